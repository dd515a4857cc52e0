"""EAGLE-1 and MTP heads: the reference checkpoint layouts, serving forward = training forward, drafting that never
changes the output, and the chains drafted in the engine against the published formulas."""
from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from conftest import NEAR_TIE, assert_greedy_equal, every_step, save_tiny_model

from specdec import LLM, SamplingParams, SpecdecError
from specdec.models.heads.eagle import EagleHead
from specdec.training.targets import target_outputs

PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick", "Hello world", "1 2 3 4 5 6 1 2 3"]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("target"), "llama", num_hidden_layers=4)


@pytest.fixture(scope="module")
def target(target_dir):
    return LLM(str(target_dir)).engine.model


def random_head(target, layout: str = "eagle", layers: int = 1, seed: int = 0, **parts) -> EagleHead:
    g = torch.Generator().manual_seed(seed)
    head = EagleHead(dataclasses.replace(target.config, num_hidden_layers=layers), target, layout, **parts)
    for p in head.trainable_parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return head


@pytest.fixture(scope="module", params=["eagle", "mtp"])
def head_dir(request, target, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    random_head(target, request.param, layers=2 if request.param == "eagle" else 1).save(path)
    return request.param, path


def serving_forward(head, target, ids: list[int]) -> torch.Tensor:
    """The head over a whole sequence through the serving path (paged cache, fused kernels): row t reads the
    target's feature of token t and the embedding of token t + 1."""
    from specdec.kv_cache import KVPool
    from specdec.models.blocks.attention import AttentionMetadata

    features, _, _ = target_outputs(target, ids, head.aux_layers)
    T, bs, dev = len(ids) - 1, 16, target.device
    kv = KVPool(head.config, -(-T // bs) + 1, bs, torch.float32, dev)
    pos = torch.arange(T, device=dev)
    slots = (pos + bs)[None]
    meta = AttentionMetadata.causal(pos[None], slots, pos[None], slots[0], [T])
    return head(target.embed(torch.tensor(ids[1:], device=dev)), pos, meta, kv, features=features[:T])


@pytest.mark.parametrize("layout, parts", [("eagle", {}), ("mtp", {}),
                                           ("eagle", dict(embed_norm=False, hidden_norm=False, output_norm=False,
                                                          fc_bias=True, first_layer_norm=False))])
def test_serving_forward_equals_the_training_forward(target, layout, parts):
    """Two implementations of one head (paged attention in the engine, SDPA with autograd in the trainer)."""
    head = random_head(target, layout, layers=2, **parts)
    ids = [5, 9, 3, 17, 22, 8, 1, 40, 33, 2, 7, 11, 19, 4, 6, 12, 30, 31, 9]
    _, hidden, _ = target_outputs(target, ids, head.aux_layers)
    with torch.no_grad():
        train = head.train_forward(target.embed(torch.tensor(ids[1:], device=target.device)).float(),
                                   target.norm(hidden)[:-1])
    torch.testing.assert_close(serving_forward(head, target, ids), train, rtol=1e-4, atol=1e-4)


def test_checkpoint_layouts(target, head_dir):
    from safetensors.torch import load_file

    layout, path = head_dir
    keys = set(load_file(path / "model.safetensors"))
    if layout == "eagle":
        assert {"fc.weight", "enorm.weight", "hnorm.weight", "norm.weight", "layers.1.self_attn.q_proj.weight",
                "layers.0.mlp.down_proj.weight", "layers.0.input_layernorm.weight"} <= keys
    else:  # DeepSeek-V3 names, under the layer index after the target's last layer
        assert {"model.layers.4.eh_proj.weight", "model.layers.4.enorm.weight", "model.layers.4.hnorm.weight",
                "model.layers.4.shared_head.norm.weight", "model.layers.4.self_attn.o_proj.weight",
                "model.layers.4.input_layernorm.weight", "model.layers.4.mlp.gate_proj.weight"} <= keys
    head = EagleHead.load(path, target, layout)
    saved = load_file(path / "model.safetensors")
    assert saved.keys() == head.state_dict_reference().keys()
    for name, t in head.state_dict_reference().items():
        assert torch.equal(t, saved[name]), name


def test_the_eagle_reference_layout_loads(target, tmp_path):
    """A checkpoint as the EAGLE reference writes it: fc with a bias, no input norm on layer 0, no extra norms;
    the head then reads the target's final hidden state and feeds the target's LM head directly."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1)
    H, inter = target.config.hidden_size, target.config.intermediate_size
    c = target.config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    sd = {"fc.weight": torch.randn(H, 2 * H, generator=g) * 0.1, "fc.bias": torch.randn(H, generator=g),
          "layers.0.self_attn.q_proj.weight": torch.randn(q, H, generator=g) * 0.1,
          "layers.0.self_attn.k_proj.weight": torch.randn(kv, H, generator=g) * 0.1,
          "layers.0.self_attn.v_proj.weight": torch.randn(kv, H, generator=g) * 0.1,
          "layers.0.self_attn.o_proj.weight": torch.randn(H, q, generator=g) * 0.1,
          "layers.0.mlp.gate_proj.weight": torch.randn(inter, H, generator=g) * 0.1,
          "layers.0.mlp.up_proj.weight": torch.randn(inter, H, generator=g) * 0.1,
          "layers.0.mlp.down_proj.weight": torch.randn(H, inter, generator=g) * 0.1,
          "layers.0.post_attention_layernorm.weight": torch.rand(H, generator=g) + 0.5,
          "embed_tokens.weight": target.embed_tokens.detach().clone()}  # some reference heads carry a copy
    save_file(sd, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "bias": True,
                                                      **{k: getattr(target.config, k) for k in (
                                                          "hidden_size", "intermediate_size", "num_attention_heads",
                                                          "num_key_value_heads", "rms_norm_eps", "rope_theta",
                                                          "max_position_embeddings", "vocab_size")},
                                                      "num_hidden_layers": 1}))
    head = EagleHead.load(tmp_path, target, "eagle")
    ids = [5, 9, 3, 17, 22, 8, 1, 40, 33]
    _, hidden, _ = target_outputs(target, ids, head.aux_layers)
    normed = target.norm(hidden)[:-1]
    x = torch.cat([target.embed(torch.tensor(ids[1:])), normed], -1) @ sd["fc.weight"].T + sd["fc.bias"]
    c = target.config
    T, nh, nkv, D = len(ids) - 1, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    pos = torch.arange(T)
    cos, sin = head.rope_cos[pos][:, None], head.rope_sin[pos][:, None]
    rot = lambda t: t * cos + t.roll(D // 2, -1) * sin  # noqa: E731  (signed sin: rotate_half)
    qh = rot((x @ sd["layers.0.self_attn.q_proj.weight"].T).view(T, nh, D)).transpose(0, 1)
    kh = rot((x @ sd["layers.0.self_attn.k_proj.weight"].T).view(T, nkv, D)).transpose(0, 1)
    kh = kh.repeat_interleave(nh // nkv, 0)
    vh = (x @ sd["layers.0.self_attn.v_proj.weight"].T).view(T, nkv, D).transpose(0, 1).repeat_interleave(nh // nkv, 0)
    scores = (qh @ kh.transpose(1, 2)) / D ** 0.5 + torch.full((T, T), float("-inf")).triu(1)
    x = x + (scores.softmax(-1) @ vh).transpose(0, 1).reshape(T, -1) @ sd["layers.0.self_attn.o_proj.weight"].T
    n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + target.config.rms_norm_eps)
    n = n * sd["layers.0.post_attention_layernorm.weight"]
    gate = torch.nn.functional.silu(n @ sd["layers.0.mlp.gate_proj.weight"].T)
    x = x + (gate * (n @ sd["layers.0.mlp.up_proj.weight"].T)
             ) @ sd["layers.0.mlp.down_proj.weight"].T
    out = serving_forward(head, target, ids)
    torch.testing.assert_close(out, x, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(head.compute_logits(out), x @ target.lm_head.T, rtol=1e-4, atol=1e-3)


def test_a_head_for_another_model_is_refused(target_dir, head_dir, tmp_path):
    layout, path = head_dir
    config = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_size": 128}))
    shutil.copy(path / "model.safetensors", tmp_path)
    with pytest.raises(SpecdecError, match="hidden size 128"):
        LLM(str(target_dir), speculative_config=every_step({"method": layout, "model": str(tmp_path)}))
    with pytest.raises(SpecdecError, match="not found"):
        LLM(str(target_dir), speculative_config=every_step({"method": layout, "model": str(tmp_path / "nowhere")}))


@pytest.mark.parametrize("tree", ["chain", [[0], [1], [0, 0], [0, 0, 0], [1, 0]]])
def test_greedy_equals_plain(target_dir, head_dir, tree):
    layout, path = head_dir
    reference = [o.token_ids for o in LLM(str(target_dir)).generate(PROMPTS, GREEDY)]
    llm = LLM(str(target_dir), speculative_config=every_step({"method": layout, "model": str(path),
                                                              "num_speculative_tokens": 3, "tree": tree}))
    outs = llm.generate(PROMPTS, GREEDY)
    assert_greedy_equal(llm, outs, reference)
    assert llm.generate(PROMPTS[1], GREEDY)[0].token_ids == reference[1]
    assert sum(o.metrics["num_draft_tokens"] for o in outs) > 0
    assert llm.engine.allocator.num_used == 0


def test_seeded_sampling_repeats(target_dir, head_dir):
    layout, path = head_dir
    llm = LLM(str(target_dir), speculative_config=every_step({"method": layout, "model": str(path),
                                                              "num_speculative_tokens": 3}))
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, seed=7, ignore_eos=True)
    first = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == first


def test_an_mtp_module_with_its_own_lm_head_uses_it(target, tmp_path):
    """DeepSeek's MTP checkpoints may carry `shared_head.head.weight`: the module then reads it, not the target's."""
    from safetensors.torch import load_file, save_file

    random_head(target, "mtp").save(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    own = torch.randn(target.config.vocab_size, target.config.hidden_size, generator=torch.Generator().manual_seed(3))
    save_file({**sd, "model.layers.4.shared_head.head.weight": own}, tmp_path / "model.safetensors")
    head = EagleHead.load(tmp_path, target, "mtp")
    out = torch.randn(3, target.config.hidden_size)
    normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + target.config.rms_norm_eps) * head.norm.weight
    torch.testing.assert_close(head.compute_logits(out), normed @ own.T, rtol=1e-4, atol=1e-4)


# ---- the drafts against the published formulas, from the saved tensors and transformers' target (issue 60) ----
# Output equality cannot tell a wrong head (verification corrects any draft): these compare the chains the engine
# drafted, step by step, with chains recomputed from scratch over the whole committed text.
def rms(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    return x if w is None else x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def llama_layer(sd: dict[str, torch.Tensor], p: str, x: torch.Tensor, c) -> torch.Tensor:
    """One Llama decoder layer over rows at positions 0..T-1, causal (HF's RoPE: rotate_half)."""
    T, D = x.shape[0], c.head_dim
    inv = 1.0 / c.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    ang = torch.cat([torch.arange(T)[:, None] * inv] * 2, -1)[:, None, :]

    def rope(t):
        return t * ang.cos() + torch.cat([-t[..., D // 2:], t[..., :D // 2]], -1) * ang.sin()

    n = rms(x, sd.get(p + "input_layernorm.weight"), c.rms_norm_eps)
    q = rope((n @ sd[p + "self_attn.q_proj.weight"].T).view(T, -1, D))
    k = rope((n @ sd[p + "self_attn.k_proj.weight"].T).view(T, -1, D))
    v = (n @ sd[p + "self_attn.v_proj.weight"].T).view(T, -1, D)
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
    scores = torch.einsum("thd,shd->hts", q, k) / D ** 0.5 + torch.full((T, T), float("-inf")).triu(1)
    x = x + torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(T, -1) @ sd[p + "self_attn.o_proj.weight"].T
    n = rms(x, sd[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
    mlp = torch.nn.functional.silu(n @ sd[p + "mlp.gate_proj.weight"].T) * (n @ sd[p + "mlp.up_proj.weight"].T)
    return x + mlp @ sd[p + "mlp.down_proj.weight"].T


def eagle_formula(sd: dict[str, torch.Tensor], c):
    """The EAGLE head (Li et al. 2024) from its checkpoint's tensors: rows [T, H] of next-token embeddings and
    feature vectors -> outputs [T, H] = layers(fc(concat(enorm(embedding), hnorm(feature)))); logits of an output:
    the target's LM head over norm(output). Its optional norms and fc bias apply where the file has them."""
    layers = sorted({int(k.split(".")[1]) for k in sd if k.startswith("layers.")})

    def rows(embeds, h):
        x = torch.cat([rms(embeds, sd.get("enorm.weight"), c.rms_norm_eps), rms(h, sd.get("hnorm.weight"),
                                                                                c.rms_norm_eps)], -1)
        x = x @ sd["fc.weight"].T + sd.get("fc.bias", 0)
        for i in layers:
            x = llama_layer(sd, f"layers.{i}.", x, c)
        return x

    return rows, lambda out: rms(out, sd.get("norm.weight"), c.rms_norm_eps), lambda out: out


def formula_chain(rows, final, recycle, embed, lm_head, ids: list[int], features: torch.Tensor, k: int):
    """A greedy chain of k drafts after `ids`, all rows recomputed each step: row t pairs the target's feature of
    token t with the embedding of token t + 1 and sits at position t; draft j + 1 is read at the row that pairs
    the head's own (recycled) output of the row before with draft j. Returns the tokens and each one's margin
    over the runner-up logit."""
    emb, h, tokens, margins = embed[ids[1:]], features, [], []
    for _ in range(k):
        out = rows(emb, h)[-1]
        top = (final(out) @ lm_head.T).topk(2)
        tokens.append(int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1]))
        emb, h = torch.cat([emb, embed[tokens[-1:]]]), torch.cat([h, recycle(out)[None]])
    return tokens, margins


def recorded_chains(llm, prompts) -> list[tuple[int, list[int], list[int]]]:
    """Every chain the engine verified while generating: (sequence, the committed text it followed, the chain)."""
    speculator, seen = llm.engine.speculator, []
    draft = speculator.draft

    def recording(seqs):
        step = draft(seqs)
        seen.extend((s.seq_id, list(s.token_ids), chain) for s, chain in zip(seqs, step.tokens) if chain)
        return step

    speculator.draft = recording
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    return seen


def chain_mismatches(seen, hf, rows, final, recycle, lm_head) -> tuple[int, int]:
    """(drafts checked, chains that part from the formula's) over `seen`; a chain is checked up to its first
    near-tie (where float rounding may pick either token) and given up at its first difference. The target's
    features are transformers' final normed hidden states, of each sequence's whole text once (causal: a
    prefix's are the first rows)."""
    texts = {sid: ids for sid, ids, _ in sorted(seen, key=lambda s: len(s[1]))}
    with torch.no_grad():
        features = {sid: hf.model(torch.tensor([ids])).last_hidden_state[0] for sid, ids in texts.items()}
    checked = mismatched = 0
    for sid, ids, chain in seen:
        with torch.no_grad():
            want, margins = formula_chain(rows, final, recycle, hf.get_input_embeddings().weight, lm_head, ids,
                                          features[sid][:len(ids) - 1], len(chain))
        for got, token, margin in zip(chain, want, margins):
            if margin < NEAR_TIE:
                break
            checked += 1
            if got != token:
                mismatched += 1
                break
    return checked, mismatched


@pytest.fixture
def tiny_engines(monkeypatch):
    """Engines for tiny models that draft at every step whatever it costs (`every_step`): they skip timing
    verification at start-up (the cost model's table, measured again at every start on a busy machine) and run on
    one thread (over rows of 64 more threads only wait on each other, up to a hundredfold on a busy machine;
    conftest restores the count)."""
    monkeypatch.setattr("specdec.engine.llm_engine.engine_costs", lambda engine: None)
    torch.set_num_threads(1)


REFERENCE_PARTS = dict(embed_norm=False, hidden_norm=False, output_norm=False, fc_bias=True, first_layer_norm=False)


@pytest.mark.parametrize("parts, planted", [({}, None), (REFERENCE_PARTS, None), ({}, "concat order"),
                                            ({}, "recycled through the norm")])
def test_eagle_drafts_are_the_published_formulas(target_dir, target, tmp_path, monkeypatch, tiny_engines, parts,
                                                 planted):
    """The chains an EAGLE head drafts in the engine (catch-up over the target's features, then its own outputs fed
    back, paged K/V), ours and one in the EAGLE reference's layout, against `eagle_formula` written from its saved
    tensors, with the target's features, embedding and LM head from transformers. Planted: the fc's input halves
    swapped; MTP's recycling (the output through the final norm) given to an EAGLE head. Verification would have
    corrected every draft; the formula does not."""
    import transformers
    from safetensors.torch import load_file

    random_head(target, "eagle", layers=1, seed=4, **parts).save(tmp_path)
    if planted == "concat order":
        monkeypatch.setattr(EagleHead, "mix", lambda self, e, h: self.fc(torch.cat([self.hnorm(h), self.enorm(e)], -1)))
    elif planted:
        monkeypatch.setattr(EagleHead, "recycled", lambda self, out: self.norm(out))
    llm = LLM(str(target_dir), speculative_config=every_step({"method": "eagle", "model": str(tmp_path),
                                                              "num_speculative_tokens": 3}))
    seen = recorded_chains(llm, PROMPTS)
    hf = transformers.AutoModelForCausalLM.from_pretrained(target_dir).eval()
    rows, final, recycle = eagle_formula(load_file(tmp_path / "model.safetensors"), target.config)
    checked, mismatched = chain_mismatches(seen, hf, rows, final, recycle, hf.lm_head.weight)
    if planted:
        assert mismatched >= 3, planted
    else:
        assert mismatched == 0 and checked > 30


def mtp_formula(sd: dict[str, torch.Tensor], block, rotary, eps: float):
    """DeepSeek-V3's MTP module (its report, section 2.2, as vLLM and SGLang run it: the embedding first in eh_proj's
    input, where the report writes the hidden state first) from the checkpoint's tensors, its decoder block
    transformers' own: rows -> block(eh_proj(concat(enorm(embedding), hnorm(hidden)))); logits of an output: the
    LM head over shared_head.norm(output), which is also what the next step reads (SGLang)."""
    p = next(k for k in sd if k.endswith(".eh_proj.weight")).removesuffix("eh_proj.weight")

    def rows(embeds, h):
        x = torch.cat([rms(embeds, sd[p + "enorm.weight"], eps), rms(h, sd[p + "hnorm.weight"], eps)], -1)
        x = (x @ sd[p + "eh_proj.weight"].T)[None]
        T, pos = x.shape[1], torch.arange(x.shape[1])[None]
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        return block(x, attention_mask=mask, position_ids=pos, position_embeddings=rotary(x, pos))[0]

    def final(out):
        return rms(out, sd[p + "shared_head.norm.weight"], eps)

    return rows, final, final


@pytest.fixture(scope="module")
def deepseek_with_mtp(tmp_path_factory):
    """A tiny DeepSeek-V3 model (latent attention, routed experts) whose files carry one MTP layer after its three
    main layers, and transformers' model of all four (its last layer is the MTP module's block)."""
    from safetensors.torch import save_file
    from test_families import FAMILIES, save_family

    cls, extra = FAMILIES["deepseek_v3"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(FAMILIES, "deepseek_v3", (cls, {**extra, "num_hidden_layers": 4}))
        path, hf = save_family(tmp_path_factory.mktemp("deepseek-mtp"), "deepseek_v3")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3, "num_nextn_predict_layers": 1,
                                                  "scoring_func": "sigmoid"}))  # as DeepSeek-V3's config says
    H, g = config["hidden_size"], torch.Generator().manual_seed(7)
    save_file({**{f"model.layers.3.{n}.weight": 1 + 0.2 * torch.randn(H, generator=g)
                  for n in ("enorm", "hnorm", "shared_head.norm")},
               "model.layers.3.eh_proj.weight": torch.randn(H, 2 * H, generator=g) * 3 / (2 * H) ** 0.5},
              path / "model-mtp.safetensors")  # "model*": the name llama.cpp's converter reads too
    hf.config.num_hidden_layers = 3  # transformers' model then runs the main layers only: the target
    return path, hf


@pytest.mark.parametrize("planted", [None, "concat order", "recycled without the norm"])
def test_mtp_drafts_of_a_deepseek_v3_model_are_the_published_formula(deepseek_with_mtp, monkeypatch, tiny_engines,
                                                                     planted):
    """The chains the engine drafts with `{"method": "mtp"}` from the model's own MTP layer against `mtp_formula`,
    transformers' DeepseekV3DecoderLayer as its block and transformers' model for the target's features (test_families
    checks the module's logits row by row; this, the chains, whose later drafts read the module's own output).
    Planted: eh_proj's input halves swapped; the output fed back without shared_head.norm (only a chain's later
    drafts show it)."""
    from safetensors.torch import load_file

    path, hf = deepseek_with_mtp
    if planted == "concat order":
        monkeypatch.setattr(EagleHead, "mix", lambda self, e, h: self.fc(torch.cat([self.hnorm(h), self.enorm(e)], -1)))
    elif planted:
        monkeypatch.setattr(EagleHead, "recycled", lambda self, out: out)
    llm = LLM(str(path), speculative_config=every_step({"method": "mtp", "num_speculative_tokens": 3}))
    seen = recorded_chains(llm, PROMPTS)
    sd = {**load_file(path / "model.safetensors"), **load_file(path / "model-mtp.safetensors")}
    rows, final, recycle = mtp_formula(sd, hf.model.layers[3], hf.model.rotary_emb, hf.config.rms_norm_eps)
    checked, mismatched = chain_mismatches(seen, hf, rows, final, recycle, hf.lm_head.weight)
    if planted:
        assert mismatched >= 3, planted
    else:
        assert mismatched == 0 and checked > 30
