"""The engines a benchmark times on the same token ids: specdec (one request, or a group decoded together),
transformers' greedy generate, and llama.cpp (llama-cpp-python) on the same GGUF file; each returns the
same measurement record."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from specdec.bench.prompts import BenchPrompt
from specdec.config import SamplingParams, SpecdecError
from specdec.models.loader import ModelSource

if TYPE_CHECKING:
    from llama_cpp import Llama
    from transformers import PreTrainedModel

    from specdec.engine.outputs import RequestOutput
    from specdec.llm import LLM


def measurement(token_ids: list[int], ttft_s: float | None, decode_s: float, e2e_s: float) -> dict:
    """One request's numbers. Decode tokens/s excludes the first token, which belongs to the prefill."""
    n = len(token_ids)
    return {"generated_tokens": n, "ttft_s": ttft_s, "decode_s": decode_s, "e2e_s": e2e_s,
            "decode_tokens_per_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else None,
            "e2e_tokens_per_s": n / e2e_s if e2e_s > 0 else None, "token_ids": list(token_ids)}

SPEC_METRICS = ("num_steps", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos")


def check_outputs(llm: LLM, outs: list[RequestOutput]) -> None:
    """A benchmark of requests that failed measures nothing: stop it, naming the configuration and the cause."""
    failed = [o for o in outs if o.finish_reason == "error"]
    if failed:
        raise SpecdecError(f"{len(failed)} of {len(outs)} requests failed with "
                           f"{llm.speculative_method or 'plain decoding'} on {llm.measuring.model.device}: "
                           f"{failed[0].stop_reason}; no figures are reported for a failing configuration")


def time_specdec(llm: LLM, prompt: BenchPrompt, params: SamplingParams) -> dict:
    start = time.perf_counter()
    out = llm.generate({"prompt_token_ids": prompt.token_ids}, params)[0]
    e2e = time.perf_counter() - start
    check_outputs(llm, [out])
    m = out.metrics
    return {**measurement(out.token_ids, m["ttft_s"], m["decode_s"], e2e), **{k: m[k] for k in SPEC_METRICS}}


def time_group(llm: LLM, prompts: list[BenchPrompt], params: SamplingParams) -> tuple[dict, list[list[int]]]:
    """One generate() call for a group. Its decode phase starts once every request has its first token."""
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p.token_ids} for p in prompts], params)
    wall = time.perf_counter() - start
    check_outputs(llm, outs)
    prefill = max(o.metrics["ttft_s"] for o in outs)
    record = {"generated_tokens": sum(len(o.token_ids) for o in outs), "wall_s": wall, "ttft_s_max": prefill,
              "ttft_s_sum": sum(o.metrics["ttft_s"] for o in outs),
              "decode_tokens": sum(len(o.token_ids) - 1 for o in outs), "decode_s": wall - prefill}
    return record, [o.token_ids for o in outs]


class _TokenClock:
    """A transformers streamer that timestamps the first and last generated tokens.

    generate() puts the prompt first, then each new token, so the first put is skipped.
    """

    def __init__(self) -> None:
        self.puts, self.first, self.last = 0, None, None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts > 1:
            self.last = time.perf_counter()
            self.first = self.first or self.last

    def end(self) -> None:
        pass


def time_hf(model: PreTrainedModel, prompt: BenchPrompt, max_tokens: int, eos: list[int]) -> dict:
    """transformers' greedy generate on the same ids, stopping on the same EOS ids as specdec."""
    x = torch.tensor([prompt.token_ids], device=model.device)
    clock = _TokenClock()
    start = time.perf_counter()
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False,
                         eos_token_id=eos or None, pad_token_id=eos[0] if eos else None, streamer=clock)
    e2e = time.perf_counter() - start
    first = clock.first or start
    return measurement(out[0, x.shape[1]:].tolist(), first - start, (clock.last or first) - first, e2e)


def load_hf(src: ModelSource, dtype: torch.dtype, device: torch.device) -> PreTrainedModel:
    """transformers' own load of the same model, as an independent reference, set up for its fastest generate on
    the device: on a GPU a static cache, with which generate compiles its decoding forward (torch.compile, CUDA
    graphs); on CPU the default dynamic cache (its compiled path is slower there).

    A GGUF goes through transformers' dequantizer directly: from_pretrained(gguf_file=...) insists on
    `accelerate`, which specdec does not depend on.
    """
    model = _load_hf(src, dtype).to(device).eval()
    if device.type == "cuda":
        model.generation_config.cache_implementation = "static"
    return model


def _load_hf(src: ModelSource, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    if src.gguf_file is None:
        return AutoModelForCausalLM.from_pretrained(str(src.path), dtype=dtype)
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(src.path), gguf_file=src.gguf_file.name)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = load_gguf_checkpoint(str(src.gguf_file), return_tensors=True, model_to_load=skeleton)["tensors"]
    missing = set(model.load_state_dict(state, strict=False).missing_keys)
    if missing - {"lm_head.weight"} or ("lm_head.weight" in missing and not config.tie_word_embeddings):
        raise SpecdecError(f"transformers' load of {src.name} lacks tensors {sorted(missing)[:3]}")
    return model


def load_llamacpp(src: ModelSource, threads: int, context: int = 4096, logits_all: bool = False) -> Llama:
    """llama.cpp on the model's own GGUF file (the peer a CPU user already has); `logits_all` computes the
    logits of every fed row (verification needs them all), not only the last."""
    try:
        from llama_cpp import Llama
    except ImportError:
        raise SpecdecError("--compare-llamacpp needs llama-cpp-python: make bench-peers (builds it, ~10 minutes)") \
            from None
    if src.gguf_file is None:
        raise SpecdecError(f"--compare-llamacpp runs llama.cpp on a GGUF file, and {src.name} is a Hugging Face model")
    return Llama(model_path=str(src.gguf_file), n_threads=threads, n_threads_batch=threads, n_ctx=context,
                 n_batch=512, logits_all=logits_all, verbose=False)


def time_llamacpp(model: Llama, prompt: BenchPrompt, max_tokens: int, eos: list[int]) -> dict:
    """Greedy decoding in llama.cpp on the same ids: prefill the prompt, then one token at a time, taking the
    argmax of its logits (no sampler chain), stopping on the same EOS ids as specdec."""
    import llama_cpp
    import numpy as np

    def argmax() -> int:  # the last position's logits, read in place (eval keeps no copy without logits_all)
        return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits(model.ctx), shape=(model.n_vocab(),))))

    model.reset()
    start = time.perf_counter()
    model.eval(prompt.token_ids)
    tokens = [argmax()]
    first = time.perf_counter()
    while len(tokens) < max_tokens and tokens[-1] not in eos:
        model.eval([tokens[-1]])
        tokens.append(argmax())
    end = time.perf_counter()
    return measurement(tokens, first - start, end - first, end - start)
