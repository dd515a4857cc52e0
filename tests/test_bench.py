"""`specdec bench` end to end on a tiny model: the JSON holds every run, and bad inputs fail clearly."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import save_tiny_model

from specdec.bench import prompts as prompt_sets
from specdec.cli import main

ROWS = [{"question_id": 1, "category": "qa", "turns": ["What is the answer?"]},
        {"question_id": 2, "category": "math_reasoning", "turns": ["Add 1 2 3 4 5."]},
        {"question_id": 3, "category": "qa", "turns": ["Hello world, who is the quick brown fox?"]}]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("bench_model"), "llama")


def write_prompts(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_bench_writes_runs(tiny_model: Path, tmp_path: Path, capsys) -> None:
    prompts = write_prompts(tmp_path / "q.jsonl", ROWS)
    out = tmp_path / "b.json"
    code = main(["bench", "--model", str(tiny_model), "--prompts", str(prompts), "--num-prompts", "3",
                 "--max-tokens", "8", "--batch-sizes", "1,2", "--compare-hf", "--speculative-config", "off",
                 "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    runs = {(r["config"]["engine"], r["config"]["batch_size"]): r for r in result["runs"]}
    assert set(runs) == {("specdec", 1), ("transformers", 1), ("specdec", 2)}
    assert all(r["config"]["method"] == "plain" and r["config"]["dtype"] == "float32" for r in runs.values())
    for run in runs.values():
        assert run["summary"]["generated_tokens"] > 0 and run["summary"]["e2e_tokens_per_s"] > 0
    plain = runs["specdec", 1]
    assert [r["category"] for r in plain["per_prompt"]] == ["qa", "math_reasoning", "qa"]  # round-robin
    assert all(0 < r["generated_tokens"] <= 8 and r["ttft_s"] > 0 for r in plain["per_prompt"])
    assert plain["roofline"]["read_bw_tokens_per_s"] > 0 and plain["roofline"]["fraction_of_read_bw"] > 0
    assert runs["specdec", 2]["summary"]["num_prompts"] == 4  # 3 prompts cycled into 2 groups of 2
    (comparison,) = result["comparisons"]
    assert comparison["baseline"]["engine"] == "transformers" and comparison["e2e_speedup"] > 0
    assert comparison["identical_prompts"] == 3 and comparison["divergences"] == []
    assert result["bandwidth"]["read_bytes_per_s"] > 0 and result["machine"]["torch_threads"] >= 1
    assert "read-BW roofline" in capsys.readouterr().out


@pytest.mark.parametrize("name, content, message", [
    ("missing.jsonl", None, "prompts file {path} does not exist"),
    ("empty.jsonl", "\n", "prompts file {path} has no prompts"),
    ("bad.jsonl", "{not json\n", "{path}:1: not valid JSON"),
    ("no_turns.jsonl", '{"category": "qa"}\n', "{path}:1: expected an object with a non-empty 'turns'"),
])
def test_bad_prompts_file(tiny_model: Path, tmp_path: Path, capsys, name, content, message) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    assert main(["bench", "--model", str(tiny_model), "--prompts", str(path), "--out", str(tmp_path / "b.json")]) == 2
    assert capsys.readouterr().err.startswith("specdec: error: " + message.format(path=path))


def test_missing_default_prompts(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(prompt_sets, "DEFAULT_PROMPTS", tmp_path / "elsewhere" / "question.jsonl")
    assert main(["bench", "--out", str(tmp_path / "b.json")]) == 2
    err = capsys.readouterr().err
    assert "no --prompts given" in err and "elsewhere" in err and "pass --prompts" in err


def test_default_prompts_ship_inside_the_package(tmp_path: Path, monkeypatch) -> None:
    """A plain clone or install has Spec-Bench's prompts without any folder beside it, whatever the cwd."""
    monkeypatch.chdir(tmp_path)
    path = prompt_sets.prompts_path(None)
    assert path.is_relative_to(Path(prompt_sets.__file__).resolve().parents[1])
    rows = prompt_sets.load_questions(path)
    assert len(rows) == 400
    assert {r["category"] for r in rows} == {"translation", "summarization", "qa", "math_reasoning", "rag"}


def test_a_prompt_rows_system_message_comes_before_its_turn(tiny_model: Path) -> None:
    """A deployment's prompts carry its system prompt ("system"): it is rendered as the chat's system message."""
    from specdec import LLM

    llm = LLM(str(tiny_model), speculative_config="off")
    rows = [{"category": "a", "turns": ["How do I reset my password?"], "system": "You are Nimbus Assist."},
            {"category": "a", "turns": ["How do I reset my password?"]}]
    with_system, plain = prompt_sets.encode_prompts(llm, rows)
    assert with_system.token_ids == llm.apply_chat_template([{"role": "system", "content": "You are Nimbus Assist."},
                                                       {"role": "user", "content": "How do I reset my password?"}])
    assert plain.token_ids == llm.apply_chat_template([{"role": "user", "content": "How do I reset my password?"}])
    assert with_system.token_ids != plain.token_ids


@pytest.mark.parametrize("flags, message", [
    (["--batch-sizes", "1,x"], "invalid --batch-sizes '1,x'"), (["--batch-sizes", "0,4"], "invalid --batch-sizes"),
    (["--num-prompts", "0"], "invalid --num-prompts 0"), (["--max-tokens", "-1"], "invalid --max-tokens -1"),
    (["--threads", "0"], "invalid --threads 0"), (["--temperature", "-0.5"], "invalid --temperature"),
    (["--replicas", "2", "--serve"], "invalid --replicas (2,)"),
    (["--llamacpp-draft", "d.gguf"], "pass --llama-server PATH too"),
])
def test_bad_options_are_refused_before_any_model_loads(flags, message, capsys, monkeypatch) -> None:
    """The command line's flags become a `BenchConfig`, which checks them: each error names its flag."""
    monkeypatch.setattr("specdec.llm.LLM.__init__", lambda *a, **k: pytest.fail("a model was loaded"))
    assert main(["bench", "--model", "no-such-model", *flags]) == 2
    assert message in capsys.readouterr().err


def test_the_command_line_and_a_library_caller_build_the_same_config() -> None:
    from specdec.bench.config import BenchConfig
    from specdec.cli import bench_config, build_parser

    args = build_parser().parse_args(["bench", "--batch-sizes", "16,4", "--dtypes", "float32,bfloat16,float32",
                                      "--concurrency", "4,1", "--num-prompts", "20"])
    assert bench_config(args) == BenchConfig(batch_sizes=(4, 16), dtypes=("float32", "bfloat16"), concurrency=(1, 4),
                                             num_prompts=20)
    spec = BenchConfig(speculative_config='{"method": "ngram"}')
    assert spec.speculative_dict({}) == {"method": "ngram"} and BenchConfig().speculative_dict({"a": 1}) == {"a": 1}


def test_unknown_dtype(tiny_model: Path, tmp_path: Path, capsys) -> None:
    prompts = write_prompts(tmp_path / "q.jsonl", ROWS)
    assert main(["bench", "--model", str(tiny_model), "--prompts", str(prompts), "--dtypes", "float32,int3"]) == 2
    assert "unknown dtype 'int3'" in capsys.readouterr().err


def test_bench_alternates_speculative_and_plain_groups_at_each_batch_size(tiny_model: Path, tmp_path: Path,
                                                                          capsys, monkeypatch) -> None:
    from specdec.engine.llm_engine import LLMEngine

    forgets = []
    forget = LLMEngine.forget_finished
    monkeypatch.setattr(LLMEngine, "forget_finished", lambda self: forgets.append(self) or forget(self))
    prompts = write_prompts(tmp_path / "q.jsonl", ROWS)
    out = tmp_path / "b.json"
    assert main(["bench", "--model", str(tiny_model), "--prompts", str(prompts), "--num-prompts", "3",
                 "--max-tokens", "8", "--batch-sizes", "1,2", "--speculative-config",
                 '{"method": "suffix", "num_speculative_tokens": 4}', "--out", str(out)]) == 0
    runs = {(r["config"]["method"], r["config"]["batch_size"]): r for r in json.loads(out.read_text())["runs"]}
    assert set(runs) == {("plain", 1), ("suffix", 1), ("plain", 2), ("suffix", 2)}
    assert [g["prompt_indices"] for g in runs["plain", 2]["per_group"]] == \
        [g["prompt_indices"] for g in runs["suffix", 2]["per_group"]] == [[0, 1], [2, 0]]
    assert runs["suffix", 2]["summary"]["identical_to_batch1"] == 4
    assert len(forgets) == 4  # both engines, after the warm-up and before the batch-2 pass
    assert "specdec/suffix vs specdec/plain (float32, batch 2, groups alternated): decode" in capsys.readouterr().out


def test_structured_bench_compares_constrained_plain_and_speculative(tiny_model: Path, tmp_path: Path,
                                                                     capsys) -> None:
    """Every output validated against its schema, identical to constrained plain, at batch 1 and in groups;
    a prompts file without schemas is refused."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "ok": {"type": "boolean"}}, "required": ["n", "ok"],
              "additionalProperties": False}
    tasks = write_prompts(tmp_path / "s.jsonl", [{"text": f"Item {i} is fine.", "schema": schema} for i in range(3)])
    out = tmp_path / "s.json"
    assert main(["bench", "--structured", "--model", str(tiny_model), "--prompts", str(tasks), "--num-prompts", "3",
                 "--max-tokens", "32", "--batch-sizes", "1,2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert set(summary) == {"plain", "speculative", "speculative, no jump-forward"}
    assert all(v["valid"] == 3 and v["identical_to_plain"] == 3 for v in summary.values())
    assert summary["speculative"]["acceptance_length"] > summary["plain"]["acceptance_length"] == 1.0
    [batched] = result["batched"]
    assert batched["batch_size"] == 2 and batched["identical_to_plain"] == 3 and batched["valid"] == {
        "plain": 3, "speculative": 3}
    assert "valid JSON" in capsys.readouterr().out
    bad = write_prompts(tmp_path / "bad.jsonl", [{"text": "no schema"}])
    assert main(["bench", "--structured", "--model", str(tiny_model), "--prompts", str(bad)]) == 2
    assert "must be an object with 'text' and 'schema'" in capsys.readouterr().err


def test_bench_fails_loudly_when_requests_fail(tiny_model: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    """A configuration whose every request fails (every tree on CUDA once) stops the bench with a non-zero exit
    and the cause, instead of printing speed figures of failed requests."""
    from specdec.engine.speculator import Speculator

    def broken(self, seqs):
        raise RuntimeError("Expected all tensors to be on the same device, but got index is on cpu")

    monkeypatch.setattr(Speculator, "draft", broken)
    prompts = write_prompts(tmp_path / "q.jsonl", ROWS)
    code = main(["bench", "--model", str(tiny_model), "--prompts", str(prompts), "--num-prompts", "2",
                 "--max-tokens", "6", "--speculative-config",  # every step drafts (not the cost model's choice)
                 '{"method": "ngram", "num_speculative_tokens": 2, "adaptive": false}',
                 "--out", str(tmp_path / "b.json")])
    err = capsys.readouterr().err
    assert code != 0 and not (tmp_path / "b.json").exists()
    assert "1 of 1 requests failed with ngram" in err and "index is on cpu" in err, err
