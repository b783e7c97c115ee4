"""Compiled copies of the modules on a token event's path, used when they match the sources.

A token event's read and parse is the worker's hottest Python (docs/measurement.md,
"Compiled modules on a token event's path"). mypyc (mypy's compiler: the same
type-annotated source, compiled to a C extension) compiles the modules that read a
response, `NATIVE_MODULES`, into `build/native` beside the sources: `build()`, which
scripts/setup runs (it needs a C compiler and Python's headers). Measured on the thread
engine's loop alone at 320 req/s: the engine thread's CPU per request 17-32 % lower; a
token event through `respond` in a hot loop, 4.5-5.3 µs against 6.0-6.2 (OpenAI
completions).

The compiled modules are used only when the build was made from these very sources: its
stamp lists every first-party module they import (their declared types are compiled in)
and holds a digest of those files, of this interpreter and of the versions of mypy, h11
and msgspec. Anything else (a module edited, a file missing, `CALCULET_NATIVE=0`) runs the
sources as they are, so what runs is always what the source says. `STATE` says which is
in use, and why (benchmarks/client_speed.py and event_parse.py print it).

Compiled code checks the annotated types at run time (a value of another type raises
TypeError where the source would have carried it on); tests/measure/test_native.py compares
the compiled modules' outcomes with the sources' and runs the parsers' tests on the
sources."""

from __future__ import annotations

import ast
import fcntl
import hashlib
import json
import os
import shutil
import sys
import sysconfig
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

# The modules compiled, in calculet_load.measure (those a response's reads go through);
# the rest stay as they are. Their msgspec Structs live in measure.fastshapes: msgspec
# builds each with a metaclass of its own, which compiled classes cannot have.
NATIVE_MODULES = ("chunked", "sse", "protocols", "outcome", "request_state", "rxstamps", "exchange")
# their sources, as paths from the project's root (mypyc names modules by them)
NATIVE_SOURCES = tuple(f"calculet_load/measure/{name}.py" for name in NATIVE_MODULES)
# C sources built beside them: the native reader the thread engine reads plain sockets
# with (reader.c: its thread reads and stamps each read without the interpreter lock)
NATIVE_C = {"_reader": "calculet_load/measure/reader.c"}
ROOT = Path(__file__).resolve().parents[2]  # the project's
BUILD_DIR = ROOT / "build" / "native"
STAMP_FILE = "STAMP.json"
# whose declared types the compiled code checks, or which compiles it
VERSIONED = ("mypy", "h11", "msgspec")
STATE = "not loaded"


def _versions() -> str:
    out = []
    for name in VERSIONED:
        try:
            out.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            out.append(f"{name} none")
    return f"{sys.implementation.cache_tag} {sys.platform}; " + ", ".join(out)


def sources() -> list[str]:
    """The compiled modules and every first-party module they import, transitively, and
    the C sources (paths from the project's root)."""
    todo = list(NATIVE_SOURCES)
    seen: list[str] = []
    while todo:
        rel = todo.pop(0)
        if rel in seen:
            continue
        seen.append(rel)
        for node in ast.walk(ast.parse((ROOT / rel).read_bytes())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            for name in names:
                if name.split(".")[0] != "calculet_load":
                    continue
                path = ROOT / name.replace(".", "/")
                for found in (path.with_suffix(".py"), path / "__init__.py"):
                    if found.is_file():
                        todo.append(str(found.relative_to(ROOT)))
                        break
    return seen + list(NATIVE_C.values())


def digest(files: list[str]) -> str:
    """What a build is valid for: this interpreter, the versions, the listed files."""
    h = hashlib.sha256(_versions().encode() + b"\n")
    for rel in files:
        h.update(rel.encode() + b"\0" + (ROOT / rel).read_bytes() + b"\0")
    return h.hexdigest()


def _valid(build: Path) -> str | None:
    """None when `build` holds a whole build of these sources, else why not."""
    stamp = build / STAMP_FILE
    if not stamp.is_file():
        return "not built: scripts/setup builds it"
    try:
        made = json.loads(stamp.read_text())
        files = [str(f) for f in made["files"]]
        if not {*NATIVE_SOURCES, *NATIVE_C.values()} <= set(files):
            return "the build is of other modules: scripts/setup builds it again"
        if made["digest"] != digest(files):
            return "the build is of other sources: scripts/setup builds it again"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"the build's stamp is unreadable ({exc}): scripts/setup builds it again"
    ext = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    wanted = [
        build / "calculet_load" / "measure" / f"{n}{ext}" for n in (*NATIVE_MODULES, *NATIVE_C)
    ]
    if not all(p.is_file() for p in wanted) or not list(build.glob(f"*__mypyc{ext}")):
        return "the build is missing files: scripts/setup builds it again"
    return None


def enable(package_path: list[str]) -> str:
    """Put the compiled modules first on the `calculet_load.measure` package's path when
    the build in BUILD_DIR is whole and of these sources; the state, for STATE."""
    global STATE
    if os.environ.get("CALCULET_NATIVE", "1") == "0":
        STATE = "off (CALCULET_NATIVE=0): the sources run as they are"
        return STATE
    why = _valid(BUILD_DIR)
    if why is not None:
        STATE = f"off ({why})"
        return STATE
    # mypyc's shared library is a top-level module beside the package's modules
    sys.path.append(str(BUILD_DIR))
    package_path.insert(0, str(BUILD_DIR / "calculet_load" / "measure"))
    STATE = f"on (mypyc: {', '.join(NATIVE_MODULES)}; C: {', '.join(NATIVE_C)})"
    return STATE


def buildable() -> str | None:
    """None when this machine can build the compiled modules, else what it lacks."""
    import importlib.util

    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        return f"no C compiler ({compiler})"
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        return "no Python headers (Python.h)"
    for module in ("mypyc", "setuptools"):
        if importlib.util.find_spec(module) is None:
            return f"no {module} (a dev extra)"
    return None


def build() -> int:
    """Compile NATIVE_MODULES into BUILD_DIR (about 35 s on 2 cores); 0 on success. One
    build at a time (a lock beside it); the new build replaces the old one whole, and its
    stamp is of the sources as they were when it started and still are when it ends."""
    lacks = buildable()
    if lacks is not None:
        print(f"calculet-load: the compiled modules cannot be built here: {lacks}")
        return 1
    BUILD_DIR.parent.mkdir(parents=True, exist_ok=True)
    with open(BUILD_DIR.parent / "native.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _valid(BUILD_DIR) is None:
            print(f"calculet-load: compiled modules up to date in {BUILD_DIR}")
            return 0
        files = sources()
        want = digest(files)
        new = BUILD_DIR.with_name(f"native.new-{os.getpid()}")
        shutil.rmtree(new, ignore_errors=True)
        try:
            _compile(new)
            if digest(files) != want:
                print("calculet-load: the sources changed during the build: not used")
                return 1
            (new / STAMP_FILE).write_text(json.dumps({"digest": want, "files": files}))
            old = BUILD_DIR.with_name(f"native.old-{os.getpid()}")
            if BUILD_DIR.exists():
                BUILD_DIR.rename(old)  # processes running it keep their loaded copies
            new.rename(BUILD_DIR)
            shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(new, ignore_errors=True)
    print(f"calculet-load: compiled {', '.join([*NATIVE_MODULES, *NATIVE_C])} into {BUILD_DIR}")
    return 0


def _compile(out: Path) -> None:
    import tempfile

    from mypyc.build import mypycify
    from setuptools import Distribution, Extension

    with tempfile.TemporaryDirectory() as tmp:
        cwd = os.getcwd()
        os.chdir(ROOT)  # mypyc names the modules by their paths from the project's root
        try:
            ext = mypycify(list(NATIVE_SOURCES), opt_level="3", target_dir=os.path.join(tmp, "c"))
            for name, src in NATIVE_C.items():
                ext.append(
                    Extension(f"calculet_load.measure.{name}", [src], extra_compile_args=["-O2"])
                )
            dist = Distribution({"name": "calculet-load-native", "ext_modules": ext})
            cmd = dist.get_command_obj("build_ext")
            cmd.build_lib, cmd.build_temp = str(out), os.path.join(tmp, "o")
            dist.run_command("build_ext")
        finally:
            os.chdir(cwd)
