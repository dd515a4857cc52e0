"""Feature-head drafting (`eagle`, `eagle3`, `mtp`): a small head over the target's hidden states (EAGLE-3:
low/mid/high features; EAGLE-1 and MTP: the last one) drafts a chain of k tokens, a static tree of its
top-ranked tokens, or an EAGLE-2 dynamic tree grown by cumulative draft probability and cut where a node's
chance of acceptance falls under `min_prob` (one batched forward per level, each node feeding its own output to
its children); a chain stops at `min_prob` the same way (SpecDec++'s rule, with the head's own probabilities).
The heads (`specdec/models/heads/eagle.py`, `eagle3.py`) share one interface: forward(embeds, positions, meta, kv,
features=... | hidden=...) -> out, compute_logits / target_logits, target_ids and aux_layers.

Each step (Meta's alignment: the head is re-aligned from target features only):

    catch up:  rows t = first token without a consumed feature .. last cached token, each pairing the target's
               feature of token t with the embedding of token t + 1, at position t   -> d1 from the last row
    extend:    (the head's own output, d_j) at the next position                     -> d_(j+1)

The head's K/V live in a pool of its own over the target's block tables, at the same slots as the
tokens they belong to. Rows written while drafting are overwritten by the next catch-up, which restarts at
the first token whose target feature the head has not consumed, so no rewind is needed. The row at slot t
holds token t + 1, so a cached prefix block is reused (K/V of target and head both) only by a prompt that
goes on with the same token after it (`cache_reads_next_token`); the head then catches up from the hit.
Drafts are the head's argmax (q = one-hot), which verification handles losslessly at any temperature. A
serving engine can swap the head for another of the same method and shape between two steps (`reload_head`).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from specdec.config import ModelConfig, SpecdecError
from specdec.drafting.base import Draft, DraftEnv, Drafter, DraftRequest, HeadOptions, check_number
from specdec.drafting.registry import SpeculativeConfig, register_method
from specdec.drafting.tree_draft import grow_dynamic_tree, grow_static_tree
from specdec.models.heads.eagle import EagleHead
from specdec.models.heads.eagle3 import Eagle3Head
from specdec.tree import ROOT, TreeFeed, tree_shape


@dataclass
class FeatureHeadOptions(HeadOptions):
    # A dynamic tree keeps a node, and a chain goes on to a draft, only when the head's probability of its whole
    # path is at least this: the cost of verifying one more token, in plain steps (`specdec tune` measures it when
    # left out; 0: the node count, or the chain's length, alone sizes the draft).
    min_prob: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number("min_prob", self.min_prob, 0, 1)


@dataclass
class Eagle3Options(FeatureHeadOptions):
    method: ClassVar[str] = "eagle3"


@dataclass
class EagleOptions(FeatureHeadOptions):
    method: ClassVar[str] = "eagle"


@dataclass
class MtpOptions(FeatureHeadOptions):
    method: ClassVar[str] = "mtp"


HEAD_KEYS = dict(trees=True, dynamic_trees=True, verify_cost_keys=("min_prob",))


@register_method("mtp", MtpOptions, head=EagleHead, head_in_model=True, **HEAD_KEYS)
@register_method("eagle", EagleOptions, head=EagleHead, **HEAD_KEYS)
@register_method("eagle3", Eagle3Options, head=Eagle3Head, **HEAD_KEYS)
class EagleDrafter(Drafter):
    cache_reads_next_token = True

    def __init__(self, head: EagleHead | Eagle3Head, env: DraftEnv, num_speculative_tokens: int,
                 min_prob: float = 0.0, cfg: SpeculativeConfig | None = None) -> None:
        """cfg: the config the head came from; with it the drafter can reload its head (`reload_head`)."""
        self.head, self.k, self.env, self.min_prob = head, num_speculative_tokens, env, min_prob
        self.embed = head.own_embed if head.embed_tokens is not None else env.target.embed
        self.kv = env.kv_pool(head.config, torch.float32)
        self.feature_layers = head.aux_layers
        self.consumed: dict[int, tuple[int, int]] = {}  # seq_id -> (epoch, rows of final head K/V)
        self.cfg = cfg
        self.reloads_head = cfg is not None
        self.head_path = cfg.options.model if cfg is not None else None

    @classmethod
    def from_config(cls, cfg: SpeculativeConfig, env: DraftEnv) -> EagleDrafter:
        return cls(load_head(cfg, cfg.options.model, env), env, cfg.num_speculative_tokens, cfg.options.min_prob, cfg)

    def reload_head(self, path: str) -> None:
        """The head in `path`, loaded and quantized as the first one, drafts from the next call on. It must read
        the same target layers (the engine gathers their features) and fit the head's K/V pool (layers, K/V heads,
        head size); its other sizes (draft vocabulary, MLP) may differ. The K/V the old head wrote for requests in
        flight and for cached prefixes stays: the new head drafts over it until it is rewritten, which costs
        acceptance there, never correctness (verification decides every token)."""
        if self.cfg is None:
            raise SpecdecError("this EAGLE drafter was built from a head object, not a config: it cannot reload one")
        try:
            head = load_head(self.cfg, path, self.env)
        except SpecdecError:
            raise
        except Exception as e:  # noqa: BLE001  an unreadable file is the caller's to fix, not a server fault
            raise SpecdecError(f"cannot load the {self.cfg.method} head in {path}: {type(e).__name__}: {e}") from None
        self._check_fits(head, path)
        self.head, self.head_path = head, str(path)
        self.embed = head.own_embed if head.embed_tokens is not None else self.env.target.embed

    def _check_fits(self, head: EagleHead | Eagle3Head, path: str) -> None:
        if tuple(head.aux_layers) != tuple(self.feature_layers):
            raise SpecdecError(f"the head in {path} reads target layers {list(head.aux_layers)}, the serving head "
                               f"reads {list(self.feature_layers)}: a reloaded head must read the same layers (the "
                               "engine gathers their features; restart with the new head to change them)")

        def kv(c: ModelConfig) -> tuple[int, int, int]:
            return c.num_hidden_layers, c.num_key_value_heads, c.head_dim

        if kv(head.config) != kv(self.head.config):
            (n, h, d), (n0, h0, d0) = kv(head.config), kv(self.head.config)
            raise SpecdecError(f"the head in {path} has {n} layer(s) x {h} K/V heads x head size {d}, the serving "
                               f"head's K/V pool holds {n0} x {h0} x {d0}: a reloaded head must fit it (restart "
                               "with the new head to change it)")

    def propose(self, requests: list[DraftRequest]) -> Draft:
        active = [i for i, r in enumerate(requests) if r.features is not None and r.max_tokens > 0]
        if not active:
            return Draft.chains([[] for _ in requests])
        chain = requests[0].dynamic is None and requests[0].tree is None
        root, first, logp = self._catch_up([requests[i] for i in active], chain)  # [len(active), H], [len(active)] x 2
        for i in active:
            r = requests[i]
            self.consumed[r.seq_id] = (r.epoch, r.features_start + len(r.features))
        if requests[0].dynamic is not None:
            return self._dynamic(requests, active, root, *requests[0].dynamic)
        if requests[0].tree is not None:
            return self._tree(requests, active, root)
        return self._chain(requests, active, root, first, logp)

    def cached_prefix(self, request: DraftRequest) -> int | None:
        """Rows whose head K/V pair a consumed target feature with the committed token after it (blocks that
        came from the prefix cache included)."""
        epoch, rows = self.consumed.get(request.seq_id, (-1, 0))
        return max(rows if epoch == request.epoch else 0, request.num_prefix_hit)

    def release(self, seq_id: int) -> None:
        self.consumed.pop(seq_id, None)

    def _catch_up(self, reqs: list[DraftRequest], greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed each request's new target features (paired with the next tokens): the head's output at its last
        row, from which the first draft tokens come, [B, H], and with `greedy` those tokens themselves [B] and
        their log-probabilities under the head [B] (else empty: trees rank the head's logits themselves)."""
        starts = [r.features_start for r in reqs]
        feeds = [r.token_ids[s + 1:s + 1 + len(r.features)] for r, s in zip(reqs, starts)]
        last = list(itertools.accumulate(len(f) for f in feeds))
        last = [n - 1 for n in last]
        out, first, logp = self._step([r.block_table for r in reqs], starts, feeds, last if greedy else [],
                                      features=reqs[0].features if len(reqs) == 1 else torch.cat([r.features
                                                                                                 for r in reqs]))
        return (out[last] if len(last) > 1 else out[last[0]:last[0] + 1]), first, logp

    def _chain(self, requests: list[DraftRequest], active: list[int], hidden: torch.Tensor, first: torch.Tensor,
               first_logp: torch.Tensor) -> Draft:
        """A chain of up to k greedy drafts per request. With `min_prob`, a request's chain ends before the first
        draft whose chance of acceptance, the product of the head's probabilities along the chain, is under it
        (the verification of such a node costs more than it is likely to save; none at all where the first is).
        With `path_scores`, each node carries that product (`Draft.scores`)."""
        reqs = [requests[i] for i in active]
        tables = [r.block_table for r in reqs]
        first_row = [len(r.token_ids) - 1 for r in reqs]  # the first draft token's row: right after the features
        budget = [min(self.k, r.max_tokens) for r in reqs]
        chains = [[t] for t in first.tolist()]
        paths = [[lp] for lp in first_logp.tolist()]  # log path probability of each draft
        floor = math.log(self.min_prob) if self.min_prob > 0 else -math.inf
        budget = [b if path[0] >= floor else 0 for b, path in zip(budget, paths)]
        for step in range(1, max(budget)):
            rows = [i for i, b in enumerate(budget) if b > step]
            if not rows:  # every chain stopped early
                break
            out, tokens, logp = self._step([tables[i] for i in rows], [first_row[i] + step - 1 for i in rows],
                                           [[chains[i][-1]] for i in rows], list(range(len(rows))),
                                           hidden=hidden[rows])
            hidden = hidden.clone()
            hidden[rows] = out
            for i, t, lp in zip(rows, tokens.tolist(), logp.tolist()):
                chains[i].append(t)
                paths[i].append(paths[i][-1] + lp)
                if paths[i][-1] < floor:
                    budget[i] = step  # this draft and any after it would not pay for their verification
        proposals: list[list[int]] = [[] for _ in requests]
        for i, chain, b in zip(active, chains, budget):
            proposals[i] = chain[:b]
        if not self.path_scores:
            return Draft.chains(proposals)
        scores: list[list[float]] = [[] for _ in requests]
        for i, path, b in zip(active, paths, budget):
            scores[i] = [math.exp(lp) for lp in path[:b]]
        return Draft.from_rows([(c, [ROOT, *range(len(c) - 1)], sc) for c, sc in zip(proposals, scores)])

    def _tree(self, requests: list[DraftRequest], active: list[int], root: torch.Tensor) -> Draft:
        """A static tree of the head's top-ranked tokens; each node feeds its own output to its children."""
        shape = tree_shape(requests[0].tree)
        reqs = [r if i in active else dataclasses.replace(r, max_tokens=0) for i, r in enumerate(requests)]
        slot = {i: j for j, i in enumerate(active)}
        outputs: dict[tuple[int, int], torch.Tensor] = {}

        def root_logits() -> torch.Tensor:
            with self.env.clock:
                logits = self.head.target_logits(root)
            full = logits.new_zeros(len(reqs), logits.shape[1])
            full[active] = logits
            return full

        def expand(batch: list[int], rows: list[list[int]], tokens: torch.Tensor, sizes: list[int]) -> torch.Tensor:
            hidden = torch.stack([root[slot[i]] if shape.parents[n] < 0 else outputs[(i, shape.parents[n])]
                                  for i in batch for n in rows[i]])
            trees = [TreeFeed.level(shape.parents[:sizes[i]], rows[i]) for i in batch]
            out = self._run([reqs[i].block_table for i in batch], [len(reqs[i].token_ids) - 1 for i in batch],
                            [tokens[i, rows[i]].tolist() for i in batch], hidden=hidden, trees=trees)
            j = 0
            for i in batch:
                for n in rows[i]:
                    outputs[(i, n)] = out[j]
                    j += 1
            with self.env.clock:
                return self.head.target_logits(out)

        return grow_static_tree(shape, reqs, root_logits, expand)

    def _dynamic(self, requests: list[DraftRequest], active: list[int], root: torch.Tensor, topk: int,
                 num_steps: int, num_draft_tokens: int) -> Draft:
        """An EAGLE-2 dynamic tree (`grow_dynamic_tree`): one head forward per expansion step, each expanded node
        fed with its parent's output (the root's children: the catch-up's), the head's row t holding token
        t + 1; nodes the head gives less than `min_prob` of being accepted are left out."""
        reqs = [requests[i] for i in active]
        tables, starts = [r.block_table for r in reqs], [len(r.token_ids) - 1 for r in reqs]
        outputs: list[dict[int, torch.Tensor]] = [{} for _ in reqs]  # per request: candidate -> head output

        def log_probs(out: torch.Tensor) -> torch.Tensor:  # over the head's vocabulary
            return torch.log_softmax(self.env.logits(self.head, out), -1).cpu()

        def expand(frontier: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, feeds: list[TreeFeed]
                   ) -> torch.Tensor:
            hidden = torch.stack([root[b] if p == ROOT else outputs[b][p]
                                  for b, row in enumerate(parents.tolist()) for p in row])
            out = self._run(tables, starts, tokens.tolist(), hidden=hidden, trees=feeds)
            for j, (b, node) in enumerate((b, n) for b, row in enumerate(frontier.tolist()) for n in row):
                outputs[b][node] = out[j]
            return log_probs(out)

        vocab = self.head.target_ids(torch.arange(self.head.draft_vocab_size, device=root.device)).cpu()
        draft = grow_dynamic_tree(reqs, log_probs(root), topk, num_steps, num_draft_tokens, expand, self.min_prob,
                                  vocab)
        return draft.spread(active, len(requests))

    def _step(self, tables: list[list[int]], starts: list[int], feeds: list[list[int]], rows: list[int],
              features: torch.Tensor | None = None, hidden: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A head step over a chain's rows, its greedy tokens at `rows` and their log-probabilities (the head's
        `draft_step`: one native call on CPU)."""
        tokens, positions, meta = self.env.inputs(tables, starts, feeds)
        with self.env.clock:
            return self.head.draft_step(self.embed(tokens), positions, meta, self.kv, rows, features=features,
                                        hidden=hidden)

    def _run(self, tables: list[list[int]], starts: list[int], feeds: list[list[int]],
             features: torch.Tensor | None = None, hidden: torch.Tensor | None = None,
             trees: list[TreeFeed | None] | None = None) -> torch.Tensor:
        tokens, positions, meta = self.env.inputs(tables, starts, feeds, trees)
        with self.env.clock:
            return self.head(self.embed(tokens), positions, meta, self.kv, features=features, hidden=hidden)


def load_head(cfg: SpeculativeConfig, path: str, env: DraftEnv) -> EagleHead | Eagle3Head:
    """The head of `cfg.method` in `path`, for the target, quantized as `cfg`'s options say."""
    head = cfg.info.head.load_for(cfg.method, path, env.target)
    cfg.options.quantize(head, env.target)
    return head
