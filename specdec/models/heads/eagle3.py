"""The EAGLE-3 draft head, in the checkpoint layout SpecForge trains and SGLang / vLLM serve.

    features  = concat(target layer outputs at low, mid, high layers)       [T, 3H]   (first draft step)
    h         = fc(features)  or  the head's own previous output            [T, H]
    x         = concat(input_layernorm(embed(token)), hidden_norm(h))       [T, 2H]   (embed: the target's)
    h'        = h + o_proj(attention(x))                                    one decoder layer whose q/k/v
    out       = h' + mlp(post_attention_layernorm(h'))                      read 2H inputs
    logits    = lm_head(norm(out))                                          [T, draft_vocab]
    target id = draft id + d2t[draft id]

Token alignment (as in EAGLE's training): the row at position t pairs the target's feature of token t with
the embedding of token t + 1, and predicts token t + 2. `out` is fed back as h for the next draft step.

Checkpoint (a directory): config.json (a Llama config with `draft_vocab_size` and optionally
`eagle_config.eagle_aux_hidden_state_layer_ids`) + model.safetensors with `fc.weight`, `midlayer.*`
(`input_layernorm`, `hidden_norm`, `self_attn.{q,k,v,o}_proj`, `post_attention_layernorm`,
`mlp.{gate,up,down}_proj`), `norm.weight`, `lm_head.weight`, `d2t` and `t2d`.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specdec.config import ModelConfig, SpecdecError
from specdec.models.blocks import kernels
from specdec.models.blocks.attention import AttentionMetadata, KVLayers
from specdec.models.blocks.kernels import greedy_with_logprob, linear, on_native
from specdec.models.cpu import native
from specdec.models.formats.quant import QuantWeight
from specdec.models.heads.files import HeadCheckpoint, TensorCopier, check_made_for, init_random
from specdec.models.heads.formats import read_head
from specdec.models.llama import (
    DecoderLayer,
    Linear,
    LlamaModel,
    RMSNorm,
    decoder_layer_state,
    load_decoder_layer,
    rope_tables,
)


def default_aux_layers(num_target_layers: int) -> tuple[int, int, int]:
    """The low, mid and high target layers a head we create reads (their outputs): 2, N / 2, N - 3 (clamped for
    tiny models). Every head we save names its layers in its config."""
    last = num_target_layers - 1
    return tuple(min(max(i, 0), last) for i in (2, num_target_layers // 2, num_target_layers - 3))


def reference_aux_layers(num_target_layers: int) -> tuple[int, int, int]:
    """The layers a published head that names none reads (the EAGLE reference, vLLM and SGLang agree): the
    inputs of layers 2, N / 2 and N - 3, i.e. the outputs of layers 1, N / 2 - 1 and N - 4 (clamped)."""
    return tuple(max(i - 1, 0) for i in default_aux_layers(num_target_layers))


class Eagle3Layer(DecoderLayer):
    """A Llama decoder layer whose attention reads [norm(embedding), norm(hidden)] (2H wide). The residual
    stream is `hidden`, or with `norm_before_residual` (the speculators option) hidden_norm(hidden). Its q/k
    norms and QKV bias follow the head's config (a head for a Qwen3 target has q/k norms)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                 norm_before_residual: bool = False) -> None:
        super().__init__(cfg, dtype, device, torch.float32)
        H, D = cfg.hidden_size, cfg.head_dim
        self.norm_before_residual = norm_before_residual
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps, torch.float32, device)
        self.qkv_proj = Linear(2 * H, (self.num_heads + 2 * self.num_kv_heads) * D, cfg.attention_bias, dtype,
                               device, torch.float32)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        residual = self.residual(hidden)
        if on_native(hidden):  # one C++ call for the layer, as the target's layers (QKV reading the 2H rows)
            out = self.native_forward(residual, cos, sin, meta, k_pool, v_pool,
                                      qkv_input=self.qkv_rows(embeds, hidden))
            if out is not None:
                return out
        q, k, v = self.project_inputs(embeds, hidden, cos, sin)
        return self.finish(residual, self.attend(q, k, v, k_pool, v_pool, meta))

    def residual(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the attention output is added to: hidden, or hidden_norm(hidden) (`norm_before_residual`)."""
        return self.hidden_norm(hidden) if self.norm_before_residual else hidden

    def qkv_rows(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """What QKV reads: [norm(embedding of the next token), norm(hidden state)] [T, 2H]."""
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], -1)

    def project_inputs(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v ([T, Hq, D], [T, Hkv, D] x 2) of the rows (embedding of the next token, hidden state)."""
        return self.project(self.qkv_rows(embeds, hidden), cos, sin)


def unrolled_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float
                       ) -> torch.Tensor:
    """Attention of unrolled step s = len(keys) (see `Eagle3Head.unroll`): q [..., Hq, T, D] sees the step-1 keys
    of rows 0..p-s+1 and, for each step r = 2..s, the one row p - s + r. keys/values: per step, [..., Hq, T, D]
    (any leading batch dims)."""
    s, T = len(keys), q.shape[-2]
    pos = torch.arange(T, device=q.device)
    scores = (q @ keys[0].transpose(-1, -2)) * scale  # [..., Hq, T, T] against step-1 rows
    scores = scores.masked_fill(~(pos[None, :] <= pos[:, None] - (s - 1)), float("-inf"))
    shifted_values, extra = [], []
    for r in range(2, s + 1):  # one earlier draft row per step r: row p - (s - r), zeros above row 0
        shift = s - r
        k_r = F.pad(keys[r - 1][..., :T - shift, :], (0, 0, shift, 0))
        v_r = F.pad(values[r - 1][..., :T - shift, :], (0, 0, shift, 0))
        d = (q * k_r).sum(-1) * scale  # [..., Hq, T]
        extra.append(d.masked_fill(pos < shift, float("-inf"))[..., None])
        shifted_values.append(v_r)
    probs = torch.softmax(torch.cat([scores, *extra], -1), -1)
    attn = probs[..., :T] @ values[0]
    for j, v_r in enumerate(shifted_values):
        attn = attn + probs[..., T + j:T + j + 1] * v_r
    return attn


@dataclass(frozen=True)
class Eagle3Variant:
    """The published EAGLE-3 options beyond SpecForge's defaults, each read from a head's config and written back by
    `save`: where the hidden norm sits, a norm on the target's features, the head's own embedding. Its layer count,
    q/k norms and QKV bias are the head's config (`num_hidden_layers`, `model_type` qwen3, `attention_bias`)."""

    norm_before_residual: bool = False  # the residual stream starts from hidden_norm(h), not h (speculators)
    norm_before_fc: bool = False  # one RMSNorm (`input_norm`) over the concatenated target features before fc
    fc_norm: bool = False  # one RMSNorm per target layer's features (`fc_norm.{i}`) before fc (EAGLE 3.1)
    norm_output: bool = False  # the normed output is fed back and read by the LM head as is (EAGLE 3.1)
    own_embedding: bool = False  # the head's own `embed_tokens` [V, H], not the target's

    @property
    def native(self) -> bool:
        """Whether the whole draft step has a C++ form (`Eagle3Step`: SpecForge's layout, one layer)."""
        return not (self.norm_before_residual or self.norm_before_fc or self.fc_norm or self.norm_output)


class Eagle3Head(nn.Module):
    """config: the head's own Llama config (num_hidden_layers = its decoder layers: the first reads the 2H rows,
    the others are plain Llama layers over the residual stream, as in vLLM); it shares the target's embedding
    unless its checkpoint carries one (`variant.own_embedding`)."""

    unrolls = True  # trained with the training-time test (`unroll`)
    max_draft_depth: int | None = None

    def __init__(self, config: ModelConfig, draft_vocab_size: int, aux_layers: tuple[int, ...],
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 variant: Eagle3Variant | None = None, target_hidden_size: int | None = None) -> None:
        """target_hidden_size: the width of each target feature where it differs from the head's (fc then reads
        len(aux_layers) x that; such a head has its own embedding)."""
        super().__init__()
        H = config.hidden_size
        self.config, self.draft_vocab_size, self.aux_layers = config, draft_vocab_size, tuple(aux_layers)
        variant = variant or Eagle3Variant()
        self.dtype, self.device, self.variant = dtype, torch.device(device), variant
        self.target_hidden_size = target_hidden_size or H
        features = len(self.aux_layers) * self.target_hidden_size
        self.input_norm = RMSNorm(features, config.rms_norm_eps, torch.float32, device) \
            if variant.norm_before_fc else None
        self.fc_norm = nn.ModuleList(RMSNorm(features // len(self.aux_layers), config.rms_norm_eps, torch.float32,
                                             device) for _ in self.aux_layers) if variant.fc_norm else None
        self.fc = Linear(features, H, False, dtype, device)
        self.midlayer = Eagle3Layer(config, dtype, device, variant.norm_before_residual)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype, device, torch.float32)
                                    for _ in range(config.num_hidden_layers - 1))
        self.norm = RMSNorm(H, config.rms_norm_eps, torch.float32, device)
        self.lm_head = nn.Parameter(torch.empty(draft_vocab_size, H, dtype=dtype, device=device), requires_grad=False)
        self.embed_tokens = nn.Parameter(torch.empty(config.vocab_size, H, dtype=dtype, device=device),
                                         requires_grad=False) if variant.own_embedding else None
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long, device=device))
        cos, sin = rope_tables(config, torch.float32, device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._step: object | None = None  # the whole draft step in C++ (`native_step`), built on first use

    @torch.inference_mode()
    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv: KVLayers,
                features: torch.Tensor | None = None, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """One draft step for T rows: the target's `features` [T, 3H] (through fc) or the head's own previous
        output `hidden` [T, H]; embeds [T, H] of the tokens each row continues with. Returns out [T, H]."""
        h = self.project_features(features.float()) if features is not None else hidden
        cos, sin = self.rope_cos[positions][:, None, :], self.rope_sin[positions][:, None, :]
        out = self.midlayer(embeds.float(), h, cos, sin, meta, kv.k[0], kv.v[0])
        for i, layer in enumerate(self.layers, 1):
            out = layer(out, cos, sin, meta, kv.k[i], kv.v[i])
        return self.norm(out) if self.variant.norm_output else out

    def project_features(self, features: torch.Tensor) -> torch.Tensor:
        """fc(features) [T, H], after the features' norms where the head has them (`norm_before_fc`: one over
        all of them; `fc_norm`: one per target layer)."""
        if self.input_norm is not None:
            features = self.input_norm(features)
        if self.fc_norm is not None:
            chunks = features.chunk(len(self.fc_norm), dim=-1)
            features = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks, strict=True)], -1)
        return self.fc(features)

    @property
    def logit_norm(self) -> RMSNorm | None:
        """The norm the LM head reads outputs through (None: they are normed already, `norm_output`)."""
        return None if self.variant.norm_output else self.norm

    def logits_input(self, out: torch.Tensor) -> torch.Tensor:
        """What the LM head reads from an output: norm(out), or out itself where it is already normed
        (`norm_output`)."""
        return out if self.variant.norm_output else self.norm(out)

    def own_embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The head's own embedding of `ids` [T, H] (where `embed_tokens` is not None)."""
        return self.embed_tokens[ids]

    @torch.inference_mode()
    def draft_step(self, embeds: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv: KVLayers,
                   rows: list[int], features: torch.Tensor | None = None, hidden: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`forward`, then the head's greedy draft tokens (target ids [N]) at rows `rows` of its output and their
        log-probabilities under the head [N]: on CPU one C++ call and one thread team for all of it
        (`native_step`), the same bits as the op-by-op path."""
        x = features if features is not None else hidden
        if kv.k[0].device.type == "cpu" and on_native(x) and (step := self.native_step()) is not None:
            out, ids, logp = step.forward(embeds.float().contiguous(), x.contiguous(), features is not None,
                                          self.rope_cos, self.rope_sin, positions, kv.k[0], kv.v[0], meta.slot_mapping,
                                          meta.context_slots, meta.mask, meta.row_starts(), self.midlayer.scale, rows)
            return out, ids, logp
        out = self.forward(embeds, positions, meta, kv, features=features, hidden=hidden)
        return (out, *greedy_with_logprob(self.compute_logits(out[rows]), self.target_ids))

    def native_step(self) -> Any:  # a native Eagle3Step (pybind), or None
        """fc, the layer, the final norm, the LM head and the argmax as one C++ object over this head's weights (as
        they are now: built on first use, after any quantization), None where the layer has no C++ form."""
        if self._step is None:
            layer = self.midlayer.native_layer() if self.device.type == "cpu" and self.variant.native \
                and not len(self.layers) and self.target_hidden_size == self.config.hidden_size else None
            matrices = (self.fc.weight, self.lm_head)
            usable = layer is not None and all(isinstance(w, QuantWeight) or w.dtype in kernels.FLOAT_KERNEL_IDS
                                               for w in matrices)
            self._step = native.ops().Eagle3Step(
                kernels.matrix(self.fc.weight), layer, self.midlayer.hidden_norm.weight.detach().float().contiguous(),
                self.norm.weight.detach().float().contiguous(), kernels.matrix(self.lm_head), self.d2t) \
                if usable else False
        return self._step or None

    def unroll(self, embeds: torch.Tensor, features: torch.Tensor, steps: int = 1) -> list[torch.Tensor]:
        """The head over one whole sequence, differentiable, unrolled `steps` times on its own outputs (EAGLE-3's
        training-time test), through the serving layers. embeds [..., T, H], features [..., T, 3H]: one
        sequence, or a batch of right-padded ones (padding rows never reach a real row: attention is causal).
        Returns out_s [..., T, H] for s = 1..steps; row p of step s is what serving computes for the s-th draft
        token when the last feature it had was token p - s + 1's:

            step 1, row p: hidden fc(features[p]),  token p + 1 (embeds[p]), keys: step-1 rows 0..p
            step s, row p: hidden out_(s-1)[p - 1], token p + 1,             keys: step-1 rows 0..p-s+1, and the
                           step-r row p - s + r for r = 2..s (the draft rows serving wrote before it)

        so rows p < s - 1 of step s are meaningless. Only the attention pattern is training's own: serving
        reads the same keys from its paged cache."""
        L = self.midlayer
        lead, (T, H) = embeds.shape[:-2], embeds.shape[-2:]
        pos = torch.arange(T, device=embeds.device)
        D = self.rope_cos.shape[-1]
        cos = self.rope_cos[pos][:, None, :].expand(*lead, T, 1, D).reshape(-1, 1, D)  # per flattened row
        sin = self.rope_sin[pos][:, None, :].expand(*lead, T, 1, D).reshape(-1, 1, D)
        group = L.num_heads // L.num_kv_heads
        flat_embeds = embeds.reshape(-1, H)

        def heads(x: torch.Tensor, repeat: int = 1) -> torch.Tensor:  # [N, h, D] -> [..., h * repeat, T, D]
            x = x.view(*lead, T, x.shape[-2], D)
            return (x.repeat_interleave(repeat, -2) if repeat > 1 else x).transpose(-3, -2)

        h = self.project_features(features)
        layers = [L, *self.layers]
        keys: list[list[torch.Tensor]] = [[] for _ in layers]  # per layer, per step: [..., Hq, T, D] (GQA repeated)
        values: list[list[torch.Tensor]] = [[] for _ in layers]
        outs: list[torch.Tensor] = []
        for s in range(1, steps + 1):
            if s > 1:  # row p reads the previous step's row p - 1
                h = F.pad(outs[-1][..., :T - 1, :], (0, 0, 1, 0))
            x = h.reshape(-1, H)
            for i, layer in enumerate(layers):
                if i == 0:
                    q, k, v = L.project_inputs(flat_embeds, x, cos, sin)
                    x = L.residual(x)
                else:
                    q, k, v = layer.project(layer.input_layernorm(x), cos, sin)
                keys[i].append(heads(k, group))
                values[i].append(heads(v, group))
                attn = unrolled_attention(heads(q), keys[i], values[i], L.scale)  # [..., Hq, T, D]
                x = layer.finish(x, attn.transpose(-3, -2).reshape(-1, L.num_heads, D))
            outs.append((self.norm(x) if self.variant.norm_output else x).view(*lead, T, H))
        return outs

    def training_terms(self, embeds: torch.Tensor, features: torch.Tensor, hidden: torch.Tensor,
                       normed: torch.Tensor, steps: int) -> tuple[list[tuple[torch.Tensor, int, int]], torch.Tensor,
                                                                  torch.Tensor | None]:
        """What the trainer fits for one sequence of T tokens (see `specdec.training.losses.sequence_loss`): terms
        (head output [n, H], ahead, first row), the regression goal per token and the target ids of the
        head's vocabulary. The target's features, last-layer output and normed state are [T, *]; embeds are
        tokens 1..T-1. Unrolled step s is meaningful from row s on; EAGLE-3 regresses the last layer's output."""
        rows = len(embeds) - 1
        outs = self.unroll(embeds[:rows], features[:rows].clone(), steps)
        draft_ids = self.target_ids(torch.arange(self.draft_vocab_size, device=embeds.device))
        return [(out, 1, s) for s, out in enumerate(outs)], hidden.clone(), draft_ids

    @torch.inference_mode()
    def compute_logits(self, out: torch.Tensor) -> torch.Tensor:
        """[N, H] head outputs -> float32 logits over the draft vocabulary [N, draft_vocab]."""
        return linear(self.logits_input(out), self.lm_head).float()

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def target_logits(self, out: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary [N, V]: -inf for tokens outside the draft vocabulary."""
        logits = self.compute_logits(out)
        full = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))
        full[:, self.target_ids(torch.arange(self.draft_vocab_size, device=logits.device))] = logits
        return full

    # ---- checkpoints ------------------------------------------------------------------------------
    @classmethod
    def create(cls, method: str, target: LlamaModel, draft_ids: torch.Tensor, num_layers: int = 1, num_heads: int = 1
               ) -> Eagle3Head:
        """An untrained head of `num_layers` decoder layers for `target` over the draft vocabulary `draft_ids`
        (sorted target ids): small random weights, unit norms, q/k norms where the target's layers have them, no
        QKV bias (SpecForge's heads), and the LM head started from the target's rows of that vocabulary (the
        head begins by reading h like the target reads its last hidden state)."""
        cfg = target.config
        head = cls(dataclasses.replace(cfg, num_hidden_layers=num_layers, attention_bias=False), len(draft_ids),
                   default_aux_layers(cfg.num_hidden_layers))
        init_random(list(head.parameters()))
        head.lm_head.data.copy_(target.lm_head[draft_ids].float())
        head.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
        return head

    @classmethod
    def load_for(cls, method: str, path: str | Path, target: LlamaModel) -> Eagle3Head:
        """The head in `path` for the target model `target`, with the target's weight dtype and device."""
        return cls.load(path, target.config, target.dtype, target.device)

    @classmethod
    def load(cls, path: str | Path, target: ModelConfig, dtype: torch.dtype = torch.float32,
             device: str | torch.device = "cpu") -> Eagle3Head:
        """A head in any layout `read_head` reads (SpecForge's, the EAGLE reference's, speculators', llama.cpp's
        GGUF; a directory, a file or a Hub id), checked against the target it drafts for."""
        return cls.from_checkpoint(read_head(path, "eagle3"), target, dtype, device)

    @classmethod
    def from_checkpoint(cls, ckpt: HeadCheckpoint, target: ModelConfig, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> Eagle3Head:
        """The head of a checkpoint in our layout (`HeadCheckpoint`), every option in its config honoured."""
        hf, sd = dict(ckpt.config), ckpt.tensors
        hf.setdefault("model_type", "llama")
        config = ModelConfig.from_hf(hf)
        config = dataclasses.replace(  # q/k norms and biases as the layer's tensors have them (Qwen heads)
            config, qk_norm=config.qk_norm or "midlayer.self_attn.q_norm.weight" in sd,
            attention_bias="midlayer.self_attn.q_proj.bias" in sd)
        own_embedding = "embed_tokens.weight" in sd
        target_hidden = int(hf.get("target_hidden_size") or config.hidden_size)
        # A head as wide as its target reads the target's embedding; a narrower or wider one brings its own.
        check_made_for("EAGLE-3", ckpt.path, target_hidden if own_embedding else config.hidden_size,
                       hf.get("vocab_size", target.vocab_size), target)
        if target_hidden != target.hidden_size:
            raise SpecdecError(f"EAGLE-3 head {ckpt.path} reads target features of width {target_hidden} "
                               f"(target_hidden_size), the target's hidden size is {target.hidden_size}")
        aux = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") \
            or reference_aux_layers(target.num_hidden_layers)
        if any(not 0 <= i < target.num_hidden_layers for i in aux):
            raise SpecdecError(f"EAGLE-3 head {ckpt.path} reads the outputs of target layers {list(aux)}, the "
                               f"target has {target.num_hidden_layers} (eagle_aux_hidden_state_layer_ids)")
        variant = Eagle3Variant(*(bool(hf.get(k)) for k in ("norm_before_residual", "norm_before_fc", "fc_norm",
                                                             "norm_output")), own_embedding=own_embedding)
        head = cls(config, int(hf.get("draft_vocab_size", target.vocab_size)), tuple(aux), dtype, device, variant,
                   target_hidden)
        head.load_state_dict_reference(sd)
        return head

    def load_state_dict_reference(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy weights named as SpecForge saves them (q/k/v and gate/up fused here); a second and later layer
        are `layers.{i}.*`, the features' norm `input_norm.weight`, an own embedding `embed_tokens.weight`."""
        copier = TensorCopier(sd, "EAGLE-3")
        take, put = copier.take, copier.put
        put(self.fc.weight, take("fc.weight"), "fc.weight")
        load_decoder_layer(self.midlayer, "midlayer.", take, put, self.config)
        put(self.midlayer.hidden_norm.weight, take("midlayer.hidden_norm.weight"), "midlayer.hidden_norm.weight")
        for i, layer in enumerate(self.layers, 1):
            load_decoder_layer(layer, f"layers.{i}.", take, put, self.config)
        for name in ("input_norm", "embed_tokens"):
            if (module := getattr(self, name)) is not None:
                put(getattr(module, "weight", module), take(f"{name}.weight"), f"{name}.weight")
        for i, norm in enumerate(self.fc_norm or ()):
            put(norm.weight, take(f"fc_norm.{i}.weight"), f"fc_norm.{i}.weight")
        put(self.norm.weight, take("norm.weight"), "norm.weight")
        put(self.lm_head, take("lm_head.weight"), "lm_head.weight")
        put(self.d2t, take("d2t") if "d2t" in sd else torch.zeros(self.draft_vocab_size, dtype=torch.long), "d2t")
        copier.refuse_leftovers(ignore=("t2d",))

    def state_dict_reference(self) -> dict[str, torch.Tensor]:
        """Weights in the SpecForge / SGLang layout (q/k/v and gate/up split), plus d2t and t2d."""
        t2d = torch.zeros(self.config.vocab_size, dtype=torch.bool)
        t2d[self.target_ids(torch.arange(self.draft_vocab_size, device=self.device)).cpu()] = True
        sd = {"fc.weight": self.fc.weight, **decoder_layer_state(self.midlayer, "midlayer."),
              "midlayer.hidden_norm.weight": self.midlayer.hidden_norm.weight, "norm.weight": self.norm.weight,
              "lm_head.weight": self.lm_head, "d2t": self.d2t, "t2d": t2d}
        for i, layer in enumerate(self.layers, 1):
            sd.update(decoder_layer_state(layer, f"layers.{i}."))
        if self.input_norm is not None:
            sd["input_norm.weight"] = self.input_norm.weight
        for i, norm in enumerate(self.fc_norm or ()):
            sd[f"fc_norm.{i}.weight"] = norm.weight
        if self.embed_tokens is not None:
            sd["embed_tokens.weight"] = self.embed_tokens
        return {k: t.detach().contiguous().cpu() for k, t in sd.items()}

    def hf_config(self) -> dict[str, Any]:
        """config.json in SpecForge's layout, with the options of `Eagle3Variant` where they are set."""
        c = self.config
        config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "qwen3" if c.qk_norm else "llama",
                  "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
                  "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
                  "head_dim": c.head_dim, "num_hidden_layers": c.num_hidden_layers, "rms_norm_eps": c.rms_norm_eps,
                  "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings,
                  "vocab_size": c.vocab_size, "draft_vocab_size": self.draft_vocab_size, "tie_word_embeddings": False,
                  "attention_bias": c.attention_bias,
                  "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layers)}}
        if c.rope_scaling:
            config["rope_scaling"] = c.rope_scaling
        for option in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
            if getattr(self.variant, option):
                config[option] = True
        if self.target_hidden_size != c.hidden_size:
            config["target_hidden_size"] = self.target_hidden_size
        return config

    def save(self, path: str | Path, dtype: torch.dtype | None = None) -> None:
        """config.json and the weights: one float32 `model.safetensors`, or with `dtype` (e.g. bfloat16, what
        ships) two shards of that dtype, the LM head alone in the second (each under 16 MiB)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(self.hf_config(), indent=1))
        for old in path.glob("model*.safetensors"):
            old.unlink()
        sd = self.state_dict_reference()
        if dtype is None:
            save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
            return
        sd = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in sd.items()}
        lm = {"lm_head.weight": sd.pop("lm_head.weight")}
        save_file(sd, path / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
        save_file(lm, path / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
