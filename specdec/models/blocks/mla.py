"""Multi-head latent attention (DeepSeek-V2 and V3), in its decoding form: the per-head key and value
up-projections absorbed, so the cache holds one latent row per token and every head attends over it.

    q        = q_proj(x)  or  q_b_proj(norm(q_a_proj(x)))                      [T, nH, nope + rope]
    c, k_pe  = kv_a_proj(x) split [r | rope];  c = kv_a_norm(c)               [T, r], [T, rope]
    q_pe, k_pe rotated (RoPE on the rope dims only; DeepSeek pairs dims (2i, 2i + 1))
    key      = [c | k_pe]                 one cached head of r + rope          [T, 1, r + rope]
    query    = [q_nope @ W_uk[h] | q_pe]  W_uk[h]: head h's key rows of kv_b   [T, nH, r + rope]
    o        = softmax(query . key * scale) @ c   (the values are the latent)  [T, nH, r]
    out[h]   = o[h] @ W_uv[h].T           W_uv[h]: head h's value rows of kv_b [T, nH, v]

query . key = q_nope . (W_uk c) + q_pe . k_pe: the same scores as decompressing every key, for a cache of
r + rope numbers a token instead of nH * (nope + rope + v) (576 against 4,096 heads' worth on DeepSeek-V2-Lite).
The interleaved rotary pairs are de-interleaved before rotating, in queries and keys alike, so their dot products are
the model's. This is the reference and the CUDA path; on CPU the fused native layer runs the same steps (`Latent` in
`csrc/layer.h`). Every product goes through `kernels.linear` (per head for the absorbed ones), so a row's bits do not
depend on its step's other rows.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from specdec.config import ModelConfig
from specdec.models.blocks import kernels
from specdec.models.blocks.attention import AttentionMetadata, attend
from specdec.models.blocks.kernels import linear
from specdec.models.blocks.layers import Linear, RMSNorm
from specdec.models.blocks.rotary import rotate
from specdec.models.formats.quant import QuantWeight


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., R] with rotary pairs (2i, 2i + 1) -> [..., R] with pairs (i, i + R/2), the layout `rotate` turns."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class LatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str, act: torch.dtype) -> None:
        super().__init__()
        H, nH = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads, self.rank, self.rope_dim = nH, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        self.nope, self.v_dim, self.interleave = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.rope_interleave
        q_dim = nH * (self.nope + self.rope_dim)
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(H, cfg.q_lora_rank, False, dtype, device)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, act, device)
            self.q_proj = Linear(cfg.q_lora_rank, q_dim, False, dtype, device)  # q_b_proj
        else:
            self.q_a_proj, self.q_a_norm = None, None
            self.q_proj = Linear(H, q_dim, False, dtype, device)
        self.kv_a_proj = Linear(H, self.rank + self.rope_dim, False, dtype, device)
        self.kv_a_norm = RMSNorm(self.rank, cfg.rms_norm_eps, act, device)
        # kv_b_proj [nH * (nope + v), r] split per head: keys' rows transposed to [nH, r, nope] (q_nope -> latent),
        # values' [nH, v, r] (latent -> value); float, as `kv_b_proj` is small and read per head
        self.w_uk = nn.Parameter(torch.empty(nH, self.rank, self.nope, dtype=act, device=device), requires_grad=False)
        self.w_uv = nn.Parameter(torch.empty(nH, self.v_dim, self.rank, dtype=act, device=device), requires_grad=False)

    @property
    def linears(self) -> tuple[Linear, ...]:
        return tuple(m for m in (self.q_a_proj, self.q_proj, self.kv_a_proj) if m is not None)

    def native_args(self) -> dict:
        """The native layer's view (`csrc/layer.h` Latent): q (or q_a, its norm and q), the kv_a norm, each head's
        absorbed matrices; the layer's qkv is kv_a."""
        return dict(mla_q_a=kernels.matrix(self.q_a_proj.weight) if self.q_a_proj is not None else None,
                    mla_q=kernels.matrix(self.q_proj.weight),
                    mla_q_a_norm=self.q_a_norm.weight.detach() if self.q_a_norm is not None else torch.empty(0),
                    mla_kv_a_norm=self.kv_a_norm.weight.detach(),
                    mla_w_uk=[kernels.matrix(w) for w in self.w_uk.detach()],
                    mla_w_uv=[kernels.matrix(w) for w in self.w_uv.detach()], mla_rope=self.rope_dim,
                    mla_nope=self.nope, mla_v=self.v_dim, mla_interleave=self.interleave)

    def load(self, p: str, take: Callable[[str], torch.Tensor],
             put: Callable[[torch.Tensor, torch.Tensor, str], None]) -> None:
        """DeepSeek's attention tensors: `{p}q_proj` (or `q_a_proj`, `q_a_layernorm`, `q_b_proj`),
        `kv_a_proj_with_mqa`, `kv_a_layernorm` and kv_b_proj as its absorbed halves `k_b_proj`, `v_b_proj`
        (`families.deepseek`)."""
        if self.q_a_proj is not None:
            self.q_a_proj.set_weight(take(p + "q_a_proj.weight"), p + "q_a_proj.weight")
            put(self.q_a_norm.weight, take(p + "q_a_layernorm.weight"), p + "q_a_layernorm.weight")
            self.q_proj.set_weight(take(p + "q_b_proj.weight"), p + "q_b_proj.weight")
        else:
            self.q_proj.set_weight(take(p + "q_proj.weight"), p + "q_proj.weight")
        self.kv_a_proj.set_weight(take(p + "kv_a_proj_with_mqa.weight"), p + "kv_a_proj_with_mqa.weight")
        put(self.kv_a_norm.weight, take(p + "kv_a_layernorm.weight"), p + "kv_a_layernorm.weight")
        self.set_absorbed(take(p + "k_b_proj.weight"), take(p + "v_b_proj.weight"), p)

    def set_absorbed(self, k_b: torch.Tensor | QuantWeight, v_b: torch.Tensor | QuantWeight, name: str) -> None:
        """The up-projections in llama.cpp's absorbed form: k_b [nH, r, nope], v_b [nH, v, r] (kv_b_proj's rows
        per head, the keys' transposed; `families.deepseek` splits a checkpoint's kv_b_proj so)."""
        for param, w, part in ((self.w_uk, k_b, "k_b_proj"), (self.w_uv, v_b, "v_b_proj")):
            w = w.dequantize() if isinstance(w, QuantWeight) else w
            if tuple(w.shape) != tuple(param.shape):
                raise ValueError(f"tensor {name}{part}.weight has shape {tuple(w.shape)}, config expects "
                                 f"{tuple(param.shape)}")
            param.data.copy_(w.float())

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                k_pool: torch.Tensor, scale: float) -> torch.Tensor:
        """x: [T, H] normed -> each head's value [T, nH, v]; k_pool [slots, 1, r + rope] holds the latent keys."""
        T = x.shape[0]
        q_in = self.q_a_norm(self.q_a_proj(x)) if self.q_a_proj is not None else x
        q = self.q_proj(q_in).view(T, self.num_heads, self.nope + self.rope_dim)
        q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)
        c, k_pe = self.kv_a_proj(x).split([self.rank, self.rope_dim], dim=-1)
        c = self.kv_a_norm(c.contiguous())
        pe = torch.cat((q_pe, k_pe[:, None, :]), dim=1)  # queries' and the key's rotated dims in one pass
        pe = rotate(deinterleave(pe) if self.interleave else pe, cos, sin)
        key = torch.cat((c, pe[:, -1]), dim=-1)[:, None, :].contiguous()  # [T, 1, r + rope]
        q_lat = torch.stack([linear(q_nope[:, h].contiguous(), self.w_uk[h]) for h in range(self.num_heads)], 1)
        query = torch.cat((q_lat, pe[:, :-1]), dim=-1).contiguous()  # [T, nH, r + rope]
        o = attend(query, key, key, k_pool, k_pool, meta, scale)[..., :self.rank]  # the values: the latent
        return torch.stack([linear(o[:, h].contiguous(), self.w_uv[h]) for h in range(self.num_heads)], 1)
