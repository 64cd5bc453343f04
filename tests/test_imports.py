"""fledge's import graph, read from the source with `ast`: no cycles, and no module imports one
of a higher layer. Imports inside functions count: a lazy import is still an arrow."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "fledge"

# Top to bottom. A module may import modules of its own layer or of a lower one.
LAYERS = [
    ("cli", {"fledge.cli", "fledge.cli_args"}),
    ("workflows", {"fledge.demo", "fledge.adapt", "fledge.tune", "fledge.bench", "fledge.doctor", "fledge.lint",
                   "fledge.probe", "fledge.checks", "fledge.train", "fledge.regen", "fledge.prompts", "fledge.data", "fledge.tokenize",
                   "fledge.vocab", "fledge.vllm_cpu", "fledge.hwmodel", "fledge.calibrate", "fledge.engine.cli",
                   "fledge.acceptance", "fledge.serving"}),
    ("engine/checkpoint/features", {"fledge.checkpoint", "fledge.features", "fledge.engine", "fledge.engine.attention",
                                    "fledge.engine.drafters", "fledge.engine.few_rows", "fledge.engine.generate",
                                    "fledge.engine.hf", "fledge.engine.model", "fledge.engine.resident",
                                    "fledge.engine.rounds", "fledge.engine.spec", "fledge.engine.stats",
                                    "fledge.engine.stream", "fledge.engine.tree"}),
    ("draft/target", {"fledge.draft", "fledge.layout", "fledge.target", "fledge.weights"}),
    ("config/conventions/util", {"fledge", "fledge.catalog", "fledge.config", "fledge.conventions", "fledge.util",
                                 "fledge.openai_client", "fledge.conversations"}),
]
LAYER = {m: i for i, (_, mods) in enumerate(LAYERS) for m in mods}


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
    return sorted(f"{m} ({LAYERS[LAYER[m]][0]}) -> {n} ({LAYERS[LAYER[n]][0]})"
                  for m, deps in g.items() for n in deps if m in LAYER and n in LAYER and LAYER[n] < LAYER[m])


def test_every_module_has_a_layer():
    missing = sorted(set(graph()) - set(LAYER))
    assert not missing, f"put these modules in a layer of LAYERS: {missing}"


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_no_arrow_from_a_lower_layer_to_a_higher_one():
    assert upward(graph()) == []


def test_the_checks_can_fail():
    """The cycle and arrow finders on made-up graphs, the reader on two real files."""
    assert upward({"fledge.util": {"fledge.cli"}, "fledge.cli": {"fledge.util"}}) == [
        "fledge.util (config/conventions/util) -> fledge.cli (cli)"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    known = {"fledge", "fledge.util", "fledge.engine", "fledge.engine.few_rows", "fledge.train"}
    assert imports(PACKAGE / "cli.py", known) >= {"fledge.util"}
    assert "fledge.train" not in imports(PACKAGE / "cli.py", known)  # named only in a string
    assert imports(PACKAGE / "engine" / "model.py", known) >= {"fledge.engine.few_rows", "fledge.util"}
    assert "fledge.engine" not in imports(PACKAGE / "engine" / "model.py", known)
