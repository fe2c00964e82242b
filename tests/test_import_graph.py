"""The package's import graph: no loops, and layers that point one way.

    contract <- source <- profiles <- engines <- runtime <- export, serve, bench <- cli

Every import counts, wherever it stands: at the top of a module, inside a function, or under
`if TYPE_CHECKING:` (a loop hidden in a function is still a loop; one under TYPE_CHECKING still ties
the two modules' designs together). Read from the source with `ast`, so the test sees imports that
a run never reaches.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "cabinlm"

# What each layer may import, besides itself. The root package (cabinlm/__init__.py: the version)
# sits with the contract at the bottom.
ALLOWED: dict[str, set[str]] = {
    "contract": set(),
    "source": {"contract"},
    "profiles": {"contract", "source"},
    "engines": {"contract", "profiles"},
    "runtime": {"contract", "profiles", "engines"},
    # The export measures the graph it wrote through the runtime (its quality report).
    "export": {"contract", "source", "profiles", "runtime"},
    "serve": {"contract", "runtime"},
    "bench": {"contract", "engines", "runtime", "export"},
    "cli": {"contract", "source", "profiles", "engines", "runtime", "export", "serve", "bench"},
    "__main__": {"cli"},
}

# A build checks what it built by running it: these modules of the engines' build side open the
# finished artifact with the runtime's Decoder. Nothing on an engine's run side may.
BUILD_CHECKS_THAT_RUN_THE_RUNTIME = {
    "cabinlm.engines.ort_fused.builder",  # one decode step of the fused build against the export's graph
    "cabinlm.engines.qnn_htp.a16_feeds",  # the 16-bit build's calibration feeds, from the runtime's bookkeeping
    "cabinlm.engines.tensorrt.doctor",  # `cabinlm doctor` runs a TensorRT build's first steps
}


def _modules() -> dict[str, tuple[Path, bool]]:
    mods = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        if package:
            parts = parts[:-1]
        mods[".".join(parts)] = (path, package)
    return mods


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> set[str]:
    """The cabinlm modules `module` imports (a name imported from a package that is a module counts as
    that module, as Python loads it)."""
    path, package = MODULES[module]
    here = module.split(".") if package else module.split(".")[:-1]
    found: set[str | None] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(_resolve(a.name) for a in node.names if a.name.split(".")[0] == "cabinlm")
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else (node.module or "")  # fmt: skip
            if base.split(".")[0] != "cabinlm":
                continue
            for a in node.names:
                full = f"{base}.{a.name}"
                found.add(full if full in MODULES else _resolve(base))
    found.discard(None)
    found.discard(module)
    return found  # type: ignore[return-value]


GRAPH = {m: _imports(m) for m in MODULES}


def _layer(module: str) -> str:
    parts = module.split(".")
    return "contract" if len(parts) == 1 else parts[1]


def _loops() -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    loops: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                loops.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return loops


def test_the_reader_sees_imports_in_functions_and_under_type_checking():
    # engines/registry.py imports Backend only under TYPE_CHECKING and each engine's builder only by
    # name at call time; its TYPE_CHECKING import must be seen.
    assert "cabinlm.engines.backend" in GRAPH["cabinlm.engines.registry"]
    assert "cabinlm.contract.engines" in GRAPH["cabinlm.engines.registry"]
    # cli/build.py imports cpu_engine inside its command.
    assert "cabinlm.profiles" in GRAPH["cabinlm.cli.build"]


def test_the_import_graph_has_no_loops():
    loops = _loops()
    assert not loops, "import loops (each line: modules that import each other round a loop):\n" + \
        "\n".join(" <-> ".join(loop) for loop in loops)  # fmt: skip


def test_every_package_is_a_named_layer():
    assert {_layer(m) for m in MODULES} <= set(ALLOWED), "a new package: name its layer in ALLOWED"


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layers_only_point_down(layer):
    wrong = []
    for module, targets in sorted(GRAPH.items()):
        if _layer(module) != layer:
            continue
        for target in sorted(targets):
            to = _layer(target)
            if to == layer or to in ALLOWED[layer]:
                continue
            if module in BUILD_CHECKS_THAT_RUN_THE_RUNTIME and to == "runtime":
                continue
            wrong.append(f"{module} -> {target}")
    assert not wrong, f"{layer} may import only {sorted(ALLOWED[layer])}:\n" + "\n".join(wrong)


def test_the_contract_needs_only_the_standard_library_and_numpy():
    outside = []
    for module, (path, _) in sorted(MODULES.items()):
        if _layer(module) != "contract":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []  # fmt: skip
            for name in names:
                top = name.split(".")[0]
                if top not in {"cabinlm", "numpy", "__future__"} and top not in _stdlib():
                    outside.append(f"{module}: {name}")
    assert not outside, "\n".join(outside)


def _stdlib() -> frozenset[str]:
    import sys

    return frozenset(sys.stdlib_module_names)
