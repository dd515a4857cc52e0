"""The package's imports follow runtime order (config -> models -> kv cache -> structured / tree / sampling / verify
-> drafting -> engine -> llm -> serving / training / bench -> cli): drafters never reach into the engine, models know
nothing of the cache, drafting or the engine, and the leaves (the serving front doors, training, bench) are imported
by the CLI alone."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "specdec"
LEAVES = ("specdec.serving.api", "specdec.serving.plans", "specdec.serving.openai_format",
          "specdec.serving.served_model", "specdec.serving.responses_api", "specdec.serving.response_store",
          "specdec.serving.messages_api", "specdec.serving.tokenize_api", "specdec.serving.server",
          "specdec.serving.engine_thread", "specdec.serving.replicas", "specdec.serving.chat_path",
          "specdec.serving.admin", "specdec.training", "specdec.bench")
FROM_DRAFTING = ("specdec.drafting", "specdec.engine", "specdec.llm", "specdec.serving", *LEAVES, "specdec.cli")
ABOVE_MODELS = ("specdec.kv_cache", "specdec.structured", "specdec.sampling", "specdec.verify", *FROM_DRAFTING)
MODELS_ORDER = ("cpu", "formats", "blocks", "families", "llama", "heads", "parallel", "quantize", "loader")
MODELS_ABOVE = {m: tuple(f"specdec.models.{n}" for n in MODELS_ORDER[i + 1:]) for i, m in enumerate(MODELS_ORDER)}


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
    ("specdec.config", ("specdec.models", *ABOVE_MODELS)),
    ("specdec.tree", ("specdec.models", *ABOVE_MODELS)),
    ("specdec.models", ABOVE_MODELS),
    # inside models, by concept from the ground up: the native kernels, the block formats and GGUF, the shared
    # blocks, the families, the decoder, the heads, the loader
    ("specdec.models.cpu", MODELS_ABOVE["cpu"]),
    ("specdec.models.formats", MODELS_ABOVE["formats"]),
    ("specdec.models.blocks", MODELS_ABOVE["blocks"]),
    ("specdec.models.families", MODELS_ABOVE["families"]),
    ("specdec.models.llama", MODELS_ABOVE["llama"]),
    ("specdec.models.heads", MODELS_ABOVE["heads"]),
    ("specdec.kv_cache", ABOVE_MODELS[1:]),  # the models do not import it either (models.attention.KVLayers)
    ("specdec.structured", FROM_DRAFTING),
    ("specdec.structured.grammar", ("specdec.structured.xgrammar_backend", "specdec.structured.llguidance_backend")),
    ("specdec.sampling", ("specdec.structured", "specdec.verify", *FROM_DRAFTING)),
    ("specdec.verify", ("specdec.structured", *FROM_DRAFTING)),
    ("specdec.drafting", FROM_DRAFTING[1:]),
    ("specdec.engine", ("specdec.llm", "specdec.serving", *LEAVES, "specdec.cli")),
    ("specdec.llm", ("specdec.serving", *LEAVES, "specdec.cli")),
    ("specdec.serving.tool_calls", ("specdec.drafting", "specdec.engine", "specdec.llm", *LEAVES, "specdec.cli")),
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


def engine_reads(path: Path) -> list[str]:
    """Every `<something>.engine` attribute read in a file (an LLM's engine, reached around its interfaces), and every
    argparse import (the command line's types belong to the CLI)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        server_loop = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and \
            node.value.attr == "server"  # `app.state.server.engine`: the serving loop, not an LLM's engine
        if isinstance(node, ast.Attribute) and node.attr == "engine" and not server_loop:
            found.append(f"{path.name}:{node.lineno} .engine")
        elif isinstance(node, ast.Import) and any(a.name == "argparse" for a in node.names):
            found.append(f"{path.name}:{node.lineno} import argparse")
    return found


def test_bench_and_training_use_the_library_not_the_engine():
    """Bench and training drive an `LLM` through its own methods and `LLM.measuring` (`engine.measuring.Measuring`),
    and take typed configs (`BenchConfig`, `TuneConfig`, `TrainConfig`), never argparse Namespaces. The server's
    own `.engine` (the serving loop a soak drives) is not an LLM's engine."""
    files = sorted((PACKAGE / "bench").rglob("*.py")) + sorted((PACKAGE / "training").rglob("*.py"))
    assert [f for p in files for f in engine_reads(p)] == []


def test_an_engine_read_is_caught(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("import argparse\n\ndef g(llm, app):\n    return llm.engine.model, app.state.server.engine\n")
    assert engine_reads(f) == ["x.py:1 import argparse", "x.py:4 .engine"]
