"""Float64 reference of the sampling semantics (tests and benchmarks only).

A direct, unoptimized transcription of the order in SIMPLE.md (vLLM's):
bias and bans, penalties, greedy, temperature, min_p, top_k, top_p, with
full sorts. ``probabilities`` returns the exact distribution a row's draw must
follow; the kernels are tested against it statistically.
"""
from __future__ import annotations

import numpy as np

from .params import TRUNCATIONS, SamplingBatch, is_greedy


def penalized_logits(row: np.ndarray, batch: SamplingBatch, r: int) -> np.ndarray:
    """Steps 1-2 for row r of the batch, in float64."""
    if batch.history_ref is not None:  # this row's lists alone
        batch, r = batch.take([r]).with_histories(), 0
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
    return logits if is_greedy(temperature) else logits / temperature


def log_softmax(z: np.ndarray) -> np.ndarray:
    finite = z[np.isfinite(z)]
    top = finite.max()
    return z - top - np.log(np.exp(finite - top).sum())


def rank_order(z: np.ndarray) -> np.ndarray:
    """Token ids by z descending, ties by lower id first."""
    return np.lexsort((np.arange(z.size), -z))


def _min_p(z: np.ndarray, keep: np.ndarray, min_p: float) -> np.ndarray:
    return keep & ((z - z.max()) >= np.log(min_p))


def _top_k(z: np.ndarray, keep: np.ndarray, k: int) -> np.ndarray:
    if not 0 < k < z.size:
        return keep
    kth = np.sort(z[keep])[::-1][k - 1] if keep.sum() > k else -np.inf
    return keep & (z >= kth)


def _top_p(z: np.ndarray, keep: np.ndarray, top_p: float) -> np.ndarray:
    weights = np.where(keep, np.exp(np.where(keep, z - z.max(), 0.0)), 0.0)
    order = rank_order(np.where(keep, z, -np.inf))
    ordered = weights[order]
    before = np.concatenate(([0.0], np.cumsum(ordered)[:-1]))
    nucleus = np.zeros_like(keep)
    nucleus[order[before < top_p * ordered.sum()]] = True
    return keep & nucleus


#: Each truncation of ``params.TRUNCATIONS``: (z, kept so far, value) -> kept.
TRUNCATE = {"min_p": _min_p, "top_k": _top_k, "top_p": _top_p}


def probabilities(row: np.ndarray, batch: SamplingBatch, r: int) -> np.ndarray:
    """Exact probability of each token for row r (float64, sums to 1)."""
    z = scaled_logits(row, batch, r)
    if is_greedy(batch.temperature[r]):
        probs = np.zeros(z.size)
        probs[int(np.argmax(z))] = 1.0
        return probs
    keep = np.isfinite(z)
    for param in TRUNCATIONS:
        value = np.asarray(getattr(batch, param.name))[r]
        if not param.is_off(value):
            keep = TRUNCATE[param.name](z, keep, value.item())
    weights = np.where(keep, np.exp(np.where(keep, z - z.max(), 0.0)), 0.0)
    return weights / weights.sum()
