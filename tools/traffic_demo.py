"""A simulated deployment that learns from its own traffic: one style of request served by `specdec serve`'s app
with `--record-traffic`, the head fine-tuned on the first half's records (`specdec train --from-traffic`), and
the second half measured before and after: greedy first-position acceptance of the head's chain of 1 (and
identity with plain decoding). Decode speed on the second half is then `specdec bench --prompts
OUT/second_half.jsonl` with each head (the rows carry the deployment's system prompt).

The deployment: a support assistant for a made-up cloud-storage product, its system prompt fixed, its users'
questions drawn from templates (seeded), so no prompt is in any training or evaluation set.

    python tools/traffic_demo.py --out /tmp/traffic-demo --requests 160 --train-seconds 540
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specdec import LLM, SamplingParams  # noqa: E402
from specdec.models.loader import shipped_head  # noqa: E402

SYSTEM = ("You are Nimbus Assist, the support assistant of Nimbus Drive, a cloud storage service with apps for "
          "Windows, macOS, Linux, iOS and Android and a web app at drive.nimbus.example. Plans: Free (5 GB), Plus "
          "(200 GB, $2.99/month) and Pro (2 TB, $9.99/month, with version history of 180 days). Answer in short "
          "numbered steps when the user asks how to do something, name the menu items exactly, and end with one "
          "line offering more help.")
ACTIONS = ["share a folder with a colleague", "restore a deleted file", "turn on two-factor authentication",
           "change my plan", "stop syncing one folder", "recover an older version of a document",
           "upload a 20 GB video", "move my files to a new computer", "cancel my subscription",
           "create a public download link", "set an expiry date on a shared link", "free up space on my phone",
           "see who opened my shared file", "sync a folder from an external drive", "change the language of the app",
           "download everything as a zip file", "reset my password", "add a second device",
           "transfer ownership of a folder", "back up my photos automatically"]
PLATFORMS = ["Windows", "macOS", "Linux", "iOS", "Android", "the web app"]
OPENERS = ["How do I {a} on {p}?", "Hi, I'm on {p}. How can I {a}?", "Can you tell me how to {a} using {p}?",
           "I need to {a}. I use {p}. What are the steps?", "What's the fastest way to {a} on {p}?",
           "Quick question: is it possible to {a} from {p}, and how?"]
PROBLEMS = ["My {p} app says 'sync paused' and won't resume. What should I do?",
            "I'm on the {plan} plan and ran out of space on {p}. What are my options?",
            "Files I delete on {p} come back after a minute. Why?",
            "The {p} app is using a lot of battery. How can I reduce it?",
            "I can't sign in on {p}; it says my session expired. How do I fix it?",
            "What's the difference between the Plus and Pro plans if I mostly use {p}?"]


def requests(n: int, seed: int) -> list[list[dict]]:
    rng = random.Random(seed)
    seen, out = set(), []
    while len(out) < n:
        if rng.random() < 0.7:
            text = rng.choice(OPENERS).format(a=rng.choice(ACTIONS), p=rng.choice(PLATFORMS))
        else:
            text = rng.choice(PROBLEMS).format(p=rng.choice(PLATFORMS), plan=rng.choice(["Free", "Plus", "Pro"]))
        if text not in seen:
            seen.add(text)
            out.append([{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}])
    return out


def serve_and_record(model: str, chats: list[list[dict]], traffic: Path, max_tokens: int) -> float:
    """The first half served by the real app (engine thread, recording on), one request after another."""
    from fastapi.testclient import TestClient

    from specdec.serving.server import create_app

    llm = LLM(model)  # the deployment's default speculation: what a user gets
    start = time.perf_counter()
    with TestClient(create_app(llm, record_traffic=traffic)) as client:
        for chat in chats:
            r = client.post("/v1/chat/completions", json={"model": "smollm2-135m", "messages": chat,
                                                          "max_tokens": max_tokens, "temperature": 0})
            r.raise_for_status()
    return time.perf_counter() - start


def acceptance(model: str, head: str, chats: list[list[dict]], max_tokens: int) -> dict:
    """Greedy first-position acceptance of the head's chain of 1 on `chats`, and identity with plain decoding."""
    plain = LLM(model, speculative_config="off")
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    encoded = [{"prompt_token_ids": plain.apply_chat_template(c)} for c in chats]
    reference = [plain.generate(e, params)[0].token_ids for e in encoded]
    llm = plain.with_speculative_config({"method": "eagle3", "model": head, "num_speculative_tokens": 1,
                                         "dispatch": {"1": "chain"}})
    outs = [llm.generate(e, params)[0] for e in encoded]
    drafts = sum(o.metrics.get("num_drafts", 0) for o in outs)
    accepted = sum((o.metrics.get("accepted_per_pos") or [0])[0] for o in outs)
    return {"first_position": round(accepted / max(drafts, 1), 4), "drafts": drafts,
            "identical": sum(o.token_ids == r for o, r in zip(outs, reference)), "prompts": len(outs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=160, help="the deployment's requests; the first half trains")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--train-seconds", type=float, default=540)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    chats = requests(args.requests, args.seed)
    first, second = chats[:len(chats) // 2], chats[len(chats) // 2:]
    traffic, tuned = out / "traffic", out / "head"
    report: dict = {"requests": len(chats), "max_tokens": args.max_tokens}
    if not any(traffic.glob("traffic-*.jsonl")):
        report["served_seconds"] = round(serve_and_record(args.model, first, traffic, args.max_tokens), 1)
    shipped = str(shipped_head(args.model))
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "specdec.cli", "train", "--target", args.model, "--from-traffic",
                    str(traffic), "--out", str(tuned), "--epochs", "1000", "--batch", "4", "--lr", "1e-4",
                    "--schedule", "constant", "--ce-weight", "1.0", "--regression-weight", "0.1", "--eval-every", "10",
                    "--held-out", "8",
                    "--train-seconds", str(args.train_seconds), "--save-every", "100000"], check=True, cwd=ROOT)
    report["train_seconds"] = round(time.perf_counter() - start, 1)
    report["curve"] = json.loads((tuned / "train_log.json").read_text())["curve"]
    report["before"] = acceptance(args.model, shipped, second, args.max_tokens)
    report["after"] = acceptance(args.model, str(tuned / "best"), second, args.max_tokens)
    prompts = out / "second_half.jsonl"
    prompts.write_text("".join(json.dumps({"category": "support", "turns": [c[1]["content"]],
                                           "system": c[0]["content"]}) + "\n" for c in second), encoding="utf-8")
    report["prompts_file"] = str(prompts)  # for `specdec bench --prompts`, before and after (see the docstring)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "curve"}, indent=1))


if __name__ == "__main__":
    main()
