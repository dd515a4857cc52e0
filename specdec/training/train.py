"""`specdec train`: fit a draft head (eagle3, eagle, mtp, medusa) to a frozen target by online distillation.

For every training conversation the target (our own serving runtime) runs once and yields, per token t,
the head's input features (EAGLE-3: its low/mid/high layer outputs; EAGLE-1 / MTP: its final hidden state),
its hidden state h_t (EAGLE-3: the last layer's output; others: after the final norm) and its logits.
Medusa head i reads the target's final hidden state of token t and predicts token t + i + 2.
The head's row t pairs feature t with the embedding of token t + 1 and predicts token t + 2, so it is
trained against the target at t + 1 (the Meta report's equation 1, shifted by one):

    loss = 0.1 * CE(softmax(target logits_(t+1) over the draft vocabulary), head logits_t)
         + 1.0 * SmoothL1(head output_t, target h_(t+1))

averaged over the assistant tokens. With `--ttt-steps K` (EAGLE-3's training-time test) the head is also
unrolled K - 1 more times on its own outputs, exactly as serving drafts tokens 2..K, each step's loss
weighted 0.8^(s-1). The weights 0.1 / 1.0 are `--ce-weight` / `--regression-weight`. AdamW (weight decay 0.1),
lr 2e-4 after a linear warmup, then a cosine decay to a tenth (`--schedule`); gradients clipped to norm 0.5;
`--batch` conversations per optimizer step; `--epochs` passes, each in a fresh seeded order. The
draft vocabulary is the most frequent assistant tokens of the training data. `--regenerate` replaces the
assistant turns with the target's own greedy answers (self-distillation). Checkpoints (the head in the
serving layout, plus optimizer state and position) are written every `--save-every` steps and at the end;
`--resume` continues from the last one. Validation measures the acceptance length with the real engine.

`--objective` picks the distribution term in place of CE (`distribution_term`: top-K distillation, the log of the
sampled acceptance rate, or CE replayed on the rows the head's own draft gets wrong). Trained on answers
(`--distilled`, or `--from-traffic`: the requests a server recorded), `--held-out` answers are never trained on and
every `--eval-every` updates give a point of the curve: per unrolled step, how often the head's top-1 / 2 / 4 hold
the target's own top-1 on them, against the answer tokens trained on; the best head so far is kept in OUT/best.
`--train-seconds` stops a run with a checkpoint.

Each flag is a field of `TrainConfig` (`specdec.training.config`), which a library caller builds directly.

Data parallel: under `torchrun --nproc-per-node N -m specdec.cli train ...` (or `specdec train --nproc N`,
which starts it) the N ranks deal every `--batch` of conversations round-robin, each runs the target on its
own conversations only, and the summed gradients are all-reduced (gloo, or nccl on CUDA) before the one
optimizer step every rank takes: the same update as one process with the same `--batch` (the same global
batch), up to the order the gradients are added in. DistributedDataParallel's module wrapper is not used
because a head's loss is not one forward call (unrolled steps, several terms); the gradients are averaged
at the same point it would. Rank 0 alone writes checkpoints, logs and validates; a checkpoint holds the
global position, so a run resumes with any number of ranks.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import math
import random
import sys
import time
import zlib
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from specdec.config import SamplingParams, SpecdecError
from specdec.training.config import TrainConfig, head_class
from specdec.training.curve import curve_point, held_out_outputs
from specdec.training.losses import sequence_loss
from specdec.training.targets import FeatureCache

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from specdec.llm import LLM
    from specdec.models.llama import LlamaModel


# ---------------------------------------------------------------------------------------------- data
def load_conversations(paths: list[str]) -> list[list[dict]]:
    convs = []
    for p in paths:
        path = Path(p).expanduser()
        if not path.is_file():
            raise SpecdecError(f"training data {path} does not exist")
        for lineno, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
            if not line.strip():
                continue
            try:
                messages = json.loads(line)["messages"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise SpecdecError(f"{path}:{lineno}: expected a JSON object with a 'messages' list") from None
            if any(m.get("role") == "assistant" for m in messages):
                convs.append(messages)
    if not convs:
        raise SpecdecError("the training data holds no conversation with an assistant turn")
    return convs


def tokenize(tokenizer: PreTrainedTokenizerBase, messages: list[dict], max_len: int) -> tuple[list[int], list[bool]]:
    """Chat-templated token ids and, per token, whether it belongs to an assistant turn (the loss mask)."""
    def render(msgs: list[dict], generation_prompt: bool):
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt)
        return tokenizer.encode(text, add_special_tokens=False)

    ids = render(messages, False)
    mask = [False] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            start, end = len(render(messages[:i], True)), len(render(messages[:i + 1], False))
            mask[start:end] = [True] * (end - start)
    return ids[:max_len], mask[:max_len]


def regenerate(llm: LLM, convs: list[list[dict]], max_len: int, cache: Path) -> list[tuple[list[int], list[bool]]]:
    """Self-distillation data: each conversation's first user turn answered by the target itself (greedy,
    batched), as token ids with the answer masked in. Cached on disk, so a resumed run reuses it."""
    if cache.is_file():
        return [tuple(x) for x in json.loads(cache.read_text())]
    prompts = [c[:next(i for i, m in enumerate(c) if m["role"] == "assistant")] for c in convs]
    encoded = [llm.apply_chat_template(p) for p in prompts]
    keep = [i for i, ids in enumerate(encoded) if len(ids) < max_len - 2]
    outs = llm.generate([{"prompt_token_ids": encoded[i]} for i in keep],
                        [SamplingParams(temperature=0, max_tokens=max_len - len(encoded[i])) for i in keep],
                        use_tqdm=True)
    samples = []
    for i, out in zip(keep, outs):
        ids = (encoded[i] + out.token_ids)[:max_len]
        samples.append((ids, [j >= len(encoded[i]) for j in range(len(ids))]))
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(samples))
    return samples


def draft_vocabulary(samples: list[tuple[list[int], list[bool]]], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent assistant tokens (sorted ids); rarer ones are never drafted."""
    counts = Counter(t for ids, mask in samples for t, m in zip(ids, mask) if m)
    chosen = [t for t, _ in counts.most_common(size)]
    for t in range(vocab_size):  # pad with the lowest unseen ids when the data is small
        if len(chosen) >= size:
            break
        if t not in counts:
            chosen.append(t)
    return torch.tensor(sorted(chosen[:size]), dtype=torch.long)


# ---------------------------------------------------------------------------------------------- run
def window(items: list, skip: int, most: int) -> list:
    """The training conversations a run takes of the shuffled ones: `skip` (--skip-conversations), then at most
    `most` (--max-conversations; 0: all), so passes over disjoint parts of a large corpus can follow one another."""
    if skip and skip >= len(items):
        raise SpecdecError(f"--skip-conversations {skip} leaves none of the {len(items)} training conversations")
    items = items[skip:]
    return items[:most] if most else items


def run_train(cfg: TrainConfig) -> dict:
    """Train the head `cfg` describes; returns the run's log (also written to OUT/train_log.json), whose "config"
    is the resolved config it ran with."""
    cfg = cfg.resolved()  # a new config: the caller's stays as given
    rank, world = data_parallel()
    try:
        return _train(cfg, head_class(cfg.method), rank, world)
    finally:  # a gloo group left to the interpreter's exit can abort the process there ("terminate called ...")
        if world > 1:
            from specdec.engine.parallel import destroy_process_groups

            destroy_process_groups()


def _train(cfg: TrainConfig, cls: type, rank: int, world: int) -> dict:
    from specdec.llm import LLM

    if world > 1 and cfg.feature_cache:
        raise SpecdecError("--feature-cache is for one process; with several ranks each runs the target on its "
                           "own conversations")
    torch.manual_seed(cfg.seed)
    # each data-parallel rank holds the whole target
    llm = LLM(cfg.target, dtype=cfg.dtype, device=cfg.device, tensor_parallel_size=1)
    target, tok = llm.target_model, llm.tokenizer
    out_dir, ckpt = Path(cfg.out), Path(cfg.out) / "trainer_state.pt"
    held: list[tuple[list[int], list[bool]]] = []  # answers never trained on: the curve's
    if cfg.distilled or cfg.from_traffic:
        if cfg.distilled:  # the target's own answers, made by `specdec distill` (files or directories)
            from specdec.training import distill

            keyed = distill.keyed_samples(cfg.distilled, cfg.data, llm, cfg.max_len)
        else:  # what a server recorded (`specdec serve --record-traffic DIR`): the prompts and the target's outputs
            keyed = traffic_samples(cfg.from_traffic, target, cfg.max_len)
        keyed = [k for k in keyed if len(k[1]) >= 3 and any(k[2][2:])]
        n_held = min(cfg.held_out, len(keyed) // 5)  # at most a fifth: the rest trains
        # held out: the answers whose key hashes lowest, so that more answers never move a trained one into the
        # held-out set
        keyed.sort(key=lambda k: zlib.crc32(repr(k[0]).encode()))
        held = [(ids, mask) for _, ids, mask in keyed[:n_held]]
        samples = [(ids, mask) for _, ids, mask in keyed[n_held:]]
        random.Random(cfg.seed).shuffle(samples)
        held_out = []  # validation prompts come with conversations; acceptance is measured by `specdec bench`
        samples = window(samples, cfg.skip_conversations, cfg.max_conversations)
    else:
        convs = load_conversations(cfg.data)
        random.Random(cfg.seed).shuffle(convs)
        held_out, train_convs = convs[:cfg.val_prompts], convs[cfg.val_prompts:]
        train_convs = window(train_convs, cfg.skip_conversations, cfg.max_conversations)
        samples = (regenerate(llm, train_convs, cfg.max_len, out_dir / "regenerated.json") if cfg.regenerate
                   else [tokenize(tok, c, cfg.max_len) for c in train_convs])
    samples = [(ids, mask) for ids, mask in samples if len(ids) >= 3 and any(mask[2:])]
    if not samples:
        raise SpecdecError("no training conversation has assistant tokens within --max-len")
    n = len(samples)
    if cfg.epochs:  # the data decides the steps
        cfg = replace(cfg, steps=math.ceil(cfg.epochs * n))
    state = None
    if cfg.resume and ckpt.is_file():
        head = cls.load_for(cfg.method, out_dir, target)
        state = torch.load(ckpt, weights_only=False)
    else:
        init = cls.load_for(cfg.method, cfg.init, target) if cfg.init else None
        if init is not None and hasattr(init, "d2t"):  # a warm start keeps its draft vocabulary
            draft_ids = init.target_ids(torch.arange(init.draft_vocab_size, device=init.d2t.device)).cpu()
        else:
            draft_ids = draft_vocabulary(samples, min(cfg.draft_vocab, target.config.vocab_size),
                                         target.config.vocab_size)
        head = cls.create(cfg.method, target, draft_ids=draft_ids, num_layers=cfg.num_layers,
                          num_heads=cfg.num_heads)
        if init is not None:
            warm_start(head, init)
    if world > 1:  # every rank starts from rank 0's weights (the same seed makes them equal anyway)
        for t in head.state_dict().values():
            torch.distributed.broadcast(t, src=0)
    cache = None
    if cfg.feature_cache:  # the target runs once per sample, before the first step
        cache = FeatureCache(Path(cfg.feature_cache), target, head.aux_layers, samples)
        cache.build()
    params = trainable_parameters(head)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    step, answer_tokens, curve = 0, 0, []
    if state is not None:
        opt.load_state_dict(state["optimizer"])
        step, answer_tokens, curve = state["step"], state.get("answer_tokens", 0), state.get("curve", [])
    updates = -(-cfg.steps // cfg.batch)
    warmup = cfg.warmup if cfg.warmup is not None else min(100, updates // 20)
    lm_rows = target.lm_head[head.target_ids(torch.arange(head.draft_vocab_size))] if hasattr(head, "d2t") else None
    autocast = autocast_context(target.device, cfg.autocast)
    loss_options = cfg.loss_options()
    held_outputs = held_out_outputs(target, head, held) if held and rank == 0 else []

    def evaluate() -> None:  # one point of the curve; the best head so far is kept in out/best
        point = {"answer_tokens": answer_tokens, "step": step,
                 **curve_point(head, target, held, held_outputs, cfg.ttt_steps, autocast)}
        curve.append(point)
        if point["step1"]["top1"] >= max((c["step1"]["top1"] for c in curve), default=-1.0):
            shards = "dtype" in inspect.signature(head.save).parameters  # the shipped layout, where a head has it
            head.save(out_dir / "best", **({"dtype": torch.bfloat16} if shards else {}))
        tqdm.write(f"eval at {answer_tokens} answer tokens: " + json.dumps(point), file=sys.stderr)

    if held_outputs and not curve:
        evaluate()
    history, order, stats = [], None, {}
    bar = tqdm(total=cfg.steps, initial=step, desc=f"train {cfg.method}", file=sys.stderr, disable=rank > 0)
    tokens_seen, start, last_save = 0, time.perf_counter(), step
    while step < cfg.steps:
        if cfg.train_seconds and step % cfg.batch == 0 and time.perf_counter() - start > cfg.train_seconds:
            if rank == 0:  # out of time: a checkpoint to resume from
                save_checkpoint(head, opt, step, out_dir, ckpt, {"answer_tokens": answer_tokens, "curve": curve})
            break
        epoch, i = divmod(step, n)
        if order is None or order[0] != epoch:  # a fresh seeded order every epoch (a resumed run sees the same)
            order = (epoch, random.Random(cfg.seed * 1000 + epoch).sample(range(n), n))
        k = order[1][i]
        ids, mask = samples[k]
        mine = (step % cfg.batch) % world == rank  # a batch's conversations are dealt round-robin
        answer_tokens += sum(mask[2:])
        if mine:
            outputs = cache.outputs(k, logits=False) if cache is not None else None
            with autocast:
                loss, stats = sequence_loss(head, target, ids, mask, loss_options, outputs, lm_rows)
            (loss / cfg.batch).backward()
            tokens_seen += len(ids)
        step += 1
        if step % cfg.batch == 0 or step == cfg.steps:  # one optimizer step per --batch sequences
            if world > 1:
                sum_gradients(params)
            lr = cfg.lr * lr_factor(step // cfg.batch if step % cfg.batch == 0 else updates, updates, warmup,
                                     cfg.schedule)
            for group in opt.param_groups:
                group["lr"] = lr
            if cfg.clip_grad:
                stats["grad_norm"] = torch.nn.utils.clip_grad_norm_(params, cfg.clip_grad).item()
            opt.step()
            opt.zero_grad()
            if held_outputs and ((step // cfg.batch) % cfg.eval_every == 0 or step == cfg.steps):
                evaluate()
            if step - last_save >= cfg.save_every or step == cfg.steps:
                if rank == 0:
                    save_checkpoint(head, opt, step, out_dir, ckpt, {"answer_tokens": answer_tokens, "curve": curve})
                last_save = step
        if mine:
            history.append({"step": step, "epoch": epoch, "lr": opt.param_groups[0]["lr"], "loss": loss.item(),
                            **stats})
            bar.set_postfix(loss=f"{loss.item():.3f}", top1=f"{stats.get('top1', 0):.2f}",
                            tok_s=f"{tokens_seen / (time.perf_counter() - start):.0f}")
        bar.update()
    bar.close()
    if held_outputs and curve[-1]["step"] != step:  # stopped by --train-seconds
        evaluate()
    result = {"steps": step, "history": history[-50:], "world_size": world, "objective": cfg.objective,
              "answer_tokens": answer_tokens, "seconds": round(time.perf_counter() - start, 1), "config": asdict(cfg)}
    if curve:
        result["curve"] = curve
        result["best"] = max(curve, key=lambda c: c["step1"]["top1"])
    if world > 1:
        torch.distributed.barrier()  # rank 0's last checkpoint is on disk before any rank returns
        if rank > 0:
            return result
    if held_out:
        k = min(3, head.max_draft_depth or 3)
        result["validation"] = validate(cfg.target, cfg.method, out_dir, held_out, cfg.val_tokens, k)
        print(json.dumps(result["validation"]))
    (out_dir / "train_log.json").write_text(json.dumps(result, indent=1))
    return result


def traffic_samples(directory: str | Path, target: LlamaModel, max_len: int
                    ) -> list[tuple[tuple[str, int], list[int], list[bool]]]:
    """Training samples from a server's traffic records of this target: prompt + output ids, the output masked
    in, each keyed by (its time, its place in the records)."""
    from specdec.models.loader import model_fingerprint
    from specdec.serving.traffic import read_traffic

    records = read_traffic(directory, model_fingerprint(target))
    if not records:
        raise SpecdecError(f"{directory} holds no traffic of this target (fingerprint {model_fingerprint(target)}): "
                           "record it with `specdec serve --record-traffic DIR` serving this model")
    out = []
    for i, r in enumerate(records):
        ids = (list(r["prompt_ids"]) + list(r["output_ids"]))[:max_len]
        out.append(((str(r.get("time")), i), ids, [j >= len(r["prompt_ids"]) for j in range(len(ids))]))
    return out


def autocast_context(device: torch.device, mode: str) -> contextlib.AbstractContextManager:
    """bfloat16 autocast for the head's matmuls ("bf16"; "auto": on a GPU and on CPUs with AVX512-BF16, where
    it is about twice float32's speed), or none ("off")."""
    if mode == "auto":
        flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
        mode = "bf16" if device.type == "cuda" or "avx512_bf16" in flags else "off"
    if mode == "off":
        return contextlib.nullcontext()
    if mode != "bf16":
        raise SpecdecError(f"invalid --autocast {mode!r}: auto, bf16 or off")
    return torch.autocast(device.type, dtype=torch.bfloat16)


def data_parallel() -> tuple[int, int]:
    """(rank, world size): joins torchrun's ranks (gloo on CPU) when started by it, else (0, 1)."""
    import os

    import torch.distributed as dist

    from specdec.engine.parallel import init_process_group  # torch's, made safe to destroy (see there)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    if not dist.is_initialized():
        init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), dist.get_world_size()


def sum_gradients(params: list[torch.nn.Parameter]) -> None:
    """Every rank's accumulated gradients, summed, on every rank (a rank without a conversation in this batch
    contributes zeros)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        torch.distributed.all_reduce(p.grad)


def lr_factor(update: int, updates: int, warmup: int, schedule: str) -> float:
    """The learning rate of optimizer step `update` (1-based) over the peak: linear warmup over `warmup` steps,
    then constant or a cosine decay to a tenth of the peak at the last step."""
    if update <= warmup:
        return update / max(warmup, 1)
    if schedule == "constant":
        return 1.0
    progress = (update - warmup) / max(updates - warmup, 1)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def warm_start(head: torch.nn.Module, old: torch.nn.Module) -> None:
    """Start `head` from a trained head `old` of the same method and target: every weight it shares; LM head
    rows of the draft tokens both vocabularies hold (the others keep their start from the target's rows). Layers
    the old head lacks (a deeper head, `--num-layers`) start as the identity, their output projections zero, so
    the new head begins by drafting exactly what the old one drafts."""
    new_sd, old_sd = head.state_dict(), old.state_dict()
    for name, value in old_sd.items():
        if name in ("lm_head", "d2t") or name not in new_sd or new_sd[name].shape != value.shape:
            continue
        new_sd[name].copy_(value.to(new_sd[name].dtype))
    for layer in list(getattr(head, "layers", []))[len(getattr(old, "layers", [])):]:
        layer.o_proj.weight.data.zero_()
        layer.down_proj.weight.data.zero_()
    if hasattr(head, "d2t") and hasattr(old, "d2t"):
        ar = lambda h: torch.arange(h.draft_vocab_size, device=h.d2t.device)  # noqa: E731
        new_ids, old_ids = head.target_ids(ar(head)).tolist(), old.target_ids(ar(old)).tolist()
        where = {t: j for j, t in enumerate(old_ids)}
        pairs = [(j, where[t]) for j, t in enumerate(new_ids) if t in where]
        if pairs:
            dst, src = torch.tensor(pairs, device=head.lm_head.device).T
            head.lm_head.data[dst] = old.lm_head.data[src.to(old.lm_head.device)].to(head.lm_head.dtype)


def trainable_parameters(head: torch.nn.Module) -> list[torch.nn.Parameter]:
    return head.trainable_parameters() if hasattr(head, "trainable_parameters") else list(head.parameters())


def save_checkpoint(head: torch.nn.Module, opt: torch.optim.Optimizer, step: int, out_dir: Path, ckpt: Path,
                    extra: dict | None = None) -> None:
    head.save(out_dir)
    torch.save({"optimizer": opt.state_dict(), "step": step, **(extra or {})}, ckpt)


def validate(target: str, method: str, head_dir: Path, conversations: list[list[dict]], max_tokens: int,
             k: int = 3) -> dict:
    """Acceptance length of the trained head with the serving engine (a chain of k), greedy, on held-out
    prompts."""
    from specdec.llm import LLM

    llm = LLM(target, speculative_config={"method": method, "model": str(head_dir), "num_speculative_tokens": k,
                                          "adaptive": False}, tensor_parallel_size=1)  # the head's every draft
    prompts = [c[:next(i for i, m in enumerate(c) if m["role"] == "assistant")] for c in conversations]
    outs = llm.chat(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
    steps = sum(o.metrics["num_steps"] for o in outs)
    return {"acceptance_length": sum(len(o.token_ids) for o in outs) / steps if steps else None,
            "num_prompts": len(outs)}
