"""`calculet-load sign | verify | keygen`: the signed result bundle from the command line.

Exit codes of `verify`: 0 verified; 1 files changed, signature invalid or missing, or an
unsigned bundle without `--allow-unsigned`; 2 no bundle, a malformed bundle or a bad key.
`sign` exits 0 when the bundle is written (signed, or UNSIGNED said out loud) and 2 on a
bad key, a missing folder, or no key with `--require-key`. Light imports only: this
module is imported whenever the CLI parser is built.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from analysis.sign import VerifyResult

__all__ = [
    "add_keygen",
    "add_sign",
    "add_verify",
    "describe",
    "run_keygen",
    "run_sign",
    "run_verify",
]

_KEY_SOURCES = "--key, CALCULET_SIGNING_KEY or CALCULET_SIGNING_KEY_FILE"


def add_sign(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="run folder (local path or URI)")
    p.add_argument(
        "--key",
        metavar="FILE",
        help="Ed25519 private key, PEM (default: $CALCULET_SIGNING_KEY, "
        "then $CALCULET_SIGNING_KEY_FILE)",
    )
    p.add_argument(
        "--require-key", action="store_true", help="exit 2 instead of writing an unsigned bundle"
    )


def run_sign(args: argparse.Namespace) -> int:
    from analysis.errors import ArtifactError
    from analysis.sign import BUNDLE_NAME, load_signing_key, sign

    try:
        key = load_signing_key(args.key)
        if key is None and args.require_key:
            print(f"sign: no signing key ({_KEY_SOURCES})", file=sys.stderr)
            return 2
        result = sign(args.run_dir, key)
    except ArtifactError as exc:
        print(f"sign: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"sign: cannot read or write {args.run_dir}: {exc}", file=sys.stderr)
        return 2
    what = f"{len(result.files)} files ({result.total_bytes} bytes) -> {result.bundle}"
    if result.signed:
        print(f"signed {args.run_dir}: {what}, key {result.key_id} (from {result.key_source})")
    else:
        print(f"UNSIGNED {args.run_dir}: {what}, no signing key")
        print(
            f"sign: UNSIGNED: no signing key ({_KEY_SOURCES}); `verify` will fail on this "
            f"{BUNDLE_NAME} unless given --allow-unsigned",
            file=sys.stderr,
        )
    return 0


def add_verify(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="run folder (local path or URI)")
    p.add_argument(
        "--pubkey",
        metavar="FILE",
        help="trusted Ed25519 public key, PEM or ssh-ed25519 (default: "
        "$CALCULET_VERIFY_KEY_FILE; without one, the key embedded in the bundle is used "
        "and reported as self-asserted)",
    )
    p.add_argument(
        "--allow-unsigned",
        action="store_true",
        help="exit 0 for an unsigned bundle whose files are unchanged",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def run_verify(args: argparse.Namespace) -> int:
    from analysis.errors import ArtifactError
    from analysis.sign import load_verify_key, verify

    try:
        result = verify(args.run_dir, load_verify_key(args.pubkey))
    except ArtifactError as exc:
        print(f"verify: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"verify: cannot read {args.run_dir}: {exc}", file=sys.stderr)
        return 2
    code = result.exit_code(allow_unsigned=args.allow_unsigned)
    if args.json:
        print(json.dumps({**result.to_dict(), "exit_code": code}, indent=2))
    else:
        print("\n".join(describe(result, allow_unsigned=args.allow_unsigned)))
    return code


def describe(r: VerifyResult, *, allow_unsigned: bool = False) -> list[str]:
    """The human report of a verification: a status line, then one line per finding."""
    from analysis.sign import SignatureStatus as S

    code = r.exit_code(allow_unsigned=allow_unsigned)
    if r.signature is S.UNSIGNED and r.files_unchanged and not r.key_trusted:
        head = "UNSIGNED (allowed)" if code == 0 else "UNSIGNED"
    else:
        head = "VERIFIED" if code == 0 else "FAILED"
    lines = [
        f"{r.run_dir}: {head}",
        f"  run: {r.run_id}, bundle written {r.created} by calculet-load {r.tool_version}",
    ]
    for m in r.modified:
        lines.append(
            f"  modified: {m.name}: expected sha256 {m.expected_sha256} ({m.expected_size} "
            f"bytes), found sha256 {m.actual_sha256} ({m.actual_size} bytes)"
        )
    for f in r.missing:
        lines.append(f"  missing: {f.name}: expected sha256 {f.sha256} ({f.size} bytes)")
    for f in r.added:
        lines.append(f"  added: {f.name}: sha256 {f.sha256} ({f.size} bytes), not in the bundle")
    changed = len(r.modified) + len(r.missing)
    lines.append(
        f"  files: {r.files} listed, all unchanged"
        if r.files_unchanged
        else f"  files: {r.files} listed, {r.files - changed} unchanged, {len(r.modified)} "
        f"modified, {len(r.missing)} missing, {len(r.added)} added"
    )
    lines.append("  signature: " + _signature_line(r, allow_unsigned))
    return lines


def _signature_line(r: VerifyResult, allow_unsigned: bool) -> str:
    from analysis.sign import SignatureStatus as S

    if r.signature is S.VALID:
        if r.key_trusted:
            return f"valid, trusted key {r.key_id}"
        return (
            f"valid, but the key is self-asserted (embedded in the bundle): {r.key_id}; "
            "pass --pubkey or set CALCULET_VERIFY_KEY_FILE to check it against a key you trust"
        )
    if r.signature is S.INVALID:
        if r.key_trusted and r.signed_by and r.signed_by != r.key_id:
            return f"INVALID: the bundle names key {r.signed_by}, not the trusted key {r.key_id}"
        where = "the trusted key" if r.key_trusted else "the key embedded in the bundle"
        return (
            f"INVALID: does not verify under {where} ({r.key_id}); the bundle was altered "
            "after signing"
        )
    if r.signature is S.MISSING:
        return (
            f"MISSING: the statement says it was signed by {r.signed_by}, but the envelope "
            "carries no signature"
        )
    if r.key_trusted:
        return f"UNSIGNED: no signature, but a trusted key was given ({r.key_id})"
    if allow_unsigned:
        return "UNSIGNED: written without a signing key; hashes checked only (--allow-unsigned)"
    return (
        "UNSIGNED: written without a signing key; hashes checked only, pass --allow-unsigned "
        "to accept an unsigned bundle"
    )


def add_keygen(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--out",
        metavar="FILE",
        required=True,
        help="private key file to create (mode 0600); the public key goes to FILE.pub",
    )


def run_keygen(args: argparse.Namespace) -> int:
    from analysis.sign import generate_keypair

    try:
        kid = generate_keypair(args.out)
    except FileExistsError:
        print("keygen: the --out file or its .pub exists already; not overwritten", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"keygen: cannot write the key: {exc.strerror}", file=sys.stderr)
        return 2
    print(f"keygen: new Ed25519 key {kid}; public key {args.out}.pub")
    return 0
