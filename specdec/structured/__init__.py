"""Structured output: a request's grammar (JSON schema, any JSON object, regex, EBNF or Lark grammar, a choice of
strings, a structural tag) compiled by one of two libraries behind the same `GrammarState`:

    grammar.py              backend-neutral: constraint texts, the compiled-grammar cache, the request's state, masks
    xgrammar_backend.py     xgrammar (preferred where it imports: its masks are the faster)
    llguidance_backend.py   llguidance (the one plain `pip install specdec[serve]` brings)

`compiler_for` builds the chosen library's compiler; SPECDEC_GRAMMAR_BACKEND=xgrammar|llguidance chooses.
"""
from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

from specdec.config import SpecdecError
from specdec.structured.grammar import GrammarCompiler, GrammarState, apply_bitmask, charge_grammar_time, mask_logits
from specdec.structured.llguidance_backend import LLGuidanceCompiler
from specdec.structured.xgrammar_backend import XGrammarCompiler

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

BACKEND_ENV = "SPECDEC_GRAMMAR_BACKEND"


def grammar_backend() -> str:
    """The grammar library: $SPECDEC_GRAMMAR_BACKEND, else xgrammar where it imports (its masks are the
    faster), else llguidance (the one `pip install specdec[serve]` brings)."""
    chosen = os.environ.get(BACKEND_ENV, "").strip().lower()
    if chosen in ("xgrammar", "llguidance"):
        return chosen
    if chosen:
        raise SpecdecError(f"{BACKEND_ENV}={chosen!r}: expected xgrammar or llguidance")
    for name in ("xgrammar", "llguidance"):
        try:
            importlib.import_module(name)
            return name
        except ImportError:
            pass
    raise SpecdecError("structured output needs a grammar library: pip install llguidance (or specdec[serve]), "
                       "or xgrammar (pip install --no-deps xgrammar apache-tvm-ffi; see the README's setup)")


def compiler_for(tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: list[int]) -> GrammarCompiler:
    """The compiler of `grammar_backend()`'s library."""
    cls = LLGuidanceCompiler if grammar_backend() == "llguidance" else XGrammarCompiler
    return cls(tokenizer, vocab_size, stop_token_ids)


__all__ = ["BACKEND_ENV", "GrammarCompiler", "GrammarState", "apply_bitmask", "charge_grammar_time", "compiler_for",
           "grammar_backend", "mask_logits"]
