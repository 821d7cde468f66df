"""Hot-first handoff, the decision side: compact rows -> tokens, and the
fallback to full rows. The data plane's side (the summary, in torch next to
the logits) is ``serving.hot_first``.

Instead of a row's V logits, the data plane sends (``hot_first_summary``):

* the raw logits of the hot set H (a ``HotVocab``, the same for every row),
* the raw logits of the row's *touched* ids T outside H: every id its
  bias, bans or penalties can change (``touched_lists``), plus, optionally,
  the row's ``cold_top`` largest logits outside H u T,
* a summary of the cold region C = V \\ (H u T), which no override touches:
  m_C = max logit, the lowest id reaching it, and
  S_C = sum_{i in C} exp(x_i / T - m_C / T) at the row's temperature T
  (T = 1 for greedy rows, as the kernels use).

``sample_compact`` decides each row from that alone (the Cython
``sample_compact_batch``, O(|H| + |T|) per row) or reports it undecided:
``HANDOFF_NEED_FULL`` (the compact row cannot decide: the full row is
sampled as usual, with the row's own seed) or ``HANDOFF_NEED_COLD`` (the
draw fell in C: the full row is sampled conditioned on C, with an
independent stream keyed by (seed, step), unless the data plane drew the
row's cold token on that stream, ``cold_draws``: then it is decided with
it). ``fallback_batch`` builds that second request; ``merge_fallback`` folds its answer in. ``decide_hot_first``
runs the rounds for every caller (``serving.hot_first.sample_hot_first`` on
one host, ``triton.hot_first_sampler`` over the sampler pool). docs/HANDOFF.md derives why the result follows
exactly the distribution of ``sampling.sample`` on the full rows, and the
float-error policy.

A seeded row's token is a function of (seed, step, row, parameters, H,
cold_top): it may differ from the full path's, never between batches,
positions, threads or instances that use the same H and cold_top.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, replace

import numpy as np

from . import _sampling
from ._sampling import Dtype, HandoffOutcome
from .host_copy import to_host
from .params import RULES, SamplingBatch, is_greedy
from .sampling import (SampleOutput, chosen_as_listed, empty_output, is_torch_tensor,
                       kernel_params, kernel_rows, logits_array, raise_row_errors, sample,
                       top_width)
from .shvs.hot_vocab import HotVocab, untruncated_rows

#: How many of each row's largest cold logits the data plane hands over
#: with its touched ids by default (``hot_first_summary``'s cold_top): they
#: make top_p rows decidable (bench handoff: fallback 1/64 rows at 256 on
#: real SmolLM2 rows in top_p, 42/64 without) for 8 bytes each.
DEFAULT_COLD_TOP = 256


@dataclass
class CompactRows:
    """B compact rows (torch tensors on the data plane's device, or numpy
    arrays after ``cpu()``).

    hot_logits: [B, |H|] in the logits' dtype; column j holds id hot_ids[j]
        (``HotVocab.kernel_arrays()[0]``, ascending).
    touched_offsets: int64 [B + 1]; touched_ids: int32 [N]; touched_logits:
        float32 [N]: CSR, row r's ids touched_ids[offsets[r]:offsets[r+1]],
        ascending, none in H, with their raw logits.
    cold_max: float32 [B], the max raw logit over C (-inf when C is empty or
        all -inf; NaN / +inf when C holds one, reported by the kernel).
    cold_argmax: int32 [B], the lowest id of C reaching cold_max (-1: none).
    cold_mass: float32 [B], S_C (0 when cold_max is -inf).
    cold_token: int32 [B] or None: a token the data plane drew inside C
        with P(t) = w_t / W_C on the row's cold stream (``cold_draws``), -1
        for a row it did not draw; a NEED_COLD row with one is decided with
        it, no full row needed. cold_token_logit: float32 [B], its raw logit
        (for its logprob). Both None: no row has one.
    """

    hot_logits: object
    touched_offsets: object
    touched_ids: object
    touched_logits: object
    cold_max: object
    cold_argmax: object
    cold_mass: object
    cold_token: object = None
    cold_token_logit: object = None

    def cpu(self) -> "CompactRows":
        """The same rows as numpy arrays (bfloat16 hot logits as
        ml_dtypes.bfloat16), what travels to the decision plane; from a
        GPU in one transfer (``host_arrays``)."""
        names = [name for name in _COMPACT_TYPES if getattr(self, name) is not None]
        arrays = host_arrays([getattr(self, name) for name in names])
        return CompactRows(**{name: array if _COMPACT_TYPES[name] is None
                              else array.astype(_COMPACT_TYPES[name], copy=False)
                              for name, array in zip(names, arrays)})

    def rows(self, start: int, end: int) -> "CompactRows":
        """Rows [start, end) of the ``cpu()`` form, as views (the touched
        offsets rebased to the first of them)."""
        a, b = self.touched_offsets[start], self.touched_offsets[end]
        return CompactRows(
            hot_logits=self.hot_logits[start:end],
            touched_offsets=self.touched_offsets[start:end + 1] - a,
            touched_ids=self.touched_ids[a:b], touched_logits=self.touched_logits[a:b],
            **{name: None if value is None else value[start:end]
               for name, value in vars(self).items() if name not in _CSR_FIELDS})

    def nbytes(self) -> int:
        """Bytes of the compact rows as numpy arrays (``cpu()`` form), the
        touched offsets and the cold tokens included."""
        rows = self.cpu()
        return sum(np.asarray(value).nbytes for value in rows.__dict__.values()
                   if value is not None)


def host_array(value) -> np.ndarray:
    """A tensor (any device) or array as a numpy array on the host, no copy
    where none is needed; bfloat16 as ml_dtypes.bfloat16."""
    if not is_torch_tensor(value):
        return np.asarray(value)
    return logits_array(to_host(value).contiguous())


def host_arrays(values) -> list[np.ndarray]:
    """``host_array`` of each value; tensors that all lie on one GPU cross
    in one transfer (their bytes packed on the device), not one each: a
    device-to-host copy waits for the device and costs ~10 us of setup
    whatever its size."""
    if not all(is_torch_tensor(value) for value in values) \
            or len({value.device for value in values}) != 1 or values[0].device.type == "cpu":
        return [host_array(value) for value in values]
    import torch

    # 8-byte dtypes first: every piece starts aligned to its itemsize
    order = sorted(range(len(values)), key=lambda i: -values[i].element_size())
    packed = to_host(torch.cat([values[i].contiguous().view(-1).view(torch.uint8)
                                for i in order]))
    out, start = [None] * len(values), 0
    for i in order:
        end = start + values[i].numel() * values[i].element_size()
        out[i] = logits_array(packed[start:end].view(values[i].dtype).view(values[i].shape))
        start = end
    return out


#: CompactRows' fields that ``rows`` slices by the touched offsets, not by row
_CSR_FIELDS = ("hot_logits", "touched_offsets", "touched_ids", "touched_logits")
#: CompactRows' fields in their cpu() dtypes (None: the logits' own)
_COMPACT_TYPES = {"hot_logits": None, "touched_offsets": np.int64, "touched_ids": np.int32,
                  "touched_logits": np.float32, "cold_max": np.float32, "cold_argmax": np.int32,
                  "cold_mass": np.float32, "cold_token": np.int32, "cold_token_logit": np.float32}


#: an enum member's lookup is two Python calls, on every request
_DECIDED, _NEED_COLD = int(HandoffOutcome.HANDOFF_DECIDED), int(HandoffOutcome.HANDOFF_NEED_COLD)


@dataclass
class HandoffOutput(SampleOutput):
    """``SampleOutput`` plus outcome int8 [B] (``HandoffOutcome``): 0 =
    decided from the compact row; 1 = NEED_FULL; 2 = NEED_COLD, whose
    logprobs[r] holds log(W_C / Z), C's share of the row's mass, until
    ``merge_fallback`` replaces it. token_ids of undecided rows are -1."""

    outcome: np.ndarray = None

    @property
    def undecided(self) -> np.ndarray:
        return self.outcome != _DECIDED


_NO_COLD_TOKENS = (np.empty(0, np.int64), np.empty(0, np.float32))


def _check_compact(rows: CompactRows, size: int, hot_vocab: HotVocab,
                   shapes_checked: bool = False) -> tuple:
    """Raise ValueError for malformed compact rows; returns the kernel's
    (touched offsets int64, ids int32, cold_argmax int64, cold_max float32,
    cold_mass float32, cold_token int64, cold_token_logit float32: empty
    when none came)
    arrays. shapes_checked: the caller checked every shape and built the
    offsets (``sampler_decode.decode_request``): only the kernel pass over
    the ids (and the cold tokens) is left."""
    vocab = hot_vocab.vocab_size
    offsets = np.ascontiguousarray(rows.touched_offsets, np.int64)
    ids = np.ascontiguousarray(rows.touched_ids)
    if not shapes_checked:
        _check_compact_shapes(rows, size, hot_vocab, offsets, ids)
    range_message = f"touched_ids must be token ids in [0, {vocab}), got {{}}"
    if ids.dtype != np.int32 and ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(range_message.format(int(ids[(ids < 0) | (ids >= vocab)][0])))
    ids = np.ascontiguousarray(ids, np.int32)  # int32 ids: the C pass checks their range
    argmax = np.ascontiguousarray(rows.cold_argmax, np.int64)
    cold_max = np.ascontiguousarray(rows.cold_max, np.float32)
    tokens, token_logits = _NO_COLD_TOKENS if rows.cold_token is None else (
        np.ascontiguousarray(rows.cold_token, np.int64),
        np.ascontiguousarray(rows.cold_token_logit, np.float32))
    cold_mass = np.ascontiguousarray(rows.cold_mass, np.float32)
    problem, index = _sampling.check_compact_ids(offsets, ids, hot_vocab.kernel_arrays()[2], vocab,
                                                 argmax, tokens, token_logits, cold_max, cold_mass)
    if problem == 1:
        raise ValueError(range_message.format(int(ids[index])))
    if problem == 2:
        raise ValueError("touched_ids must be ascending and distinct within each row")
    if problem == 3:
        raise ValueError(f"touched_ids must not hold hot ids, got {int(ids[index])}")
    if problem == 4:
        raise ValueError(f"cold_argmax must be -1 or a token id in [0, {vocab})")
    if problem == 5:
        raise ValueError(f"cold_token must be -1 or a token id in [0, {vocab})")
    if problem == 6:  # a token from anywhere else would skew the row's distribution
        raise ValueError("cold_token must be an id of the cold region (not hot, not touched), "
                         "with a finite cold_token_logit <= cold_max")
    if problem == 7:  # the kernels would return it as the token
        raise ValueError(f"row {index}: cold_argmax must be -1 when cold_max is -inf and an id "
                         f"of the cold region (not hot, not touched) otherwise, got "
                         f"{int(argmax[index])}")
    if problem == 8:
        raise ValueError(f"row {index}: cold_mass must be a finite number >= 0, got "
                         f"{float(cold_mass[index])}")
    return offsets, ids, argmax, cold_max, cold_mass, tokens, token_logits


def _check_compact_shapes(rows: CompactRows, size: int, hot_vocab: HotVocab,
                          offsets: np.ndarray, ids: np.ndarray) -> None:
    hot = np.asarray(rows.hot_logits)
    if hot.shape != (size, hot_vocab.size):
        raise ValueError(f"hot_logits must have shape [{size}, {hot_vocab.size}], "
                         f"got {list(hot.shape)}")
    if (rows.cold_token is None) != (rows.cold_token_logit is None):
        raise ValueError("cold_token and cold_token_logit must come together")
    for name in ("cold_max", "cold_argmax", "cold_mass") + (
            () if rows.cold_token is None else ("cold_token", "cold_token_logit")):
        if np.shape(getattr(rows, name)) != (size,):
            raise ValueError(f"{name} must have shape [{size}], "
                             f"got {list(np.shape(getattr(rows, name)))}")
    if (offsets.shape != (size + 1,) or offsets[0] != 0 or (offsets[1:] < offsets[:-1]).any()
            or offsets[-1] != ids.size or np.shape(rows.touched_logits) != (ids.size,)):
        raise ValueError(f"touched_offsets must be {size + 1} non-decreasing offsets from 0 to "
                         f"len(touched_ids)={ids.size}, with touched_logits of the same length")


def sample_compact(rows: CompactRows, batch: SamplingBatch, hot_vocab: HotVocab, *,
                   num_top_logprobs: int = 0, return_logprobs: bool = True,
                   num_threads: int | None = None, validated: bool = False,
                   shapes_checked: bool = False) -> HandoffOutput:
    """Decide each compact row (``CompactRows.cpu()`` form) or mark it
    undecided (``HandoffOutput.outcome``).

    batch: the rows' parameters and histories, length B (as for ``sample``).
    hot_vocab: the H the rows were summarized with. Other arguments as for
    ``sample`` (validated included); shapes_checked: the compact rows come
    from ``sampler_decode.decode_request``, which checked their shapes and
    built their offsets (their ids are checked here all the same). Raises
    ValueError for malformed compact rows, bad
    parameters, NaN / +inf logits (a cold one is reported at cold_argmax),
    an all-banned row, or a touched list missing an id the row's overrides
    change."""
    size = len(batch)
    if batch.given_token_ids is not None and np.any(np.asarray(batch.given_token_ids) >= 0):
        raise ValueError("given_token_ids are scored on full rows, not compact ones")
    touched_offsets, touched_ids, cold_argmax, cold_max, cold_mass, cold_token, cold_token_logit = (
        _check_compact(rows, size, hot_vocab, shapes_checked))
    vocab = hot_vocab.vocab_size
    out = empty_output(size, top_width(num_top_logprobs, vocab))
    params, threads = kernel_params(batch, vocab, num_top_logprobs, num_threads, validated)
    if hot_vocab.size:
        hot_bytes, dtype = kernel_rows(rows.hot_logits)
    else:
        hot_bytes, dtype = np.zeros((size, 0), np.uint8), Dtype.DTYPE_FLOAT32
    outcome = np.empty(size, np.int8)
    errors = np.empty(size, np.int32)
    error_columns = np.empty(size, np.int64)
    hot_ids, hot_block_start, hot_bits = hot_vocab.kernel_arrays()
    _sampling.sample_compact_batch(
        _sampling.KernelBatch(
            logits_bytes=hot_bytes, dtype=dtype, **params, want_logprob=return_logprobs,
            num_threads=threads, tokens=out.token_ids, logprobs=out.logprobs,
            top_tokens=out.top_token_ids, top_logprobs=out.top_logprobs, errors=errors,
            error_columns=error_columns, hot_ids=hot_ids, hot_block_start=hot_block_start,
            hot_bits=hot_bits, hot_outcomes=outcome),
        vocab, hot_vocab.positions(),
        touched_offsets, touched_ids,
        np.ascontiguousarray(rows.touched_logits, np.float32),
        cold_max, cold_argmax, cold_mass, cold_token, cold_token_logit)
    raise_row_errors(errors, error_columns)
    out.hot_accepted[:] = -1
    return HandoffOutput(**chosen_as_listed(out).__dict__, outcome=outcome)


def inverse_temperatures(temperature) -> np.ndarray:
    """float32 [B] 1 / T (1 for greedy rows): the factor the kernels scale
    logits by, which the cold mass must use too."""
    temperature = np.asarray(temperature, np.float64)
    greedy = is_greedy(temperature)
    return np.where(greedy, 1.0, 1.0 / np.where(greedy, 1.0, temperature)).astype(np.float32)


def cold_draws(batch: SamplingBatch) -> np.ndarray:
    """float64 [B]: each row's uniform for a draw inside C on its cold stream
    (``_sampling.cold_draw_uniforms``: the randomness the second request's
    draw would use), NaN for the rows that never reach NEED_COLD (greedy,
    truncated). What a data plane needs to draw the cold token itself
    (``serving.hot_first.hot_first_summary``): u * W_C along C in id
    order."""
    size = len(batch)
    out = np.full(size, np.nan)
    rows = np.flatnonzero(untruncated_rows(batch))
    if rows.size:
        drawn = np.empty(rows.size)
        _sampling.cold_draw_uniforms(np.ascontiguousarray(np.asarray(batch.seed)[rows], np.uint64),
                                     np.ascontiguousarray(np.asarray(batch.step)[rows], np.uint64),
                                     drawn)
        out[rows] = drawn
    return out


#: What a NEED_COLD row's draw inside C turns off: penalties and truncation
#: (it keeps its temperature).
FALLBACK_NEUTRAL = tuple(p for p in RULES if p.kind != "scale")


def fallback_batch(batch: SamplingBatch, first: HandoffOutput, rows: CompactRows,
                   hot_vocab: HotVocab) -> tuple[np.ndarray, SamplingBatch]:
    """The second request: (row indices, their SamplingBatch), to be sampled
    by ``sample`` (or any sampler) on those rows' full logits.

    NEED_FULL rows keep their parameters and seed: the full path's answer.
    NEED_COLD rows become a draw inside C: H and the row's touched ids
    banned, no bias, penalties or truncation (none applies inside C), and
    the seed ``cold_stream_seeds`` derives from (seed, step), an independent
    stream."""
    undecided = np.flatnonzero(first.undecided)
    second = batch.take(undecided)
    cold = first.outcome[undecided] == _NEED_COLD
    if not cold.any():
        return undecided, second
    picked = np.flatnonzero(cold)
    offsets = np.asarray(rows.touched_offsets, np.int64)
    hot_ids = hot_vocab.kernel_arrays()[0].astype(np.int64)
    bans = [np.asarray(second.ban_ids[second.ban_offsets[j]:second.ban_offsets[j + 1]], np.int64)
            for j in range(len(second))]
    for j in picked:
        r = undecided[j]
        bans[j] = np.concatenate([hot_ids, np.asarray(rows.touched_ids[offsets[r]:offsets[r + 1]],
                                                      np.int64)])
    second.ban_offsets = np.zeros(len(second) + 1, np.int64)
    np.cumsum([b.size for b in bans], out=second.ban_offsets[1:])
    second.ban_ids = np.concatenate(bans) if bans else np.zeros(0, np.int64)
    # take's arrays are new: changed in place
    seeds = second.seed = np.asarray(second.seed, np.uint64)
    derived = np.empty(picked.size, np.uint64)
    _sampling.cold_stream_seeds(seeds[picked], second.step[picked].astype(np.uint64), derived)
    seeds[picked] = derived
    for param in FALLBACK_NEUTRAL:
        getattr(second, param.name)[picked] = param.neutral
    # No bias inside C (it only touches ids handed over); the history stays
    # (unused: no penalty is on) for a sampler that wants one.
    if not second.bias_offsets[-1]:
        return undecided, second
    keep = np.repeat(~cold, np.diff(second.bias_offsets))
    second.bias_offsets = np.r_[0, np.cumsum(np.where(cold, 0, np.diff(second.bias_offsets)))]
    second.bias_ids = np.asarray(second.bias_ids)[keep]
    second.bias_values = np.asarray(second.bias_values)[keep]
    return undecided, second


def merge_fallback(first: HandoffOutput, undecided: np.ndarray, second: SampleOutput) -> HandoffOutput:
    """Fold the second request's answers (rows ``undecided`` of ``first``)
    in place: tokens, logprobs (NEED_COLD: log P(t | C) + log(W_C / Z)),
    and for NEED_FULL rows the top logprobs. Returns ``first``."""
    cold = first.outcome[undecided] == _NEED_COLD
    first.token_ids[undecided] = second.token_ids
    first.logprobs[undecided] = np.where(cold, second.logprobs + first.logprobs[undecided],
                                         second.logprobs)
    full = undecided[~cold]
    if first.top_token_ids.shape[1]:
        # the second round is as wide as its own rows ask (row_options): the rest is padding
        width = second.top_token_ids.shape[1]
        first.top_token_ids[full] = -1
        first.top_logprobs[full] = -np.inf
        first.top_token_ids[full, :width] = second.top_token_ids[~cold]
        first.top_logprobs[full, :width] = second.top_logprobs[~cold]
    return first


def decide_from_full_rows(first: HandoffOutput, rows: CompactRows, batch: SamplingBatch,
                          hot_vocab: HotVocab, full_rows, want_logprobs: np.ndarray, *,
                          num_top_logprobs: int = 0, num_threads: int | None = None) -> HandoffOutput:
    """The second round in place, where the undecided rows' full rows are at
    hand (``full_rows`` [B, V], the compact rows' own, e.g. mapped from the
    llm model's arena): ``fallback_batch``, ``sample`` with the hot set on
    those rows, ``merge_fallback``, exactly what the second request's sampler
    would do, so the tokens are the two-round path's. want_logprobs: bool
    [B], the rows that asked (the second request's return_logprobs is theirs
    among the undecided rows). Returns ``first``, its undecided rows' tokens
    filled in (their outcome kept: it says which rows read a full row)."""
    undecided, second = fallback_batch(batch, first, rows, hot_vocab)
    second.want_logprobs = want_logprobs[undecided]
    if np.ndim(num_top_logprobs):
        num_top_logprobs = np.asarray(num_top_logprobs)[undecided]
    # fallback_batch derives from a checked batch, checked touched ids and H
    full = sample(np.asarray(full_rows)[undecided], second, num_top_logprobs=num_top_logprobs,
                  return_logprobs=bool(want_logprobs[undecided].any()), num_threads=num_threads,
                  hot_vocab=hot_vocab, validated=True)
    return merge_fallback(first, undecided, full)


async def decide_hot_first(rows: CompactRows, batch: SamplingBatch, hot_vocab: HotVocab,
                           decide, sample_full) -> HandoffOutput:
    """The handoff's rounds, written once for every caller: decide the
    compact rows, then sample the undecided rows whole (``fallback_batch``)
    and fold their answers in (``merge_fallback``); then the logprobs of
    the rows that ask for top logprobs or raw logprobs (``scored_rows``).

    decide(rows, batch) -> HandoffOutput: ``sample_compact`` here, or a
    request to a sampler that runs it. sample_full(rows, rows_batch) ->
    SampleOutput: the full rows ``rows`` sampled with ``rows_batch``. Either
    may return an awaitable (a remote sampler); with plain functions nothing
    is awaited and ``run_now`` gives the result.

    The tokens are decided as if no row asked for top or raw logprobs
    (``tokens_batch``): a compact row whose top n the cold region could
    enter, or whose raw logprobs need the whole row, would need its full
    row (NEED_FULL), and the full path draws another token than the
    compact decision (both exact), so asking would change the token. Their
    logprobs come from their full rows instead, in a request of their own
    that scores the token decided (``SamplingBatch.given_token_ids``): the
    chosen token's logprob and the top n from one pass.
    """
    tokens = tokens_batch(batch)
    first = await _result(decide(rows, tokens))
    if first.undecided.any():
        undecided, second_batch = fallback_batch(tokens, first, rows, hot_vocab)
        merge_fallback(first, undecided, await _result(sample_full(undecided, second_batch)))
    if tokens is not batch:
        asking = np.flatnonzero(scored_rows(batch))
        scoring = batch.take(asking)
        scoring.given_token_ids = first.token_ids[asking].astype(np.int64)
        add_scored_logprobs(first, asking, await _result(sample_full(asking, scoring)))
    return first


def scored_rows(batch: SamplingBatch) -> np.ndarray:
    """bool [B]: the rows whose logprobs the compact decision cannot give:
    those asking for top logprobs, and those asking for raw logprobs (their
    own or top-n: ``SamplingBatch.raw_logprobs``)."""
    size = len(batch)
    top = (np.zeros(size, bool) if batch.num_top_logprobs is None
           else np.asarray(batch.num_top_logprobs) > 0)
    if batch.raw_logprobs is None:
        return top
    want = np.ones(size, bool) if batch.want_logprobs is None else np.asarray(batch.want_logprobs, bool)
    return top | (np.asarray(batch.raw_logprobs, bool) & want)


def tokens_batch(batch: SamplingBatch) -> SamplingBatch:
    """`batch` as its tokens are decided (itself when no row asks for top
    or raw logprobs): no top logprobs asked, no raw ones, and the rows
    asking for raw logprobs asking for none (``scored_rows`` scores them)."""
    if not scored_rows(batch).any():
        return batch
    raw = batch.raw_logprobs is not None and np.any(batch.raw_logprobs)
    if not raw:
        return replace(batch, num_top_logprobs=None)
    want = (np.ones(len(batch), bool) if batch.want_logprobs is None
            else np.array(batch.want_logprobs, bool))
    want[np.asarray(batch.raw_logprobs, bool)] = False
    return replace(batch, num_top_logprobs=None, raw_logprobs=None, want_logprobs=want)


def add_scored_logprobs(out: HandoffOutput, rows: np.ndarray, full: SampleOutput) -> None:
    """Give rows ``rows`` of `out` the logprobs `full` scored on their full
    rows for the tokens `out` holds (``SamplingBatch.given_token_ids``): the
    chosen token's, where asked, and the top n."""
    if not np.array_equal(full.token_ids, out.token_ids[rows]):
        raise RuntimeError("the full rows' sampler scored other tokens than the ones given")
    width = full.top_token_ids.shape[1]
    out.top_token_ids = np.full((len(out.token_ids), width), -1, np.int32)
    out.top_logprobs = np.full((len(out.token_ids), width), -np.inf, np.float32)
    out.top_token_ids[rows], out.top_logprobs[rows] = full.top_token_ids, full.top_logprobs
    out.logprobs[rows] = full.logprobs


async def _result(value):
    return await value if inspect.isawaitable(value) else value


def run_now(coroutine):
    """The result of a coroutine that never suspends (``decide_hot_first``
    with plain functions), without an event loop."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("run_now: the coroutine waited on something; await it in an event loop")
