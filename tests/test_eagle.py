"""EAGLE-1 and MTP heads: the reference checkpoint layouts, serving forward = training forward, and drafting
that never changes the output."""
from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from conftest import assert_greedy_equal, every_step, save_tiny_model

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
