"""Train the default model's EAGLE-3 head on the target's own answers, on one borrowed GPU, in one command
(issue 40). Three phases, each under a wall-clock budget so that the command ends in time:

  1. answers   the target answers the training prompts, batched by prompt length (transformers from the GGUF
               in bfloat16, or specdec's own engine: `--generator`, by default the faster of the two): greedily,
               except every `--sampled-every`-th batch at temperature 0.7. These are the training data, and
               the greedy ones are a drafting corpus (`answers-*.npz`).
  2. training  batches of answers, right-padded; the target runs once per batch under inference mode for its
               layer 2 / 15 / 27 outputs, its last layer's output and its logits over the draft vocabulary;
               the head (float32 weights, bfloat16 autocast) unrolls `--ttt-steps` draft steps
               (`Eagle3Head.unroll`, the serving layers) and fits specdec's loss (`specdec.training.train`:
               CE against the target's distribution + SmoothL1 to its last layer, step s weighted 0.8^(s-1)),
               token-averaged. Warm start from `--init`; linear warm-up, then a cosine decay to a tenth over
               the time budget.
  3. curve     every `--eval-every` seconds: on held-out answers (never trained on), per draft step, how often
               the head's top-1 / top-2 / top-4 hold the target's top-1 (step 1's top-1 is the greedy first-position
               acceptance), against the tokens trained on. The best head by step-1 top-1 is the one saved.

Writes to --out: head/ (config.json + two bfloat16 safetensors shards: the device returns files of at most
16 MiB), train_log.json (settings, timings, the curve) and answers-*.npz (prompt index, answer ids, sampled).
Answers accumulate across runs: `--answers` takes the answers-*.npz of earlier runs (carry them), their prompts
are not answered again, and the new run's answers-*.npz hold them all. The held-out prompts are the first of the
seeded order in every run.

    # here, once: the first user turn of every training conversation (the device cannot read ../shared)
    python tools/train_head_gpu.py prompts --data-dir ../shared/data/train --out .dev/p3/prompts.jsonl.gz
    # on the GPU (after prep.sh's env.sh):
    python3 tools/train_head_gpu.py train --prompts .dev/p3/prompts.jsonl.gz --out $OUT \\
        --answers specdec/data/answers/*.npz
    # dry run on CPU (checks the script, not the figures):
    python tools/train_head_gpu.py train --prompts .dev/p3/prompts.jsonl.gz --out /tmp/head-dry --device cpu \\
        --dtype float32 --max-prompts 40 --held-out 8 --max-new-tokens 24 --gen-batch 8 --gen-seconds 60 \\
        --train-seconds 30 --eval-every 10 --batch-tokens 512
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gzip
import json
import math
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.config import ModelConfig  # noqa: E402
from specdec.models.eagle3 import Eagle3Head, default_aux_layers  # noqa: E402
from specdec.models.head_files import init_random  # noqa: E402
from specdec.models.loader import load_tokenizer, resolve  # noqa: E402
from specdec.training.train import TTT_DECAY, draft_vocabulary, head_loss, lr_factor, warm_start  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "specdec" / "data"
SHARD_TOKENS = 5_000_000  # answer tokens per answers-*.npz (uint16, compressed: well under 16 MiB)


def log(*parts: object) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *parts, flush=True)


# ------------------------------------------------------------------------------------------------ prompts
def first_turns(data_dir: Path) -> list[dict]:
    """{"source", "prompt"}: the first user turn of every conversation in data_dir/*.jsonl, in the order of the
    exported prompts file (answers name their prompts by index into it)."""
    rows = []
    for path in sorted(Path(data_dir).glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").split("\n"):
            if line.strip():
                messages = json.loads(line)["messages"]
                user = next((m["content"] for m in messages if m["role"] == "user"), None)
                if user:
                    rows.append({"source": path.stem, "prompt": user})
    return rows


def export_prompts(data_dir: Path, out: Path) -> None:
    """The first user turns (`first_turns`) as gzipped JSON lines."""
    rows = first_turns(data_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(out, "wt", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"{len(rows)} prompts from {data_dir} -> {out} ({out.stat().st_size / 1e6:.1f} MB)")


def read_prompts(path: Path) -> list[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


# ------------------------------------------------------------------------------------------------ target
class Target:
    """The target in transformers, with forward hooks that keep the outputs of the head's feature layers and
    of the last layer (before the final norm)."""

    def __init__(self, model_name: str, device: str, dtype: torch.dtype, aux: tuple[int, ...] | None) -> None:
        from transformers import AutoModelForCausalLM

        src = resolve(model_name)
        self.tokenizer = load_tokenizer(src)
        kwargs = {"gguf_file": src.gguf_file.name} if src.gguf_file is not None else {}
        self.model = AutoModelForCausalLM.from_pretrained(str(src.path), dtype=dtype, **kwargs).to(device).eval()
        hf = self.model.config.to_dict()
        self.config = ModelConfig.from_hf(hf)
        n = self.config.num_hidden_layers
        self.aux = tuple(aux) if aux else default_aux_layers(n)
        self.captured: dict[int, torch.Tensor] = {}
        for i in {*self.aux, n - 1}:
            self.model.model.layers[i].register_forward_hook(self._keep(i))
        eos = self.model.generation_config.eos_token_id
        self.eos = sorted({*(eos if isinstance(eos, list) else [eos] if eos is not None else []),
                           self.tokenizer.eos_token_id} - {None})
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos[0]

    def _keep(self, i: int):
        def hook(module: torch.nn.Module, args: object, out: object) -> None:
            self.captured[i] = out[0] if isinstance(out, tuple) else out
        return hook

    def chat(self, prompt: str) -> list[int]:
        """Exactly `specdec.LLM.apply_chat_template` of one user turn."""
        text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                  add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    @torch.inference_mode()
    def answer(self, batch: list[list[int]], max_new: int, temperature: float) -> list[list[int]]:
        """Answers to a batch of prompts (left-padded), each up to and including its first EOS."""
        width = max(len(p) for p in batch)
        dev = self.model.device
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in batch], device=dev)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=dev)
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 \
            else {"do_sample": False}
        out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                                  pad_token_id=self.pad, eos_token_id=self.eos, **sampling)[:, width:].tolist()
        answers = []
        for row in out:
            end = next((j + 1 for j, t in enumerate(row) if t in self.eos), len(row))
            answers.append(row[:end])
        return answers

    @torch.no_grad()  # not inference mode: these tensors feed the head's autograd graph
    def outputs(self, ids: torch.Tensor, lm_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ids [B, T] (right-padded) -> features [B, T, 3H], last layer's output [B, T, H] (float32), logits over
        the draft vocabulary [B, T, Vd] (float32)."""
        normed = self.model.model(input_ids=ids).last_hidden_state
        features = torch.cat([self.captured[i] for i in self.aux], -1).float()
        last = self.captured[self.config.num_hidden_layers - 1].float()
        return features, last, (normed @ lm_rows.T).float()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.model.model.embed_tokens(ids).float()


# ------------------------------------------------------------------------------------------------ phase 1
class Answerer:
    """Who answers the prompts: transformers' `generate` ("hf": padded batches, each decoding until its longest
    answer ends) or specdec's own engine ("specdec": continuous batching over paged K/V, CUDA graphs on a GPU).
    With "auto" the first batch goes to specdec's engine and the second to transformers, and whichever made more
    answer tokens a second answers the rest; an error in specdec's engine hands everything to transformers."""

    def __init__(self, target: Target, args: argparse.Namespace) -> None:
        self.target, self.args = target, args
        self.choice = None if args.generator == "auto" else args.generator
        self.speed: dict[str, float] = {}
        self.llm = None

    def answer(self, batch: list[list[int]], temperature: float, seed: int) -> list[list[int]]:
        name = self.choice or next((n for n in ("specdec", "hf") if n not in self.speed), None)
        if name is None:
            self.choice = name = max(self.speed, key=self.speed.get)
            log(f"answering with {name}: " + ", ".join(f"{n} {v:.0f} tok/s" for n, v in self.speed.items()))
        start = time.perf_counter()
        try:
            answers = (self._specdec(batch, temperature, seed) if name == "specdec" else
                       answer_split(self.target, batch, self.args.max_new_tokens, temperature))
        except Exception as e:  # noqa: BLE001  the fallback is the point: transformers answers instead
            if name != "specdec" or self.args.generator == "specdec":
                raise
            log(f"specdec's engine failed ({type(e).__name__}: {e}); transformers answers")
            self.choice = "hf"
            return self.answer(batch, temperature, seed)
        if self.choice is None:
            self.speed[name] = sum(map(len, answers)) / (time.perf_counter() - start)
        return answers

    def _specdec(self, batch: list[list[int]], temperature: float, seed: int) -> list[list[int]]:
        from specdec import LLM, SamplingParams

        if self.llm is None:
            self.llm = LLM(self.args.model, dtype=self.args.dtype, device=self.args.device,
                           speculative_config="off", max_num_seqs=min(self.args.gen_batch, 512),
                           max_num_batched_tokens=16384, kv_cache_memory_gb=self.args.gen_kv_gb)
        params = [SamplingParams(temperature=temperature, max_tokens=self.args.max_new_tokens,
                                 seed=seed * 100_003 + j if temperature > 0 else None) for j in range(len(batch))]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in batch], params)
        eos = set(self.target.eos)
        return [list(o.token_ids)[:next((j + 1 for j, t in enumerate(o.token_ids) if t in eos), len(o.token_ids))]
                for o in outs]


def make_answers(target: Target, prompts: list[str], args: argparse.Namespace, deadline: float
                 ) -> list[tuple[int, list[int], list[int], bool]]:
    """(prompt index, prompt ids, answer ids, sampled) for as many prompts as the budget allows, in order."""
    done: list[tuple[int, list[int], list[int], bool]] = []
    answerer = Answerer(target, args)
    chunk = args.gen_batch * 8  # prompts are sorted by length within a chunk, so a batch pads little
    batches = tokens = 0
    start = time.perf_counter()
    for c in range(0, len(prompts), chunk):
        enc = [(i, target.chat(prompts[i])) for i in range(c, min(c + chunk, len(prompts)))]
        enc = sorted([e for e in enc if len(e[1]) <= args.max_prompt_tokens], key=lambda e: len(e[1]))
        b = 0
        while b < len(enc):
            if time.perf_counter() > deadline:
                return done
            width = len(enc[min(b + args.gen_batch, len(enc)) - 1][1])  # the longest prompt of the batch
            size = max(1, min(args.gen_batch, args.gen_prefill_tokens // width))
            batch = enc[b:b + size]
            b += size
            sampled = args.sampled_every > 0 and batches % args.sampled_every == args.sampled_every - 1
            answers = answerer.answer([p for _, p in batch], 0.7 if sampled else 0.0, args.seed * 1_000_003 + batches)
            done.extend((i, p, a, sampled) for (i, p), a in zip(batch, answers))
            batches += 1
            tokens += sum(len(a) for a in answers)
            if batches % 10 == 0:
                el = time.perf_counter() - start
                log(f"answers: {len(done)} prompts, {tokens} answer tokens, {tokens / el:.0f} tok/s")
    return done


def answer_split(target: Target, batch: list[list[int]], max_new: int, temperature: float) -> list[list[int]]:
    """target.answer, halving the batch when the GPU runs out of memory."""
    try:
        return target.answer(batch, max_new, temperature)
    except torch.OutOfMemoryError:
        if len(batch) == 1:
            raise
        torch.cuda.empty_cache()
        log(f"out of memory answering {len(batch)} prompts: halving")
        half = len(batch) // 2
        return (answer_split(target, batch[:half], max_new, temperature)
                + answer_split(target, batch[half:], max_new, temperature))


def prompts_digest_of(prompts: list[str]) -> str:
    """sha256 of the prompts: answers name their prompts by index into the prompts file."""
    import hashlib

    return hashlib.sha256("\n".join(prompts).encode()).hexdigest()


def save_answers(out: Path, answers: list[tuple[int, list[int], list[int], bool]], digest: str) -> list[str]:
    """answers-K.npz: prompt_index [N] int32 (lines of the prompts file whose sha256 is `prompts_sha256`),
    offsets [N+1] int64, answer_ids uint16, sampled [N] bool; at most SHARD_TOKENS answer tokens a file."""
    names, shard, size = [], [], 0
    for a in answers + [None]:
        if a is None or (shard and size + len(a[2]) > SHARD_TOKENS):
            if shard:
                name = f"answers-{len(names)}.npz"
                np.savez_compressed(out / name, prompt_index=np.array([s[0] for s in shard], np.int32),
                                    offsets=np.cumsum([0] + [len(s[2]) for s in shard]).astype(np.int64),
                                    answer_ids=np.array([t for s in shard for t in s[2]], np.uint16),
                                    sampled=np.array([s[3] for s in shard], bool), prompts_sha256=np.array(digest))
                names.append(name)
            shard, size = [], 0
        if a is not None:
            shard.append(a)
            size += len(a[2])
    return names


def load_answers(files: list[str], target: Target, prompts: list[str], wanted: set[int]
                 ) -> dict[int, tuple[list[int], list[int], bool]]:
    """Answers of earlier runs (answers-*.npz), by prompt index: (prompt ids, answer ids, sampled); only the
    prompts in `wanted`. Files made from another prompts file are refused."""
    got: dict[int, tuple[list[int], list[int], bool]] = {}
    digest = None
    for f in files:
        z = np.load(f)
        if "prompts_sha256" in z:
            digest = digest or prompts_digest_of(prompts)
            if str(z["prompts_sha256"]) != digest:
                raise SystemExit(f"{f} answers another prompts file")
        off, ids = z["offsets"], z["answer_ids"].astype(np.int64)
        for k, (i, s) in enumerate(zip(z["prompt_index"].tolist(), z["sampled"].tolist())):
            if i in wanted and i < len(prompts):
                got[i] = (target.chat(prompts[i]), ids[off[k]:off[k + 1]].tolist(), bool(s))
    if files:
        log(f"{len(got)} earlier answers from {len(files)} files")
    return got


# ------------------------------------------------------------------------------------------------ phase 2
def batches_of(samples: list[tuple[list[int], int]], batch_tokens: int, rng: random.Random
               ) -> list[list[tuple[list[int], int]]]:
    """Samples (ids, answer start) grouped by similar length into batches of at most batch_tokens padded tokens,
    in a random order."""
    order = sorted(samples, key=lambda s: len(s[0]))
    out, cur = [], []
    for s in order:
        if cur and (len(cur) + 1) * max(len(s[0]), len(cur[-1][0])) > batch_tokens:
            out.append(cur)
            cur = []
        cur.append(s)
    if cur:
        out.append(cur)
    rng.shuffle(out)
    return out


def pad(batch: list[tuple[list[int], int]], pad_id: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, T] right-padded and the loss mask [B, T] (answer tokens)."""
    T = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(batch), T, dtype=torch.bool)
    for b, (s, start) in enumerate(batch):
        ids[b, :len(s)] = torch.tensor(s)
        mask[b, start:len(s)] = True
    return ids.to(device), mask.to(device)


def batch_loss(head: Eagle3Head, target: Target, ids: torch.Tensor, mask: torch.Tensor, lm_rows: torch.Tensor,
               args: argparse.Namespace, autocast: contextlib.AbstractContextManager
               ) -> tuple[torch.Tensor, list[dict]]:
    """specdec's loss (`train.head_loss`, as `train.sequence_loss` weighs it) over a batch: row t pairs feature t with
    token t + 1's embedding and is fitted to the target at t + 1 (token t + 2), for every unrolled step; per step,
    its stats: top-1 / top-2 / top-4 agreement with the target's own top-1 over the draft vocabulary (a token
    outside it is never drafted) and the row count."""
    features, last, logits = target.outputs(ids, lm_rows)
    T = ids.shape[1]
    rows = T - 2
    embeds = target.embed(ids[:, 1:1 + rows])
    with autocast:
        outs = head.unroll(embeds, features[:, :rows], args.ttt_steps)
    goal, goal_logits = last[:, 1:1 + rows].flatten(0, 1), logits[:, 1:1 + rows].flatten(0, 1)
    loss, stats = 0.0, []
    for s, out in enumerate(outs):
        m = mask[:, 2:2 + rows].clone()
        m[:, :s] = False
        if not m.any():
            continue
        with autocast:
            step_loss, step_stats = head_loss(head, out.flatten(0, 1), goal, goal_logits, m.flatten(), None,
                                              (args.ce_weight, args.regression_weight))
        loss = loss + TTT_DECAY ** s * step_loss
        stats.append(step_stats)
    return loss, stats


def evaluate(head: Eagle3Head, target: Target, held: list[list[tuple[list[int], int]]], lm_rows: torch.Tensor,
             args: argparse.Namespace, autocast: contextlib.AbstractContextManager) -> dict:
    """Per draft step, top-1 / top-2 / top-4 agreement with the target on held-out answers (token-weighted).
    The draft vocabulary's coverage of the target's top-1 is counted: agreement is with the target's top-1 over
    its whole vocabulary only when that token is in the draft vocabulary."""
    keys = ("top1", "top2", "top4")
    totals: dict[int, list[float]] = {}
    with torch.no_grad():
        for batch in held:
            ids, mask = pad(batch, target.pad, args.device)
            _, stats = batch_loss(head, target, ids, mask, lm_rows, args, autocast)
            for s, st in enumerate(stats):
                acc = totals.setdefault(s, [0.0] * (len(keys) + 1))
                for j, k in enumerate(keys):
                    acc[j] += st[k] * st["n"]
                acc[-1] += st["n"]
    return {f"step{s + 1}": {**{k: round(acc[j] / acc[-1], 4) for j, k in enumerate(keys)}, "rows": int(acc[-1])}
            for s, acc in sorted(totals.items()) if acc[-1]}


# ------------------------------------------------------------------------------------------------ main
def train(args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    target = Target(args.model, args.device, dtype, None)
    log(f"target on {args.device} in {args.dtype}: {time.perf_counter() - t0:.1f} s; aux layers {target.aux}, "
        f"eos {target.eos}; device {torch.cuda.get_device_name(0) if args.device == 'cuda' else 'cpu'}")
    prompts = read_prompts(Path(args.prompts))
    order = list(range(len(prompts)))
    random.Random(args.seed).shuffle(order)
    reserved = {json.loads(line)["turns"][0] for f in args.exclude
                for line in Path(f).read_text(encoding="utf-8").splitlines() if line.strip()}
    order = [i for i in order if prompts[i] not in reserved]  # evaluation prompts are never answered nor trained on
    if args.max_prompts:
        order = order[:args.max_prompts]

    # 1. answers: earlier ones (--answers) first, then new ones for the prompts not answered yet
    t1 = time.perf_counter()
    earlier = load_answers(args.answers, target, prompts, set(order))
    todo = [i for i in order if i not in earlier]
    new = make_answers(target, [prompts[i] for i in todo], args, t1 + args.gen_seconds)
    rank = {i: r for r, i in enumerate(order)}
    got = sorted([(i, p, a, s) for i, (p, a, s) in earlier.items()] +
                 [(todo[j], p, a, s) for j, p, a, s in new], key=lambda g: rank[g[0]])  # in the seeded order
    gen_s = time.perf_counter() - t1
    new_tokens = sum(len(a) for _, _, a, _ in new)
    n_tokens = sum(len(a) for _, _, a, _ in got)
    log(f"answers: {len(new)} new prompts, {new_tokens} new answer tokens in {gen_s:.0f} s "
        f"({new_tokens / gen_s:.0f} tok/s); with {len(earlier)} earlier ones: {len(got)} prompts, {n_tokens} tokens")
    answer_files = save_answers(out, got, prompts_digest_of(prompts))
    held_n = min(args.held_out, len(got) // 4)
    # the first prompts of the seeded order are held out, the same ones in every run: never trained on
    held_samples = [(p + a, len(p)) for _, p, a, _ in got[:held_n]]
    train_samples = [(p + a, len(p)) for _, p, a, _ in got[held_n:]]
    def fits(samples: list[tuple[list[int], int]]) -> list[tuple[list[int], int]]:
        return [(ids[:args.max_len], start) for ids, start in samples if start + 2 < min(len(ids), args.max_len)]

    train_samples, held_samples = fits(train_samples), fits(held_samples)

    # the draft vocabulary: the most frequent answer tokens (`train.draft_vocabulary`); a resumed run keeps its own
    state_path = Path(args.state or out) / "trainer_state.pt"
    state_path.parent.mkdir(parents=True, exist_ok=True)
    st = torch.load(state_path, weights_only=False) if args.resume and state_path.is_file() else None
    V = target.config.vocab_size
    draft_ids = st["draft_ids"] if st is not None else draft_vocabulary(
        [(ids, [j >= start for j in range(len(ids))]) for ids, start in train_samples], min(args.draft_vocab, V), V)
    size = len(draft_ids)
    answer_tokens = np.array([t for ids, start in train_samples for t in ids[start:]], np.int64)
    coverage = np.isin(answer_tokens, draft_ids.numpy()).mean() if len(answer_tokens) else 1.0
    log(f"draft vocabulary {size}: covers {coverage:.4f} of the answer tokens")

    head = Eagle3Head(dataclasses.replace(target.config, num_hidden_layers=1), size, target.aux,
                      torch.float32, args.device)
    init_random(list(head.parameters()))
    lm_head_full = target.model.get_output_embeddings().weight
    head.lm_head.data.copy_(lm_head_full[draft_ids.to(args.device)].float())
    head.d2t.copy_((draft_ids - torch.arange(size)).to(args.device))
    if st is not None:
        head.load_state_dict(st["head"])
        log(f"resumed from {state_path}: {st['tokens']} tokens, {st['elapsed']:.0f} s trained")
    elif args.init.lower() != "none":
        warm_start(head, Eagle3Head.load(args.init, target.config, torch.float32, args.device))
        log(f"warm start from {args.init}")
    lm_rows = lm_head_full[draft_ids.to(args.device)].detach()
    params = [p for p in head.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95))
    # bfloat16 matmuls for the head wherever the target runs in bfloat16 (on a CPU: 1.5x the float32 speed
    # where the cores have AVX512-BF16, e.g. Zen 4)
    autocast = torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16) \
        if dtype == torch.bfloat16 else contextlib.nullcontext()
    held = batches_of(held_samples, args.batch_tokens, random.Random(0))

    # 2. training, 3. the curve; --train-seconds counts every run of a resumed training
    t2 = time.perf_counter()
    if st is None:
        step = tokens = epoch = position = 0
        planned, elapsed0 = None, 0.0  # optimizer steps the budget allows: estimated after the first 20
        if args.skip_tokens:  # an earlier run trained on these batches and its trainer state is gone
            first = batches_of(train_samples, args.batch_tokens, random.Random(args.seed * 1000))
            while position < len(first) and tokens < args.skip_tokens:
                tokens += sum(len(ids) - start for ids, start in first[position])
                position += 1
            log(f"skipped the first {position} batches of epoch 0 ({tokens} answer tokens)")
        curve = [{"tokens": tokens, "seconds": 0.0, **evaluate(head, target, held, lm_rows, args, autocast)}]
        log(f"eval at {tokens} tokens:", json.dumps(curve[-1]))
        best = (curve[-1]["step1"]["top1"] if "step1" in curve[-1] else -1.0, copy.deepcopy(head.state_dict()),
                tokens)
    else:
        opt.load_state_dict(st["optimizer"])
        curve, best, planned, elapsed0 = st["curve"], st["best"], st["planned"], st["elapsed"]
        step, tokens, epoch, position = st["step"], st["tokens"], st["epoch"], st["position"]

    def trained_s() -> float:
        return elapsed0 + time.perf_counter() - t2

    def save_state() -> None:
        tmp = state_path.with_suffix(".tmp")
        torch.save({"head": head.state_dict(), "optimizer": opt.state_dict(), "draft_ids": draft_ids, "step": step,
                    "tokens": tokens, "epoch": epoch, "position": position, "planned": planned, "curve": curve,
                    "best": best, "elapsed": trained_s()}, tmp)
        tmp.replace(state_path)

    next_eval, next_save, last_stats = t2 + args.eval_every, t2 + args.save_every, []
    lr = args.lr
    while trained_s() < args.train_seconds:
        # each epoch's batches in an order fixed by the seed, so a resumed run goes on where it stopped
        batches = batches_of(train_samples, args.batch_tokens, random.Random(args.seed * 1000 + epoch))
        while position < len(batches) and trained_s() < args.train_seconds:
            if step == 20 and planned is None:
                planned = max(int(20 * args.train_seconds / trained_s()), 40)
            lr = args.lr * (lr_factor(step + 1, planned, args.warmup, "cosine") if planned
                            else min((step + 1) / args.warmup, 1.0))
            for g in opt.param_groups:
                g["lr"] = lr
            ids, mask = pad(batches[position], target.pad, args.device)
            position += 1
            loss, last_stats = batch_loss(head, target, ids, mask, lm_rows, args, autocast)
            if not isinstance(loss, torch.Tensor):
                continue
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, args.clip_grad).item()
            if math.isfinite(grad_norm):
                opt.step()
            step += 1
            tokens += int(mask.sum())
            if time.perf_counter() > next_eval:
                next_eval = time.perf_counter() + args.eval_every
                point = {"tokens": tokens, "seconds": round(trained_s(), 1), "step": step, "epoch": epoch,
                         "lr": lr, "train": last_stats[:1],
                         **evaluate(head, target, held, lm_rows, args, autocast)}
                curve.append(point)
                log("eval:", json.dumps(point))
                if point.get("step1", {}).get("top1", -1) > best[0]:
                    best = (point["step1"]["top1"], copy.deepcopy(head.state_dict()), tokens)
            if time.perf_counter() > next_save:
                next_save = time.perf_counter() + args.save_every
                save_state()
        if position >= len(batches):
            epoch, position = epoch + 1, 0
    final = {"tokens": tokens, "seconds": round(trained_s(), 1), "step": step, "epoch": epoch,
             **evaluate(head, target, held, lm_rows, args, autocast)}
    curve.append(final)
    log("final eval:", json.dumps(final))
    if final.get("step1", {}).get("top1", -1) >= best[0]:
        best = (final["step1"]["top1"], head.state_dict(), tokens)
    save_state()
    head.load_state_dict(best[1])
    save_head(head, out / "head")
    summary = {"settings": vars(args), "answers": {"prompts": len(got), "answer_tokens": n_tokens,
                                                   "new_prompts": len(new), "new_answer_tokens": new_tokens,
                                                   "seconds": round(gen_s, 1), "files": answer_files,
                                                   "sampled": sum(s for *_, s in got)},
               "held_out_prompts": held_n, "draft_vocab_coverage": float(coverage),
               "trained": {"optimizer_steps": step, "tokens": tokens, "epochs": epoch,
                           "seconds": round(trained_s(), 1)},
               "saved": {"step1_top1": best[0], "at_tokens": best[2]}, "curve": curve,
               "total_seconds": round(time.perf_counter() - t0, 1)}
    (out / "train_log.json").write_text(json.dumps(summary, indent=1))
    log(f"saved the head ({best[0]} step-1 top-1, at {best[2]} tokens) to {out / 'head'}; "
        f"total {summary['total_seconds']} s")


def save_head(head: Eagle3Head, path: Path) -> None:
    """The head in specdec's layout (config.json + safetensors), bfloat16, in two shards (the LM head alone)."""
    from safetensors.torch import save_file

    head.save(path)  # config.json + model.safetensors (float32)
    (path / "model.safetensors").unlink()
    sd = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in head.state_dict_reference().items()}
    lm = {"lm_head.weight": sd.pop("lm_head.weight")}
    save_file(sd, str(path / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file(lm, str(path / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prompts", help="export the training prompts (first user turns)")
    p.add_argument("--data-dir", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    t = sub.add_parser("train", help="answers, training and the curve, in one command")
    t.add_argument("--prompts", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--model", default="smollm2-135m")
    t.add_argument("--init", default=str(Path(__file__).resolve().parents[1] / "specdec/heads/smollm2-135m-eagle3"),
                   help="warm start from this head ('none': from the target's LM head rows alone)")
    t.add_argument("--device", default="cuda")
    t.add_argument("--dtype", default="bfloat16")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--max-prompts", type=int, default=0)
    t.add_argument("--exclude", nargs="*",
                   default=[str(DATA / "tune_prompts.jsonl"), str(DATA / "chat_code_prompts.jsonl")],
                   help="prompt sets ({'turns': [...]} lines) whose prompts are never answered nor trained on")
    t.add_argument("--max-prompt-tokens", type=int, default=1024)
    t.add_argument("--max-new-tokens", type=int, default=256)
    t.add_argument("--gen-batch", type=int, default=1024, help="prompts answered together, at most")
    t.add_argument("--gen-prefill-tokens", type=int, default=600_000,
                   help="at most this many (padded) prompt tokens in one batch")
    t.add_argument("--generator", choices=["auto", "hf", "specdec"], default="auto",
                   help="who answers: transformers' generate, specdec's engine, or the faster of the two")
    t.add_argument("--gen-kv-gb", type=float, default=24.0, help="K/V memory of specdec's engine when it answers")
    t.add_argument("--answers", nargs="*", default=[], help="answers-*.npz of earlier runs (the same --prompts)")
    t.add_argument("--sampled-every", type=int, default=5, help="every k-th batch of answers sampled at 0.7")
    t.add_argument("--gen-seconds", type=float, default=170)
    t.add_argument("--held-out", type=int, default=256)
    t.add_argument("--max-len", type=int, default=1280)
    t.add_argument("--draft-vocab", type=int, default=8192)
    t.add_argument("--train-seconds", type=float, default=170)
    t.add_argument("--batch-tokens", type=int, default=16384)
    t.add_argument("--ttt-steps", type=int, default=5)
    t.add_argument("--lr", type=float, default=3e-4)
    t.add_argument("--warmup", type=int, default=30)
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--clip-grad", type=float, default=0.5)
    t.add_argument("--ce-weight", type=float, default=1.0)
    t.add_argument("--regression-weight", type=float, default=0.1)
    t.add_argument("--eval-every", type=float, default=25)
    t.add_argument("--save-every", type=float, default=600, help="seconds between checkpoints (trainer_state.pt)")
    t.add_argument("--state", default=None, help="where trainer_state.pt goes (default: --out)")
    t.add_argument("--skip-tokens", type=int, default=0,
                   help="without a trainer state: start epoch 0 after the batches holding this many answer tokens "
                        "(an earlier run's, warm-started from its head with --init)")
    t.add_argument("--resume", action="store_true",
                   help="go on from --out's trainer_state.pt (the CPU pipeline, across sessions)")
    args = ap.parse_args(argv)
    if args.cmd == "prompts":
        export_prompts(args.data_dir, args.out)
    else:
        train(args)


if __name__ == "__main__":
    main()
