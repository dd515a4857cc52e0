"""Draft trees: attention masks, depths and positions from parent pointers; static and dynamic tree shapes.

A draft tree for B sequences with up to N nodes each is given by parent pointers:

    parents [B, N] long   -1 = child of the root (the last committed token), -2 = padding;
                          topologically ordered (parent index < node index); a chain is arange(N) - 1

Static shapes are written in the EAGLE / Medusa choice-list format: each node is the path of child
ranks from the root, e.g. [[0], [1], [0, 0]] = the root's best and second-best candidates, then the
best candidate after the first of them. A node's token is its parent's rank-th best candidate.

    Dm-BFn  full tree of depth m and branching n (Meta's "EAGLE at scale" naming)
    Ni      pruned tree: the i nodes most likely to be accepted under measured acceptance statistics
    EAGLE-2 dynamic tree: expand the `topk` best frontier nodes by cumulative draft log-probability for
            `num_steps` steps, then keep the `num_draft_tokens` best nodes (SGLang's knob names)

Draft shapes as users write them (`speculative_config`'s "tree" and "dispatch" values), one grammar:

    "off" | "chain" | "chain-K" | K       a chain of K tokens (or none)
    "Dm-BFn" | [[0], [1], [0, 0], ...]    a static tree (full, or a choice list)
    {"topk", "num_steps", "num_draft_tokens"}   an EAGLE-2 dynamic tree

Everything here is a pure function on small tensors or lists; nothing runs a model.
"""
from __future__ import annotations

import functools
import heapq
import itertools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

ROOT, PAD = -1, -2  # parent pointers: a child of the last committed token; padding
MAX_TREE_NODES = 64  # draft nodes verified per sequence and step, at most

Path = tuple[int, ...]


# ---- masks, depths, positions, paths ---------------------------------------------------------------

def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """mask [B, N, N] bool: mask[b, i, j] iff node j is node i or one of its ancestors (root excluded).

    This is the tree part of the verification attention mask (every node also sees the whole committed
    prefix). Built the EAGLE way: since parents come first, each row is its parent's row plus itself.
    Padding rows see only themselves, so no attention row is ever empty.
    """
    B, N = parents.shape
    mask = torch.eye(N, dtype=torch.bool, device=parents.device).expand(B, N, N).clone()
    rows = torch.arange(B, device=parents.device)
    for i in range(N):
        p = parents[:, i]  # [B]
        inherited = mask[rows, p.clamp(min=0)] & (p >= 0)[:, None]  # [B, N] the parent's row, if any
        mask[:, i] |= inherited
    return mask


def depths(parents: torch.Tensor) -> torch.Tensor:
    """depth [B, N] long: 1 for children of the root, parent's depth + 1 below; 0 for padding."""
    return ancestor_mask(parents).sum(-1) * (parents != PAD)


# ---- feeding a tree to the model -------------------------------------------------------------------

@dataclass
class TreeFeed:
    """Rows fed in tree layout into the slots of one sequence from `start` on (the prefix before `start`
    is visible to every row): each row's slot offset, rotary position offset, and which of the `span`
    slots start.. it may see."""

    index: list[int]  # [rows] slot offset from start
    rope: list[int]  # [rows] rotary position offset from start
    visible: torch.Tensor  # [rows, span] bool

    @classmethod
    def verification(cls, parents: list[int]) -> TreeFeed:
        """Rows [last committed token, n draft nodes] with the nodes' parents (-1 = the last token): slots in
        node order, positions by depth, each node seeing its ancestors and the last token."""
        p = torch.tensor([parents], dtype=torch.long)
        n = len(parents)
        visible = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        visible[:, 0] = True
        visible[1:, 1:] = ancestor_mask(p)[0]
        return cls(list(range(n + 1)), [0] + depths(p)[0].tolist(), visible)

    @classmethod
    def level(cls, parents: list[int], nodes: list[int]) -> TreeFeed:
        """Draft nodes `nodes` of a tree whose slots follow the last committed token (start = its slot + 1;
        the nodes' ancestors are already cached there): how a drafter grows a tree one level per forward."""
        p = torch.tensor([parents], dtype=torch.long)
        span = max(nodes) + 1  # nodes after the newest fed one are no one's ancestors: not attended at all
        return cls(list(nodes), (depths(p)[0][nodes] - 1).tolist(), ancestor_mask(p)[0][nodes][:, :span])


# ---- static trees ----------------------------------------------------------------------------------

class StaticTree(NamedTuple):
    """A static tree shape; node i's token is the ranks[i]-th best candidate after its parent."""

    paths: list[Path]  # node i's path of child ranks from the root, depth then lexicographic order
    parents: torch.Tensor  # [N] long, -1 = child of the root
    ranks: torch.Tensor  # [N] long, which top-k candidate of its parent the node is
    depths: torch.Tensor  # [N] long, 1 for children of the root


def tree_from_choices(choices: Sequence[Sequence[int]]) -> StaticTree:
    """Parent pointers for a choice list; raises ValueError for an empty path, a negative rank, a
    duplicate, or a path whose parent path is missing (the tree would be disconnected).

    Nodes are ordered by depth, then lexicographically, so every parent precedes its children.
    """
    paths = sorted((tuple(c) for c in choices), key=lambda p: (len(p), p))
    index: dict[Path, int] = {}
    for path in paths:
        if not path or min(path) < 0:
            raise ValueError(f"tree choice {list(path)} must be a non-empty list of ranks >= 0")
        if path in index:
            raise ValueError(f"tree choice {list(path)} appears twice")
        if len(path) > 1 and path[:-1] not in index:
            raise ValueError(f"tree choice {list(path)} has no parent: {list(path[:-1])} is missing")
        index[path] = len(index)
    parents = [index[p[:-1]] if len(p) > 1 else ROOT for p in paths]
    return StaticTree(paths, torch.tensor(parents, dtype=torch.long),
                      torch.tensor([p[-1] for p in paths], dtype=torch.long),
                      torch.tensor([len(p) for p in paths], dtype=torch.long))


def full_tree(depth: int, branching: int) -> list[list[int]]:
    """Dm-BFn: every path of 1..depth ranks below `branching`; sum of branching**d nodes."""
    return [list(p) for d in range(1, depth + 1) for p in itertools.product(range(branching), repeat=d)]


def chain(k: int) -> list[list[int]]:
    """k nodes, each the best candidate after the previous: the plain speculative-decoding draft."""
    return [[0] * d for d in range(1, k + 1)]


def parse_tree_spec(spec: str) -> list[list[int]]:
    """Choices for a full tree written "Dm-BFn" (e.g. "D3-BF2"), as in Meta's EAGLE-at-scale report."""
    match = re.fullmatch(r"D(\d+)-BF(\d+)", spec.strip(), flags=re.IGNORECASE)
    if match is None:
        raise ValueError(f"tree spec {spec!r} is not of the form 'Dm-BFn' (e.g. 'D3-BF2')")
    return full_tree(int(match[1]), int(match[2]))


def pruned_tree(acceptance: Mapping[Path, float] | Sequence[Sequence[float]], num_nodes: int) -> list[list[int]]:
    """Ni: the `num_nodes` nodes most likely to be accepted, as a prefix-closed choice list.

    The model: a node is accepted only if its whole path is, so a tree's expected number of accepted
    tokens is the sum of its nodes' path acceptance probabilities. `acceptance` is either
    - a table [depth - 1][rank]: the rate at which the rank-th candidate is accepted given its parent
      was (measured per depth and rank); a path's probability is the product of its rates; or
    - a mapping from path to its measured acceptance probability; only its keys are candidates.
    When probabilities never increase along a path (always true for the table), the i most probable
    nodes form a tree and maximize the expected accepted length among i-node trees. Nodes are chosen
    best-first from the root's children, so the result is prefix-closed for any input; ties go to the
    shallower, then lexicographically smaller path.
    """
    prob = _path_prob(acceptance)
    candidates = [(-prob((r,)), 1, (r,)) for r in _child_ranks(acceptance, ())]
    heapq.heapify(candidates)
    chosen: list[list[int]] = []
    while candidates and len(chosen) < num_nodes:
        _, depth, path = heapq.heappop(candidates)
        chosen.append(list(path))
        for r in _child_ranks(acceptance, path):
            heapq.heappush(candidates, (-prob(path + (r,)), depth + 1, path + (r,)))
    return sorted(chosen, key=lambda p: (len(p), p))


def _path_prob(acceptance: Mapping[Path, float] | Sequence[Sequence[float]]) -> Callable[[Path], float]:
    if isinstance(acceptance, Mapping):
        return lambda path: acceptance[path]
    return lambda path: math.prod(acceptance[d][r] for d, r in enumerate(path))


def _child_ranks(acceptance: Mapping[Path, float] | Sequence[Sequence[float]], path: Path) -> list[int]:
    if isinstance(acceptance, Mapping):
        return sorted(p[-1] for p in acceptance if len(p) == len(path) + 1 and p[:-1] == path)
    return list(range(len(acceptance[len(path)]))) if len(path) < len(acceptance) else []


# ---- dynamic trees (EAGLE-2) -----------------------------------------------------------------------

class Expansion(NamedTuple):
    """One EAGLE-2 expansion step: every candidate child joins the tree; `next_frontier` are expanded next."""

    tokens: torch.Tensor  # [B, F * K] long, candidate tokens, frontier node-major
    parents: torch.Tensor  # [B, F * K] long, the frontier node each candidate hangs from
    scores: torch.Tensor  # [B, F * K] float, cumulative log-probability from the root
    next_frontier: torch.Tensor  # [B, topk] long, indices into the candidates, best first


def expand_step(frontier_nodes: torch.Tensor, frontier_scores: torch.Tensor, child_tokens: torch.Tensor,
                child_logprobs: torch.Tensor, topk: int) -> Expansion:
    """Score each frontier node's top-K children and pick the `topk` best to expand next (EAGLE-2).

    frontier_nodes [B, F] long (tree indices; -1 for the root), frontier_scores [B, F] cumulative
    log-probabilities, child_tokens / child_logprobs [B, F, K] each frontier node's top-K draft tokens.
    A candidate's score is its parent's score plus its own log-probability, i.e. the draft's estimate of
    the probability that its whole path is accepted, so the most promising branches grow; ties go to the
    lower candidate index.
    """
    B, F, K = child_tokens.shape
    scores = (frontier_scores[:, :, None] + child_logprobs).reshape(B, F * K)
    parents = frontier_nodes[:, :, None].expand(B, F, K).reshape(B, F * K)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    return Expansion(child_tokens.reshape(B, F * K), parents, scores, order[:, :topk])


def select_dynamic_tree(cum_logprobs: torch.Tensor, parents: torch.Tensor,
                        num_draft_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-2 rerank: keep the `num_draft_tokens` best nodes of a candidate tree, always a tree.

    cum_logprobs [B, N], parents [B, N] -> keep [B, K] node indices, new_parents [B, K] with
    K = min(num_draft_tokens, N). Kept real nodes come first in index order (so the result stays
    topologically ordered), then padding: rows with fewer real nodes keep padding nodes, whose new
    parent is -2. Gather tokens and draft probabilities with `keep`.

    Cumulative log-probabilities never increase along a path, so the top-K is prefix-closed up to ties.
    To guarantee closure, each node is scored by the minimum along its path (a no-op for true cumulative
    scores), and ties go to the lower index, which always ranks a parent before its child.
    """
    B, N = parents.shape
    K = min(num_draft_tokens, N)
    real = parents != PAD
    score = _path_min(cum_logprobs, parents)  # [B, N]
    by_score = torch.sort(score, dim=1, descending=True, stable=True).indices
    real_first = torch.sort((~real).gather(1, by_score).long(), dim=1, stable=True).indices
    top = by_score.gather(1, real_first)[:, :K]  # [B, K] best real nodes, then padding
    keep = torch.sort(top + N * (~real).gather(1, top), dim=1).values % N  # real ascending, then padding
    new_index = torch.full((B, N), PAD, dtype=torch.long, device=parents.device)
    new_index.scatter_(1, keep, torch.arange(K, device=parents.device).expand(B, K))
    old_parents = parents.gather(1, keep)  # [B, K]
    new_parents = torch.where(old_parents >= 0, new_index.gather(1, old_parents.clamp(min=0)), old_parents)
    return keep, new_parents


def _path_min(scores: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """[B, N]: each node's score capped by its parent's capped score (monotone along every path): the minimum over
    its path, found by relaxing every node at once until nothing changes (as many rounds as the tree is deep)."""
    capped = scores.clone()
    has_parent, parent = parents >= 0, parents.clamp(min=0)
    for _ in range(parents.shape[1]):  # a path is at most N nodes long
        relaxed = torch.where(has_parent, torch.minimum(capped, capped.gather(1, parent)), capped)
        if torch.equal(relaxed, capped):
            break
        capped = relaxed
    return capped


# ---- draft shapes: the grammar of "tree" and "dispatch" values -----------------------------------

@dataclass(frozen=True)
class SpecShape:
    """What one speculative step drafts per sequence: a chain of k tokens, or a static tree (choice list,
    node order), or an EAGLE-2 dynamic tree; k = 0 is no speculation."""

    k: int
    tree: tuple[tuple[int, ...], ...] | None = None
    dynamic: tuple[int, int, int] | None = None  # EAGLE-2 (topk, num_steps, num_draft_tokens)

    @property
    def num_tokens(self) -> int:
        """Draft nodes verified per sequence."""
        return self.dynamic[2] if self.dynamic else len(self.tree) if self.tree else self.k

    @property
    def num_slots(self) -> int:
        """KV slots a step writes after the last committed token (a dynamic tree's drafter feeds
        topk * (num_steps - 1) candidates before choosing which to verify)."""
        return max(self.num_tokens, self.dynamic[0] * (self.dynamic[1] - 1)) if self.dynamic else self.num_tokens

    @property
    def depth(self) -> int:
        """The deepest node (a dynamic tree: its number of expansion steps)."""
        return self.dynamic[1] if self.dynamic else max(map(len, self.tree)) if self.tree else self.k

    def nodes_within(self, depth: int) -> int:
        """How many nodes lie at most `depth` deep (nodes are in depth order): the draft that can still be
        accepted when only `depth` more tokens may be emitted. Dynamic trees limit their depth themselves."""
        if self.dynamic:
            return self.num_tokens if depth > 0 else 0
        if self.tree is None:
            return max(0, min(self.k, depth))
        return sum(1 for path in self.tree if len(path) <= depth)

    def __str__(self) -> str:
        if self.dynamic:
            return "dynamic(topk={}, num_steps={}, num_draft_tokens={})".format(*self.dynamic)
        return "off" if self.k == 0 else f"tree({len(self.tree)} nodes)" if self.tree else f"chain-{self.k}"

    def to_json(self) -> str | list[list[int]] | dict:
        """The shape written back in the grammar (how `specdec tune` writes dispatch tables)."""
        if self.dynamic:
            return dict(zip(("topk", "num_steps", "num_draft_tokens"), self.dynamic))
        return "off" if self.k == 0 else [list(p) for p in self.tree] if self.tree else f"chain-{self.k}"


def parse_shape(value: Any, k: int, what: str = "tree", method: str = "", tree_methods: Sequence[str] = (),
                dynamic_methods: Sequence[str] = ()) -> SpecShape:
    """A draft shape in the grammar above, for `method` (k: its num_speculative_tokens). Trees are refused
    unless the method is in `tree_methods`, dynamic trees unless it is in `dynamic_methods`; every refusal
    is a ValueError naming `what` and the value."""
    if value == "off":
        return SpecShape(0)
    if value in ("chain", None):
        return SpecShape(k)
    chain_k = re.fullmatch(r"chain-(\d+)", value) if isinstance(value, str) else None
    if chain_k or (isinstance(value, int) and not isinstance(value, bool)):
        n = int(chain_k[1]) if chain_k else value
        if not 1 <= n <= 15:
            raise ValueError(f"invalid {what} {value!r}: a chain drafts 1 to 15 tokens")
        return SpecShape(n)
    if method not in tree_methods:
        raise ValueError(f"invalid {what} {value!r}: method {method!r} drafts chains only ('chain', "
                           f"'chain-K' or 'off'); trees are available for {list(tree_methods)} (ngram branches "
                           "with 'ngram_branches'; a custom drafter returns its own trees)")
    if isinstance(value, dict):
        if method not in dynamic_methods:
            raise ValueError(f"invalid {what} {value!r}: dynamic trees are available for "
                               f"{' and '.join(dynamic_methods)}; {method} drafts chains and static trees")
        return _parse_dynamic(value, what)
    try:
        if isinstance(value, str):
            choices = parse_tree_spec(value)
        elif isinstance(value, list) and all(isinstance(c, list) and all(isinstance(r, int) for r in c)
                                             for c in value):
            choices = [list(c) for c in value]
        else:
            raise ValueError("expected 'off', 'chain', 'chain-K', a full tree 'Dm-BFn' (e.g. 'D3-BF2'), "
                             "a choice list such as [[0], [1], [0, 0]] or a dynamic tree "
                             '{"topk": 4, "num_steps": 3, "num_draft_tokens": 12}')
        tree = tree_from_choices(choices)
    except ValueError as e:
        raise ValueError(f"invalid {what} {value!r}: {e}") from None
    if not 1 <= len(choices) <= MAX_TREE_NODES:
        raise ValueError(f"invalid {what} {value!r}: it has {len(choices)} nodes; at most "
                           f"{MAX_TREE_NODES} are verified per step")
    return SpecShape(len(choices), tuple(tuple(p) for p in tree.paths))


def _parse_dynamic(value: dict, what: str) -> SpecShape:
    """EAGLE-2's dynamic tree, with SGLang's knob names."""
    limits = {"topk": (1, 8), "num_steps": (1, 8), "num_draft_tokens": (1, MAX_TREE_NODES)}
    if set(value) != set(limits):
        raise ValueError(f"invalid {what} {value!r}: a dynamic tree needs exactly the keys {sorted(limits)}")
    for key, (lo, hi) in limits.items():
        v = value[key]
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise ValueError(f"invalid {what}: {key}={v!r} must be an integer in [{lo}, {hi}]")
    return SpecShape(value["num_draft_tokens"], dynamic=(value["topk"], value["num_steps"], value["num_draft_tokens"]))


class TreeShape:
    """A static tree prepared for drafting: parents, ranks and the nodes of each level."""

    def __init__(self, choices: tuple[tuple[int, ...], ...]) -> None:
        tree = tree_from_choices(choices)
        self.tensor_parents = tree.parents
        self.parents, self.ranks = tree.parents.tolist(), tree.ranks.tolist()
        self.width = max(self.ranks) + 1
        depth = tree.depths.tolist()
        self.levels = [[n for n, d in enumerate(depth) if d == level] for level in range(1, max(depth) + 1)]


@functools.lru_cache(maxsize=64)
def tree_shape(choices: tuple[tuple[int, ...], ...]) -> TreeShape:
    """The prepared form of a static tree, made once per shape for every drafter."""
    return TreeShape(choices)
