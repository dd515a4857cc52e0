"""`specdec` command line: generate, serve, bench, tune, distill, train. Every command defaults to the built-in
model."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from specdec.config import SpecdecError
from specdec.drafting.registry import registered_methods
from specdec.models.heads.formats import FORMATS, WRITES
from specdec.models.loader import DEFAULT_MODEL

if TYPE_CHECKING:
    from specdec.bench.config import BenchConfig, TuneConfig
    from specdec.training.config import TrainConfig

# prompt sets of the package kept for measuring: never answered for training nor trained on
RESERVED_PROMPTS = ("chat_code_prompts.jsonl", "tune_prompts.jsonl", "eval/prompts.jsonl")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"alias, HF directory or .gguf file (default {DEFAULT_MODEL})")
    p.add_argument("--dtype", default="auto", help="auto (a GGUF computes on its own quantized blocks, a Hugging Face "
                   "model in float32) | float32 | bfloat16 | float16 (a GGUF dequantized)")
    p.add_argument("--quantization", default=None, help="gguf (a GGUF's own blocks) | a block format "
                   "to quantize float weights into on load: q4_0 q4_1 q5_0 q5_1 q8_0 q4_k q5_k q6_k iq4_nl iq4_xs")
    p.add_argument("--device", default=None, help="cpu | cuda (default: $SPECDEC_DEVICE, else cpu)")
    p.add_argument("--speculative-config", default=None, help="JSON, vLLM-style: "
                   '\'{"method": "ngram", "num_speculative_tokens": 4}\', or off (default: the built-in model '
                   "its tuned default, specdec/heads/<model>.json; any other model n-gram drafting; the cost model "
                   "verifies drafts only where they are expected to pay)")


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="split the target over this many processes (torch.distributed; this one is rank 0)")


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt")
    g.add_argument("prompt", nargs="?", default="Explain in three sentences why the sky is blue.")
    add_model_args(g)
    add_parallel_args(g)
    add_sampling_args(g, max_tokens=128)
    g.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    c = g.add_mutually_exclusive_group()
    c.add_argument("--json-schema", default=None, metavar="FILE", help="constrain the output to this JSON schema")
    c.add_argument("--regex", default=None, help="constrain the output to this regular expression")
    c.add_argument("--grammar", default=None, metavar="FILE", help="constrain the output to this EBNF (GBNF) grammar")
    c.add_argument("--choice", default=None, help="constrain the output to one of these comma-separated strings")

    s = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API (chat and text completions, /metrics)",
                       description="Serve MODEL over an OpenAI-compatible HTTP API: /v1/chat/completions, "
                       "/v1/completions, /v1/models, /health, /metrics. --speculative-config also takes 'off'. "
                       "With --admin-key: GET /admin/draft names the draft head drafting; POST /admin/draft with "
                       "{\"model\": DIR} swaps it for the head in DIR (same method and shape, for the same target) "
                       "between two engine steps, without a restart (400 naming why when refused).")
    s.add_argument("model_arg", nargs="?", default=None, metavar="MODEL", help="same as --model")
    add_model_args(s)
    add_parallel_args(s)
    s.set_defaults(model=None)  # so that a positional MODEL and --model can be told apart
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every request but /admin/*")
    s.add_argument("--admin-key", default=None,
                   help="turn on /admin/* (off: 404), behind 'Authorization: Bearer KEY', a key other than --api-key")
    s.add_argument("--allowed-head-dirs", nargs="+", default=[], metavar="DIR",
                   help="folders POST /admin/draft may load heads from, besides the Hugging Face cache (else 403)")
    s.add_argument("--allow-unknown-fields", action="store_true",
                   help="accept and ignore request fields no endpoint knows (default: 400 naming the field)")
    s.add_argument("--served-model-name", default=None, help="the name clients pass as `model` (default: MODEL)")
    s.add_argument("--max-num-seqs", type=int, default=None, help="most requests decoded together")
    s.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="prompt tokens prefilled per step (default 512): long prompts are prefilled in chunks "
                   "of this size, alternating with decode steps, so running requests keep streaming")
    s.add_argument("--max-model-len", type=int, default=None,
                   help="context length in tokens, prompt and output together (default: the model's)")
    s.add_argument("--default-max-tokens", type=int, default=None,
                   help="output tokens of a request that gives no max_tokens (default: the rest of its context)")
    s.add_argument("--max-queue", type=int, default=None,
                   help="requests that may wait beyond the --max-num-seqs running; more get 429 with Retry-After "
                   "(default: no limit)")
    s.add_argument("--max-choices", type=int, default=16,
                   help="choices per request: n, times the prompts of a completions request (default 16)")
    s.add_argument("--max-stored-responses", type=int, default=1000,
                   help="Responses API: responses kept for previous_response_id, least recently used dropped first "
                   "(default 1000; 0 stores none)")
    s.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                   help="wall time per request; past it the request ends with what it has, finish_reason length")
    s.add_argument("--max-request-bytes", type=int, default=2 * 2**20,
                   help="largest request body (default 2 MiB); larger ones get 413 before they are read")
    s.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM or Ctrl-C, how long requests in flight may take to finish (default 30)")
    s.add_argument("--record-traffic", default=None, metavar="DIR",
                   help="record every finished request in DIR/traffic-<UTC time>-<pid>.jsonl, one JSON line each "
                   "(the target's fingerprint, prompt and output token ids, finish reason, temperature, time), files "
                   "0600 in a 0700 DIR; not aborted requests, nor those sent with \"record\": false (default: off)")
    s.add_argument("--record-traffic-max-mb", type=float, default=1024.0, metavar="MB",
                   help="with --record-traffic: DIR's files together; past it the oldest are deleted (default 1024)")
    s.add_argument("--record-traffic-days", type=float, default=None, metavar="DAYS",
                   help="with --record-traffic: delete files older than this, at start and at each new file "
                   "(default: kept until the size cap)")
    s.add_argument("--replicas", type=int, default=None,
                   help="serve N engine replicas behind this one endpoint on Ray Serve (pip install specdec[ray]); "
                   "requests go to the replica holding their prompt's prefix, else the least loaded. Joins the "
                   "Ray cluster RAY_ADDRESS names, else starts one on this machine")

    b = sub.add_parser("bench", help="measure decoding speed on Spec-Bench prompts")
    add_model_args(b)
    add_prompt_set_args(b, max_tokens=128, batch_sizes="1", out="bench_results/bench.json")
    b.add_argument("--dtypes", default=None, help="comma-separated dtypes to compare, e.g. float32,bfloat16 "
                   "(default: --dtype)")
    b.add_argument("--compare-hf", action="store_true",
                   help="also time transformers' generate on the same prompts, interleaved, and compare token ids")
    b.add_argument("--compare-llamacpp", action="store_true",
                   help="also time llama.cpp (llama-cpp-python, `make bench-peers`) on the same GGUF and token ids, "
                   "interleaved prompt by prompt")
    b.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    b.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy (default); above 0 every prompt samples with a fixed seed (speculative output "
                   "equals plain output under keyed verification, the default sampled_verification)")
    b.add_argument("--serve", action="store_true",
                   help="load-test `specdec serve` over HTTP instead: plain vs --speculative-config at each "
                   "--concurrency level (writes JSON and a PNG plot)")
    b.add_argument("--structured", action="store_true",
                   help="constrained decoding on JSON-extraction prompts instead (--prompts default: "
                   "specdec/data/structured_prompts.jsonl): plain vs --speculative-config with and without "
                   "jump-forward "
                   "drafting, validity against each schema, the masks' share of time")
    b.add_argument("--agent", action="store_true",
                   help="an agent's workload instead: --num-prompts tasks, each a tool-calling turn (tool_choice "
                   "required) and an answer turn, plain vs --speculative-config (default suffix, 12 tokens, "
                   "jump-forward 15), "
                   "same tools and instructions throughout")
    b.add_argument("--soak", action="store_true",
                   help="reliability soak instead: a server in this process gets --num-requests mixed requests "
                   "(greedy, seeded, cancelled, malformed, unauthenticated, injected faults), every response and "
                   "the KV level at the end checked; one summary line (writes JSON; exit 2 on any problem)")
    b.add_argument("--num-requests", type=int, default=1000, help="with --soak: requests in all (default 1000)")
    b.add_argument("--soak-concurrency", type=int, default=16, help="with --soak: concurrent clients (default 16)")
    b.add_argument("--soak-seed", type=int, default=0, help="with --soak: seed of the request mix (default 0)")
    b.add_argument("--concurrency", default="1,4,16,64", help="with --serve: concurrent clients per level")
    b.add_argument("--llama-server", default=None, metavar="PATH",
                   help="with --serve: also drive llama.cpp's llama-server binary at PATH on the same GGUF file, "
                   "and report specdec's throughput over it per level; with --compare-llamacpp: also time "
                   "llama.cpp's own speculative modes (ngram-mod, ngram-simple, ngram-map-k, the shipped EAGLE-3 "
                   "head converted to GGUF, draft-mtp where the GGUF has MTP layers), one llama-server each")
    b.add_argument("--llamacpp-draft", default=None, metavar="GGUF",
                   help="with --compare-llamacpp --llama-server: also time llama.cpp's draft-model speculation "
                   "with this draft GGUF (same vocabulary as the model)")
    b.add_argument("--replicas", default=None,
                   help="with --serve: compare serving on these numbers of Ray Serve replicas instead, e.g. 0,1,2 "
                   "(0: `specdec serve` without Ray), each with --speculative-config")
    b.add_argument("--requests-per-level", type=int, default=None,
                   help="with --serve: requests per level (default: 2x the concurrency, at least --num-prompts at 1)")

    t = sub.add_parser("tune", help="measure draft shapes per batch size and write the tree dispatcher's table")
    add_model_args(t)
    add_prompt_set_args(t, max_tokens=64, batch_sizes="1,4,16", out="tune.json")
    t.add_argument("--write-default", action="store_true",
                   help="write the fastest config (of a JSON list given to --speculative-config) as the model's "
                        "default: specdec/heads/<model>.json for a built-in model, else $SPECDEC_CACHE/defaults")
    tr = sub.add_parser("train", help="train a draft head (eagle3, eagle, mtp, medusa) by online distillation")
    tr.add_argument("--method", default="eagle3",
                    help=f"a draft-head method: {', '.join(registered_methods(head=True))} (default eagle3)")
    tr.add_argument("--target", default=DEFAULT_MODEL, help=f"the frozen target (default {DEFAULT_MODEL})")
    tr.add_argument("--data", nargs="+", default=None,
                    help="chat JSONL files ({'messages': [...]} per line), or with --distilled their directory")
    tr.add_argument("--from-traffic", default=None,
                    help="fine-tune on the requests a server recorded (`specdec serve --record-traffic DIR`): the "
                         "target's own outputs; --init defaults to the target's shipped head")
    tr.add_argument("--distilled", nargs="+", default=None,
                    help="train on the target's own answers made by `specdec distill` (.npz files or answer "
                         "directories); --data is then the directory of the prompts they answer")
    tr.add_argument("--objective", choices=("ce", "topk", "acceptance", "replay"), default="ce",
                    help="how the head's distribution is fitted to the target's: cross-entropy (default), "
                         "cross-entropy on the target's --topk tokens, the log of the sampled acceptance rate, or "
                         "cross-entropy weighted to the rows where the head's own draft would be rejected")
    tr.add_argument("--topk", type=int, default=8, help="tokens of --objective topk (default 8)")
    tr.add_argument("--held-out", type=int, default=64,
                    help="with --distilled or --from-traffic: answers never trained on (at most a fifth), on which "
                         "the curve is measured (default 64)")
    tr.add_argument("--eval-every", type=int, default=100,
                    help="optimizer steps between points of the curve (default 100)")
    tr.add_argument("--train-seconds", type=float, default=0,
                    help="stop (with a checkpoint; --resume goes on) after this long (default: no limit)")
    tr.add_argument("--autocast", default="auto",
                    help="bf16: the head's matmuls in bfloat16; off; auto (default): bf16 on a GPU and on CPUs "
                         "with AVX512-BF16")
    tr.add_argument("--out", required=True, help="directory for the head, its checkpoints and train_log.json")
    tr.add_argument("--steps", type=int, default=1000, help="conversations to train on (default 1000)")
    tr.add_argument("--epochs", type=float, default=None,
                    help="passes over the training data (sets --steps; each epoch in a fresh seeded order)")
    tr.add_argument("--batch", type=int, default=1, help="conversations per optimizer step (default 1)")
    tr.add_argument("--schedule", choices=("cosine", "constant"), default="cosine",
                    help="learning rate after warmup: cosine decay to a tenth of --lr (default) or constant")
    tr.add_argument("--warmup", type=int, default=None,
                    help="optimizer steps of linear warmup (default: 5%% of them, at most 100)")
    tr.add_argument("--clip-grad", type=float, default=0.5, help="gradient norm clip, 0 for none (default 0.5)")
    tr.add_argument("--init", default=None,
                    help="start from this trained head's weights (same method and target; shared draft tokens keep "
                         "their LM head rows)")
    tr.add_argument("--max-len", type=int, default=512, help="tokens per conversation (default 512)")
    tr.add_argument("--lr", type=float, default=2e-4)
    tr.add_argument("--weight-decay", type=float, default=0.1)
    tr.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size (default 8192)")
    tr.add_argument("--save-every", type=int, default=200, help="steps between checkpoints (default 200)")
    tr.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    tr.add_argument("--nproc", type=int, default=1,
                    help="data-parallel ranks on this machine (starts torchrun; same updates as one process with "
                         "the same --batch)")
    tr.add_argument("--ttt-steps", type=int, default=None,
                    help="eagle3: unroll the head on its own outputs this many steps (training-time test, default 3)")
    tr.add_argument("--num-layers", type=int, default=1,
                    help="eagle, eagle3: decoder layers in the head; medusa: residual blocks per head (default 1)")
    tr.add_argument("--num-heads", type=int, default=3, help="medusa: heads, one per draft position (default 3)")
    tr.add_argument("--regenerate", action="store_true",
                    help="train on the target's own greedy answers to the data's prompts (cached in --out)")
    tr.add_argument("--feature-cache", default=None,
                    help="compute the target's features once per sample into this directory (bfloat16, resumable; "
                         "e.g. ~/.cache/specdec/features) so epochs never rerun the target")
    tr.add_argument("--max-conversations", type=int, default=0,
                    help="use only the first N training conversations after shuffling (default: all)")
    tr.add_argument("--skip-conversations", type=int, default=0,
                    help="leave out the first N training conversations after shuffling, before --max-conversations "
                         "(a later pass over what an earlier run's --max-conversations left; same --seed)")
    tr.add_argument("--ce-weight", type=float, default=0.1, help="weight of the CE term of the loss (default 0.1)")
    tr.add_argument("--regression-weight", type=float, default=1.0,
                    help="weight of the SmoothL1 hidden-state term of the loss (default 1.0)")
    tr.add_argument("--val-prompts", type=int, default=8, help="held-out conversations for validation")
    tr.add_argument("--val-tokens", type=int, default=64, help="greedy tokens per validation prompt")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--device", default=None, help="cpu | cuda (default: $SPECDEC_DEVICE, else cpu)")
    tr.add_argument("--dtype", default="auto", help="the target's dtype (default auto: a GGUF's own blocks)")

    c = sub.add_parser("convert-head", help="convert a draft head between the layouts engines read "
                       "(specforge, eagle, speculators, medusa, gguf)")
    c.add_argument("src", help="the head: a directory, a weight file (.safetensors, .bin, .pt, .gguf) or a Hub id; "
                   "for mtp, a model whose files hold MTP layers")
    c.add_argument("--to", required=True, choices=FORMATS, dest="to_format",
                   help="specforge: SpecForge / SGLang safetensors (ours); eagle: the EAGLE reference's "
                   "pytorch_model.bin; speculators: vLLM's speculators; medusa: medusa_lm_head.pt; gguf: "
                   "llama.cpp's EAGLE-3 GGUF")
    c.add_argument("out", help="the output directory (for gguf also a .gguf path)")
    c.add_argument("--method", default=None, choices=sorted(WRITES),
                   help="the head's method (default: read from its files)")
    c.add_argument("--target", default=None, metavar="MODEL",
                   help="with --to gguf: the target (alias or .gguf file) whose tokenizer goes into the head's file, "
                   "as llama.cpp's loader requires (specdec reads the head without it)")

    d = sub.add_parser("distill", help="answer the training prompts with the target itself (self-distillation data)")
    d.add_argument("--model", default=DEFAULT_MODEL, help=f"the target (default {DEFAULT_MODEL})")
    d.add_argument("--data-dir", required=True, nargs="+",
                   help="the folder(s) of training JSONL files (chat 'messages' rows; file stems must differ)")
    d.add_argument("--out", default=None,
                   help="the answers' directory (chunk files; a rerun answers only what it lacks; default "
                   "$SPECDEC_CACHE/answers/<model>, $SPECDEC_CACHE defaulting to ~/.cache/specdec)")
    d.add_argument("--also", nargs="*", default=[],
                   help="earlier answer files or directories: their prompts are not answered again")
    d.add_argument("--pack", default=None,
                   help="after answering, write every answer of --out and --also as this one .npz")
    d.add_argument("--export-prompts", default=None, metavar="DIR",
                   help="answer nothing: write the training folder's prompts alone to DIR (a smaller copy that "
                        "names the same rows, e.g. for a device machine)")
    d.add_argument("--per-source", default="1000",
                   help="prompts per training file, or 'all' (default 1000)")
    d.add_argument("--sampled-share", type=float, default=0.25,
                   help="share of prompts answered by sampling at temperature 0.7, the rest greedy (default 0.25)")
    d.add_argument("--max-tokens", type=int, default=256, help="tokens per answer (default 256)")
    d.add_argument("--max-prompt-tokens", type=int, default=1536, help="longer prompts are skipped (default 1536)")
    d.add_argument("--in-flight", type=int, default=32, help="requests answered together (default 32)")
    d.add_argument("--flush-every", type=int, default=1000, help="answers per chunk file (default 1000)")
    d.add_argument("--reserve", nargs="*", default=None,
                   help="prompt sets ({'turns': [...]} lines) never answered (default: the package's held-out "
                   "chat, code and tune prompts and its evaluation set)")
    d.add_argument("--limit", type=int, default=None, help="stop after this many new answers (resume later)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--device", default=None, help="cpu | cuda (default: $SPECDEC_DEVICE, else cpu)")
    d.add_argument("--dtype", default="auto", help="the target's dtype (default auto: a GGUF's own blocks)")
    return parser


def add_prompt_set_args(p: argparse.ArgumentParser, max_tokens: int, batch_sizes: str, out: str) -> None:
    p.add_argument("--prompts", default=None,
                   help="JSONL with 'turns' (default: the Spec-Bench prompts shipped in specdec/data/spec_bench)")
    p.add_argument("--num-prompts", type=int, default=8, help="taken round-robin across categories (default 8)")
    p.add_argument("--max-tokens", type=int, default=max_tokens,
                   help=f"greedy tokens per prompt (default {max_tokens})")
    p.add_argument("--batch-sizes", default=batch_sizes, help=f"comma-separated batch sizes (default {batch_sizes})")
    p.add_argument("--out", default=out, help=f"where to write the JSON results (default {out})")


def structured_output_arg(args: argparse.Namespace) -> dict | None:
    """--json-schema FILE, --regex R, --grammar FILE or --choice A,B as a structured_output dict."""
    def read(path: str, what: str) -> str:
        try:
            return Path(path).read_text()
        except OSError as e:
            raise SpecdecError(f"cannot read the {what} file {path!r}: {e.strerror}") from None

    if args.json_schema:
        return {"json": read(args.json_schema, "--json-schema")}
    if args.grammar:
        return {"grammar": read(args.grammar, "--grammar")}
    if args.regex:
        return {"regex": args.regex}
    if args.choice:
        return {"choice": [c for c in args.choice.split(",") if c]}
    return None


def cmd_generate(args: argparse.Namespace) -> None:
    from specdec.config import SamplingParams
    from specdec.llm import LLM

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            seed=args.seed, max_tokens=args.max_tokens, structured_output=structured_output_arg(args))
    llm = LLM(args.model, dtype=args.dtype, device=args.device, speculative_config=args.speculative_config,
              quantization=args.quantization, tensor_parallel_size=args.tensor_parallel_size)
    if args.no_chat or not getattr(llm.tokenizer, "chat_template", None):
        prompt_ids = llm.encode(args.prompt)[1]
    else:
        prompt_ids = llm.apply_chat_template([{"role": "user", "content": args.prompt}])
    if args.json:
        out = llm.generate({"prompt_token_ids": prompt_ids}, params)[0]
        m = out.metrics
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "prompt_token_ids": out.prompt_token_ids,
                          "finish_reason": out.finish_reason, "metrics": m}))
        return
    for delta in llm.stream(prompt_ids, params):
        sys.stdout.write(delta)
        sys.stdout.flush()
    m = llm.last_output.metrics
    tps = f"{m['tokens_per_s']:.1f} tok/s" if m["tokens_per_s"] else "n/a"
    spec = f", acceptance length {m['acceptance_length']:.2f}" if m["num_drafts"] else ""
    print(f"\n[{m['num_generated_tokens']} tokens, TTFT {m['ttft_s'] * 1e3:.0f} ms, decode {tps}{spec}]",
          file=sys.stderr)


def cmd_convert_head(args: argparse.Namespace) -> None:
    from specdec.models.heads.formats import find_method, read_head, write_head

    method = args.method or find_method(args.src)
    target = None
    if args.target is not None:
        from specdec.models.loader import resolve

        target = resolve(args.target).gguf_file
        if target is None:
            raise SpecdecError(f"--target {args.target} is not a GGUF model: the tokenizer is copied from the "
                               "target's GGUF")
    ckpt = read_head(args.src, method)
    out = write_head(ckpt, args.to_format, args.out, target)
    if args.to_format == "gguf" and target is None:
        print("note: no --target, so the file holds no tokenizer; llama.cpp loads a head only with its target's "
              "(pass --target MODEL)", file=sys.stderr)
    print(f"wrote {out}: the {method} head of {args.src} ({ckpt.source} layout, {len(ckpt.tensors)} tensors) in "
          f"the {args.to_format} layout")


def cmd_distill(args: argparse.Namespace) -> None:
    from specdec.config import cache_root
    from specdec.llm import LLM
    from specdec.training import distill

    if args.export_prompts:
        print(json.dumps(distill.export_prompts(args.data_dir, args.export_prompts)))
        return
    if args.per_source != "all" and not args.per_source.isdigit():
        raise SpecdecError(f"invalid --per-source {args.per_source!r}: a count or 'all'")
    out = args.out or cache_root() / "answers" / Path(args.model).stem.lower()
    data = Path(__file__).resolve().parent / "data"
    reserve = args.reserve if args.reserve is not None else [data / p for p in RESERVED_PROMPTS if (data / p).is_file()]
    llm = LLM(args.model, dtype=args.dtype, device=args.device, speculative_config="off")
    summary = distill.regenerate(
        llm, args.data_dir, out, per_source=None if args.per_source == "all" else int(args.per_source),
        sampled_share=args.sampled_share, max_tokens=args.max_tokens, max_prompt_tokens=args.max_prompt_tokens,
        seed=args.seed, also=args.also, reserved=distill.reserved_turns(reserve),
        flush_every=args.flush_every, in_flight=args.in_flight, limit=args.limit)
    if args.pack:
        summary["packed"] = distill.pack([*args.also, out], args.pack)
    print(json.dumps(summary))


def cmd_serve(args: argparse.Namespace) -> None:
    from specdec.llm import LLM
    from specdec.serving.admin import Admin
    from specdec.serving.api import Limits
    from specdec.serving.server import serve
    from specdec.serving.traffic import Recording

    if args.model_arg and args.model and args.model_arg != args.model:
        raise SpecdecError(f"two models given: {args.model_arg!r} and --model {args.model!r}; give one")
    model = args.model_arg or args.model or DEFAULT_MODEL
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise SpecdecError(f"invalid --{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
    for flag, value, low in (("--default-max-tokens", args.default_max_tokens, 1), ("--max-queue", args.max_queue, 0),
                             ("--max-request-bytes", args.max_request_bytes, 1),
                             ("--max-choices", args.max_choices, 1),
                             ("--max-stored-responses", args.max_stored_responses, 0)):
        if value is not None and value < low:
            raise SpecdecError(f"invalid {flag} {value}: must be at least {low}")
    if args.request_timeout is not None and not args.request_timeout > 0:
        raise SpecdecError(f"invalid --request-timeout {args.request_timeout}: must be positive")
    limits = Limits(max_request_bytes=args.max_request_bytes, default_max_tokens=args.default_max_tokens,
                    max_queue=args.max_queue, request_timeout_s=args.request_timeout, max_choices=args.max_choices,
                    max_stored_responses=args.max_stored_responses, allow_unknown_fields=args.allow_unknown_fields)
    engine_kwargs = {"max_num_batched_tokens": args.max_num_batched_tokens}
    for name in ("max_num_seqs", "max_model_len"):
        if getattr(args, name) is not None:
            engine_kwargs[name] = getattr(args, name)
    if args.replicas is not None:
        if args.record_traffic is not None:
            raise SpecdecError("--record-traffic records one engine's requests; it does not work with --replicas yet")
        if args.admin_key is not None:
            raise SpecdecError("--admin-key: the /admin routes swap one engine's head; they are not served with "
                               "--replicas")
        try:
            from specdec.serving.replicas import ReplicaSpec, serve_replicas
        except ImportError as e:
            raise SpecdecError(f"--replicas needs Ray Serve: pip install 'specdec[ray]' ({e})") from None
        llm_kwargs = {"dtype": args.dtype, "device": args.device, "speculative_config": args.speculative_config,
                      "quantization": args.quantization, "tensor_parallel_size": args.tensor_parallel_size,
                      **engine_kwargs}
        spec = ReplicaSpec(model, llm_kwargs, args.replicas, args.served_model_name, args.api_key, limits=limits)
        return serve_replicas(spec, host=args.host, port=args.port)
    admin = Admin(args.admin_key, args.allowed_head_dirs)
    record = None if args.record_traffic is None else \
        Recording(args.record_traffic, args.record_traffic_max_mb, args.record_traffic_days)
    llm = LLM(model, dtype=args.dtype, device=args.device, speculative_config=args.speculative_config,
              quantization=args.quantization, tensor_parallel_size=args.tensor_parallel_size, **engine_kwargs)
    serve(llm, host=args.host, port=args.port, api_key=args.api_key, served_model_name=args.served_model_name,
          limits=limits, shutdown_timeout=args.shutdown_timeout, record_traffic=record, admin=admin)


def config_from(cls: type, args: argparse.Namespace, **parsed: object) -> object:
    """A config dataclass from a command's flags: every flag that names a field, with `parsed` (the flags given as
    text, e.g. comma-separated lists) in place of their raw values; the rest (the run's kind, --nproc) left out."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in vars(args).items() if k in names and k not in parsed}, **parsed)


def bench_config(args: argparse.Namespace) -> BenchConfig:
    """`specdec bench`'s flags as the bench's config; the run's kind (--serve, --soak, ...) is the caller's choice
    of function."""
    from specdec.bench.config import BenchConfig, parse_counts, parse_dtypes

    return config_from(BenchConfig, args,
                       batch_sizes=parse_counts(args.batch_sizes, "--batch-sizes", "1,4,16"),
                       concurrency=parse_counts(args.concurrency, "--concurrency", "1,4,16,64"),
                       dtypes=parse_dtypes(args.dtypes) if args.dtypes is not None else None,
                       replicas=parse_counts(args.replicas, "--replicas", "0,1,2", least=0) if args.replicas else None)


def tune_config(args: argparse.Namespace) -> TuneConfig:
    from specdec.bench.config import TuneConfig, parse_counts

    return config_from(TuneConfig, args, batch_sizes=parse_counts(args.batch_sizes, "--batch-sizes", "1,4,16"))


def train_config(args: argparse.Namespace) -> TrainConfig:
    """`specdec train`'s flags as the trainer's config: every flag but the launcher's own (--nproc) is a field."""
    from specdec.training.config import TrainConfig

    return config_from(TrainConfig, args)


def launch_ranks(nproc: int, argv: list[str]) -> int:
    """`specdec train --nproc N`: the same command on N data-parallel ranks under torchrun (one machine)."""
    import subprocess

    rest, skip = [], False
    for a in argv:  # the same arguments without --nproc
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            rest.append(a)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={nproc}", "-m", "specdec.cli", *rest]).returncode


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            cmd_generate(args)
        elif args.command == "serve":
            cmd_serve(args)
        elif args.command == "bench" and args.soak:
            from specdec.bench.soak import run_soak

            run_soak(bench_config(args))
        elif args.command == "bench" and args.serve and args.replicas:
            from specdec.bench.serve import run_replica_bench

            run_replica_bench(bench_config(args))
        elif args.command == "bench" and args.serve:
            from specdec.bench.serve import run_serve_bench

            run_serve_bench(bench_config(args))
        elif args.command == "bench" and args.structured:
            from specdec.bench.structured import run_structured_bench

            run_structured_bench(bench_config(args))
        elif args.command == "bench" and args.agent:
            from specdec.bench.agent import run_agent_bench

            run_agent_bench(bench_config(args))
        elif args.command == "bench":
            from specdec.bench.offline import run_bench

            run_bench(bench_config(args))
        elif args.command == "train" and args.nproc > 1 and "WORLD_SIZE" not in os.environ:
            return launch_ranks(args.nproc, argv if argv is not None else sys.argv[1:])
        elif args.command == "train":
            from specdec.training.train import run_train

            run_train(train_config(args))
        elif args.command == "distill":
            cmd_distill(args)
        elif args.command == "convert-head":
            cmd_convert_head(args)
        elif args.command == "tune":
            from specdec.bench.tune import run_tune

            run_tune(tune_config(args))
    except SpecdecError as e:
        print(f"specdec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
