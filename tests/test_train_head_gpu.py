"""tools/train_head_gpu.py, the GPU training pipeline, run on CPU with a tiny target: the answers are the target's
own greedy ones, the head it saves serves losslessly, and a second run resumes from the first one's answers."""
from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from train_head_gpu import main  # noqa: E402

from specdec import LLM, SamplingParams  # noqa: E402

PROMPTS = ["the quick brown fox", "hello world", "1 2 3 4 5", "def add(a, b):", "the answer is", "speculative",
           "decoding is fast", "brown fox jumps", "lazy dog", "7 8 9 10", "return a + b", "Hello there"]


def write_prompts(path: Path, prompts: list[str]) -> Path:
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"source": "test", "prompt": p}) + "\n")
    return path


def run(model: Path, prompts: Path, out: Path, *extra: str) -> dict:
    main(["train", "--prompts", str(prompts), "--out", str(out), "--model", str(model), "--device", "cpu",
          "--dtype", "float32", "--init", "none", "--max-new-tokens", "8", "--gen-batch", "4", "--sampled-every", "0",
          "--gen-seconds", "120", "--train-seconds", "3", "--eval-every", "1", "--held-out", "3",
          "--batch-tokens", "256", "--max-len", "128", "--draft-vocab", "64", *extra])
    return json.loads((out / "train_log.json").read_text())


def test_the_pipeline_answers_trains_a_lossless_head_and_resumes(tiny_llama_dir, tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl.gz", PROMPTS)
    first = run(tiny_llama_dir, prompts, tmp_path / "a")
    assert first["answers"]["prompts"] == first["answers"]["new_prompts"] == len(PROMPTS)
    curve = first["curve"]
    assert len(curve) >= 2 and curve[0]["tokens"] == 0 and curve[-1]["tokens"] > 0
    assert 0 <= curve[-1]["step1"]["top1"] <= curve[-1]["step1"]["top4"] <= 1

    # the answers are the target's own greedy answers (as specdec's plain decoding gives them)
    z = np.load(tmp_path / "a" / "answers-0.npz")
    llm = LLM(str(tiny_llama_dir), speculative_config="off")
    plain = llm.chat([[{"role": "user", "content": PROMPTS[i]}] for i in z["prompt_index"]],
                     SamplingParams(temperature=0, max_tokens=8))
    for k, out in enumerate(plain):
        answer = z["answer_ids"][z["offsets"][k]:z["offsets"][k + 1]].tolist()
        assert answer == list(out.token_ids)[:len(answer)]

    # the saved head (two shards) serves, and speculation keeps the output
    spec = LLM(str(tiny_llama_dir), speculative_config={"method": "eagle3", "model": str(tmp_path / "a" / "head"),
                                                         "num_speculative_tokens": 3})
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert [o.token_ids for o in spec.generate(PROMPTS, greedy)] == \
        [o.token_ids for o in llm.generate(PROMPTS, greedy)]

    # a second run answers nothing again, holds out the same prompts and keeps every answer
    second = run(tiny_llama_dir, prompts, tmp_path / "b", "--answers", str(tmp_path / "a" / "answers-0.npz"))
    assert second["answers"]["new_prompts"] == 0 and second["answers"]["prompts"] == len(PROMPTS)
    assert second["curve"][0] == first["curve"][0]
    again = np.load(tmp_path / "b" / "answers-0.npz")
    assert all(np.array_equal(again[k], z[k]) for k in ("prompt_index", "offsets", "answer_ids", "sampled"))

    # the CPU pipeline resumes: --train-seconds counts every run, the curve goes on
    state = tmp_path / "state"
    part = run(tiny_llama_dir, prompts, tmp_path / "d", "--answers", str(tmp_path / "a" / "answers-0.npz"),
               "--state", str(state), "--train-seconds", "2")
    assert (state / "trainer_state.pt").is_file()
    whole = run(tiny_llama_dir, prompts, tmp_path / "d", "--answers", str(tmp_path / "a" / "answers-0.npz"),
                "--state", str(state), "--train-seconds", "4", "--resume")
    assert whole["trained"]["tokens"] > part["trained"]["tokens"]
    assert whole["curve"][:len(part["curve"])] == part["curve"]
    assert 4 <= whole["trained"]["seconds"] < 4 + 30

    # a run whose trainer state is gone starts after the batches an earlier run trained on (its tokens counted)
    skipped = run(tiny_llama_dir, prompts, tmp_path / "e", "--answers", str(tmp_path / "a" / "answers-0.npz"),
                  "--skip-tokens", "10", "--train-seconds", "0")
    assert 10 <= skipped["curve"][0]["tokens"] < skipped["answers"]["answer_tokens"]
    assert skipped["trained"]["tokens"] == skipped["curve"][0]["tokens"]

    # bfloat16 (autocast for the head) trains too
    bf16 = run(tiny_llama_dir, prompts, tmp_path / "f", "--answers", str(tmp_path / "a" / "answers-0.npz"),
               "--dtype", "bfloat16", "--train-seconds", "1")
    assert bf16["trained"]["tokens"] > 0 and 0 <= bf16["curve"][-1]["step1"]["top1"] <= 1

    # answers made for another prompts file are refused
    other = write_prompts(tmp_path / "other.jsonl.gz", PROMPTS[::-1])
    with pytest.raises(SystemExit, match="answers another prompts file"):
        run(tiny_llama_dir, other, tmp_path / "c", "--answers", str(tmp_path / "a" / "answers-0.npz"))


def test_specdecs_engine_and_transformers_give_the_same_greedy_answers(tiny_llama_dir, tmp_path, capsys):
    """The two answerers agree (float32 on CPU), and "auto" times both before it picks one."""
    prompts = write_prompts(tmp_path / "prompts.jsonl.gz", PROMPTS)
    answers = {}
    for generator in ("hf", "specdec", "auto"):
        run(tiny_llama_dir, prompts, tmp_path / generator, "--generator", generator, "--train-seconds", "0")
        z = np.load(tmp_path / generator / "answers-0.npz")
        answers[generator] = {int(i): z["answer_ids"][z["offsets"][k]:z["offsets"][k + 1]].tolist()
                              for k, i in enumerate(z["prompt_index"])}
    assert answers["hf"] == answers["specdec"] == answers["auto"] and len(answers["hf"]) == len(PROMPTS)
    assert "answering with" in capsys.readouterr().out
