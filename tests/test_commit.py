"""The commit as one ordered pass (`specdec/engine/commit.py`): what a sequence keeps of a step is decided once
(grammar, stop token or end-of-sequence, max_tokens or the context, stop string), and the counts follow that one
record. Every kind of stop landing inside an accepted draft leaves the same output, counts and prefix-cache keys as
plain decoding, and every block goes back; an invariant checked after every step catches a count taken before the
stops."""
from __future__ import annotations

import pytest
import torch
import transformers
from conftest import every_step
from test_speculative import PROMPTS, PairingDrafter, ScriptedDrafter

from specdec import LLM, SamplingParams
from specdec.engine import llm_engine
from specdec.engine.commit import GRAMMAR_DONE, StepOutput, keep
from specdec.engine.outputs import OutputProcessor
from specdec.engine.sequence import Sequence
from specdec.kv_cache import NULL_BLOCK

K = 5  # draft tokens per step: the first decode step's accepted draft holds output tokens 1 .. 5 (0: prefill's)


# ---- the invariant, checked after every step ------------------------------------------------------------------
def check_commit(engine, before: list[Sequence], updates) -> None:
    """After a step, for the sequences running or waiting before it: one that emitted or stopped in it caches all
    its tokens but its last; a running one holds exactly the blocks of its cached tokens, keys only full cached
    blocks, and (with a feature drafter) has features waiting for exactly its cached tokens not yet handed over; a
    waiting or finished one holds no block; the allocator's references are exactly the running sequences' blocks."""
    alloc, by_id = engine.allocator, {s.seq_id: s for s in before}
    for u in updates:
        seq = by_id[u.request_id]
        if seq.finish_reason in (None, "stop", "length"):  # not a failed step's ("error")
            assert seq.num_cached == len(seq.token_ids) - 1, \
                f"request {seq.seq_id} caches {seq.num_cached} tokens of {len(seq.token_ids)}"
    for seq in before:
        if seq in engine.scheduler.running:
            assert 0 <= seq.num_cached < len(seq.token_ids), (seq.num_cached, len(seq.token_ids))
            assert len(seq.block_table.blocks) == -(-seq.num_cached // alloc.block_size)
            assert len(seq.block_table.keys) <= seq.num_cached // alloc.block_size
            if engine.feature_layers and seq.pending_features:
                assert sum(len(f) for f in seq.pending_features) == seq.num_cached - seq.features_start
        else:
            assert not seq.block_table.blocks, f"request {seq.seq_id} ({seq.status}) holds blocks"
    held = [b for s in engine.scheduler.running for b in s.block_table.blocks if b != NULL_BLOCK]
    assert sum(alloc.ref_count) == len(held) and alloc.num_used == len(set(held)), "blocks leaked"


def checked(llm: LLM) -> LLM:
    """The engine's `step` checks the commit's invariant after each step."""
    engine, step = llm.engine, llm.engine.step

    def checked_step():
        before = [*engine.scheduler.running, *engine.scheduler.waiting]
        updates = step()
        check_commit(engine, before, updates)
        return updates

    engine.step = checked_step
    return llm


# ---- `keep` on a bare sequence: each kind of stop inside the emitted tokens -------------------------------------
@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)


class EndingGrammar:
    """A grammar that accepts `length` more tokens, then none (as past its end under ignore_eos)."""

    def __init__(self, length: int) -> None:
        self.length, self.dead = length, length == 0

    def accept(self, token: int) -> bool:
        assert not self.dead, "no token is offered to a grammar that ended"
        self.length -= 1
        self.dead = self.length < 0
        return not self.dead


def decoding(tokenizer) -> tuple[list[int], list[int], str, str]:
    """A sequence's tokens in its decode steps (a prompt and one output token), the 5 tokens a step with 4 accepted
    drafts then emits, the text the third of them adds (a stop string only it completes) and the output text
    before it."""
    ids = tokenizer.encode("Hello world, speculative decoding is fast.")
    tokens, emitted = ids[:5], ids[5:10]
    before, after = (tokenizer.decode(ids[4:4 + n], skip_special_tokens=True) for n in (3, 4))
    piece = after[len(before):]
    assert piece.strip() and piece not in before and emitted[2] not in emitted[:2] and 2 not in emitted
    return tokens, emitted, piece, before


@pytest.mark.parametrize("kind", ["none", "stop token", "eos", "eos ignored", "stop string", "max_tokens",
                                  "context", "grammar ended", "grammar ends"])
def test_keep_cuts_the_emitted_tokens_at_the_first_stop_and_counts_only_what_it_kept(tokenizer, kind):
    tokens, emitted, piece, text_before = decoding(tokenizer)
    params, grammar, max_len = {}, None, 64
    kept_n, reason, why = {"none": (5, None, None), "stop token": (3, "stop", emitted[2]), "eos": (2, "stop", 2),
                           "eos ignored": (5, None, None), "stop string": (3, "stop", piece),
                           "max_tokens": (3, "length", None), "context": (4, "length", None),
                           "grammar ended": (0, "stop", GRAMMAR_DONE), "grammar ends": (2, "stop", GRAMMAR_DONE)}[kind]
    if kind == "stop token":
        params = {"stop_token_ids": [emitted[2]]}
    elif kind.startswith("eos"):
        emitted[1] = 2
        params = {"ignore_eos": kind == "eos ignored"}
    elif kind == "stop string":
        params = {"stop": [piece]}
    elif kind == "max_tokens":
        params = {"max_tokens": 1 + 3}
    elif kind == "context":
        max_len = len(tokens) + 4
    elif kind.startswith("grammar"):
        grammar = EndingGrammar(0 if kind == "grammar ended" else 2)
    seq = Sequence(0, tokens[:-1], SamplingParams(**{"temperature": 0, "max_tokens": 16, **params}), max_len,
                   frozenset({2}), token_ids=list(tokens), num_cached=len(tokens) - 1, grammar=grammar)
    start, outputs = seq.num_cached, OutputProcessor(tokenizer)
    features = torch.arange(5.0)[:, None]  # the fed token's row, then the 4 accepted drafts'
    out = StepOutput(1, list(emitted), features, [f"logprob {i}" for i in range(5)])
    k = keep(seq, out, outputs)
    assert k.tokens == emitted[:kept_n] and seq.token_ids == tokens + k.tokens
    assert (k.finish_reason, k.stop_reason) == (reason, why)
    assert start + k.num_cached == len(seq.token_ids) - 1  # all its tokens but the last
    assert torch.equal(k.features, features[:k.num_cached]) and k.logprobs == seq.logprobs == out.logprobs[:kept_n]
    if kind == "stop string":
        seq.finish("stop", piece)
        assert outputs.output(seq).text == text_before  # cut before the stop string


def test_a_prefill_chunk_keeps_its_fed_tokens_and_its_last_chunk_all_but_its_token(tokenizer):
    seq = Sequence(0, list(range(10, 30)), SamplingParams(temperature=0), 64)
    outputs = OutputProcessor(tokenizer)
    chunk = keep(seq, StepOutput(12, None, torch.zeros(12, 1)), outputs)
    assert (chunk.num_cached, chunk.tokens, len(chunk.features), seq.num_steps) == (12, None, 12, 0)
    seq.num_cached = 12
    last = keep(seq, StepOutput(8, [40], torch.zeros(8, 1)), outputs)
    assert (last.num_cached, last.tokens, len(last.features), seq.num_steps) == (8, [40], 8, 1)
    assert seq.num_cached + last.num_cached == len(seq.token_ids) - 1


# ---- end to end: a stop inside an accepted draft, against plain decoding ------------------------------------
@pytest.fixture(scope="module")
def plain(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), speculative_config="off")


def oracle(plain: LLM, truth: dict, drafter=None) -> LLM:
    """A fresh engine over the same weights whose drafter proposes plain decoding's continuation: every draft is
    accepted."""
    return checked(plain.with_speculative_config(every_step({"method": "custom", "num_speculative_tokens": K,
                                                             "drafter": drafter or ScriptedDrafter(truth, K)})))


def greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def generate_checked(llm: LLM, prompt: list[int], params: SamplingParams):
    """One request on a fresh engine: every block goes back (at most kept by the prefix cache), and the prefix cache
    keys the full blocks of its tokens but the last, no more."""
    alloc = llm.engine.allocator
    free = alloc.num_free
    out = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    assert alloc.num_used == 0 and alloc.num_free == free and not llm.engine.has_unfinished()
    assert len(alloc.block_of) == (len(prompt) + len(out.token_ids) - 1) // alloc.block_size
    return out


def cut_inside_a_draft(out) -> bool:
    """Whether verification emitted tokens the request did not keep: a stop inside an accepted draft."""
    m = out.metrics
    return m["num_accepted_tokens"] + m["num_steps"] > len(out.token_ids)


@pytest.fixture(scope="module")
def boundary(plain) -> tuple[list[int], int, list[int]]:
    """A prompt, and a position j inside the first decode step's draft whose token is new there, such that the
    prompt and the output up to j fill exactly one KV block: counting the stop token's K/V (as the count taken before
    the stops did) would key that block."""
    base = plain.encode(PROMPTS[0])[1]
    bs = plain.engine.allocator.block_size
    for j in range(1, K + 1):
        prompt = base[:bs - 1 - j]
        ref = plain.generate([{"prompt_token_ids": prompt}], greedy(ignore_eos=True))[0].token_ids
        if ref[j] not in ref[:j]:
            return prompt, j, ref
    pytest.fail("no output token is new inside the first draft")


@pytest.mark.parametrize("kind", ["stop token", "eos", "stop string"])
def test_a_stop_inside_an_accepted_draft_leaves_plain_decodings_output_and_counts(plain, boundary, kind):
    prompt, j, ref = boundary
    spec, baseline = oracle(plain, {tuple(prompt): ref}), plain.with_speculative_config("off")
    params = greedy(ignore_eos=True)
    if kind == "stop token":
        params = greedy(ignore_eos=True, stop_token_ids=[ref[j]])
    elif kind == "eos":
        for llm in (spec, baseline):
            llm.engine.eos_token_ids = frozenset({ref[j]})
        params = greedy()
    else:
        before, after = plain.engine.decode(ref[:j]), plain.engine.decode(ref[:j + 1])
        assert after[len(before):].strip() and after[len(before):] not in before
        params = greedy(ignore_eos=True, stop=[after[len(before):]])
    out, want = generate_checked(spec, prompt, params), generate_checked(checked(baseline), prompt, params)
    assert (out.token_ids, out.text, out.finish_reason, out.stop_reason) == \
        (want.token_ids, want.text, want.finish_reason, want.stop_reason)
    assert out.token_ids == ref[:j + 1] and out.finish_reason == "stop" and cut_inside_a_draft(out)
    assert len(prompt) + len(out.token_ids) == spec.engine.allocator.block_size  # no block keyed (plain keys none)


def test_max_tokens_ends_at_the_bonus_token_with_plain_decodings_counts(plain, boundary):
    """A draft never reaches past max_tokens (`Speculator.budget`), so that stop lands on a step's last token."""
    prompt, j, ref = boundary
    out = generate_checked(oracle(plain, {tuple(prompt): ref}), prompt, greedy(K - 1, ignore_eos=True))
    assert out.token_ids == ref[:K - 1] and out.finish_reason == "length" and not cut_inside_a_draft(out)


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_grammars_end_inside_an_accepted_draft_leaves_plain_decodings_output_and_counts(plain, ignore_eos):
    """Its stop token, forced by the grammar and drafted (jump-forward), is accepted mid-draft. Under ignore_eos the
    grammar then allows nothing more: the token after it is dropped and the request ends, as plain decoding's next
    step does (it used to keep that token, one its grammar refused)."""
    prompt = [1, 45, 200, 45, 200]
    params = greedy(64, ignore_eos=ignore_eos, structured_output={"choice": ["the quick brown fox jumps over"]})
    want = generate_checked(checked(plain.with_speculative_config("off")), prompt, params)
    out = generate_checked(oracle(plain, {tuple(prompt): want.token_ids}), prompt, params)
    assert (out.token_ids, out.text, out.finish_reason, out.stop_reason) == \
        (want.token_ids, want.text, want.finish_reason, want.stop_reason)
    assert out.finish_reason == "stop" and cut_inside_a_draft(out)
    assert (out.stop_reason == GRAMMAR_DONE) == ignore_eos


def test_every_kind_of_stop_in_one_batch_with_a_feature_drafter_and_preemption(plain):
    """Stops inside drafts beside requests that run on, a drafter that reads target features (it refuses a row
    whose next token was not kept), and a cache so small that requests are preempted: the invariant holds after
    every step, the output is plain decoding's, and every block goes back."""
    prompts = [plain.encode(p)[1] for p in PROMPTS]
    ref = [o.token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], greedy(ignore_eos=True))]
    params = [greedy(ignore_eos=True, stop_token_ids=[ref[0][3]]), greedy(ignore_eos=True),
              greedy(ignore_eos=True, stop=[plain.engine.decode(ref[2][:4])[-2:]]), greedy(K + 2, ignore_eos=True)]
    drafter = PairingDrafter(dict(zip(map(tuple, prompts), ref)), K)
    spec = checked(plain.with_speculative_config(every_step({"method": "custom", "num_speculative_tokens": K,
                                                             "drafter": drafter}), block_size=4, num_kv_blocks=16))
    requests = [{"prompt_token_ids": p} for p in prompts] * 2
    outs, want = spec.generate(requests, params * 2), plain.generate(requests, params * 2)
    assert [(o.token_ids, o.text, o.finish_reason) for o in outs] == \
        [(o.token_ids, o.text, o.finish_reason) for o in want]
    assert spec.engine.scheduler.num_preemptions > 0 and spec.engine.stats()["spec_draft_failures"] == 0
    assert spec.engine.allocator.num_used == 0


@pytest.mark.parametrize("bug", ["counted before the stops", "one token more"])
def test_the_invariant_catches_a_count_that_is_not_the_kept_tokens(plain, boundary, monkeypatch, bug):
    """Planted bugs: the kept record counts every accepted row whatever the stop kept (the count the scheduler took
    before the stops were applied), or one token more at every step."""
    def miscounted(seq, out, outputs):
        kept = keep(seq, out, outputs)
        if out.tokens:
            kept.num_cached = out.num_fed + len(out.tokens) - 1 if bug == "counted before the stops" else \
                kept.num_cached + 1
        return kept

    prompt, j, ref = boundary
    monkeypatch.setattr(llm_engine, "keep", miscounted)
    with pytest.raises(AssertionError, match="caches"):
        oracle(plain, {tuple(prompt): ref}).generate([{"prompt_token_ids": prompt}],
                                                     greedy(ignore_eos=True, stop_token_ids=[ref[j]]))
