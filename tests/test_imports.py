"""The package's imports follow runtime order: drafters never reach into the engine, models know nothing of
drafting or the engine, and the leaves (api, protocol, server, replicas, train, distill, bench) are imported by the CLI alone."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "specdec"
LEAVES = ("specdec.api", "specdec.protocol", "specdec.server", "specdec.replicas", "specdec.train", "specdec.distill", "specdec.bench")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every specdec module a file imports, at the top or inside functions (lazy imports count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}  # `from specdec import bench`
    return {m for m in found if m == "specdec" or m.startswith("specdec.")}


IMPORTS = {module_name(p): imports_of(p) for p in sorted(PACKAGE.rglob("*.py"))}


def under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def offenders(importers: str, forbidden: tuple[str, ...]) -> list[str]:
    return [f"{m} imports {i}" for m, imported in IMPORTS.items() if under(m, importers)
            for i in sorted(imported) if any(under(i, f) for f in forbidden)]


def test_the_walk_sees_the_whole_package():
    assert {"specdec.config", "specdec.drafting.base", "specdec.engine.llm_engine", "specdec.cli"} <= set(IMPORTS)
    assert "specdec.engine.speculator" in IMPORTS["specdec.engine.llm_engine"]  # and reads imports


@pytest.mark.parametrize("importers, forbidden", [
    ("specdec.drafting", ("specdec.engine", "specdec.llm", *LEAVES, "specdec.cli")),
    ("specdec.models", ("specdec.drafting", "specdec.engine", "specdec.llm", *LEAVES, "specdec.cli")),
    ("specdec.engine", ("specdec.llm", *LEAVES, "specdec.cli")),
    ("specdec.tool_calls", ("specdec.drafting", "specdec.engine", "specdec.llm", *LEAVES, "specdec.cli")),
    ("specdec.grammar", ("specdec.grammar_llguidance", "specdec.drafting", "specdec.engine", "specdec.llm", *LEAVES,
                         "specdec.cli")),
    ("specdec.grammar_llguidance", ("specdec.drafting", "specdec.engine", "specdec.llm", *LEAVES, "specdec.cli")),
])
def test_imports_never_climb(importers, forbidden):
    assert offenders(importers, forbidden) == []


def test_only_the_cli_imports_the_leaves():
    bad = [f"{m} imports {i}" for m, imported in IMPORTS.items() for i in sorted(imported)
           if any(under(i, leaf) for leaf in LEAVES)
           and m != "specdec.cli" and not any(under(m, leaf) for leaf in LEAVES)]
    assert bad == []


def test_a_violation_is_caught(tmp_path):
    """The walk itself: a lazy import inside a function is found."""
    f = tmp_path / "x.py"
    f.write_text("def g():\n    from specdec.engine.sequence import Sequence\n    import specdec.bench.prompts\n")
    assert imports_of(f) == {"specdec.engine.sequence", "specdec.engine.sequence.Sequence", "specdec.bench.prompts"}
