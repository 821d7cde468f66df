"""Hot-first handoff, the data plane's side: the compact rows of a batch
(``compact_rows``: the hot set's logits, the touched ones and an exact cold
summary, in torch on the logits' device), and the whole handoff on one host
(``sample_hot_first``). The decision side is ``simple_sampler.handoff``;
docs/HANDOFF.md derives both.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ..handoff import DEFAULT_COLD_TOP, CompactRows, HandoffOutput, cold_draws, \
    decide_hot_first, inverse_temperatures, run_now, sample_compact
from ..host_copy import to_device, to_host
from ..params import SamplingBatch, any_on, is_greedy
from ..sampling import logits_tensor, sample
from ..shvs.hot_vocab import HotVocab, untruncated_rows


def touched_lists(batch: SamplingBatch, hot_vocab: HotVocab) -> tuple[np.ndarray, np.ndarray]:
    """CSR (offsets int64 [B + 1], ids int64) of each row's touched ids
    outside H, ascending: its bias and ban ids, and its prompt and output
    ids when a penalty is on (repetition != 1, presence or frequency != 0),
    exactly the columns the kernels build overrides for."""
    batch = batch.with_histories()
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
    keys = np.concatenate(keys) if keys else np.zeros(0, np.int64)
    # per step: the hot set's position table is built once per HotVocab
    keys = keys[hot_vocab.positions()[keys % vocab] < 0]
    # sorted and deduplicated by hand: numpy 2's np.unique hashes first,
    # which was most of a GPU host's summary for rows with long histories
    # (docs/results/gpu-2026-11-27b.md)
    keys.sort()
    first = np.ones(keys.size, bool)
    np.not_equal(keys[1:], keys[:-1], out=first[1:])
    keys = keys[first]
    offsets = np.zeros(size + 1, np.int64)
    np.cumsum(np.bincount(keys // vocab, minlength=size), out=offsets[1:])
    return offsets, keys % vocab


#: Ids per block of the cold draw's two-level walk (``_cold_tokens``): the
#: float64 cumulative sum runs over a row's block masses, then inside the one
#: block the draw lands in, so no float64 copy of the rows is ever made.
COLD_DRAW_BLOCK = 1024

#: (device, vocab) -> (hot ids array, its ids on the device, a bool [V] mask
#: of them): the hot set crosses to the device once, not once per step. An
#: entry serves the array it was made from (the same object, as
#: ``HotVocab.kernel_arrays()`` hands out), never an equal-looking other.
_DEVICE_HOT_SETS: dict = {}


def hot_set_on(device: torch.device, hot_ids, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    key = (str(device), vocab)
    entry = _DEVICE_HOT_SETS.get(key)
    if entry is None or entry[0] is not hot_ids:
        ids = torch.as_tensor(np.asarray(hot_ids, np.int64)).to(device)
        mask = torch.zeros(vocab, dtype=torch.bool, device=device)
        mask[ids] = True
        entry = _DEVICE_HOT_SETS[key] = (hot_ids, ids, mask)
    return entry[1], entry[2]


@torch.no_grad()
def hot_first_summary(logits: torch.Tensor, hot_ids, touched_offsets, touched_ids, temperature,
                      cold_top: int = 0, draws=None) -> CompactRows:
    """The data plane's side of the handoff, in torch on the logits' device.

    logits: [B, V] float32 / float16 / bfloat16 tensor (any device).
    hot_ids: int [|H|] ascending distinct ids (``HotVocab.kernel_arrays()[0]``;
        kept on the device per array object, ``hot_set_on``).
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
        falls along C's weights in id order, float64 sums over blocks of
        COLD_DRAW_BLOCK ids, then inside one): a row the decision finds
        NEED_COLD is then decided with it, no full row needed.
    Returns ``CompactRows`` as tensors on the logits' device (the cold
    summary over C = V minus every id handed over), in the dtypes of its
    ``cpu()`` form.

    Written for a GPU's stream (``summarize``): one transfer of the step's
    inputs, no wait for the device until the touched lists' final length is
    read (only with cold_top > 0, after everything is queued).
    """
    size, vocab = logits.shape
    hot, handed = hot_set_on(logits.device, hot_ids, vocab)
    inputs, most = step_inputs(size, vocab, touched_offsets, touched_ids, temperature,
                                cold_top, draws)
    out = summarize(logits, hot, handed, most, draws is not None,
                     *to_device(logits.device, *inputs))
    # with cold ids the lists' length is known once they are sorted on the device
    total = int(out["touched_offsets"][-1]) if most else inputs[1].size
    out["touched_ids"], out["touched_logits"] = (out["touched_ids"][:total],
                                                 out["touched_logits"][:total])
    return CompactRows(**out)


def step_inputs(size: int, vocab: int, touched_offsets, touched_ids, temperature, cold_top,
                 draws) -> tuple[tuple[np.ndarray, ...], int]:
    """``summarize``'s host inputs (offsets int64 [B + 1], touched keys
    row * V + id int64 [N], their count int64 [1], 1 / T float32 [B], draws
    float64 [B] (NaN: none), cold_tops int64 [B]) and the largest cold_top."""
    offsets = np.asarray(touched_offsets, np.int64)
    keys = np.repeat(np.arange(size, dtype=np.int64), np.diff(offsets)) * vocab \
        + np.asarray(touched_ids, np.int64)
    tops = np.broadcast_to(np.asarray(cold_top, np.int64), (size,))
    uniforms = np.full(size, np.nan) if draws is None else np.asarray(draws, np.float64)
    return ((offsets, keys, np.array([keys.size], np.int64), inverse_temperatures(temperature),
             uniforms, tops), min(int(tops.max(initial=0)), vocab))


def summarize(logits: torch.Tensor, hot: torch.Tensor, handed: torch.Tensor, most: int,
               drawn: bool, offsets, keys, count, inv_t, u, tops) -> dict:
    """``hot_first_summary``'s work on the device: ``CompactRows``' fields
    as tensors, the touched ones over every key of `keys` (those past
    `count` sort last) and the cold ids; the caller trims them to the
    offsets' last. No shape here depends on the data and nothing waits for
    the device: a stream runs it as queued. Passes over the [B, V] rows:
    mask (in the rows' dtype), argmax, float32 weights (x / T), shift,
    exp, block masses; with cold_top > 0 a top-k."""
    size, vocab = logits.shape
    device = logits.device
    x = torch.where(handed, -torch.inf, logits).contiguous()  # the logits' dtype: exact
    flat = x.view(-1)
    flat.index_fill_(0, keys, -torch.inf)
    if most:
        values, extra = x.topk(most, dim=1)  # sorted: a row's k first
        # -inf picks are ids already handed over (masked) or cold ids of
        # weight 0, which may as well stay in C.
        picked = (values > -torch.inf) & (torch.arange(most, device=device) < tops[:, None])
        extra += torch.arange(size, device=device)[:, None] * vocab
        flat.index_put_((extra.view(-1),), torch.where(picked, -torch.inf, values).view(-1))
        beyond = size * vocab  # distinct from every touched key (masked before): sorts last
        keys = torch.sort(torch.cat([
            torch.where(torch.arange(keys.numel(), device=device) < count, keys, beyond),
            torch.where(picked, extra, beyond).view(-1)])).values
        offsets = torch.nn.functional.pad(torch.cumsum(offsets.diff() + picked.sum(dim=1), 0),
                                          (1, 0))
    cold_argmax = x.argmax(dim=1)           # the first maximal index: the lowest id
    cold_max = x.gather(1, cold_argmax[:, None])[:, 0].float()
    # z and zc with the kernels' float operations (x * inv_t), exps in
    # float32 as theirs, summed in float64 per block: a float32 sum of ~1e5
    # terms is off by ~1e-5 and its value moves with the reduction order
    # (threads, batch shape), and a row's decision must not.
    zc = cold_max * inv_t
    finite = torch.isfinite(zc)
    weights = torch.mul(x, inv_t[:, None])  # float32 (x converted exactly)
    weights.sub_(torch.where(finite, zc, 0.0)[:, None]).exp_()
    blocks = _block_masses(weights)
    out = {"hot_logits": logits.index_select(1, hot), "touched_offsets": offsets,
           "touched_ids": (keys % vocab).int(),
           "touched_logits": logits[(keys // vocab).clamp_(max=size - 1), keys % vocab].float(),
           "cold_max": cold_max, "cold_argmax": torch.where(cold_max == -torch.inf, -1,
                                                            cold_argmax).int(),
           "cold_mass": torch.where(finite, blocks.sum(dim=1), 0.0).float()}
    if drawn:
        out["cold_token"], out["cold_token_logit"] = _cold_tokens(logits, weights, blocks,
                                                                  finite, u)
    return out


def _block_masses(weights: torch.Tensor) -> torch.Tensor:
    """float64 [B, ceil(V / COLD_DRAW_BLOCK)]: each row's weights summed per
    block of COLD_DRAW_BLOCK ids (the last block may be shorter)."""
    size, vocab = weights.shape
    whole = vocab // COLD_DRAW_BLOCK
    full = weights.as_strided((size, whole, COLD_DRAW_BLOCK), (vocab, COLD_DRAW_BLOCK, 1))
    if vocab == whole * COLD_DRAW_BLOCK:
        return full.sum(dim=2, dtype=torch.float64)
    return torch.cat([full.sum(dim=2, dtype=torch.float64),
                      weights[:, whole * COLD_DRAW_BLOCK:].sum(dim=1, dtype=torch.float64,
                                                               keepdim=True)], dim=1)


def _cold_tokens(logits: torch.Tensor, weights: torch.Tensor, blocks: torch.Tensor,
                 finite: torch.Tensor, u: torch.Tensor):
    """(cold_token int32 [B], cold_token_logit float32 [B]) on the logits'
    device: for each row with a finite draw u and a positive cold mass W
    (the sum of its block masses `blocks`), the id where u * W falls along
    its weights' float64 cumulative sum: the block by the block masses' sum,
    then the id inside it (a zero weight, an id handed over, is never
    picked); -1 and 0 elsewhere. weights: float32 [B, V], 0 for the ids
    handed over."""
    vocab = weights.shape[1]
    cumulative = blocks.cumsum(dim=1)
    total = cumulative[:, -1]
    drawing = torch.isfinite(u) & finite & (total > 0)
    # u < 1, but u * W may round up to W: below W, a positive weight holds it
    target = torch.minimum(u.nan_to_num(0.0) * total, torch.nextafter(total, total.new_zeros(())))
    block = torch.searchsorted(cumulative, target[:, None], right=True).clamp_(
        max=blocks.shape[1] - 1)
    # the cumulative sum before the block: exactly the one searchsorted compared
    before = torch.nn.functional.pad(cumulative, (1, 0)).gather(1, block)
    columns = block * COLD_DRAW_BLOCK + torch.arange(COLD_DRAW_BLOCK, device=weights.device)
    inside = weights.gather(1, columns.clamp(max=vocab - 1)).double()
    if vocab % COLD_DRAW_BLOCK:  # the short last block: its columns past V weigh 0
        inside.masked_fill_(columns >= vocab, 0.0)
    offset = torch.searchsorted(before + inside.cumsum(dim=1), target[:, None], right=True)
    # the block's own sum may round below the target: then its last weight > 0
    last = torch.where(inside > 0, columns, -1).amax(dim=1, keepdim=True)
    token = torch.where(offset < COLD_DRAW_BLOCK, columns.gather(1, offset.clamp(
        max=COLD_DRAW_BLOCK - 1)), last)
    # a CUDA cumsum is a parallel scan: if its rounding left the block with
    # no positive weight, the row takes the second round
    drawing &= token[:, 0] >= 0
    token_logit = logits.gather(1, token.clamp(0, vocab - 1))[:, 0].float()
    return (torch.where(drawing, token[:, 0], -1).int(),
            torch.where(drawing, token_logit, 0.0))


def undecidable_rows(batch: SamplingBatch, cold_draw: bool) -> np.ndarray:
    """bool [B]: the rows the compact decision may leave undecided for want
    of their full row (NEED_FULL, NEED_COLD): truncated rows (a nucleus or
    top-k reaching into C), and, without the cold draw, untruncated ones (a
    draw landing in C). Always decided: greedy rows (the cold argmax is
    known) and untruncated rows with a cold token drawn (a draw in C takes
    it). Top logprobs can leave a row undecided too; the decode loop's
    compact requests never ask them (``handoff.decide_hot_first``). A function of the rows' own parameters."""
    sampled = ~is_greedy(batch.temperature)
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


def rows_to_host(logits: torch.Tensor, rows) -> torch.Tensor:
    """``logits[rows]`` on the host: the rows a compact decision left
    undecided, gathered where they lie (on a GPU by an index sent with
    ``host_copy.to_device``, not a pageable copy that would spin behind the
    stream) and brought back by ``host_copy.to_host`` (the caller asleep
    until the copy is done; on the CPU the same calls make one copy)."""
    (index,) = to_device(logits.device, np.asarray(rows, np.int64))
    return to_host(logits.index_select(0, index))


def rows_in_place(logits: torch.Tensor, rows) -> torch.Tensor | None:
    """``logits[rows]`` without a copy where the row indices `rows`
    (ascending) are evenly spaced, as when every row of a step, or every
    other, asks for top logprobs: a strided view over the rows where they
    lie, which a sampler that maps them reads there (``SamplerPool`` sends
    rows of a shared region by reference); None for any other rows (the
    caller gathers them: ``rows_to_host``)."""
    rows = np.asarray(rows, np.int64)
    if rows.size == 0:
        return None
    step = int(rows[1] - rows[0]) if rows.size > 1 else 1
    if step < 1 or not np.array_equal(rows, rows[0] + step * np.arange(rows.size)):
        return None
    return logits[int(rows[0]):int(rows[-1]) + 1:step]


def sample_hot_first(logits, batch: SamplingBatch, hot_vocab: HotVocab, *,
                     cold_top: int = DEFAULT_COLD_TOP,
                     num_top_logprobs: int = 0, return_logprobs: bool = True,
                     num_threads: int | None = None, cold_draw: bool = True) -> HandoffOutput:
    """The whole handoff on one host: summary (cold tokens drawn unless not
    `cold_draw`), compact decision, then the undecided rows whole, with the
    hot set on as a sampler instance holding it samples them (so the tokens
    are the served handoff's), and the top logprobs of the rows that ask
    (`num_top_logprobs`: one n, or n per row) from their full rows, which
    leaves their tokens as they are without (``decide_hot_first``).
    logits: [B, V] torch tensor or numpy array. The result's outcome says
    which rows needed their full row to draw their token."""
    tensor = logits if isinstance(logits, torch.Tensor) else logits_tensor(logits)
    if np.any(num_top_logprobs):  # as the rows' own asks (decide_hot_first)
        batch = dataclasses.replace(batch, num_top_logprobs=np.broadcast_to(
            np.asarray(num_top_logprobs, np.int32), (len(batch),)))
    options = dict(return_logprobs=return_logprobs, num_threads=num_threads)

    def sample_full(rows, rows_batch):
        wanted = rows_batch.num_top_logprobs
        return sample(rows_to_host(tensor, rows), rows_batch, hot_vocab=hot_vocab,
                      num_top_logprobs=0 if wanted is None else wanted, **options)

    return run_now(decide_hot_first(
        compact_rows(tensor, batch, hot_vocab, cold_top, cold_draw=cold_draw), batch, hot_vocab,
        lambda rows, batch: sample_compact(rows, batch, hot_vocab, **options), sample_full))

