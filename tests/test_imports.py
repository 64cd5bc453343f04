"""fledge's import graph, read from the source with `ast`: no cycles, and no module imports one
of a higher layer. Imports inside functions count: a lazy import is still an arrow."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "fledge"

# Top to bottom, by package. A module may import modules of its own layer or of a lower one; the
# pipeline's stages are ordered too (perf measures what train made from data's files; doctor
# probes with perf's prompts), so no two stages import each other.
LAYERS = [
    ("cli", {"fledge.cli", "fledge.cli_args", "fledge.cli_checks", "fledge.cli_perf", "fledge.demo"}),
    ("doctor", {"fledge.doctor"}),
    ("perf", {"fledge.perf"}),
    ("train", {"fledge.train"}),
    ("data", {"fledge.data"}),
    ("engine", {"fledge.engine"}),
    ("drafter", {"fledge.drafter"}),
    ("core", {"fledge.core", "fledge"}),
]


def layer_of(module: str) -> int | None:
    """The index in LAYERS of the module itself, or of the subpackage (one level deep) holding it."""
    package = ".".join(module.split(".")[:2])
    for i, (_, names) in enumerate(LAYERS):
        if module in names or (package != module and package in names and package != "fledge"):
            return i
    return None




def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, known: set[str]) -> set[str]:
    """The fledge modules `path` imports anywhere in its body. `from fledge.engine import tree`
    names the submodule; the package itself only when a name it defines is imported."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & known
            out |= subs if len(subs) == len(node.names) else subs | {node.module}
    return {m for m in out if m in known}


def graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    known = {module_name(p) for p in paths}
    return {module_name(p): imports(p, known) - {module_name(p)} for p in paths}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each module that lies on one (depth-first search, sorted order)."""
    found, state = [], {}  # state: 1 on the current path, 2 finished

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(g[m]):
            if state.get(n) == 1:
                found.append(path[path.index(n):] + [n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    return found


def upward(g: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} ({LAYERS[layer_of(m)][0]}) -> {n} ({LAYERS[layer_of(n)][0]})"
                  for m, deps in g.items() for n in deps
                  if layer_of(m) is not None and layer_of(n) is not None and layer_of(n) < layer_of(m))


def test_every_module_has_a_layer():
    missing = sorted(m for m in graph() if layer_of(m) is None)
    assert not missing, f"put these modules in a layer of LAYERS: {missing}"


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_no_arrow_from_a_lower_layer_to_a_higher_one():
    assert upward(graph()) == []


def test_the_checks_can_fail():
    """The cycle and arrow finders on made-up graphs, the reader on two real files."""
    assert upward({"fledge.core.errors": {"fledge.cli"}, "fledge.cli": {"fledge.core.errors"}}) == [
        "fledge.core.errors (core) -> fledge.cli (cli)"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    known = {"fledge", "fledge.core.errors", "fledge.engine", "fledge.engine.few_rows", "fledge.train.loop"}
    assert imports(PACKAGE / "cli.py", known) >= {"fledge.core.errors"}
    assert "fledge.train.loop" not in imports(PACKAGE / "cli.py", known)  # named only in a string
    assert imports(PACKAGE / "engine" / "model.py", known) >= {"fledge.engine.few_rows", "fledge.core.errors"}
    assert "fledge.engine" not in imports(PACKAGE / "engine" / "model.py", known)
