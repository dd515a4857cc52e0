"""Structured output on xgrammar: the grammar library we prefer where it imports (on SmolLM2's 49,152 tokens it
fills a next-token mask in 2 us median and 8 us at p90 over a nested JSON schema, against llguidance's 4 / 6 us;
docs/benchmarks-history.md, "Structured output on llguidance"). It rolls back any number of tokens and finds the
jump-forward string, which is all `GrammarState` asks of a matcher.

JSON schemas are written with compact separators and strict JSON characters (`json_schema_ebnf`), so a schema's
keys and punctuation are forced text that jump-forward drafts.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING

from specdec.config import SpecdecError, StructuredOutput
from specdec.structured.grammar import GrammarCompiler, GrammarState, check_schema

if TYPE_CHECKING:
    import xgrammar
    from transformers import PreTrainedTokenizerBase


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:  # pragma: no cover - a broken install
        raise SpecdecError("structured output needs the xgrammar package (pip install --no-deps xgrammar "
                           "apache-tvm-ffi); see the README's setup") from e
    return xgrammar


# xgrammar 0.2.8 writes a string with minLength / maxLength as characters from [^"\\\r\n], which lets control
# characters through unescaped (invalid JSON); every other string rule it writes excludes them.
_LOOSE_CHAR = r'[^\"\\\r\n]'
_STRICT_CHAR = r'[^\0-\x1f\"\\]'


def json_schema_ebnf(schema: str) -> str:
    """The EBNF grammar of a JSON schema (xgrammar's, compact separators), its characters strict JSON's."""
    check_schema(json.loads(schema))
    grammar = _xgrammar().Grammar.from_json_schema(schema, any_whitespace=False)
    return str(grammar).replace(_LOOSE_CHAR, _STRICT_CHAR)


def structural_tag_grammar(tag: dict) -> xgrammar.Grammar:
    """xgrammar's grammar of a structural tag whose JSON schema contents are written as `json_schema_ebnf` writes
    them (compact and strict, so a tool call's keys and punctuation are forced text: jump-forward drafts them)."""
    def strict(node: object):
        if isinstance(node, list):
            return [strict(n) for n in node]
        if not isinstance(node, dict):
            return node
        if node.get("type") == "json_schema" and "json_schema" in node:
            schema = node["json_schema"]
            text = schema if isinstance(schema, str) else json.dumps(schema)
            return {"type": "grammar", "grammar": json_schema_ebnf(text)}
        return {k: strict(v) for k, v in node.items()}

    if not isinstance(tag, dict) or tag.get("type") != "structural_tag" or not isinstance(tag.get("format"), dict):
        raise ValueError('a structural tag is {"type": "structural_tag", "format": {...}}')
    return _xgrammar().Grammar.from_structural_tag(json.dumps(strict(tag)))


class XGrammarCompiler(GrammarCompiler):
    """`GrammarCompiler` on xgrammar."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: list[int]) -> None:
        super().__init__(vocab_size, stop_token_ids)
        xgr = _xgrammar()
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(stop_token_ids))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)

    def _compile(self, kind: str, text: str):
        field = {"json_object": "json_object", "choice": "choice"}.get(kind, kind.split(":")[0])
        try:
            if kind in ("json", "json_object"):
                json.loads(text or "{}")  # a clearer message than the compiler's for text that is not JSON at all
                return self.compiler.compile_grammar(json_schema_ebnf(text or '{"type": "object"}'))
            if kind == "regex":
                return self.compiler.compile_regex(text)
            if kind == "structural_tag":
                return self.compiler.compile_grammar(structural_tag_grammar(json.loads(text)))
            if kind == "grammar:lark":
                return self.compiler.compile_lark(text)
            return self.compiler.compile_grammar(text)  # EBNF (GBNF), and the choice grammar
        except json.JSONDecodeError as e:
            raise SpecdecError(f"structured_output.{field} is not valid JSON: {e}") from None
        except (RuntimeError, ValueError, TypeError) as e:
            message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise SpecdecError(f"invalid structured_output.{field}: {message}") from None

    def state(self, so: StructuredOutput) -> GrammarState:
        return GrammarState(_xgrammar().GrammarMatcher(self.compile(so)), self.vocab_size, self.stop_token_ids)
