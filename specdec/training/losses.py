"""The draft-head trainer's loss: equation 1 of the Meta report (a distribution term on the head's logits and a
SmoothL1 term on its output), per training sequence over every term the head fits (unrolled steps, Medusa heads),
later terms weighted down; the distribution term is chosen by `--objective` (`distribution_term`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from specdec.config import SpecdecError
from specdec.models.blocks.kernels import linear
from specdec.training.targets import target_outputs

if TYPE_CHECKING:
    from specdec.models.llama import LlamaModel

CE_WEIGHT, REGRESSION_WEIGHT = 0.1, 1.0
TTT_DECAY = 0.8  # weight of unrolled step s: 0.8^(s - 1)
OBJECTIVES = ("ce", "topk", "acceptance", "replay")


@dataclass(frozen=True)
class LossOptions:
    """What `sequence_loss` reads of a training run (`TrainConfig.loss_options()`), and nothing else of it."""

    ttt_steps: int = 1  # the head unrolled on its own outputs this many steps (EAGLE-3's training-time test)
    ce_weight: float = CE_WEIGHT  # weight of the distribution term
    regression_weight: float = REGRESSION_WEIGHT  # weight of the SmoothL1 hidden-state term
    objective: str = "ce"  # the distribution term (`distribution_term`): one of OBJECTIVES
    topk: int = 8  # tokens of objective "topk"


def logits_input(head: torch.nn.Module, out: torch.Tensor) -> torch.Tensor:
    """What a head's LM head reads of its outputs [N, H], differentiable: its final RMSNorm of them (`logit_norm`),
    or the outputs themselves where it has none (Medusa, an EAGLE head without one, an EAGLE-3 head whose outputs
    are normed already)."""
    norm = getattr(head, "logit_norm", None)
    return F.rms_norm(out.float(), norm.weight.shape, norm.weight.float(), norm.eps) if hasattr(norm, "weight") \
        else out


REPLAY_WEIGHT = 4.0  # "replay": a row whose draft the target would reject counts this many times a kept one


def distribution_term(logits: torch.Tensor, target_logits: torch.Tensor, objective: str = "ce", topk: int = 8
                      ) -> torch.Tensor:
    """The term that fits the head's distribution q (logits [N, V]) to the target's p (target_logits [N, V]),
    averaged over the rows:

    - "ce": cross-entropy against the whole of p, -sum p log q (EAGLE's);
    - "topk": cross-entropy against p's `topk` most likely tokens only, renormalized (HASS-style top-K
      distillation: the tail, which a draft is never accepted on, takes no capacity);
    - "acceptance": -log sum_x min(p(x), q(x)), the log of the probability that a token sampled from q is
      accepted against p (a total-variation loss, as the LK losses), plus a tenth of "ce" to give rows where
      q and p do not overlap a gradient;
    - "replay": "ce" with each row weighted by whether the head's own greedy draft there would be rejected (its
      top-1 is not the target's): rejected rows count REPLAY_WEIGHT times, the weights renormalized. On-policy
      replay from the rejected positions (DistillSpec, Draft-OPD): the head's capacity goes where serving finds
      it wrong, on the target's own answers."""
    logq = torch.log_softmax(logits.float(), -1)
    p = torch.softmax(target_logits.float(), -1)
    if objective == "ce":
        return -(p * logq).sum(-1).mean()
    if objective == "topk":
        top = p.topk(min(topk, p.shape[-1]), -1)
        weights = top.values / top.values.sum(-1, keepdim=True)
        return -(weights * logq.gather(-1, top.indices)).sum(-1).mean()
    if objective == "acceptance":
        accepted = torch.minimum(p, logq.exp()).sum(-1).clamp_min(1e-6)
        return -accepted.log().mean() - 0.1 * (p * logq).sum(-1).mean()
    if objective == "replay":
        with torch.no_grad():
            weights = 1.0 + (REPLAY_WEIGHT - 1.0) * (logits.argmax(-1) != target_logits.argmax(-1)).float()
        return -((p * logq).sum(-1) * weights).sum() / weights.sum()
    raise SpecdecError(f"unknown objective {objective!r}: one of {OBJECTIVES}")


def head_loss(head: torch.nn.Module, out: torch.Tensor, target_hidden: torch.Tensor, target_logits: torch.Tensor,
              mask: torch.Tensor, draft_ids: torch.Tensor | None,
              weights: tuple[float, float] = (CE_WEIGHT, REGRESSION_WEIGHT), objective: str = "ce", topk: int = 8
              ) -> tuple[torch.Tensor, dict]:
    """Equation 1 on rows whose predicted token (t + 2) is an assistant token, its distribution term chosen by
    `objective` (`distribution_term`). out: [T, H] head outputs; target_hidden / target_logits: the target at
    t + 1 for row t ([T, H], [T, V]); mask [T] bool; draft_ids: the target ids of the head's vocabulary (None:
    the target's whole vocabulary)."""
    out, target_hidden, target_logits = out[mask], target_hidden[mask], target_logits[mask].float()
    if draft_ids is not None:
        target_logits = target_logits[:, draft_ids]
    logits = F.linear(logits_input(head, out), head.lm_head)  # [N, draft_vocab]
    fit = distribution_term(logits, target_logits, objective, topk)
    regression = F.smooth_l1_loss(out.float(), target_hidden.float())
    with torch.no_grad():  # how often the head's top-1 / top-2 / top-4 hold the target's top-1
        best = logits.topk(min(4, logits.shape[-1]), -1).indices == target_logits.argmax(-1)[:, None]
        recall = {f"top{k}": best[:, :k].any(-1).float().mean().item() for k in (1, 2, 4)}
    return weights[0] * fit + weights[1] * regression, {"ce": fit.item(), "l1": regression.item(), **recall,
                                                             "n": len(out)}


def sequence_loss(head: torch.nn.Module, target: LlamaModel, ids: list[int], mask: list[bool], options: LossOptions,
                  outputs: tuple[torch.Tensor | None, torch.Tensor, None] | None = None,
                  lm_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Equation 1 over one training sequence; the target runs once, under inference mode.

    Row t pairs the target's feature of token t with the embedding of token t + 1 and is trained against the
    target at t + 1 (token t + 2). lm_rows: the target's LM head rows of the head's vocabulary, when the caller
    has them at hand. The head says what it fits (`training_terms`): each term is (head output
    [n, H], ahead, first row): row t is trained against the target at t + ahead (predicting token
    t + ahead + 1), from `first row` on; later terms (unrolled steps, further heads) weigh less."""
    features, hidden, _ = outputs or target_outputs(target, ids, head.aux_layers, logits=False)
    with torch.inference_mode():
        normed = target.norm(hidden)
    embeds = target.embed(torch.tensor(ids[1:])).float()
    terms, goal, draft_ids = head.training_terms(embeds, features, hidden, normed, options.ttt_steps)
    with torch.inference_mode():  # the target's logits over the head's vocabulary only (a sixth of the rows)
        goal_logits = (target.compute_logits(normed) if draft_ids is None
                       else linear(normed, lm_rows if lm_rows is not None else target.lm_head[draft_ids]).float())
    loss, stats = 0.0, {}
    for s, (out, ahead, first_row) in enumerate(terms):
        n = len(out)
        step_mask = torch.tensor(mask[ahead + 1:ahead + 1 + n]) & (torch.arange(n) >= first_row)
        if n <= 0 or not step_mask.any():
            continue
        step_loss, step_stats = head_loss(head, out, goal[ahead:ahead + n], goal_logits[ahead:ahead + n], step_mask,
                                          None, (options.ce_weight, options.regression_weight),
                                          options.objective, options.topk)
        loss = loss + TTT_DECAY ** s * step_loss
        stats = stats or step_stats  # the progress bar reports the first step / head
    return loss, stats
