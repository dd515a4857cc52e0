"""EAGLE-3 heads: the reference checkpoint layout, and drafting that never changes the output."""
from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from conftest import NEAR_TIE, assert_greedy_equal, every_step, save_tiny_model

from specdec import LLM, SamplingParams, SpecdecError
from specdec.drafting.eagle import EagleDrafter
from specdec.models.heads.eagle3 import Eagle3Head

PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick", "Hello world", "1 2 3 4 5 6 1 2 3"]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("target"), "llama", num_hidden_layers=4)


def random_head(target_config, draft_vocab: int = 100, seed: int = 0) -> Eagle3Head:
    """A head with random weights and a draft vocabulary of `draft_vocab` target tokens (d2t offsets)."""
    g = torch.Generator().manual_seed(seed)
    head = Eagle3Head(dataclasses.replace(target_config, num_hidden_layers=1), draft_vocab, (0, 1, 2))
    for p in head.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    chosen = torch.randperm(target_config.vocab_size, generator=g)[:draft_vocab].sort().values
    head.d2t.copy_(chosen - torch.arange(draft_vocab))
    return head


@pytest.fixture(scope="module")
def head_dir(target_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("head")
    random_head(LLM(str(target_dir)).engine.model.config).save(path)
    return path


def test_checkpoint_round_trip_in_the_reference_layout(target_dir, head_dir):
    from safetensors.torch import load_file

    config = json.loads((head_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 100
    keys = set(load_file(head_dir / "model.safetensors"))
    assert {"fc.weight", "midlayer.hidden_norm.weight", "midlayer.self_attn.q_proj.weight",
            "midlayer.mlp.up_proj.weight",
            "norm.weight", "lm_head.weight", "d2t", "t2d"} <= keys
    target = LLM(str(target_dir)).engine.model.config
    head = Eagle3Head.load(head_dir, target)
    assert load_file(head_dir / "model.safetensors").keys() == head.state_dict_reference().keys()
    for name, t in head.state_dict_reference().items():
        assert torch.equal(t, load_file(head_dir / "model.safetensors")[name]), name
    assert head.aux_layers == (0, 1, 2)
    t2d = load_file(head_dir / "model.safetensors")["t2d"]
    assert t2d.sum() == 100 and t2d[head.target_ids(torch.arange(100))].all()


def test_a_head_for_another_model_is_refused(target_dir, head_dir, tmp_path):
    config = json.loads((head_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_size": 128}))
    shutil.copy(head_dir / "model.safetensors", tmp_path)
    with pytest.raises(SpecdecError, match="hidden size 128"):
        LLM(str(target_dir), speculative_config=every_step({"method": "eagle3", "model": str(tmp_path)}))
    with pytest.raises(SpecdecError, match="not found: no such directory or file, and not a Hub id"):
        LLM(str(target_dir), speculative_config=every_step({"method": "eagle3", "model": str(tmp_path / "nowhere")}))
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecdecError, match=r"has no weights \(\*.safetensors, \*.bin, \*.pt or \*.pth\)"):
        LLM(str(target_dir), speculative_config=every_step({"method": "eagle3", "model": str(tmp_path)}))


DYNAMIC = {"topk": 2, "num_steps": 3, "num_draft_tokens": 5}


@pytest.mark.parametrize("tree", ["chain", "D2-BF2", [[0], [1], [0, 0], [0, 0, 0], [1, 0]], DYNAMIC])
def test_eagle3_greedy_equals_plain(target_dir, head_dir, tree):
    reference = [o.token_ids for o in LLM(str(target_dir)).generate(PROMPTS, GREEDY)]
    llm = LLM(str(target_dir), speculative_config=every_step({"method": "eagle3", "model": str(head_dir),
                                                              "num_speculative_tokens": 3, "tree": tree}))
    outs = llm.generate(PROMPTS, GREEDY)
    assert_greedy_equal(llm, outs, reference)
    assert llm.generate(PROMPTS[1], GREEDY)[0].token_ids == reference[1]
    assert sum(o.metrics["num_draft_tokens"] for o in outs) > 0
    assert llm.engine.allocator.num_used == 0


def test_incremental_drafts_equal_drafts_from_a_fresh_head_cache(target_dir, head_dir):
    """The head's cache, re-aligned from target features each step, holds what a fresh head fed the whole
    history computes: each step's head output at the last committed token equals a from-scratch recomputation
    (to float32 rounding: the fresh head is fed many more rows, so its matmuls take another path), and so does
    the first draft token wherever the head's two best logits are not a near tie."""
    llm = LLM(str(target_dir), speculative_config=every_step({"method": "eagle3", "model": str(head_dir),
                                                              "num_speculative_tokens": 3}))
    drafter = llm.engine.speculator.drafter
    history: dict[int, list[torch.Tensor]] = {}
    compared, first_tokens = [], []

    def catch_up(reqs, greedy):
        roots, first, logp = EagleDrafter._catch_up(drafter, reqs, greedy)
        for r, root in zip(reqs, roots):
            history.setdefault(r.seq_id, []).append(r.features)
            fresh = EagleDrafter(drafter.head, drafter.env, drafter.k)
            full = dataclasses.replace(r, features=torch.cat(history[r.seq_id]), features_start=0)
            again = fresh._catch_up([full], False)[0][0]
            compared.append(torch.allclose(root, again, atol=1e-4, rtol=1e-4))
            logits = drafter.head.compute_logits(torch.stack([root, again]))
            top = logits[1].topk(2).values
            if top[0] - top[1] > NEAR_TIE:
                first_tokens.append(bool(logits[0].argmax() == logits[1].argmax()))
        return roots, first, logp

    drafter._catch_up = catch_up
    llm.generate(PROMPTS, GREEDY)
    assert len(compared) > 10 and all(compared)
    assert len(first_tokens) > 10 and all(first_tokens)


def test_eagle3_tree_nodes_follow_the_heads_own_chain(target_dir, head_dir):
    """The rank-0 path of a tree is the chain the head drafts: each node is fed its parent's output."""
    llm = LLM(str(target_dir), speculative_config=every_step({"method": "eagle3", "model": str(head_dir),
                                                              "num_speculative_tokens": 3, "tree": "D3-BF2"}))
    drafter = llm.engine.speculator.drafter
    seen = []

    original = type(drafter).propose

    def propose(self, requests):
        tree = original(self, requests)
        chain_requests = [dataclasses.replace(r, tree=None, max_tokens=3) for r in requests]
        # replay the same catch-up (features are consumed by the call above, so hand them over again)
        chain = original(self, chain_requests)
        for i in range(len(requests)):
            if tree.num_nodes()[i] >= 14 and chain.num_nodes()[i] == 3:
                path = [0, 2, 6]  # D3-BF2 node order: [0], [1], [0,0], [0,1], [1,0], [1,1], [0,0,0], ...
                seen.append(tree.tokens[i, path].tolist() == chain.tokens[i, :3].tolist())
        return tree

    type(drafter).propose = propose
    try:
        llm.generate(PROMPTS, GREEDY)
    finally:
        type(drafter).propose = original
    assert len(seen) > 5 and all(seen)


def test_a_dynamic_tree_keeps_only_nodes_the_head_rates_at_least_min_prob(target_dir, head_dir):
    """EAGLE-2 trees sized by min_prob: every node kept is one whose path the head gives at least min_prob (its
    probabilities recomputed from the head's own outputs); min_prob 1 drafts nothing; output equals plain."""
    reference = [o.token_ids for o in LLM(str(target_dir)).generate(PROMPTS, GREEDY)]
    drafted = {}
    for min_prob in (0.0, 0.05, 1.0):
        llm = LLM(str(target_dir), speculative_config=every_step({"method": "eagle3", "model": str(head_dir),
                                                                  "num_speculative_tokens": 5, "tree": DYNAMIC,
                                                                  "min_prob": min_prob}))
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == reference
        drafted[min_prob] = sum(o.metrics["num_draft_tokens"] for o in outs)
    assert drafted[1.0] == 0 < drafted[0.05] < drafted[0.0]


def test_dynamic_tree_paths_are_the_heads_most_probable(target_dir, head_dir):
    """With topk 1 a dynamic tree is the head's greedy chain: each node fed its parent's output."""
    def drafts(tree):
        llm = LLM(str(target_dir), speculative_config=every_step({"method": "eagle3", "model": str(head_dir),
                                                                  "num_speculative_tokens": 3, "tree": tree}))
        seen = []
        propose = llm.engine.speculator.drafter.propose

        def recording(requests):
            draft = propose(requests)
            seen.append([draft.tokens[i, :n].tolist() for i, n in enumerate(draft.num_nodes())])
            return draft

        llm.engine.speculator.drafter.propose = recording
        llm.generate(PROMPTS, GREEDY)
        return seen

    chain = drafts("chain")
    assert drafts({"topk": 1, "num_steps": 3, "num_draft_tokens": 3}) == chain
    assert sum(len(row) for step in chain for row in step) > 10


@pytest.mark.parametrize("quantization, expected", [(None, "q8_0"), ("none", None), ("q4_0", "q4_0")])
def test_a_head_computes_on_blocks_when_the_target_does(tmp_path_factory, quantization, expected):
    """By default ("auto") a head drafting for a target on quantized blocks is quantized to q8_0 (the same
    acceptance as float32 at about half the draft time); "none" keeps its float weights; output equals plain."""
    from specdec.models.formats.quant import QuantWeight

    target = save_tiny_model(tmp_path_factory.mktemp("blocks"), "llama", num_hidden_layers=4, intermediate_size=128)
    plain = LLM(str(target), quantization="q8_0", speculative_config="off")
    head_dir = tmp_path_factory.mktemp("blocks-head")
    random_head(plain.engine.model.config).save(head_dir)
    spec = {"method": "eagle3", "model": str(head_dir), "num_speculative_tokens": 3}
    llm = plain.with_speculative_config(every_step(spec if quantization is None else {**spec,
                                                   "quantization": quantization}))
    head = llm.engine.speculator.drafter.head
    formats = {f for w in (head.fc.weight, head.lm_head) if isinstance(w, QuantWeight) for f in w.formats}
    assert formats == ({expected} if expected else set())
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == \
        [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("quantization", ["none", "q8_0"])
def test_the_native_draft_step_gives_the_op_by_op_steps_bits(tmp_path_factory, quantization):
    """`Eagle3Head.draft_step` runs fc, the layer, the final norm, the LM head and the argmax as one C++ call (one
    thread team for a few rows, a parallel region per product above): the same output rows and draft tokens as
    `forward`, `compute_logits` and argmax one op at a time, from features (a catch-up) and from the head's own
    output (a chain's next step), in a head cache written either way."""
    from specdec.models.cpu import native

    target = save_tiny_model(tmp_path_factory.mktemp("step"), "llama", num_hidden_layers=4, intermediate_size=128)
    plain = LLM(str(target), quantization="q8_0", speculative_config="off")
    head_dir = tmp_path_factory.mktemp("step-head")
    random_head(plain.engine.model.config).save(head_dir)
    llm = plain.with_speculative_config(every_step({"method": "eagle3", "model": str(head_dir),
                                                    "num_speculative_tokens": 2,
                                                    "quantization": quantization}))
    drafter = llm.engine.speculator.drafter
    head, env = drafter.head, drafter.env
    assert head.native_step() is not None
    g = torch.Generator().manual_seed(0)
    table = list(range(1, 9))  # blocks of the drafter's own pool, written by this test only
    for cache in (*drafter.kv.k, *drafter.kv.v):  # the 3 tokens of context before the rows are read, never written:
        cache.zero_()  # zeros, not what the pool's memory held (a NaN there made both sides NaN)
    ops, before = native.ops(), native.ops().team_max_rows()
    try:
        for n, team in ((1, 16), (5, 16), (5, 0), (20, 16)):  # rows, and whether few rows run as one team
            ops.team_max_rows(team)
            tokens = torch.randint(0, 320, (n,), generator=g).tolist()
            features = torch.randn(n, 3 * head.config.hidden_size, generator=g)
            hidden = torch.randn(n, head.config.hidden_size, generator=g)
            for kwargs in ({"features": features}, {"hidden": hidden}):
                got, want = [], []
                for out in (got, want):
                    ids, positions, meta = env.inputs([table], [3], [tokens])
                    embeds = drafter.embed(ids)
                    if out is got:
                        out.extend(head.draft_step(embeds, positions, meta, drafter.kv, [n - 1, 0], **kwargs))
                    else:
                        rows = head.forward(embeds, positions, meta, drafter.kv, **kwargs)
                        logits = head.compute_logits(rows[[n - 1, 0]])
                        best = logits.argmax(-1)
                        out.extend([rows, head.target_ids(best), torch.log_softmax(logits, -1)[[0, 1], best]])
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
                assert torch.allclose(got[2], want[2], atol=1e-5)  # what a chain's stopping rule reads
    finally:
        ops.team_max_rows(before)


def record_logprobs(drafter: EagleDrafter, seen: list) -> None:
    """Make each head step of `drafter` also append its drafts' log-probabilities to `seen`."""
    step = drafter._step

    def record_step(*args, **kwargs):
        out = step(*args, **kwargs)
        seen.append(out[2].tolist())
        return out

    drafter._step = record_step


def test_a_chain_stops_before_the_draft_whose_path_probability_falls_under_min_prob(target_dir, head_dir):
    """`min_prob` on a chain: a request's chain keeps its drafts while the product of the head's probabilities
    along it is at least min_prob (SpecDec++'s rule), none where even the first is under it; outputs unchanged."""
    def run(min_prob: float):
        llm = LLM(str(target_dir), speculative_config=every_step({
            "method": "eagle3", "model": str(head_dir), "num_speculative_tokens": 4, "min_prob": min_prob}))
        drafter = llm.engine.speculator.drafter
        logps, drafts = [], []
        record_logprobs(drafter, logps)
        propose = drafter.propose

        def record_propose(requests):
            draft = propose(requests)
            drafts.append(draft.host_rows()[0])
            return draft

        drafter.propose = record_propose
        return llm.generate(PROMPTS[0], GREEDY)[0].token_ids, logps, drafts

    plain = LLM(str(target_dir), speculative_config="off").generate(PROMPTS[0], GREEDY)[0].token_ids
    free, logps, drafts = run(0.0)
    assert free == plain and len(drafts[0][0]) == 4
    path = torch.tensor([lp[0] for lp in logps[:4]]).cumsum(0)  # the first chain's log path probabilities
    assert (path.diff() < -1e-3).all()  # every draft is less than certain: each cut below is a real one
    for keep in (1, 2, 3):
        cut, cut_logps, cut_drafts = run(float(path[keep - 1].exp()) * 0.999)
        assert cut == plain and cut_drafts[0][0] == drafts[0][0][:keep], keep
    none, _, nothing = run(1.0)
    assert none == plain and all(chain == [] for d in nothing for chain in d)


def test_a_chain_gives_its_path_probabilities_to_a_hybrid(target_dir, head_dir):
    """In a hybrid, the head's chain carries each node's path probability under the head (its belief b), what
    the hybrid's calibrated scores start from; outputs stay plain decoding's."""
    llm = LLM(str(target_dir), speculative_config=every_step({"method": "hybrid", "num_speculative_tokens": 3,
                                                              "min_score": 0.0, "sources": [
        {"method": "eagle3", "model": str(head_dir), "num_speculative_tokens": 3}]}))
    drafter = llm.engine.speculator.drafter.sources[0].drafter
    assert drafter.path_scores
    seen, chains = [], []
    record_logprobs(drafter, seen)
    chain = drafter._chain

    def record_chain(*args):
        seen.clear()
        seen.append(args[-1].tolist())  # the catch-up's log-probabilities
        draft = chain(*args)
        path = torch.tensor([lp[0] for lp in seen]).cumsum(0).exp()
        assert torch.allclose(draft.scores[args[1][0], :len(path)], path, rtol=1e-5)
        chains.append(len(path))
        return draft

    drafter._chain = record_chain
    plain = LLM(str(target_dir), speculative_config="off").generate(PROMPTS[0], GREEDY)[0].token_ids
    assert llm.generate(PROMPTS[0], GREEDY)[0].token_ids == plain
    assert chains and max(chains) == 3  # the head drafted whole chains, each checked


def eagle3_formula(sd: dict[str, torch.Tensor], cfg, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """The published EAGLE-3 head over one sequence, written from its checkpoint's tensors alone (the reference
    layout, HF Llama RoPE and RMSNorm): logits over the draft vocabulary [T, draft_vocab]."""
    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w

    def rope(x, pos):  # [T, h, D], rotate_half
        D = x.shape[-1]
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
        ang = torch.cat([pos[:, None] * inv] * 2, -1)[:, None, :]
        x1, x2 = x[..., :D // 2], x[..., D // 2:]
        return x * ang.cos() + torch.cat([-x2, x1], -1) * ang.sin()

    T, D = embeds.shape[0], cfg.head_dim
    h = features @ sd["fc.weight"].T
    x = torch.cat([rms(embeds, sd["midlayer.input_layernorm.weight"]), rms(h, sd["midlayer.hidden_norm.weight"])], -1)
    pos = torch.arange(T, dtype=torch.float32)
    q = rope((x @ sd["midlayer.self_attn.q_proj.weight"].T).view(T, -1, D), pos)
    k = rope((x @ sd["midlayer.self_attn.k_proj.weight"].T).view(T, -1, D), pos)
    v = (x @ sd["midlayer.self_attn.v_proj.weight"].T).view(T, -1, D)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / D ** 0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(T, -1)
    h = h + attn @ sd["midlayer.self_attn.o_proj.weight"].T
    n = rms(h, sd["midlayer.post_attention_layernorm.weight"])
    mlp = (F.silu(n @ sd["midlayer.mlp.gate_proj.weight"].T) * (n @ sd["midlayer.mlp.up_proj.weight"].T))
    out = h + mlp @ sd["midlayer.mlp.down_proj.weight"].T
    return rms(out, sd["norm.weight"]) @ sd["lm_head.weight"].T


@pytest.mark.parametrize("planted", [False, True])
def test_the_head_computes_the_published_formula(target_dir, monkeypatch, planted):
    """The head's logits (through the serving layers, `unroll`) against the formula above from its saved tensors;
    and its greedy draft per row is the formula's argmax mapped through d2t. Planted: the two halves of the
    attention input swapped (hidden state first); output equality could never show it (verification corrects any
    draft), the formula does."""
    config = LLM(str(target_dir), speculative_config="off").engine.model.config
    head = random_head(config, seed=5)
    sd = {name: t.float() for name, t in head.state_dict_reference().items()}
    g = torch.Generator().manual_seed(6)
    T, H = 7, config.hidden_size
    embeds, features = torch.randn(T, H, generator=g), torch.randn(T, 3 * H, generator=g)
    if planted:
        real = head.midlayer.project_inputs
        monkeypatch.setattr(head.midlayer, "project_inputs", lambda e, x, cos, sin: real(x, e, cos, sin))
    with torch.no_grad():
        got = head.compute_logits(head.unroll(embeds, features, 1)[0])
    want = eagle3_formula(sd, dataclasses.replace(config, num_hidden_layers=1), embeds, features)
    assert torch.allclose(got, want, atol=1e-3, rtol=1e-3) != planted
    if not planted:
        drafted = head.target_ids(got.argmax(-1))
        assert torch.equal(drafted, want.argmax(-1) + sd["d2t"].long()[want.argmax(-1)])
