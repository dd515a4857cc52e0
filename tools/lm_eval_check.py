"""lm-evaluation-harness against `specdec serve`, as an evaluator would run it: its `local-completions` model scores
a small multiple-choice task through /v1/completions (echo + logprobs, the prompts' log-likelihoods), and every
log-likelihood it got must equal our offline computation of the same tokens (LLM.generate with prompt_logprobs).

    pip install lm-eval==0.4.13          # not a test dependency: it pulls datasets, pandas, scikit-learn, ...
    python tools/lm_eval_check.py [--model smollm2-135m] [--speculative-config '{"method": "suffix"}']

The task (ten questions written here, no download) is a JSON file and a task YAML in a temporary directory; the
tokenizer lm-eval needs is the served model's own, saved there too. Prints the accuracy, the largest difference
between lm-eval's log-likelihoods and ours, and exits 1 when one differs by more than --tolerance.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

QUESTIONS = [  # (question, choices, answer index)
    ("The capital of France is", ["Paris", "Berlin", "Madrid", "Rome"], 0),
    ("Water freezes at a temperature of", ["0 degrees Celsius", "50 degrees Celsius", "100 degrees Celsius"], 0),
    ("The largest planet in the solar system is", ["Mars", "Jupiter", "Venus", "Mercury"], 1),
    ("Two plus three equals", ["four", "five", "six"], 1),
    ("The opposite of hot is", ["cold", "warm", "loud"], 0),
    ("A baby cat is called a", ["puppy", "kitten", "calf"], 1),
    ("The sun rises in the", ["west", "north", "east"], 2),
    ("Bees make", ["milk", "honey", "silk"], 1),
    ("The color of a clear daytime sky is", ["green", "blue", "red"], 1),
    ("Ice is water in its", ["solid", "liquid", "gas"], 0),
]

TASK = """task: specdec_mc
dataset_path: json
dataset_kwargs:
  data_files: {data}
test_split: train
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--speculative-config", default=None, help="JSON, as `specdec serve` takes it")
    ap.add_argument("--tolerance", type=float, default=1e-4, help="largest allowed difference per log-likelihood")
    args = ap.parse_args()

    import lm_eval
    from lm_eval.tasks import TaskManager
    from test_server import serving

    from specdec import LLM, SamplingParams

    spec = json.loads(args.speculative_config) if args.speculative_config else None
    served_llm, offline = LLM(args.model, speculative_config=spec), LLM(args.model, speculative_config="off")
    work = Path(tempfile.mkdtemp(prefix="specdec-lm-eval-"))
    data = work / "questions.json"
    data.write_text("\n".join(json.dumps({"question": q, "choices": c, "answer": a}) for q, c, a in QUESTIONS))
    (work / "specdec_mc.yaml").write_text(TASK.format(data=data))
    offline.tokenizer.save_pretrained(work / "tokenizer")

    with serving(served_llm, served_model_name="specdec") as s:
        results = lm_eval.simple_evaluate(
            model="local-completions", tasks=["specdec_mc"], log_samples=True,
            model_args={"base_url": f"{s.url}/v1/completions", "model": "specdec", "tokenizer_backend": "huggingface",
                        "tokenizer": str(work / "tokenizer"), "tokenized_requests": True, "num_concurrent": 1,
                        "max_retries": 1, "batch_size": 4},
            task_manager=TaskManager(include_path=str(work)))
    accuracy = results["results"]["specdec_mc"]["acc,none"]
    worst = 0.0
    checked = 0
    for sample in results["samples"]["specdec_mc"]:
        for (context, continuation), [(got, _)] in zip(sample["arguments"], sample["resps"], strict=True):
            ctx = offline.tokenizer.encode(context, add_special_tokens=False)
            whole = offline.tokenizer.encode(context + continuation, add_special_tokens=False)
            out = offline.generate({"prompt_token_ids": whole}, SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
            ours = sum(e.logprob for e in out.prompt_logprobs[len(ctx) - 1:])
            worst = max(worst, abs(ours - got))
            checked += 1
    print(f"lm-eval local-completions on {len(QUESTIONS)} questions ({checked} choices): acc {accuracy:.2f}; "
          f"largest |lm-eval log-likelihood - offline| = {worst:.2e} (tolerance {args.tolerance:g})")
    return 0 if worst <= args.tolerance and checked == sum(len(c) for _, c, _ in QUESTIONS) else 1


if __name__ == "__main__":
    sys.exit(main())
