"""Mixtral: the Llama form whose every MLP is a mixture of experts (top-2 of 8, probabilities renormalized); older
checkpoints name the router and experts `block_sparse_moe.gate` and `experts.N.w1 / w3 / w2` (gate, up, down)."""
from __future__ import annotations

from specdec.config import ModelConfig
from specdec.models.families import Family, State, rename, rope_fields

_RENAMES = {"block_sparse_moe.gate.weight": "mlp.gate.weight"}


def config(hf: dict) -> ModelConfig:
    experts = hf.get("num_local_experts") or hf.get("num_experts") or 8
    return ModelConfig.from_hf(
        hf, **rope_fields(hf), num_experts=experts, num_experts_per_tok=hf.get("num_experts_per_tok", 2),
        moe_intermediate_size=hf["intermediate_size"], norm_topk_prob=True,
        moe_layers=tuple(range(hf["num_hidden_layers"])))


def state(state: State, hf: dict) -> State:
    out = {}
    for name, tensor in rename(state, _RENAMES).items():
        if ".block_sparse_moe.experts." in name:
            name = name.replace(".block_sparse_moe.experts.", ".mlp.experts.")
            for old, new in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                name = name.replace(f".{old}.weight", f".{new}.weight")
        out[name] = tensor
    return out


FAMILY = Family("mixtral", ("mixtral",), config, state)
