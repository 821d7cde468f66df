"""A vLLM-style PyTorch sampler: the baseline the kernels are measured against.

Written here after the structure of vLLM's v1 CPU path (penalties from
history bin counts, temperature, min_p from softmax, then top-k / top-p by a
full sort of the vocabulary and an exponential-race draw), same semantics
and order as the kernels. It is deliberately the usual approach, not a tuned
one: it is what users run today.
"""
from __future__ import annotations

import numpy as np
import torch

from .params import GREEDY_TEMPERATURE, PARAMS, SamplingBatch


def _column(values, dtype, device: torch.device) -> torch.Tensor:
    """A per-row parameter as a tensor on the logits' device (the inline
    mode samples on the engine's device: the CPU, or the GPU with
    ``--device cuda``)."""
    return torch.from_numpy(np.asarray(values, dtype)).to(device)


def _bin_counts(offsets: np.ndarray, ids: np.ndarray, batch: int, vocab: int,
                device: torch.device) -> torch.Tensor:
    counts = torch.zeros(batch, vocab, dtype=torch.int32, device=device)
    rows = _column(np.repeat(np.arange(batch), np.diff(offsets)), np.int64, device)
    counts.index_put_((rows, _column(ids, np.int64, device)),
                      torch.ones(ids.size, dtype=torch.int32, device=device), accumulate=True)
    return counts


def greedy_rows(batch: SamplingBatch, device: torch.device) -> torch.Tensor:
    """bool [B]: rows decoded greedily (temperature compared in float32)."""
    return _column(batch.temperature, np.float32, device) < GREEDY_TEMPERATURE


def temperature_divisor(batch: SamplingBatch, device: torch.device) -> torch.Tensor:
    """float32 [B, 1]: each row's temperature, 1 for greedy rows (whose
    logits are left as they are)."""
    temperature = _column(batch.temperature, np.float32, device)
    return torch.where(temperature < GREEDY_TEMPERATURE, 1.0, temperature)[:, None]


def _min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    top = probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < min_p[:, None] * top, -float("inf"))


def _top_k(ascending: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    vocab = ascending.shape[-1]
    k = torch.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)
    kth = ascending.gather(1, (vocab - k)[:, None])
    return ascending.masked_fill(ascending < kth, -float("inf"))


def _top_p(ascending: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    outside = cumulative <= (1 - top_p)[:, None]
    outside[:, -1] = False
    return ascending.masked_fill(outside, -float("inf"))


#: The truncations of ``params.TRUNCATIONS`` in the order applied: those on
#: the logits (skipped when no row has it on), then one ascending sort for
#: those on sorted logits (vLLM's apply_top_k_top_p).
ON_LOGITS = {"min_p": _min_p}
ON_SORTED = {"top_k": _top_k, "top_p": _top_p}


def _parameter(batch: SamplingBatch, name: str, device: torch.device) -> torch.Tensor:
    """A parameter's column as torch computes with it: int64 or float32."""
    dtype = np.int64 if np.dtype(PARAMS[name].dtype).kind == "i" else np.float32
    return _column(getattr(batch, name), dtype, device)


def truncate(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The logits with every token a truncation drops at -inf."""
    for name, op in ON_LOGITS.items():
        if not PARAMS[name].is_off(getattr(batch, name)).all():
            logits = op(logits, _parameter(batch, name, logits.device))
    ascending, order = logits.sort(dim=-1, descending=False)
    for name, op in ON_SORTED.items():
        ascending = op(ascending, _parameter(batch, name, logits.device))
    return torch.empty_like(ascending).scatter_(1, order, ascending)


def torch_sort_sample(logits: torch.Tensor, batch: SamplingBatch,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """Token ids [B] for logits [B, V] (any float dtype; computed in float32)."""
    batch = batch.with_histories()
    logits = logits.float().clone()
    size, vocab = logits.shape
    device = logits.device
    prompt = _bin_counts(batch.prompt_offsets, batch.prompt_ids, size, vocab, device)
    output = _bin_counts(batch.output_offsets, batch.output_ids, size, vocab, device)
    repetition = _column(batch.repetition_penalty, np.float32, device)[:, None]
    seen = (prompt > 0) | (output > 0)
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalized, logits)
    logits -= _column(batch.frequency_penalty, np.float32, device)[:, None] * output
    logits -= _column(batch.presence_penalty, np.float32, device)[:, None] * (output > 0)
    logits /= temperature_divisor(batch, device)

    logits = truncate(logits, batch)
    probs = logits.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    sampled = probs.div_(noise).argmax(dim=-1)
    return torch.where(greedy_rows(batch, device), logits.argmax(dim=-1), sampled)
