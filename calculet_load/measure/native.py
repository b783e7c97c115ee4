"""Compiled copies of the modules on a token event's path, used when they match the sources.

A token event's read and parse is the worker's hottest Python (docs/measurement.md,
"Where the CPU goes"). mypyc (mypy's compiler: the same type-annotated source, compiled
to a C extension) compiles the modules that read a response, `NATIVE_MODULES`, into
`build/native` beside the sources (`native.build()`, which scripts/setup runs when a C
compiler is there). Measured on the
thread engine's loop alone at 320 req/s (benchmarks/event_parse.py): the engine thread's
CPU per request 20-25 % lower; a token event through `respond` in a hot loop, 4.5 µs
against 6.5.

The compiled modules are used only when the build was made from these very sources (a
digest of them, of this interpreter and of mypyc's version is kept with it): an edited
module makes the whole set fall back to the source as it is, so what runs is always
what the source says. `CALCULET_NATIVE=0` uses the sources regardless. `STATE` says
which is in use, and why (the benchmarks print it).

Compiled code checks the annotated types at run time (a value of another type raises
TypeError where the source would have carried it on); the same tests run on both
(tests/load/test_native.py compares their outcomes on the hostile streams)."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

# The modules compiled, in calculet_load.measure (those a response's reads go through);
# the rest stay as they are. Their msgspec Structs live in measure.fastshapes: msgspec
# builds each with a metaclass of its own, which compiled classes cannot have.
NATIVE_MODULES = ("chunked", "sse", "response", "protocols")
SOURCE_DIR = Path(__file__).resolve().parent
BUILD_DIR = SOURCE_DIR.parents[1] / "build" / "native"
DIGEST_FILE = "SOURCES.sha256"
STATE = "not loaded"


def _mypyc_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mypy")
    except PackageNotFoundError:
        return "none"


def digest() -> str:
    """What a build is valid for: this interpreter, mypyc's version, the modules' sources."""
    h = hashlib.sha256()
    h.update(f"{sys.implementation.cache_tag} {sys.platform} mypy {_mypyc_version()}\n".encode())
    for name in NATIVE_MODULES:
        h.update(name.encode() + b"\0" + (SOURCE_DIR / f"{name}.py").read_bytes() + b"\0")
    return h.hexdigest()


def enable(package_path: list[str]) -> str:
    """Put the compiled modules first on the `calculet_load.measure` package's path when
    the build in BUILD_DIR was made from these sources; the state, for STATE."""
    global STATE
    if os.environ.get("CALCULET_NATIVE", "1") == "0":
        STATE = "off (CALCULET_NATIVE=0): the sources run as they are"
    elif not (BUILD_DIR / DIGEST_FILE).is_file():
        STATE = "off (not built: scripts/setup builds it)"
    elif (BUILD_DIR / DIGEST_FILE).read_text().strip() != digest():
        STATE = "off (the build is of other sources: scripts/setup builds it again)"
    else:
        # mypyc's shared library is a top-level module beside the package's modules
        sys.path.append(str(BUILD_DIR))
        package_path.insert(0, str(BUILD_DIR / "calculet_load" / "measure"))
        STATE = f"on (mypyc: {', '.join(NATIVE_MODULES)})"
    return STATE


def build() -> int:
    """Compile NATIVE_MODULES into BUILD_DIR (about 25 s); 0 on success."""
    import shutil
    import tempfile

    from mypyc.build import mypycify
    from setuptools import Distribution

    want = digest()
    if (BUILD_DIR / DIGEST_FILE).is_file() and (BUILD_DIR / DIGEST_FILE).read_text() == want:
        print(f"calculet-load: compiled modules up to date in {BUILD_DIR}")
        return 0
    root = SOURCE_DIR.parents[1]
    shutil.rmtree(BUILD_DIR, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        cwd = os.getcwd()
        os.chdir(root)  # mypyc names the modules by their paths from the project's root
        try:
            paths = [f"calculet_load/measure/{name}.py" for name in NATIVE_MODULES]
            ext = mypycify(paths, opt_level="3", target_dir=os.path.join(tmp, "c"))
            dist = Distribution({"name": "calculet-load-native", "ext_modules": ext})
            cmd = dist.get_command_obj("build_ext")
            cmd.build_lib, cmd.build_temp = str(BUILD_DIR), os.path.join(tmp, "o")
            dist.run_command("build_ext")
        finally:
            os.chdir(cwd)
    (BUILD_DIR / DIGEST_FILE).write_text(want)
    print(f"calculet-load: compiled {', '.join(NATIVE_MODULES)} into {BUILD_DIR}")
    return 0
