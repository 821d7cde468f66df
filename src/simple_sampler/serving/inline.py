"""Sampling inside the data plane with PyTorch: the ``inline`` baseline mode,
the in-line sampler a user would pick (vLLM v1's design), in ONE batched pass.

Every row of the step goes through the same handful of whole-batch torch ops,
on the logits' device (the GPU with ``--engine torch --device cuda``, where it
is bench serve-gpu's ``gpu_inline``): there is no Python loop over rows, so a
batch of 256 issues the same kernels as a batch of 2
(tests/test_inline.py counts them). In the sampler's order (SIMPLE.md,
"Sampling semantics"):

1. logit_bias by one ``index_add_`` and bans by one ``index_fill_`` over the
   flattened [B * V] logits;
2. penalties by scatter over the histories (only when some row has one on):
   repetition over the prompt and output ids, presence and frequency over the
   output ids, each a gather and a write of the touched (row, id) pairs, never
   a [B, V] count table;
3. greedy rows take the argmax of those logits (lowest id on ties);
4. the others are divided by their temperature;
5-7. min_p, top_k and top_p as masks over ONE batched descending sort of the
   rows (a stable sort: ties by lower id, as the float64 reference ranks them),
   as vLLM's native path does (``vllm/v1/sample/ops/topk_topp_sampler.py``,
   ``apply_top_k_top_p_pytorch``: one ``sort`` of [B, V], top-k by gathering
   the k-th value, top-p by a cumulative sum of the sorted probabilities). Each
   mask is a prefix of the sorted row, so what is kept is the first
   ``n_keep`` columns; without any top_k / top_p in the batch there is no sort;
8. one draw per row by inverse CDF: a uniform keyed by (seed, step) alone
   (``row_uniforms``: SplitMix64 on the host, B numbers per step), scaled by
   the kept mass and looked up with one batched ``searchsorted`` in the
   cumulative weights (in sorted order the cumulative sum of step 7 is reused).

Randomness differs from the kernels (Philox in C): a seeded row's token is a
deterministic function of (seed, step, its logits), independent of the batch
and of the row's position (given logits that are), but not the kernels'
token. Noise keyed by (seed, step, token) for an exponential race
(``vllm/v1/sample/ops/topk_topp_sampler.py``, ``random_sample``; its CPU path
hashes per (seed, token) with SplitMix64) was considered: without a fused
kernel it costs some twenty elementwise int64 passes over [B, V] per step in
eager torch, where one uniform per row and the cumulative sum cost one pass;
the distribution is the same (tests/test_inline.py, chi-square against the
float64 reference).

Exactness guards: a token of zero weight (banned, truncated, underflowed) is
never drawn, whatever the float rounding of a parallel cumulative sum: in
sorted order the draw is clamped to the kept prefix, in vocabulary order it
takes the first column whose cumulative weight passes the target AND whose
weight is positive (the top token when rounding leaves none: a case of
probability of the order of float32's epsilon).

Logprobs are those of ``simple_sampler.sample``: the chosen token's
log-probability under softmax of the penalized, temperature-scaled logits
(temperature 1 for greedy rows), before truncation.

Run here on the CPU only; the same ops on CUDA are tested under a CUDA skip
(tests/test_inline.py) and have NOT been run on a GPU yet.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from ..host_copy import to_device, to_host
from ..params import PARAMS, SamplingBatch, any_on, is_greedy

_U64 = np.uint64
#: SplitMix64's constants (Steele, Lea, Flood 2014; the finalizer of
#: java.util.SplittableRandom), as vLLM's CPU Gumbel path keys its noise
_GOLDEN = _U64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = _U64(0xBF58476D1CE4E5B9), _U64(0x94D049BB133111EB)
#: the largest float32 below 1: a uniform that rounds to 1 would select past the kept mass
_BELOW_ONE = np.nextafter(np.float32(1.0), np.float32(0.0))


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer over a uint64 array (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = x + _GOLDEN
        x = (x ^ (x >> _U64(30))) * _MIX1
        x = (x ^ (x >> _U64(27))) * _MIX2
        return x ^ (x >> _U64(31))


def row_uniforms(seed, step) -> np.ndarray:
    """float32 [B] in (0, 1): each row's uniform, keyed by (seed, step) only,
    never by the batch or the row's position."""
    seed = np.asarray(seed).astype(_U64)
    key = _splitmix64(seed ^ _splitmix64(np.asarray(step).astype(_U64)))
    uniform = ((key >> _U64(11)).astype(np.float64) + 0.5) * 2.0 ** -53
    return np.minimum(uniform.astype(np.float32), _BELOW_ONE)


class _RowColumns(NamedTuple):
    """Per-row parameters on the device, [B, 1] each, from ONE host-to-device copy."""

    greedy: torch.Tensor       # bool
    divisor: torch.Tensor      # temperature, 1 for greedy rows
    log_min_p: torch.Tensor    # -inf where min_p is off
    top_k: torch.Tensor        # int64, V where off
    top_p: torch.Tensor
    uniform: torch.Tensor


def _row_columns(batch: SamplingBatch, vocab: int, device: torch.device) -> _RowColumns:
    temperature = np.asarray(batch.temperature, np.float32)
    greedy = is_greedy(temperature)
    top_k = np.asarray(batch.top_k, np.int64)
    top_k = np.where(PARAMS["top_k"].is_off(top_k) | (top_k >= vocab), vocab, top_k)
    with np.errstate(divide="ignore"):
        log_min_p = np.log(np.asarray(batch.min_p, np.float64))
    # top_k as float32 is exact: vocabularies stay below 2**24 ids
    table = np.stack([greedy, np.where(greedy, 1.0, temperature), log_min_p, top_k,
                      batch.top_p, row_uniforms(batch.seed, batch.step)], axis=1)
    (columns,) = to_device(device, table.astype(np.float32))
    columns = columns.split(1, dim=1)
    return _RowColumns(columns[0] > 0, columns[1], columns[2], columns[3].long(),
                       columns[4], columns[5])


def _flat_keys(offsets, ids, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(positions in the flattened [B * V] logits, row of each) of a CSR id list."""
    rows = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    return rows * vocab + np.asarray(ids, dtype=np.int64), rows


def _apply_penalties(flat: torch.Tensor, batch: SamplingBatch, vocab: int) -> None:
    """Repetition, then presence and frequency, in place on the flattened
    logits, touching only the (row, id) pairs of the histories. A pair listed
    twice is written twice with the same value (gathered before the write),
    so no ``unique`` is needed; frequency adds -f once per occurrence."""
    batch = batch.with_histories()
    prompt, prompt_rows = _flat_keys(batch.prompt_offsets, batch.prompt_ids, vocab)
    output, output_rows = _flat_keys(batch.output_offsets, batch.output_ids, vocab)
    repetition = np.asarray(batch.repetition_penalty, np.float32)
    seen, seen_rows = np.concatenate([prompt, output]), np.concatenate([prompt_rows, output_rows])
    seen, penalty = to_device(flat.device, seen, repetition[seen_rows])
    values = flat[seen]
    flat[seen] = torch.where(values > 0, values / penalty, values * penalty)
    presence = np.asarray(batch.presence_penalty, np.float32)[output_rows]
    frequency = np.asarray(batch.frequency_penalty, np.float32)[output_rows]
    output, presence, frequency = to_device(flat.device, output, presence, frequency)
    flat[output] = flat[output] - presence
    flat.index_add_(0, output, -frequency)


def penalized_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Steps 1-2 for every row: float32 [B, V], a new tensor."""
    z = logits.to(torch.float32, copy=True)
    vocab = z.shape[-1]
    flat = z.view(-1)
    if np.asarray(batch.bias_ids).size:
        keys, _ = _flat_keys(batch.bias_offsets, batch.bias_ids, vocab)
        keys, values = to_device(z.device, keys, np.asarray(batch.bias_values, np.float32))
        flat.index_add_(0, keys, values)
    if np.asarray(batch.ban_ids).size:
        keys, _ = _flat_keys(batch.ban_offsets, batch.ban_ids, vocab)
        flat.index_fill_(0, *to_device(z.device, keys), -torch.inf)
    if any_on(batch, "penalty").any():
        _apply_penalties(flat, batch, vocab)
    return z


def _draw_in_vocabulary_order(z: torch.Tensor, top: torch.Tensor, columns: _RowColumns,
                              min_p: bool, fallback: torch.Tensor) -> torch.Tensor:
    """Token ids [B] when no row has top_k or top_p on: no sort."""
    shifted = z - top
    weights = shifted.exp()
    if min_p:
        weights.masked_fill_(shifted < columns.log_min_p, 0.0)
    cumulative = weights.cumsum(dim=-1)
    target = columns.uniform * cumulative[:, -1:]
    passed = (cumulative > target) & (weights > 0)
    first = passed.to(torch.uint8).argmax(dim=-1, keepdim=True)
    found = passed.gather(1, first)
    return torch.where(found, first, fallback[:, None])[:, 0]


def _draw_sorted(z: torch.Tensor, columns: _RowColumns, min_p: bool, top_k: bool,
                 top_p: bool) -> torch.Tensor:
    """Token ids [B] from one descending sort: min_p, top_k, top_p as prefix masks."""
    ranked, order = z.sort(dim=-1, descending=True, stable=True)
    shifted = ranked - ranked[:, :1]
    weights = shifted.exp()
    keep = weights > 0
    if min_p:
        keep &= shifted >= columns.log_min_p
    if top_k:  # ties at the k-th value are kept
        keep &= ranked >= ranked.gather(1, columns.top_k - 1)
    weights.masked_fill_(~keep, 0.0)
    cumulative = weights.cumsum(dim=-1)
    if top_p:  # the smallest prefix whose mass reaches top_p: mass before < top_p
        keep &= (cumulative - weights) < columns.top_p * cumulative[:, -1:]
    # the kept prefix's length; a first False found, not a count, so that an
    # ulp's disorder in a parallel cumulative sum cannot extend it
    vocab = z.shape[-1]
    dropped = ~keep
    kept = torch.where(dropped.any(dim=-1, keepdim=True),
                       dropped.to(torch.uint8).argmax(dim=-1, keepdim=True), vocab)
    target = columns.uniform * cumulative.gather(1, kept - 1)
    index = torch.minimum(torch.searchsorted(cumulative, target, right=True), kept - 1)
    return order.gather(1, index)[:, 0]


def sample_torch(logits: torch.Tensor, batch: SamplingBatch) -> tuple:
    """Sample one token per row of float logits [B, V] with torch, all rows
    in one batched pass on the logits' device.

    Returns ``(token_ids int64 [B], logprobs float32 [B])`` on the host, by
    one device-to-host copy (module docstring); where a row asks for top
    logprobs (``batch.num_top_logprobs``), a third element, their ids int32
    [B, k] and logprobs float32 [B, k] (``samplers.SampleResult``), by one
    more copy.
    """
    vocab = logits.shape[-1]
    batch.validate(vocab)
    columns = _row_columns(batch, vocab, logits.device)
    z = penalized_logits(logits, batch)
    greedy_tokens = z.argmax(dim=-1)
    z.div_(columns.divisor)
    log_total = torch.logsumexp(z, dim=-1, keepdim=True)
    on = {name: not PARAMS[name].is_off(getattr(batch, name)).all()
          for name in ("min_p", "top_k", "top_p")}
    if on["top_k"] or on["top_p"]:
        drawn = _draw_sorted(z, columns, on["min_p"], on["top_k"], on["top_p"])
    else:
        drawn = _draw_in_vocabulary_order(z, z.amax(dim=-1, keepdim=True), columns,
                                          on["min_p"], greedy_tokens)
    tokens = torch.where(columns.greedy[:, 0], greedy_tokens, drawn)
    scores, scores_total = _scored(logits, batch, z, log_total)
    logprobs = scores.gather(1, tokens[:, None]) - scores_total
    # token ids below 2**53 are exact in float64: one copy for both, and for
    # each row's total, whose -inf is a row with every token banned (a
    # grammar's mask, allowed_token_ids), refused as the kernels refuse it
    host = to_host(torch.cat([tokens[:, None].double(), logprobs.double(),
                              log_total.double()], dim=1)).numpy()
    if (banned := np.flatnonzero(host[:, 2] == -np.inf)).size:
        raise ValueError(f"row {int(banned[0])}: every token is banned (-inf after bias, bans, "
                         f"masks and penalties)")
    sampled = host[:, 0].astype(np.int64), host[:, 1].astype(np.float32)
    wanted = batch.num_top_logprobs
    if wanted is None or not np.any(wanted):
        return sampled
    return (*sampled, _top_logprobs(scores, scores_total, wanted))


sample_torch.gives_top_logprobs = True


def _scored(logits: torch.Tensor, batch: SamplingBatch, z: torch.Tensor,
            log_total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' logprobs' logits and their logsumexp: z's, or for the rows
    ``batch.raw_logprobs`` names, the logits as given (vLLM's raw_logprobs,
    the kernels' score_raw)."""
    if batch.raw_logprobs is None or not np.any(batch.raw_logprobs):
        return z, log_total
    raw = torch.as_tensor(np.asarray(batch.raw_logprobs, bool), device=z.device)[:, None]
    given = logits.to(torch.float32)
    return (torch.where(raw, given, z),
            torch.where(raw, torch.logsumexp(given, dim=-1, keepdim=True), log_total))


def _top_logprobs(z: torch.Tensor, log_total: torch.Tensor, wanted: np.ndarray):
    """The top logprobs of the rows that want them (``wanted`` int [B]), as
    the kernels give them: under softmax(z), most likely first, ties by
    lower id (a stable descending sort); ids int32 [B, k] and logprobs
    float32 [B, k], k the widest ask (at most V), -1 and -inf elsewhere."""
    width = min(int(np.max(wanted)), z.shape[-1])
    asking = np.flatnonzero(wanted)
    rows = torch.as_tensor(asking, device=z.device)
    ranked, order = z.index_select(0, rows).sort(dim=-1, descending=True, stable=True)
    picked = torch.cat([order[:, :width].double(),
                        (ranked[:, :width] - log_total.index_select(0, rows)).double()], dim=1)
    host = to_host(picked).numpy()
    ids = np.full((len(wanted), width), -1, np.int32)
    logprobs = np.full((len(wanted), width), -np.inf, np.float32)
    ids[asking], logprobs[asking] = host[:, :width], host[:, width:]
    return ids, logprobs
