"""Retrieval drafting (REST, He et al. 2023): draft what followed the current suffix in a corpus, as a tree of
its continuations weighted by how often each one followed.

The datastore is the corpus as token ids and a suffix array over them (`drafting/datastore.py`), built once and
cached on disk by the corpus's content and the target, under $SPECDEC_CACHE/retrieval (by default
~/.cache/specdec/retrieval). A step finds the longest suffix of the sequence, from `max_match` down to `min_match`
tokens, that occurs in the corpus (binary searches in the suffix array; presence of a suffix implies every shorter
one's, so the length is found by bisection, first tried at the longest the request's last match allows,
`RetrievalDrafter.match`), reads the tokens that
follow up to `max_candidates` of its occurrences (spread evenly over them), counts those continuations in a
trie and drafts its most probable nodes the way suffix decoding does (a child's probability is its parent's
times its share of the parent's count; nodes below `min_token_prob` are left out). Proposals are
deterministic, so verification keeps greedy output identical and sampled output in the target's distribution.

A corpus is a text file (documents separated by blank lines), a JSONL file (each line an object with a
"text" string or a "messages" list whose assistant turns are taken: the training data's format), or the
token ids of `specdec distill` or the answers of `tools/train_head_gpu.py` (.npz, `specdec/data/answers/`;
a distill file is checked to be the target's own).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from specdec.config import SpecdecError, cache_root
from specdec.drafting.base import Draft, DraftEnv, Drafter, DraftRequest, check_int, check_number
from specdec.drafting.datastore import SORT_DEPTH_EXTRA, Datastore, count_trie
from specdec.drafting.registry import SpeculativeConfig, register_method
from specdec.drafting.suffix import grow

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CACHE_DIR: Path | None = None  # where datastores are cached; None: cache_dir()'s default


def cache_dir() -> Path:
    """The datastores' folder: CACHE_DIR when set, else retrieval/ under $SPECDEC_CACHE (default ~/.cache/specdec,
    as the native kernels' builds and converted tokenizers)."""
    if CACHE_DIR is not None:
        return Path(CACHE_DIR).expanduser()
    return cache_root() / "retrieval"


@dataclass
class RetrievalOptions:
    corpus: str | None = None  # the corpus file (text, JSONL or `specdec distill` .npz)
    max_match: int = 16  # longest suffix of the sequence looked up
    min_match: int = 2  # shortest suffix worth drafting from
    max_candidates: int = 64  # occurrences whose continuations are counted
    min_token_prob: float = 0.1  # nodes estimated less likely than this are not drafted
    max_corpus_tokens: int = 64_000_000  # budget: in memory 8 bytes a token + 8 per key (40 at the defaults)

    def __post_init__(self) -> None:
        if not self.corpus or not isinstance(self.corpus, str):
            raise SpecdecError("method 'retrieval' needs 'corpus': a text, JSONL or `specdec distill` .npz file")
        for name, low, high in (("max_match", 1, 256), ("min_match", 1, 256), ("max_candidates", 1, 1 << 20),
                                ("max_corpus_tokens", 1, 1 << 31)):
            check_int(name, getattr(self, name), low, high)
        if self.min_match > self.max_match:
            raise SpecdecError(f"min_match={self.min_match} exceeds max_match={self.max_match}")
        check_number("min_token_prob", self.min_token_prob, 0, 1)


# ---------------------------------------------------------------------------------------------- corpus
def read_corpus(path: str | Path, tokenizer: PreTrainedTokenizerBase, vocab_size: int, max_tokens: int,
                fingerprint: str | None = None) -> np.ndarray:
    """The corpus as int32 token ids, each document followed by -1; refused whole (nothing kept) when it is
    missing, not text, malformed, of another target, or over `max_tokens`."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise SpecdecError(f"retrieval corpus {path} does not exist")
    if path.suffix == ".npz":
        return _read_token_file(path, vocab_size, max_tokens, fingerprint)
    if path.stat().st_size > 16 * max_tokens:  # text runs about 4 bytes per token; far over budget
        raise SpecdecError(f"retrieval corpus {path} ({path.stat().st_size} bytes) is far larger than "
                           f"max_corpus_tokens={max_tokens}; raise the budget or use a smaller corpus")
    raw = path.read_bytes()
    if b"\x00" in raw:
        raise SpecdecError(f"retrieval corpus {path} is not a text file (it holds NUL bytes)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise SpecdecError(f"retrieval corpus {path} is not UTF-8 text (byte {err.start})") from None
    docs = _jsonl_documents(path, text) if path.suffix == ".jsonl" else \
        [d for d in (p.strip() for p in text.split("\n\n")) if d]
    pieces, total = [], 0
    for start in range(0, len(docs), 256):
        for ids in tokenizer(docs[start:start + 256], add_special_tokens=False)["input_ids"]:
            total += len(ids) + 1
            if total > max_tokens:
                raise SpecdecError(f"retrieval corpus {path} holds more than max_corpus_tokens={max_tokens} "
                                   "tokens; raise the budget or use a smaller corpus")
            pieces.append(np.asarray([*ids, -1], dtype=np.int32))
    if not pieces:
        raise SpecdecError(f"retrieval corpus {path} holds no text")
    return np.concatenate(pieces)


def _jsonl_documents(path: Path, text: str) -> list[str]:
    docs = []
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if isinstance(row.get("text"), str):
                docs.append(row["text"])
            else:
                docs.extend(m["content"] for m in row["messages"] if m.get("role") == "assistant")
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise SpecdecError(f"{path}:{lineno}: expected a JSON object with a 'text' string or a 'messages' "
                               "list") from None
    return docs


def _read_token_file(path: Path, vocab_size: int, max_tokens: int, fingerprint: str | None) -> np.ndarray:
    try:
        with np.load(path) as z:
            meta = json.loads(z["meta"].tobytes().decode()) if "meta" in z else {}
            ids = z["tokens"] if "tokens" in z else z["answer_ids"]  # `specdec distill` / tools/train_head_gpu.py
            tokens, offsets = ids.astype(np.int64), z["offsets"].astype(np.int64)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as err:
        raise SpecdecError(f"retrieval corpus {path} is not a token file with 'tokens' (or 'answer_ids') and 'offsets' "
                           f"({type(err).__name__})") from None
    if fingerprint is not None and meta.get("model") not in (None, fingerprint):
        raise SpecdecError(f"retrieval corpus {path} holds token ids of another model (fingerprint "
                           f"{meta['model']}, this target {fingerprint})")
    if len(tokens) and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise SpecdecError(f"retrieval corpus {path} holds token ids outside the target's vocabulary [0, {vocab_size})")
    if len(offsets) < 1 or offsets[0] != 0 or offsets[-1] != len(tokens) or np.any(np.diff(offsets) < 0):
        raise SpecdecError(f"retrieval corpus {path}: 'offsets' must rise from 0 to the number of tokens")
    lengths = np.diff(offsets)
    if len(tokens) + len(lengths) > max_tokens:
        raise SpecdecError(f"retrieval corpus {path} holds more than max_corpus_tokens={max_tokens} tokens; "
                           "raise the budget or use a smaller corpus")
    out = np.full(len(tokens) + len(lengths), -1, dtype=np.int32)
    keep = np.ones(len(out), dtype=bool)
    keep[offsets[1:] + np.arange(len(lengths))] = False  # the separator after each document
    out[keep] = tokens
    return out


def load_datastore(opts: RetrievalOptions, env: DraftEnv | None, depth: int) -> Datastore:
    """The corpus's datastore, from the disk cache when this corpus (by content) was indexed for this target."""
    from specdec.models.loader import model_fingerprint

    path = Path(opts.corpus).expanduser()
    if not path.is_file():
        raise SpecdecError(f"retrieval corpus {path} does not exist")
    target = env.target if env is not None else None
    fingerprint = model_fingerprint(target) if target is not None else None
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    key = f"{digest}-{fingerprint}-{opts.max_match + SORT_DEPTH_EXTRA}"
    cached = cache_dir() / f"{key}.npz"
    loaded = (str(cached), opts.max_match, depth)
    if (store := _LOADED.get(loaded)) is not None and store.n <= opts.max_corpus_tokens:
        return _keep(loaded, store)
    if cached.is_file():
        try:
            with np.load(cached) as z:
                tokens, sa = z["tokens"], z["sa"]
            if len(tokens) <= opts.max_corpus_tokens:
                return _keep(loaded, Datastore(tokens, sa, opts.max_match + depth, opts.max_match))
        except (OSError, ValueError, KeyError):
            pass  # a damaged cache entry is rebuilt
    if env is None or env.tokenizer is None:
        raise SpecdecError("method 'retrieval' needs the target's tokenizer to read a text corpus")
    tokens = read_corpus(path, env.tokenizer, target.config.vocab_size, opts.max_corpus_tokens, fingerprint)
    store = Datastore.build(tokens, opts.max_match, depth)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(".tmp.npz")
        np.savez(tmp, tokens=tokens, sa=store.sa)
        tmp.replace(cached)
    except OSError:
        pass  # a read-only home only costs the next load the build
    return _keep(loaded, store)


# (cache file, max_match, depth) -> its datastore, read-only once built: engines of one process share it (each LLM()
# of the built-in model would pack the keys of its 1.5 M-token answers again, 0.3 s, and hold its own 60 MB)
_LOADED: dict[tuple[str, int, int], Datastore] = {}
LOADED_KEEP = 2


def _keep(key: tuple[str, int, int], store: Datastore) -> Datastore:
    _LOADED.pop(key, None)
    _LOADED[key] = store
    while len(_LOADED) > LOADED_KEEP:
        _LOADED.pop(next(iter(_LOADED)))
    return store


def evidence(match: int) -> str:
    """What a retrieval draft rests on: its match length, bucketed by powers of two ("retrieval 2" for 2-3 tokens,
    "retrieval 4" for 4-7, ...): drafts after longer matches keep more (on chat and code outputs of the default
    model, where the n-gram found nothing, a draft after 8+ matched tokens kept its first token 83% of the time, after
    4-7 tokens 51%; `tools/ngram_evidence.py --corpus`)."""
    return f"retrieval {1 << (match.bit_length() - 1)}"


@register_method("retrieval", RetrievalOptions)
class RetrievalDrafter(Drafter):
    """Drafts first (`Drafter.drafts_first`): a lookup is host work of tens of microseconds, and its match length is
    the evidence the cost model prices the draft by. Asked for its whole budget (`DraftRequest.sized_by_plan`) it
    proposes the chain most continuations agree on, which the plan cuts; otherwise its tree of continuations."""

    drafts_first = True

    @classmethod
    def from_config(cls, cfg: SpeculativeConfig, env: DraftEnv | None = None) -> RetrievalDrafter:
        o = cfg.options
        store = load_datastore(o, env, cfg.num_speculative_tokens)
        return cls(store, cfg.num_speculative_tokens, o.max_match, o.min_match, o.max_candidates, o.min_token_prob)

    def __init__(self, store: Datastore, num_speculative_tokens: int, max_match: int = 16, min_match: int = 2,
                 max_candidates: int = 64, min_token_prob: float = 0.1) -> None:
        self.store, self.k = store, num_speculative_tokens
        self.max_match, self.min_match = max_match, min_match
        self.max_candidates, self.min_prob = max_candidates, min_token_prob
        self.last: dict[int, tuple[int, int]] = {}  # seq_id -> (its length, its longest match) at its last draft

    def propose(self, requests: list[DraftRequest]) -> Draft:
        drafts = [self.draft_one(r) for r in requests]
        chains = all(r.sized_by_plan for r in requests)  # no scores to build (the cost model prices by evidence)
        draft = Draft.from_rows([d[:2] if chains else d for d, _ in drafts])
        draft.evidence = [e for _, e in drafts]
        return draft

    def match(self, r: DraftRequest) -> tuple[int, int, int]:
        """The longest match of the request's sequence (`Datastore.longest_match`), looked up first at the longest it
        can be: a suffix of L tokens occurring means its first L - new tokens (a suffix of the sequence `new` tokens
        ago) occur too, so the match grows by at most the tokens added since. While a continuation holds that is
        one search instead of a bisection."""
        context, bound, before = r.token_ids, self.max_match, self.last.get(r.seq_id)
        if before is not None and before[1] < self.max_match and before[0] <= len(context):
            longest = max(before[1], self.min_match - 1)  # no match then: shorter than min_match
            bound = min(bound, longest + len(context) - before[0])
        found = self.store.longest_match(context, max(self.min_match, bound), bound) \
            if bound >= self.min_match else (0, 0, 0)
        if not found[0] and bound > self.min_match:
            found = self.store.longest_match(context, self.min_match, bound - 1)
        self.last[r.seq_id] = (len(context), found[0])
        return found

    def release(self, seq_id: int) -> None:
        self.last.pop(seq_id, None)

    def draft_one(self, r: DraftRequest) -> tuple[tuple[list[int], list[int], list[float]], str | None]:
        """The request's draft (tokens, parents, scores) and its evidence (None: no draft)."""
        budget = min(self.k, r.max_tokens)
        depth = budget if r.max_depth is None else min(budget, r.max_depth)
        if depth <= 0:
            return ([], [], []), None
        m, lo, hi = self.match(r)
        if m == 0:
            return ([], [], []), None
        if r.sized_by_plan:
            chain = self.store.voted_chain(lo, hi, m, depth, self.max_candidates)
            return (chain, list(range(-1, len(chain) - 1)), [1.0] * len(chain)), evidence(m) if chain else None
        rows = self.store.continuations(lo, hi, m, depth, self.max_candidates)
        tokens, parents, scores = grow(count_trie(rows), budget, depth, self.min_prob)
        return (tokens, parents, scores), evidence(m) if tokens else None
