"""The house keeps its shape: no import cycle, every import goes down (docs/architecture.md).

The import graph is read from the source (every `import`, also inside functions and under
`TYPE_CHECKING`: an arrow is an arrow); a module may import modules of a lower layer, or
of its own subpackage as long as that makes no cycle. Modules over 500 lines say why in
a one-line `# size:` comment near their top; a module of the drivers stays under 400 lines,
with no such excuse.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("calculet_load", "analysis", "calculet_drivers", "calculet_sim")

# Layers, lowest first. A module's layer is that of the longest prefix listed here.
LAYERS: list[tuple[str, ...]] = [
    ("calculet_load", "calculet_load.errors", "calculet_load.clock", "calculet_load.events",
     "calculet_load.configfile", "calculet_load.ranges"),
    ("calculet_load.schema",),
    ("calculet_load.measure", "calculet_load.target"),
    ("calculet_load.workload",),
    ("calculet_load.locust",),
    ("analysis", "analysis.errors"),
    ("analysis.stats",),
    ("analysis.tables",),
    ("analysis.judge",),
    ("analysis.views",),
    ("analysis.analyze", "analysis.report", "analysis.sign", "analysis.legacy"),
    ("analysis.cli", "analysis.signcli"),
    ("calculet_drivers",),
    ("calculet_drivers.skeleton",),
    ("calculet_drivers.faults",),
    ("calculet_drivers.soak",),
    ("calculet_drivers.capacity",),
    ("calculet_drivers.accept",),
    ("calculet_drivers.commands", "calculet_drivers.demo"),
    ("calculet_drivers.cli",),
]  # fmt: skip
# What else a package may import besides its own layers and those below: the library
# never reaches up into the analysis or the drivers; analysis reads files only, so of the
# load generator it takes the base and the schema.
FORBIDDEN = {
    "calculet_load": ("analysis", "calculet_drivers"),
    "analysis": ("calculet_load.measure", "calculet_load.target", "calculet_load.workload",
                 "calculet_load.locust", "calculet_drivers"),
    "calculet_sim": ("calculet_load.errors", "calculet_load.clock", "calculet_load.measure",
                     "calculet_load.target", "calculet_load.workload", "calculet_load.locust",
                     "analysis", "calculet_drivers"),
}  # fmt: skip
SIBLINGS_APART = (  # same layer, different subpackages: neither may import the other
    ("calculet_load.measure", "calculet_load.target"),
)
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


MODULES = _modules()


def _type_only(tree: ast.Module) -> set[int]:
    """Ids of the import nodes under `if TYPE_CHECKING:` (no arrow at run time)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


def _imports(name: str, path: Path, runtime: bool = False) -> Iterator[tuple[str, int]]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_only(tree) if runtime else set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")
                up = up[: len(up) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield (full if full in MODULES else base), node.lineno


def _graph(runtime: bool = False) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        deps = set()
        for target, _ in _imports(name, path, runtime):
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                deps.add(target)  # a package's own __init__ is not an arrow
        graph[name] = deps
    return graph


def _layer(name: str) -> int | None:
    best, found = -1, None
    for i, layer in enumerate(LAYERS):
        for prefix in layer:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), i
    return found


def _subpackage(name: str) -> str:
    for layer in LAYERS:
        for prefix in sorted(layer, key=len, reverse=True):
            if name == prefix or name.startswith(prefix + "."):
                return prefix
    return name


def test_every_module_has_a_layer() -> None:
    missing = [m for m in MODULES if not m.startswith("calculet_sim") and _layer(m) is None]
    assert not missing


def test_imports_go_down() -> None:
    graph = _graph()
    wrong = []
    for name, deps in sorted(graph.items()):
        top = name.split(".")[0]
        for dep in sorted(deps):
            if any(dep == f or dep.startswith(f + ".") for f in FORBIDDEN.get(top, ())):
                wrong.append(f"{name} -> {dep} (forbidden to {top})")
                continue
            if top == "calculet_sim" or dep.startswith("calculet_sim"):
                continue
            a, b = _layer(name), _layer(dep)
            assert a is not None and b is not None
            same = _subpackage(name) == _subpackage(dep)
            apart = any({_subpackage(name), _subpackage(dep)} == set(p) for p in SIBLINGS_APART)
            if b > a or (b == a and not same and (apart or _subpackage(dep) not in LAYERS[a])):
                wrong.append(f"{name} -> {dep}")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_no_import_cycle() -> None:
    """`TYPE_CHECKING` imports are arrows too: a type named for the checker couples two
    modules as much as a call does. The simulator alone is counted at run time: its
    engine and its job phases name each other's types under `TYPE_CHECKING`."""
    full, runtime = _graph(), _graph(runtime=True)
    graph = {n: runtime[n] if n.startswith("calculet_sim") else deps for n, deps in full.items()}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for d in sorted(graph.get(n, ())):
            if state.get(d) == 1:
                cycles.append([*stack[stack.index(d) :], d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_long_modules_say_why(name: str) -> None:
    lines = MODULES[name].read_text().splitlines()
    if len(lines) > MAX_LINES:
        assert any(line.startswith("# size:") for line in lines[:40]), (
            f"{name}: {len(lines)} lines; split it or say why in a '# size:' line at its top"
        )


DRIVER_MAX_LINES = 400  # the drivers are steps and judgement on the skeleton: no excuse


@pytest.mark.parametrize("name", sorted(m for m in MODULES if m.startswith("calculet_drivers")))
def test_driver_modules_are_short(name: str) -> None:
    lines = MODULES[name].read_text().splitlines()
    assert len(lines) <= DRIVER_MAX_LINES, f"{name}: {len(lines)} lines; split it"
    assert not any(line.startswith("# size:") for line in lines), f"{name}: a `# size:` line"
