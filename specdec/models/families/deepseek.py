"""DeepSeek-V2 and V3 (and their Lite and R1 checkpoints): multi-head latent attention (`models.mla`: q and kv
low-rank projections, a decoupled rotary key, YaRN), and mixtures of experts after the first `first_k_dense_replace`
dense layers, with shared experts every token takes and DeepSeek's routing (V2: softmax, optionally limited to the
best expert groups; V3: sigmoid scores, a correction bias that only steers the choice, groups scored by their best
two, weights renormalized and scaled). Their MTP layers (`num_nextn_predict_layers`) draft through `{"method": "mtp"}`.
"""
from __future__ import annotations

from specdec.config import ModelConfig, SpecdecError
from specdec.models.blocks.rotary import yarn_mscale
from specdec.models.families import Family, State, rope_fields
from specdec.models.formats.gguf import GGUFArch, KeyReader, f32
from specdec.models.formats.quant import QuantWeight


def _yarn_scale(rope: dict) -> float:
    """DeepSeek's query scale on top of 1/sqrt(head dim): YaRN's mscale(factor, mscale_all_dim) squared."""
    scaling = rope["rope_scaling"] or {}
    mscale_all = scaling.get("mscale_all_dim")
    if scaling.get("rope_type", scaling.get("type")) in (None, "default") or not mscale_all:
        return 1.0
    return yarn_mscale(float(scaling["factor"]), float(mscale_all)) ** 2


def config(hf: dict) -> ModelConfig:
    v3 = hf["model_type"] == "deepseek_v3"
    if hf.get("attention_bias"):
        raise SpecdecError("DeepSeek attention_bias=true is not supported (no released checkpoint sets it)")
    experts, n = hf.get("n_routed_experts") or 0, hf["num_hidden_layers"]
    first, freq = hf.get("first_k_dense_replace") or 0, hf.get("moe_layer_freq") or 1
    grouped = v3 or hf.get("topk_method") == "group_limited_greedy"
    rank, rope_dim, nope = hf["kv_lora_rank"], hf["qk_rope_head_dim"], hf["qk_nope_head_dim"]
    rope = rope_fields(hf)
    return ModelConfig.from_hf(
        hf, **rope,
        num_key_value_heads=1,
        head_dim=rank + rope_dim,
        attn_scale=(nope + rope_dim) ** -0.5 * _yarn_scale(rope),
        kv_lora_rank=rank,
        q_lora_rank=hf.get("q_lora_rank") or 0,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=hf["v_head_dim"],
        rope_interleave=bool(hf.get("rope_interleave", True)) if v3 else True,  # V2 rotates complex pairs
        num_experts=experts,
        num_experts_per_tok=hf.get("num_experts_per_tok") or 0,
        moe_intermediate_size=hf.get("moe_intermediate_size") or 0,
        moe_layers=tuple(i for i in range(n) if experts and i >= first and i % freq == 0),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        moe_scoring=hf.get("scoring_func") or ("sigmoid" if v3 else "softmax"),
        moe_groups=(hf.get("n_group") or 1) if grouped else 1,
        moe_topk_groups=(hf.get("topk_group") or 1) if grouped else 1,
        moe_choice_bias=v3,
        routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
        shared_expert_intermediate_size=(hf.get("n_shared_experts") or 0) * (hf.get("moe_intermediate_size") or 0),
        shared_expert_gate=False,
    )


def state(state: State, hf: dict) -> State:
    """Shared experts under the canonical name; kv_b_proj [nH * (nope + v), r] split per head into llama.cpp's
    absorbed pair, the canonical form (a GGUF stores it so): k_b_proj [nH, r, nope] (keys' rows, transposed) and
    v_b_proj [nH, v, r]."""
    heads, nope, v = hf["num_attention_heads"], hf["qk_nope_head_dim"], hf["v_head_dim"]
    out = {}
    for name, t in state.items():
        name = name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")
        if name.endswith("self_attn.kv_b_proj.weight"):  # (an older GGUF's attn_kv_b too)
            t = t.dequantize() if isinstance(t, QuantWeight) else t
            if t.shape[0] != heads * (nope + v):
                raise SpecdecError(f"tensor {name!r} has {t.shape[0]} rows; the config implies {heads * (nope + v)}")
            k, v_b = t.view(heads, nope + v, -1).split([nope, v], dim=1)
            stem = name.removesuffix("kv_b_proj.weight")
            out[stem + "k_b_proj.weight"], out[stem + "v_b_proj.weight"] = k.transpose(1, 2).contiguous(), v_b
            continue
        out[name] = t
    return out


def _gguf_keys(key: KeyReader, config: dict, tensors: dict) -> dict:
    """DeepSeek-V2/V3's options from llama.cpp's deepseek2 keys: the latent ranks and head widths (the *_mla keys of
    files with the absorbed k_b / v_b pair, the plain ones before), the leading dense layers, the shared experts and
    the router (sigmoid gating or a correction bias: V3's; weights scale and norm; expert groups), YaRN's
    log multiplier (written as 0.1 * mscale_all_dim). The rotated part is its own width (qk_rope_head_dim), not a
    partial factor."""
    config.pop("partial_rotary_factor", None)
    rope = key("rope.dimension_count")
    qk = key("attention.key_length_mla", None) or key("attention.key_length")
    experts = key("expert_count", 0)
    v3 = key("expert_gating_func", 1) == 2 or any(n.endswith("exp_probs_b.bias") for n in tensors)
    out = {"model_type": "deepseek_v3" if v3 else "deepseek_v2",
           "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
           "kv_lora_rank": key("attention.kv_lora_rank"), "q_lora_rank": key("attention.q_lora_rank", 0) or None,
           "qk_rope_head_dim": rope, "qk_nope_head_dim": qk - rope,
           "v_head_dim": key("attention.value_length_mla", None) or key("attention.value_length"),
           "first_k_dense_replace": key("leading_dense_block_count", 0),
           "n_routed_experts": experts or None, "n_shared_experts": key("expert_shared_count", 0),
           "moe_intermediate_size": key("expert_feed_forward_length", 0),
           "routed_scaling_factor": f32(key("expert_weights_scale", 1.0)),
           "norm_topk_prob": bool(key("expert_weights_norm", False)),
           "scoring_func": "sigmoid" if key("expert_gating_func", 1) == 2 else "softmax",
           "rope_interleave": True}
    groups = key("expert_group_count", 0)
    if groups > 1:
        out.update(n_group=groups, topk_group=key("expert_group_used_count"), topk_method="group_limited_greedy")
    scaling = config["rope_scaling"]
    if scaling and scaling.get("rope_type") == "yarn" and (log_mul := key("rope.scaling.yarn_log_multiplier", 0.0)):
        mscale = f32(log_mul / 0.1)
        out["rope_scaling"] = {**scaling, "mscale": mscale, "mscale_all_dim": mscale}
    return out


# an older GGUF's one kv_b becomes the absorbed pair as a checkpoint's does (gguf_state)
FAMILY = Family("deepseek", ("deepseek_v2", "deepseek_v3"), config, state, gguf_state=state,
                gguf=(GGUFArch("deepseek2", "deepseek_v2", "DeepseekV2ForCausalLM", _gguf_keys, window=False),))
