"""Sampling inside the data plane with PyTorch: the ``inline`` baseline mode.

This is what users run today (vLLM-style): the engine's process samples its
own logits with torch, sort-based top-k / top-p
(``baselines.torch_sort_sample``), on the critical path of every step.

Semantics are the sampler's (SIMPLE.md order): logit_bias and bans, then
repetition / presence / frequency penalties over the history, greedy below
``GREEDY_TEMPERATURE``, temperature, min_p, top_k, top_p, one draw. The
distribution is the same up to float32 rounding and the order of tied
logits. Two differences, both from torch:

* randomness: each row draws with its own ``torch.Generator`` seeded from
  (seed, step), so a seeded request is reproducible and batch-invariant, but
  its tokens differ from the ``simple`` mode's (Philox in the kernels);
* rows are drawn one at a time, because ``torch_sort_sample`` takes one
  generator per call (vLLM does the same for seeded requests).

Everything runs on the logits' device: on the CPU with the CPU engines, on
the GPU with ``--engine torch --device cuda`` (the engine then hands its
logits over without the device-to-host copy), where it is the GPU-inline
baseline: torch ops, a sort per row with truncation, no FlashInfer; its
row-by-row draws are one generator per row, as vLLM's path for seeded
requests (unseeded ones it draws in one batch).

Logprobs are those of ``simple_sampler.sample``: the chosen token's
log-probability under softmax of the penalized, temperature-scaled logits
(temperature 1 for greedy rows), before truncation.
"""
from __future__ import annotations

import hashlib

import numpy as np
import torch

from ..baselines import temperature_divisor, torch_sort_sample
from ..params import GREEDY_TEMPERATURE, TRUNCATIONS, SamplingBatch, SamplingParams


def _flat_keys(offsets: np.ndarray, ids: np.ndarray, vocab: int,
               device: torch.device) -> torch.Tensor:
    """Positions in the flattened [B * V] logits of a CSR id list: int64."""
    rows = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    return torch.from_numpy(rows * vocab + np.asarray(ids, dtype=np.int64)).to(device)


def _per_row(values, keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """A per-row float32 column broadcast to flattened positions ``keys``."""
    return torch.from_numpy(np.asarray(values, np.float32)).to(keys.device)[keys // vocab]


def scaled_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """z for every row: bias, bans and penalties applied, divided by the
    temperature (1 for greedy rows). float32 [B, V], a new tensor.

    Penalties touch only the (row, id) pairs in the histories, not the whole
    [B, V] matrix."""
    z = logits.float().clone()
    size, vocab = z.shape
    device = z.device
    flat = z.view(-1)
    flat.index_add_(0, _flat_keys(batch.bias_offsets, batch.bias_ids, vocab, device),
                    torch.from_numpy(np.asarray(batch.bias_values, np.float32)).to(device))
    flat[_flat_keys(batch.ban_offsets, batch.ban_ids, vocab, device)] = -torch.inf
    output = _flat_keys(batch.output_offsets, batch.output_ids, vocab, device)
    seen = torch.unique(torch.cat([_flat_keys(batch.prompt_offsets, batch.prompt_ids, vocab,
                                              device), output]))
    penalty = _per_row(batch.repetition_penalty, seen, vocab)
    flat[seen] = torch.where(flat[seen] > 0, flat[seen] / penalty, flat[seen] * penalty)
    generated, counts = torch.unique(output, return_counts=True)
    flat[generated] -= (_per_row(batch.frequency_penalty, generated, vocab) * counts
                        + _per_row(batch.presence_penalty, generated, vocab))
    return z / temperature_divisor(batch, device)


def row_generator(seed: int, step: int, device: torch.device = torch.device("cpu")
                  ) -> torch.Generator:
    """A torch generator keyed by (seed, step) only, never by batch position
    (on ``device``: a draw needs a generator of its tensor's device)."""
    digest = hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest, "little"))


def sample_torch(logits: torch.Tensor, batch: SamplingBatch) -> tuple[np.ndarray, np.ndarray]:
    """Sample one token per row of float logits [B, V] with torch.

    Returns ``(token_ids int64 [B], logprobs float32 [B])`` (module docstring).
    """
    batch.validate(logits.shape[-1])
    z = scaled_logits(logits, batch)
    tokens = z.argmax(dim=-1)  # the greedy rows' answer; the others are drawn below
    for row in np.flatnonzero(np.asarray(batch.temperature) >= GREEDY_TEMPERATURE):
        # z is already penalized and scaled: only truncation and the draw remain.
        truncation = SamplingBatch.from_params([SamplingParams(
            temperature=1.0, seed=0,
            **{p.name: np.asarray(getattr(batch, p.name))[row].item() for p in TRUNCATIONS})])
        generator = row_generator(int(batch.seed[row]), int(batch.step[row]), z.device)
        tokens[row] = torch_sort_sample(z[row:row + 1], truncation, generator)[0]
    logprobs = z.log_softmax(dim=-1).gather(1, tokens[:, None])[:, 0]
    return tokens.cpu().numpy().astype(np.int64), logprobs.cpu().numpy().astype(np.float32)
