"""Medusa-1 drafting: K heads over the target's own last hidden state each guess one position further ahead,
so a whole draft costs one small forward and no draft KV cache.

    row       = the target's last-layer output (before its final norm) of token n - 2, n = len(token_ids):
                the newest feature there is (token n - 1 was produced from it and has none yet)
    head i    = argmax of Medusa head i on norm(row)  -> the token at index n + i

Chains take head i's argmax at depth i + 1. Static trees take, at depth d, the rank-r token of head d - 1 for
a node of rank r: the Cartesian products of the heads' top-k, as Medusa builds its trees (a head's logits do
not depend on the tokens drafted before it). Drafts are deterministic (q = one-hot), which verification
handles losslessly at any temperature.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from specdec.config import SpecdecError
from specdec.drafting.base import Draft, DraftEnv, Drafter, DraftRequest, ForwardClock, HeadOptions
from specdec.drafting.registry import SpeculativeConfig, register_method
from specdec.drafting.tree_draft import grow_static_tree
from specdec.models.heads.medusa import MedusaHeads
from specdec.models.llama import LlamaModel
from specdec.tree import tree_shape


@dataclass
class MedusaOptions(HeadOptions):
    method: ClassVar[str] = "medusa"


def check_depth(cfg: SpeculativeConfig, num_heads: int, where: str) -> None:
    """Head i drafts depth i + 1 only: refuse chains or trees (default and dispatch shapes) deeper than that."""
    for shape in cfg.shapes():
        if shape.tree is not None:
            depth = max(map(len, shape.tree))
            what = f"the tree {shape} is {depth} deep"
        elif shape.k:
            depth = min(shape.k, cfg.num_speculative_tokens)
            what = f"num_speculative_tokens={cfg.num_speculative_tokens}"
        else:
            continue
        if depth > num_heads:
            raise SpecdecError(f"{what}, but the Medusa head {where} has {num_heads} heads (head i drafts depth "
                               f"i + 1): draft at most {num_heads} deep")


@register_method("medusa", MedusaOptions, trees=True, head=MedusaHeads)
class MedusaDrafter(Drafter):
    def __init__(self, heads: MedusaHeads, target: LlamaModel, num_speculative_tokens: int,
                 clock: ForwardClock | None = None) -> None:
        """target: the model the heads draft for (its final norm is applied to its last layer's output); clock:
        times the heads' forward (`DraftEnv.clock`)."""
        self.heads, self.k, self.clock = heads, num_speculative_tokens, clock or ForwardClock()
        self.norm = target.norm
        self.feature_layers = (target.config.num_hidden_layers - 1,)  # the last layer, pre-norm

    @classmethod
    def from_config(cls, cfg: SpeculativeConfig, env: DraftEnv) -> MedusaDrafter:
        heads = MedusaHeads.load_for(cfg.method, cfg.options.model, env.target)
        check_depth(cfg, heads.num_heads, cfg.options.model)
        cfg.options.quantize(heads, env.target)
        return cls(heads, env.target, cfg.num_speculative_tokens, env.clock)

    def propose(self, requests: list[DraftRequest]) -> Draft:
        active = [i for i, r in enumerate(requests) if r.features is not None and r.max_tokens > 0]
        if not active:
            return Draft.chains([[] for _ in requests])
        tree = requests[0].tree
        K = self.heads.num_heads
        depth = max(map(len, tree)) if tree is not None else min(self.k, K, max(requests[i].max_tokens for i in active))
        if depth > K:  # build_drafter's check_depth refuses such shapes up front
            raise SpecdecError(f"a tree {depth} deep needs {depth} Medusa heads, the head has {K}")
        rows = torch.stack([requests[i].features[-1] for i in active])  # [B, H]: token n - 2 of each request
        with self.clock:
            logits = self.heads.logits(self.heads(self.norm(rows), depth))  # [depth, B, V]
        if tree is not None:
            return self._tree(requests, active, logits)
        tokens = logits.argmax(-1).T.tolist()  # [B, depth]
        proposals: list[list[int]] = [[] for _ in requests]
        for j, i in enumerate(active):
            proposals[i] = tokens[j][:requests[i].max_tokens]  # depth <= k already
        return Draft.chains(proposals)

    def _tree(self, requests: list[DraftRequest], active: list[int], logits: torch.Tensor) -> Draft:
        """Fill the static tree from the heads' top-ranked tokens: a node's children come from the head of the
        next depth, whatever the node's own token."""
        shape = tree_shape(requests[0].tree)
        reqs = [r if i in active else dataclasses.replace(r, max_tokens=0) for i, r in enumerate(requests)]
        slot = {i: j for j, i in enumerate(active)}
        depth = {n: d for d, level in enumerate(shape.levels, 1) for n in level}

        def root_logits() -> torch.Tensor:  # [B, V]; inactive requests draft nothing, their rows are unused
            full = logits.new_zeros(len(reqs), logits.shape[-1])
            full[active] = logits[0]
            return full

        def expand(batch: list[int], rows: list[list[int]], tokens: torch.Tensor, sizes: list[int]) -> torch.Tensor:
            return torch.stack([logits[depth[n], slot[i]] for i in batch for n in rows[i]])  # [fed nodes, V]

        return grow_static_tree(shape, reqs, root_logits, expand)
