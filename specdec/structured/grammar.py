"""Structured output, whatever the grammar library: the constraint texts both libraries share, the compiled-grammar
cache (`GrammarCompiler`, one subclass per library: `xgrammar_backend`, `llguidance_backend`), a request's matcher
state (`GrammarState`), and masking a step's logits by it (`mask_logits`, `apply_bitmask`).

How the engine uses a `GrammarState` (on the host; accept and rollback take microseconds, a mask fill 3-1,300 us
depending on the grammar's state):

    plain step:       sampled rows: logits masked by the grammar before sampling; greedy rows: masked only when
                      the target's argmax is refused (then the masked argmax is taken); the committed token is
                      accepted into the state
    speculative step: the draft is filtered (a node whose token the grammar refuses after its path is dropped
                      with its subtree; text the grammar forces is drafted, "jump-forward"), and each
                      verification row is masked by the grammar after its own path, so verification (greedy or
                      sampled, chains or trees) runs on the masked target distribution; every walk over draft
                      paths rolls back to the committed tokens, which are accepted after verification

so speculative output is constrained decoding's own output, token for token (greedy) or in distribution.
"""
from __future__ import annotations

import functools
import json
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Protocol

import torch

from specdec.config import SpecdecError, StructuredOutput
from specdec.models.cpu import native
from specdec.models.loader import token_codec
from specdec.sampling import greedy_tokens

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Keywords xgrammar 0.2.8 accepts but does not enforce (measured: the grammar is the same without them, or
# accepts what they forbid). A schema using one is refused rather than silently not honoured.
UNENFORCED_KEYWORDS = frozenset({"not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
                                 "uniqueItems", "contains", "minContains", "maxContains", "unevaluatedProperties",
                                 "unevaluatedItems", "additionalItems"})
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples", "required", "title", "description",
                            "$comment", "$schema", "$id", "$ref", "type", "format", "pattern"})
_NAMED_SUBSCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions"})


def check_schema(node: object, path: str = "#") -> None:
    """Refuse a JSON schema keyword the grammar backend would not enforce, naming where it is."""
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        where = f"{path}/{key}"
        if key in _DATA_KEYWORDS:
            continue
        if key in UNENFORCED_KEYWORDS and not (key == "uniqueItems" and value is False):
            raise SpecdecError(f"invalid structured_output.json: the keyword {key!r} at {path} is not supported "
                               "(the grammar could not enforce it); remove it or enforce it after decoding")
        if key == "allOf" and isinstance(value, list) and len(value) > 1:
            raise SpecdecError(f"invalid structured_output.json: 'allOf' with {len(value)} schemas at {path} is not "
                               "supported; merge them into one schema")
        if key in _NAMED_SUBSCHEMAS and isinstance(value, dict):
            for name, sub in value.items():
                check_schema(sub, f"{where}/{name}")
        elif isinstance(value, dict):
            check_schema(value, where)
        elif isinstance(value, list):
            for i, sub in enumerate(value):
                check_schema(sub, f"{where}/{i}")


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose only sentences are the given strings (JSON string literals are valid EBNF ones)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class GrammarCompiler:
    """Compiles structured-output constraints for one tokenizer; compiled grammars are kept by their text
    (`MAX_CACHED`, least recently used first out), so a schema every request repeats compiles once. A library's
    subclass builds its library's compiler and writes `_compile` and `state`."""

    MAX_CACHED = 256

    def __init__(self, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.vocab_size, self.stop_token_ids = vocab_size, sorted(stop_token_ids)
        self.cache: OrderedDict[tuple[str, str], object] = OrderedDict()

    def compile(self, so: StructuredOutput) -> object:  # the library's compiled grammar
        """The compiled grammar of `so`; a SpecdecError naming the field when it is malformed."""
        kind = so.kind
        if kind == "json":
            text = so.json if isinstance(so.json, str) else json.dumps(so.json)  # key order is output order
        elif kind == "json_object":
            text = ""
        elif kind == "choice":
            text = choice_grammar(so.choice)
        elif kind == "grammar":
            kind, text = f"grammar:{so.grammar_syntax}", so.grammar
        elif kind == "structural_tag":
            text = so.structural_tag if isinstance(so.structural_tag, str) else json.dumps(so.structural_tag)
        else:
            text = so.regex
        key = (kind, text)
        if key in self.cache:
            self.cache.move_to_end(key)
            return self.cache[key]
        compiled = self._compile(kind, text)
        self.cache[key] = compiled
        if len(self.cache) > self.MAX_CACHED:
            self.cache.popitem(last=False)
        return compiled

    def _compile(self, kind: str, text: str):
        """The library's compiled grammar of one constraint (kind: json, json_object, regex, choice,
        structural_tag, grammar:ebnf or grammar:lark)."""
        raise NotImplementedError

    def state(self, so: StructuredOutput) -> GrammarState:
        """A fresh matcher state for one request."""
        raise NotImplementedError


class Matcher(Protocol):
    """The matcher calls `GrammarState` makes: xgrammar's `GrammarMatcher`, or `LLGuidanceMatcher` over
    llguidance's `LLMatcher` (the backends are not imported here)."""

    def accept_token(self, token: int, /) -> bool: ...
    def rollback(self, num_tokens: int, /) -> None: ...
    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int, /) -> object: ...
    def find_jump_forward_string(self) -> str: ...
    def is_terminated(self) -> bool: ...
    def is_completed(self) -> bool: ...


class GrammarState:
    """One request's position in its grammar, after its committed tokens. `accept` advances it by one committed
    token; the draft methods walk a draft's paths (accept, then the library's own rollback: no re-parse) and
    always leave it where it was."""

    def __init__(self, matcher: Matcher, vocab_size: int, stop_token_ids: list[int] = ()) -> None:
        self.matcher, self.vocab_size, self.stop_token_ids = matcher, vocab_size, list(stop_token_ids)
        self.width = (vocab_size + 31) // 32
        self.dead = False  # nothing may follow the committed tokens: the request must stop
        self.seconds = 0.0  # time the engine spent on this request's grammar (its `grammar_s` metric)

    def accept(self, token: int) -> bool:
        """Advance by one committed token; a token the grammar refuses (only possible past its end, e.g. under
        ignore_eos) leaves the state and makes it a dead end."""
        ok = self.matcher.accept_token(token)
        self.dead = self.dead or not ok
        return ok

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    # ---- a draft tree: node j's parent is parents[j] (-1: the committed tokens); row 0 is the state after the
    # committed tokens, row j + 1 the state after node j's path (it verifies node j's children) ----------------
    def filter_draft(self, tokens: list[int], parents: list[int], tokenizer: PreTrainedTokenizerBase | None = None,
                     limit: int = 0) -> tuple[list[int], list[int], list[int]]:
        """The nodes the grammar allows: a node is kept when its parent is and its token is accepted after its
        parent's path. Returns the kept tokens, their parents (re-indexed) and each one's index in the draft
        (-1: forced text). With a `tokenizer`, text the grammar forces is drafted at no model cost
        (jump-forward): a kept chain shorter than `limit` is extended by the forced text after it, as far as the
        grammar accepts it. A draft the grammar accepts is kept even where it tokenizes the forced text
        differently: the drafter may know the target's tokenization better than a fresh encoding of the text
        (`", "` then `age` against `", "age`) does."""
        if self.terminated:
            self.dead = True
            return [], [], []
        kept: list[int] = []
        kept_parents: list[int] = []
        origin: list[int] = []
        new_index: dict[int, int] = {}  # draft node -> kept node
        path: list[int] = []  # the kept nodes the matcher has accepted, root first
        for j, (token, parent) in enumerate(zip(tokens, parents)):
            if parent >= 0 and parent not in new_index:
                continue  # below a dropped node
            p = -1 if parent < 0 else new_index[parent]
            self._walk_to(path, p, kept, kept_parents)
            if self.terminated or not self.matcher.accept_token(token):
                continue
            new_index[j] = len(kept)
            path.append(len(kept))
            kept.append(token)
            kept_parents.append(p)
            origin.append(j)
        if tokenizer is not None and len(kept) < limit and kept_parents == list(range(-1, len(kept) - 1)):
            self._walk_to(path, len(kept) - 1, kept, kept_parents)
            if not self.terminated:
                forced = self._forced(tokenizer)
                for token in forced[: limit - len(kept)]:
                    if not self.matcher.accept_token(token):
                        break
                    path.append(len(kept))
                    kept_parents.append(len(kept) - 1)
                    kept.append(token)
                    origin.append(-1)
                stop = self._only_stop() if len(kept) < limit else None
                if stop is not None:  # the text is complete: its stop token is forced too
                    self.matcher.accept_token(stop)
                    path.append(len(kept))
                    kept_parents.append(len(kept) - 1)
                    kept.append(stop)
                    origin.append(-1)
        self._walk_to(path, -1, kept, kept_parents)
        return kept, kept_parents, origin

    def refused_rows(self, tokens: list[int], parents: list[int], choices: list[int],
                     rows: list[int] | None = None) -> list[int]:
        """Rows r (0 .. len(tokens), or those in `rows`) whose token choices[r] the grammar refuses after row r's
        path: where a greedy target's own choice needs the mask (elsewhere the masked argmax is that same
        token)."""
        refused, path = [], []
        for r in range(len(choices)) if rows is None else rows:
            self._walk_to(path, r - 1, tokens, parents)
            if self.terminated or not self.matcher.accept_token(choices[r]):
                refused.append(r)
            else:
                self.matcher.rollback(1)
        self._walk_to(path, -1, tokens, parents)
        return refused

    def masks(self, tokens: list[int], parents: list[int], rows: list[int] | None = None) -> torch.Tensor:
        """[1 + len(tokens), width] int32: the allowed next tokens after each row's path, for `rows` (None: all);
        every token for the others. Nothing after a stop token. A root row that allows nothing marks the request
        dead and is left open (the engine drops that row's token and stops the request)."""
        bitmask = torch.full((1 + len(tokens), self.width), -1, dtype=torch.int32)
        path: list[int] = []
        for r in range(1 + len(tokens)) if rows is None else rows:
            self._walk_to(path, r - 1, tokens, parents)
            if self.terminated:
                bitmask[r] = 0
            else:
                self.matcher.fill_next_token_bitmask(bitmask, r)
        self._walk_to(path, -1, tokens, parents)
        if (rows is None or 0 in rows) and not bool(bitmask[0].any()):
            self.dead = True
            bitmask[0] = -1
        return bitmask

    def _only_stop(self) -> int | None:
        """The stop token, when it is the one token the grammar allows next (the text is complete, as after a
        JSON object's closing brace). Only where the grammar may end is the mask filled."""
        if self.terminated or not self.matcher.is_completed():
            return None
        bitmask = torch.zeros((1, self.width), dtype=torch.int32)
        self.matcher.fill_next_token_bitmask(bitmask, 0)
        words = bitmask[0].nonzero().flatten().tolist()
        if len(words) != 1 or int(bitmask[0, words[0]]).bit_count() != 1:
            return None
        word = int(bitmask[0, words[0]]) & 0xFFFFFFFF
        token = 32 * words[0] + word.bit_length() - 1
        return token if token in self.stop_token_ids else None

    def _forced(self, tokenizer: PreTrainedTokenizerBase) -> list[int]:
        """The text the grammar forces next (xgrammar's jump-forward string), tokenized."""
        text = self.matcher.find_jump_forward_string()
        return encode_text(tokenizer, text) if text else []

    def _walk_to(self, path: list[int], node: int, tokens: list[int], parents: list[int]) -> None:
        """Move the matcher from the end of `path` (nodes, root first) to node `node`'s path (-1: the committed
        tokens): roll back to their common prefix, then accept the rest (each was accepted from the same state
        before, so it is again)."""
        target = []
        while node >= 0:
            target.append(node)
            node = parents[node]
        target.reverse()
        common = 0
        while common < min(len(path), len(target)) and path[common] == target[common]:
            common += 1
        if len(path) > common:
            self.matcher.rollback(len(path) - common)
        del path[common:]
        for n in target[common:]:
            self.matcher.accept_token(tokens[n])
            path.append(n)


@functools.lru_cache(maxsize=4096)
def _encode_cached(tokenizer: PreTrainedTokenizerBase, text: str) -> tuple[int, ...]:
    return tuple(token_codec(tokenizer)[0](text))


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of `text` alone (no special tokens), cached, since a schema's forced texts (its keys) recur."""
    return list(_encode_cached(tokenizer, text))


Constrained = tuple[GrammarState | None, list[int], list[int], bool]  # (state, draft tokens, parents, greedy)


def mask_logits(logits: torch.Tensor, requests: list[Constrained]) -> list[int] | None:
    """Mask the target's logits [T, V] by each request's grammar, in place: request i owns 1 + len(tokens_i)
    consecutive rows (after its committed tokens, then after each draft node's path). A sampled request's rows
    are all masked; a greedy request's only where the target's argmax is refused (its masked argmax is
    otherwise the same token), which usually means no mask at all. A greedy chain's rows past the first one
    whose masked argmax differs from the draft are not looked at: verification stops there (and where the
    argmax equals the draft token, the grammar allows it: drafts are filtered). The time is charged to the
    requests.

    Returns every row's argmax after masking when some constrained request is greedy (the argmax it needed
    anyway, redone only on the masked rows: verification reuses it), else None."""
    start = time.perf_counter()
    if not any(g is not None and greedy for g, _, _, greedy in requests):
        top = None
    else:
        top = greedy_tokens(logits).tolist()
    row = 0
    for grammar, tokens, parents, greedy in requests:
        n = 1 + len(tokens)
        if grammar is None:
            pass
        elif greedy and parents == list(range(-1, n - 2)):
            _mask_chain(logits[row:row + n], grammar, tokens, top, row)
        else:
            rows = grammar.refused_rows(tokens, parents, top[row:row + n]) if greedy else None
            if rows is None or rows:
                apply_bitmask(logits[row:row + n], grammar.masks(tokens, parents, rows))
                masked = [row + r for r in (range(n) if rows is None else rows)]
                if top is not None:
                    for r, token in zip(masked, greedy_tokens(logits[torch.tensor(masked)]).tolist()):
                        top[r] = token
        row += n
    charge_grammar_time([g for g, _, _, _ in requests], time.perf_counter() - start)
    return top


def _mask_chain(logits: torch.Tensor, grammar: GrammarState, tokens: list[int], top: list[int], row: int) -> None:
    """A greedy chain's rows [1 + len(tokens), V], looked at in order as verification walks them: the first row
    whose argmax differs from the draft is masked if the grammar refuses that argmax; when its masked argmax
    then agrees with the draft, verification goes on, and so does this (updating `top` from `row`)."""
    r, chain = 0, list(range(-1, len(tokens) - 1))
    while True:
        r = next((j for j in range(r, len(tokens)) if top[row + j] != tokens[j]), len(tokens))
        if not grammar.refused_rows(tokens, chain, top[row:row + len(tokens) + 1], [r]):
            return
        apply_bitmask(logits[r:r + 1], grammar.masks(tokens, chain, [r])[r:r + 1])
        top[row + r] = int(greedy_tokens(logits[r:r + 1])[0])
        if r == len(tokens) or top[row + r] != tokens[r]:
            return
        r += 1


def charge_grammar_time(grammars: list[GrammarState | None], seconds: float) -> None:
    """Share the time a step spent on grammars among its constrained requests."""
    constrained = [g for g in grammars if g is not None]
    for g in constrained:
        g.seconds += seconds / len(constrained)


_BITS = torch.arange(32, dtype=torch.int32)


@torch.inference_mode()  # logits come out of the model's inference mode: updated in place only inside one
def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set logits [T, V] of the tokens `bitmask` [T, width] forbids to -inf, in place (bit t % 32 of word
    t // 32 allows token t): a native loop on CPU (20-50 us a row), tensor ops elsewhere."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous() and native.available():
        native.ops().mask_rows(logits, bitmask.contiguous())
        return
    bits = bitmask.to(logits.device)[:, :, None] >> _BITS.to(logits.device)  # [T, width, 32]
    allowed = (bits & 1).bool().flatten(1)[:, : logits.shape[-1]]
    logits.masked_fill_(~allowed, float("-inf"))
