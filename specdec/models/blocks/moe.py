"""A mixture-of-experts MLP: a router picks each row's top-k experts, each expert a gated MLP of its own.

    router:   probs = softmax(x @ gate.T) [T, E] (or sigmoid: DeepSeek-V3);  top-k per row (renormalized to sum 1
              with norm_topk_prob), chosen among the best expert groups where grouped and by probs + a correction
              bias where the checkpoint has one; weights times routed_scaling_factor (DeepSeek)
    experts:  y_e(x) = down_e(act(gate_e(x)) * up_e(x))            (gate_e and up_e fused by rows, as dense MLPs)
    out[t]  = sum over the row's ranks j = 0..k-1, in rank order, of w[t, j] * y_{e[t, j]}(x[t])
              (+ shared(x) where a shared expert is configured, gated by sigmoid(x @ shared_gate.T) in Qwen2-MoE)

A step's rows are grouped by expert, so each expert's weights are read once a step whatever number of rows (the
batch and its draft rows) chose it: k rows read the union of their experts' bytes, never k times an expert. Each
row's sum runs over its own ranks in a fixed order and every product is the native GEMM, whose rows do not depend on
the other rows of the call: a row's bits are the same alone or in any batch, so greedy speculation stays identical.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from specdec.config import ModelConfig
from specdec.models.blocks import kernels
from specdec.models.blocks.kernels import linear
from specdec.models.blocks.layers import Linear, glu, load_gated_mlp


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str, act: torch.dtype) -> None:
        super().__init__()
        H, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.top_k, self.norm_topk_prob, self.act = cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.hidden_act
        self.scoring, self.groups, self.topk_groups = cfg.moe_scoring, cfg.moe_groups, cfg.moe_topk_groups
        self.scale = cfg.routed_scaling_factor
        self.gate = nn.Parameter(torch.empty(cfg.num_experts, H, dtype=act, device=device), requires_grad=False)
        self.gate_bias = nn.Parameter(torch.zeros(cfg.num_experts, dtype=act, device=device), requires_grad=False) \
            if cfg.router_bias else None
        self.cfg = cfg
        self.choice_bias = nn.Parameter(torch.zeros(cfg.num_experts, dtype=torch.float32, device=device),
                                        requires_grad=False) if cfg.moe_choice_bias else None
        bias = cfg.expert_bias
        self.gate_up = nn.ModuleList(Linear(H, 2 * inter, bias, dtype, device, act) for _ in range(cfg.num_experts))
        self.down = nn.ModuleList(Linear(inter, H, bias, dtype, device, act) for _ in range(cfg.num_experts))
        shared = cfg.shared_expert_intermediate_size
        self.shared_gate_up = Linear(H, 2 * shared, False, dtype, device) if shared else None
        self.shared_down = Linear(shared, H, False, dtype, device) if shared else None
        self.shared_gate = nn.Parameter(torch.empty(1, H, dtype=act, device=device), requires_grad=False) \
            if shared and cfg.shared_expert_gate else None


    @property
    def linears(self) -> tuple[Linear, ...]:
        shared = (self.shared_gate_up, self.shared_down) if self.shared_gate_up is not None else ()
        return (*self.gate_up, *self.down, *shared)

    def load(self, p: str, take: Callable[[str], torch.Tensor],
             put: Callable[[torch.Tensor, torch.Tensor, str], None]) -> None:
        """The mixture under the canonical names (`families` renames each family's): the router `{p}gate.weight`
        [E, H], experts `{p}experts.{e}.{gate,up,down}_proj.weight`, and a shared expert `{p}shared_expert.*` with
        its gate `{p}shared_expert_gate.weight` [1, H] where configured. put(param, tensor, name) checks the shape."""
        put(self.gate, take(p + "gate.weight"), p + "gate.weight")
        if self.gate_bias is not None:
            put(self.gate_bias, take(p + "gate.bias"), p + "gate.bias")
        if self.choice_bias is not None:
            put(self.choice_bias, take(p + "gate.e_score_correction_bias"), p + "gate.e_score_correction_bias")
        for e, (gate_up, down) in enumerate(zip(self.gate_up, self.down)):
            load_gated_mlp(gate_up, down, f"{p}experts.{e}.", take)
        if self.shared_gate_up is not None:
            load_gated_mlp(self.shared_gate_up, self.shared_down, p + "shared_expert.", take)
        if self.shared_gate is not None:
            put(self.shared_gate, take(p + "shared_expert_gate.weight"), p + "shared_expert_gate.weight")

    def native_args(self) -> dict:
        """The native layer's view of the mixture (`csrc/moe.h`): the router (its bias, DeepSeek's scoring, groups,
        correction bias and scale), each expert's matrices (and biases), the shared expert's and its gate."""
        shared = (self.shared_gate_up, self.shared_down) if self.shared_gate_up is not None else ()
        return dict(router=self.gate.detach().float().contiguous(),
                    experts_gate_up=[kernels.matrix(m.weight) for m in self.gate_up],
                    experts_down=[kernels.matrix(m.weight) for m in self.down], top_k=self.top_k,
                    norm_topk=self.norm_topk_prob, shared=[kernels.matrix(m.weight) for m in shared],
                    shared_gate=torch.empty(0) if self.shared_gate is None
                    else self.shared_gate.detach().float().reshape(-1).contiguous(),
                    router_b=self.gate_bias.detach().float().contiguous() if self.gate_bias is not None
                    else torch.empty(0),
                    experts_gate_up_b=[m.bias.detach().float().contiguous() for m in self.gate_up
                                       if m.bias is not None],
                    experts_down_b=[m.bias.detach().float().contiguous() for m in self.down if m.bias is not None],
                    scoring=1 if self.scoring == "sigmoid" else 0, groups=self.groups, topk_groups=self.topk_groups,
                    choice_b=self.choice_bias.detach().float().contiguous() if self.choice_bias is not None
                    else torch.empty(0), routed_scale=self.scale)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's experts [T, k] (by descending choice score) and their weights [T, k], float32."""
        logits = linear(x, self.gate, self.gate_bias).float()
        probs = torch.sigmoid(logits) if self.scoring == "sigmoid" else torch.softmax(logits, dim=-1)
        choice = probs if self.choice_bias is None else probs + self.choice_bias
        if self.groups > 1:  # only experts of the topk_groups best groups compete
            grouped = choice.view(choice.shape[0], self.groups, -1)
            score = grouped.topk(2, dim=-1)[0].sum(-1) if self.scoring == "sigmoid" else grouped.max(-1).values
            best = torch.topk(score, self.topk_groups, dim=-1)[1]
            keep = torch.zeros_like(score, dtype=torch.bool).scatter_(1, best, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)
        experts = torch.topk(choice, self.top_k, dim=-1)[1]
        weights = probs.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if self.scoring == "sigmoid" else 0.0))
        return experts, weights * self.scale if self.scale != 1.0 else weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] (the MLP's normed input) -> [T, H]."""
        experts, weights = self.route(x)
        T, k = experts.shape
        ys = x.new_zeros(k, T, x.shape[-1])  # ys[j, t]: row t's rank-j expert's output
        flat = experts.reshape(-1)
        for e in torch.unique(flat).tolist():  # every expert a step touches, its weights read once
            hits = (flat == e).nonzero()[:, 0]
            rows, ranks = hits // k, hits % k
            ys[ranks, rows] = self.expert(e, x[rows])
        out = ys[0] * weights[:, :1].to(x.dtype)
        for j in range(1, k):  # rank order, the same for a row alone or in a batch
            out = out + ys[j] * weights[:, j:j + 1].to(x.dtype)
        if self.shared_gate_up is not None:
            gate, up = self.shared_gate_up(x).chunk(2, dim=-1)
            shared = self.shared_down(glu(self.cfg, gate, up))
            gated = shared if self.shared_gate is None else torch.sigmoid(linear(x, self.shared_gate)) * shared
            out = out + gated
        return out

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e's gated MLP on its rows x [n, H]."""
        gate, up = self.gate_up[e](x).chunk(2, dim=-1)
        return self.down[e](glu(self.cfg, gate, up))
