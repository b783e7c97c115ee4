# size: the signed bundle (DSSE envelope, in-toto statement, keys, verification) as one
"""Signed result bundles: every file of a run folder, hashed into one signed statement.

`sign()` writes `bundle.intoto.json` into the run folder: an in-toto Statement v1 whose
subjects are the run's files (relative path, sha256, size), carried in a DSSE envelope
signed with Ed25519 over `PAE(payloadType, payload)`. `verify()` recomputes every hash
and checks the signature. Both read through pyarrow.fs, so a run folder may be a local
path or an object-store URI, and hash in fixed-size chunks, never a whole file at once.

The private key never enters the bundle, an error message or a log line: messages name
where a key came from (`--key`, an environment variable), never its path or content.
Formats: docs/signing.md; background: research/stats.md §6.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import json
import os
import re
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

import pyarrow.fs as pafs
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from analysis.errors import ArtifactError
from calculet_load import __version__
from calculet_load.clock import Clock, SystemClock
from calculet_load.schema.fs import resolve_fs

__all__ = [
    "BUNDLE_NAME",
    "ENV_SIGNING_KEY",
    "ENV_SIGNING_KEY_FILE",
    "ENV_VERIFY_KEY_FILE",
    "PAYLOAD_TYPE",
    "PREDICATE_TYPE",
    "STATEMENT_TYPE",
    "BundleError",
    "FileDigest",
    "Modified",
    "SignResult",
    "SignatureStatus",
    "SigningKey",
    "SigningKeyError",
    "VerifyResult",
    "generate_keypair",
    "hash_files",
    "key_id",
    "load_signing_key",
    "load_verify_key",
    "pae",
    "sign",
    "sign_run",
    "verify",
]

BUNDLE_NAME = "bundle.intoto.json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://calculet.dev/result-bundle/v1"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
ENV_SIGNING_KEY = "CALCULET_SIGNING_KEY"
ENV_SIGNING_KEY_FILE = "CALCULET_SIGNING_KEY_FILE"
ENV_VERIFY_KEY_FILE = "CALCULET_VERIFY_KEY_FILE"
TMP_SUFFIX = ".tmp"
CHUNK_BYTES = 1 << 20
_PREDICATE_VERSION = re.compile(r"^https://calculet\.dev/result-bundle/v(\d+)$")
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
_PRIVATE_PEM = re.compile(rb"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----")


class BundleError(ArtifactError):
    """No bundle, an unreadable run folder, or a bundle that is not ours to read (exit 2)."""


class SigningKeyError(ArtifactError):
    """A key that cannot be used; the message names its source, never a private path."""


@dataclasses.dataclass(frozen=True, slots=True)
class FileDigest:
    """One run-folder file: path relative to the folder ('/'-separated), sha256, bytes."""

    name: str
    sha256: str
    size: int

    def subject(self) -> dict[str, Any]:
        """The in-toto ResourceDescriptor; the size rides in `annotations`."""
        return {
            "name": self.name,
            "digest": {"sha256": self.sha256},
            "annotations": {"size": self.size},
        }


@dataclasses.dataclass(frozen=True, slots=True)
class SigningKey:
    """A private key and where it came from (`--key`, or an environment variable name)."""

    private: Ed25519PrivateKey = dataclasses.field(repr=False)
    source: str

    @property
    def key_id(self) -> str:
        return key_id(self.private.public_key())


@dataclasses.dataclass(frozen=True, slots=True)
class SignResult:
    bundle: str
    run_id: str
    files: tuple[FileDigest, ...]
    key_id: str | None
    key_source: str | None
    envelope: dict[str, Any]

    @property
    def signed(self) -> bool:
        return self.key_id is not None

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


class SignatureStatus(StrEnum):
    VALID = "valid"
    INVALID = "invalid"
    UNSIGNED = "unsigned"  # written without a key, and the statement says so
    MISSING = "missing"  # the statement says signed, the envelope carries no signature


@dataclasses.dataclass(frozen=True, slots=True)
class Modified:
    name: str
    expected_sha256: str
    actual_sha256: str
    expected_size: int
    actual_size: int


@dataclasses.dataclass(frozen=True, slots=True)
class VerifyResult:
    """What `verify` found. `ok` only when no file changed and the signature is valid."""

    run_dir: str
    run_id: str
    created: str
    tool_version: str
    files: int  # subjects listed in the bundle
    modified: tuple[Modified, ...]
    missing: tuple[FileDigest, ...]  # as listed in the bundle
    added: tuple[FileDigest, ...]  # as found now
    signature: SignatureStatus
    key_id: str | None  # the key the signature was checked with (or claimed, if none)
    key_trusted: bool  # checked against a key given by the verifier, not the embedded one
    signed_by: str | None  # the key id the statement names

    @property
    def files_unchanged(self) -> bool:
        return not (self.modified or self.missing or self.added)

    @property
    def ok(self) -> bool:
        return self.files_unchanged and self.signature is SignatureStatus.VALID

    def exit_code(self, *, allow_unsigned: bool = False) -> int:
        """0 verified; 1 files changed, signature invalid or missing, or unsigned (unless
        allowed and no trusted key was given: a trusted key demands a signature)."""
        if not self.files_unchanged:
            return 1
        if self.signature is SignatureStatus.VALID:
            return 0
        unsigned_ok = allow_unsigned and not self.key_trusted
        return 0 if self.signature is SignatureStatus.UNSIGNED and unsigned_ok else 1

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["ok"] = self.ok
        return d


def pae(payload_type: str, body: bytes) -> bytes:
    """DSSE pre-authentication encoding: `"DSSEv1" SP LEN(type) SP type SP LEN(body) SP
    body`, LEN the ASCII decimal byte length. This, not the payload alone, is signed."""
    t = payload_type.encode()
    return b"DSSEv1 %d %b %d %b" % (len(t), t, len(body), body)


def key_id(public: Ed25519PublicKey) -> str:
    """`sha256:` + hex sha256 of the raw 32-byte public key (the bundle's keyid and the
    fingerprint verify prints)."""
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def _public_pem(public: Ed25519PublicKey) -> str:
    return public.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode()


# --- keys ------------------------------------------------------------------------------
def generate_keypair(out: str) -> str:
    """Write a new Ed25519 key: `out` (PKCS#8 PEM, mode 0600, never overwritten) and
    `out.pub` (SubjectPublicKeyInfo PEM). Returns the key id."""
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    if os.path.exists(out + ".pub"):
        raise FileExistsError(out + ".pub")
    # O_EXCL + 0600 at creation: the key is never readable by others, not even briefly.
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(pem)
    with open(out + ".pub", "x", encoding="ascii") as f:
        f.write(_public_pem(key.public_key()))
    return key_id(key.public_key())


def load_signing_key(
    path: str | None = None, environ: Mapping[str, str] | None = None
) -> SigningKey | None:
    """The signing key from `path` (`--key`), else `$CALCULET_SIGNING_KEY` (PEM text), else
    `$CALCULET_SIGNING_KEY_FILE`; None when none is set."""
    env = os.environ if environ is None else environ
    if path:
        source, data = "--key", _read_key_file(path, "signing key (--key)")
    elif env.get(ENV_SIGNING_KEY):
        source, data = ENV_SIGNING_KEY, env[ENV_SIGNING_KEY].encode()
    elif env.get(ENV_SIGNING_KEY_FILE):
        source = ENV_SIGNING_KEY_FILE
        data = _read_key_file(env[ENV_SIGNING_KEY_FILE], f"signing key ({source})")
    else:
        return None
    where = f"signing key ({source})"
    try:
        if data.lstrip().startswith(b"-----BEGIN OPENSSH PRIVATE KEY-----"):
            key: object = serialization.load_ssh_private_key(data, password=None)
        else:
            key = serialization.load_pem_private_key(data, password=None)
    except TypeError:  # cryptography's word for "encrypted, and no password given"
        raise SigningKeyError(f"{where}: the key is encrypted; give an unencrypted one") from None
    except (ValueError, UnsupportedAlgorithm):
        raise SigningKeyError(f"{where}: not a PEM private key") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise SigningKeyError(f"{where}: not an Ed25519 key ({type(key).__name__})")
    return SigningKey(key, source)


def load_verify_key(
    path: str | None = None, environ: Mapping[str, str] | None = None
) -> Ed25519PublicKey | None:
    """The trusted public key from `path` (`--pubkey`) or `$CALCULET_VERIFY_KEY_FILE`: PEM
    or an OpenSSH `ssh-ed25519` line. None when neither is set."""
    env = os.environ if environ is None else environ
    source = "--pubkey" if path else ENV_VERIFY_KEY_FILE
    path = path or env.get(ENV_VERIFY_KEY_FILE) or None
    if path is None:
        return None
    where = f"public key {path} ({source})"  # a public key's path is not a secret
    data = _read_key_file(path, where)
    try:
        if data.lstrip().startswith(b"ssh-"):
            key: object = serialization.load_ssh_public_key(data.strip())
        else:
            key = serialization.load_pem_public_key(data)
    except (ValueError, UnsupportedAlgorithm):
        raise SigningKeyError(f"{where}: not a PEM public key") from None
    if not isinstance(key, Ed25519PublicKey):
        raise SigningKeyError(f"{where}: not an Ed25519 key ({type(key).__name__})")
    return key


def _read_key_file(path: str, where: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise SigningKeyError(f"{where}: cannot read the key file ({exc.strerror})") from None


# --- hashing ---------------------------------------------------------------------------
def _open_dir(run_dir: str, filesystem: pafs.FileSystem | None) -> tuple[pafs.FileSystem, str]:
    try:
        fs, root = (filesystem, run_dir) if filesystem is not None else resolve_fs(run_dir)
    except ValueError as exc:  # pyarrow's ArrowInvalid: an unknown scheme, a bad URI
        raise BundleError(f"{run_dir}: {exc}") from None
    root = root.rstrip("/")
    if fs.get_file_info(root).type != pafs.FileType.Directory:
        raise BundleError(f"{run_dir}: no such run folder")
    return fs, root


def _hash_file(fs: pafs.FileSystem, path: str) -> tuple[str, int, bool]:
    """sha256, size, and whether the file starts like a PEM private key."""
    h = hashlib.sha256()
    size = 0
    looks_private = False
    with fs.open_input_stream(path) as f:
        while chunk := f.read(CHUNK_BYTES):
            if size == 0:
                looks_private = bool(_PRIVATE_PEM.match(chunk[:256].lstrip()))
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size, looks_private


def _scan(fs: pafs.FileSystem, root: str) -> list[tuple[FileDigest, bool]]:
    infos = fs.get_file_info(pafs.FileSelector(root, recursive=True))
    out = []
    for info in infos:
        if info.type != pafs.FileType.File or info.base_name.endswith(TMP_SUFFIX):
            continue
        name = info.path[len(root) + 1 :]
        if name == BUNDLE_NAME:
            continue
        digest, size, looks_private = _hash_file(fs, info.path)
        out.append((FileDigest(name, digest, size), looks_private))
    return sorted(out, key=lambda item: item[0].name)


def hash_files(run_dir: str, *, filesystem: pafs.FileSystem | None = None) -> list[FileDigest]:
    """Every file of the run folder, sorted by relative path, except the bundle itself and
    `*.tmp` files (parts being written)."""
    fs, root = _open_dir(run_dir, filesystem)
    return [fd for fd, _ in _scan(fs, root)]


# --- signing ---------------------------------------------------------------------------
def sign(
    run_dir: str,
    key: SigningKey | None = None,
    *,
    clock: Clock | None = None,
    filesystem: pafs.FileSystem | None = None,
) -> SignResult:
    """Hash the run folder and write `bundle.intoto.json` (replacing an older one). With
    no key the envelope has no signatures and the predicate says `"signed": false`."""
    fs, root = _open_dir(run_dir, filesystem)
    scanned = _scan(fs, root)
    for fd, looks_private in scanned:
        if looks_private:
            raise BundleError(
                f"{run_dir}: {fd.name} looks like a private key; move it out of the run "
                "folder before signing (everything in the folder is listed in the bundle)"
            )
    files = tuple(fd for fd, _ in scanned)
    wall_s = (clock or SystemClock()).wall_ns() // 1_000_000_000
    run_id = _run_id(fs, root)
    public = key.private.public_key() if key else None
    statement = {
        "_type": STATEMENT_TYPE,
        "subject": [f.subject() for f in files],
        "predicateType": PREDICATE_TYPE,
        "predicate": {
            "run_id": run_id,
            "created": datetime.fromtimestamp(wall_s, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "tool": {"name": "calculet-load", "version": __version__},
            "signed": key is not None,
            "key_id": key_id(public) if public else None,
            "public_key": _public_pem(public) if public else None,
            "files": len(files),
            "total_bytes": sum(f.size for f in files),
            "excluded": [BUNDLE_NAME, "*" + TMP_SUFFIX],
        },
    }
    # Sorted keys and compact separators make the payload reproducible; DSSE signs the
    # exact bytes, so a reader never re-serializes it.
    payload = json.dumps(statement, sort_keys=True, separators=(",", ":")).encode()
    signatures = []
    if key is not None:
        sig = key.private.sign(pae(PAYLOAD_TYPE, payload))
        signatures.append({"keyid": key.key_id, "sig": base64.b64encode(sig).decode()})
    envelope = {
        "payloadType": PAYLOAD_TYPE,
        "payload": base64.b64encode(payload).decode(),
        "signatures": signatures,
    }
    final = f"{root}/{BUNDLE_NAME}"
    with fs.open_output_stream(final + TMP_SUFFIX) as f:
        f.write((json.dumps(envelope, indent=2) + "\n").encode())
    fs.move(final + TMP_SUFFIX, final)
    return SignResult(
        bundle=f"{run_dir.rstrip('/')}/{BUNDLE_NAME}",
        run_id=run_id,
        files=files,
        key_id=key.key_id if key else None,
        key_source=key.source if key else None,
        envelope=envelope,
    )


def sign_run(run_dir: str, environ: Mapping[str, str] | None = None) -> SignResult:
    """The pipeline's last step: sign with the key from the environment, and say UNSIGNED
    on stderr when there is none. Nothing may be written to the folder after this."""
    result = sign(run_dir, load_signing_key(None, environ))
    if not result.signed:
        print(
            f"sign: UNSIGNED: {result.bundle} written without a signing key "
            f"(set {ENV_SIGNING_KEY} or {ENV_SIGNING_KEY_FILE})",
            file=sys.stderr,
        )
    return result


def _run_id(fs: pafs.FileSystem, root: str) -> str:
    """The manifest's run id, else the folder's name (signing does not validate)."""
    import yaml

    try:
        with fs.open_input_stream(f"{root}/manifest.yaml") as f:
            doc = yaml.safe_load(f.read())
    except (OSError, yaml.YAMLError):
        doc = None
    run_id = doc.get("run_id") if isinstance(doc, dict) else None
    return run_id if isinstance(run_id, str) else root.rsplit("/", 1)[-1]


# --- verifying -------------------------------------------------------------------------
def verify(
    run_dir: str,
    pubkey: Ed25519PublicKey | None = None,
    *,
    filesystem: pafs.FileSystem | None = None,
) -> VerifyResult:
    """Recompute every hash and check the signature, against `pubkey` when given (trusted)
    or else the key embedded in the bundle (self-asserted). Raises BundleError when the
    bundle is absent or malformed."""
    fs, root = _open_dir(run_dir, filesystem)
    try:
        with fs.open_input_stream(f"{root}/{BUNDLE_NAME}") as f:
            raw = f.read()
    except FileNotFoundError:
        raise BundleError(
            f"{run_dir}: no {BUNDLE_NAME}; sign the run first (calculet-load sign)"
        ) from None
    payload, sigs = _parse_envelope(raw)
    subjects, predicate = _parse_statement(payload)
    status, checked_with = _check_signature(payload, sigs, predicate, pubkey)

    now = {fd.name: fd for fd, _ in _scan(fs, root)}
    tool = predicate.get("tool")
    modified, missing = [], []
    for name, (digest, size) in subjects.items():
        current = now.get(name)
        if current is None:
            missing.append(FileDigest(name, digest, size))
        elif current.sha256 != digest:
            modified.append(Modified(name, digest, current.sha256, size, current.size))
    return VerifyResult(
        run_dir=run_dir,
        run_id=predicate["run_id"],
        created=str(predicate.get("created", "")),
        tool_version=str(tool.get("version", "")) if isinstance(tool, dict) else "",
        files=len(subjects),
        modified=tuple(modified),
        missing=tuple(missing),
        added=tuple(fd for name, fd in now.items() if name not in subjects),
        signature=status,
        key_id=checked_with,
        key_trusted=pubkey is not None,
        signed_by=predicate.get("key_id"),
    )


def _malformed(what: str) -> BundleError:
    return BundleError(f"{BUNDLE_NAME}: malformed: {what}")


def _b64(value: object, field: str) -> bytes:
    if not isinstance(value, str):
        raise _malformed(f"{field} is not a string")
    try:  # DSSE readers accept standard and URL-safe base64
        if "-" in value or "_" in value:
            return base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise _malformed(f"{field} is not base64") from None


def _parse_envelope(raw: bytes) -> tuple[bytes, list[bytes]]:
    try:
        env = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise _malformed("not JSON") from None
    if not isinstance(env, dict):
        raise _malformed("not a DSSE envelope (a JSON object)")
    if env.get("payloadType") != PAYLOAD_TYPE:
        raise _malformed(f"payloadType {env.get('payloadType')!r}, expected {PAYLOAD_TYPE!r}")
    sigs = env.get("signatures")
    if not isinstance(sigs, list) or not all(isinstance(s, dict) for s in sigs):
        raise _malformed("signatures is not a list of objects")
    return _b64(env.get("payload"), "payload"), [
        _b64(s.get("sig"), f"signatures[{i}].sig") for i, s in enumerate(sigs)
    ]


def _parse_statement(payload: bytes) -> tuple[dict[str, tuple[str, int]], dict[str, Any]]:
    try:
        st = json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        raise _malformed("payload is not JSON") from None
    if not isinstance(st, dict) or st.get("_type") != STATEMENT_TYPE:
        raise _malformed(f"payload is not an in-toto statement ({STATEMENT_TYPE})")
    ptype = st.get("predicateType")
    if ptype != PREDICATE_TYPE:
        m = _PREDICATE_VERSION.match(str(ptype))
        if m and int(m.group(1)) > 1:
            raise BundleError(
                f"{BUNDLE_NAME}: predicateType {ptype} is newer than this calculet-load "
                f"reads ({PREDICATE_TYPE}); upgrade calculet-load"
            )
        raise _malformed(f"predicateType {ptype!r}, expected {PREDICATE_TYPE!r}")
    pred = st.get("predicate")
    if not (
        isinstance(pred, dict)
        and isinstance(pred.get("run_id"), str)
        and isinstance(pred.get("signed"), bool)
        and isinstance(pred.get("public_key"), str | None)
    ):
        raise _malformed("predicate lacks run_id, signed or public_key")
    subjects: dict[str, tuple[str, int]] = {}
    listed = st.get("subject")
    for i, s in enumerate(listed if isinstance(listed, list) else [None]):
        ok = isinstance(s, dict) and isinstance(s.get("digest"), dict)
        ok = ok and isinstance(s.get("annotations"), dict)
        name, digest, size = (
            (s.get("name"), s["digest"].get("sha256"), s["annotations"].get("size"))
            if ok
            else (None, None, None)
        )
        if not (isinstance(name, str) and _SHA256_HEX.match(str(digest))) or name in subjects:
            raise _malformed(f"subject[{i}] needs a unique name and a sha256 digest")
        if not isinstance(size, int):
            raise _malformed(f"subject[{i}] ({name}) has no size annotation")
        subjects[name] = (str(digest), size)
    return subjects, pred


def _check_signature(
    payload: bytes,
    sigs: list[bytes],
    predicate: dict[str, Any],
    trusted: Ed25519PublicKey | None,
) -> tuple[SignatureStatus, str | None]:
    """The status and the id of the key it was checked with (the claimed one if none)."""
    claimed = predicate.get("key_id")
    if not sigs:
        if predicate["signed"]:
            return SignatureStatus.MISSING, claimed
        return SignatureStatus.UNSIGNED, key_id(trusted) if trusted else None
    if not predicate["signed"]:
        raise _malformed("the statement says unsigned but the envelope carries signatures")
    key = trusted
    if key is None:
        try:
            embedded = serialization.load_pem_public_key(str(predicate["public_key"]).encode())
        except (ValueError, UnsupportedAlgorithm):
            raise _malformed("predicate.public_key is not a PEM public key") from None
        if not isinstance(embedded, Ed25519PublicKey):
            raise _malformed("predicate.public_key is not an Ed25519 key")
        key = embedded
    message = pae(PAYLOAD_TYPE, payload)
    for sig in sigs:  # keyid is an unauthenticated hint: try each signature
        try:
            key.verify(sig, message)
        except InvalidSignature:
            continue
        return SignatureStatus.VALID, key_id(key)
    return SignatureStatus.INVALID, key_id(key)
