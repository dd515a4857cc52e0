"""Self-distillation data: a reproducible interleaved plan that never takes reserved prompts, answers equal to
the engine's own, runs that resume from a directory on any machine, packed files that round-trip, and clear
errors when prompts, settings or the target no longer match."""
from __future__ import annotations

import json

import pytest
from conftest import save_tiny_model

from specdec import LLM, SamplingParams, SpecdecError
from specdec.training import distill


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("target"), "llama", num_hidden_layers=2)


@pytest.fixture(scope="module")
def llm(target_dir):
    return LLM(str(target_dir), speculative_config="off")


def write_data(root, rows_per_file: int = 6):
    root.mkdir(parents=True, exist_ok=True)
    for name in ("alpha", "beta"):
        lines = []
        for i in range(rows_per_file):
            lines.append(json.dumps({"id": f"{name}-{i}", "messages": [
                {"role": "user", "content": f"{name} question {i} \u2028 with a line separator"},
                {"role": "assistant", "content": "a human answer"}]}))
        lines.insert(2, json.dumps({"id": "no-user", "messages": [{"role": "assistant", "content": "x"}]}))
        (root / f"{name}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (root / "spec_bench").mkdir(exist_ok=True)  # subdirectories are never read
    return root


def test_plan_is_seeded_balanced_and_extends_with_the_quota(tmp_path):
    sources = distill.read_sources(write_data(tmp_path / "data"))
    small, large = distill.plan(sources, 2, 0.5, seed=3), distill.plan(sources, 4, 0.5, seed=3)
    assert [j.source for j in small] == ["alpha", "beta"] * 2  # interleaved: a run stopped early has every source
    assert set(small) <= set(large)  # a larger quota keeps the smaller one's jobs
    assert all(j.row != 2 for j in large)  # the line without a user turn is never planned
    assert distill.plan(sources, 4, 0.5, seed=3) == large and distill.plan(sources, 4, 0.5, seed=4) != large
    assert {j.temperature for j in distill.plan(sources, 7, 0.0, seed=0)} == {0.0}
    assert {j.temperature for j in distill.plan(sources, 7, 1.0, seed=0)} == {0.7}
    everything = distill.plan(sources, None, 0.5, seed=3)
    assert len(everything) == 12 and set(large) <= set(everything)


def test_reserved_prompts_are_never_planned(tmp_path):
    sources = distill.read_sources(write_data(tmp_path / "data"))
    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps({"turns": ["beta question 4 \u2028 with a line separator"]}) + "\n", encoding="utf-8")
    jobs = distill.plan(sources, None, 0.0, seed=0, reserved=distill.reserved_turns([held]))
    assert len(jobs) == 11 and ("beta", 5) not in {(j.source, j.row) for j in jobs}  # row 5: question 4 (row 2 skipped)


def test_answers_are_the_engines_own_and_round_trip(tmp_path, llm):
    data = write_data(tmp_path / "data")
    out = tmp_path / "answers"
    summary = distill.regenerate(llm, data, out, per_source=3, sampled_share=0.5, max_tokens=8, flush_every=2,
                                 in_flight=4)
    assert summary["answers"] == 6 and summary["remaining"] == 0
    assert len(list(out.glob("chunk-*.npz"))) >= 2  # flushed as it goes (every 2 answers or more)
    packed = distill.pack([out], tmp_path / "packed.npz")
    meta, records = distill.load(tmp_path / "packed.npz")
    assert meta["max_tokens"] == 8 and len(records) == 6 and packed["answers"] == 6
    prompts = distill.read_sources(data)
    for r in records:  # each answer is what the engine itself gives that prompt with that job's sampling
        ids = llm.apply_chat_template(prompts[r.job.source][r.job.row])
        params = SamplingParams(temperature=r.job.temperature, seed=r.job.seed if r.job.temperature else None,
                                max_tokens=8)
        assert llm.generate({"prompt_token_ids": ids}, params)[0].token_ids == r.tokens
        assert r.prompt_len == len(ids) and r.finish in ("stop", "length")
    samples = distill.samples(out, data, llm, max_len=10_000)
    assert len(samples) == 6
    ids, mask = samples[0]
    assert len(ids) == records[0].prompt_len + len(records[0].tokens)
    assert mask == [False] * records[0].prompt_len + [True] * len(records[0].tokens)


def test_a_run_resumes_where_it_stopped(tmp_path, llm):
    data = write_data(tmp_path / "data")
    out = tmp_path / "answers"
    first = distill.regenerate(llm, data, out, per_source=4, max_tokens=6, limit=3)
    assert first["new_answers"] == 3 and first["remaining"] == 5
    second = distill.regenerate(llm, data, out, per_source=4, max_tokens=6)
    assert second["new_answers"] == 5 and second["remaining"] == 0
    fresh = tmp_path / "fresh"
    distill.regenerate(llm, data, fresh, per_source=4, max_tokens=6)
    key = lambda r: (r.job.source, r.job.row, r.job.temperature, r.job.seed, r.tokens)  # noqa: E731
    answered = lambda d: sorted(map(key, distill.load_all([d])[1].values()))  # noqa: E731
    assert answered(out) == answered(fresh)
    # a new machine with only a packed file of the earlier answers: nothing is redone, a larger quota adds
    distill.pack([out], tmp_path / "earlier.npz")
    third = distill.regenerate(llm, data, tmp_path / "new", per_source=5, max_tokens=6, also=[tmp_path / "earlier.npz"])
    assert third["new_answers"] == 2 and third["answers"] == 10


def test_long_prompts_are_skipped_once(tmp_path, llm):
    data = write_data(tmp_path / "data")
    out = tmp_path / "answers"
    distill.regenerate(llm, data, out, per_source=2, max_tokens=4, max_prompt_tokens=3)
    records = list(distill.load_all([out])[1].values())
    assert {r.finish for r in records} == {"skipped"} and all(not r.tokens for r in records)
    again = distill.regenerate(llm, data, out, per_source=2, max_tokens=4, max_prompt_tokens=3)
    assert again["new_answers"] == 0
    assert distill.samples(out, data, llm, 100) == []


def test_mismatches_are_refused_clearly(tmp_path, llm, target_dir):
    data = write_data(tmp_path / "data")
    out = tmp_path / "answers"
    distill.regenerate(llm, data, out, per_source=1, max_tokens=4)
    with pytest.raises(SpecdecError, match="other settings"):
        distill.regenerate(llm, data, out, per_source=1, max_tokens=5)
    with pytest.raises(SpecdecError, match="is a file"):
        distill.regenerate(llm, data, data / "alpha.jsonl", per_source=1, max_tokens=4)
    other = LLM(str(save_tiny_model(tmp_path / "other", "llama", seed=7, num_hidden_layers=2)))
    with pytest.raises(SpecdecError, match="another target"):
        distill.samples(out, data, other, 100)
    path = data / "alpha.jsonl"  # an edited data file: its prompts no longer match the answers
    path.write_text(path.read_text(encoding="utf-8").replace("question", "query"), encoding="utf-8")
    with pytest.raises(SpecdecError, match="no longer renders"):
        distill.samples(out, data, llm, 100)
    with pytest.raises(SpecdecError, match="does not exist"):
        distill.load(tmp_path / "missing.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(SpecdecError, match="not a self-distillation file"):
        distill.load(tmp_path / "junk.npz")
    with pytest.raises(SpecdecError, match="does not exist"):
        distill.read_sources(tmp_path / "nowhere")


def test_cli_distills_and_a_head_trains_on_the_packed_answers(tmp_path, target_dir):
    from specdec.cli import main

    data, out = write_data(tmp_path / "data"), tmp_path / "answers.npz"
    assert main(["distill", "--model", str(target_dir), "--data-dir", str(data), "--out", str(tmp_path / "dir"),
                 "--per-source", "3", "--max-tokens", "12", "--pack", str(out)]) == 0
    assert len(distill.load(out)[1]) == 6
    assert main(["distill", "--model", str(target_dir), "--data-dir", str(data), "--out", str(tmp_path / "dir"),
                 "--per-source", "many"]) == 2
    head = tmp_path / "head"
    assert main(["train", "--target", str(target_dir), "--data", str(data), "--distilled", str(out),
                 "--out", str(head), "--steps", "4", "--save-every", "2"]) == 0
    log = json.loads((head / "train_log.json").read_text())
    assert log["steps"] == 4 and all(h["loss"] > 0 for h in log["history"])
    assert (head / "model.safetensors").is_file()


def test_the_exported_prompts_name_the_same_rows(tmp_path):
    """`--export-prompts`: a copy without the answers, line for line, that plans and renders exactly as the
    original (answers made from it are the original's rows)."""
    data = write_data(tmp_path / "data")
    distill.export_prompts(data, tmp_path / "copy")
    original, copy = distill.read_sources(data), distill.read_sources(tmp_path / "copy")
    assert copy == original and copy["alpha"][2] is None
    assert distill.plan(copy, None, 0.5, seed=1) == distill.plan(original, None, 0.5, seed=1)
    assert "human answer" not in (tmp_path / "copy" / "alpha.jsonl").read_text(encoding="utf-8")


def test_prompts_come_from_several_folders_named_by_file(tmp_path):
    data = write_data(tmp_path / "data")
    more = tmp_path / "more"
    more.mkdir()
    (more / "gamma.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "gamma?"}]}) + "\n")
    sources = distill.read_sources([data, more])
    assert list(sources) == ["alpha", "beta", "gamma"] and sources["gamma"] == [[{"role": "user", "content": "gamma?"}]]
    (more / "alpha.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "again"}]}) + "\n")
    with pytest.raises(SpecdecError, match="two training files are named alpha.jsonl"):
        distill.read_sources([data, more])
