"""The training curve: on held-out answers never trained on, per unrolled draft step (or Medusa head), how often
the head's top-1 / top-2 / top-4 hold the target's own top-1 over its whole vocabulary (step 1's top-1 is a chain's
greedy first-position acceptance), against the answer tokens trained on."""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from specdec.training.losses import logits_input
from specdec.training.targets import target_outputs

if TYPE_CHECKING:
    from specdec.models.llama import LlamaModel


@torch.inference_mode()
def held_out_outputs(target: LlamaModel, head: torch.nn.Module, held: list[tuple[list[int], list[bool]]]
                     ) -> list[tuple]:
    """Per held-out sample, what the curve needs of the target, computed once: (features, last layer's output,
    normed state, the target's top-1 over its whole vocabulary at every position)."""
    out = []
    for ids, _ in held:
        features, hidden, logits = target_outputs(target, ids, head.aux_layers)
        out.append((features, hidden, target.norm(hidden), logits.argmax(-1)))
    return out


@torch.no_grad()
def curve_point(head: torch.nn.Module, target: LlamaModel, held: list[tuple[list[int], list[bool]]],
                outputs: list[tuple], steps: int, autocast: contextlib.AbstractContextManager) -> dict:
    """Per unrolled draft step (or Medusa head), over the held-out answers' rows: how often the head's top-1 /
    top-2 / top-4 hold the target's own top-1 over its whole vocabulary. Step 1's top-1 is the greedy
    first-position acceptance of a chain; a token outside the draft vocabulary is always a miss."""
    hits: dict[int, list[float]] = {}
    for (ids, mask), (features, hidden, normed, top1) in zip(held, outputs):
        embeds = target.embed(torch.tensor(ids[1:], device=target.device)).float()
        with autocast:
            terms, _, _ = head.training_terms(embeds, features, hidden, normed, steps)
        for s, (out, ahead, first_row) in enumerate(terms):
            n = len(out)
            rows = torch.tensor(mask[ahead + 1:ahead + 1 + n], device=out.device)
            rows &= torch.arange(n, device=out.device) >= first_row
            if n <= 0 or not rows.any():
                continue
            logits = F.linear(logits_input(head, out[rows].float()), head.lm_head.float())
            best = logits.topk(min(4, logits.shape[-1]), -1).indices
            best = head.target_ids(best) if hasattr(head, "d2t") else best
            hit = best == top1[ahead:ahead + n][rows][:, None]
            acc = hits.setdefault(s, [0.0, 0.0, 0.0, 0.0])
            for j, k in enumerate((1, 2, 4)):
                acc[j] += hit[:, :k].any(-1).sum().item()
            acc[3] += len(hit)
    return {f"step{s + 1}": {"top1": round(a[0] / a[3], 4), "top2": round(a[1] / a[3], 4),
                             "top4": round(a[2] / a[3], 4), "rows": int(a[3])} for s, a in sorted(hits.items())}
