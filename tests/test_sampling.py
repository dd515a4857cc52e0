"""Sampling: exact masks on hand-made tables, exact distributions, and seeded repeatability."""
from __future__ import annotations

import math

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.sampling import (
    Penalized,
    SamplingTensors,
    apply_min_p,
    apply_top_k,
    apply_top_p,
    keyed_noise,
    keyed_sample,
    logits_to_probs,
    penalize,
    sample_from_probs,
    sampling_key,
)

INF = float("inf")


def tensors(params: list[SamplingParams], seeds: list[int | None] | None = None) -> SamplingTensors:
    gens = [None if s is None else torch.Generator().manual_seed(s) for s in (seeds or [None] * len(params))]
    return SamplingTensors.from_params(params, gens)


def test_top_k_table():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [1.0, 3.0, 2.0, 0.0], [5.0, 5.0, 1.0, 0.0]])
    out = apply_top_k(logits, torch.tensor([2, 0, 1]))
    assert torch.equal(out[0], torch.tensor([-INF, 3.0, 2.0, -INF]))
    assert torch.equal(out[1], logits[1])  # k = 0: off
    assert torch.equal(out[2], torch.tensor([5.0, 5.0, -INF, -INF]))  # ties at the k-th value are kept


@pytest.mark.parametrize("top_p, kept", [(0.7, [0.5, 0.3, 0, 0]), (0.5, [0.5, 0, 0, 0]),
                                         (0.81, [0.5, 0.3, 0.15, 0]), (1.0, [0.5, 0.3, 0.15, 0.05])])
def test_top_p_table(top_p, kept):
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3]])  # unsorted on purpose
    order = [1, 3, 0, 2]  # positions of 0.5, 0.3, 0.15, 0.05
    expected = torch.zeros(1, 4)
    for pos, value in zip(order, kept):
        expected[0, pos] = value
    assert torch.allclose(apply_top_p(probs, torch.tensor([top_p])), expected)


def test_min_p_table():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    assert torch.allclose(apply_min_p(probs, torch.tensor([0.2])), torch.tensor([[0.5, 0.3, 0.15, 0.0]]))
    assert torch.allclose(apply_min_p(probs, torch.tensor([0.0])), probs)


def test_logits_to_probs_combines_and_renormalizes():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    st = tensors([SamplingParams(temperature=1.0, top_p=0.7), SamplingParams(temperature=0)])
    probs = logits_to_probs(logits, st)
    assert torch.allclose(probs[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))
    assert torch.equal(probs[1], torch.tensor([1.0, 0.0, 0.0, 0.0]))  # greedy row: one-hot argmax


def test_temperature_sharpens():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    cold = logits_to_probs(logits, tensors([SamplingParams(temperature=0.5)]))
    assert torch.allclose(cold, torch.softmax(logits / 0.5, -1))


def test_sampling_draws_from_the_distribution():
    """Chi-square goodness of fit over 40k draws; the threshold is the 0.999 quantile for 4 dof."""
    p = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    n = 40_000
    g = torch.Generator().manual_seed(1234)
    draws = sample_from_probs(p.expand(n, 5), [g] * n)
    counts = torch.bincount(draws, minlength=5).double()
    chi2 = (((counts - n * p.double()) ** 2) / (n * p.double())).sum().item()
    assert chi2 < 18.47


@pytest.mark.parametrize("position", [0, 7])
def test_keyed_sampling_draws_from_the_distribution(position):
    """The keyed sampler over many seeds is the distribution: chi-square goodness of fit over 40k seeds at one
    position (0.999 quantile for 5 dof), rows unnormalized as masks leave them, with a zero that is never drawn;
    and pairs of positions of one seed are independent (one key per position, not per seed)."""
    p = torch.tensor([0.4, 0.25, 0.0, 0.2, 0.1, 0.04, 0.01]) * 3.0  # unnormalized, as a masked row
    n = 40_000
    draws = keyed_sample(p.expand(n, 7), [sampling_key(seed, position) for seed in range(n)])
    counts = torch.bincount(draws, minlength=7).double()
    assert counts[2] == 0
    q = (p / p.sum()).double()
    kept = q > 0
    chi2 = (((counts[kept] - n * q[kept]) ** 2) / (n * q[kept])).sum().item()
    assert chi2 < 20.52
    second = keyed_sample(p.expand(n, 7), [sampling_key(seed, position + 1) for seed in range(n)])
    joint = torch.bincount(draws * 7 + second, minlength=49).double().view(7, 7)
    expected = n * q[:, None] * q[None, :]
    big = expected > 20
    chi2 = (((joint[big] - expected[big]) ** 2) / expected[big]).sum().item()
    assert chi2 < 55.0  # ~24 cells, dof <= 23: its 0.9999 quantile is about 55


def test_a_key_decides_its_token_alone():
    """The same (seed, position) gives the same token in any row of any batch; keys are 63-bit generator seeds."""
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(2))
    probs = torch.softmax(logits, -1)
    alone = keyed_sample(probs[3:4], [sampling_key(42, 5)]).item()
    batch = keyed_sample(probs[[0, 3, 1]], [sampling_key(1, 0), sampling_key(42, 5), sampling_key(9, 9)])
    assert batch[1].item() == alone
    assert all(0 <= sampling_key(seed, pos) < 2**63 for seed in (0, -1, 2**70) for pos in (0, 1, 10**9))
    assert sampling_key(3, 4) != sampling_key(4, 3) and sampling_key(3, 4) == sampling_key(3, 4)


def test_the_keyed_race_is_one_function_of_key_and_token_on_every_path():
    """The native kernel (every instruction-set build this CPU runs: 8 lanes, then the scalar tail of widths that are
    no multiple of 8) draws the tokens of the tensor version's noise, row by row; the noise is never 0 or infinite
    (u is a float strictly inside (0, 1): its largest value once rounded up to 1, which made E = 0); a vocabulary-wide
    row over many keys follows its distribution (chi-square, 0.999 quantile), the lanes included."""
    from specdec.models.cpu import native
    assert native.available()
    g = torch.Generator().manual_seed(0)
    from specdec.sampling import _uniform
    extremes = _uniform(torch.tensor([0, 2**32 - 1]))
    assert 0 < extremes[0] and extremes[1] < 1
    noise = keyed_noise([sampling_key(s, 3) for s in range(64)], 49152)
    assert torch.isfinite(noise).all() and (noise > 0).all()
    for width in (1, 7, 8, 9, 33, 1000, 49152):
        probs = torch.softmax(torch.randn(96, width, generator=g) * 3, -1)
        probs[:, ::5] = 0.0  # masked tokens are never drawn
        keys = [sampling_key(s, width) for s in range(96)]
        expected = (probs / keyed_noise(keys, width)).argmax(-1)
        for isa in native.distinct_isas():
            got = native.ops(isa).race_rows(probs, torch.tensor(keys))
            assert torch.equal(got, expected), (isa, width)
            if width > 1:
                assert (got % 5 != 0).all()
    p = torch.rand(24, generator=g) + 0.05  # 24 tokens: three 8-lane blocks
    n = 30_000
    draws = keyed_sample(p.expand(n, 24).contiguous(), [sampling_key(seed, 11) for seed in range(n)])
    counts = torch.bincount(draws, minlength=24).double()
    q = (p / p.sum()).double()
    chi2 = (((counts - n * q) ** 2) / (n * q)).sum().item()
    assert chi2 < 49.73  # 23 dof, 0.999 quantile


def test_a_temperature_alone_is_raced_straight_from_the_logits():
    """A request that sets only a temperature draws from its logits in one native pass (`race_logit_row`, every
    instruction-set build): the token `keyed_sample` draws from softmax(logits / T) with the same key, row by row
    (the vector builds pad the last block, so widths that are no multiple of 8 are covered); -inf logits (a grammar's
    mask) are never drawn; over many keys a row follows softmax(logits / T) (chi-square, 0.999 quantile)."""
    from specdec.models.cpu import native
    from specdec.sampling import keyed_logit_sample
    assert native.available()
    g = torch.Generator().manual_seed(1)
    for width, temperature in ((1, 0.7), (9, 1.0), (33, 0.5), (1000, 1.3), (49152, 0.7)):
        logits = torch.randn(48, width, generator=g) * 3
        logits[:, 1::6] = -INF
        for r in range(48):
            key = sampling_key(r, width)
            expected = int(keyed_sample(torch.softmax(logits[r:r + 1] / temperature, -1), [key])[0])
            for isa in native.distinct_isas():
                got = native.ops(isa).race_logit_row(logits[r], 1.0 / temperature, key)
                if native.ops(isa).isa() != "portable":  # the scalar build's exp may differ in the last bit
                    assert got == expected, (isa, width, r)
                assert width == 1 or got % 6 != 1
            assert keyed_logit_sample(logits[r], temperature, key) == expected
    logits = torch.randn(24, generator=g)
    n = 30_000
    draws = torch.tensor([keyed_logit_sample(logits, 0.8, sampling_key(seed, 2)) for seed in range(n)])
    counts = torch.bincount(draws, minlength=24).double()
    q = torch.softmax(logits.double() / 0.8, -1)
    chi2 = (((counts - n * q) ** 2) / (n * q)).sum().item()
    assert chi2 < 49.73  # 23 dof, 0.999 quantile


def test_zero_probability_tokens_are_never_sampled():
    p = torch.tensor([[0.0, 0.7, 0.0, 0.3]]).expand(5000, 4)
    draws = sample_from_probs(p, [None] * 5000)
    assert set(draws.tolist()) <= {1, 3}


def plain_step_tokens(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
                      output_lens: list[int]) -> torch.Tensor:
    """The tokens a plain step chooses (`token_choice.target_tokens`, the engine's path): one row per sequence,
    sequence i with output_lens[i] tokens generated after a 2-token prompt."""
    from specdec.engine.layout import StepLayout
    from specdec.engine.sequence import Sequence
    from specdec.engine.token_choice import StepDrafts, target_tokens

    seqs = []
    for i, (p, seed, n) in enumerate(zip(params, seeds, output_lens)):
        seq = Sequence(i, [1, 2], p, 100, sampling_seed=seed)
        seq.token_ids = [1, 2] + [3] * n
        seqs.append(seq)
    return target_tokens(seqs, StepDrafts.none(len(seqs)), StepLayout.of_drafts([0] * len(seqs)), logits.clone(),
                         None)


def test_keyed_rows_repeat_and_ignore_their_neighbours():
    """A sampled row's token depends on its seed and output position alone: the same again, beside any rows."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=1.0, seed=7)] * 3
    first = plain_step_tokens(logits, params, [7, 8, 9], [0, 0, 0])
    again = plain_step_tokens(logits[[2, 0, 1]], params, [9, 7, 8], [0, 0, 0])
    assert first.tolist() == again[[1, 2, 0]].tolist()
    later = [plain_step_tokens(logits, params, [7, 8, 9], [n, 0, 0])[0].item() for n in range(20)]
    assert len(set(later)) > 1  # a new position draws new noise


def test_a_seeded_row_draws_the_same_beside_greedy_rows():
    """In a mixed batch only sampled rows draw, each from its own row: a seeded row with top-k gives the same
    token alone and among greedy rows and another sampled one; greedy rows give their argmax."""
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(1))
    seeded = SamplingParams(temperature=0.8, top_k=20, seed=3)
    alone = plain_step_tokens(logits[1:2], [seeded], [3], [5]).item()
    mixed = [SamplingParams(temperature=0), seeded, SamplingParams(temperature=1.0), SamplingParams(temperature=0)]
    out = plain_step_tokens(logits, mixed, [0, 3, 11, 5], [2, 5, 1, 0])
    assert out[1].item() == alone and alone in logits[1].topk(20).indices.tolist()
    assert out[0].item() == logits[0].argmax().item() and out[3].item() == logits[3].argmax().item()


def test_invalid_values_are_refused_with_the_field_named():
    for kwargs, name in [({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"),
                         ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"), ({"min_p": 2.0}, "min_p"),
                         ({"max_tokens": 0}, "max_tokens"), ({"temperature": math.nan}, "temperature"),
                         ({"presence_penalty": 2.5}, "presence_penalty"),
                         ({"frequency_penalty": -3}, "frequency_penalty"),
                         ({"repetition_penalty": 0}, "repetition_penalty"), ({"logit_bias": {3: 101}}, "logit_bias"),
                         ({"logit_bias": {-1: 1.0}}, "logit_bias"), ({"logprobs": 21}, "logprobs"),
                         ({"logprobs": -1}, "logprobs")]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kwargs)


@pytest.mark.parametrize("numpy_devices", [("cpu",), ()], ids=["numpy", "torch"])
def test_penalties_follow_their_definitions_row_by_row(monkeypatch, numpy_devices):
    """OpenAI's frequency and presence penalties over the output so far, vLLM's repetition penalty over the prompt
    and the output, logit_bias added first; a draft row counts the draft tokens on its own path; other rows and
    other requests' rows are untouched."""
    import specdec.sampling

    monkeypatch.setattr(specdec.sampling, "NUMPY_DEVICES", numpy_devices)  # () runs the torch path a GPU takes
    V, prompt, output = 12, [1, 4], [3, 3, 5]
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3,
                            logit_bias={2: 5.0, 7: -100.0})
    paths = [[], [6], [6, 3]]  # the rows after the output, after draft 6, after drafts 6 then 3
    logits = torch.randn(5, V)
    got = logits.clone()
    penalize(got, [Penalized(1, params, prompt, output, paths)])
    assert torch.equal(got[0], logits[0]) and torch.equal(got[4], logits[4])
    for j, path in enumerate(paths):
        want = logits[1 + j].clone()
        want[2] += 5.0
        want[7] -= 100.0
        for t in range(V):
            c = (output + path).count(t)
            if c or t in prompt:
                want[t] = want[t] / 1.3 if want[t] > 0 else want[t] * 1.3
            want[t] -= 0.3 * c + 0.5 * (c > 0)
        torch.testing.assert_close(got[1 + j], want)
    alone = logits[2:3].clone()  # a row alone, as plain decoding after 6 would compute it: the same bits
    penalize(alone, [Penalized(0, params, prompt, output + [6], [[]])])
    assert torch.equal(alone[0], got[2])


def test_seeded_generate_repeats_exactly_even_in_a_batch(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir))
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=42, max_tokens=16, ignore_eos=True)
    alone = llm.generate("Hello world", p)[0].token_ids
    again = llm.generate("Hello world", p)[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    in_batch = llm.generate(["The quick", "Hello world", "1 2 3"], [other, p, other])[1].token_ids
    different_seed = llm.generate("Hello world", SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=43,
                                                                max_tokens=16, ignore_eos=True))[0].token_ids
    assert alone == again == in_batch
    assert different_seed != alone


def test_a_vanishing_temperature_samples_greedily(tiny_llama_dir):
    """A temperature that underflows float32 (a fuzzer sent 6.6e-155) decodes greedily instead of failing."""
    llm = LLM(str(tiny_llama_dir), speculative_config="off")
    greedy = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=6))[0].token_ids
    for t in (6.6e-155, 1e-6):
        assert SamplingParams(temperature=t).greedy
        assert llm.generate("Hello world", SamplingParams(temperature=t, max_tokens=6, seed=1))[0].token_ids == greedy
