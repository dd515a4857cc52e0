"""EAGLE-1 and MTP draft heads: one small decoder over the target's last hidden state and the next token.

    h_in   = target_norm(target's last layer output)  (first draft step: the target's final hidden state)
           | the head's own previous output          (later steps)                                [T, H]
    x      = fc(concat(enorm(embed(token)), hnorm(h_in)))                                          [T, H]
    out    = M Llama decoder layers (x)                                                             [T, H]
    logits = lm_head(norm(out))                       lm_head: the target's, shared and frozen      [T, V]

Alignment is EAGLE-3's (`specdec/models/heads/eagle3.py`): row t pairs the target's hidden state of token t with the
embedding of token t + 1 and predicts token t + 2; `out` regresses the target's final hidden state of token
t + 1, which is why it can be fed back as h_in.

The RMSNorms enorm, hnorm and norm are the ones the Meta report found necessary; each is optional so the
published layouts load:
- `eagle` (the EAGLE reference): `fc.weight` (+ `fc.bias`), `layers.N.*` Llama layers, where layer 0 has no
  `input_layernorm`; our heads add `enorm.weight`, `hnorm.weight`, `norm.weight`.
- `mtp` (DeepSeek-V3's multi-token-prediction module, one module reused for every draft step):
  `enorm.weight`, `hnorm.weight`, `eh_proj.weight`, the decoder layer's tensors (`self_attn.*`, `mlp.*`,
  `input_layernorm`, `post_attention_layernorm`), `shared_head.norm.weight` and optionally
  `shared_head.head.weight`, all under a `model.layers.{L}.` prefix (L = the target's layer count).
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdec.config import ModelConfig, SpecdecError
from specdec.models.blocks.attention import AttentionMetadata, KVLayers
from specdec.models.blocks.kernels import greedy_with_logprob, linear
from specdec.models.families import family_of
from specdec.models.formats.quant import QuantWeight
from specdec.models.heads.files import TensorCopier, check_made_for, init_random
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

LAYOUTS = ("eagle", "mtp")
_MTP_NAMES = {"fc": "eh_proj.", "norm": "shared_head.norm.", "enorm": "enorm.", "hnorm": "hnorm."}  # ours -> DeepSeek


class EagleHead(nn.Module):
    """config: the head's own Llama config (num_hidden_layers = M). target: the model it drafts for (its final
    norm and LM head are used, not copied). Optional parts: see the module docstring."""

    unrolls = False  # trained one step ahead
    max_draft_depth: int | None = None
    embed_tokens = None  # reads the target's embedding

    def __init__(self, config: ModelConfig, target: LlamaModel, layout: str = "eagle", embed_norm: bool = True,
                 hidden_norm: bool = True, output_norm: bool = True, fc_bias: bool = False,
                 first_layer_norm: bool = True) -> None:
        super().__init__()
        if layout not in LAYOUTS:
            raise SpecdecError(f"unknown head layout {layout!r}; choose one of {list(LAYOUTS)}")
        H, dtype, device = config.hidden_size, torch.float32, target.device
        self.config, self.layout, self.device = config, layout, target.device
        # Shared with the target, not part of the head: a plain tensor (or the target's quantized matrix).
        self.lm_head = target.lm_head if isinstance(target.lm_head, QuantWeight) else target.lm_head.data
        self.target_norm = RMSNorm(H, target.config.rms_norm_eps, dtype, device)  # a frozen copy, not saved
        self.target_norm.weight.data.copy_(target.norm.weight)
        self.draft_vocab_size = target.config.vocab_size
        self.aux_layers = (target.config.num_hidden_layers - 1,)  # the target layer whose output the head reads
        eps = config.rms_norm_eps
        self.enorm = RMSNorm(H, eps, dtype, device) if embed_norm else nn.Identity()
        self.hnorm = RMSNorm(H, eps, dtype, device) if hidden_norm else nn.Identity()
        self.fc = Linear(2 * H, H, fc_bias, dtype, device)
        # index i: a layer's own MLP (an MTP module's mixture of experts, `moe_layers`); the head never slides
        self.layers = nn.ModuleList(DecoderLayer(config, dtype, device, dtype, i)
                                    for i in range(config.num_hidden_layers))
        if not first_layer_norm:
            self.layers[0].input_layernorm = nn.Identity()
        self.norm = RMSNorm(H, eps, dtype, device) if output_norm else nn.Identity()
        cos, sin = rope_tables(config, torch.float32, device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The head's own weights (the target's norm and LM head stay frozen)."""
        return [p for name, p in self.named_parameters() if not name.startswith("target_norm.")]

    @torch.inference_mode()
    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv: KVLayers,
                features: torch.Tensor | None = None, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """One draft step for T rows: the target's last-layer `features` [T, H] or the head's own previous
        output `hidden` [T, H]; embeds [T, H] of the tokens each row continues with. Returns out [T, H]."""
        h = self.target_norm(features.float()) if features is not None else self.recycled(hidden)
        x = self.mix(embeds.float(), h)
        cos, sin = self.rope_cos[positions][:, None, :], self.rope_sin[positions][:, None, :]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, meta, kv.k[i], kv.v[i])
        return x

    @property
    def logit_norm(self) -> nn.Module:
        """The norm the LM head reads outputs through (an Identity where the layout has none)."""
        return self.norm

    def recycled(self, out: torch.Tensor) -> torch.Tensor:
        """What a later draft step reads of the previous step's output: itself (EAGLE), or its final norm
        (`shared_head.norm`, DeepSeek's MTP, as vLLM and SGLang recycle it)."""
        return self.norm(out) if self.layout == "mtp" else out

    def mix(self, embeds: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The decoder's input: fc(concat(enorm(embedding), hnorm(hidden state))) [T, H]."""
        return self.fc(torch.cat([self.enorm(embeds), self.hnorm(h)], -1))

    def train_forward(self, embeds: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """The head over one whole sequence, differentiable, through the serving layers: row t reads the
        target's final (normed) hidden state of token t, normed [T, H], and the embedding of token t + 1."""
        T = embeds.shape[0]
        pos = torch.arange(T, device=embeds.device)
        cos, sin = self.rope_cos[pos][:, None, :], self.rope_sin[pos][:, None, :]
        x = self.mix(embeds, normed)
        for layer in self.layers:
            q, k, v = (t.transpose(0, 1) for t in layer.project(layer.input_layernorm(x), cos, sin))  # [heads, T, D]
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=layer.scale, enable_gqa=True)
            x = layer.finish(x, attn.transpose(0, 1))
        return x

    def training_terms(self, embeds: torch.Tensor, features: torch.Tensor, hidden: torch.Tensor,
                       normed: torch.Tensor, steps: int) -> tuple[list[tuple[torch.Tensor, int, int]], torch.Tensor,
                                                                  None]:
        """What the trainer fits (see `Eagle3Head.training_terms`): EAGLE-1 and MTP read and regress the
        target's final normed hidden state, as the EAGLE reference does."""
        rows = len(embeds) - 1
        return [(self.train_forward(embeds[:rows], normed[:rows].clone()), 1, 0)], normed.clone(), None

    @torch.inference_mode()
    def draft_step(self, embeds: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv: KVLayers,
                   rows: list[int], features: torch.Tensor | None = None, hidden: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`forward`, then the head's greedy draft tokens at rows `rows` of its output [N] and their
        log-probabilities under the head [N] (as `Eagle3Head`'s)."""
        out = self.forward(embeds, positions, meta, kv, features=features, hidden=hidden)
        return (out, *greedy_with_logprob(self.compute_logits(out[rows])))

    @torch.inference_mode()
    def compute_logits(self, out: torch.Tensor) -> torch.Tensor:
        """[N, H] head outputs -> float32 logits over the target's vocabulary [N, V]."""
        return linear(self.norm(out), self.lm_head).float()

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids  # the head drafts over the target's own vocabulary

    target_logits = compute_logits

    # ---- checkpoints ------------------------------------------------------------------------------
    def state_dict_reference(self) -> dict[str, torch.Tensor]:
        """Weights under the layout's names."""
        sd: dict[str, torch.Tensor] = {}
        for name in ("enorm", "hnorm", "norm"):
            if isinstance(getattr(self, name), RMSNorm):
                sd[f"{name}.weight"] = getattr(self, name).weight
        sd["fc.weight"] = self.fc.weight
        if self.fc.bias is not None:
            sd["fc.bias"] = self.fc.bias
        for i, layer in enumerate(self.layers):
            sd.update(decoder_layer_state(layer, f"layers.{i}."))
        if self.layout == "mtp":
            prefix = f"model.layers.{self.aux_layers[0] + 1}."
            sd = {prefix + _to_mtp(k): t for k, t in sd.items()}
        return {k: t.detach().contiguous().cpu() for k, t in sd.items()}

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        c = self.config
        config = {"architectures": ["EagleHead" if self.layout == "eagle" else "DeepseekMTPHead"],
                  "model_type": "llama", "specdec_layout": self.layout, "hidden_size": c.hidden_size,
                  "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
                  "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
                  "num_hidden_layers": c.num_hidden_layers, "rms_norm_eps": c.rms_norm_eps,
                  "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings,
                  "vocab_size": self.draft_vocab_size, "bias": self.fc.bias is not None}
        (path / "config.json").write_text(json.dumps(config, indent=1))
        save_file(self.state_dict_reference(), path / "model.safetensors", metadata={"format": "pt"})

    @classmethod
    def create(cls, method: str, target: LlamaModel, draft_ids: torch.Tensor | None = None, num_layers: int = 1,
               num_heads: int = 1) -> EagleHead:
        """An untrained head in `method`'s layout: `num_layers` decoder layers (an MTP module has one), small
        random weights, unit norms."""
        layers = num_layers if method == "eagle" else 1
        head = cls(head_config(target.config, layers), target, method)
        init_random(head.trainable_parameters())
        return head

    @classmethod
    def load_for(cls, method: str, path: str | Path, target: LlamaModel) -> EagleHead:
        """The head of `method` ("eagle" or "mtp": its layout) in `path`, for `target`."""
        return cls.load(path, target, method)

    @classmethod
    def load(cls, path: str | Path, target: LlamaModel, layout: str = "eagle") -> EagleHead:
        """A head in the EAGLE reference layout, speculators' `eagle` or DeepSeek's MTP layout (a directory, a
        file, a Hub id, or the MTP layers inside the target's own files; see `read_head`), checked against the
        target it drafts for. Which optional norms and biases it has is read from the tensors present."""
        ckpt = read_head(path, layout)
        hf, sd = dict(ckpt.config), ckpt.tensors
        hf.setdefault("model_type", "llama")
        family = family_of(hf)  # an MTP module is a layer of its model's family (DeepSeek: latent attention, experts)
        config = family.config(hf)
        check_made_for(layout, ckpt.path, config.hidden_size, hf.get("vocab_size", target.config.vocab_size),
                       target.config)
        if layout == "mtp":  # the model's own layer, under its family's names
            sd = family.state({"model." + _from_mtp(k): v for k, v in sd.items()}, hf)
            sd = {k.removeprefix("model."): v for k, v in sd.items()}
        num_layers = 1 + max((int(m[1]) for k in sd if (m := re.match(r"layers\.(\d+)\.", k))), default=0)
        config = dataclasses.replace(
            head_config(config, num_layers, moe_layers=tuple(i for i in range(num_layers)
                                                             if f"layers.{i}.mlp.gate.weight" in sd)),
            qk_norm=config.qk_norm or "layers.0.self_attn.q_norm.weight" in sd,
            attention_bias="layers.0.self_attn.q_proj.bias" in sd)
        head = cls(config, target, layout, embed_norm="enorm.weight" in sd, hidden_norm="hnorm.weight" in sd,
                   output_norm="norm.weight" in sd, fc_bias="fc.bias" in sd,
                   first_layer_norm="layers.0.input_layernorm.weight" in sd)
        if "shared_head.head.weight" in sd:  # an MTP module with its own copy of the LM head
            head.lm_head = sd["shared_head.head.weight"].to(target.dtype)
        head.load_state_dict_reference(sd, ignore=("shared_head.head.weight", "embed_tokens.weight"))
        return head

    def load_state_dict_reference(self, sd: dict[str, torch.Tensor], ignore: tuple[str, ...] = ()) -> None:
        """Copy the layout's tensors in; a tensor the head has no place for is refused by name (`ignore`: the
        copies of the target's embedding and LM head that MTP modules carry)."""
        copier = TensorCopier(sd, self.layout)
        take, put = copier.take, copier.put

        for name in ("enorm", "hnorm", "norm"):
            module = getattr(self, name)
            if isinstance(module, RMSNorm):
                put(module.weight, take(f"{name}.weight"), f"{name}.weight")
        put(self.fc.weight, take("fc.weight"), "fc.weight")
        if self.fc.bias is not None:
            put(self.fc.bias, take("fc.bias"), "fc.bias")
        for i, layer in enumerate(self.layers):
            load_decoder_layer(layer, f"layers.{i}.", take, put, self.config)
        copier.refuse_leftovers(ignore)


def head_config(config: ModelConfig, num_layers: int, moe_layers: tuple[int, ...] = ()) -> ModelConfig:
    """A head's decoder shape from its model's: `num_layers` layers that see every key, mixtures of experts on
    `moe_layers` only (an EAGLE head's layers are dense; an MTP module's are its model's kind)."""
    return dataclasses.replace(config, num_hidden_layers=num_layers, layer_types=None, sliding_window=None,
                               moe_layers=moe_layers)


def _to_mtp(name: str) -> str:
    top, rest = name.split(".", 1)
    return _MTP_NAMES[top] + rest if top in _MTP_NAMES else name.removeprefix("layers.0.")


def _from_mtp(name: str) -> str:
    """DeepSeek's MTP tensor name (with or without `model.layers.{L}.`) -> ours."""
    name = re.sub(r"^model\.layers\.\d+\.", "", name)
    for ours, theirs in _MTP_NAMES.items():
        if name.startswith(theirs):
            return f"{ours}.{name[len(theirs):]}"
    return name if name.startswith(("shared_head.", "embed_tokens.")) else "layers.0." + name
