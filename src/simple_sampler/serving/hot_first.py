"""Hot-first handoff, the data plane's side: the compact rows of a batch
(``compact_rows``: the hot set's logits, the touched ones and an exact cold
summary, in torch on the logits' device), and the whole handoff on one host
(``sample_hot_first``). The decision side is ``simple_sampler.handoff``;
docs/HANDOFF.md derives both.
"""
from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import torch

from ..handoff import DEFAULT_COLD_TOP, CompactRows, HandoffOutput, cold_draws, \
    decide_hot_first, inverse_temperatures, run_now, sample_compact
from ..params import GREEDY_TEMPERATURE, SamplingBatch, any_on
from ..sampling import sample
from ..shvs.hot_vocab import HotVocab, untruncated_rows


def touched_lists(batch: SamplingBatch, hot_vocab: HotVocab) -> tuple[np.ndarray, np.ndarray]:
    """CSR (offsets int64 [B + 1], ids int64) of each row's touched ids
    outside H, ascending: its bias and ban ids, and its prompt and output
    ids when a penalty is on (repetition != 1, presence or frequency != 0),
    exactly the columns the kernels build overrides for."""
    vocab = hot_vocab.vocab_size
    size = len(batch)
    penalized = any_on(batch, "penalty")
    keys = []
    for name, rows_on in (("bias", None), ("ban", None), ("prompt", penalized),
                          ("output", penalized)):
        offsets = np.asarray(getattr(batch, f"{name}_offsets"), np.int64)
        if not offsets[-1] or (rows_on is not None and not rows_on.any()):
            continue
        ids = np.asarray(getattr(batch, f"{name}_ids"), np.int64)
        rows = np.repeat(np.arange(size, dtype=np.int64), np.diff(offsets))
        if rows_on is not None:
            keep = np.asarray(rows_on, bool)[rows]
            rows, ids = rows[keep], ids[keep]
        keys.append(rows * vocab + ids)
    keys = np.unique(np.concatenate(keys)) if keys else np.zeros(0, np.int64)
    # per step: the hot set's position table is built once per HotVocab
    keys = keys[hot_vocab.positions()[keys % vocab] < 0]
    offsets = np.zeros(size + 1, np.int64)
    np.cumsum(np.bincount(keys // vocab, minlength=size), out=offsets[1:])
    return offsets, keys % vocab


@torch.no_grad()
def hot_first_summary(logits: torch.Tensor, hot_ids, touched_offsets, touched_ids, temperature,
                      cold_top: int = 0, draws=None) -> CompactRows:
    """The data plane's side of the handoff, in torch on the logits' device.

    logits: [B, V] float32 / float16 / bfloat16 tensor (any device).
    hot_ids: int [|H|] ascending distinct ids (``HotVocab.kernel_arrays()[0]``).
    touched_offsets int [B + 1], touched_ids int [N]: CSR of each row's
        touched ids (``touched_lists``), ascending, none in H.
    temperature: [B] the rows' temperatures (< 1e-5: greedy, mass at T = 1).
    cold_top: int, or int [B] one per row (``row_cold_tops``): also hand
        over each row's cold_top largest logits outside H u T as touched
        ids (0: none): rows whose cold region would otherwise hold part of
        their nucleus become decidable.
    draws: float64 [B] (``handoff.cold_draws``) or None: each row's uniform
        on its cold stream, NaN for none. With it, every row with a finite
        draw and a cold mass also gets its cold token (the id where u * W_C
        falls along C's weights in id order, a cumulative sum in float64):
        a row the decision finds NEED_COLD is then decided with it, no full
        row needed. One more pass over the rows, on their device.
    Returns ``CompactRows`` as tensors on the logits' device (the cold
    summary over C = V minus every id handed over).
    """
    size, vocab = logits.shape
    device = logits.device
    hot = torch.as_tensor(np.asarray(hot_ids), dtype=torch.long, device=device)
    offsets = torch.as_tensor(np.asarray(touched_offsets), dtype=torch.long)
    counts = (offsets[1:] - offsets[:-1]).to(device)
    rows = torch.repeat_interleave(torch.arange(size, device=device), counts)
    ids = torch.as_tensor(np.asarray(touched_ids), dtype=torch.long, device=device)
    x = logits.float().clone() if logits.dtype == torch.float32 else logits.float()
    x[:, hot] = -torch.inf
    x[rows, ids] = -torch.inf
    tops = np.broadcast_to(np.asarray(cold_top, np.int64), (size,))
    most = int(tops.max(initial=0))
    if most > 0:
        values, extra = x.topk(min(most, vocab), dim=1)  # sorted: a row's k first
        # -inf picks are ids already handed over (masked) or cold ids of
        # weight 0, which may as well stay in C.
        picked = values > -torch.inf
        if (tops != most).any():
            picked &= (torch.arange(extra.shape[1], device=device)[None, :]
                       < torch.tensor(tops, device=device)[:, None])
        extra_rows = torch.arange(size, device=device)[:, None].expand_as(extra)[picked]
        keys = torch.cat([rows * vocab + ids, extra_rows * vocab + extra[picked]])
        keys = torch.unique(keys)           # sorted: by row, then id
        rows, ids = keys // vocab, keys % vocab
        counts = torch.bincount(rows, minlength=size)
        x[rows, ids] = -torch.inf
    inv_t = torch.as_tensor(inverse_temperatures(temperature), device=device)
    cold_argmax = x.argmax(dim=1)           # the first maximal index: the lowest id
    cold_max = x.gather(1, cold_argmax[:, None])[:, 0]
    # z and zc with the kernels' float operations (x * inv_t), exps in
    # float32 as theirs, summed in float64: a float32 sum of ~1e5 terms is
    # off by ~1e-5 and its value moves with the reduction order (threads,
    # batch shape), and a row's decision must not.
    zc = cold_max * inv_t
    finite = torch.isfinite(zc)
    shift = torch.where(finite, zc, torch.zeros_like(zc))
    weights = torch.exp(x * inv_t[:, None] - shift[:, None])
    cold_mass = weights.sum(dim=1, dtype=torch.float64)
    cold_mass = torch.where(finite, cold_mass, torch.zeros_like(cold_mass))
    drawn = {} if draws is None else dict(zip(
        ("cold_token", "cold_token_logit"), _cold_tokens(logits, weights, cold_mass, draws)))
    cold_argmax = torch.where(cold_max == -torch.inf, torch.full_like(cold_argmax, -1), cold_argmax)
    new_offsets = torch.zeros(size + 1, dtype=torch.long, device=device)
    new_offsets[1:] = torch.cumsum(counts, 0)
    return CompactRows(hot_logits=logits.index_select(1, hot), touched_offsets=new_offsets,
                       touched_ids=ids, touched_logits=logits[rows, ids].float(),
                       cold_max=cold_max, cold_argmax=cold_argmax, cold_mass=cold_mass.float(),
                       **drawn)


def _cold_tokens(logits: torch.Tensor, weights: torch.Tensor, cold_mass: torch.Tensor, draws):
    """(cold_token int32 [B], cold_token_logit float32 [B]) on the logits'
    device: for each row with a finite draw u and a positive cold mass, the
    id where u * W falls along its weights' float64 cumulative sum (a zero
    weight, an id handed over, is never picked), -1 and 0 elsewhere."""
    size, vocab = weights.shape
    device = weights.device
    token = torch.full((size,), -1, dtype=torch.int32, device=device)
    token_logit = torch.zeros(size, dtype=torch.float32, device=device)
    u = torch.as_tensor(np.asarray(draws, np.float64), device=device)
    rows = torch.nonzero(torch.isfinite(u) & (cold_mass > 0)).flatten()
    if rows.numel():
        cumulative = weights[rows].double().cumsum(dim=1)
        target = u[rows] * cumulative[:, -1]
        picked = torch.searchsorted(cumulative, target[:, None], right=True)[:, 0]
        # u < 1, but u * W may round up to W: then the last id of weight > 0
        last = vocab - 1 - (weights[rows].flip(1) > 0).int().argmax(dim=1)
        picked = torch.where(picked >= vocab, last, picked)
        token[rows] = picked.int()
        token_logit[rows] = logits[rows, picked].float()
    return token, token_logit


def undecidable_rows(batch: SamplingBatch, cold_draw: bool) -> np.ndarray:
    """bool [B]: the rows the compact decision may leave undecided for want
    of their full row (NEED_FULL, NEED_COLD): truncated rows (a nucleus or
    top-k reaching into C), and, without the cold draw, untruncated ones (a
    draw landing in C). Always decided: greedy rows (the cold argmax is
    known) and untruncated rows with a cold token drawn (a draw in C takes
    it). Top logprobs can leave a row undecided too; the decode loop's
    compact requests never ask them. A function of the rows' own parameters."""
    sampled = np.asarray(batch.temperature) >= GREEDY_TEMPERATURE
    return sampled & ~untruncated_rows(batch) if cold_draw else sampled


def row_cold_tops(batch: SamplingBatch, cold_top: int, cold_draw: bool) -> np.ndarray:
    """int64 [B]: each row's cold_top (``hot_first_summary``): `cold_top`
    for the rows the compact decision could leave undecided without their
    largest cold logits (``undecidable_rows``), 0 for the others, which
    would only carry them (8 bytes an id, and the kernel's work on them).
    A function of the row's own parameters: batch-invariant, as the token
    must be."""
    return np.where(undecidable_rows(batch, cold_draw), cold_top, 0).astype(np.int64)


def compact_rows(logits: torch.Tensor, batch: SamplingBatch, hot_vocab: HotVocab,
                 cold_top: int = DEFAULT_COLD_TOP, summary=None,
                 cold_draw: bool = True) -> CompactRows:
    """The batch's compact rows in ``cpu()`` form: its touched lists, then
    the summary on the logits' device: `summary`, an engine's own (with
    ``hot_first_summary``'s arguments, returning the ``cpu()`` form: the
    simulated engine's, part of its modelled step), or ``hot_first_summary``.
    cold_top: for the rows that need it (``row_cold_tops``). cold_draw:
    with each untruncated row's cold token (docs/HANDOFF.md, "The cold
    draw"); False leaves NEED_COLD rows to the second round."""
    offsets, ids = touched_lists(batch, hot_vocab)
    draws = cold_draws(batch) if cold_draw else None
    tops = row_cold_tops(batch, cold_top, cold_draw)
    if summary is not None:
        return summary(logits, hot_vocab.kernel_arrays()[0], offsets, ids, batch.temperature,
                       tops, draws)
    return hot_first_summary(logits, hot_vocab.kernel_arrays()[0], offsets, ids,
                             batch.temperature, tops, draws).cpu()


def sample_hot_first(logits, batch: SamplingBatch, hot_vocab: HotVocab, *,
                     cold_top: int = DEFAULT_COLD_TOP,
                     num_top_logprobs: int = 0, return_logprobs: bool = True,
                     num_threads: int | None = None, cold_draw: bool = True) -> HandoffOutput:
    """The whole handoff on one host: summary (cold tokens drawn unless not
    `cold_draw`), compact decision, then the undecided rows whole. logits:
    [B, V] torch tensor or numpy array. The result's outcome says which rows
    needed their full row."""
    tensor = logits if isinstance(logits, torch.Tensor) else _as_tensor(logits)
    options = dict(num_top_logprobs=num_top_logprobs, return_logprobs=return_logprobs,
                   num_threads=num_threads)
    return run_now(decide_hot_first(
        compact_rows(tensor, batch, hot_vocab, cold_top, cold_draw=cold_draw), batch, hot_vocab,
        lambda rows, batch: sample_compact(rows, batch, hot_vocab, **options),
        lambda undecided, second: sample(tensor[torch.as_tensor(undecided)].cpu(), second,
                                         **options)))


def _as_tensor(array) -> torch.Tensor:
    """A CPU tensor over a numpy float32 / float16 / bfloat16 array, no copy."""
    array = np.asarray(array)
    with warnings.catch_warnings():
        # A read-only array (a broadcast row) is fine: nothing here writes
        # to the logits (hot_first_summary masks a copy).
        warnings.simplefilter("ignore", UserWarning)
        if array.dtype == ml_dtypes.bfloat16:
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(array)
