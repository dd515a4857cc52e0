"""Static-tree drafting with a draft LM (draft_model or layer_skip): each node's children are the draft's
top-ranked tokens after it (greedy draft decoding, as in the Meta report, section 3.2).

    catch up:  feed the committed tokens the draft cache lacks (at least the last one)  -> root's top-k
    level d:   feed every depth-d node in one forward (tree mask, positions by depth)   -> their top-k

Children are deterministic proposals (q = one-hot), which tree verification handles losslessly for any
temperature. Node K/V are written to the slots right after the committed tokens (the ones the target's
verification overwrites) and are not kept: the next catch-up feeds the accepted tokens again.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from specdec.drafting.base import Draft, DraftRequest
from specdec.drafting.chain import ChainDrafter, DraftCache
from specdec.tree import PAD, ROOT, TreeFeed, TreeShape, expand_step, select_dynamic_tree, tree_shape


def grow_static_tree(shape: TreeShape, requests: list[DraftRequest], root_logits: Callable[[], torch.Tensor],
                     expand: Callable[..., torch.Tensor]) -> Draft:
    """Fill a static tree with the drafter's top-ranked tokens, one forward per level.

    root_logits() -> [B, V] the draft's logits after the last committed token (called once, first);
    expand(batch, rows, tokens, sizes) -> [sum of len(rows[i]) for i in batch, V] logits after each node in
    rows[i] (node indices of request i, one level), fed in that order; `tokens` [B, N] is the tree so far
    and request i has sizes[i] nodes.
    Each request gets the first min(nodes, max_tokens) nodes (a prefix of the node order is a tree).
    """
    B = len(requests)
    sizes = [min(len(shape.parents), r.max_tokens) for r in requests]
    N = max(sizes, default=0)
    tokens = torch.zeros(B, N, dtype=torch.long)
    parents = torch.full((B, N), PAD, dtype=torch.long)
    for i, n in enumerate(sizes):
        parents[i, :n] = shape.tensor_parents[:n]
    if N == 0:
        return Draft(tokens, parents)
    top = root_logits().topk(shape.width).indices.cpu()  # [B, width]
    for c in shape.levels[0]:
        if c < N:
            tokens[:, c] = top[:, shape.ranks[c]]
    for level, below in zip(shape.levels, shape.levels[1:]):
        rows = [[n for n in level if n < size and any(shape.parents[c] == n for c in below if c < size)]
                for size in sizes]
        batch = [i for i in range(B) if rows[i]]
        if not batch:
            break
        top = expand(batch, rows, tokens, sizes).topk(shape.width).indices.cpu()  # [rows fed, width]
        offset = 0
        for i in batch:
            for c in below:
                if c < sizes[i] and shape.parents[c] in rows[i]:
                    tokens[i, c] = top[offset + rows[i].index(shape.parents[c]), shape.ranks[c]]
            offset += len(rows[i])
    return Draft(tokens, parents)


class TreeDrafter(ChainDrafter):
    """A ChainDrafter that drafts the static tree a request asks for (`DraftRequest.tree`), all requests of
    a step sharing one shape; chains when none is asked for; EAGLE-2 dynamic trees (`DraftRequest.dynamic`).
    One drafter (and one draft cache) serves every shape, so the tree dispatcher can switch shapes from step
    to step."""

    def propose(self, requests: list[DraftRequest]) -> Draft:
        if requests and requests[0].dynamic is not None:
            return self._propose_dynamic(requests, *requests[0].dynamic)
        if not requests or requests[0].tree is None:
            return super().propose(requests)
        shape = tree_shape(requests[0].tree)
        tables = [r.block_table for r in requests]

        def expand(batch: list[int], rows: list[list[int]], tokens: torch.Tensor, sizes: list[int]) -> torch.Tensor:
            trees = [TreeFeed.level(shape.parents[:sizes[i]], rows[i]) for i in batch]
            hidden = self.run([tables[i] for i in batch], [len(requests[i].token_ids) for i in batch],
                              [tokens[i, rows[i]].tolist() for i in batch], trees)
            return self.env.logits(self.model, hidden)

        return grow_static_tree(shape, requests, lambda: self._catch_up(requests), expand)

    def _catch_up(self, requests: list[DraftRequest]) -> torch.Tensor:
        """Feed what the draft cache lacks up to the last committed token; the draft's logits there [B, V].
        The cache then holds committed tokens only: node K/V written later are not on the sequence's path."""
        starts = [self._cached(r) for r in requests]
        feeds = [r.token_ids[s:] for r, s in zip(requests, starts)]
        hidden = self.run([r.block_table for r in requests], starts, feeds)
        last = torch.tensor([len(f) for f in feeds], device=hidden.device).cumsum(0) - 1
        for r in requests:
            self.caches[r.seq_id] = DraftCache(r.epoch, list(r.token_ids), len(r.token_ids))
        return self.env.logits(self.model, hidden[last])

    def _propose_dynamic(self, requests: list[DraftRequest], topk: int, num_steps: int, num_draft_tokens: int
                         ) -> Draft:
        """EAGLE-2 dynamic trees of the draft model's candidates (`grow_dynamic_tree`); the draft's row at slot t
        holds token t, so expanded nodes go to the slots right after the last committed token."""
        tables, starts = [r.block_table for r in requests], [len(r.token_ids) for r in requests]

        def expand(frontier: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, feeds: list[TreeFeed]
                   ) -> torch.Tensor:
            hidden = self.run(tables, starts, tokens.tolist(), feeds)
            return torch.log_softmax(self.env.logits(self.model, hidden).float(), -1).cpu()

        root = torch.log_softmax(self._catch_up(requests).float(), -1).cpu()
        return grow_dynamic_tree(requests, root, topk, num_steps, num_draft_tokens, expand)


def grow_dynamic_tree(requests: list[DraftRequest], root_logp: torch.Tensor, topk: int, num_steps: int,
                      num_draft_tokens: int, expand: Callable[..., torch.Tensor], min_prob: float = 0.0,
                      vocab: torch.Tensor | None = None) -> Draft:
    """EAGLE-2: grow a candidate tree by expanding, `num_steps` times, the `topk` candidates with the highest
    cumulative draft log-probability (each expanded node gets its `topk` best children), then keep the
    `num_draft_tokens` best candidates whose estimated chance of acceptance (the product of the draft's
    probabilities along the path) is at least `min_prob` (0: the count alone sizes the tree).

    root_logp [B, V]: the draft's log-probabilities after the last committed token. expand(frontier, tokens,
    parents, feeds) feeds the frontier in one forward and returns its children's log-probabilities
    [B * topk, V] (request-major): frontier [B, topk] candidate indices, tokens [B, topk] their tokens, parents
    [B, topk] their parents' candidate indices (ROOT for the root's children), feeds one TreeFeed per request.
    Expanded nodes take consecutive slots from the drafter's start on in the order they are fed (their
    ancestors were fed before them), each seeing its own slot and its ancestors'. `vocab` [V]: the token id of
    each column of the log-probabilities (a head's reduced vocabulary), None when they are token ids."""
    B = len(requests)

    def best(logp: torch.Tensor) -> torch.return_types.topk:
        top = logp.topk(topk)
        return top if vocab is None else torch.return_types.topk((top.values, vocab[top.indices]))

    first = best(root_logp)  # [B, topk]
    tokens, parents, scores = [first.indices], [torch.full((B, topk), ROOT)], [first.values]
    depth = [torch.ones(B, topk, dtype=torch.long)]
    frontier, frontier_scores = torch.arange(topk).expand(B, topk), first.values
    fed: list[torch.Tensor] = []  # candidate index of every expanded node, in slot order, [B] each
    for _ in range(num_steps - 1):
        if min_prob > 0 and frontier_scores.max() < math.log(min_prob):
            break  # no child of the frontier could be kept: spare the forward
        all_tokens, all_parents = torch.cat(tokens, 1), torch.cat(parents, 1)
        fed += list(frontier.T)
        all_depth = torch.cat(depth, 1)
        feeds = []
        for i in range(B):
            slot_of = {int(f[i]): j for j, f in enumerate(fed)}  # candidate -> slot offset
            visible = torch.zeros(topk, len(fed), dtype=torch.bool)
            for row, node in enumerate(frontier[i].tolist()):
                while node != ROOT:
                    visible[row, slot_of[node]] = True
                    node = int(all_parents[i, node])
            rows = frontier[i].tolist()
            feeds.append(TreeFeed([slot_of[n] for n in rows], (all_depth[i, rows] - 1).tolist(), visible))
        child = best(expand(frontier, all_tokens.gather(1, frontier), all_parents.gather(1, frontier), feeds))
        child_tokens, child_logp = child.indices.view(B, topk, topk), child.values.view(B, topk, topk)
        step = expand_step(frontier, frontier_scores, child_tokens, child_logp, topk)
        base = all_tokens.shape[1]
        tokens.append(step.tokens)
        parents.append(step.parents)
        scores.append(step.scores)
        depth.append(all_depth.gather(1, step.parents) + 1)
        frontier = base + step.next_frontier
        frontier_scores = step.scores.gather(1, step.next_frontier)
    all_tokens, all_parents = torch.cat(tokens, 1), torch.cat(parents, 1)
    all_scores, all_depth = torch.cat(scores, 1), torch.cat(depth, 1)
    max_depth = torch.tensor([r.max_depth if r.max_depth is not None else num_steps for r in requests])
    all_parents = torch.where(all_depth <= max_depth[:, None], all_parents, PAD)  # too deep to be emitted
    if min_prob > 0:  # path scores never rise along a path, so this drops whole subtrees
        all_parents = torch.where(all_scores >= math.log(min_prob), all_parents, PAD)
    keep, new_parents = select_dynamic_tree(all_scores, all_parents, num_draft_tokens)
    budget = torch.tensor([r.max_tokens for r in requests])
    new_parents = torch.where(torch.arange(keep.shape[1]) < budget[:, None], new_parents, PAD)
    return Draft(all_tokens.gather(1, keep), new_parents)
