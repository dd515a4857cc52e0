"""The measured dispatcher: a speculative config with no dispatch table speculates where its own steps are faster."""
from __future__ import annotations

from specdec import LLM, SamplingParams
from specdec.engine.dispatch import EXPLORE, MAX_EXPLORE, PROBES, WARMUP, MeasuredDispatch


def run(dispatch: MeasuredDispatch, steps: int, batch_size: int, speculative_tok_s: float, plain_tok_s: float
        ) -> list[bool]:
    """Drive `steps` decode steps of a simulated engine whose two sides emit at these rates; the choices made."""
    choices = []
    for _ in range(steps):
        speculates = dispatch.speculates(batch_size)
        assert dispatch.speculates(batch_size) == speculates  # stable until the step is recorded
        tokens = 2 * batch_size if speculates else batch_size
        dispatch.record(batch_size, speculates, tokens, tokens / (speculative_tok_s if speculates else plain_tok_s))
        choices.append(speculates)
    return choices


def test_a_faster_side_is_kept_and_the_other_probed_now_and_then():
    d = MeasuredDispatch()
    wins = run(d, 650, 2, speculative_tok_s=300, plain_tok_s=200)
    assert wins[:WARMUP] == [True] * WARMUP and wins[WARMUP:WARMUP + PROBES] == [False] * PROBES
    assert sum(not c for c in wins[WARMUP + PROBES:]) <= PROBES * (650 // EXPLORE)  # probes only
    d = MeasuredDispatch()
    loses = run(d, 650, 2, speculative_tok_s=150, plain_tok_s=200)
    assert loses[:WARMUP] == [True] * WARMUP and not any(loses[WARMUP:WARMUP + PROBES])
    later = loses[WARMUP + PROBES:]
    assert 0 < sum(later) <= PROBES * 5  # off, but looked at again: after 32, 64, 128, 256 steps
    assert sum(later[-300:]) <= PROBES  # probes grow rarer while they confirm the choice
    assert not d.speculates(2)


def test_batch_sizes_are_decided_apart():
    d = MeasuredDispatch()
    run(d, 200, 2, speculative_tok_s=300, plain_tok_s=200)
    run(d, 200, 16, speculative_tok_s=500, plain_tok_s=800)
    assert d.speculates(2) and not d.speculates(16)
    assert not d.speculates(9)  # 9-16 share a bucket
    assert d.speculates(4)  # a batch size not seen yet starts by speculating
    run(d, 200, 1, speculative_tok_s=100, plain_tok_s=800)
    assert d.speculates(1) and not d.buckets.get(0)  # one sequence always drafts (its own back-off rules there)


def test_a_larger_batch_opens_plain_where_a_smaller_one_found_plain_faster():
    d = MeasuredDispatch()
    run(d, 100, 3, speculative_tok_s=150, plain_tok_s=200)
    choices = run(d, 2 * MAX_EXPLORE, 16, speculative_tok_s=300, plain_tok_s=200)
    first = MAX_EXPLORE // 2
    assert not any(choices[:first]) and all(choices[first:first + PROBES + EXPLORE])  # a probe finds it faster
    assert run(MeasuredDispatch(), 1, 16, speculative_tok_s=150, plain_tok_s=200) == [True]  # no prior: speculate


def test_probes_that_cost_more_come_more_rarely():
    """A speculative probe whose first step pays a long catch-up (a feature head after a plain stretch) waits long
    enough between probes that they cost about BUDGET of the time."""
    def probes(switch_cost: float) -> int:
        d, last, count = MeasuredDispatch(), None, 0
        for _ in range(4000):
            speculates = d.speculates(4)
            pace = 150 if speculates else 200  # tokens/s: plain decoding is faster
            d.record(4, speculates, 4, 4 / pace * (switch_cost if speculates and last is False else 1.0))
            count += speculates and last is False
            last = speculates
        return count

    cheap, costly = probes(1.0), probes(20.0)
    assert costly < cheap and costly <= 4000 // MAX_EXPLORE + 2  # at the longest wait from the first one on


def test_a_change_in_the_traffic_is_followed():
    d = MeasuredDispatch()
    run(d, 200, 3, speculative_tok_s=150, plain_tok_s=200)
    assert not d.speculates(3)
    choices = run(d, 2 * MAX_EXPLORE, 3, speculative_tok_s=400, plain_tok_s=200)  # the prompts start repeating
    first_on = choices.index(True)
    assert first_on <= MAX_EXPLORE and all(choices[first_on:first_on + EXPLORE])  # one probe turns it back on


def test_a_config_without_a_table_measures_both_sides_and_keeps_the_output(tiny_llama_dir):
    """No dispatch table: the engine's decode steps warm up speculating, then probe plain decoding; the tokens are
    those of plain decoding whichever side ran."""
    llm = LLM(str(tiny_llama_dir), speculative_config="off")
    spec = llm.with_speculative_config({"method": "ngram", "num_speculative_tokens": 3,
                                        "prompt_lookup_min": 1})
    prompts = [{"prompt_token_ids": [1, 2, 3, 1, 2, 3, 1, 2]}, {"prompt_token_ids": [5, 6, 7, 5, 6, 7]}]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    measured = spec.engine.speculator.measured
    sides = []  # whether each recorded step of two sequences speculated
    record = measured.record
    measured.record = lambda b, speculated, tokens, seconds: (sides.append(speculated) if b == 2 else None,
                                                              record(b, speculated, tokens, seconds))
    assert [o.token_ids for o in spec.generate(prompts, params)] == \
        [o.token_ids for o in llm.generate(prompts, params)]
    # Both sides measured: the bucket opens speculating, then probes plain (which one wins after that is the
    # machine's to say: a loaded machine may make either faster).
    assert sides[:WARMUP] == [True] * WARMUP and False in sides
    tuned = llm.with_speculative_config({"method": "ngram", "num_speculative_tokens": 3, "dispatch": {"1": "chain"}})
    assert tuned.engine.speculator.measured is None  # a table is followed as written
