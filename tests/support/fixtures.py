"""Fixtures of the whole suite, registered in tests/conftest.py: the kernel's receive
stamps held on, and what the `calculet-load accept` tests share (their helpers are in
tests.support.acceptkit)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from analysis.sign import generate_keypair
from calculet_load.measure.rxstamps import ask_kernel_stamps
from tests.support.simproc import ADMIN_TOKEN


@pytest.fixture(scope="session", autouse=True)
def kernel_stamps_on() -> Iterator[None]:
    """A socket asking for receive times, held for the session. Linux stamps arriving
    packets only while some socket asks; when the first one asks, it turns that on from a
    workqueue, a moment later, and a read in between carries no stamp (a test's socket
    that asked just before its first read met it, beside other workers whose sockets
    had just closed). With one held, every later socket's stamps are there at once."""
    held = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    ask_kernel_stamps(held)
    yield
    held.close()


@pytest.fixture(scope="module")
def signing_key(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh Ed25519 signing key (the public key is beside it, `.pub`), one per module."""
    key = tmp_path_factory.mktemp("key") / "signing.pem"
    generate_keypair(str(key))
    return key


@pytest.fixture
def accept_env(monkeypatch: pytest.MonkeyPatch, signing_key: Path) -> Path:
    """The environment `calculet-load accept` reads: the admin token and the signing key.
    Returns the public key the bundle verifies with."""
    monkeypatch.setenv("CALCULET_ADMIN_TOKEN", ADMIN_TOKEN)
    monkeypatch.setenv("CALCULET_SIGNING_KEY_FILE", str(signing_key))
    monkeypatch.delenv("CALCULET_SIGNING_KEY", raising=False)
    return Path(f"{signing_key}.pub")


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[Any]]]:
    """Child processes (pipelines, CPU hogs) killed and reaped whatever the test did."""
    started: list[subprocess.Popen[Any]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(10)
        for stream in (p.stdout, p.stderr):
            if stream is not None:
                stream.close()
