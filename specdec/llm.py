"""The user-facing API: `LLM(...).generate(prompts, SamplingParams(...))`, vLLM-style."""
from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterable, Iterator
from collections.abc import Sequence as Seq
from typing import Any

import torch
from tqdm import tqdm

from specdec.config import EngineConfig, SamplingParams, SpecdecError, from_kwargs
from specdec.drafting.registry import SpeculativeConfig, method_info, registered_methods
from specdec.engine.llm_engine import LLMEngine
from specdec.engine.measuring import Measuring
from specdec.engine.outputs import RequestOutput
from specdec.engine.parallel import Workers, launched_by_torchrun
from specdec.models.loader import DEFAULT_MODEL, default_speculative_config, load_model, load_tokenizer, model_files
from specdec.models.parallel import check_split, shard_model

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}

Prompt = str | dict[str, Any]


def parse_dtype(dtype: str | torch.dtype) -> str | torch.dtype:
    """A torch dtype, or 'auto' (a GGUF computes on its own quantized blocks, anything else in float32)."""
    if isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    if dtype not in _DTYPES:
        raise SpecdecError(f"unknown dtype {dtype!r}; choose one of {['auto', *sorted(_DTYPES)]}")
    return _DTYPES[dtype]


DEVICE_ENV = "SPECDEC_DEVICE"  # the device when none is given (LLM, the CLI, the tests' --device): default cpu


def parse_device(device: str | torch.device | None) -> torch.device:
    """The device asked for, or $SPECDEC_DEVICE (else cpu) when None."""
    if device is None:
        device = os.environ.get(DEVICE_ENV) or "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise SpecdecError(f"invalid device {device!r}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SpecdecError(f"device {device!r} requested but CUDA is not available here; use device='cpu'")
    return dev


def start_ranks(size: int | None, model: str, dtype: torch.dtype | str, device: torch.device,
                quantization: str | None) -> Workers | None:
    """The other tensor-parallel ranks: spawned here, or (under torchrun) joined; None for one process. A rank
    other than 0 under torchrun serves rank 0 here and exits when it is done."""
    if launched_by_torchrun() and size in (None, int(os.environ["WORLD_SIZE"])):
        from specdec.engine.parallel import DEFAULT_TIMEOUT_S, destroy_process_groups, init_group, serve_rank

        tp = init_group(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), device, DEFAULT_TIMEOUT_S, "env://")
        if tp.rank != 0:
            net, _ = load_model(model, dtype, device, quantization)
            shard_model(net, tp)
            serve_rank(net, tp)
            destroy_process_groups()
            raise SystemExit(0)
        return Workers(tp, [])
    if size is None or size == 1:
        return None
    return Workers.spawn(size, model, dtype, device, quantization)


def unicode_text(text: str, what: str) -> None:
    """Tokenizers take Unicode text; a lone UTF-16 surrogate (from JSON's \\ud800, say) is not."""
    bad = _SURROGATE.search(text)
    if bad is not None:
        raise SpecdecError(f"{what} holds a lone UTF-16 surrogate (U+{ord(bad[0]):04X}) at character {bad.start()}; "
                           "give valid Unicode text")


_SURROGATE = re.compile("[\ud800-\udfff]")


def head_in_model_files(speculative_config: dict | str | None, model: str) -> dict | str | None:
    """A method whose head may live in the model's own files (MTP layers) and that names no `model` drafts with the
    head inside the model (at the top, or as a source of a method that nests others)."""
    config = speculative_config
    if isinstance(config, str) and config.strip().startswith("{"):
        try:
            config = json.loads(config)
        except json.JSONDecodeError:
            return speculative_config  # SpeculativeConfig.parse names the error
    if not isinstance(config, dict) or config.get("model") or config.get("method") not in registered_methods():
        return speculative_config
    if isinstance(config.get("sources"), list):  # a method that nests others (switch, hybrid): each source's own
        sources = [head_in_model_files(c, model) if isinstance(c, dict) else c for c in config["sources"]]
        return {**config, "sources": sources} if sources != config["sources"] else speculative_config
    return {**config, "model": model_files(model)} if method_info(config["method"]).head_in_model \
        else speculative_config


class LLM:
    """Load a model once, then generate for batches of prompts.

    model: an alias (default `smollm2-135m`), a Hugging Face directory, or a .gguf file.
    speculative_config: vLLM-style dict or JSON string, e.g. {"method": "ngram", "num_speculative_tokens": 4};
    output is the same as without it (greedy: token for token; sampling: in distribution). None: the
    built-in model's tuned default, any other model's n-gram drafting (`loader.MODEL_FREE_DEFAULT`), switching with
    its own MTP layers' drafts where its files bring them (`loader.MTP_DEFAULT`), verified only where the cost
    model (`engine.cost`) expects drafts to pay; "off": no speculation.
    dtype: 'auto' computes a GGUF on its own quantized blocks (native int8 kernels on CPU) and a Hugging Face
    model in float32; 'float32' / 'bfloat16' dequantize a GGUF as before (float32 is the exact reference).
    device: 'cpu' or 'cuda'; None takes $SPECDEC_DEVICE, else 'cpu'.
    quantization: 'gguf' (insist on a GGUF's own blocks), or a block format to quantize float weights into on
    load ('q4_0', 'q4_1', 'q5_0', 'q5_1', 'q8_0', 'q4_k', 'q5_k', 'q6_k', 'iq4_nl', 'iq4_xs': `quant.FORMATS`).
    tensor_parallel_size: split the target over this many processes (torch.distributed; see
    specdec.engine.parallel): this one is rank 0 and spawns the others, or, under torchrun, every rank calls
    LLM(...) and the ranks other than 0 serve rank 0 until it shuts down, then exit.
    Extra keyword arguments are EngineConfig fields (block_size, max_num_seqs, ...).
    """

    def __init__(self, model: str = DEFAULT_MODEL, dtype: str | torch.dtype = "auto",
                 device: str | torch.device | None = None, speculative_config: dict | str | None = None,
                 quantization: str | None = None, tensor_parallel_size: int | None = None,
                 **engine_kwargs: Any) -> None:
        default = speculative_config is None  # the model's own: known once its files are read (MTP layers)
        speculative = None if default else SpeculativeConfig.parse(head_in_model_files(speculative_config, model))
        engine_cfg = from_kwargs(EngineConfig, engine_kwargs)
        dtype, device = parse_dtype(dtype), parse_device(device)
        if tensor_parallel_size is not None and (not isinstance(tensor_parallel_size, int) or
                                                 isinstance(tensor_parallel_size, bool) or tensor_parallel_size < 1):
            raise SpecdecError(f"tensor_parallel_size must be a positive integer, got {tensor_parallel_size!r}")
        net, src = load_model(model, dtype, device, quantization)
        if default:
            config = default_speculative_config(model, net.config.num_mtp_layers)
            speculative = SpeculativeConfig.parse(head_in_model_files(config, model))
        if tensor_parallel_size and tensor_parallel_size > 1:
            check_split(net, tensor_parallel_size)  # before any rank starts
        self.workers = start_ranks(tensor_parallel_size, model, dtype, device, quantization)
        if self.workers is not None:
            shard_model(net, self.workers.tp)
        self.model_name = str(model)
        self.tokenizer = load_tokenizer(src)
        self.engine = LLMEngine(net, self.tokenizer, engine_cfg, speculative, self.workers)

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (also done at exit)."""
        if self.workers is not None:
            self.workers.close()

    def with_speculative_config(self, speculative_config: dict | str | None, **engine_kwargs: Any) -> LLM:
        """Another LLM over the same weights and tokenizer, with its own engine and speculation settings
        (how `bench` compares speculative and plain decoding of one model side by side). None means what it
        means for `LLM(...)`: the model's default speculation; "off": no speculation."""
        if speculative_config is None:
            speculative_config = default_speculative_config(self.model_name, self.engine.model.config.num_mtp_layers)
        other = object.__new__(LLM)
        other.model_name, other.tokenizer, other.workers = self.model_name, self.tokenizer, self.workers
        cfg = from_kwargs(EngineConfig, engine_kwargs) if engine_kwargs else self.engine.cfg
        other.engine = LLMEngine(self.engine.model, self.tokenizer, cfg,
                                 SpeculativeConfig.parse(head_in_model_files(speculative_config, self.model_name)),
                                 self.workers)
        return other

    @property
    def draft_head(self) -> str | None:
        """The directory of the draft head speculation drafts with (None without a head method)."""
        return self.engine.draft_head

    @property
    def speculative_method(self) -> str | None:
        """The drafting method speculation uses (None when it is off)."""
        return self.engine.speculative.method if self.engine.speculative is not None else None

    @property
    def fingerprint(self) -> str:
        """The target's fingerprint (`model_fingerprint`): what answers and traffic records are made by."""
        from specdec.models.loader import model_fingerprint

        return model_fingerprint(self.engine.model)

    @property
    def target_model(self) -> torch.nn.Module:
        """The target network, for what runs it outside decoding (the trainer's features); decoding is this class's."""
        return self.engine.model

    @property
    def measuring(self) -> Measuring:
        """The engine as measuring tools see and drive it (`specdec.engine.measuring`): bench, tune, the soak."""
        return Measuring(self.engine)

    def reload_draft(self, path: str) -> None:
        """Swap the draft head for the one in `path` (same method, same target and shape) without reloading the
        target: between generate() calls here, between engine steps in the server (`POST /admin/draft`). Outputs
        stay lossless. See `LLMEngine.reload_draft`."""
        self.engine.reload_draft(path)

    # -- prompts -------------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """A string is tokenized as is; {"prompt_token_ids": [...]} is used directly."""
        if isinstance(prompt, str):
            if not prompt:
                raise SpecdecError("prompt is empty: give at least one character")
            unicode_text(prompt, "prompt")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise SpecdecError("prompt_token_ids must be a list of ints")
            return prompt.get("prompt"), list(ids)
        raise SpecdecError(f"a prompt is a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")

    @property
    def max_model_len(self) -> int:
        """The context a request's prompt and output share, in tokens."""
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.model.config.vocab_size

    def check_structured_output(self, params: SamplingParams) -> None:
        """Compile params' structured output (cached by its text, so the engine reuses it): a bad schema, regex or
        grammar raises a SpecdecError naming the field, before the request is queued."""
        self.engine.grammar_state(params)

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template renders tools itself (then it is given `tools`, assistant `tool_calls` and
        `tool` messages as they are; else specdec.serving.tool_calls writes them as plain messages)."""
        template = getattr(self.tokenizer, "chat_template", None)
        return isinstance(template, str) and "tools" in template

    def apply_chat_template(self, conversation: list[dict], tools: list[dict] | None = None) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise SpecdecError(f"model {self.model_name!r} has no chat template; use generate() with plain prompts")
        text = self.tokenizer.apply_chat_template(conversation, tools=tools or None, tokenize=False,
                                                  add_generation_prompt=True)
        unicode_text(text, "the conversation")
        return self.tokenizer.encode(text, add_special_tokens=False)

    # -- generation ----------------------------------------------------------------------------
    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Decode all prompts together (continuous batching); outputs come back in prompt order."""
        if not isinstance(prompts, (list, tuple)):
            prompts = [prompts]
        return self._run([self.encode(p) for p in prompts], sampling_params, use_tqdm)

    def chat(self, conversations: list[dict[str, str]] | Seq[list[dict[str, str]]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """Like generate, with the model's chat template applied to each conversation."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self._run([(None, self.apply_chat_template(c)) for c in conversations], sampling_params)

    def stream(self, prompt_token_ids: list[int], params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text as it is produced for one request (holds back incomplete UTF-8); its whole output is then
        `last_output`."""
        engine = self.engine
        request_id = engine.add_request(prompt_token_ids, params or SamplingParams(), stream=True)
        emitted, out = "", None
        try:
            while out is None:
                for update in engine.step():
                    if update.request_id != request_id:
                        continue
                    out = update.output
                    if len(update.text) > len(emitted):
                        yield update.text[len(emitted):]
                        emitted = update.text
        finally:
            if out is None:
                out = engine.abort(request_id)  # the caller stopped early: free the blocks
        self.last_output = out

    def as_completed(self, requests: Iterable[tuple[list[int], SamplingParams]], in_flight: int = 32
                     ) -> Iterator[tuple[int, RequestOutput]]:
        """(index, output) of each request as it finishes, with at most `in_flight` decoding together; the next ones
        are taken from `requests` (token ids, params) as earlier ones finish, so a long queue costs no memory. A
        caller that stops early leaves nothing running (the rest are aborted and their blocks freed)."""
        if in_flight < 1:
            raise SpecdecError(f"in_flight must be >= 1, got {in_flight}")
        engine, queue = self.engine, enumerate(requests)
        running: dict[int, int] = {}  # request id -> index
        try:
            while True:
                while len(running) < in_flight and (nxt := next(queue, None)) is not None:
                    index, (ids, params) = nxt
                    running[engine.add_request(ids, params)] = index
                if not running:
                    return
                for update in engine.step():
                    if update.finished and update.request_id in running:
                        yield running.pop(update.request_id), update.output
        finally:
            for request_id in running:
                engine.abort(request_id)

    def _run(self, encoded: list[tuple[str | None, list[int]]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None, use_tqdm: bool = False
             ) -> list[RequestOutput]:
        params = self._params_per_prompt(sampling_params, len(encoded))
        engine = self.engine
        ids: list[int] = []
        outputs: dict[int, RequestOutput] = {}
        bar = tqdm(total=len(encoded), desc="generate", unit="req", disable=not use_tqdm, file=sys.stderr)
        try:
            for (_, prompt_ids), p in zip(encoded, params):
                ids.append(engine.add_request(prompt_ids, p))
            while len(outputs) < len(ids):
                outputs.update((u.request_id, u.output) for u in engine.step() if u.finished)
                bar.update(len(outputs) - bar.n)
        finally:
            bar.close()
            for request_id in ids:
                if request_id not in outputs:
                    engine.abort(request_id)  # frees blocks if we were interrupted
        for (prompt, _), request_id in zip(encoded, ids):
            outputs[request_id].prompt = prompt
        return [outputs[i] for i in ids]

    @staticmethod
    def _params_per_prompt(sp: SamplingParams | Seq[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if sp is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(sp, SamplingParams):
            return [sp] * n
        sp = list(sp)
        if len(sp) != n:
            raise SpecdecError(f"got {len(sp)} SamplingParams for {n} prompts; pass one, or one per prompt")
        return sp
