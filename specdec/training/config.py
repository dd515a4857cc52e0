"""`TrainConfig`: every option of a training run, typed, with `specdec train`'s defaults.

The command line builds one from its flags (`specdec.cli`); a library caller builds one directly:

    run_train(TrainConfig(target="smollm2-135m", data=["chat.jsonl"], out="heads/mine", steps=200))

A config checks its own values when made (errors name the command-line flag, so both callers read the same
message). What depends on the method or the target (`--ttt-steps`' default, `--from-traffic`'s `--init`) is filled
in by `resolved()`, a new config: the caller's is never changed.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from specdec.config import SpecdecError
from specdec.drafting.registry import method_info, registered_methods
from specdec.models.loader import DEFAULT_MODEL, shipped_head
from specdec.training.losses import CE_WEIGHT, OBJECTIVES, REGRESSION_WEIGHT, LossOptions

AT_LEAST_ONE = ("steps", "batch", "max_len", "draft_vocab", "save_every", "eval_every", "topk", "num_layers",
                "num_heads")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    # what to train, on what
    out: str  # directory for the head, its checkpoints and train_log.json
    method: str = "eagle3"  # a registered draft-head method (`head_class`)
    target: str = DEFAULT_MODEL  # the frozen target: alias, HF directory or .gguf file
    data: list[str] | None = None  # chat JSONL files; with `distilled`, the directory of the prompts they answer
    distilled: list[str] | None = None  # the target's own answers made by `specdec distill` (files or directories)
    from_traffic: str | None = None  # a server's traffic records to fine-tune on (alone: no data, no distilled)
    regenerate: bool = False  # train on the target's own greedy answers to the data's prompts (cached in out)
    max_conversations: int = 0  # the first N training conversations after shuffling (0: all)
    skip_conversations: int = 0  # leave out the first N first (a later pass over the same seed's order)
    max_len: int = 512  # tokens per conversation
    # the head
    init: str | None = None  # start from this trained head (with from_traffic, eagle3: the shipped one)
    draft_vocab: int = 8192  # draft vocabulary size
    num_layers: int = 1  # eagle, eagle3: decoder layers; medusa: residual blocks per head
    num_heads: int = 3  # medusa: heads, one per draft position
    # the loss (`LossOptions`)
    objective: str = "ce"  # the distribution term: one of losses.OBJECTIVES
    topk: int = 8  # tokens of objective "topk"
    ce_weight: float = CE_WEIGHT  # weight of the distribution term
    regression_weight: float = REGRESSION_WEIGHT  # weight of the SmoothL1 hidden-state term
    ttt_steps: int | None = None  # eagle3's training-time test unroll (None: 3 where the head unrolls, else 1)
    # the optimizer and its schedule
    steps: int = 1000  # conversations to train on
    epochs: float | None = None  # passes over the training data; sets steps once the data is read
    batch: int = 1  # conversations per optimizer step
    lr: float = 2e-4  # peak learning rate
    weight_decay: float = 0.1
    schedule: str = "cosine"  # after warmup: "cosine" decay to a tenth of lr, or "constant"
    warmup: int | None = None  # optimizer steps of linear warmup (None: 5% of them, at most 100)
    clip_grad: float = 0.5  # gradient norm clip (0: none)
    seed: int = 0  # data order, initial weights
    # checkpoints, time, curve and validation
    save_every: int = 200  # steps between checkpoints
    resume: bool = False  # continue from the checkpoint in out
    train_seconds: float = 0.0  # stop with a checkpoint after this long (0: no limit)
    held_out: int = 64  # with distilled / from_traffic: answers never trained on, for the curve (at most a fifth)
    eval_every: int = 100  # optimizer steps between points of the curve
    val_prompts: int = 8  # held-out conversations for the final validation (with data)
    val_tokens: int = 64  # greedy tokens per validation prompt
    # where it runs
    feature_cache: str | None = None  # directory of the target's features, computed once per sample (one rank)
    autocast: str = "auto"  # the head's matmuls: "bf16", "off", or "auto" (bf16 on a GPU and AVX512-BF16 CPUs)
    device: str | None = None  # cpu | cuda (None: $SPECDEC_DEVICE, else cpu)
    dtype: str = "auto"  # the target's dtype

    def __post_init__(self) -> None:
        unrolls = head_class(self.method).unrolls  # refuses a method without a trainable head
        if self.ttt_steps not in (None, 1) and not unrolls:
            raise SpecdecError(f"--ttt-steps is EAGLE-3's training-time test; {self.method} trains one step")
        if self.epochs is not None and self.epochs <= 0:
            raise SpecdecError(f"invalid --epochs {self.epochs}: must be > 0")
        for name in AT_LEAST_ONE + (("ttt_steps",) if self.ttt_steps is not None else ()):
            if getattr(self, name) < 1:
                raise SpecdecError(f"invalid --{name.replace('_', '-')} {getattr(self, name)}: must be >= 1")
        if self.skip_conversations < 0 or self.max_conversations < 0:
            raise SpecdecError(f"invalid --skip-conversations {self.skip_conversations} / --max-conversations "
                               f"{self.max_conversations}: must be >= 0")
        for flag, value, allowed in (("objective", self.objective, OBJECTIVES),
                                     ("schedule", self.schedule, ("cosine", "constant")),
                                     ("autocast", self.autocast, ("auto", "bf16", "off"))):
            if value not in allowed:
                raise SpecdecError(f"invalid --{flag} {value!r}: one of {', '.join(allowed)}")
        if self.from_traffic and (self.data or self.distilled):
            raise SpecdecError("--from-traffic trains on the recorded requests alone: leave out --data and --distilled")
        if not self.from_traffic and not self.data:
            raise SpecdecError("what to train on: --data FILES (with --distilled: their folder), or --from-traffic DIR")

    def resolved(self) -> TrainConfig:
        """This config with what its method and target decide filled in: `ttt_steps` (3 where the head unrolls,
        else 1) and, fine-tuning an eagle3 head on traffic, `init` (the head the deployment serves by default)."""
        ttt_steps = self.ttt_steps if self.ttt_steps is not None else (3 if head_class(self.method).unrolls else 1)
        init = self.init
        if self.from_traffic and init is None and self.method == "eagle3":
            init = shipped_head(self.target)
            if init is None:
                raise SpecdecError(f"--from-traffic fine-tunes a head: give --init (no head ships for {self.target})")
        return dataclasses.replace(self, ttt_steps=ttt_steps, init=init)

    def loss_options(self) -> LossOptions:
        """What the loss reads of this (resolved) config."""
        if self.ttt_steps is None:
            raise SpecdecError("TrainConfig.loss_options: resolve the config first (`resolved()`)")
        return LossOptions(ttt_steps=self.ttt_steps, ce_weight=self.ce_weight,
                           regression_weight=self.regression_weight, objective=self.objective, topk=self.topk)


def head_class(method: str) -> type:
    """The model class of a registered draft-head method
    (`specdec.drafting.registry.register_method(..., head=...)`)."""
    heads = registered_methods(head=True)
    if method not in heads:
        raise SpecdecError(f"--method {method}: the trainer supports {heads}")
    return method_info(method).head
