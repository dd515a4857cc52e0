"""Prefix caching: full blocks outlive their request, a later request with the same prefix reuses them
(target and draft K/V together), and reuse never changes a token."""
from __future__ import annotations

import pytest
from conftest import assert_greedy_equal, every_step

from specdec import LLM, SamplingParams
from specdec.drafting import Draft, Drafter
from specdec.kv_cache import BlockAllocator, BlockTable

SYSTEM = list(range(20, 60))  # a 40-token shared "system prompt": 10 full blocks of 4


def test_freed_full_blocks_are_found_again_by_prefix():
    alloc = BlockAllocator(num_blocks=12, block_size=4, enable_prefix_caching=True)
    tokens = list(range(10, 21))  # 11 tokens: 2 full blocks and a partial one
    t = BlockTable()
    assert alloc.admit(t, tokens, max_new=100) == 0
    alloc.register(t, tokens, len(tokens))
    first_two = t.blocks[:2]
    alloc.free(t)
    assert alloc.num_used == 0 and alloc.num_cached_free == 2  # kept, but evictable

    again = BlockTable()
    assert alloc.admit(again, tokens + [99], max_new=100) == 8
    assert again.blocks[:2] == first_two and alloc.num_cached_free == 0
    other = BlockTable()  # same second block, different first block: the chained key does not match
    assert alloc.admit(other, [0, 0, 0, 0] + tokens[4:], max_new=100) == 0
    assert alloc.prefix_hit_tokens == 8


def test_blocks_for_a_head_that_reads_the_next_token_match_one_token_further():
    """EAGLE's K/V at a block's last slot encode the token after the block: with match_next_token a cached
    block is reused only by a prefix that goes on with the token that followed it when it was registered."""
    alloc = BlockAllocator(num_blocks=12, block_size=4, enable_prefix_caching=True, match_next_token=True)
    tokens = list(range(10, 20))  # blocks [10..13] (followed by 14) and [14..17] (followed by 18)
    t = BlockTable()
    alloc.admit(t, tokens, 100)
    alloc.register(t, tokens, 8)
    alloc.free(t)
    hits = []
    for prompt in (tokens, tokens[:8] + [99, 5], tokens[:4] + [99, 15, 16, 17, 18], tokens[:8]):
        t = BlockTable()
        hits.append(alloc.admit(t, prompt, 100))
        alloc.free(t)
    # the same prompt: both; another token after block 2: block 1 only; another token after block 1: none;
    # 8 tokens: the last one is fed, so block 1 only
    assert hits == [8, 4, 0, 4]
    plain = BlockAllocator(num_blocks=12, block_size=4, enable_prefix_caching=True)
    t = BlockTable()
    plain.admit(t, tokens, 100)
    plain.register(t, tokens, 8)
    plain.free(t)
    assert plain.admit(BlockTable(), tokens[:8] + [99, 5], 100) == 8  # without the rule, both blocks


def test_a_prompt_that_is_all_cached_still_feeds_its_last_token():
    alloc = BlockAllocator(num_blocks=8, block_size=4, enable_prefix_caching=True)
    tokens = list(range(8))
    t = BlockTable()
    alloc.admit(t, tokens, 100)
    alloc.register(t, tokens, 8)
    alloc.free(t)
    t = BlockTable()
    assert alloc.admit(t, tokens, 100) == 4  # block 2 holds the last token, which must produce logits


def test_cached_blocks_are_evicted_least_recently_used_first():
    alloc = BlockAllocator(num_blocks=7, block_size=2, enable_prefix_caching=True)  # 6 usable blocks
    for prompt in ([1, 2, 9], [3, 4, 9], [5, 6, 9]):
        t = BlockTable()
        alloc.admit(t, prompt, 100)
        alloc.register(t, prompt, 2)
        alloc.free(t)
    assert alloc.num_cached_free == 3 and alloc.num_free == 6
    t = BlockTable()
    alloc.admit(t, [1, 2, 9], 100)  # touches [1, 2]: now the most recently used
    alloc.free(t)
    t = BlockTable()
    alloc.allocate(t, 8)  # 3 free blocks, then evicts the oldest cached one, [3, 4]
    alloc.free(t)
    hits = []
    for prompt in ([1, 2, 9], [3, 4, 9], [5, 6, 9]):
        t = BlockTable()
        hits.append(alloc.admit(t, prompt, 100))
        alloc.free(t)
    assert hits == [2, 0, 2]


def test_admission_without_room_changes_nothing():
    alloc = BlockAllocator(num_blocks=3, block_size=4, enable_prefix_caching=True)
    t = BlockTable()
    assert alloc.admit(t, list(range(12)), 100) is None
    assert t.blocks == [] and alloc.num_free == 2 and alloc.prefix_queried_tokens == 0


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3},
                                  {"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 3},
                                  "draft_model"])
def test_prefix_hits_give_identical_outputs_and_skip_prefill(tiny_llama_dir, spec):
    if spec == "draft_model":
        spec = {"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 3}
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [{"prompt_token_ids": SYSTEM + [100 + i, 101 + i, 102]} for i in range(3)]
    cold = LLM(str(tiny_llama_dir), block_size=4, speculative_config=spec, enable_prefix_caching=False)
    expected = [o.token_ids for o in cold.generate(prompts, params)]

    warm = LLM(str(tiny_llama_dir), block_size=4, speculative_config=spec)
    first = warm.generate(prompts[0], params)[0]
    rest = [warm.generate(p, params)[0] for p in prompts[1:]]
    assert [o.token_ids for o in [first] + rest] == expected
    assert first.metrics["num_cached_tokens"] == 0
    assert [o.metrics["num_cached_tokens"] for o in rest] == [len(SYSTEM)] * 2
    eng = warm.engine
    assert eng.allocator.num_used == 0 and eng.stats()["kv_blocks_used"] == eng.allocator.num_cached_free > 0


def test_draft_model_reuses_its_own_cached_kv(tiny_llama_dir, monkeypatch):
    """Target and draft caches hit together: after a hit the draft model does not prefill the prefix again."""
    spec = every_step({"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 2})
    llm = LLM(str(tiny_llama_dir), block_size=4, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm.generate({"prompt_token_ids": SYSTEM + [7]}, params)
    drafter = llm.engine.speculator.drafter
    fed = []
    run = drafter.run
    monkeypatch.setattr(drafter, "run", lambda t, s, f, *a, **k: fed.append((s, f)) or run(t, s, f, *a, **k))
    llm.generate({"prompt_token_ids": SYSTEM + [8, 9]}, params)
    starts, feeds = fed[0]  # the first catch-up of the second request: its prompt after the prefix, and the
    assert starts == [len(SYSTEM)] and feeds[0][:2] == [8, 9] and len(feeds[0]) == 3  # token prefill sampled


def test_preempted_sequences_resume_from_their_cached_blocks(tiny_llama_dir):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(10 + 7 * i, 30 + 7 * i))} for i in range(4)]
    roomy = LLM(str(tiny_llama_dir), block_size=4).generate(prompts, params)
    tight = LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=24)
    outs = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.stats()["prefix_cache_hit_tokens"] > 0  # recomputes started from cached blocks
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    assert tight.engine.allocator.num_used == 0


def eagle3_head_dir(target_dir, path):
    import dataclasses

    import torch

    from specdec.models.heads.eagle3 import Eagle3Head

    config = LLM(str(target_dir)).engine.model.config
    g = torch.Generator().manual_seed(0)
    head = Eagle3Head(dataclasses.replace(config, num_hidden_layers=1), config.vocab_size, (0, 1, 1))
    for p in head.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    head.save(path)
    return path


def test_feature_heads_reuse_cached_prefixes_with_identical_drafts(tiny_llama_dir, tmp_path):
    """EAGLE-3 with prefix caching: a shared system prompt is a cache hit for target and head alike (neither
    recomputes it), and the drafts are the ones a cold engine drafts. A hit prefills only the prompt's few new
    tokens where the cold engine prefills all of them through torch's GEMM (float32 summed in another order),
    so after the first request the outputs are compared up to near ties and the drafts to 90%."""
    spec = every_step({"method": "eagle3", "model": str(eagle3_head_dir(tiny_llama_dir, tmp_path)),
                       "num_speculative_tokens": 3})
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": SYSTEM + [100 + i, 101 + i, 102]} for i in range(3)]
    plain = [o.token_ids for o in LLM(str(tiny_llama_dir), block_size=4).generate(prompts, params)]

    def run(**kw):
        llm = LLM(str(tiny_llama_dir), block_size=4, speculative_config=spec, **kw)
        drafter, drafts = llm.engine.speculator.drafter, []
        propose = drafter.propose

        def recorded(requests):
            draft = propose(requests)
            drafts.append((draft.tokens.tolist(), draft.parents.tolist()))
            return draft

        drafter.propose = recorded
        outs = []
        for p in prompts:
            outs.append(llm.generate(p, params)[0])
            drafts.append(None)  # the end of a request's drafts
        return llm, outs, drafts

    cold_llm, cold, cold_drafts = run(enable_prefix_caching=False)
    warm_llm, warm, warm_drafts = run()
    assert [o.token_ids for o in cold] == plain
    assert_greedy_equal(warm_llm, warm, plain)
    # the head's row at the system prompt's last slot holds the token after it, which differs per prompt: the
    # hit stops one block short
    assert [o.metrics["num_cached_tokens"] for o in warm] == [0, len(SYSTEM) - 4, len(SYSTEM) - 4]
    first = cold_drafts.index(None)
    assert warm_drafts[:first] == cold_drafts[:first]  # the first request: no hit, the same computation
    same = sum(w == c for w, c in zip(warm_drafts[first:], cold_drafts[first:]))
    assert len(warm_drafts) > 10 and same >= 0.9 * (len(cold_drafts) - first)
    assert warm_llm.engine.allocator.num_used == 0


def test_a_block_is_not_reused_before_another_next_token_by_a_feature_head(tiny_llama_dir):
    class FeatureDrafter(Drafter):
        feature_layers = (0,)
        cache_reads_next_token = True

        def propose(self, requests):
            return Draft.chains([[] for _ in requests])

    llm = LLM(str(tiny_llama_dir), block_size=4, speculative_config={"method": "custom", "drafter": FeatureDrafter()})
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate({"prompt_token_ids": SYSTEM + [7, 8]}, params)
    assert llm.engine.allocator.match_next_token
    out = llm.generate({"prompt_token_ids": SYSTEM[:36] + [9, 9, 9, 9, 9]}, params)[0]
    assert out.metrics["num_cached_tokens"] == 32  # block 9 ends the shared part, and another token follows it


@pytest.mark.parametrize("spec", [None, "draft_model"])
def test_choices_of_one_prompt_share_its_blocks(tiny_llama_dir, spec):
    """n > 1: the later choices, queued together with the first, wait for its prefill and take its prompt blocks
    (target and draft K/V) from the cache; each decodes as it would alone, and every block comes back."""
    if spec == "draft_model":
        spec = {"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 3}
    llm = LLM(str(tiny_llama_dir), block_size=4, speculative_config=spec)
    eng = llm.engine
    prompt = SYSTEM + [100, 101, 102]
    temperature = 1.0 if spec is None else 0.0  # sampled speculation repeats only in the same batches
    choices = [SamplingParams(temperature=temperature, seed=7 + j, max_tokens=12, ignore_eos=True) for j in range(4)]
    alone = [LLM(str(tiny_llama_dir), block_size=4, speculative_config=spec,
                 enable_prefix_caching=False).generate({"prompt_token_ids": prompt}, p)[0].token_ids for p in choices]
    first_id = eng.add_request(prompt, choices[0])
    first = eng.sequence(first_id)
    rest = [eng.sequence(eng.add_request(prompt, p, share_prompt_with=first_id)) for p in choices[1:]]
    seqs = [first] + rest
    while eng.has_unfinished():
        eng.step()
    assert [s.output_token_ids for s in seqs] == alone
    assert first.num_prefix_hit == 0 and [s.num_prefix_hit for s in rest] == [len(SYSTEM)] * 3
    assert eng.allocator.num_used == 0


def test_a_choice_shares_nothing_without_the_prefix_cache_and_still_runs(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), block_size=4, enable_prefix_caching=False)
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    first_id = eng.add_request(SYSTEM, params)
    first = eng.sequence(first_id)
    other = eng.sequence(eng.add_request(SYSTEM, params, share_prompt_with=first_id))
    while eng.has_unfinished():
        eng.step()
    assert other.output_token_ids == first.output_token_ids and other.num_prefix_hit == 0


@pytest.mark.parametrize("which", ["head_off", "switch"])
def test_a_feature_drafter_that_drafts_nothing_still_lets_prompts_share_blocks(tiny_llama_dir, tmp_path, which):
    """A head whose steps draft nothing (a dispatch table that says off, or a switch whose n-gram drafts every
    step) still takes the target's features (`Speculator.catch_up`: every CATCH_UP_ROWS rows, the rest at the end),
    so its K/V follows each sequence and a shared system prompt is a cache hit, as with a head that drafts."""
    head = str(eagle3_head_dir(tiny_llama_dir, tmp_path))
    eagle = {"method": "eagle3", "model": head, "num_speculative_tokens": 1}
    spec = {**eagle, "dispatch": {"1": "off"}} if which == "head_off" else {
        "method": "switch", "num_speculative_tokens": 3, "head_cost": 1.0, "dispatch": {"1": "chain"},
        "sources": [{"method": "ngram", "num_speculative_tokens": 3}, eagle]}
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": SYSTEM + [100 + i, 101 + i, 102]} for i in range(3)]
    plain = [o.token_ids for o in LLM(str(tiny_llama_dir), block_size=4).generate(prompts, params)]
    llm = LLM(str(tiny_llama_dir), block_size=4, speculative_config=spec)
    outs = [llm.generate(p, params)[0] for p in prompts]
    assert_greedy_equal(llm, outs, plain)
    # as for a head that drafts: the head's row at the system prompt's last slot holds the token after it
    assert [o.metrics["num_cached_tokens"] for o in outs] == [0, len(SYSTEM) - 4, len(SYSTEM) - 4]
    assert llm.engine.allocator.num_used == 0
