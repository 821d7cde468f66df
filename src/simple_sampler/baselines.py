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

from .params import GREEDY_TEMPERATURE, SamplingBatch


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


def torch_sort_sample(logits: torch.Tensor, batch: SamplingBatch,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """Token ids [B] for logits [B, V] (any float dtype; computed in float32)."""
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

    temperature = _column(batch.temperature, np.float32, device)
    greedy = temperature < GREEDY_TEMPERATURE
    logits /= torch.where(greedy, 1.0, temperature)[:, None]

    min_p = _column(batch.min_p, np.float32, device)
    if bool((min_p > 0).any()):
        probs = logits.softmax(dim=-1)
        top = probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < min_p[:, None] * top, -float("inf"))

    sorted_logits, order = logits.sort(dim=-1, descending=False)
    top_k = _column(batch.top_k, np.int64, device)
    k = torch.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)
    kth = sorted_logits.gather(1, (vocab - k)[:, None])
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, -float("inf"))
    top_p = _column(batch.top_p, np.float32, device)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    outside = cumulative <= (1 - top_p)[:, None]
    outside[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(outside, -float("inf"))
    logits = torch.empty_like(sorted_logits).scatter_(1, order, sorted_logits)

    probs = logits.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    sampled = probs.div_(noise).argmax(dim=-1)
    return torch.where(greedy, logits.argmax(dim=-1), sampled)
