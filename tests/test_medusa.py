"""Medusa-1 heads: the reference checkpoint layout, and drafting that never changes the output."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_greedy_equal, every_step, save_tiny_model

from specdec import LLM, SamplingParams, SpecdecError
from specdec.drafting import DraftRequest
from specdec.drafting.medusa import MedusaDrafter
from specdec.models.heads.medusa import MedusaHeads

PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick", "Hello world", "1 2 3 4 5 6 1 2 3"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
TREE = [[0], [1], [0, 0], [1, 0]]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("target"), "llama", num_hidden_layers=3)


@pytest.fixture(scope="module")
def target(target_dir):
    return LLM(str(target_dir)).engine.model


def random_heads(lm_head: torch.Tensor | None, K: int = 2, L: int = 1, H: int = 64, V: int = 320,
                 seed: int = 0, scale: float = 0.2) -> MedusaHeads:
    g = torch.Generator().manual_seed(seed)
    heads = MedusaHeads(K, L, H, V, lm_head)
    for p in heads.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * scale)
    return heads


@pytest.fixture(scope="module")
def head_dir(target, tmp_path_factory):
    path = tmp_path_factory.mktemp("medusa")
    random_heads(target.lm_head).save(path)
    return path


@pytest.fixture(scope="module")
def reference(target_dir):
    return [o.token_ids for o in LLM(str(target_dir)).generate(PROMPTS, GREEDY)]


def medusa(target_dir, head_dir, **kw) -> LLM:
    return LLM(str(target_dir), speculative_config=every_step({"method": "medusa", "model": str(head_dir),
                                                   "num_speculative_tokens": 2, **kw}))


def test_shapes_and_forward(target):
    heads = random_heads(target.lm_head, K=3, L=2)
    h = torch.randn(5, 64)
    out = heads(h)
    assert out.shape == (3, 5, 64) and heads(h, 2).shape == (2, 5, 64)
    logits = heads.logits(out)
    assert logits.shape == (3, 5, 320) and logits.dtype == torch.float32
    assert torch.allclose(logits[1], out[1] @ target.lm_head.float().T, atol=1e-4)
    zero = MedusaHeads(2, 1, 64, 320, target.lm_head)
    for p in zero.parameters():
        p.data.zero_()
    assert torch.equal(zero(h), torch.stack([h, h]))  # x + SiLU(0): zero-initialised blocks are the identity
    assert all(".linear." in name for name in heads.state_dict())  # the shared LM head is the target's: not saved


def draft_for(drafter: MedusaDrafter, features: torch.Tensor, tree=None, max_tokens: int = 4):
    n = features.shape[0] + 1  # the last committed token has no feature yet
    return drafter.propose([DraftRequest(0, list(range(n)), 1, max_tokens, tree=tree, features=features)])


def test_save_load_round_trip_gives_identical_drafts(target_dir, target, head_dir):
    from safetensors.torch import load_file

    config = json.loads((head_dir / "config.json").read_text())
    assert config == {"architectures": ["MedusaModel"], "medusa_num_heads": 2, "medusa_num_layers": 1,
                      "hidden_size": 64, "vocab_size": 320}
    saved = load_file(head_dir / "model.safetensors")
    assert set(saved) == {f"medusa_head.{i}.0.linear.{w}" for i in range(2) for w in ("weight", "bias")}
    loaded = MedusaHeads.load(head_dir, target.config, target.lm_head)
    original = random_heads(target.lm_head)
    for name, t in original.state_dict_reference().items():
        assert torch.equal(t, loaded.state_dict_reference()[name]), name
    model = LLM(str(target_dir)).engine.model
    features = torch.randn(6, 64) * 3
    for tree in (None, tuple(map(tuple, TREE))):
        a, b = (draft_for(MedusaDrafter(h, model, 2), features, tree) for h in (original, loaded))
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents) and a.probs is None


@pytest.mark.parametrize("planted", [False, True])
def test_reference_checkpoint_with_per_head_lm_heads(target, tmp_path, monkeypatch, planted):
    """A checkpoint written by hand in the reference layout (each head with its own LM head, config without
    sizes) loads, and its logits are the ones plain torch computes. Planted: a block without its residual; the
    formula tells at once, where output equality never would (verification corrects any draft)."""
    from safetensors.torch import save_file

    from specdec.models.heads.medusa import ResBlock

    if planted:
        monkeypatch.setattr(ResBlock, "forward", lambda self, x: F.silu(self.linear(x)))

    K, L, H, V = 2, 2, 64, 320
    g = torch.Generator().manual_seed(3)
    sd = {}
    for i in range(K):
        for j in range(L):
            sd[f"medusa_head.{i}.{j}.linear.weight"] = torch.randn(H, H, generator=g) * 0.1
            sd[f"medusa_head.{i}.{j}.linear.bias"] = torch.randn(H, generator=g) * 0.1
        sd[f"medusa_head.{i}.{L}.weight"] = torch.randn(V, H, generator=g)
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": K, "medusa_num_layers": L,
                                                      "base_model_name_or_path": "tiny"}))
    save_file(sd, tmp_path / "medusa_lm_head.safetensors")
    heads = MedusaHeads.load(tmp_path, target.config, target.lm_head)
    assert heads.owns_lm_heads
    h = torch.randn(4, H)
    expected = []
    for i in range(K):
        x = h
        for j in range(L):
            x = x + F.silu(x @ sd[f"medusa_head.{i}.{j}.linear.weight"].T + sd[f"medusa_head.{i}.{j}.linear.bias"])
        expected.append(x @ sd[f"medusa_head.{i}.{L}.weight"].T)
    assert torch.allclose(heads.logits(heads(h)), torch.stack(expected), atol=1e-4) != planted
    if planted:
        return
    del sd[f"medusa_head.1.{L}.weight"]  # only some heads with their own LM head
    save_file(sd, tmp_path / "medusa_lm_head.safetensors")
    with pytest.raises(SpecdecError, match=r"missing tensor 'medusa_head\.1\.2\.weight'"):
        MedusaHeads.load(tmp_path, target.config, target.lm_head)


def test_a_head_for_another_model_is_refused(target_dir, target, head_dir, tmp_path):
    random_heads(None, H=32).save(tmp_path / "small")
    with pytest.raises(SpecdecError, match="hidden size 32"):
        medusa(target_dir, tmp_path / "small")
    config = json.loads((tmp_path / "small" / "config.json").read_text())
    del config["hidden_size"], config["vocab_size"]  # sizes only in the tensors
    (tmp_path / "small" / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecdecError, match=r"'medusa_head\.0\.0\.linear\.weight' has shape \(32, 32\), expected "
                                           r"\(64, 64\)"):
        medusa(target_dir, tmp_path / "small")
    from safetensors.torch import load_file, save_file

    sd = load_file(head_dir / "model.safetensors")
    del sd["medusa_head.1.0.linear.bias"]
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "config.json").write_text((head_dir / "config.json").read_text())
    save_file(sd, tmp_path / "partial" / "model.safetensors")
    with pytest.raises(SpecdecError, match=r"missing tensor 'medusa_head\.1\.0\.linear\.bias'"):
        medusa(target_dir, tmp_path / "partial")
    with pytest.raises(SpecdecError, match="not found: no such directory or file"):
        medusa(target_dir, tmp_path / "nowhere")
    (tmp_path / "bare").mkdir()
    with pytest.raises(SpecdecError, match="no config.json"):
        medusa(target_dir, tmp_path / "bare")


@pytest.mark.parametrize("tree", ["chain", TREE])
def test_medusa_greedy_equals_plain(target_dir, head_dir, reference, tree):
    llm = medusa(target_dir, head_dir, tree=tree)
    outs = llm.generate(PROMPTS, GREEDY)  # a ragged batch of 3
    assert_greedy_equal(llm, outs, reference)
    assert llm.generate(PROMPTS[0], GREEDY)[0].token_ids == reference[0]  # batch 1
    assert sum(o.metrics["num_draft_tokens"] for o in outs) > 0
    assert llm.engine.allocator.num_used == 0


def test_heads_read_the_newest_target_feature(target_dir, target, reference, tmp_path):
    """With identity blocks and the target's LM head, head 0 repeats the target's own greedy prediction from
    the row it reads: that of token n - 2, which is the last committed token n - 1."""
    zero = MedusaHeads(2, 1, 64, 320, target.lm_head)
    for p in zero.parameters():
        p.data.zero_()
    zero.save(tmp_path)
    llm = medusa(target_dir, tmp_path)
    drafter = llm.engine.speculator.drafter
    checked = []

    class Checked(MedusaDrafter):
        def propose(self, requests):
            draft = MedusaDrafter.propose(self, requests)
            for i, r in enumerate(requests):
                if draft.num_nodes()[i]:
                    assert r.features_start + len(r.features) == len(r.token_ids) - 1
                    checked.append(draft.tokens[i, 0].item() == r.token_ids[-1])
            return draft

    drafter.__class__ = Checked
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    assert len(checked) > 5 and all(checked)


def test_seeded_sampling_repeats(target_dir, head_dir):
    params = SamplingParams(temperature=0.8, max_tokens=16, seed=7, ignore_eos=True)
    llm = medusa(target_dir, head_dir, tree=TREE)
    first = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == first
    chain = medusa(target_dir, head_dir)
    assert chain.generate(PROMPTS[1], params)[0].token_ids == chain.generate(PROMPTS[1], params)[0].token_ids


def test_drafting_deeper_than_the_heads_is_refused(target_dir, head_dir):
    with pytest.raises(SpecdecError, match="num_speculative_tokens=3, but the Medusa head .* has 2 heads"):
        medusa(target_dir, head_dir, num_speculative_tokens=3)
    with pytest.raises(SpecdecError, match="is 3 deep, but the Medusa head .* has 2 heads"):
        medusa(target_dir, head_dir, tree=[[0], [0, 0], [0, 0, 0]])
    medusa(target_dir, head_dir, num_speculative_tokens=5, tree=TREE)  # a tree-only config never drafts k deep
