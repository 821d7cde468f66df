"""Float64 reference of the sampling semantics (tests and benchmarks only).

A direct, unoptimized transcription of the order in SIMPLE.md (vLLM's):
bias and bans, penalties, greedy, temperature, min_p, top_k, top_p, with
full sorts. ``probabilities`` returns the exact distribution a row's draw must
follow; the kernels are tested against it statistically.
"""
from __future__ import annotations

import numpy as np

from .params import GREEDY_TEMPERATURE, SamplingBatch


def penalized_logits(row: np.ndarray, batch: SamplingBatch, r: int) -> np.ndarray:
    """Steps 1-2 for row r of the batch, in float64."""
    logits = np.asarray(row, dtype=np.float64).copy()
    lo, hi = batch.bias_offsets[r], batch.bias_offsets[r + 1]
    np.add.at(logits, np.asarray(batch.bias_ids[lo:hi], np.int64),
              np.asarray(batch.bias_values[lo:hi], np.float64))
    lo, hi = batch.ban_offsets[r], batch.ban_offsets[r + 1]
    logits[np.asarray(batch.ban_ids[lo:hi], np.int64)] = -np.inf
    prompt = np.asarray(batch.prompt_ids[batch.prompt_offsets[r]:batch.prompt_offsets[r + 1]],
                        np.int64)
    output = np.asarray(batch.output_ids[batch.output_offsets[r]:batch.output_offsets[r + 1]],
                        np.int64)
    counts = np.bincount(output, minlength=logits.size).astype(np.float64)
    seen = counts > 0
    seen[prompt] = True
    penalty = float(batch.repetition_penalty[r])
    logits[seen] = np.where(logits[seen] > 0, logits[seen] / penalty, logits[seen] * penalty)
    with np.errstate(invalid="ignore"):
        logits -= float(batch.frequency_penalty[r]) * counts
        logits -= float(batch.presence_penalty[r]) * (counts > 0)
    return logits


def scaled_logits(row: np.ndarray, batch: SamplingBatch, r: int) -> np.ndarray:
    """z: penalized logits over the temperature (temperature 1 when greedy)."""
    logits = penalized_logits(row, batch, r)
    temperature = float(batch.temperature[r])
    return logits if temperature < GREEDY_TEMPERATURE else logits / temperature


def log_softmax(z: np.ndarray) -> np.ndarray:
    finite = z[np.isfinite(z)]
    top = finite.max()
    return z - top - np.log(np.exp(finite - top).sum())


def rank_order(z: np.ndarray) -> np.ndarray:
    """Token ids by z descending, ties by lower id first."""
    return np.lexsort((np.arange(z.size), -z))


def probabilities(row: np.ndarray, batch: SamplingBatch, r: int) -> np.ndarray:
    """Exact probability of each token for row r (float64, sums to 1)."""
    z = scaled_logits(row, batch, r)
    if float(batch.temperature[r]) < GREEDY_TEMPERATURE:
        probs = np.zeros(z.size)
        probs[int(np.argmax(z))] = 1.0
        return probs
    top = z.max()
    keep = np.isfinite(z)
    min_p = float(batch.min_p[r])
    if min_p > 0:
        keep &= (z - top) >= np.log(min_p)
    k = int(batch.top_k[r])
    if 0 < k < z.size:
        kth = np.sort(z[keep])[::-1][k - 1] if keep.sum() > k else -np.inf
        keep &= z >= kth
    weights = np.where(keep, np.exp(np.where(keep, z - top, 0.0)), 0.0)
    top_p = float(batch.top_p[r])
    if top_p < 1:
        order = rank_order(np.where(keep, z, -np.inf))
        ordered = weights[order]
        before = np.concatenate(([0.0], np.cumsum(ordered)[:-1]))
        nucleus = before < top_p * ordered.sum()
        trimmed = np.zeros_like(weights)
        trimmed[order[nucleus]] = ordered[nucleus]
        weights = trimmed
    return weights / weights.sum()
