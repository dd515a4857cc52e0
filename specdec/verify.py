"""Verification: which draft tokens the target accepts, for a batch of draft trees, losslessly.

Vocabulary (vLLM's):
- accepted tokens: the draft tokens the target keeps, along one root-to-leaf path of the draft tree;
- recovered token: drawn from the residual distribution after the target rejected every child of the
  last accepted node;
- bonus token: drawn from the target's p after the last accepted node when that node has no children.
Every step emits the accepted tokens plus exactly one extra token (recovered or bonus).

Inputs, for B sequences with up to N draft nodes each:
- draft_tokens [B, N] long;
- parents [B, N] long: -1 = child of the root (the last committed token), -2 = padding (ignored);
  parent index < node index, so a chain is arange(N) - 1;
- draft_probs [B, N, V] or None: the distribution q node c was drawn from, given its earlier siblings
  (the same q for all siblings when sampled with replacement); None = deterministic proposals (n-gram,
  greedy top-k), i.e. q = one-hot at the proposed token;
- target_probs [B, N + 1, V]: the target's processed p (`sampling.logits_to_probs`); row 0 is p at the
  root, row i + 1 is p after node i (the distribution for node i's children).

The one rule (multi-round speculative sampling, SpecInfer / EAGLE): at the current node with target
distribution p, try its children in index order; child c with token x drawn from q is accepted with
probability min(1, p(x) / q(x)), and then c becomes the current node with its own p; on rejection
p <- normalize(max(p - q, 0)) and the next sibling is tried. With no child left, the extra token is
drawn from p. Each try is one standard speculative-sampling step whose output (accepted x, or a draw
from the residual) is distributed exactly as p, so the emitted sequence follows the target exactly.
Greedy rows have one-hot p, for which the rule reduces to "accept the first child equal to argmax p".
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.sampling import sample_from_probs
from specdec.tree import PAD, ROOT


@dataclass
class VerifyResult:
    """What one verification step keeps, per sequence, as host lists (what the scheduler applies); the tensor views
    are made on demand."""

    accepted_nodes: list[list[int]]  # accepted node indices, root to leaf
    emitted_tokens: list[list[int]]  # draft_tokens at accepted_nodes, then the extra token

    @property
    def num_accepted(self) -> torch.Tensor:  # [B] long
        return torch.tensor([len(n) for n in self.accepted_nodes], dtype=torch.long)

    @property
    def extra_tokens(self) -> torch.Tensor:  # [B] long, the recovered or bonus token
        return torch.tensor([e[-1] for e in self.emitted_tokens], dtype=torch.long)


def verify(draft_tokens: torch.Tensor, parents: torch.Tensor, target_probs: torch.Tensor,
           draft_probs: torch.Tensor | None = None, generators: list[torch.Generator | None] | None = None,
           all_greedy: bool = False) -> VerifyResult:
    """Verify a batch of draft trees; all_greedy (every row temperature 0) takes the fast tensor path."""
    if all_greedy:
        return verify_greedy(draft_tokens, parents, target_probs.argmax(-1))
    return verify_sampling(draft_tokens, parents, target_probs, draft_probs, generators)


def verify_greedy(draft_tokens: torch.Tensor, parents: torch.Tensor, target_ids: torch.Tensor) -> VerifyResult:
    """Greedy verification from the target's argmax ids [B, N + 1] (row 0 = root), without any loop over nodes.

    A node is accepted iff it and all its ancestors are "good": equal to argmax p of their parent and the
    first such sibling. At most one child per node is good, so the accepted nodes form one path. The
    all-ancestors test is pointer jumping: ceil(log2 N) rounds of gathers instead of a walk down the tree.
    Callers with logits can pass logits.argmax(-1) and skip the softmax.
    """
    B, N = draft_tokens.shape
    node = torch.arange(N, device=draft_tokens.device).expand(B, N)
    real = parents != PAD
    slot = torch.where(real, parents + 1, 0)  # [B, N] row of the parent in target_ids; 0 = root
    match = real & (draft_tokens == target_ids.gather(1, slot))
    first = torch.full((B, N + 1), N, device=node.device, dtype=torch.long)
    first = first.scatter_reduce(1, slot, torch.where(match, node, N), "amin")  # [B, N + 1] first match per parent
    good = match & (first.gather(1, slot) == node)
    root = torch.zeros(B, 1, dtype=torch.long, device=slot.device)  # (a draft of no nodes is just the root)
    ok = torch.cat([root == 0, good], 1)  # [B, N + 1], slot 0 = root, always ok
    up = torch.cat([root, slot], 1)  # [B, N + 1] parent slot; root is its own parent
    for _ in range((N - 1).bit_length()):  # after k rounds ok covers 2^k path nodes, enough for depth <= N
        ok = ok & ok.gather(1, up)
        up = up.gather(1, up)
    last_slot = torch.where(ok, torch.arange(N + 1, device=ok.device), 0).amax(1)  # [B] deepest = largest index
    extra = target_ids.gather(1, last_slot[:, None]).squeeze(1)
    return _result(draft_tokens, ok[:, 1:], extra)


def verify_sampling(draft_tokens: torch.Tensor, parents: torch.Tensor, target_probs: torch.Tensor,
                    draft_probs: torch.Tensor | None = None,
                    generators: list[torch.Generator | None] | None = None) -> VerifyResult:
    """The multi-round rule for any mix of sampled and greedy rows, vectorized over the batch.

    The nodes a sequence tries have increasing indices (a node's children and its later siblings all come
    after it), so one pass over j = 0..N-1 visits them in order: node j is tried iff its parent is the
    current node. Accepting a child ends its later siblings' turn: their parent is no longer current.
    Each pass works on the rows that try node j only, so the [*, V] work follows the nodes actually tried
    (about the accepted length plus one per row), not B * N.
    """
    B, N = draft_tokens.shape
    V = target_probs.shape[-1]
    generators = generators if generators is not None else [None] * B
    uniforms = acceptance_uniforms(parents != PAD, generators)  # [B, N]
    cur = torch.full((B,), ROOT, device=draft_tokens.device)  # [B] current node
    p = target_probs[:, 0].clone()  # [B, V] p at the current node, after the residual updates so far
    accepted = torch.zeros_like(draft_tokens, dtype=torch.bool)  # [B, N]
    for j in range(N):
        rows = (parents[:, j] == cur).nonzero().squeeze(1)  # [R] the rows that try node j
        x = draft_tokens[rows, j]  # [R]
        q = draft_probs[rows, j] if draft_probs is not None else torch.nn.functional.one_hot(x, V).to(p.dtype)
        p_r = p[rows]  # [R, V]
        p_x, q_x = p_r.gather(1, x[:, None]).squeeze(1), q.gather(1, x[:, None]).squeeze(1)
        accept = uniforms[rows, j] * q_x < p_x  # [R] u < min(1, p/q) without dividing by q
        residual = residual_probs(p_r, q, target_probs[rows, cur[rows] + 1])
        p[rows] = torch.where(accept[:, None], target_probs[rows, j + 1], residual)
        cur[rows] = torch.where(accept, j, cur[rows])
        accepted[rows, j] = accept
    extra = sample_from_probs(p, generators)
    return _result(draft_tokens, accepted, extra)


def residual_probs(p: torch.Tensor, q: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """normalize(max(p - q, 0)) per row [B, V]: what to draw from after rejecting a token drawn from q.

    Its mass sum(max(p - q, 0)) equals the probability that a draw from q is rejected. A row whose mass is
    0 has p <= q everywhere, so p == q in exact arithmetic and the rejection that led here had probability
    0; only float rounding reaches it, with probability sum(max(q - p, 0)) = sum(q) - sum(p) ~ 1e-7. Such
    rows take `fallback` (the target's unmodified p at the node): any valid distribution costs no
    measurable bias there, and it avoids dividing by zero.
    """
    r = (p - q).clamp(min=0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / mass, fallback)


def acceptance_uniforms(real: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One U[0, 1) per node [B, N], each used at most once. A seeded row draws exactly one per real node,
    so its result does not depend on how many nodes the other sequences in the batch have."""
    u = torch.rand(real.shape, device=real.device)  # unseeded rows: the global generator
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if seeded:
        counts = real.sum(1).tolist()
        for i in seeded:
            u[i, real[i]] = torch.rand(counts[i], generator=generators[i], device=real.device)
    return u


def verify_greedy_chains(drafts: list[list[int]], target_ids: list[int]) -> VerifyResult:
    """Greedy verification of chains, on host lists (a handful of tokens per sequence: list code beats a
    dozen small tensor ops). drafts[i]: sequence i's chain; target_ids: the target's argmax of every fed row,
    sequence after sequence, 1 + len(drafts[i]) rows each. The same rule as `verify_greedy`: keep the longest
    prefix equal to the target's argmax, then emit the target's token after it."""
    nodes, emitted, row = [], [], 0
    for chain in drafts:
        target = target_ids[row:row + len(chain) + 1]
        row += len(chain) + 1
        a = 0
        while a < len(chain) and chain[a] == target[a]:
            a += 1
        nodes.append(list(range(a)))
        emitted.append(chain[:a] + [target[a]])
    if row != len(target_ids):
        raise ValueError(f"{len(target_ids)} target rows for chains feeding {row}")
    return VerifyResult(nodes, emitted)


def _result(draft_tokens: torch.Tensor, accepted: torch.Tensor, extra: torch.Tensor) -> VerifyResult:
    """Host lists from one device-to-host copy."""
    host = torch.cat([accepted.long(), draft_tokens, extra[:, None]], 1).tolist()  # [B, 2N + 1]
    N = draft_tokens.shape[1]
    nodes = [[j for j in range(N) if row[j]] for row in host]
    emitted = [[row[N + j] for j in path] + [row[-1]] for row, path in zip(host, nodes)]
    return VerifyResult(nodes, emitted)
