"""specdec's greedy tokens against llama.cpp's on the same GGUF file, a divergence judged by a third reference.

Both engines decode the same prompt ids greedily. Where their tokens first part, transformers (its own GGUF loader,
dequantized, in float64 by default; its model class on the dequantized weights where it has no GGUF loader for the
architecture) scores the common prefix: if the two tokens' log-probabilities there are within
--tie of each other the divergence is a near-tie, which the engines' different rounding (int8 activations, their
own kernels) may decide either way; otherwise one engine computes the family differently, and the tool says so and
exits 1. Needs llama-cpp-python (`make bench-peers`).

    python tools/compare_llamacpp.py FILE.gguf --num-prompts 6 --max-tokens 32
"""
from __future__ import annotations

import argparse
import gc
import re
import sys
from dataclasses import dataclass

import torch

from specdec import LLM, SamplingParams
from specdec.bench.engines import _load_hf, load_llamacpp, time_llamacpp
from specdec.bench.prompts import encode_prompts, load_questions, pick_round_robin, prompts_path
from specdec.models.loader import resolve


@dataclass
class Verdict:
    prompt: int
    tokens: int  # where the engines first part (or how many they share)
    kind: str  # identical, near-tie, differs
    gap: float  # |log p(ours) - log p(llama.cpp's)| under the reference at that position (0 if identical)
    picks: str = ""  # which engine's token the reference ranks higher there


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


def compare(path: str, num_prompts: int, max_tokens: int, tie: float, dtype: torch.dtype, threads: int
            ) -> list[Verdict]:
    llm = LLM(path, speculative_config="off")
    prompts = encode_prompts(llm, pick_round_robin(load_questions(prompts_path(None)), num_prompts))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ours = [o.token_ids for o in llm.generate([{"prompt_token_ids": p.token_ids} for p in prompts], params)]
    peer = load_llamacpp(resolve(path), threads)
    theirs = [time_llamacpp(peer, p, max_tokens, eos=[])["token_ids"] for p in prompts]
    del llm, peer  # the engines' memory back before the reference takes its own
    gc.collect()
    reference = None
    verdicts = []
    for n, (p, a, b) in enumerate(zip(prompts, ours, theirs)):
        i = first_divergence(a, b)
        if i is None:
            verdicts.append(Verdict(n, min(len(a), len(b)), "identical", 0.0))
            continue
        if reference is None:
            reference = load_reference(path, dtype)
        with torch.no_grad():
            logits = reference(torch.tensor([p.token_ids + a[:i]])).logits[0, -1].double()
        logp = torch.log_softmax(logits, -1)
        gap = abs(logp[a[i]] - logp[b[i]]).item()
        picks = "specdec" if logp[a[i]] > logp[b[i]] else "llama.cpp"
        verdicts.append(Verdict(n, i, "near-tie" if gap <= tie else "differs", gap, picks))
    return verdicts


_MIXTRAL = {"gate": "w1", "down": "w2", "up": "w3"}


def load_reference(path: str, dtype: torch.dtype):
    """transformers' model of the GGUF: through its own GGUF loader, or where it has none for the architecture
    (deepseek2, olmoe; a llama file with experts) through its model class on the file's weights as specdec
    dequantizes them, written back under the checkpoint's own names (the reader and the forward stay
    transformers')."""
    try:
        return _load_hf(resolve(path), dtype).eval()
    except (ValueError, TypeError) as err:  # no reader for the architecture; gpt-oss's reader fails on its own
        # rope.scaling keys (transformers 5.23); a llama file of experts (Mixtral as llama.cpp writes it) is read
        # as a dense Llama, without its experts
        if isinstance(err, ValueError) and not ("is not supported" in str(err) or "lacks tensors" in str(err)):
            raise
    import json
    import tempfile
    from pathlib import Path

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from specdec.models.loader import load_gguf

    hf, state = load_gguf(resolve(path).gguf_file, dtype=torch.float32)
    if hf["model_type"].startswith("deepseek"):  # the canonical absorbed pair back to kv_b_proj, shared experts
        for k_b in [k for k in state if k.endswith("k_b_proj.weight")]:
            stem = k_b.removesuffix("k_b_proj.weight")
            k, v = state.pop(k_b), state.pop(stem + "v_b_proj.weight")
            state[stem + "kv_b_proj.weight"] = torch.cat((k.transpose(1, 2), v), 1).reshape(-1, k.shape[1])
        state = {k.replace(".shared_expert.", ".shared_experts."): t for k, t in state.items()}
        hf.update(head_dim=hf["qk_rope_head_dim"], num_key_value_heads=hf["num_attention_heads"])  # HF's reading
    if hf["model_type"] == "gpt_oss":
        state = _gpt_oss_names(state, hf)
    if hf["model_type"] == "mixtral":  # Mixtral's checkpoint names, which transformers converts to its own
        state = {re.sub(r"\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.",
                        lambda m: f".block_sparse_moe.experts.{m[1]}.{_MIXTRAL[m[2]]}.", k)
                 .replace(".mlp.gate.weight", ".block_sparse_moe.gate.weight"): t for k, t in state.items()}
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(hf))
        save_file({k: t.contiguous() for k, t in state.items()}, Path(d) / "model.safetensors")
        del state  # one copy of the weights in memory at a time
        gc.collect()
        return AutoModelForCausalLM.from_pretrained(d, dtype=dtype).eval()


def _gpt_oss_names(state: dict, hf: dict) -> dict:
    """specdec's per-expert names back to gpt-oss's checkpoint: each layer's experts stacked, gate and up
    interleaved by column ([E, H, 2I]), the router as `mlp.router`."""
    out = {}
    for i in range(hf["num_hidden_layers"]):
        p, E = f"model.layers.{i}.mlp.", hf["num_experts"]
        gate = [state.pop(f"{p}experts.{e}.gate_proj.weight") for e in range(E)]
        up = [state.pop(f"{p}experts.{e}.up_proj.weight") for e in range(E)]
        out[p + "experts.gate_up_proj"] = torch.stack([torch.stack((g, u), 1).flatten(0, 1).T
                                                       for g, u in zip(gate, up)])
        gb = [state.pop(f"{p}experts.{e}.gate_proj.bias") for e in range(E)]
        ub = [state.pop(f"{p}experts.{e}.up_proj.bias") for e in range(E)]
        out[p + "experts.gate_up_proj_bias"] = torch.stack([torch.stack((g, u), 1).flatten() for g, u in zip(gb, ub)])
        out[p + "experts.down_proj"] = torch.stack([state.pop(f"{p}experts.{e}.down_proj.weight").T
                                                    for e in range(E)])
        out[p + "experts.down_proj_bias"] = torch.stack([state.pop(f"{p}experts.{e}.down_proj.bias")
                                                         for e in range(E)])
        out[p + "router.weight"], out[p + "router.bias"] = state.pop(p + "gate.weight"), state.pop(p + "gate.bias")
    return {**state, **out}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf")
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--tie", type=float, default=0.05, help="log-probability gap under which a divergence is a "
                                                             "near-tie (default 0.05 nats)")
    ap.add_argument("--reference-dtype", choices=("float64", "float32"), default="float64")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args(argv)
    verdicts = compare(args.gguf, args.num_prompts, args.max_tokens, args.tie, getattr(torch, args.reference_dtype),
                       args.threads)
    for v in verdicts:
        where = f"first differs at token {v.tokens}" if v.kind != "identical" else f"{v.tokens} tokens"
        print(f"prompt {v.prompt}: {v.kind:9s} {where}" +
              (f", gap {v.gap:.4f} nats, the reference ranks {v.picks}'s higher" if v.kind != "identical" else ""))
    counts = {k: sum(v.kind == k for v in verdicts) for k in ("identical", "near-tie", "differs")}
    print(f"{counts['identical']} identical, {counts['near-tie']} near-ties, {counts['differs']} differ")
    sys.exit(1 if counts["differs"] else 0)


if __name__ == "__main__":
    main()
