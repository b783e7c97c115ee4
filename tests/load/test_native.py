"""The compiled modules on a token event's path (calculet_load.measure.native): used when
built from these sources, never otherwise, and reading every stream as the sources do."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from calculet_load.measure import native

REPO = Path(__file__).resolve().parents[2]

# Reads streams as an engine does, on whichever modules are in use, and prints the
# outcomes: every protocol's common stream, fast path on and off, and the fast path's
# irregular events and framings (tests/load/test_fastpath.py's).
_READER = r"""
import dataclasses, json, sys
sys.path.insert(0, "benchmarks")
import msgspec
from calculet_load.clock import SystemClock
from calculet_load.measure import native
from event_parse import PROTOCOLS, adapter, read_once, reads_of
from tests.load import test_fastpath as fp

def row(out):
    fields = dataclasses.asdict(out)
    fields["token_events"] = [msgspec.structs.astuple(e) for e in out.token_events]
    return fields

rows = []
for proto in PROTOCOLS:
    for fast in (True, False):
        rows.append(row(read_once(reads_of(proto, 16), adapter(proto, fast), SystemClock())))
    for data in fp._odd(proto):
        body = fp._chunk(b"data: " + data + b"\n\n", 0) + fp.END
        for cuts in ([], [3], [7, 40]):
            rows.append(fp._read([fp.HEAD, *fp._split(body, cuts)], fp._adapter(proto)))
print(json.dumps({"state": native.STATE, "rows": rows}, default=repr))
"""


def _outcomes(native_on: bool) -> dict[str, object]:
    env = {**os.environ, "CALCULET_NATIVE": "1" if native_on else "0"}
    done = subprocess.run(
        [sys.executable, "-c", _READER], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=120, check=True,
    )  # fmt: skip
    result: dict[str, object] = json.loads(done.stdout)
    return result


def _built() -> bool:
    stamp = native.BUILD_DIR / native.DIGEST_FILE
    return stamp.is_file() and stamp.read_text().strip() == native.digest()


def test_the_compiled_modules_run_when_built() -> None:
    """scripts/setup builds them wherever a C compiler is: then they are what runs."""
    if not _built():
        if shutil.which("cc") and os.environ.get("CALCULET_NATIVE") != "0":
            pytest.fail(f"a C compiler is here but no build of these sources: {native.STATE}")
        pytest.skip(f"no build of the compiled modules here: {native.STATE}")
    from calculet_load.measure import chunked, protocols, response, sse

    assert native.STATE.startswith("on"), native.STATE
    for module in (chunked, sse, response, protocols):
        assert Path(str(module.__file__)).is_relative_to(native.BUILD_DIR), module.__file__
        assert str(module.__file__).endswith(".so")


def test_compiled_and_source_modules_read_every_stream_the_same() -> None:
    if not _built():
        pytest.skip(f"no build of the compiled modules here: {native.STATE}")
    compiled, source = _outcomes(True), _outcomes(False)
    assert str(compiled["state"]).startswith("on") and str(source["state"]).startswith("off")
    rows = compiled["rows"]
    assert isinstance(rows, list) and len(rows) > 50
    assert rows == source["rows"]


def test_a_build_of_other_sources_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An edited module makes the whole set fall back to the sources as they are."""
    sources = tmp_path / "src"
    sources.mkdir()
    for name in native.NATIVE_MODULES:
        shutil.copy(native.SOURCE_DIR / f"{name}.py", sources / f"{name}.py")
    monkeypatch.setattr(native, "SOURCE_DIR", sources)
    monkeypatch.setattr(native, "BUILD_DIR", tmp_path / "build")
    monkeypatch.setattr(native, "STATE", native.STATE)
    (tmp_path / "build").mkdir()
    stamp = tmp_path / "build" / native.DIGEST_FILE
    stamp.write_text(native.digest())
    monkeypatch.setattr(sys, "path", list(sys.path))
    path: list[str] = ["/the/sources"]
    assert native.enable(path).startswith("on")
    assert path == [str(tmp_path / "build" / "calculet_load" / "measure"), "/the/sources"]
    # one byte more in one source: another digest, and the build is not used
    with (sources / "sse.py").open("a") as f:
        f.write("\n")
    path = ["/the/sources"]
    assert native.enable(path).startswith("off (the build is of other sources")
    assert path == ["/the/sources"]
    stamp.write_text(native.digest())
    monkeypatch.setenv("CALCULET_NATIVE", "0")
    assert native.enable(path).startswith("off (CALCULET_NATIVE=0)") and path == ["/the/sources"]
    monkeypatch.delenv("CALCULET_NATIVE")
    stamp.unlink()
    assert native.enable(path).startswith("off (not built") and path == ["/the/sources"]
