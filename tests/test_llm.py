"""The public API: prompts, chat, stop conditions, per-prompt params, and clear errors for bad input."""
from __future__ import annotations

import gc
import weakref

import pytest
from conftest import REAL_FREEZE_HEAP, every_step

from specdec import LLM, SamplingParams, SpecdecError
from specdec.engine import llm_engine


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), max_model_len=64)


GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def test_outputs_carry_text_ids_and_metrics(llm):
    out = llm.generate("Hello world", GREEDY)[0]
    assert out.prompt == "Hello world"
    assert out.prompt_token_ids == llm.tokenizer.encode("Hello world")
    assert len(out.token_ids) == 10 and out.finish_reason == "length"
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    m = out.metrics
    assert m["num_generated_tokens"] == 10 and m["ttft_s"] > 0 and m["tokens_per_s"] > 0


def test_token_id_prompts_and_string_prompts_agree(llm):
    ids = llm.tokenizer.encode("The quick brown fox")
    a = llm.generate({"prompt_token_ids": ids}, GREEDY)[0]
    b = llm.generate("The quick brown fox", GREEDY)[0]
    assert a.token_ids == b.token_ids and a.prompt_token_ids == ids


def test_chat_applies_the_template(llm):
    conv = [{"role": "user", "content": "hi"}]
    out = llm.chat(conv, GREEDY)[0]
    expected = llm.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert out.prompt_token_ids == llm.tokenizer.encode(expected, add_special_tokens=False)


def test_stop_token_ids_and_eos(llm):
    free = llm.generate("Hello world", GREEDY)[0].token_ids
    stop_at = free[4]
    out = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_at]))[0]
    assert out.token_ids == free[: free.index(stop_at) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at


def test_stop_strings_cut_the_text(llm):
    free = llm.generate("Hello world", GREEDY)[0]
    text = free.text
    stop = text[3:5] if len(text.strip()) >= 5 else None
    assert stop is not None and stop.strip(), f"the test needs printable text from the tiny model, got {text!r}"
    out = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.find(stop)]
    assert llm.engine.allocator.num_used == 0


def test_per_prompt_params_and_lengths(llm):
    outs = llm.generate(["a", "b"], [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                                     SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)])
    assert [len(o.token_ids) for o in outs] == [3, 7]
    with pytest.raises(SpecdecError, match="2 SamplingParams for 3 prompts"):
        llm.generate(["a", "b", "c"], [GREEDY, GREEDY])


def test_generation_stops_at_the_context_limit(llm):
    ids = llm.tokenizer.encode("Hello world") * 3
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))[0]
    assert len(ids) + len(out.token_ids) == 64 and out.finish_reason == "length"


@pytest.mark.parametrize("prompt, message", [
    ("", "prompt is empty"),
    ({"prompt_token_ids": []}, "prompt is empty"),
    ({"prompt_token_ids": [5] * 64}, "prompt has 64 tokens but the model context is 64"),
    ({"prompt_token_ids": [10**6]}, "token ids must be in"),
    (42, "a prompt is a string"),
])
def test_bad_prompts_are_refused_and_leak_nothing(llm, prompt, message):
    with pytest.raises(SpecdecError, match=message):
        llm.generate(prompt, GREEDY)
    assert llm.engine.allocator.num_used == 0 and not llm.engine.has_unfinished()


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(SpecdecError, match="not found"):
        LLM(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecdecError, match="no config.json"):
        LLM(str(tmp_path / "empty"))


def test_unsupported_architecture_is_named(tmp_path, tiny_llama_dir):
    import json
    import shutil

    d = tmp_path / "gpt2ish"
    shutil.copytree(tiny_llama_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecdecError, match="GPT2LMHeadModel"):
        LLM(str(d))


def test_shard_that_does_not_match_the_config(tmp_path, tiny_llama_dir):
    import json
    import shutil

    d = tmp_path / "wrong"
    shutil.copytree(tiny_llama_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] += 16
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecdecError, match="mlp.gate_up_proj.weight.*shape"):
        LLM(str(d))


def test_unknown_engine_option_lists_valid_ones(tiny_llama_dir):
    with pytest.raises(SpecdecError, match="valid keys"):
        LLM(str(tiny_llama_dir), block_sz=8)


def test_quantization_on_load(tmp_path_factory):
    """A Hugging Face model quantized on load: q8_0 logits close to float32, greedy ngram speculation
    token-identical to plain decoding of the same quantized model."""
    from conftest import save_tiny_model

    path = save_tiny_model(tmp_path_factory.mktemp("tiny128"), "llama", intermediate_size=128)
    prompts = ["the quick brown fox", "def add(a, b):"]
    params = SamplingParams(temperature=0, max_tokens=24)
    for name in ("q8_0", "q4_1"):
        plain = LLM(str(path), quantization=name, speculative_config="off")
        assert plain.engine.model.quantization == name
        spec = plain.with_speculative_config(every_step({"method": "ngram", "num_speculative_tokens": 3}))
        assert [o.token_ids for o in spec.generate(prompts, params)] == \
            [o.token_ids for o in plain.generate(prompts, params)]


def test_quantization_errors_name_the_choices(tiny_llama_dir):
    with pytest.raises(SpecdecError, match=r"unknown quantization 'int3'; choose one of "
                                           r"\['gguf', 'iq4_nl', 'iq4_xs', 'mxfp4', 'q4_0', "
                                           r"'q4_1', 'q4_k', 'q5_0', 'q5_1', 'q5_k', 'q6_k', 'q8_0'\]"):
        LLM(str(tiny_llama_dir), quantization="int3")
    with pytest.raises(SpecdecError, match="is a Hugging Face model: quantize it on load"):
        LLM(str(tiny_llama_dir), quantization="gguf")
    with pytest.raises(SpecdecError, match="112 inputs, not a multiple of q4_0's block of 32"):
        LLM(str(tiny_llama_dir), quantization="q4_0")  # intermediate_size 112
    with pytest.raises(SpecdecError, match="computes with float32 activations"):
        LLM(str(tiny_llama_dir), quantization="q8_0", dtype="bfloat16")


# -- fault isolation (issue 18) ------------------------------------------------------------------------------
FAULTY = 299  # a prompt ending in this token makes any step it takes part in raise (injected)


def fail_on_marked(seqs):
    if any(s.prompt_token_ids[-1] == FAULTY for s in seqs):
        raise RuntimeError("injected fault")


@pytest.mark.parametrize("config", ["off", {"method": "ngram", "num_speculative_tokens": 3}])
def test_a_step_that_raises_fails_only_the_request_at_fault(tiny_llama_dir, config):
    llm = LLM(str(tiny_llama_dir), speculative_config=every_step(config))
    prompts = [{"prompt_token_ids": llm.encode(t)[1]} for t in ("Hello world", "1 2 3 1 2 3 1 2", "def add(a, b):")]
    alone = [llm.generate(p, GREEDY)[0].token_ids for p in prompts]
    llm.measuring.inject_fault(fail_on_marked)
    faulty = {"prompt_token_ids": [5, 6, 7, FAULTY]}
    outs = llm.generate([prompts[0], faulty, prompts[1], prompts[2]], GREEDY)  # one batch: the fault hits all
    assert [o.token_ids for o in outs[:1] + outs[2:]] == alone  # the others: as if nothing happened
    assert outs[1].finish_reason == "error" and "injected fault" in outs[1].stop_reason
    assert llm.engine.num_failed == 1 and llm.engine.stats()["requests_failed"] == 1
    assert llm.engine.allocator.num_used == 0 and not llm.engine.scheduler.suspects
    llm.measuring.inject_fault(None)
    assert llm.generate(prompts[0], GREEDY)[0].token_ids == alone[0]


def test_a_drafter_that_raises_turns_speculation_off_for_its_request_only(tiny_llama_dir):
    from specdec.drafting.base import Draft, Drafter

    class Fragile(Drafter):
        """Proposes the last token again; raises on a marked request."""

        def propose(self, requests):
            if any(FAULTY in r.token_ids for r in requests):
                raise ValueError("drafter broke")
            return Draft.chains([[r.token_ids[-1]] * r.max_tokens for r in requests])

    plain = LLM(str(tiny_llama_dir), speculative_config="off")
    llm = plain.with_speculative_config(every_step({"method": "custom", "drafter": Fragile(),
                                                    "num_speculative_tokens": 2}))
    prompts = [{"prompt_token_ids": plain.encode(t)[1]} for t in ("Hello world", "1 2 3 1 2 3 1 2")]
    faulty = {"prompt_token_ids": [5, 6, 7, FAULTY]}
    want = [o.token_ids for o in plain.generate([prompts[0], faulty, prompts[1]], GREEDY)]
    outs = llm.generate([prompts[0], faulty, prompts[1]], GREEDY)
    assert [o.token_ids for o in outs] == want  # lossless either way
    assert [o.finish_reason for o in outs] == ["length"] * 3
    assert outs[1].metrics["num_drafts"] == 0 and outs[0].metrics["num_drafts"] > 0
    assert llm.engine.stats()["spec_draft_failures"] == 1


def test_the_device_comes_from_specdec_device_when_not_given(tiny_llama_dir, monkeypatch):
    """`--device cuda` runs the suite on a GPU through $SPECDEC_DEVICE; a device given by name always wins."""
    import torch

    from specdec.llm import parse_device

    monkeypatch.setenv("SPECDEC_DEVICE", "meta")
    assert parse_device(None) == torch.device("meta") and parse_device("cpu") == torch.device("cpu")
    assert LLM(str(tiny_llama_dir), speculative_config="off").engine.model.device == torch.device("meta")
    monkeypatch.delenv("SPECDEC_DEVICE")
    assert parse_device(None) == torch.device("cpu")
    if not torch.cuda.is_available():
        monkeypatch.setenv("SPECDEC_DEVICE", "cuda")
        with pytest.raises(SpecdecError, match="CUDA is not available"):
            LLM(str(tiny_llama_dir))


def test_as_completed_feeds_requests_as_others_finish_and_aborts_what_is_left(llm):
    """Every request comes back once, under its index, with plain generate()'s tokens; no more than `in_flight`
    decode together; a caller that stops early leaves no request running and no block held."""
    prompts = [[1, 2, 3 + i] for i in range(7)]
    lengths = [4 + 3 * (i % 3) for i in range(7)]  # finishing out of order
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    want = [o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    engine, running = llm.engine, []
    step = engine.step

    def counting():
        running.append(len(engine.scheduler.running) + len(engine.scheduler.waiting))
        return step()

    engine.step = counting
    try:
        got = dict(llm.as_completed(zip(prompts, params), in_flight=3))
    finally:
        del engine.step
    assert sorted(got) == list(range(7)) and [got[i].token_ids for i in range(7)] == want
    assert max(running) == 3
    stream = llm.as_completed(zip(prompts, params), in_flight=3)
    next(stream)
    stream.close()  # the caller stops after one answer
    assert not engine.has_unfinished() and engine.allocator.num_used == 0
    with pytest.raises(SpecdecError, match="in_flight"):
        next(llm.as_completed([], in_flight=0))


def test_an_engine_hides_the_startup_heap_from_the_collector_and_frees_one_dropped_since(tiny_llama_dir,
                                                                                        monkeypatch):
    """A full collection walks only what was allocated after the engine was built (`freeze_heap`), and an engine
    dropped later, even in a reference cycle, is freed when the next one is built."""
    monkeypatch.setattr(llm_engine, "freeze_heap", REAL_FREEZE_HEAP)  # (the suite's other tests skip it)
    first = LLM(str(tiny_llama_dir), max_model_len=64)
    assert gc.get_freeze_count() > 1000
    dropped = weakref.ref(first.engine)
    first.engine.itself = first.engine  # only the cyclic collector can free it now
    del first
    gc.collect()
    assert dropped() is not None  # frozen: a collection does not look at it
    second = LLM(str(tiny_llama_dir), max_model_len=64)
    assert dropped() is None
    assert second.generate(["hi"], GREEDY)[0].token_ids
    gc.unfreeze()  # the rest of the suite runs unfrozen
