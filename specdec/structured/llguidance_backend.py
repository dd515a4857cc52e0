"""Structured output on llguidance: the grammar backend that installs with plain pip (xgrammar's pip dependencies
pull triton, GPU-only and 1 GB), used where xgrammar is not importable or `SPECDEC_GRAMMAR_BACKEND=llguidance`.

`specdec.structured.grammar.GrammarState` drives either library through the same matcher calls; `LLGuidanceMatcher`
gives
llguidance's `LLMatcher` xgrammar's meaning for them:

    call                       xgrammar                      llguidance, through this adapter
    accept_token(t)            False, state unchanged,       try_consume_tokens([t]) (consume_token would
                               when t is refused             leave the matcher in an error state for good)
    a stop token               accepted where the grammar    never passed on (a stopped LLMatcher does not
                               may end; then terminated      record it, so rollback(1) would undo the token
                                                             before it): the adapter marks itself terminated
    rollback(n)                n tokens                      the stop token's mark first, then n - 1 tokens
    fill_next_token_bitmask    the tokens accept takes       the same with `no_forcing` (by default llguidance
                                                             allows only the canonical tokens of forced text)
    find_jump_forward_string   the forced text               compute_ff_bytes, cut to whole characters
    is_completed               the grammar may end here      is_accepting

Constraints are written as `specdec.structured.grammar` writes them for xgrammar, so both accept the same texts: JSON
with compact separators (", " and ": ", no free whitespace, so keys and punctuation are forced text that
jump-forward drafts), read as xgrammar reads a schema (`strict_schema`), the same keywords refused
(`check_schema`); a choice, an EBNF grammar (through llguidance's GBNF converter) and a structural tag as Lark,
JSON contents as `%json`. Where they still differ, llguidance follows JSON Schema and xgrammar does not: it
enforces `multipleOf` with a range, `minProperties` and `patternProperties`, allows escapes in bounded
strings, and refuses a `format` it does not know (xgrammar ignores it).
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from specdec.config import SpecdecError, StructuredOutput
from specdec.structured.grammar import GrammarCompiler, GrammarState, check_schema

if TYPE_CHECKING:
    import llguidance
    import torch
    from transformers import PreTrainedTokenizerBase

JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False,
                "json_allow_general_unicode_escapes": True}  # "\u00e9" in a string, as xgrammar takes it
# Masks allow every token the matcher accepts, as xgrammar's do: a greedy row is masked only where `accept`
# refuses its argmax, which must then be the masked argmax (llguidance's default allows only the canonical tokens
# of forced text in masks, not in `accept`)
NO_FORCING = '%llguidance {"no_forcing": true}\n'


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError as e:
        raise SpecdecError("SPECDEC_GRAMMAR_BACKEND=llguidance needs the llguidance package "
                           "(pip install llguidance, or specdec[serve])") from e
    return llguidance


class LLGuidanceMatcher:
    """An `LLMatcher` with the matcher calls `GrammarState` makes on xgrammar's (see the module's table)."""

    def __init__(self, matcher: llguidance.LLMatcher, stop_token_ids: list[int]) -> None:
        self.matcher, self.stop_token_ids = matcher, frozenset(stop_token_ids)
        self.terminated = False  # a stop token was accepted

    def accept_token(self, token: int) -> bool:
        if self.terminated:
            return False
        if token in self.stop_token_ids:
            self.terminated = self.matcher.is_accepting()
            return self.terminated
        return self.matcher.try_consume_tokens([token]) == 1

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and self.terminated:
            self.terminated, num_tokens = False, num_tokens - 1
        if num_tokens and not self.matcher.rollback(num_tokens):
            raise RuntimeError(f"llguidance could not roll back {num_tokens} tokens: {self.matcher.get_error()}")

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of an int32 CPU bitmask [rows, ceil(V / 32)], written in place (xgrammar's layout)."""
        words = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())

    def find_jump_forward_string(self) -> str:
        forced = self.matcher.compute_ff_bytes()
        try:
            return forced.decode()
        except UnicodeDecodeError as e:  # a character cut at the end: its first bytes wait for the rest
            return forced[: e.start].decode()

    def is_terminated(self) -> bool:
        return self.terminated

    def is_completed(self) -> bool:
        return self.matcher.is_accepting()


class LLGuidanceCompiler(GrammarCompiler):
    """`GrammarCompiler` on llguidance: the same constraints, cache and states. A compiled grammar is an
    `LLMatcher` that never moves; each request's state is a copy of it (5 us, against 0.6 ms and up to build)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: list[int]) -> None:
        super().__init__(vocab_size, stop_token_ids)
        llg = _llguidance()
        try:
            self.tokenizer = llg.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=self.stop_token_ids)
        except ValueError as e:
            raise SpecdecError(f"structured output on llguidance needs a fast (Rust) tokenizer: {e}") from None

    def _compile(self, kind: str, text: str):
        llg = _llguidance()
        field = {"json_object": "json_object", "choice": "choice"}.get(kind, kind.split(":")[0])
        try:
            if kind in ("json", "json_object"):
                lark = "start: " + json_lark(json.loads(text or '{"type": "object"}'))
            elif kind == "regex":
                lark = f"start: /{llg.regex_to_lark(text)}/"
            elif kind == "structural_tag":
                lark = structural_tag_lark(json.loads(text))
            elif kind == "grammar:lark":
                lark = text
            elif kind == "choice":  # `choice_grammar`'s alternatives are JSON string literals, as Lark's are
                lark = "start: " + text.removeprefix("root ::= ")
            else:  # EBNF (GBNF)
                from llguidance.gbnf_to_lark import any_to_lark

                try:
                    lark = any_to_lark(text)
                except Exception as e:  # GbnfToLarkError, and whatever the converter trips on
                    raise ValueError(f"cannot convert the EBNF grammar to Lark: {e}") from None
        except json.JSONDecodeError as e:
            raise SpecdecError(f"structured_output.{field} is not valid JSON: {e}") from None
        except (ValueError, TypeError) as e:
            raise SpecdecError(f"invalid structured_output.{field}: {_first_line(e)}") from None
        matcher = llg.LLMatcher(self.tokenizer, NO_FORCING + lark, log_level=0)
        if matcher.is_error():
            raise SpecdecError(f"invalid structured_output.{field}: {_first_line(matcher.get_error())}")
        return matcher

    def state(self, so: StructuredOutput) -> GrammarState:
        matcher = LLGuidanceMatcher(self.compile(so).deep_copy(), self.stop_token_ids)
        return GrammarState(matcher, self.vocab_size, self.stop_token_ids)


def _first_line(error: object) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


# JSON schema keywords whose value is one subschema, a list of them, or a map of names to them
_SUBSCHEMA = ("items", "additionalProperties", "unevaluatedProperties", "propertyNames", "contains", "not", "if",
              "then", "else", "additionalItems")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def strict_schema(node: Any) -> Any:  # a JSON value
    """The schema as xgrammar reads it: `"additionalProperties": false` wherever an object lists its properties
    and says nothing of others, and no items past `prefixItems` (its strict mode: the model cannot wander into
    keys of its own), `"uniqueItems": false` left out (llguidance refuses the keyword), and a string's
    `pattern` matching the whole string (JSON Schema's is a search, so `[0-2][0-9]:[0-5][0-9]` would take any
    string holding a time: the model ran on past it, measured)."""
    if not isinstance(node, dict):
        return node
    out = dict(node)
    if isinstance(out.get("pattern"), str):
        out["pattern"] = f"^(?:{out['pattern']})$"
    if out.get("uniqueItems") is False:  # says nothing, and llguidance refuses the keyword
        del out["uniqueItems"]
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = strict_schema(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict_schema(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: strict_schema(s) for name, s in out[key].items()}
    if "properties" in out and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    if "prefixItems" in out and "items" not in out:  # likewise no items past the listed ones
        out["items"] = False
    return out


def json_lark(schema: object) -> str:
    """A JSON schema as a Lark expression (`%json`), checked and written as for xgrammar (see the module)."""
    if not isinstance(schema, dict):
        raise ValueError("a JSON schema must be a JSON object")
    check_schema(schema)
    return "%json " + json.dumps({**strict_schema(schema), "x-guidance": JSON_OPTIONS})


# ---- structural tags (xgrammar's format) as Lark ------------------------------------------------------------
def structural_tag_lark(tag: dict) -> str:
    """The Lark grammar of a structural tag: `{"type": "structural_tag", "format": F}`, F a tag
    (`begin content end`), tags with a separator, triggered tags (free text; a trigger starts a tag) or what
    they contain (sequence, or, optional, plus, star, const_string, json_schema, regex, any_text)."""
    if not isinstance(tag, dict) or tag.get("type") != "structural_tag" or not isinstance(tag.get("format"), dict):
        raise ValueError('a structural tag is {"type": "structural_tag", "format": {...}}')
    writer = _LarkWriter()
    start = writer.format(tag["format"])
    return "\n".join([f"start: {start}", *writer.rules])


def _literal(text: str) -> str:
    return json.dumps(text) if text else ""


def _regex_literal(text: str) -> str:
    """A regex matching `text` exactly (every character but letters and digits escaped: safe in `/.../`)."""
    return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text)


def _fields(node: dict, *names: str) -> list:
    if not isinstance(node, dict):
        raise ValueError(f"a structural tag format must be a JSON object, not {json.dumps(node)[:40]}")
    missing = [n for n in names if n not in node]
    if missing:
        raise ValueError(f"a {node.get('type')!r} format needs {', '.join(map(repr, missing))}")
    return [node[n] for n in names]


class _LarkWriter:
    """Writes formats as Lark expressions, adding the rules they need to `rules` (names numbered)."""

    REPEATS = {"optional": "?", "plus": "+", "star": "*"}

    def __init__(self) -> None:
        self.rules: list[str] = []

    def name(self, prefix: str) -> str:
        return f"{prefix}_{len(self.rules)}"

    def format(self, node: object) -> str:
        kind = node.get("type") if isinstance(node, dict) else None
        if kind == "const_string":
            return _literal(*_fields(node, "value")) or '""'
        if kind == "json_schema":
            return self.json_schema(node)
        if kind == "regex":
            return f"/{_llguidance().regex_to_lark(_fields(node, 'pattern')[0])}/"
        if kind == "any_text":
            if node.get("excludes"):
                raise ValueError("any_text with excludes is not supported on the llguidance grammar backend")
            return "/(?s:.*)/"
        if kind == "sequence":
            return "(" + " ".join(self.format(e) for e in _fields(node, "elements")[0]) + ")"
        if kind == "or":
            return "(" + " | ".join(self.format(e) for e in _fields(node, "elements")[0]) + ")"
        if kind in self.REPEATS:
            return f"({self.format(_fields(node, 'content')[0])}){self.REPEATS[kind]}"
        if kind == "tag":
            return self.tag(node)
        if kind == "tags_with_separator":
            return self.tags_with_separator(node)
        if kind == "triggered_tags":
            return self.triggered_tags(node)
        raise ValueError(f"the structural tag format {kind!r} is not supported on the llguidance grammar backend")

    def json_schema(self, node: dict) -> str:
        schema = _fields(node, "json_schema")[0]
        if node.get("style", "json") != "json":
            raise ValueError(f"json_schema style {node['style']!r} is not supported on the llguidance grammar backend")
        return json_lark(json.loads(schema) if isinstance(schema, str) else schema)

    def tag(self, node: dict, head: str | None = None) -> str:
        """`begin content end`; `head` (a rule that matched the text up to and with the begin's trigger) stands
        for the begin's first characters. Any text as content runs up to the first end string (a lazy rule)."""
        begin, content, end = _fields(node, "begin", "content", "end")
        ends = [end] if isinstance(end, str) else end
        if not isinstance(begin, str) or not isinstance(ends, list) or not all(isinstance(e, str) for e in ends):
            raise ValueError("a tag's begin and end must be strings on the llguidance grammar backend")
        ends_expr = "(" + " | ".join(_literal(e) or '""' for e in ends) + ")"
        if isinstance(content, dict) and content.get("type") == "any_text" and not content.get("excludes") \
                and any(ends):
            rule = self.name("text_until_end")
            self.rules.append(f"{rule}[lazy]: /(?s:.*)/ {ends_expr}")
            body = rule
        else:
            body = f"{self.format(content)} {ends_expr}"
        return f"({head or ''} {_literal(begin)} {body})"

    def tags_with_separator(self, node: dict) -> str:
        tags, separator = _fields(node, "tags", "separator")
        one = "(" + " | ".join(self.tag(t) for t in tags) + ")"
        many = one if node.get("stop_after_first") else f"{one} ({_literal(separator)} {one})*"
        return many if node.get("at_least_one") else f"({many})?"

    def triggered_tags(self, node: dict) -> str:
        """Free text with tags, a tag where a trigger appears. Text holds no trigger (nor an `excludes`
        string): a tag starts at its trigger's first occurrence, matched by a lazy rule for text then trigger.
        With at_least_one the output starts with a tag; with stop_after_first it ends after one (xgrammar's)."""
        triggers, tags = _fields(node, "triggers", "tags")
        text = self.name("TEXT")
        banned = "|".join(_regex_literal(s) for s in [*triggers, *node.get("excludes", [])] if s)
        self.rules.append(f"{text}: /(?s:.*)/" + (f" & ~/(?s:.*)({banned})(?s:.*)/" if banned else ""))
        heads = {}
        for trigger in triggers:
            heads[trigger] = self.name("text_then_trigger")
            self.rules.append(f"{heads[trigger]}[lazy]: {text} {_literal(trigger)}")
        after_text = []
        for t in tags:
            begin = t.get("begin") if isinstance(t, dict) else None
            trigger = next((s for s in triggers if isinstance(begin, str) and begin.startswith(s)), None)
            if trigger is None:
                raise ValueError(f"the tag beginning {begin!r} starts with none of the triggers {triggers}")
            after_text.append(self.tag({**t, "begin": begin[len(trigger):]}, heads[trigger]))
        any_tag = "(" + " | ".join(after_text) + ")"
        first = "(" + " | ".join(self.tag(t) for t in tags) + ")"
        if node.get("stop_after_first"):
            return first if node.get("at_least_one") else f"({any_tag} | {text})"
        return f"{first if node.get('at_least_one') else ''} {any_tag}* {text}"
