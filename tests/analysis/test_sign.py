"""Signed result bundles: the DSSE/in-toto shape, sign → verify on a real run folder, each
way of tampering with its exact report and exit code, unsigned runs, keys from the
environment, keygen, URIs and chunked hashing."""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from analysis import sign, signcli
from analysis.sign import BUNDLE_NAME, SignatureStatus
from calculet_load.clock import FakeClock

REPO = Path(__file__).resolve().parents[2]
PARQUET = "client/w00/part-00000.requests.parquet"
FILES = [
    PARQUET,
    "client/w00/part-00000.tokens.parquet",
    "manifest.yaml",
    "plan.json",
    "report.html",
    "server/server_events.jsonl",
    "server/steps.jsonl",
    "verdict.json",
]
CREATED = "2023-11-14T22:13:20Z"  # FakeClock's wall 1_700_000_000 s


@pytest.fixture(autouse=True)
def _no_key_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (sign.ENV_SIGNING_KEY, sign.ENV_SIGNING_KEY_FILE, sign.ENV_VERIFY_KEY_FILE):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A run folder laid out as DESIGN §3.4, with real Parquet parts and a part being
    written (`.tmp`, never listed)."""
    d = tmp_path / "runs" / "r1"
    (d / "client" / "w00").mkdir(parents=True)
    (d / "server").mkdir()
    table = pa.table({"request_id": [f"r{i}" for i in range(200)], "ttft_ns": list(range(200))})
    pq.write_table(table, d / PARQUET)
    pq.write_table(pa.table({"index": [0, 1, 2]}), d / "client/w00/part-00000.tokens.parquet")
    (d / "client/w00/.part-00001.requests.parquet.tmp").write_bytes(b"half a part")
    shutil.copy(REPO / "configs/manifest.sim.yaml", d / "manifest.yaml")
    (d / "plan.json").write_text('{"cells": []}\n')
    (d / "server/server_events.jsonl").write_text('{"event": "accepted"}\n')
    (d / "server/steps.jsonl").write_text('{"step_index": 0}\n')
    (d / "verdict.json").write_text('{"exit_code": 0}\n')
    (d / "report.html").write_text("<!doctype html><title>r1</title>\n")
    return d


@pytest.fixture
def keys(tmp_path: Path) -> Callable[[str], Path]:
    """`keys(name)` makes a key pair outside the run folder; returns the private key file."""

    def make(name: str) -> Path:
        (tmp_path / "keys").mkdir(exist_ok=True)
        path = tmp_path / "keys" / name
        sign.generate_keypair(str(path))
        return path

    return make


def cli(command: str, *argv: str) -> int:
    """One signing subcommand, through the same add/run pair the COMMANDS table names."""
    add, run_fn = {
        "sign": (signcli.add_sign, signcli.run_sign),
        "verify": (signcli.add_verify, signcli.run_verify),
        "keygen": (signcli.add_keygen, signcli.run_keygen),
    }[command]
    p = argparse.ArgumentParser(prog=command)
    add(p)
    return run_fn(p.parse_args(argv))


def key_of(private: Path) -> str:
    pub = serialization.load_pem_public_key((Path(f"{private}.pub")).read_bytes())
    assert isinstance(pub, Ed25519PublicKey)
    return sign.key_id(pub)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def envelope(run: Path) -> dict[str, Any]:
    return dict(json.loads((run / BUNDLE_NAME).read_text()))


def statement(run: Path) -> dict[str, Any]:
    return dict(json.loads(base64.b64decode(envelope(run)["payload"])))


def write_envelope(run: Path, env: dict[str, Any]) -> None:
    (run / BUNDLE_NAME).write_text(json.dumps(env))


def signed(run: Path, key: Path) -> sign.SignResult:
    return sign.sign(str(run), sign.load_signing_key(str(key)), clock=FakeClock())


# --- shape -------------------------------------------------------------------------------
def test_pae_reproduces_the_dsse_spec_example_and_counts_bytes() -> None:
    # protocol.md: "DSSEv1" SP 29 SP type SP 11 SP body
    assert sign.pae("http://example.com/HelloWorld", b"hello world") == (
        b"DSSEv1 29 http://example.com/HelloWorld 11 hello world"
    )
    # LEN is the UTF-8 byte length: "t/é" is 4 bytes; an empty body is "0 " and nothing.
    assert sign.pae("t/é", b"") == b"DSSEv1 4 t/\xc3\xa9 0 "


def test_bundle_is_an_in_toto_statement_in_a_dsse_envelope(
    run: Path, keys: Callable[[str], Path]
) -> None:
    key = keys("k")
    result = signed(run, key)
    env = envelope(run)
    assert sorted(env) == ["payload", "payloadType", "signatures"]
    assert env["payloadType"] == "application/vnd.in-toto+json"
    assert [sorted(s) for s in env["signatures"]] == [["keyid", "sig"]]
    assert env["signatures"][0]["keyid"] == key_of(key) == result.key_id
    st = statement(run)
    assert st["_type"] == "https://in-toto.io/Statement/v1"
    assert st["predicateType"] == "https://calculet.dev/result-bundle/v1"
    # every file, sorted, relative; neither the bundle nor the `.tmp` part
    assert st["subject"] == [
        {
            "name": name,
            "digest": {"sha256": sha(run / name)},
            "annotations": {"size": (run / name).stat().st_size},
        }
        for name in FILES
    ]
    pred = st["predicate"]
    assert pred["run_id"] == "sim-rehearsal-001"  # from manifest.yaml, not the folder name
    assert pred["created"] == CREATED
    assert pred["tool"] == {"name": "calculet-load", "version": "0.1.0"}
    assert (pred["signed"], pred["key_id"], pred["files"]) == (True, key_of(key), len(FILES))
    assert pred["total_bytes"] == sum((run / n).stat().st_size for n in FILES)
    # The signature is over PAE built by hand (28 = len("application/vnd.in-toto+json")),
    # and checks with the public key the keygen wrote.
    payload = base64.b64decode(env["payload"])
    pae = b"DSSEv1 28 application/vnd.in-toto+json %d " % len(payload) + payload
    pub = serialization.load_pem_public_key(Path(f"{key}.pub").read_bytes())
    assert isinstance(pub, Ed25519PublicKey)
    pub.verify(base64.b64decode(env["signatures"][0]["sig"]), pae)  # raises when wrong
    assert pred["public_key"] == Path(f"{key}.pub").read_text()
    # the private key and its path appear nowhere in the bundle
    text = (run / BUNDLE_NAME).read_text() + payload.decode()
    assert str(key) not in text and "keys" not in text and "PRIVATE" not in text


def test_public_names_are_pinned() -> None:
    assert sign.__all__ == [
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
    assert all(hasattr(sign, n) for n in sign.__all__)


def test_commands_are_registered_and_the_cli_module_imports_light() -> None:
    from calculet_drivers.cli import COMMANDS

    assert {n: COMMANDS[n] for n in ("sign", "verify", "keygen")} == {
        "sign": ("analysis.signcli", COMMANDS["sign"][1], "add_sign", "run_sign"),
        "verify": ("analysis.signcli", COMMANDS["verify"][1], "add_verify", "run_verify"),
        "keygen": ("analysis.signcli", COMMANDS["keygen"][1], "add_keygen", "run_keygen"),
    }
    code = (
        "import sys, analysis.signcli\n"
        "heavy = [m for m in ('cryptography', 'pyarrow', 'yaml') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# --- sign → verify -----------------------------------------------------------------------
def test_sign_then_verify_with_a_trusted_key(
    run: Path, keys: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    key = keys("k")
    assert cli("sign", str(run), "--key", str(key)) == 0
    out, err = capsys.readouterr()
    total = sum((run / n).stat().st_size for n in FILES)
    assert out == (
        f"signed {run}: 8 files ({total} bytes) -> {run}/{BUNDLE_NAME}, key {key_of(key)} "
        "(from --key)\n"
    )
    assert err == "" and str(key) not in out
    assert cli("verify", str(run), "--pubkey", f"{key}.pub") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{run}: VERIFIED"
    assert lines[1].startswith("  run: sim-rehearsal-001, bundle written 20")
    assert lines[2:] == [
        "  files: 8 listed, all unchanged",
        f"  signature: valid, trusted key {key_of(key)}",
    ]


def test_without_a_trusted_key_the_embedded_key_is_named_as_self_asserted(
    run: Path, keys: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    key = keys("k")
    signed(run, key)
    assert cli("verify", str(run)) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"  signature: valid, but the key is self-asserted (embedded in the bundle): "
        f"{key_of(key)}; pass --pubkey or set CALCULET_VERIFY_KEY_FILE to check it against "
        "a key you trust"
    )
    r = sign.verify(str(run))
    assert (r.ok, r.signature, r.key_trusted, r.files) == (True, SignatureStatus.VALID, False, 8)


def test_re_signing_replaces_the_bundle(run: Path, keys: Callable[[str], Path]) -> None:
    signed(run, keys("k"))
    (run / "notes.txt").write_text("added before the second signature\n")
    signed(run, keys("k2"))
    assert sign.verify(str(run)).ok
    assert "notes.txt" in [s["name"] for s in statement(run)["subject"]]


# --- tampering ---------------------------------------------------------------------------
def test_one_flipped_byte_in_a_parquet_part_is_named_with_both_digests(
    run: Path, keys: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    key = keys("k")
    signed(run, key)
    part = run / PARQUET
    before, size = sha(part), part.stat().st_size
    data = bytearray(part.read_bytes())
    data[size // 2] ^= 0x01
    part.write_bytes(bytes(data))
    assert cli("verify", str(run), "--pubkey", f"{key}.pub") == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{run}: FAILED"
    assert lines[2:] == [
        f"  modified: {PARQUET}: expected sha256 {before} ({size} bytes), "
        f"found sha256 {sha(part)} ({size} bytes)",
        "  files: 8 listed, 7 unchanged, 1 modified, 0 missing, 0 added",
        f"  signature: valid, trusted key {key_of(key)}",
    ]


def test_a_deleted_file_is_missing(
    run: Path, keys: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    signed(run, keys("k"))
    digest, size = sha(run / "server/steps.jsonl"), (run / "server/steps.jsonl").stat().st_size
    (run / "server/steps.jsonl").unlink()
    assert cli("verify", str(run)) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[2:4] == [
        f"  missing: server/steps.jsonl: expected sha256 {digest} ({size} bytes)",
        "  files: 8 listed, 7 unchanged, 0 modified, 1 missing, 0 added",
    ]


def test_an_added_file_is_named_but_tmp_files_are_not(
    run: Path, keys: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    signed(run, keys("k"))
    (run / "server/extra.jsonl").write_text("{}\n")
    (run / "client/w00/.part-00002.tokens.parquet.tmp").write_text("being written")
    assert cli("verify", str(run)) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[2:4] == [
        f"  added: server/extra.jsonl: sha256 {sha(run / 'server/extra.jsonl')} (3 bytes), "
        "not in the bundle",
        "  files: 8 listed, 8 unchanged, 0 modified, 0 missing, 1 added",
    ]


@pytest.mark.parametrize("trusted", [True, False])
def test_an_altered_payload_breaks_the_signature(
    run: Path, keys: Callable[[str], Path], capsys: pytest.CaptureFixture[str], trusted: bool
) -> None:
    key = keys("k")
    signed(run, key)
    # A forger hides a modified part by rewriting its digest in the statement.
    (run / "plan.json").write_text('{"cells": ["forged"]}\n')
    st = statement(run)
    for s in st["subject"]:
        if s["name"] == "plan.json":
            s["digest"]["sha256"] = sha(run / "plan.json")
            s["annotations"]["size"] = (run / "plan.json").stat().st_size
    env = envelope(run)
    env["payload"] = base64.b64encode(json.dumps(st).encode()).decode()
    write_envelope(run, env)
    args = ["--pubkey", f"{key}.pub"] if trusted else []
    assert cli("verify", str(run), *args) == 1
    lines = capsys.readouterr().out.splitlines()
    where = "the trusted key" if trusted else "the key embedded in the bundle"
    assert lines[0] == f"{run}: FAILED"
    assert lines[-2:] == [
        "  files: 8 listed, all unchanged",
        f"  signature: INVALID: does not verify under {where} ({key_of(key)}); the bundle "
        "was altered after signing",
    ]


def test_a_signature_swapped_in_from_another_bundle_is_invalid(
    run: Path, tmp_path: Path, keys: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    key = keys("k")
    other = tmp_path / "other"
    other.mkdir()
    (other / "plan.json").write_text("{}\n")
    signed(other, key)  # same key, another statement
    signed(run, key)
    env = envelope(run)
    env["signatures"] = envelope(other)["signatures"]
    write_envelope(run, env)
    assert cli("verify", str(run), "--pubkey", f"{key}.pub") == 1
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"  signature: INVALID: does not verify under the trusted key ({key_of(key)}); the "
        "bundle was altered after signing"
    )


def test_a_wrong_public_key_names_both_keys(
    run: Path, keys: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    key, wrong = keys("k"), keys("wrong")
    signed(run, key)
    assert cli("verify", str(run), "--pubkey", f"{wrong}.pub") == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{run}: FAILED"
    assert out[-1] == (
        f"  signature: INVALID: the bundle names key {key_of(key)}, not the trusted key "
        f"{key_of(wrong)}"
    )


def test_a_stripped_signature_is_missing_not_unsigned(
    run: Path, keys: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    key = keys("k")
    signed(run, key)
    env = envelope(run)
    env["signatures"] = []
    write_envelope(run, env)
    assert cli("verify", str(run), "--allow-unsigned") == 1
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"  signature: MISSING: the statement says it was signed by {key_of(key)}, but the "
        "envelope carries no signature"
    )


# --- exit 2: no bundle, malformed bundle, bad keys -----------------------------------------
def _rewrite(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda env: env.__setitem__(field, value)


def _statement_edit(edit: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def apply(env: dict[str, Any]) -> None:
        st = json.loads(base64.b64decode(env["payload"]))
        edit(st)
        env["payload"] = base64.b64encode(json.dumps(st).encode()).decode()

    return apply


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_rewrite("payloadType", "text/plain"), "payloadType 'text/plain', expected "),
        (_rewrite("payload", "not base64!"), "payload is not base64"),
        (_rewrite("signatures", {"sig": "x"}), "signatures is not a list of objects"),
        (
            _statement_edit(lambda st: st.__setitem__("_type", "x")),
            "payload is not an in-toto statement",
        ),
        (
            _statement_edit(lambda st: st["subject"][0].__setitem__("digest", {"md5": "0"})),
            "subject[0] needs a unique name and a sha256 digest",
        ),
        (
            _statement_edit(
                lambda st: st.__setitem__("predicateType", "https://calculet.dev/result-bundle/v2")
            ),
            "is newer than this calculet-load reads",
        ),
    ],
)
def test_a_malformed_bundle_exits_2_naming_what_is_wrong(
    run: Path,
    keys: Callable[[str], Path],
    capsys: pytest.CaptureFixture[str],
    edit: Callable[[dict[str, Any]], None],
    message: str,
) -> None:
    signed(run, keys("k"))
    env = envelope(run)
    edit(env)
    write_envelope(run, env)
    assert cli("verify", str(run)) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"verify: {BUNDLE_NAME}: ") and message in err


def test_no_bundle_and_no_folder_exit_2(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli("verify", str(run)) == 2
    assert capsys.readouterr().err == (
        f"verify: {run}: no {BUNDLE_NAME}; sign the run first (calculet-load sign)\n"
    )
    (run / BUNDLE_NAME).write_text("{not json")
    assert cli("verify", str(run)) == 2
    assert capsys.readouterr().err == f"verify: {BUNDLE_NAME}: malformed: not JSON\n"
    assert cli("verify", str(tmp_path / "nope")) == 2
    assert capsys.readouterr().err == f"verify: {tmp_path / 'nope'}: no such run folder\n"


def test_bad_key_files_exit_2_and_never_name_the_private_key_path(
    run: Path, keys: Callable[[str], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = keys("k")
    not_a_key = tmp_path / "secret-place" / "key.pem"
    not_a_key.parent.mkdir()
    not_a_key.write_text("hello\n")
    assert cli("sign", str(run), "--key", str(not_a_key)) == 2
    assert cli("sign", str(run), "--key", str(tmp_path / "secret-place" / "absent")) == 2
    assert cli("sign", str(run), "--key", f"{key}.pub") == 2  # a public key cannot sign
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "sign: signing key (--key): not a PEM private key",
        "sign: signing key (--key): cannot read the key file (No such file or directory)",
        "sign: signing key (--key): not a PEM private key",
    ]
    assert not (run / BUNDLE_NAME).exists()
    signed(run, key)
    assert cli("verify", str(run), "--pubkey", str(key)) == 2  # a private key is not a pubkey
    assert capsys.readouterr().err == (
        f"verify: public key {key} (--pubkey): not a PEM public key\n"
    )


def test_an_rsa_key_is_refused(run: Path, tmp_path: Path) -> None:
    from cryptography.hazmat.primitives.asymmetric import rsa

    pem = (
        rsa.generate_private_key(public_exponent=65537, key_size=1024)
        .private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        .decode()
    )
    with pytest.raises(sign.SigningKeyError, match=r"not an Ed25519 key \(.*RSAPrivateKey\)"):
        sign.load_signing_key(environ={sign.ENV_SIGNING_KEY: pem})


def test_a_private_key_inside_the_run_folder_is_refused(
    run: Path, keys: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    key = keys("k")
    shutil.copy(key, run / "oops.pem")
    assert cli("sign", str(run), "--key", str(key)) == 2
    assert "oops.pem looks like a private key; move it out" in capsys.readouterr().err
    assert not (run / BUNDLE_NAME).exists()


# --- unsigned ----------------------------------------------------------------------------
def test_an_unsigned_run_says_so_and_verify_needs_allow_unsigned(
    run: Path, keys: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli("sign", str(run)) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"UNSIGNED {run}: 8 files (") and out.endswith(", no signing key\n")
    assert err.startswith("sign: UNSIGNED: no signing key (--key, CALCULET_SIGNING_KEY or ")
    assert envelope(run)["signatures"] == []
    pred = statement(run)["predicate"]
    assert (pred["signed"], pred["key_id"], pred["public_key"]) == (False, None, None)

    assert cli("verify", str(run)) == 1
    lines = capsys.readouterr().out.splitlines()
    assert (lines[0], lines[-1]) == (
        f"{run}: UNSIGNED",
        "  signature: UNSIGNED: written without a signing key; hashes checked only, pass "
        "--allow-unsigned to accept an unsigned bundle",
    )
    assert cli("verify", str(run), "--allow-unsigned") == 0
    assert capsys.readouterr().out.splitlines()[0] == f"{run}: UNSIGNED (allowed)"
    # a trusted key demands a signature, --allow-unsigned or not
    key = keys("k")
    assert cli("verify", str(run), "--allow-unsigned", "--pubkey", f"{key}.pub") == 1
    assert capsys.readouterr().out.splitlines()[0] == f"{run}: FAILED"
    # hashes are still checked
    (run / "verdict.json").write_text('{"exit_code": 4}\n')
    assert cli("verify", str(run), "--allow-unsigned") == 1
    assert cli("sign", str(run), "--require-key") == 2
    assert capsys.readouterr().err.endswith(
        "sign: no signing key (--key, CALCULET_SIGNING_KEY or CALCULET_SIGNING_KEY_FILE)\n"
    )


def test_sign_run_reads_the_environment_and_warns_when_unsigned(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = sign.sign_run(str(run), environ={})
    assert not result.signed
    assert capsys.readouterr().err.startswith(f"sign: UNSIGNED: {run}/{BUNDLE_NAME} written")


# --- keys from the environment, keygen ------------------------------------------------------
def test_keys_from_the_environment(
    run: Path,
    keys: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    key, other = keys("k"), keys("other")
    monkeypatch.setenv(sign.ENV_SIGNING_KEY_FILE, str(other))
    monkeypatch.setenv(sign.ENV_SIGNING_KEY, key.read_text())  # PEM text wins over the file
    assert cli("sign", str(run)) == 0
    out = capsys.readouterr().out
    assert out.endswith(f"key {key_of(key)} (from CALCULET_SIGNING_KEY)\n")
    assert "PRIVATE" not in out
    monkeypatch.delenv(sign.ENV_SIGNING_KEY)
    assert cli("sign", str(run)) == 0
    out = capsys.readouterr().out
    assert out.endswith(f"key {key_of(other)} (from CALCULET_SIGNING_KEY_FILE)\n")
    assert str(other) not in out
    assert cli("sign", str(run), "--key", str(key)) == 0  # the flag wins over both
    assert capsys.readouterr().out.endswith(f"key {key_of(key)} (from --key)\n")

    monkeypatch.setenv(sign.ENV_VERIFY_KEY_FILE, f"{key}.pub")
    assert cli("verify", str(run)) == 0
    assert (
        capsys.readouterr().out.splitlines()[-1] == f"  signature: valid, trusted key {key_of(key)}"
    )
    monkeypatch.setenv(sign.ENV_VERIFY_KEY_FILE, f"{other}.pub")
    assert cli("verify", str(run)) == 1


def test_keygen_writes_a_0600_private_key_and_refuses_to_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "signing.key"
    assert cli("keygen", "--out", str(out)) == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert capsys.readouterr().out == (
        f"keygen: new Ed25519 key {key_of(out)}; public key {out}.pub\n"
    )
    loaded = sign.load_signing_key(str(out))
    assert loaded is not None and loaded.key_id == key_of(out)
    assert str(out) not in repr(loaded) and "PRIVATE" not in repr(loaded)
    before = out.read_bytes()
    assert cli("keygen", "--out", str(out)) == 2
    assert out.read_bytes() == before
    assert capsys.readouterr().err == (
        "keygen: the --out file or its .pub exists already; not overwritten\n"
    )


def test_openssh_keys_sign_and_verify(run: Path, tmp_path: Path) -> None:
    """An existing `ssh-keygen -t ed25519` key works as it is."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    k = Ed25519PrivateKey.generate()
    priv = k.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    pub = k.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    (tmp_path / "id_ed25519").write_bytes(priv)
    (tmp_path / "id_ed25519.pub").write_bytes(pub + b" someone@host\n")
    sign.sign(str(run), sign.load_signing_key(str(tmp_path / "id_ed25519")))
    r = sign.verify(str(run), sign.load_verify_key(str(tmp_path / "id_ed25519.pub")))
    assert r.ok and r.key_trusted


# --- URIs and streaming ------------------------------------------------------------------
def test_uris_and_object_stores(run: Path, keys: Callable[[str], Path]) -> None:
    key = keys("k")
    sign.sign(f"file://{run}", sign.load_signing_key(str(key)))
    assert sign.verify(str(run)).ok  # signed through a URI, verified as a path
    # a non-local file system: nothing may go through os.* or open()
    mock = pafs._MockFileSystem()
    mock.create_dir("bucket/runs/r1/client/w00")
    mock.create_dir("bucket/runs/r1/server")
    for name in FILES:
        with mock.open_output_stream(f"bucket/runs/r1/{name}") as f:
            f.write((run / name).read_bytes())
    result = sign.sign("bucket/runs/r1", sign.load_signing_key(str(key)), filesystem=mock)
    assert [f.name for f in result.files] == FILES
    assert sign.verify("bucket/runs/r1", filesystem=mock).ok
    with mock.open_output_stream("bucket/runs/r1/verdict.json") as f:
        f.write(b'{"exit_code": 4}\n')
    r = sign.verify("bucket/runs/r1", filesystem=mock)
    assert [m.name for m in r.modified] == ["verdict.json"]


class CountingFS:
    """A local file system that records the size of every read."""

    def __init__(self) -> None:
        self.fs = pafs.LocalFileSystem()
        self.reads: list[int] = []

    def get_file_info(self, what: Any) -> Any:
        return self.fs.get_file_info(what)

    def open_input_stream(self, path: str) -> CountingFS:
        self.stream = self.fs.open_input_stream(path)
        return self

    def __enter__(self) -> CountingFS:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stream.close()

    def read(self, n: int) -> bytes:
        self.reads.append(n)
        return bytes(self.stream.read(n))


def test_hashing_streams_in_chunks(run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sign, "CHUNK_BYTES", 7)
    fs = CountingFS()
    files = sign.hash_files(str(run), filesystem=fs)
    assert {f.name: f.sha256 for f in files} == {n: sha(run / n) for n in FILES}
    # never a whole file in one read: the Parquet part alone is hundreds of 7-byte reads
    assert set(fs.reads) == {7} and len(fs.reads) > (run / PARQUET).stat().st_size // 7


def test_verify_json_output(
    run: Path, keys: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    key = keys("k")
    signed(run, key)
    os.remove(run / "plan.json")
    assert cli("verify", str(run), "--json") == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["exit_code"] == 1 and doc["ok"] is False
    assert doc["signature"] == "valid" and doc["key_id"] == key_of(key)
    assert [m["name"] for m in doc["missing"]] == ["plan.json"]
    assert (doc["run_id"], doc["created"], doc["files"]) == ("sim-rehearsal-001", CREATED, 8)


def test_the_installed_entry_point_exits_with_the_documented_codes(
    run: Path, keys: Callable[[str], Path]
) -> None:
    key = keys("k")
    exe = str(Path(sys.executable).parent / "calculet-load")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CALCULET_")}

    def call(*argv: str) -> int:
        return subprocess.run([exe, *argv], env=env, capture_output=True).returncode

    assert call("verify", str(run)) == 2
    assert call("sign", str(run), "--key", str(key)) == 0
    assert call("verify", str(run), "--pubkey", f"{key}.pub") == 0
    (run / "report.html").write_text("changed\n")
    assert call("verify", str(run), "--pubkey", f"{key}.pub") == 1
