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
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specdec.config import ModelConfig
from specdec.models import kernels, native
from specdec.models.attention import AttentionMetadata, KVLayers
from specdec.models.head_files import check_made_for, init_random, read_head_config, read_head_tensors, tensor_copier
from specdec.models.kernels import greedy_with_logprob, linear, on_native
from specdec.models.llama import (
    DecoderLayer,
    Linear,
    LlamaModel,
    RMSNorm,
    decoder_layer_state,
    load_decoder_layer,
    rope_tables,
)
from specdec.models.quant import QuantWeight


def default_aux_layers(num_target_layers: int) -> tuple[int, int, int]:
    """Low, mid and high target layers (SGLang's choice): 2, N / 2, N - 3 (clamped for tiny models)."""
    last = num_target_layers - 1
    return tuple(min(max(i, 0), last) for i in (2, num_target_layers // 2, num_target_layers - 3))


class Eagle3Layer(DecoderLayer):
    """A Llama decoder layer whose attention reads [norm(embedding), norm(hidden)] (2H wide); the residual
    stream is `hidden`."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        cfg = dataclasses.replace(cfg, attention_bias=False, qk_norm=False)
        super().__init__(cfg, dtype, device, torch.float32)
        H, D = cfg.hidden_size, cfg.head_dim
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps, torch.float32, device)
        self.qkv_proj = Linear(2 * H, (self.num_heads + 2 * self.num_kv_heads) * D, False, dtype, device)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        if on_native(hidden):  # one C++ call for the layer, as the target's layers (QKV reading the 2H rows)
            out = self.native_forward(hidden, cos, sin, meta, k_pool, v_pool, qkv_input=self.qkv_rows(embeds, hidden))
            if out is not None:
                return out
        q, k, v = self.project_inputs(embeds, hidden, cos, sin)
        return self.finish(hidden, self.attend(q, k, v, k_pool, v_pool, meta))

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


class Eagle3Head(nn.Module):
    """config: the head's own Llama config (num_hidden_layers = 1); it shares the target's embedding."""

    unrolls = True  # trained with the training-time test (`unroll`)
    max_draft_depth: int | None = None

    def __init__(self, config: ModelConfig, draft_vocab_size: int, aux_layers: tuple[int, ...],
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        super().__init__()
        H = config.hidden_size
        self.config, self.draft_vocab_size, self.aux_layers = config, draft_vocab_size, tuple(aux_layers)
        self.dtype, self.device = dtype, torch.device(device)
        self.fc = Linear(len(self.aux_layers) * H, H, False, dtype, device)
        self.midlayer = Eagle3Layer(config, dtype, device)
        self.norm = RMSNorm(H, config.rms_norm_eps, torch.float32, device)
        self.lm_head = nn.Parameter(torch.empty(draft_vocab_size, H, dtype=dtype, device=device), requires_grad=False)
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
        h = self.fc(features.float()) if features is not None else hidden
        cos, sin = self.rope_cos[positions][:, None, :], self.rope_sin[positions][:, None, :]
        return self.midlayer(embeds.float(), h, cos, sin, meta, kv.k[0], kv.v[0])

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
            layer = self.midlayer.native_layer() if self.device.type == "cpu" else None
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

        h = self.fc(features)
        keys: list[torch.Tensor] = []  # per step, [..., Hq, T, D] (GQA heads repeated)
        values: list[torch.Tensor] = []
        outs: list[torch.Tensor] = []
        for s in range(1, steps + 1):
            if s > 1:  # row p reads the previous step's row p - 1
                h = F.pad(outs[-1][..., :T - 1, :], (0, 0, 1, 0))
            q, k, v = L.project_inputs(flat_embeds, h.reshape(-1, H), cos, sin)
            keys.append(heads(k, group))
            values.append(heads(v, group))
            attn = unrolled_attention(heads(q), keys, values, L.scale)  # [..., Hq, T, D]
            out = L.finish(h.reshape(-1, H), attn.transpose(-3, -2).reshape(-1, L.num_heads, D))
            outs.append(out.view(*lead, T, H))
        return outs

    def training_terms(self, embeds: torch.Tensor, features: torch.Tensor, hidden: torch.Tensor,
                       normed: torch.Tensor, steps: int) -> tuple[list[tuple[torch.Tensor, int, int]], torch.Tensor,
                                                                  torch.Tensor | None]:
        """What the trainer fits for one sequence of T tokens (see `specdec.training.train.sequence_loss`): terms
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
        return linear(self.norm(out), self.lm_head).float()

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
        """An untrained head for `target` over the draft vocabulary `draft_ids` (sorted target ids): small random
        weights, unit norms, and the LM head started from the target's rows of that vocabulary (the head
        begins by reading h like the target reads its last hidden state)."""
        cfg = target.config
        head = cls(dataclasses.replace(cfg, num_hidden_layers=1), len(draft_ids),
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
        """A head directory in the SpecForge / SGLang layout, checked against the target it drafts for."""
        path, hf = read_head_config(path, "EAGLE-3")
        hf.setdefault("model_type", "llama")
        config = dataclasses.replace(ModelConfig.from_hf(hf), num_hidden_layers=1)
        check_made_for("EAGLE-3", path, config.hidden_size, hf.get("vocab_size", target.vocab_size), target)
        sd = read_head_tensors(path, "EAGLE-3")
        aux = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") \
            or default_aux_layers(target.num_hidden_layers)
        head = cls(config, int(hf.get("draft_vocab_size", target.vocab_size)), tuple(aux), dtype, device)
        head.load_state_dict_reference(sd)
        return head

    def load_state_dict_reference(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy weights named as SpecForge saves them (q/k/v and gate/up fused here)."""
        take, put = tensor_copier(sd, "EAGLE-3")
        put(self.fc.weight, take("fc.weight"), "fc.weight")
        layer_cfg = dataclasses.replace(self.config, attention_bias=False, qk_norm=False)
        load_decoder_layer(self.midlayer, "midlayer.", take, put, layer_cfg)
        put(self.midlayer.hidden_norm.weight, take("midlayer.hidden_norm.weight"), "midlayer.hidden_norm.weight")
        put(self.norm.weight, take("norm.weight"), "norm.weight")
        put(self.lm_head, take("lm_head.weight"), "lm_head.weight")
        put(self.d2t, take("d2t") if "d2t" in sd else torch.zeros(self.draft_vocab_size, dtype=torch.long), "d2t")

    def state_dict_reference(self) -> dict[str, torch.Tensor]:
        """Weights in the SpecForge / SGLang layout (q/k/v and gate/up split), plus d2t and t2d."""
        t2d = torch.zeros(self.config.vocab_size, dtype=torch.bool)
        t2d[self.target_ids(torch.arange(self.draft_vocab_size, device=self.device)).cpu()] = True
        sd = {"fc.weight": self.fc.weight, **decoder_layer_state(self.midlayer, "midlayer."),
              "midlayer.hidden_norm.weight": self.midlayer.hidden_norm.weight, "norm.weight": self.norm.weight,
              "lm_head.weight": self.lm_head, "d2t": self.d2t, "t2d": t2d}
        return {k: t.detach().contiguous().cpu() for k, t in sd.items()}

    def save(self, path: str | Path, dtype: torch.dtype | None = None) -> None:
        """config.json and the weights: one float32 `model.safetensors`, or with `dtype` (e.g. bfloat16, what
        ships) two shards of that dtype, the LM head alone in the second (each under 16 MiB)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        c = self.config
        config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": c.hidden_size,
                  "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
                  "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "num_hidden_layers": 1,
                  "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
                  "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
                  "draft_vocab_size": self.draft_vocab_size, "tie_word_embeddings": False,
                  "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layers)}}
        (path / "config.json").write_text(json.dumps(config, indent=1))
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
