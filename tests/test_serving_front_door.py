"""The serving layer reaches the engine only through its front door.

The rule, read from each module of specdec/serving/ with `ast` (engine_thread.py alone is exempt: it owns the
engine and steps it):
- no import of specdec.engine or its modules, except the plain output dataclasses of specdec.engine.outputs
  (RequestOutput, RequestUpdate);
- no `.engine` read (nor `getattr(..., "engine")`) except off a server (`server.engine`, `self.server.engine`, or
  `self.engine` inside OpenAIServer), whose `engine` is the engine thread (`AsyncEngine`), not the LLM's engine;
- the LLM itself is held only where the server is put together (server.py, served_model.py, replicas.py): the
  modules that plan requests and format answers get a ServedModel, values and functions, never the LLM.
The checks run on synthetic sources first, so the guard is shown to catch what it forbids.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

SERVING = Path(__file__).resolve().parents[1] / "specdec" / "serving"
EXEMPT = "engine_thread.py"
OUTPUTS = {"RequestOutput", "RequestUpdate"}  # specdec.engine.outputs' plain dataclasses
HOLD_THE_LLM = {"server.py", "served_model.py", "replicas.py", EXEMPT}


def _is_engine_module(name: str | None) -> bool:
    return name is not None and (name == "specdec.engine" or name.startswith("specdec.engine."))


def _server_side(node: ast.expr, cls: str | None) -> bool:
    """Whether `node` (what `.engine` is read off) is a server: its `engine` is the engine thread."""
    if isinstance(node, ast.Name):
        return node.id == "server" or (node.id == "self" and cls == "OpenAIServer")
    return isinstance(node, ast.Attribute) and node.attr == "server"


def violations(source: str, filename: str) -> list[str]:
    """Every breach of the rule in one module's source, as 'file:line: what'."""
    found: list[str] = []

    def report(node: ast.AST, what: str) -> None:
        found.append(f"{filename}:{node.lineno}: {what}")

    def visit(node: ast.AST, cls: str | None) -> None:
        if isinstance(node, ast.ClassDef):
            cls = node.name
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_engine_module(alias.name):
                    report(node, f"imports {alias.name}")
                if alias.name == "specdec.llm" and filename not in HOLD_THE_LLM:
                    report(node, "imports specdec.llm")
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = {a.name for a in node.names}
            if node.module == "specdec" and "engine" in names:
                report(node, "imports specdec.engine")
            elif _is_engine_module(node.module) and (node.module != "specdec.engine.outputs" or names - OUTPUTS):
                report(node, f"imports {sorted(names - OUTPUTS) or sorted(names)} from {node.module}")
            if node.module == "specdec.llm" and "LLM" in names and filename not in HOLD_THE_LLM:
                report(node, "imports the LLM (take a ServedModel instead)")
        elif isinstance(node, ast.Attribute) and node.attr == "engine" and not _server_side(node.value, cls):
            report(node, f"reads {ast.unparse(node)}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value == "engine"):
            report(node, f"reads {ast.unparse(node)}")
        for child in ast.iter_child_nodes(node):
            visit(child, cls)

    visit(ast.parse(source, filename), None)
    return found


@pytest.mark.parametrize("source, filename, caught", [
    ("limit = self.llm.engine.max_model_len", "plans.py", True),
    ("def f(llm):\n    return llm.engine.stats()", "server.py", True),
    ("x = getattr(llm, 'engine')", "openai_format.py", True),
    ("from specdec.engine.llm_engine import LLMEngine", "server.py", True),
    ("from specdec.engine.outputs import RequestOutput, eos_ids", "server.py", True),
    ("import specdec.engine.scheduler", "api.py", True),
    ("from specdec import engine", "api.py", True),
    ("from specdec.llm import LLM", "plans.py", True),
    ("import specdec.llm", "messages_api.py", True),
    ("class Other:\n    def f(self):\n        return self.engine", "server.py", True),
    # what the rule allows
    ("from specdec.engine.outputs import RequestOutput, RequestUpdate", "openai_format.py", False),
    ("await self.server.engine.submit(plan)", "replicas.py", False),
    ("class OpenAIServer:\n    def f(self):\n        return self.engine.stats", "server.py", False),
    ("from specdec.llm import LLM, unicode_text", "served_model.py", False),
    ("from specdec.llm import unicode_text", "api.py", False),
    ("llm.engine.step()", EXEMPT, True),  # the rule itself flags it; the exemption is the module list below
])
def test_the_guard_catches_what_it_forbids(source, filename, caught):
    assert bool(violations(source, filename)) is caught


def test_no_serving_module_reaches_into_the_engine():
    modules = sorted(p for p in SERVING.glob("*.py") if p.name != EXEMPT)
    assert {"plans.py", "openai_format.py", "server.py", "responses_api.py", "messages_api.py"} <= \
        {p.name for p in modules}
    found = [v for p in modules for v in violations(p.read_text(), p.name)]
    assert not found, "serving modules reach past the engine's front door:\n" + "\n".join(found)
