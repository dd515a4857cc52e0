"""Prompt lookup (n-gram) drafting: propose what followed the last time the current suffix appeared.

An index maps every n-gram (n in [prompt_lookup_min, prompt_lookup_max]) to the places right after its
occurrences. It is updated only with newly committed tokens, so a step costs O(new tokens * n-gram
sizes), never a scan of the whole history. The pool options TensorRT-LLM documents:
- `ngram_pool`: "request" (each request looks up its own prompt and output) or "shared" (requests also
  look up the text of other requests, finished ones included, up to `MAX_SHARED_TEXTS` of them);
- `ngram_match`: continue from the "latest" or the "oldest" matching occurrence (all are kept), or follow
  the "frequent" continuation (default): at each draft position the token that most of the (up to
  `MAX_VOTERS` latest) occurrences still agreeing so far continue with, ties going to the latest. A phrase
  the text repeats in several ways then drafts its most common wording rather than its last one (on
  Spec-Bench outputs of the default model: acceptance length 1.62 against 1.59 for "latest", see
  docs/benchmarks-history.md);
- `ngram_branches`: propose up to this many continuations that start with different tokens, as branches
  of a tree (verification accepts at most one), instead of a single chain.

- `ngram_text_match`: where no n-gram of tokens matches, match the text instead: the longest suffix of the
  decoded text (at least `TEXT_MATCH_MIN_CHARS` characters) seen earlier, its continuation re-encoded. Copying
  often crosses a token boundary the tokenizer draws differently in the copy: a value quoted from the prompt
  (`"Montreal` is `"`, `Mont`, `real` in JSON but ` Montreal` in the text), an identifier after a dot.

Draft length. How far a continuation holds depends on how long the match is: on Spec-Bench outputs of
the default model, a draft after a 1-token match keeps 0.8 tokens on average, after a 4-token match 6.2
(out of 15). Verifying a token is not free on a CPU (1 + k tokens cost about 1 + 0.09 k plain steps in float32,
1 + 0.2 k on the native Q4_1 runtime; tools/verify_cost.py), so
by default ("adaptive") a match of n < prompt_lookup_max tokens drafts min(k, 2^(n-1)) tokens and a full
prompt_lookup_max match drafts k; "fixed" always drafts k (vLLM's behaviour).
"""
from __future__ import annotations

from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specdec.config import SpecdecError
from specdec.drafting.base import Draft, DraftEnv, Drafter, DraftRequest, check_int
from specdec.drafting.registry import SpeculativeConfig, register_method
from specdec.models.loader import token_codec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MAX_SHARED_TEXTS = 256  # a shared pool forgets the oldest finished texts beyond this
MAX_VOTERS = 64  # "frequent" matching counts the continuations of at most this many latest occurrences
TEXT_MATCH_MIN_CHARS = 3  # the shortest text suffix a text match may rest on
TEXT_MATCH_FULL_CHARS = 16  # a text match this long drafts k tokens (shorter: 1 token, 2 from 8 characters)
TEXT_MATCH_LOOKAHEAD = 8  # characters of continuation re-encoded per token drafted


@dataclass
class NgramOptions:
    prompt_lookup_min: int = 1  # shortest n-gram looked up
    prompt_lookup_max: int = 4  # longest n-gram looked up (tried first)
    ngram_match: str = "frequent"  # follow the continuation most occurrences agree on, the "latest" or "oldest"
    ngram_pool: str = "request"  # look up in the request's own text, or "shared" across requests
    ngram_draft_length: str = "adaptive"  # "adaptive" (by match length, up to k) or "fixed" (always k)
    ngram_branches: int = 1  # continuations with different first tokens, drafted as a tree (k nodes in all)
    ngram_text_match: bool = True  # no token n-gram matches: match the decoded text (needs the tokenizer)

    def __post_init__(self) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in (lo, hi)) or not 1 <= lo <= hi:
            raise SpecdecError(f"invalid prompt_lookup_min={lo!r} / prompt_lookup_max={hi!r}: need integers "
                               "with 1 <= min <= max")
        if self.ngram_match not in ("latest", "oldest", "frequent"):
            raise SpecdecError(f"invalid ngram_match={self.ngram_match!r}: choose 'latest', 'oldest' or 'frequent'")
        if self.ngram_pool not in ("request", "shared"):
            raise SpecdecError(f"invalid ngram_pool={self.ngram_pool!r}: choose 'request' or 'shared'")
        check_int("ngram_branches", self.ngram_branches, 1, 8)
        if not isinstance(self.ngram_text_match, bool):
            raise SpecdecError(f"invalid ngram_text_match={self.ngram_text_match!r}: need true or false")
        if self.ngram_draft_length not in ("adaptive", "fixed"):
            raise SpecdecError(f"invalid ngram_draft_length={self.ngram_draft_length!r}: choose 'adaptive' or 'fixed'")


class NgramIndex:
    """n-gram -> (text id, position that followed it), over one or many token sequences ("texts")."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.positions: dict[tuple[int, ...], list[tuple[int, int]]] = defaultdict(list)
        self.texts: OrderedDict[int, list[int]] = OrderedDict()  # text id -> its tokens (by reference)
        self.indexed: dict[int, int] = {}  # text id -> tokens indexed so far

    def extend(self, text_id: int, tokens: list[int]) -> None:
        """Index the n-grams ending before each new position: their continuation is that position."""
        self.texts[text_id] = tokens
        start = self.indexed.get(text_id, 0)
        for end in range(max(start, 1), len(tokens)):
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self.positions[tuple(tokens[end - n:end])].append((text_id, end))
        self.indexed[text_id] = max(start, len(tokens))

    def lookup(self, tokens: list[int], k: int, latest: bool = True) -> tuple[list[int], int]:
        """Up to k tokens that followed the longest suffix of `tokens` seen earlier (in any indexed text),
        and that suffix's length (0: no match)."""
        found = self.lookup_branches(tokens, k, 1, latest)
        return found[0] if found else ([], 0)

    def lookup_branches(self, tokens: list[int], k: int, branches: int, latest: bool = True
                        ) -> list[tuple[list[int], int]]:
        """Up to `branches` continuations (with their match lengths) that start with different tokens: the
        longest matching suffix's occurrences first, then shorter suffixes'."""
        L, found, firsts = len(tokens), [], set()
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            places = self.positions.get(tuple(tokens[L - n:]), [])
            for text_id, start in reversed(places) if latest else places:
                text = self.texts.get(text_id)  # None once forgotten; the suffix itself is never indexed
                if text is not None and text[start] not in firsts:
                    firsts.add(text[start])
                    found.append((text[start:start + k], n))
                    if len(found) == branches:
                        return found
        return found

    def lookup_frequent(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """Up to k tokens continuing the longest suffix of `tokens` seen earlier, each the one most of the
        occurrences that agree with the draft so far continue with (ties: the latest); and the suffix length."""
        L = len(tokens)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            places = self.positions.get(tuple(tokens[L - n:]), [])[-MAX_VOTERS:]
            voters = [(text, start) for text, start in ((self.texts.get(t), s) for t, s in reversed(places))
                      if text is not None]  # latest first, so that ties go to the latest
            if not voters:
                continue
            draft: list[int] = []
            while len(draft) < k and voters:
                depth = len(draft)
                counts: dict[int, int] = {}
                for text, start in voters:
                    if start + depth < len(text):
                        token = text[start + depth]
                        counts[token] = counts.get(token, 0) + 1
                if not counts:
                    break
                best = max(counts, key=counts.__getitem__)  # the first maximum: the latest among equals
                draft.append(best)
                voters = [(t, s) for t, s in voters if s + depth < len(t) and t[s + depth] == best]
            return draft, n
        return [], 0

    def forget(self, text_id: int) -> None:
        """Drop a text; its entries in `positions` are skipped by lookup."""
        self.texts.pop(text_id, None)
        self.indexed.pop(text_id, None)


class TextIndex:
    """One request's text, decoded incrementally, for matching across token boundaries."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.text, self.decoded = "", 0
        self.encode, self.decode = token_codec(tokenizer)

    def extend(self, tokens: list[int]) -> None:
        if len(tokens) > self.decoded:
            self.text += self.decode(tokens[self.decoded:])
            self.decoded = len(tokens)

    def lookup(self, k: int) -> tuple[list[int], int]:
        """Up to k tokens continuing the longest suffix of the text (at least TEXT_MATCH_MIN_CHARS characters,
        at most TEXT_MATCH_FULL_CHARS looked at) seen earlier in it, latest occurrence first, re-encoded; and the
        suffix's length in characters (0: no match). The last encoded token may be cut by the look-ahead, so
        it is dropped."""
        text, end = self.text, len(self.text)
        found, length = -1, 0
        for n in range(TEXT_MATCH_MIN_CHARS, TEXT_MATCH_FULL_CHARS + 1):  # a longer suffix is a rarer string
            at = text.rfind(text[end - n:], 0, end - 1) if n < end else -1
            if at < 0:
                break
            found, length = at + n, n
        if found < 0:
            return [], 0
        tokens = self.encode(text[found:found + TEXT_MATCH_LOOKAHEAD * (k + 1)])
        return tokens[:min(k, len(tokens) - 1)], length


@register_method("ngram", NgramOptions)
class NgramDrafter(Drafter):
    @classmethod
    def from_config(cls, cfg: SpeculativeConfig, env: DraftEnv | None = None) -> NgramDrafter:
        o = cfg.options
        return cls(cfg.num_speculative_tokens, o.prompt_lookup_min, o.prompt_lookup_max, o.ngram_match, o.ngram_pool,
                   adaptive=o.ngram_draft_length == "adaptive", branches=o.ngram_branches,
                   tokenizer=env.tokenizer if env is not None and o.ngram_text_match else None)

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4,
                 match: str = "frequent", pool: str = "request", adaptive: bool = True, branches: int = 1,
                 tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        self.k, self.n_min, self.n_max = num_speculative_tokens, prompt_lookup_min, prompt_lookup_max
        self.adaptive, self.branches, self.tokenizer = adaptive, branches, tokenizer
        self.texts: dict[int, TextIndex] = {}  # seq id -> its decoded text (with a tokenizer)
        self.latest, self.frequent, self.shared = match == "latest", match == "frequent", pool == "shared"
        self.indexes: dict[int, NgramIndex] = {}
        self.shared_index = NgramIndex(prompt_lookup_min, prompt_lookup_max)
        self.drafts_first = branches == 1  # a chain's evidence is its match (a tree of branches sizes itself)

    def index_for(self, seq_id: int) -> NgramIndex:
        if self.shared:
            return self.shared_index
        return self.indexes.setdefault(seq_id, NgramIndex(self.n_min, self.n_max))

    def propose(self, requests: list[DraftRequest]) -> Draft:
        proposals, evidence = [], []
        for r in requests:
            index = self.index_for(r.seq_id)
            index.extend(r.seq_id, r.token_ids)
            budget = min(self.k, r.max_tokens)
            if self.branches == 1:
                tokens, n = (index.lookup_frequent(r.token_ids, budget) if self.frequent
                             else index.lookup(r.token_ids, budget, self.latest))
                found = f"match {n}"
                if tokens and not r.sized_by_plan:
                    tokens = tokens[:self.draft_length(n)]
                elif not tokens:
                    tokens, found = self.text_lookup(r, budget)
                proposals.append([tokens])
                evidence.append(found if tokens else None)
                continue
            depth = budget if r.max_depth is None else min(budget, r.max_depth)
            found = index.lookup_branches(r.token_ids, depth, self.branches, self.latest or self.frequent)
            if self.frequent and found:  # the voted continuation leads; the others keep distinct first tokens
                voted = index.lookup_frequent(r.token_ids, depth)
                found = [voted] + [f for f in found if f[0][:1] != voted[0][:1]][:self.branches - 1]
            chains = []
            for tokens, n in found:  # the best match first; later branches share what budget is left
                tokens = tokens[:min(self.draft_length(n), budget)]
                budget -= len(tokens)
                chains.append(tokens)
            proposals.append([c for c in chains if c])
            evidence.append(None)
        draft = Draft.branches(proposals)
        draft.evidence = evidence
        return draft

    def text_lookup(self, r: DraftRequest, budget: int) -> tuple[list[int], str]:
        """The text match's draft where no token n-gram matched (nothing without a tokenizer), and its evidence: the
        matched suffix's length in characters, bucketed as the drafter's own cut sizes it."""
        if self.tokenizer is None or not budget:
            return [], "text 0"
        text = self.texts.setdefault(r.seq_id, TextIndex(self.tokenizer))
        text.extend(r.token_ids)
        tokens, chars = text.lookup(budget)
        if chars >= TEXT_MATCH_FULL_CHARS:
            return tokens, f"text {TEXT_MATCH_FULL_CHARS}"
        if r.sized_by_plan or not self.adaptive:
            return tokens, "text 8" if chars >= 8 else "text 3"
        return (tokens[:2], "text 8") if chars >= 8 else (tokens[:1], "text 3")

    def draft_length(self, match_length: int) -> int:
        """Tokens worth drafting after a match of this many tokens (see the module docstring)."""
        if not self.adaptive or match_length >= self.n_max:
            return self.k
        return min(self.k, 2 ** (match_length - 1)) if match_length else 0

    def forget(self) -> None:
        self.shared_index = NgramIndex(self.n_min, self.n_max)

    def release(self, seq_id: int) -> None:
        self.texts.pop(seq_id, None)
        if not self.shared:
            self.indexes.pop(seq_id, None)
            return
        texts = self.shared_index.texts  # the finished text stays for later requests, oldest dropped first
        while len(texts) > MAX_SHARED_TEXTS:
            self.shared_index.forget(next(iter(texts)))
