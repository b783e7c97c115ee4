"""The compiled modules on a token event's path (calculet_load.measure.native): used when
built from these sources, never otherwise, and reading every stream as the sources do."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from calculet_load.measure import native

REPO = Path(__file__).resolve().parents[2]

# Reads streams as an engine does, on whichever modules are in use, and prints the
# outcomes: every protocol's common stream, fast path on and off, and the fast path's
# irregular events and framings (tests/measure/test_fastpath.py's).
_READER = r"""
import dataclasses, json, sys
sys.path.insert(0, "benchmarks")
import msgspec
from calculet_load.clock import SystemClock
from calculet_load.measure import native
from event_parse import PROTOCOLS, adapter, read_once, reads_of
from tests.measure import test_fastpath as fp

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
            rows.append(fp.read_response([fp.HEAD, *fp._split(body, cuts)], fp._adapter(proto)))
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
    return native._valid(native.BUILD_DIR) is None


def test_the_compiled_modules_run_when_built() -> None:
    """scripts/setup builds them wherever they can be built: then they are what runs."""
    if os.environ.get("CALCULET_NATIVE") == "0":
        pytest.skip("CALCULET_NATIVE=0: the sources run")
    if not _built():
        lacks = native.buildable()
        if lacks is None:
            pytest.fail(f"this machine can build the compiled modules, and runs: {native.STATE}")
        pytest.skip(f"the compiled modules cannot be built here: {lacks}")
    assert native.STATE.startswith("on"), native.STATE
    for name in native.NATIVE_MODULES:
        module = importlib.import_module(f"calculet_load.measure.{name}")
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


def test_the_parsers_tests_pass_on_the_sources() -> None:
    """The suite runs on the compiled modules where they are built; the sources (what a
    machine without a compiler runs) get the parsers' own tests here."""
    files = ["test_fastpath.py", "test_sse.py", "test_chunked.py", "test_protocols.py"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         *(f"tests/measure/{f}" for f in files)],
        cwd=REPO, env={**os.environ, "CALCULET_NATIVE": "0"}, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout


def _project(root: Path) -> None:
    """A copy of the compiled modules' sources (and what they import) under `root`."""
    for rel in native.sources():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, root / rel)


def _fake_build(build: Path, files: list[str]) -> None:
    ext = sysconfig.get_config_var("EXT_SUFFIX")
    (build / "calculet_load" / "measure").mkdir(parents=True)
    for name in (*native.NATIVE_MODULES, *native.NATIVE_C):
        (build / "calculet_load" / "measure" / f"{name}{ext}").write_bytes(b"")
    (build / f"0123__mypyc{ext}").write_bytes(b"")
    (build / native.STAMP_FILE).write_text(
        json.dumps({"digest": native.digest(files), "files": files})
    )


def test_a_build_of_other_sources_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An edited module, one its compiled code imports, a missing file or an unreadable
    stamp: the sources run as they are."""
    monkeypatch.delenv("CALCULET_NATIVE", raising=False)
    monkeypatch.setattr(native, "STATE", native.STATE)
    monkeypatch.setattr(sys, "path", list(sys.path))
    files = native.sources()
    assert "calculet_load/measure/fastshapes.py" in files  # imported: its types are compiled in
    assert "calculet_load/schema/records.py" in files
    _project(tmp_path / "src")
    monkeypatch.setattr(native, "ROOT", tmp_path / "src")
    build = tmp_path / "build"
    monkeypatch.setattr(native, "BUILD_DIR", build)
    _fake_build(build, files)

    def state() -> tuple[str, list[str]]:
        path = ["/the/sources"]
        return native.enable(path), path

    on, path = state()
    assert on.startswith("on") and path == [
        str(build / "calculet_load" / "measure"),
        "/the/sources",
    ]
    # one byte more in a module the compiled code imports: another digest
    with (tmp_path / "src" / "calculet_load" / "measure" / "fastshapes.py").open("a") as f:
        f.write("\n")
    assert state() == ("off (the build is of other sources: scripts/setup builds it again)",
                       ["/the/sources"])  # fmt: skip
    shutil.rmtree(build)
    _fake_build(build, files)
    assert state()[0].startswith("on")
    monkeypatch.setenv("CALCULET_NATIVE", "0")
    assert state() == ("off (CALCULET_NATIVE=0): the sources run as they are", ["/the/sources"])
    monkeypatch.delenv("CALCULET_NATIVE")
    (build / "calculet_load" / "measure" / f"sse{sysconfig.get_config_var('EXT_SUFFIX')}").unlink()
    assert state()[0].startswith("off (the build is missing files")
    (build / native.STAMP_FILE).write_text("{")
    assert state()[0].startswith("off (the build's stamp is unreadable")
    (build / native.STAMP_FILE).unlink()
    assert state() == ("off (not built: scripts/setup builds it)", ["/the/sources"])
