"""How a target is reached (calculet_load.schema.access): base paths, headers, the API key
and what may be written of them; the manifest's target section takes the same fields."""

from __future__ import annotations

import argparse
import socket
import ssl
import threading
from pathlib import Path

import pytest

from calculet_load.schema.access import (
    REDACTED,
    AccessError,
    TargetAccess,
    access_described,
    access_from,
    add_access_arguments,
    parse_header,
    secret_header,
)
from calculet_load.schema.manifest import ManifestError, Target, parse_manifest
from calculet_load.schema.profiles import profile_named
from calculet_load.target.netprobe import measure_round
from tests.conftest import REPO


@pytest.mark.parametrize(
    ("url", "path", "want"),
    [
        ("http://127.0.0.1:8080", "/v1/completions", "/v1/completions"),
        ("http://127.0.0.1:8080/", "/completion", "/completion"),
        ("https://gw.example/llm/v1", "/v1/completions", "/llm/v1/completions"),
        ("https://gw.example/llm/v1/", "/v1/chat/completions", "/llm/v1/chat/completions"),
        ("https://gw.example/llm/v1", "/health", "/llm/health"),
        ("http://127.0.0.1:8443/llm", "/v1/completions", "/llm/v1/completions"),
        ("http://127.0.0.1:8443/llm", "/traces/steps?offset=0", "/llm/traces/steps?offset=0"),
        ("https://gw.example/v1", "/v1/models", "/v1/models"),
    ],
)
def test_paths_resolve_under_the_base_path(url: str, path: str, want: str) -> None:
    assert TargetAccess(url.rstrip("/")).path(path) == want


def test_host_header_and_ports() -> None:
    a = TargetAccess("https://gw.example/llm/v1")
    assert (a.host, a.port, a.authority, a.tls) == ("gw.example", 443, "gw.example", True)
    b = TargetAccess("http://127.0.0.1:8080")
    assert (b.port, b.authority, b.tls, b.ssl_context()) == (8080, "127.0.0.1:8080", False, None)
    assert b.resolve("/health") == "http://127.0.0.1:8080/health"


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"url": "ftp://x"}, "expected http"),
        ({"url": "https://user:pw@gw.example"}, "credentials in the URL"),
        ({"url": "https://gw.example/v1?key=1"}, "no query"),
        ({"url": "http://x", "insecure": True}, "https:// target only"),
        ({"url": "https://x", "insecure": True, "ca_file": "ca.pem"}, "not both"),
        ({"url": "https://x", "headers": (("Host", "y"),)}, "set by the client"),
        ({"url": "https://x", "api_key_env": "CALCULET_NO_SUCH_VARIABLE"}, "not set"),
        ({"url": "https://x", "api_key_file": "/nonexistent/key"}, "--api-key-file"),
    ],
)
def test_unusable_access_is_one_line(kw: dict[str, object], message: str) -> None:
    with pytest.raises(AccessError, match=message):
        TargetAccess(**kw)  # type: ignore[arg-type]


def test_the_key_is_sent_but_never_described(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("sk-file-secret\n")
    a = TargetAccess(
        "https://gw.example/llm",
        api_key_file=str(key_file),
        headers=(("X-Api-Key", "hdr-secret"), ("X-Team", "perf")),
    )
    assert a.request_headers() == [
        ("X-Api-Key", "hdr-secret"),
        ("X-Team", "perf"),
        ("Authorization", "Bearer sk-file-secret"),
    ]
    described = repr(a) + str(a.describe())
    assert "sk-file-secret" not in described and "hdr-secret" not in described
    assert a.describe()["headers"] == {"X-Api-Key": REDACTED, "X-Team": "perf"}
    assert a.describe()["api_key"] == {"file": str(key_file)}
    assert sorted(a.secrets()) == ["hdr-secret", "sk-file-secret"]
    monkeypatch.setenv("CALCULET_KEY", "sk-env-secret")
    b = TargetAccess("https://x", api_key_env="CALCULET_KEY")
    assert ("Authorization", "Bearer sk-env-secret") in b.request_headers()
    assert b.describe()["api_key"] == {"env": "CALCULET_KEY"}
    # an explicit Authorization header wins over the key
    c = TargetAccess("https://x", api_key_env="CALCULET_KEY", headers=(("authorization", "t"),))
    assert c.request_headers() == [("authorization", "t")]


def test_a_worker_rebuilds_the_access_from_its_description(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A distributed run sends its workers describe() only; each rebuilds the access on its
    host: the key from the same variable or file there, a secret header from its own
    --header (else one line naming the header)."""
    p = argparse.ArgumentParser()
    add_access_arguments(p.add_argument)
    monkeypatch.setenv("WORKER_KEY", "sk-worker")
    sent = TargetAccess(
        "https://gw.example/llm/v1", insecure=True, api_key_env="WORKER_KEY",
        headers=(("X-Team", "perf"),),
    )  # fmt: skip
    here = access_described(sent.describe(), p.parse_args([]))
    assert here.request_headers() == sent.request_headers()
    assert here.insecure and here.path("/v1/completions") == "/llm/v1/completions"
    secret = TargetAccess("http://127.0.0.1:9", headers=(("X-Api-Key", "hdr-secret"),))
    with pytest.raises(AccessError, match=r"X-Api-Key.*--header"):
        access_described(secret.describe(), p.parse_args([]))
    own = access_described(secret.describe(), p.parse_args(["--header", "X-Api-Key: mine"]))
    assert own.request_headers() == [("X-Api-Key", "mine")]
    key_file = tmp_path / "key"
    key_file.write_text("sk-own-file\n")
    mine = access_described(sent.describe(), p.parse_args(["--api-key-file", str(key_file)]))
    assert ("Authorization", "Bearer sk-own-file") in mine.request_headers()
    monkeypatch.delenv("WORKER_KEY")
    with pytest.raises(AccessError, match="WORKER_KEY"):
        access_described(sent.describe(), p.parse_args([]))


def test_the_rtt_probe_asks_the_profile_health_path_under_the_base_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """netprobe's /health round trip goes where the target's requests go: under the base
    path, to the profile's health path (the model list for a plain OpenAI endpoint), with
    the target's headers and key; the round's figures never hold the key."""
    monkeypatch.setenv("PROBE_KEY", "sk-probe")
    got: list[bytes] = []
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(5)

        def answer() -> None:
            conn, _ = server.accept()
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(4096)
                got.append(data)
                conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")

        t = threading.Thread(target=answer)
        t.start()
        port = server.getsockname()[1]
        access = TargetAccess(
            f"http://127.0.0.1:{port}/llm/v1", api_key_env="PROBE_KEY", headers=(("X-Team", "p"),)
        )
        path = profile_named("openai").health_probe_path
        row = measure_round(access, 1, path=path, timeout_s=5)
        t.join(5)
    lines = got[0].decode().split("\r\n")
    assert lines[0] == "GET /llm/v1/models HTTP/1.1"
    assert f"Host: 127.0.0.1:{port}" in lines
    assert "Authorization: Bearer sk-probe" in lines and "X-Team: p" in lines
    assert row["errors"] == 0 and row["health"]["n"] == 1, row  # a 404 still times the trip
    assert "sk-probe" not in str(row)
    assert profile_named("llama.cpp").health_probe_path == "/health"


def test_secret_names_and_header_parsing() -> None:
    for name in ("Authorization", "X-Api-Key", "api_key", "X-Auth-Token", "Cookie", "X-Secret"):
        assert secret_header(name), name
    for name in ("X-Team", "Accept", "OpenAI-Organization"):
        assert not secret_header(name), name
    assert parse_header("X-Team:  perf ") == ("X-Team", "perf")
    with pytest.raises(AccessError):
        parse_header("no colon")
    with pytest.raises(AccessError):
        parse_header("Bad Name: x")


def test_verification_is_on_unless_insecure() -> None:
    on = TargetAccess("https://x").ssl_context()
    assert on is not None and on.verify_mode == ssl.CERT_REQUIRED and on.check_hostname
    off = TargetAccess("https://x", insecure=True).ssl_context()
    assert off is not None and off.verify_mode == ssl.CERT_NONE and not off.check_hostname
    assert TargetAccess("https://x", insecure=True).banner() is not None
    assert TargetAccess("https://x").banner() is None


def test_options_over_the_manifest_target(monkeypatch: pytest.MonkeyPatch) -> None:
    p = argparse.ArgumentParser()
    add_access_arguments(p.add_argument)
    monkeypatch.setenv("MANIFEST_KEY", "k1")
    monkeypatch.setenv("CLI_KEY", "k2")
    target = Target(
        url="https://gw.example/llm/v1",
        headers=["X-Team: perf"],
        api_key_env="MANIFEST_KEY",
    )
    a = access_from(p.parse_args([]), target.url, target)
    assert ("Authorization", "Bearer k1") in a.request_headers()
    args = p.parse_args(["--api-key-env", "CLI_KEY", "--header", "X-Run: 7", "--insecure"])
    b = access_from(args, target.url, target)
    assert ("Authorization", "Bearer k2") in b.request_headers()
    assert ("X-Team", "perf") in b.request_headers() and ("X-Run", "7") in b.request_headers()
    assert b.insecure


def test_the_manifest_never_holds_a_secret_inline() -> None:
    import yaml

    data = yaml.safe_load((REPO / "configs" / "manifest.sim.yaml").read_text())
    data["target"] = {"url": "https://gw.example/llm/v1", "headers": ["Authorization: Bearer x"]}
    with pytest.raises(ManifestError, match="never written inline"):
        parse_manifest(data)
    data["target"] = {"url": "https://gw.example/llm/v1", "api_key_env": "bad name"}
    with pytest.raises(ManifestError, match="api_key_env"):
        parse_manifest(data)
    data["target"] = {
        "url": "https://gw.example/llm/v1",
        "api_key_file": "/run/secrets/llm-key",
        "ca_file": "/etc/ssl/gw-ca.pem",
        "headers": ["X-Team: perf"],
    }
    assert parse_manifest(data).target is not None
