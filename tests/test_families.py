"""Every family against transformers' own classes: tiny random configs saved with `save_pretrained`, loaded by
specdec from the directory, float32 log-probabilities of a prompt and its continuation through the paged cache within
1e-3 of transformers', and speculative greedy output identical to plain greedy."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import transformers
from conftest import build_tokenizer, needs_native
from test_models import run_paged

from specdec import LLM, SamplingParams
from specdec.config import SpecdecError
from specdec.models.loader import load_model

COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
              pad_token_id=0)
WINDOW = 8  # a window the prompts outgrow, so a layer that ignores it answers differently

DEEPSEEK = dict(moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1,
                kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, num_key_value_heads=4)

FAMILIES = {
    "mistral-window": (transformers.MistralConfig, dict(sliding_window=WINDOW)),
    "qwen2-window": (transformers.Qwen2Config, dict(use_sliding_window=True, sliding_window=WINDOW,
                                                    max_window_layers=1)),
    "gemma2": (transformers.Gemma2Config, dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                               attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3": (transformers.Gemma3TextConfig, dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                                   layer_types=["sliding_attention", "full_attention",
                                                                "sliding_attention"],
                                                   rope_parameters={"full_attention": {"rope_type": "linear",
                                                                                       "factor": 2.0,
                                                                                       "rope_theta": 100000.0},
                                                                    "sliding_attention": {"rope_type": "default",
                                                                                          "rope_theta": 1000.0}})),
    "phi3-longrope": (transformers.Phi3Config, dict(
        max_position_embeddings=512, original_max_position_embeddings=128,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
                         "short_factor": [1.0 + i / 8 for i in range(8)], "long_factor": [2.0 + i for i in range(8)]})),
    "phi4-partial-rotary": (transformers.Phi3Config, dict(partial_rotary_factor=0.5, sliding_window=WINDOW)),
    "qwen2_moe": (transformers.Qwen2MoeConfig, dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48,
                                                     shared_expert_intermediate_size=80, decoder_sparse_step=1,
                                                     mlp_only_layers=[1])),
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=40,
                                                     head_dim=16, norm_topk_prob=True, decoder_sparse_step=2)),
    "mixtral": (transformers.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2)),
    "olmoe": (transformers.OlmoeConfig, dict(num_experts=8, num_experts_per_tok=2, clip_qkv=4.0)),
    # sinks, biases everywhere, alternating windows, YaRN without truncation, the clamped SwiGLU over interleaved halves
    "gpt_oss": (transformers.GptOssConfig, dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                                intermediate_size=48, sliding_window=WINDOW, swiglu_limit=0.5,
                                                rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                                 "beta_slow": 1.0, "truncate": False,
                                                                 "original_max_position_embeddings": 64,
                                                                 "rope_theta": 150000.0})),
    # latent attention (V2-Lite: no q bottleneck), shared experts, softmax routing within the 2 best of 4 groups
    "deepseek_v2": (transformers.DeepseekV2Config, dict(DEEPSEEK, n_shared_experts=2, q_lora_rank=None,
                                                         topk_method="group_limited_greedy", n_group=4, topk_group=2)),
    # V3: a q bottleneck, YaRN with DeepSeek's query scale, sigmoid routing steered by a correction bias, scaled weights
    "deepseek_v3": (transformers.DeepseekV3Config, dict(
        DEEPSEEK, n_shared_experts=1, q_lora_rank=24, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, rope_parameters={"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                              "original_max_position_embeddings": 64, "rope_theta": 10000.0})),
}


def save_family(path, name: str, seed: int = 0):
    cls, extra = FAMILIES[name]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cls(**{**COMMON, **extra})).eval()
    with torch.no_grad():  # sharper than the random init, so greedy is not decided by rounding noise
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(3.0)
            elif p.dim() == 1 and "norm" in "".join(n for n, q in model.named_parameters() if q is p):
                p.add_(torch.randn_like(p) * 0.2)  # norms away from their init, so a wrong offset shows
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a bias that changes which experts win
                b.copy_(torch.randn_like(b) * 0.3)
    model.save_pretrained(path)
    build_tokenizer(COMMON["vocab_size"]).save_pretrained(path)
    return path, model


def prompt_logprobs(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(logits[:-1].double(), -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


@needs_native
@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_family_matches_transformers_through_the_paged_cache(tmp_path, name):
    path, hf = save_family(tmp_path, name)
    ours, _ = load_model(path)
    assert ours.native_stack() is not None  # every family option in the fused native layer
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (5, 19)]  # past the window
    conts = [torch.randint(3, 320, (12,), generator=g).tolist() for _ in prompts]
    for p, c, logits in zip(prompts, conts, run_paged(ours, prompts, conts)):
        with torch.no_grad():
            ref = hf(torch.tensor([p + c])).logits[0]
        assert logits.shape == ref.shape
        got, want = prompt_logprobs(logits, p + c), prompt_logprobs(ref, p + c)
        assert (got - want).abs().max().item() < 1e-3, name
        assert torch.equal(logits.argmax(-1), ref.argmax(-1))


@needs_native
@pytest.mark.parametrize("name", ["mistral-window", "gemma2", "gemma3", "qwen3_moe", "olmoe", "deepseek_v3",
                                  "gpt_oss"])
def test_speculative_greedy_output_equals_plain_for_a_family(tmp_path, name):
    path, _ = save_family(tmp_path, name)
    prompts = [{"prompt_token_ids": [5, 9, 14, 5, 9, 14, 5, 9, 14, 5, 9]},
               {"prompt_token_ids": [40, 41, 42, 43, 40, 41, 42, 43, 40, 41, 42]}]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = [o.token_ids for o in LLM(str(path), speculative_config="off").generate(prompts, params)]
    for spec in ({"method": "ngram", "num_speculative_tokens": 4, "dispatch": {"1": "chain"}},
                 {"method": "suffix", "num_speculative_tokens": 6, "dispatch": {"1": "chain"}}):
        outs = LLM(str(path), speculative_config=spec).generate(prompts, params)
        assert [o.token_ids for o in outs] == plain, spec


def test_an_unknown_family_is_refused_naming_every_supported_one(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "mamba", "architectures": ["MambaForCausalLM"]}')
    with pytest.raises(SpecdecError, match=r"unsupported architecture 'MambaForCausalLM'.*gemma2.*qwen3_moe"):
        load_model(tmp_path)


def test_a_window_larger_than_the_context_is_refused_by_name(tmp_path):
    from specdec.models.families import load_config

    hf = {**COMMON, "model_type": "mistral", "sliding_window": 4096}
    with pytest.raises(SpecdecError, match="sliding_window=4096 is larger than the context"):
        load_config(hf)


def test_a_missing_expert_tensor_is_refused_by_name(tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = save_family(tmp_path, "qwen3_moe")
    state = load_file(path / "model.safetensors")
    del state["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(state, path / "model.safetensors")
    with pytest.raises(SpecdecError, match=r"missing tensor 'model.layers.1.mlp.experts.5.up_proj.weight'"):
        load_model(path)


def test_an_unknown_rope_type_is_refused_by_name(tmp_path):
    path, _ = save_family(tmp_path, "mixtral")
    cfg = (path / "config.json").read_text().replace('"rope_type": "default"', '"rope_type": "wobbly"')
    (path / "config.json").write_text(cfg)
    with pytest.raises((SpecdecError, ValueError), match="unsupported rope_scaling type 'wobbly'"):
        load_model(path)


# ---- the same families from GGUF files (llama.cpp's layout, written by tools/hf_to_gguf.py) ----

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import hf_to_gguf  # noqa: E402


@needs_native
@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_familys_gguf_loads_as_its_hugging_face_directory(tmp_path, name):
    """F32: the same logits as the directory it was written from; Q8_0 on its own blocks (int8 activations): close to
    the same file dequantized to float32, the same greedy token at nearly every position (a mixture's router may
    pick another expert at a near-tie, which moves that row's logits more than rounding does)."""
    path, _ = save_family(tmp_path / "hf", name)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (4, 17)]
    conts = [torch.randint(3, 320, (10,), generator=g).tolist() for _ in prompts]
    reference = run_paged(load_model(path)[0], prompts, conts)
    f32 = hf_to_gguf.write(path, tmp_path / "f32.gguf", "F32")
    for got, want in zip(run_paged(load_model(f32)[0], prompts, conts), reference):
        assert (got - want).abs().max().item() < 1e-4, name
    q8 = hf_to_gguf.write(path, tmp_path / "q8.gguf", "Q8_0")
    blocks, _ = load_model(q8, dtype="auto")
    assert blocks.quantization == "q8_0"
    dequantized = run_paged(load_model(q8, dtype=torch.float32)[0], prompts, conts)
    got, want = torch.cat(run_paged(blocks, prompts, conts)), torch.cat(dequantized)
    assert (got - want).abs().mean().item() < 0.03 * want.abs().mean().item(), name
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9, name


# ---- files written by llama.cpp's own converter: the independent check of our reading of its layout ----

import llamacpp_convert  # noqa: E402

# The families as their published models configure them (llama.cpp's converter writes no window for Mistral or
# Qwen2, no clip_qkv for OLMoE, no query scale for Gemma but the head size's, and Gemma 3's 5-to-1 layer pattern).
AS_PUBLISHED = {
    "gemma2": dict(query_pre_attn_scalar=16),
    "gemma3": dict(query_pre_attn_scalar=16, num_hidden_layers=7, layer_types=None),
    "phi3-longrope": {}, "phi4-partial-rotary": {},
    "qwen2_moe": dict(mlp_only_layers=[]), "qwen3_moe": dict(decoder_sparse_step=1),
    "mixtral": {}, "olmoe": dict(clip_qkv=None),
    # V2-Lite's plain routing (llama.cpp scores a group by its best two, V2 by its best one); V3 names its gating
    "deepseek_v2": dict(topk_method="greedy", n_group=None, topk_group=None),
    "deepseek_v3": dict(scoring_func="sigmoid"),
    "gpt_oss": dict(swiglu_limit=7.0),  # llama.cpp's gpt-oss assumes the published limit (its converter writes none)
}


@needs_native
@pytest.mark.parametrize("name", list(AS_PUBLISHED))
def test_llama_cpps_own_gguf_of_a_family_loads_as_its_hugging_face_directory(tmp_path, name, monkeypatch):
    cls, extra = FAMILIES[name]
    monkeypatch.setitem(FAMILIES, name, (cls, {k: v for k, v in {**extra, **AS_PUBLISHED[name]}.items()
                                               if v is not None or k == "clip_qkv"}))
    path, _ = save_family(tmp_path / "hf", name)
    converted = llamacpp_convert.convert(path, tmp_path / "llamacpp.gguf")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (4, 17)]
    conts = [torch.randint(3, 320, (10,), generator=g).tolist() for _ in prompts]
    for got, want in zip(run_paged(load_model(converted)[0], prompts, conts),
                         run_paged(load_model(path)[0], prompts, conts)):
        assert (got - want).abs().max().item() < 1e-5, name


# ---- the Python layer (CUDA's path and the reference) and batch invariance ----

@needs_native
@pytest.mark.parametrize("name", ["gemma2", "gemma3", "phi4-partial-rotary", "qwen2_moe", "olmoe", "gpt_oss",
                                  "deepseek_v2", "deepseek_v3"])
def test_the_python_layers_match_transformers_too(tmp_path, name, monkeypatch):
    """The torch layer (every product, norm and attention still the native kernels on CPU) where no fused layer
    runs: the decoder's own reference for each family option."""
    from specdec.models.llama import DecoderLayer

    monkeypatch.setattr(DecoderLayer, "native_layer", lambda self: None)
    path, hf = save_family(tmp_path, name)
    ours, _ = load_model(path)
    assert ours.native_stack() is None
    prompt = torch.randint(3, 320, (21,), generator=torch.Generator().manual_seed(4)).tolist()
    (logits,) = run_paged(ours, [prompt[:13]], [prompt[13:]])
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    assert (prompt_logprobs(logits, prompt) - prompt_logprobs(ref, prompt)).abs().max().item() < 1e-3


@needs_native
@pytest.mark.parametrize("name", ["qwen2_moe", "mixtral", "gemma2", "gpt_oss", "deepseek_v3"])
def test_a_rows_logits_do_not_depend_on_the_other_rows_of_its_step(tmp_path, name):
    """Experts grouped over a step's rows, windows, soft-caps: a row's bits alone equal its bits beside another
    sequence and its own draft rows (what makes greedy speculation identical by construction)."""
    path, _ = save_family(tmp_path, name)
    ours, _ = load_model(path)
    g = torch.Generator().manual_seed(5)
    a, b = (torch.randint(3, 320, (n,), generator=g).tolist() for n in (15, 9))
    cont_a, cont_b = (torch.randint(3, 320, (6,), generator=g).tolist() for _ in range(2))
    (alone,) = run_paged(ours, [a], [cont_a])
    together, _ = run_paged(ours, [a, b], [cont_a, cont_b])
    assert torch.equal(alone, together)


def test_a_gguf_of_an_architecture_transformers_cannot_read_still_gets_its_tokenizer(tmp_path, monkeypatch):
    """transformers refuses an OLMoE GGUF outright (no model of that architecture in its GGUF support): the
    tokenizer fields are read through an architecture it has, and encode as the directory's tokenizer does."""
    from transformers import AutoTokenizer

    from specdec.models.loader import load_tokenizer, resolve

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    path, _ = save_family(tmp_path / "hf", "olmoe")
    gguf_path = hf_to_gguf.write(path, tmp_path / "olmoe.gguf", "F32")
    text = "def add(a, b):\n    return a + b  # the quick brown fox"
    want = AutoTokenizer.from_pretrained(path).encode(text, add_special_tokens=False)
    assert load_tokenizer(resolve(gguf_path)).encode(text, add_special_tokens=False) == want


# ---- DeepSeek's MTP module: the seeds' drafter, checked against the formula, not only through lossless output ----

def _with_mtp_layer(path: Path) -> dict[str, torch.Tensor]:
    """A DeepSeek-V3 directory given an MTP module (layer 3 after the 3 main ones, as published checkpoints carry
    it): a mixture-of-experts layer with latent attention, and enorm, hnorm, eh_proj, shared_head.norm."""
    from safetensors.torch import load_file, save_file

    own = load_file(path / "model.safetensors")
    H, g = COMMON["hidden_size"], torch.Generator().manual_seed(6)
    mtp = {"model.layers.3." + k.removeprefix("model.layers.2."): t + 0.1 * torch.randn(t.shape, generator=g)
           for k, t in own.items() if k.startswith("model.layers.2.")}
    mtp |= {f"model.layers.3.{n}.weight": 1 + 0.2 * torch.randn(H, generator=g)
            for n in ("enorm", "hnorm", "shared_head.norm")}
    mtp["model.layers.3.eh_proj.weight"] = torch.randn(H, 2 * H, generator=g) / (2 * H) ** 0.5 * 3
    save_file(mtp, path / "mtp.safetensors")
    return mtp


def _mtp_reference(path: Path, mtp: dict, features: torch.Tensor, next_ids: list[int], swap_inputs: bool = False):
    """DeepSeek-V3's MTP module written out, its decoder layer transformers' own: logits [T, V] of row t predicting
    token t + 2 from the target's last-layer output of token t (features [T, H]) and the embedding of token t + 1."""
    import json

    from safetensors.torch import load_file
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    config = transformers.DeepseekV3Config(**json.loads((path / "config.json").read_text()))
    config._attn_implementation = "eager"
    layer = ds.DeepseekV3DecoderLayer(config, layer_idx=2).eval()
    p = "model.layers.3."
    sd = {k.removeprefix(p): t for k, t in mtp.items()
          if not k.startswith(tuple(p + n for n in ("enorm", "hnorm", "eh_proj", "shared_head")))}
    E = config.n_routed_experts
    sd["mlp.experts.gate_up_proj"] = torch.stack([torch.cat((sd.pop(f"mlp.experts.{e}.gate_proj.weight"),
                                                             sd.pop(f"mlp.experts.{e}.up_proj.weight")))
                                                  for e in range(E)])
    sd["mlp.experts.down_proj"] = torch.stack([sd.pop(f"mlp.experts.{e}.down_proj.weight") for e in range(E)])
    layer.load_state_dict(sd, strict=True)
    own = load_file(path / "model.safetensors")
    eps = config.rms_norm_eps

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    h = norm(features, own["model.norm.weight"])  # the target's final norm
    e = own["model.embed_tokens.weight"][next_ids]
    pair = (norm(h, mtp[p + "hnorm.weight"]), norm(e, mtp[p + "enorm.weight"])) if swap_inputs else \
        (norm(e, mtp[p + "enorm.weight"]), norm(h, mtp[p + "hnorm.weight"]))
    x = torch.cat(pair, -1) @ mtp[p + "eh_proj.weight"].T
    T = x.shape[0]
    pos = torch.arange(T)[None]
    rope = ds.DeepseekV3RotaryEmbedding(config)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        out = layer(x[None], attention_mask=mask, position_ids=pos, position_embeddings=rope(x[None], pos))
    out = out[0] if isinstance(out, tuple) else out
    return norm(out[0], mtp[p + "shared_head.norm.weight"]) @ own["lm_head.weight"].T


@needs_native
@pytest.mark.parametrize("planted", [False, True])
def test_deepseeks_mtp_module_drafts_as_its_formula_says(tmp_path, planted):
    """The MTP head loaded from the model's own files gives, row by row through the paged cache, the logits of the
    module written out with transformers' DeepSeek-V3 layer; with its two inputs swapped (a planted bug) it does not."""
    from specdec.models.heads.eagle import EagleHead

    path, _ = save_family(tmp_path, "deepseek_v3")
    mtp = _with_mtp_layer(path)
    target, _ = load_model(path)
    head = EagleHead.load(path, target, "mtp")
    assert head.layers[0].mla is not None and head.layers[0].moe is not None
    seq = torch.randint(3, 320, (14,), generator=torch.Generator().manual_seed(7)).tolist()
    last = target.config.num_hidden_layers - 1
    (features,) = run_paged(_LayerOutput(target, last), [seq], [[]])

    class HeadAsModel:  # row p: the target's output of token p and the embedding of token p + 1
        config, act_dtype, device = head.config, torch.float32, torch.device("cpu")

        def __call__(self, tokens, positions, meta, kv):
            return head(target.embed(tokens), positions, meta, kv, features=features[positions]), None

        def compute_logits(self, rows):
            return head.compute_logits(rows)

    (ours,) = run_paged(HeadAsModel(), [seq[1:9]], [seq[9:]])
    want = _mtp_reference(path, mtp, features[:-1], seq[1:], swap_inputs=planted)
    close = (ours - want).abs().max().item() < 1e-3 * want.abs().max().item()
    assert close != planted


class _LayerOutput:
    """A model whose 'logits' are its last layer's output (pre-norm), for run_paged."""

    def __init__(self, model, layer: int):
        self.model, self.layer, self.config, self.act_dtype = model, layer, model.config, model.act_dtype
        self.device = model.device

    def __call__(self, tokens, positions, meta, kv):
        _, outs = self.model(tokens, positions, meta, kv, output_layers=(self.layer,))
        return outs[self.layer], None

    def compute_logits(self, rows):
        return rows


def assert_mtp_lossless(model: Path) -> None:
    """The model's own MTP layer drafts (some tokens each run) and greedy output stays plain greedy's."""
    prompts = [{"prompt_token_ids": [5, 9, 14, 5, 9, 14, 5, 9]}, {"prompt_token_ids": [40, 41, 42, 43, 40, 41]}]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = [o.token_ids for o in LLM(str(model), speculative_config="off").generate(prompts, params)]
    llm = LLM(str(model), speculative_config={"method": "mtp", "num_speculative_tokens": 2, "dispatch": {"1": "chain"}})
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == plain
    assert sum(o.metrics["num_draft_tokens"] for o in outs) > 0 and llm.engine.allocator.num_used == 0
    # without a config the model's MTP layers are a source of its default speculation, beside the n-gram
    default = LLM(str(model))
    spec = default.engine.speculative
    assert default.engine.model.config.num_mtp_layers == 1 and spec.method == "switch"
    assert [(s["method"], s.get("model")) for s in spec.options.sources] == [("ngram", None), ("mtp", str(model))]
    assert [o.token_ids for o in default.generate(prompts, params)] == plain
    assert LLM(str(model), speculative_config="off").engine.speculative is None  # "off" stays off


@needs_native
def test_a_model_declaring_mtp_layers_its_files_lack_speculates_with_the_n_gram(tmp_path):
    """transformers writes num_nextn_predict_layers=1 into every DeepSeek-V3 config: without the layer's tensors
    the model has no MTP head, and its default is the model-free one."""
    path, _ = save_family(tmp_path, "deepseek_v3")
    assert json.loads((path / "config.json").read_text()).get("num_nextn_predict_layers") == 1
    llm = LLM(str(path))
    assert llm.engine.model.config.num_mtp_layers == 0 and llm.engine.speculative.method == "ngram"


@needs_native
def test_deepseeks_mtp_module_speculates_losslessly(tmp_path):
    path, _ = save_family(tmp_path, "deepseek_v3")
    _with_mtp_layer(path)
    assert_mtp_lossless(path)


@needs_native
def test_deepseeks_mtp_layer_in_a_gguf_is_the_directorys_and_speculates_losslessly(tmp_path):
    """The MTP layer written as llama.cpp's nextn block (block N: latent attention and experts under blk.N names, its
    nextn.* tensors) reads back as the same head as from the Hugging Face directory, tensor for tensor, and drafts
    for the GGUF target without changing its greedy output."""
    from specdec.models.heads.eagle import EagleHead

    path, _ = save_family(tmp_path / "hf", "deepseek_v3")
    _with_mtp_layer(path)
    gguf = hf_to_gguf.write(path, tmp_path / "m.gguf", "F32")
    from_dir = EagleHead.load(path, load_model(path)[0], "mtp").state_dict()
    from_gguf = EagleHead.load(gguf, load_model(gguf)[0], "mtp").state_dict()
    assert from_dir.keys() == from_gguf.keys()
    for name, t in from_dir.items():
        assert torch.allclose(t, from_gguf[name], atol=1e-6), name
    assert_mtp_lossless(gguf)


# ---- gpt-oss's MXFP4 experts, as the published checkpoints ship them ----

@needs_native
def test_gpt_oss_mxfp4_experts_load_as_their_blocks_with_transformers_values(tmp_path, monkeypatch):
    """A checkpoint whose experts are MXFP4 (`*_blocks`, `*_scales`): each expert's matrices become GGUF MXFP4 blocks
    whose values are transformers' own dequantization of them, and the model's logits follow the float checkpoint's
    (int8 activations aside)."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    cls, extra = FAMILIES["gpt_oss"]
    monkeypatch.setitem(FAMILIES, "gpt_oss", (cls, {**extra, "intermediate_size": 64,  # blocks of 32 both ways
                                                    "swiglu_limit": 7.0}))
    path, _ = save_family(tmp_path / "float", "gpt_oss")
    state, g = load_file(path / "model.safetensors"), torch.Generator().manual_seed(8)
    packed = dict(state)
    for i in range(COMMON["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts."
        for name in ("gate_up_proj", "down_proj"):
            E, rows, cols = state[p + name].transpose(1, 2).shape  # [E, out, in]
            blocks = torch.randint(0, 256, (E, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
            scales = torch.randint(120, 126, (E, rows, cols // 32), generator=g, dtype=torch.uint8)
            state[p + name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
            del packed[p + name]
            packed[p + name + "_blocks"], packed[p + name + "_scales"] = blocks, scales
    save_file(state, path / "model.safetensors")
    mx = tmp_path / "mxfp4"
    mx.mkdir()
    for f in path.iterdir():
        if f.suffix != ".safetensors":
            (mx / f.name).write_bytes(f.read_bytes())
    config = json.loads((path / "config.json").read_text())
    (mx / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "mxfp4"}}))
    save_file(packed, mx / "model.safetensors")
    floats, blocks = load_model(path)[0], load_model(mx)[0]
    assert "mxfp4" in blocks.quantization
    for a, b in zip(floats.layers, blocks.layers):
        for fa, fb in zip(a.moe.linears, b.moe.linears):
            assert torch.equal(fb.weight.dequantize(), fa.weight)
    prompt = torch.randint(3, 320, (16,), generator=g).tolist()
    (want,), (got,) = (run_paged(m, [prompt[:10]], [prompt[10:]]) for m in (floats, blocks))
    # the blocks' products take int8 activations (the float model's do not), through three sharpened random layers:
    # close, not equal (measured 6.5% of the mean logit; a wrong nibble order or scale gives errors of order 100%)
    assert (got - want).abs().mean().item() < 0.12 * want.abs().mean().item()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.6


@needs_native
@pytest.mark.parametrize("spec", ["off", {"method": "ngram", "num_speculative_tokens": 4, "dispatch": {"1": "chain"}},
                                  {"method": "ngram", "num_speculative_tokens": 6, "ngram_branches": 2,
                                   "dispatch": {"1": "chain", "4": "chain"}}],
                         ids=["plain", "ngram-chain", "ngram-tree"])
def test_blocks_behind_every_layers_window_are_freed_and_output_stays_exact(tmp_path, spec):
    """Mistral with an 8-token window on every layer, blocks of 4: four 60-token sequences at once need 60 blocks
    with the whole context kept, but only the blocks their windows still reach (about 4 each) when the rest are
    freed. In 25 blocks they run without a preemption, give the tokens of a run with blocks to spare, and give
    every block back; prefix caching still hits on a repeated prompt."""
    path, _ = save_family(tmp_path, "mistral-window")
    g = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(3, 320, (20,), generator=g).tolist()} for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ample = [o.token_ids for o in LLM(str(path), speculative_config="off", block_size=4).generate(prompts, params)]
    llm = LLM(str(path), speculative_config=spec, block_size=4, num_kv_blocks=25, max_num_seqs=4)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == ample
    assert spec == "off" or sum(o.metrics["num_draft_tokens"] for o in outs) > 0
    engine = llm.engine
    assert engine.scheduler.num_preemptions == 0 and engine.allocator.num_used == 0
    for _ in range(2):  # the prompt's blocks, freed behind the window, are still cached for the second run
        hits = engine.allocator.prefix_hit_tokens
        assert [o.token_ids for o in llm.generate(prompts[:1], params)] == ample[:1]
    assert engine.allocator.prefix_hit_tokens - hits == 16 and engine.allocator.num_used == 0


EAGLE3_TARGETS = ["qwen3_moe", "gpt_oss", "gemma3"]  # the families EAGLE-3 heads are published for


@needs_native
@pytest.mark.parametrize("name", EAGLE3_TARGETS)
def test_the_features_an_eagle3_head_reads_are_the_familys_layer_outputs(tmp_path, name):
    """An EAGLE-3 head reads the outputs of three target layers, as its trainer (SpecForge, on transformers'
    model) saw them: layer i's output is transformers' hidden_states[i + 1] (the last one under the final norm there).
    Checked for every row of a prompt that
    outgrows the window, through the native stack these targets run on."""
    from conftest import sequence_inputs

    from specdec.engine.model_runner import ModelRunner
    from specdec.engine.sequence import Sequence
    from specdec.kv_cache import BlockAllocator, KVPool

    path, hf = save_family(tmp_path, name)
    ours, _ = load_model(path)
    ids = torch.randint(3, 320, (19,), generator=torch.Generator().manual_seed(2)).tolist()
    alloc, layers = BlockAllocator(16, 4), (0, 1, 2)
    runner = ModelRunner(ours, KVPool(ours.config, 16, 4, ours.act_dtype, "cpu"), 4)
    seq = Sequence(0, ids, SamplingParams(), 64)
    alloc.allocate(seq.block_table, len(ids))
    _, features, _ = ours.forward_logits(*sequence_inputs(runner, [seq], [len(ids)]), runner.kv, [len(ids) - 1],
                                         output_layers=layers)
    with torch.no_grad():
        states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
        # transformers' last entry is the final layer's output after the final norm
        got = list(features.split(ours.config.hidden_size, -1))
        got[-1] = ours.norm(got[-1])
    for i, f in zip(layers, got, strict=True):
        want = states[i + 1][0]
        assert ((f - want).abs().max() / want.abs().max()).item() < 1e-4, (name, i)


@needs_native
@pytest.mark.parametrize("name", EAGLE3_TARGETS)
def test_an_eagle3_head_made_for_a_family_loads_and_speculates_losslessly(tmp_path, name):
    """A head as published for these targets: a Llama-form layer of the target's width in SpecForge's layout, with a
    draft vocabulary of 100 target tokens, reading layers (0, 1, 2). It loads against the family's target and its
    greedy speculation gives plain greedy's tokens while drafting."""
    from specdec.config import ModelConfig
    from specdec.models.heads.eagle3 import Eagle3Head

    path, _ = save_family(tmp_path / "target", name)
    target = LLM(str(path), speculative_config="off")
    t = target.engine.model.config
    g = torch.Generator().manual_seed(0)
    cfg = ModelConfig(model_type="llama", vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=96,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=256)
    head = Eagle3Head(cfg, 100, (0, 1, 2))
    for p in head.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    chosen = torch.randperm(t.vocab_size, generator=g)[:100].sort().values
    head.d2t.copy_(chosen - torch.arange(100))
    head.save(tmp_path / "head")
    prompts = [{"prompt_token_ids": [5, 9, 14, 5, 9, 14, 5, 9, 14, 5, 9]}, {"prompt_token_ids": list(range(40, 59))}]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = [o.token_ids for o in target.generate(prompts, params)]
    llm = LLM(str(path), speculative_config={"method": "eagle3", "model": str(tmp_path / "head"),
                                             "num_speculative_tokens": 3, "dispatch": {"1": "chain"}})
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == plain
    assert sum(o.metrics["num_draft_tokens"] for o in outs) > 0 and llm.engine.allocator.num_used == 0
