"""The `specdec` command line: JSON output, streaming, and errors without tracebacks."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specdec.cli import main


def test_generate_json(tiny_llama_dir, capsys):
    rc = main(["generate", "Hello", "--model", str(tiny_llama_dir), "--max-tokens", "6", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"text", "token_ids", "prompt_token_ids", "metrics"}
    assert set(out["metrics"]) >= {"num_generated_tokens", "ttft_s", "decode_s", "tokens_per_s"}
    assert 1 <= out["metrics"]["num_generated_tokens"] <= 6
    assert out["prompt_token_ids"][0] == 3  # the chat template's <|user|> token: chat is applied by default


def test_generate_no_chat_streams_the_same_text(tiny_llama_dir, capsys):
    args = ["generate", "Hello", "--model", str(tiny_llama_dir), "--max-tokens", "8", "--no-chat"]
    assert main(args + ["--json"]) == 0
    expected = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    captured = capsys.readouterr()
    assert captured.out.rstrip("\n") == expected["text"].rstrip("\n")
    assert "tok/s" in captured.err


@pytest.mark.parametrize("extra, message", [
    (["--model", "/no/such/model"], "not found"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--dtype", "float8"], "unknown dtype"),
])
def test_errors_are_one_clear_line(tiny_llama_dir, capsys, extra, message):
    base = ["generate", "Hello", "--model", str(tiny_llama_dir), "--max-tokens", "2"]
    assert main(base + extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("specdec: error:") and message in err and "Traceback" not in err


def test_console_script_runs(tiny_llama_dir):
    proc = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "Hi", "--model", "/no/such/model"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "not found" in proc.stderr


def test_generate_with_speculation_reports_acceptance(tiny_llama_dir, capsys):
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    args = ["generate", "1 2 3 1 2 3 1 2", "--model", str(tiny_llama_dir), "--max-tokens", "12", "--no-chat"]
    assert main(args + ["--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(args + ["--json", "--speculative-config", spec]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == plain["token_ids"]
    assert set(out["metrics"]) >= {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos",
                                   "acceptance_rate", "acceptance_length"}
    assert main(args + ["--speculative-config", '{"method": "nope"}']) == 2
    assert "unknown speculative method" in capsys.readouterr().err
