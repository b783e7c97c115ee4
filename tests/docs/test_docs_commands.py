"""Every command and Python name the README and docs show still exists.

Commands: each `calculet-load SUBCOMMAND`, `calculet-sim` and `locust -f LOCUSTFILE`
found in a fenced shell block answers `--help` with exit 0. Names: each dotted
`calculet_load.…` / `analysis.…` name written in backticks imports (a module) or is an
attribute of the module before it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
COMMAND = re.compile(  # a command at the start of a line of a shell block
    r"^\s*(?:\$ )?(?:\.venv/bin/)?(calculet-load|calculet-sim|locust)\b"
    r"((?: +-f +\S+)|(?: +[a-z][a-z-]*))?",
    re.M,
)
NAME = re.compile(r"`((?:calculet_load|analysis)(?:\.[A-Za-z_][A-Za-z0-9_]*)+)`")


def _blocks(text: str) -> list[str]:
    """The fenced code blocks of a Markdown text (fences opened and closed in turn)."""
    blocks, current = [], None
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if current is None:
                current = []
            else:
                blocks.append("\n".join(current))
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def _commands() -> list[tuple[str, ...]]:
    found: set[tuple[str, ...]] = set()
    for doc in DOCS:
        for block in _blocks(doc.read_text()):
            for prog, rest in COMMAND.findall(block):
                rest = rest.strip()
                if prog == "calculet-load" and rest and not rest.startswith("-"):
                    found.add((prog, rest))
                elif prog == "locust" and rest.startswith("-f"):
                    found.add((prog, "-f", rest.split()[1].split(",")[0]))
                elif prog == "calculet-sim":
                    found.add((prog,))
    return sorted(found)


def _names() -> list[str]:
    return sorted({n for doc in DOCS for n in NAME.findall(doc.read_text())})


def _help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """`calculet-load ARGV --help` in this process (its parser is the program's; a
    process per command cost 0.4 s of CPU each); `test_the_program_answers_help` runs
    the program itself."""
    from calculet_drivers.cli import main

    with pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code == 0, capsys.readouterr().err[-2000:]
    return capsys.readouterr().out


def test_the_program_answers_help() -> None:
    args = [sys.executable, "-m", "calculet_drivers.cli", "--help"]
    done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage: calculet-load" in done.stdout


@pytest.mark.parametrize("command", _commands(), ids=" ".join)
def test_documented_command_answers_help(
    command: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    if command[0] == "calculet-load":
        assert "usage" in _help(list(command[1:]), capsys).lower()
        return
    exe = {"calculet-sim": "calculet_sim.cli", "locust": "locust"}[command[0]]
    args = [sys.executable, "-m", exe, *command[1:], "--help"]
    done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage" in done.stdout.lower()


def test_the_docs_show_the_main_commands() -> None:
    shown = {c[1] for c in _commands() if c[0] == "calculet-load"}
    assert {"accept", "analyze", "probe", "export", "schema"} <= shown
    assert ("locust", "-f", "locustfiles/calculet.py") in _commands()


# Importing these runs Locust's import, which monkey-patches the whole process with gevent:
# in an xdist worker that stops the worker's own loop (a documented
# `calculet_load.locust.worker` once crashed one with LoopExit). Their names are read from
# the source instead.
_PATCHING = ("calculet_load.locust.",)


def _defined_in_source(module: str, attr: str) -> bool:
    """Whether `module`'s source binds `attr` at its top level (a def, class or assignment)."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, f"{module}: no such module"
    tree = ast.parse(Path(spec.origin).read_text())
    for node in tree.body:
        defined = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        if defined and node.name == attr:  # type: ignore[union-attr]
            return True
        targets = (
            node.targets if isinstance(node, ast.Assign)
            else [node.target] if isinstance(node, ast.AnnAssign) else []
        )  # fmt: skip
        if any(isinstance(t, ast.Name) and t.id == attr for t in targets):
            return True
    return False


def _exported(package: str, attr: str) -> bool:
    """Whether `package`'s `__init__` lists `attr` in its `__all__` and gives it through a
    module `__getattr__` (a name imported only when asked for)."""
    if not _defined_in_source(package, "__getattr__"):
        return False
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.origin is not None
    for node in ast.parse(Path(spec.origin).read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return attr in ast.literal_eval(node.value)
    return False


@pytest.mark.parametrize("name", _names())
def test_documented_python_name_exists(name: str) -> None:
    parts = name.split(".")
    if name.startswith(_PATCHING):
        # down from the package: find_spec imports a name's parent, never the module itself
        for i in range(2, len(parts) + 1):
            module = ".".join(parts[:i])
            found = importlib.util.find_spec(module)
            if found is None and i == len(parts) and _exported(".".join(parts[:-1]), parts[-1]):
                return  # a package's name given by its `__all__` and `__getattr__`
            assert found is not None, f"{name}: no module {module}"
            if found.submodule_search_locations is None:  # a module, not a package
                rest = parts[i:]
                assert len(rest) <= 1, f"{name}: only a module's top-level names are checked"
                assert not rest or _defined_in_source(module, rest[0]), (
                    f"{name}: {module} defines no {rest[0]!r}"
                )
                return
        return  # a package
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            assert hasattr(obj, attr), f"{name}: {'.'.join(parts[:i])} has no {attr!r}"
            obj = getattr(obj, attr)
        return
    pytest.fail(f"{name}: no such module")


def _every_subcommand() -> list[str]:
    from calculet_drivers.cli import COMMANDS

    return sorted(COMMANDS)


@pytest.mark.parametrize("sub", _every_subcommand())
def test_every_subcommand_answers_help(sub: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert f"calculet-load {sub}" in _help([sub], capsys)


def test_the_locustfiles_load() -> None:
    """`--list` loads the locustfiles (`--help` would not) and names their users."""
    args = [sys.executable, "-m", "locust", "-f", "locustfiles/calculet.py,locustfiles/stages.py",
            "--list"]  # fmt: skip
    done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "CalculetUser" in done.stdout
