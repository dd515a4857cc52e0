"""Turning logits into tokens: temperature, top-k, top-p, min-p, and seeded sampling.

Pure functions over batched tensors, so the verifier can reuse `logits_to_probs` to get the target's
distribution p. Sampling uses the exponential race (argmax of p / E with E ~ Exp(1)), which draws
exactly from p, needs no host sync, and lets each seeded request use its own generator.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch

from specdec.config import SamplingParams
from specdec.models.cpu import native


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of a batch, as tensors. Greedy rows have temperature 0."""

    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] long, 0 = off
    top_p: torch.Tensor  # [B] float32, 1 = off
    min_p: torch.Tensor  # [B] float32, 0 = off
    generators: list[torch.Generator | None]
    all_greedy: bool
    any_greedy: bool  # host flags (no device read): a selection of rows keeps its batch's, still true of it
    needs_top_k: bool
    needs_top_p: bool
    needs_min_p: bool

    @classmethod
    def from_params(cls, params: list[SamplingParams], generators: list[torch.Generator | None],
                    device: torch.device | str = "cpu") -> SamplingTensors:
        def t(values: Sequence[float], dtype: torch.dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            temperature=t([0.0 if p.greedy else p.temperature for p in params], torch.float32),
            top_k=t([p.top_k for p in params], torch.long),
            top_p=t([p.top_p for p in params], torch.float32),
            min_p=t([p.min_p for p in params], torch.float32),
            generators=generators,
            all_greedy=all(p.greedy for p in params),
            any_greedy=any(p.greedy for p in params),
            needs_top_k=any(p.top_k > 0 and not p.greedy for p in params),
            needs_top_p=any(p.top_p < 1 and not p.greedy for p in params),
            needs_min_p=any(p.min_p > 0 and not p.greedy for p in params),
        )

    @classmethod
    def from_requests(cls, requests: Sequence[Any], device: torch.device | str = "cpu") -> SamplingTensors:
        """From anything with `.params` and `.generator` (sequences, draft requests)."""
        return cls.from_params([r.params for r in requests], [r.generator for r in requests], device)

    def select(self, rows: list[int]) -> SamplingTensors:
        """The parameters of rows `rows` (one row per draft position when verifying)."""
        index = torch.tensor(rows, device=self.temperature.device)
        return SamplingTensors(self.temperature[index], self.top_k[index], self.top_p[index], self.min_p[index],
                               [self.generators[i] for i in rows], self.all_greedy, self.any_greedy, self.needs_top_k,
                               self.needs_top_p, self.needs_min_p)


@dataclass
class Penalized:
    """One request's rows of a step's logits, for `penalize`: rows row .. row + len(paths) - 1, row j being the
    distribution of the token after the request's output and then `paths[j]` (the draft tokens on row j's path:
    [] for the first row, the ancestors and node of a draft node for its row)."""

    row: int
    params: SamplingParams
    prompt: list[int]
    output: list[int]
    paths: list[list[int]]


@dataclass
class TokenLogprob:
    """A generated token's log-probability under the target, and the `k` most likely tokens there."""

    token: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, log-probability), most likely first


def token_logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """One TokenLogprob per row of logits [n, V] and the token chosen after each (one copy to the host). On CPU a
    native pass per row (the maximum and the top k together, then the sum of exponentials: ~25 us for a 49k-wide
    row, where torch's log-softmax and topk took 30 + 110 us); elsewhere torch's."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and native.available():
        picked, values, ids = native.ops().logprob_rows(logits, torch.tensor(tokens, dtype=torch.long), k)
        return [TokenLogprob(t, p, list(zip(i, v))) for t, p, v, i in
                zip(tokens, picked.tolist(), values.tolist(), ids.tolist())]
    logprobs = torch.log_softmax(logits, -1)
    index = torch.tensor(tokens, dtype=torch.long, device=logits.device)[:, None]
    picked = logprobs.gather(1, index)  # [n, 1]
    if k:
        top = logprobs.topk(k, dim=-1)
        values, ids = torch.cat([picked, top.values], 1).tolist(), top.indices.tolist()
    else:
        values, ids = picked.tolist(), [[]] * len(tokens)
    return [TokenLogprob(t, v[0], list(zip(i, v[1:]))) for t, v, i in zip(tokens, values, ids)]


NUMPY_DEVICES = ("cpu",)  # where `penalize` computes with numpy on a view of the logits


@torch.inference_mode()  # logits come out of the model's inference mode: updated in place only inside one
def penalize(logits: torch.Tensor, requests: list[Penalized]) -> None:
    """Apply each request's logit_bias, then its repetition, frequency and presence penalties, to its rows of
    logits [T, V] in place, vLLM's order. A row's counts are those of the tokens before it on its own path, so a
    draft position gets exactly the distribution plain decoding would give after the same tokens: greedy
    speculation stays token-identical and sampled speculation keeps the penalized distribution. Only the columns
    of tokens seen so far are read and written (a few hundred of a 49k vocabulary), with numpy on CPU (a dozen
    torch calls would cost more than the arithmetic), torch elsewhere; each row's result depends on that row
    alone, so batching changes no bit."""
    cpu = logits.device.type in NUMPY_DEVICES
    for r in requests:
        p, n = r.params, len(r.paths)
        rows = logits[r.row:r.row + n].numpy() if cpu else logits[r.row:r.row + n]  # views: written in place
        if p.logit_bias:
            ids, bias = np.fromiter(p.logit_bias, np.int64), np.fromiter(p.logit_bias.values(), np.float32)
            if cpu:
                rows[:, ids] += bias
            else:
                rows[:, torch.from_numpy(ids).to(rows.device)] += torch.from_numpy(bias).to(rows.device)
        if not (p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1):
            continue
        seen = np.array([*r.output, *(t for path in r.paths for t in path)], dtype=np.int64)
        prompt = np.asarray(r.prompt if p.repetition_penalty != 1 else [], dtype=np.int64)
        ids, where = np.unique(np.concatenate([seen, prompt]), return_inverse=True)  # the columns touched
        counts = np.zeros((n, len(ids)), dtype=np.float32)  # [n, U] occurrences before each row
        np.add.at(counts, (slice(None), where[:len(r.output)]), 1.0)
        offset = len(r.output)
        for j, path in enumerate(r.paths):
            np.add.at(counts[j], where[offset:offset + len(path)], 1.0)
            offset += len(path)
        in_prompt = np.zeros(len(ids), dtype=bool)
        in_prompt[where[len(seen):]] = True
        if cpu:
            rows[:, ids] = _penalties(rows[:, ids], counts, in_prompt, p, np)
        else:
            columns = torch.from_numpy(ids).to(rows.device)
            c, hit = (torch.from_numpy(a).to(rows.device) for a in (counts, in_prompt))
            rows[:, columns] = _penalties(rows[:, columns], c, hit, p, torch)


def _penalties(vals: np.ndarray | torch.Tensor, counts: np.ndarray | torch.Tensor,
               in_prompt: np.ndarray | torch.Tensor, p: SamplingParams, xp: ModuleType):
    """The penalized values of the touched columns [n, U] (numpy arrays or tensors, float32; xp: their module)."""
    if p.repetition_penalty != 1:
        scaled = xp.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        vals = xp.where((counts > 0) | in_prompt, scaled, vals)
    if p.frequency_penalty:
        vals = vals - p.frequency_penalty * counts
    if p.presence_penalty:
        vals = vals - p.presence_penalty * counts.clip(max=1)
    return vals


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep the k largest logits per row (ties at the k-th value kept); k = 0 keeps all. logits: [B, V]."""
    V = logits.shape[-1]
    k = torch.where(top_k <= 0, V, top_k.clamp(max=V))
    kth = logits.topk(int(k.max()), dim=-1).values.gather(-1, (k - 1)[:, None])  # [B, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (unnormalized). probs: [B, V]."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_p.cumsum(-1) - sorted_p  # mass of strictly more likely tokens
    drop_sorted = mass_before >= top_p[:, None]
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return probs.masked_fill(drop, 0.0)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than min_p times the most likely one. probs: [B, V]."""
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return probs.masked_fill(probs < threshold, 0.0)


def logits_to_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """The distribution each row samples from. Greedy rows become one-hot on the argmax.

    Order: temperature, top-k, softmax, top-p, min-p, renormalize (vLLM's order). logits: [B, V] float32.
    """
    greedy = st.temperature == 0
    x = logits / torch.where(greedy, 1.0, st.temperature)[:, None]
    if st.needs_top_k:
        x = apply_top_k(x, st.top_k)
    probs = torch.softmax(x, dim=-1)
    if st.needs_top_p:
        probs = apply_top_p(probs, st.top_p)
    if st.needs_min_p:
        probs = apply_min_p(probs, st.min_p)
    if st.needs_top_p or st.needs_min_p:
        probs = probs / probs.sum(-1, keepdim=True)
    if st.any_greedy:
        one_hot = torch.zeros_like(probs).scatter_(-1, greedy_tokens(logits)[..., None], 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def sample_from_probs(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row, drawn exactly from `probs` [B, V]: the keyed race of `keyed_sample` with a key drawn from
    row i's generators[i] (or the global generator when None), so a seeded generator still repeats its draws.
    Returns [B] long."""
    keys = [int(torch.randint(0, 1 << 62, (1,), generator=g, device=g.device if g is not None else "cpu"))
            for g in generators]
    return keyed_sample(probs, keys)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim of logits [..., V] (the first index on ties, as torch.argmax): a vectorized
    kernel for float32 on CPU (torch's is a scalar loop, 50 us over a 49k vocabulary), torch elsewhere."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() >= 1 and native.available():
        return native.ops().argmax_rows(logits)
    return logits.argmax(dim=-1)


# ---- position-keyed sampling -------------------------------------------------------------------------------
# A sampled request draws the token at output position t by the exponential race over its processed distribution,
# argmax p / E, with the noise E ~ Exp(1) [V] a function of a key of (its seed, t) and the token id. The draw
# depends on the distribution and the key alone, never on the batch, the step or the drafts, so a speculative step
# that keeps a draft token exactly when it equals the target's own keyed sample emits plain decoding's tokens. A
# drafter that samples with the same key on its own q agrees with the target as often as the Gumbel-max coupling
# gives (close to 1 - TV(p, q); an inverse-CDF draw with a shared uniform agreed far less often, measured).
_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sampling_key(seed: int, position: int) -> int:
    """The key of a request's noise at one output position: splitmix64 of its seed, mixed with the position and
    mixed again (63 bits)."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64)) >> 1


# The noise itself is a function of (key, token id) alone, a counter-based hash, not a generator's stream: a row is
# drawn in one pass over its values (on CPU by the native kernel `race_rows`: torch's exponential_ took 0.9 ms for a
# 49k vocabulary, a quarter of a decode step). The hash: two rounds of the lowbias32 mixer over 32-bit words,
# bits = mix(mix(v * 0x9E3779B9 + key_lo) ^ key_hi), u = (bits >> 9 + 1/2) / 2^23, E = -log u. The native kernel and
# the tensor version below compute the same bits and u; their logs may differ in the last bit (so may their tokens,
# once in a great many draws), but each is the same on every call.
_M32 = 0xFFFFFFFF


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """(h * c) mod 2^32 for int64 tensors of 32-bit values, in 16-bit halves (no int64 overflow)."""
    return (h * (c & 0xFFFF) + (((h * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x7FEB352D)
    h = h ^ (h >> 15)
    h = _mul32(h, 0x846CA68B)
    return h ^ (h >> 16)


def keyed_noise(keys: list[int], width: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """E ~ Exp(1) of shape [len(keys), width]: entry (r, v) a function of keys[r] and v alone (the same bits for a key
    wherever the row sits in a batch), never 0."""
    k = torch.tensor(keys, dtype=torch.int64, device=device)[:, None]
    v = torch.arange(width, dtype=torch.int64, device=device)[None, :]
    bits = _mix32(_mix32((_mul32(v, 0x9E3779B9) + (k & _M32)) & _M32) ^ ((k >> 32) & _M32))
    return -torch.log(_uniform(bits))


def _uniform(bits: torch.Tensor) -> torch.Tensor:
    """32 hash bits -> a float32 strictly inside (0, 1): 23 of them and a half, exact (24 bits would round the
    largest up to 1, a zero E)."""
    return ((bits >> 9).float() + 0.5) * (1.0 / 8388608.0)


def only_temperature(params: SamplingParams) -> bool:
    """A sampled request whose distribution is its logits at a temperature, nothing else (no top-k, top-p, min-p)."""
    return not params.greedy and params.top_k == 0 and params.top_p >= 1 and params.min_p <= 0


def keyed_logit_sample(row: torch.Tensor, temperature: float, key: int) -> int:
    """The keyed sample of softmax(row / temperature) for one row of logits [V] (an `only_temperature` request's): on
    CPU one native pass over the logits (`race_logit_row`: 0.1 ms for a 49k vocabulary), no distribution written.
    The same distribution as `keyed_sample` over `logits_to_probs`, and the same token but at near-ties (the exp's
    and the normalization's last bits); a request always takes one path, so its tokens never depend on the other."""
    if row.device.type == "cpu" and row.dtype == torch.float32 and native.available():
        return int(native.ops().race_logit_row(row.contiguous(), 1.0 / temperature, key))
    return int(keyed_sample(torch.softmax(row[None] / temperature, -1), [key])[0])


def keyed_sample(probs: torch.Tensor, keys: list[int]) -> torch.Tensor:
    """One token per row of probs [R, V] (unnormalized is fine): argmax of p / E with the row's keyed noise. A token
    of probability 0 is never chosen. Returns [R] long, on probs' device."""
    if probs.device.type == "cpu" and probs.dtype == torch.float32 and native.available():
        return native.ops().race_rows(probs, torch.tensor(keys, dtype=torch.int64))
    return greedy_tokens(probs / keyed_noise(keys, probs.shape[-1], probs.device))
