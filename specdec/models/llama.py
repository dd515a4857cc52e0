"""The decoder every family runs: the Llama form (Llama 2/3, SmolLM2, Mistral, Qwen2 with q/k/v bias, Qwen3 with
q/k norms, sliding windows) and the options other families add to it (`ModelConfig`'s family fields, set by
`specdec.models.families`): Gemma's GeGLU, sandwich norms, soft-caps and local rotary base, Phi's partial rotary
and LongRoPE, OLMoE's whole-q/k norms, gpt-oss's sinks, biases and clamped SwiGLU, DeepSeek's latent attention
(`mla.LatentAttention`), and mixture-of-experts MLPs (`moe.MoE`).

On CPU (inference) every layer, with any of these options, runs as one C++ call (`native`: norm, fused q/k/v, RoPE,
paged attention with its window, o, the gated MLP or the experts), whatever the weights are stored in (GGUF blocks or
float32/bfloat16/float16), and all layers as one stack. The torch code below is the path for CUDA, for training and
for a tensor-parallel shard, and the reference; on CPU its products, norms and attention are the same C++ kernels
called one by one, so a row's bits never depend on its step's other rows either way.
Logits are only computed for the rows that ask for them.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from specdec.config import ModelConfig
from specdec.models.blocks import kernels
from specdec.models.blocks.attention import AttentionMetadata, KVLayers, attend
from specdec.models.blocks.kernels import linear, on_native
from specdec.models.blocks.layers import Linear, RMSNorm, fuse_rows, glu, load_gated_mlp, replace_parameter
from specdec.models.blocks.mla import LatentAttention
from specdec.models.blocks.moe import MoE
from specdec.models.blocks.rotary import rope_tables, rotate
from specdec.models.cpu import native
from specdec.models.formats.quant import QuantWeight

__all__ = ["Linear", "RMSNorm", "DecoderLayer", "LlamaModel", "replace_parameter", "rope_tables"]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str, act: torch.dtype,
                 index: int | None = None) -> None:
        """dtype: the weight matrices; act: activations, norms and biases (see LlamaModel). index: the layer's place
        in its model, which decides its window, rotary base and MLP (None: a draft head's layer, full and dense)."""
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, D
        self.q_size, self.kv_size = self.num_heads * D, self.num_kv_heads * D
        self.window = cfg.window(index) if index is not None else 0
        self.local_rope = self.window > 0 and cfg.rope_local_theta is not None  # the model's second rotary table
        self.softcap = cfg.attn_softcap or 0.0
        self.act, self.clip_qkv = cfg.hidden_act, cfg.clip_qkv
        self.rotary = cfg.rotary_dim
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps, act, device)
        # DeepSeek's latent attention in place of q/k/v (its output heads are v_head_dim wide)
        self.mla = LatentAttention(cfg, dtype, device, act) if cfg.kv_lora_rank else None
        if self.mla is not None:
            self.q_size = self.num_heads * cfg.v_head_dim
        self.qkv_proj = Linear(H, self.q_size + 2 * self.kv_size, cfg.attention_bias, dtype, device, act) \
            if self.mla is None else None
        norm_q, norm_k = (self.q_size, self.kv_size) if cfg.qk_norm_full else (D, D)
        self.q_norm = RMSNorm(norm_q, cfg.rms_norm_eps, act, device) if cfg.qk_norm or cfg.qk_norm_full else None
        self.k_norm = RMSNorm(norm_k, cfg.rms_norm_eps, act, device) if cfg.qk_norm or cfg.qk_norm_full else None
        self.qk_norm_full = cfg.qk_norm_full
        self.o_proj = Linear(self.q_size, H, cfg.o_proj_bias, dtype, device, act)
        # gpt-oss: each head's sink logit in its softmax
        self.sinks = nn.Parameter(torch.zeros(self.num_heads, dtype=act, device=device), requires_grad=False) \
            if cfg.attn_sinks else None
        self.cfg = cfg
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps, act, device)  # the MLP's input norm
        # Gemma's sandwich: the attention's and the MLP's outputs normed before they join the residual stream
        self.attn_out_norm = RMSNorm(H, cfg.rms_norm_eps, act, device) if cfg.sandwich_norms else None
        self.mlp_out_norm = RMSNorm(H, cfg.rms_norm_eps, act, device) if cfg.sandwich_norms else None
        self.moe = MoE(cfg, dtype, device, act) if index is not None and index in cfg.moe_layers else None
        inter = 0 if self.moe is not None else cfg.intermediate_size
        self.gate_up_proj = Linear(H, 2 * inter, False, dtype, device) if self.moe is None else None
        self.down_proj = Linear(inter, H, False, dtype, device) if self.moe is None else None
        self.scale = cfg.attn_scale or D ** -0.5
        self._native: object | None = None  # the C++ layer over this layer's weights, built on first CPU call
        self.tp = None  # a `parallel.TPGroup` once sharded: this rank's heads and units, all-reduced outputs

    @property
    def linears(self) -> tuple[Linear, ...]:
        mlp = self.moe.linears if self.moe is not None else (self.gate_up_proj, self.down_proj)
        attn = self.mla.linears if self.mla is not None else (self.qkv_proj,)
        return (*attn, self.o_proj, *mlp)

    def native_layer(self) -> Any:  # a native Layer (pybind), or None
        """The C++ decoder layer over this layer's weights (blocks or float32/bfloat16/float16) with every family
        option and its experts, None where it cannot run: a tensor-parallel shard (all-reduces between its halves),
        weights off the CPU, or an input norm other than RMSNorm or none."""
        if self._native is None:
            if self.tp is not None or not native.available() or not isinstance(
                    self.input_layernorm, (RMSNorm, nn.Identity)) or not all(
                    lin.quantized or (lin.weight.device.type == "cpu" and lin.weight.dtype in kernels.FLOAT_KERNEL_IDS)
                    for lin in self.linears):
                return None
            qkv_b, q_norm, k_norm = (t.detach().float() for t in self._optional_weights())
            qkv = self.qkv_proj if self.mla is None else self.mla.kv_a_proj  # latent attention: the key projection
            ln1 = self.input_layernorm.weight.detach() if isinstance(self.input_layernorm, RMSNorm) else torch.empty(0)
            dense = self.moe is None
            self._native = native.ops().Layer(
                ln1, kernels.matrix(qkv.weight), qkv_b, q_norm, k_norm, kernels.matrix(self.o_proj.weight),
                self.post_attention_layernorm.weight.detach(),
                kernels.matrix(self.gate_up_proj.weight) if dense else None,
                kernels.matrix(self.down_proj.weight) if dense else None, self.num_heads, self.num_kv_heads,
                self.head_dim,
                self.post_attention_layernorm.eps, window=self.window, softcap=self.softcap,
                attn_out_norm=_weight(self.attn_out_norm), mlp_out_norm=_weight(self.mlp_out_norm),
                act={"silu": 0, "gelu_pytorch_tanh": 1, "swigluoai": 2}[self.act], rotary=self.rotary,
                local_rope=self.local_rope, qk_norm_full=self.qk_norm_full, clip=self.clip_qkv or 0.0,
                sinks=self.sinks.detach().float().contiguous() if self.sinks is not None else torch.empty(0),
                o_b=self.o_proj.bias.detach().float().contiguous() if self.o_proj.bias is not None else torch.empty(0),
                swiglu_alpha=self.cfg.swiglu_alpha, swiglu_limit=self.cfg.swiglu_limit,
                **({} if dense else self.moe.native_args()), **({} if self.mla is None else self.mla.native_args()))
        return self._native

    def _optional_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The qkv bias and the q / k norms, empty where the architecture has none (the fused kernels' form)."""
        none = torch.empty(0)
        return (self.qkv_proj.bias if self.qkv_proj is not None and self.qkv_proj.bias is not None else none,
                self.q_norm.weight if self.q_norm is not None else none,
                self.k_norm.weight if self.k_norm is not None else none)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        """x: [T, H], the flattened new tokens of every sequence."""
        if self.tp is not None:  # a shard: the row-parallel outputs are all-reduced between the fused halves
            q, k, v = self.project(self.input_layernorm(x), cos, sin)
            return self.finish(x, self.attend(q, k, v, k_pool, v_pool, meta))
        out = self.native_forward(x, cos, sin, meta, k_pool, v_pool)
        if out is not None:
            return out
        if self.mla is not None:
            return self.finish(x, self.mla(self.input_layernorm(x), cos, sin, meta, k_pool, self.scale))
        q, k, v = self.project(self.input_layernorm(x), cos, sin)
        return self.finish(x, self.attend(q, k, v, k_pool, v_pool, meta))

    def native_forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                       k_pool: torch.Tensor, v_pool: torch.Tensor, qkv_input: torch.Tensor | None = None
                       ) -> torch.Tensor | None:
        """The layer in one C++ call on CPU (None where it cannot run there): every row count (decode,
        verification, prefill) through the same code, so a token's bits never depend on how its step was
        batched and a self-draft is always accepted. qkv_input [T, in]: what QKV reads instead of the input norm
        of x (an EAGLE-3 head's 2H-wide rows)."""
        if not (on_native(x) and k_pool.device.type == "cpu") or (layer := self.native_layer()) is None:
            return None
        out = x.contiguous().clone()
        layer.forward(out, cos[:, 0].contiguous(), sin[:, 0].contiguous(), k_pool, v_pool, meta.slot_mapping,
                      meta.context_slots, meta.mask, meta.row_starts(),
                      self.scale, qkv_input.contiguous() if qkv_input is not None else torch.empty(0))
        return out

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """This layer's paged attention (its scale, window, soft-cap and sinks)."""
        return attend(q, k, v, k_pool, v_pool, meta, self.scale, self.window, self.softcap, self.sinks)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated queries and keys, and values, of the normed input x [T, in]: [T, Hq, D], [T, Hkv, D] x 2.
        Differentiable outside inference mode (the draft-head trainer runs the serving layers)."""
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.qk_norm_full:  # OLMoE: one norm over each whole projection
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            qkv = torch.cat((self.q_norm(q.contiguous()), self.k_norm(k.contiguous()), v), dim=-1)
        if self.clip_qkv is not None:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        qkv = qkv.view(T, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk, v = qkv.split([self.num_heads + self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.q_norm is not None and not self.qk_norm_full:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape),
                            self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)), dim=1)
        q, k = rotate(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)  # q and k in one pass
        return q, k, v.contiguous()

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The residual stream after attention [T, Hq, D]: output projection, then the MLP block."""
        out = self.o_proj(attn.reshape(x.shape[0], self.q_size))
        out = out if self.tp is None else self.tp.all_reduce(out)
        x = x + (self.attn_out_norm(out) if self.attn_out_norm is not None else out)
        h = self.post_attention_layernorm(x)
        if self.moe is not None:
            out = self.moe(h)
        else:
            gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
            out = self.down_proj(glu(self.cfg, gate, up))
        out = out if self.tp is None else self.tp.all_reduce(out)
        return x + (self.mlp_out_norm(out) if self.mlp_out_norm is not None else out)


def _weight(norm: RMSNorm | None) -> torch.Tensor:
    """A norm's weight for the native layer, empty where the layer has no such norm."""
    return norm.weight.detach() if norm is not None else torch.empty(0)


def load_decoder_layer(layer: DecoderLayer, prefix: str, take: Callable[[str], torch.Tensor],
                       put: Callable[[torch.Tensor, torch.Tensor, str], None], cfg: ModelConfig) -> None:
    """Copy one Hugging Face-named decoder layer (`{prefix}self_attn.q_proj.weight`, ...) into `layer`,
    fusing q/k/v and gate/up. take(name) -> tensor; put(param, tensor, name) checks the shape. A layer whose
    input norm is an Identity (EAGLE-1's first layer) reads no input_layernorm."""
    p = prefix
    if layer.mla is not None:
        layer.mla.load(p + "self_attn.", take, put)
    else:
        layer.qkv_proj.set_weight(fuse_rows([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]),
                                  p + "self_attn.qkv_proj.weight")
    if cfg.attention_bias and layer.mla is None:
        put(layer.qkv_proj.bias, torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]),
            p + "self_attn.qkv_proj.bias")
    layer.o_proj.set_weight(take(p + "self_attn.o_proj.weight"), p + "self_attn.o_proj.weight")
    if layer.o_proj.bias is not None:
        put(layer.o_proj.bias, take(p + "self_attn.o_proj.bias"), p + "self_attn.o_proj.bias")
    if layer.sinks is not None:
        put(layer.sinks, take(p + "self_attn.sinks"), p + "self_attn.sinks")
    if layer.q_norm is not None:
        put(layer.q_norm.weight, take(p + "self_attn.q_norm.weight"), p + "self_attn.q_norm.weight")
        put(layer.k_norm.weight, take(p + "self_attn.k_norm.weight"), p + "self_attn.k_norm.weight")
    if layer.moe is not None:
        layer.moe.load(p + "mlp.", take, put)
    else:
        load_gated_mlp(layer.gate_up_proj, layer.down_proj, p + "mlp.", take)
    if isinstance(layer.input_layernorm, RMSNorm):
        put(layer.input_layernorm.weight, take(p + "input_layernorm.weight"), p + "input_layernorm.weight")
    put(layer.post_attention_layernorm.weight, take(p + "post_attention_layernorm.weight"),
        p + "post_attention_layernorm.weight")
    if layer.attn_out_norm is not None:
        put(layer.attn_out_norm.weight, take(p + "attn_out_norm.weight"), p + "attn_out_norm.weight")
        put(layer.mlp_out_norm.weight, take(p + "mlp_out_norm.weight"), p + "mlp_out_norm.weight")


def decoder_layer_state(layer: DecoderLayer, prefix: str) -> dict[str, torch.Tensor]:
    """The inverse of load_decoder_layer: one layer's weights under Hugging Face names, with its QKV biases and
    q/k norms where it has them."""
    sizes = [layer.q_size, layer.kv_size, layer.kv_size]
    q, k, v = layer.qkv_proj.weight.split(sizes)
    gate, up = layer.gate_up_proj.weight.chunk(2)
    sd = {"self_attn.q_proj.weight": q, "self_attn.k_proj.weight": k, "self_attn.v_proj.weight": v,
          "self_attn.o_proj.weight": layer.o_proj.weight, "mlp.gate_proj.weight": gate, "mlp.up_proj.weight": up,
          "mlp.down_proj.weight": layer.down_proj.weight,
          "post_attention_layernorm.weight": layer.post_attention_layernorm.weight}
    if layer.qkv_proj.bias is not None:
        sd.update(zip((f"self_attn.{n}_proj.bias" for n in "qkv"), layer.qkv_proj.bias.split(sizes), strict=True))
    if layer.q_norm is not None:
        sd["self_attn.q_norm.weight"], sd["self_attn.k_norm.weight"] = layer.q_norm.weight, layer.k_norm.weight
    if isinstance(layer.input_layernorm, RMSNorm):
        sd["input_layernorm.weight"] = layer.input_layernorm.weight
    return {prefix + name: t for name, t in sd.items()}


class LlamaModel(nn.Module):
    """Decoder-only LM. forward(tokens, positions, meta, kv) -> final hidden states (+ chosen layers)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        """dtype: the weight matrices (embedding, projections, LM head). On CPU activations, norms, biases
        and the KV cache stay float32 (`act_dtype`; the native runtime keeps K/V in float16, `kv_dtype`): bfloat16
        there means bf16 weights widened inside our kernels, half the bytes per step with float32 arithmetic that
        does not depend on the batch shape. On CUDA everything runs in `dtype`."""
        super().__init__()
        self.config, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.act_dtype = torch.float32 if self.device.type == "cpu" else dtype
        act = self.act_dtype
        H, V = cfg.hidden_size, cfg.vocab_size
        self.embed_tokens = nn.Parameter(torch.empty(V, H, dtype=dtype, device=device), requires_grad=False)
        # Tied models share one [V, H] tensor between the embedding and the LM head.
        self.lm_head = self.embed_tokens if cfg.tie_word_embeddings else nn.Parameter(
            torch.empty(V, H, dtype=dtype, device=device), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, device, act, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps, act, device)
        cos, sin = rope_tables(cfg, act, device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.local_rope = any(layer.local_rope for layer in self.layers)
        if self.local_rope:  # Gemma 3's sliding layers: their own base
            cos, sin = rope_tables(cfg, act, device, local=True)
            self.register_buffer("rope_local_cos", cos, persistent=False)
            self.register_buffer("rope_local_sin", sin, persistent=False)
        self._stack: object | None = None  # the C++ stack of all layers (False: not every layer is quantized)
        # tensor parallel (`parallel.shard_model`): the group, this rank's LM-head rows and every rank's count
        self.tp, self.lm_shard, self.vocab_sizes = None, None, None
        self.kv_config = cfg  # the K/V heads this process caches (a shard's own)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [T] -> [T, H] in the activation dtype (times Gemma's sqrt(H), rounded to that dtype first, as
        transformers does)."""
        x = self.embed_tokens[tokens].to(self.act_dtype)
        scale = self.config.embed_scale
        return x if scale == 1.0 else x * torch.tensor(scale, dtype=self.act_dtype)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv: KVLayers, output_layers: tuple[int, ...] = (), num_layers: int | None = None
                ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """tokens, positions: [T], the new tokens of every sequence, flattened.

        Returns the final-normed hidden states [T, H] and {layer index: that layer's output [T, H]}
        for the layers in `output_layers` (EAGLE-3 reads low/mid/high features from these).
        num_layers: run only the first layers, then the final norm (early exit, for self-speculation).
        """
        n = len(self.layers) if num_layers is None else min(num_layers, len(self.layers))
        wanted = tuple(i for i in dict.fromkeys(output_layers) if i < n)
        hidden, features, _ = self._forward(tokens, positions, meta, kv, wanted, n, None)
        return hidden, dict(zip(wanted, features.split(hidden.shape[-1], -1))) if wanted else {}

    @torch.inference_mode()
    def forward_logits(self, tokens: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv: KVLayers,
                       logit_rows: list[int], output_layers: tuple[int, ...] = ()
                       ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The final-normed hidden states [T, H], the outputs of `output_layers` concatenated per row in that order
        [T, len(output_layers) * H] (None without any: a feature drafter's input as it reads it), and the float32
        logits [N, V] of the rows `logit_rows`: in the same native call where the whole stack runs as one (no return
        to Python between the last layer and the LM head), else `compute_logits`. Either way the same bits as
        `forward`, then `compute_logits(hidden[logit_rows])`."""
        return self._forward(tokens, positions, meta, kv, tuple(output_layers), len(self.layers), logit_rows)

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv: KVLayers,
                 output_layers: tuple[int, ...], n: int, logit_rows: list[int] | None
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The first n layers; the outputs of `output_layers` (each < n) concatenated per row; logits of
        `logit_rows` (None: none)."""
        x = self.embed(tokens)
        if on_native(x) and (stack := self.native_stack()) is not None:  # all layers in one C++ call
            head = kernels.matrix(self.lm_head) if logit_rows is not None else None
            local = (self.rope_local_cos, self.rope_local_sin) if self.local_rope else (torch.empty(0), torch.empty(0))
            normed, logits, features = stack.forward(
                x.contiguous(), self.rope_cos, self.rope_sin, positions, kv.k, kv.v, meta.slot_mapping,
                meta.context_slots, meta.mask, meta.row_starts(), self.layers[0].scale, n, list(output_layers), head,
                logit_rows or [], *local)
            return normed, features if output_layers else None, self.softcap(logits) if head is not None else None
        cos, sin = self.rope_cos[positions][:, None, :], self.rope_sin[positions][:, None, :]
        if self.local_rope:
            local = self.rope_local_cos[positions][:, None, :], self.rope_local_sin[positions][:, None, :]
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers[:n]):
            x = layer(x, *(local if layer.local_rope else (cos, sin)), meta, kv.k[i], kv.v[i])
            if i in output_layers:
                captured[i] = x
        hidden = self.norm(x)
        features = torch.cat([captured[i] for i in output_layers], -1) if output_layers else None
        if logit_rows is None:
            return hidden, features, None
        return hidden, features, self.compute_logits(hidden[torch.tensor(logit_rows, device=hidden.device)])

    @property
    def kv_dtype(self) -> torch.dtype:
        """The element type of this model's K/V cache: float16 where the native runtime computes every layer of a
        block-quantized model (attention then reads half the bytes per key; the kernels widen to float32), else the
        activation dtype (a float model stays the float32 reference)."""
        native_blocks = self.device.type == "cpu" and self.quantization is not None and self.native_stack() is not None
        return torch.float16 if native_blocks else self.act_dtype

    def native_stack(self) -> Any:  # a native Stack (pybind), or None
        """Every decoder layer as one C++ stack (the whole forward in one call), None where a layer has no C++ layer."""
        if self.tp is not None:
            return None
        if self._stack is None:
            layers = [layer.native_layer() for layer in self.layers]
            self._stack = native.ops().Stack(layers, self.norm.weight.detach(), self.norm.eps) \
                if all(layer is not None for layer in layers) else False
        return self._stack or None

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] (only the rows that need logits) -> float32 logits [N, V]. A shard computes its
        vocabulary rows and gathers every rank's (every rank must call this for the same rows)."""
        if self.tp is not None:
            logits = self.tp.gather_columns(linear(hidden, self.lm_shard).float(), self.vocab_sizes)
        else:
            logits = linear(hidden, self.lm_head).float()
        return self.softcap(logits)

    def softcap(self, logits: torch.Tensor) -> torch.Tensor:
        """Gemma 2's final soft-cap: cap * tanh(logits / cap), where configured."""
        cap = self.config.final_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named weights in, fusing q/k/v and gate/up and transposing linears."""
        cfg, sd = self.config, dict(sd)

        def take(name: str) -> torch.Tensor:
            if name not in sd:
                raise ValueError(f"checkpoint is missing tensor {name!r} required by the config")
            return sd.pop(name)

        def put(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
            if tuple(param.shape) != tuple(value.shape):
                raise ValueError(f"tensor {name!r} has shape {tuple(value.shape)}, config expects {tuple(param.shape)}")
            param.data.copy_(value.to(param.dtype))

        def put_matrix(attr: str, value: torch.Tensor | QuantWeight, name: str) -> None:
            """The embedding or LM head: into its float Parameter, or in its place when block-quantized."""
            if tuple(value.shape) != tuple(getattr(self, attr).shape):
                raise ValueError(f"tensor {name!r} has shape {tuple(value.shape)}, config expects "
                                 f"{tuple(getattr(self, attr).shape)}")
            if isinstance(value, QuantWeight):
                self.set_matrix(attr, value)
            else:
                put(getattr(self, attr), value, name)

        put_matrix("embed_tokens", take("model.embed_tokens.weight"), "model.embed_tokens.weight")
        if not cfg.tie_word_embeddings:
            put_matrix("lm_head", take("lm_head.weight"), "lm_head.weight")
        sd.pop("lm_head.weight", None)  # some tied checkpoints still store a copy
        for i, layer in enumerate(self.layers):
            load_decoder_layer(layer, f"model.layers.{i}.", take, put, cfg)
        put(self.norm.weight, take("model.norm.weight"), "model.norm.weight")
        leftover = [k for k in sd if not k.endswith("rotary_emb.inv_freq")]
        if leftover:
            raise ValueError(f"checkpoint has tensors the config does not expect, e.g. {leftover[:3]}")

    def weights_changed(self) -> None:
        """Forget the kernels' views of the weights (the fused layers, the stack); rebuilt on the next forward."""
        for layer in self.layers:
            layer._native = None
        self._stack = None

    def set_matrix(self, attr: str, value: QuantWeight) -> None:
        """Replace the embedding or the LM head ('embed_tokens', 'lm_head') by a block-quantized matrix; a tied
        model's other one is the same object, so it is replaced too."""
        tied = self.lm_head is self.embed_tokens
        for name in ("embed_tokens", "lm_head") if tied else (attr,):
            replace_parameter(self, name, value)

    @property
    def quantization(self) -> str | None:
        """The block formats of the decoder's matrices ('q4_1', or 'q4_k+q6_k' for a mix), None if float."""
        names = sorted({f for layer in self.layers for lin in layer.linears if lin.quantized
                        for f in lin.weight.formats})
        return "+".join(names) or None

    def weight_bytes_per_token(self) -> int:
        """Bytes of weights a single decode step must read (the memory-bandwidth roofline's numerator).

        Every parameter and quantized matrix once, except an untied input embedding, of which a step reads
        a single row, and a mixture's experts, of which a token reads its top k (their mean size each).
        """
        def nbytes(t: torch.Tensor | QuantWeight) -> int:
            return t.nbytes if isinstance(t, QuantWeight) else t.numel() * t.element_size()

        matrices = [*self.parameters(), self.embed_tokens, self.lm_head,
                    *(lin.weight for layer in self.layers for lin in layer.linears)]
        total = sum(nbytes(t) for t in {id(t): t for t in matrices}.values())
        if self.lm_head is not self.embed_tokens:
            total -= nbytes(self.embed_tokens) * (self.embed_tokens.shape[0] - 1) // self.embed_tokens.shape[0]
        for moe in (layer.moe for layer in self.layers if layer.moe is not None):
            experts = sum(nbytes(lin.weight) for lin in (*moe.gate_up, *moe.down))
            total -= experts - experts * moe.top_k // len(moe.gate_up)
        return total
