"""Scheduler: admission by seats and KV budget, prefill chunks interleaved with decoding, aborts."""
from __future__ import annotations

import pytest

from specdec import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), block_size=4, max_num_seqs=2, max_num_batched_tokens=8)


def test_seats_limit_admission_and_later_requests_wait(llm):
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    seqs = [eng.sequence(eng.add_request([5 + i, 6, 7], params)) for i in range(3)]
    eng.step()
    assert len(eng.scheduler.running) == 2 and len(eng.scheduler.waiting) == 1
    while eng.has_unfinished():
        eng.step()
    assert all(len(s.output_token_ids) == 4 for s in seqs) and eng.allocator.num_used == 0


def test_a_long_prompt_does_not_stall_decoding(llm):
    """While a long prompt is prefilled chunk by chunk, the request already decoding keeps getting tokens."""
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    short = eng.sequence(eng.add_request([5, 6, 7], params))
    eng.step()  # prefill of the short prompt
    long = eng.sequence(eng.add_request(list(range(10, 60)),
                                        SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)))
    gained_while_long_prefills = 0
    while long.num_cached < len(long.prompt_token_ids):
        before = len(short.output_token_ids)
        eng.step()
        gained_while_long_prefills += len(short.output_token_ids) - before
    chunks = -(-len(long.prompt_token_ids) // 8)
    assert gained_while_long_prefills >= chunks - 1  # one decode step between consecutive chunks
    while eng.has_unfinished():
        eng.step()
    alone = llm.generate({"prompt_token_ids": [5, 6, 7]}, params)[0]
    assert short.output_token_ids == alone.token_ids


def test_aborting_waiting_and_running_requests_frees_everything(llm):
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    ids = [eng.add_request(list(range(5, 25)), params) for _ in range(3)]
    seqs = [eng.sequence(i) for i in ids]
    for _ in range(4):
        eng.step()
    for i in ids:
        eng.abort(i)
    assert not eng.has_unfinished() and eng.allocator.num_used == 0
    assert all(s.finish_reason == "abort" for s in seqs)
