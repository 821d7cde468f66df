"""The samplers that run in this process: the kernels as the decoder's
``inline_kernels`` mode calls them (:func:`kernel_sample`), and an async
stand-in for the remote decision plane (:func:`threaded`); and a step's
rows sampled around the rows a sampler refused
(:func:`sample_around_refusals`)."""
from __future__ import annotations

import asyncio
import re
from typing import Any, Awaitable, Callable, Protocol, runtime_checkable

import numpy as np
import torch

from ..params import SamplingBatch
from ..sampling import sample

#: A step's top logprobs: token ids int32 [n, k] and their logprobs float32
#: [n, k], most likely first; row r's first min(its n, V) columns are its
#: own (``SamplingBatch.num_top_logprobs``), the rest padding.
TopLogprobs = tuple[np.ndarray, np.ndarray]
#: A sampler's answer: (token_ids int64 [n], logprobs float32 [n]), and a
#: third element, TopLogprobs, where a row of the batch asked for them.
SampleResult = (tuple[np.ndarray, np.ndarray]
                | tuple[np.ndarray, np.ndarray, TopLogprobs])
#: row index -> why the sampler refused that row of a step
Refusals = dict[int, str]
AsyncSampler = Callable[[torch.Tensor, SamplingBatch], Awaitable[SampleResult]]


@runtime_checkable
class SummarizesOnDataPlane(Protocol):
    """Optional capability of an :data:`AsyncSampler` split in two halves
    (``triton/hot_first_sampler.HotFirstSampler``): ``summarize`` runs on the
    data plane's thread right after the forward (the hot-first summary), and
    the sampler is then awaited with its result as ``summary=``. Checked
    with ``isinstance(sampler, SummarizesOnDataPlane)``."""

    def summarize(self, logits: torch.Tensor, batch: SamplingBatch) -> Any: ...


@runtime_checkable
class SamplesNow(Protocol):
    """Optional capability of a :class:`SummarizesOnDataPlane` sampler: its
    synchronous path, ``sample_now(logits, batch, summary)``, which answers
    the step on the data plane's thread (a result) or declines (None: the
    async path follows). Checked with ``isinstance(sampler, SamplesNow)``."""

    def sample_now(self, logits: torch.Tensor, batch: SamplingBatch,
                   summary: Any) -> Any: ...


@runtime_checkable
class ReadsRowArena(Protocol):
    """Optional capability of an :data:`AsyncSampler` whose instances read a
    step's rows in place from a shared-memory row arena
    (``triton/sampler_pool.SamplerPool``): ``arena``, a
    ``row_arena.RowArena`` or None. Rows a producer writes itself (a guided
    step's masked copy, ``data_plane``) go into a slot taken there
    (``RowArena.take``) and cross with no copy. Checked with
    ``isinstance(sampler, ReadsRowArena)``."""

    arena: Any


def widest_top(batch: SamplingBatch) -> int:
    """The most top logprobs a row of `batch` asks for (0: none)."""
    wanted = batch.num_top_logprobs
    return 0 if wanted is None else int(np.max(wanted, initial=0))


def result_parts(result: SampleResult) -> tuple[np.ndarray, np.ndarray, TopLogprobs | None]:
    """(token_ids, logprobs, TopLogprobs or None) of a sampler's answer."""
    tokens, logprobs, *top = result
    return tokens, logprobs, top[0] if top else None


def gives_top_logprobs(sampler) -> bool:
    """Whether `sampler` answers a row's top logprobs (``SampleResult``'s
    third element): a sampler says so with ``gives_top_logprobs = True``."""
    return bool(getattr(sampler, "gives_top_logprobs", False))


def kernel_sample(logits: torch.Tensor, batch: SamplingBatch,
                  num_threads: int | None = None) -> SampleResult:
    """``simple_sampler.sample`` as ``(token_ids int64 [n], logprobs float32 [n])``
    (logprobs NaN when no row of the batch wants them), plus the rows' top
    logprobs where one asks (``SampleResult``), its rows spread over
    ``num_threads`` threads (default: ``sampling.default_num_threads()``)."""
    wanted = batch.want_logprobs is None or bool(np.any(batch.want_logprobs))
    asked = widest_top(batch)
    out = sample(logits, batch, return_logprobs=wanted, num_threads=num_threads,
                 num_top_logprobs=batch.num_top_logprobs if asked else 0)
    if not asked:
        return out.token_ids, out.logprobs
    return out.token_ids, out.logprobs, (out.top_token_ids, out.top_logprobs)


kernel_sample.gives_top_logprobs = True


def threaded(sample_fn: Callable[[torch.Tensor, SamplingBatch], SampleResult] = kernel_sample
             ) -> AsyncSampler:
    """An async sampler running ``sample_fn`` in a worker thread: a stand-in
    for the remote decision plane (the kernels release the GIL)."""
    async def sampler(logits: torch.Tensor, batch: SamplingBatch) -> SampleResult:
        return await asyncio.to_thread(sample_fn, logits, batch)
    sampler.gives_top_logprobs = gives_top_logprobs(sample_fn)
    return sampler


#: how a sampler names the row it refuses (``sampling.raise_row_errors``, the
#: sampler model's INVALID_ARG messages): "row 3: logits must not contain NaN ..."
_ROW_NAMED = re.compile(r"\brow \d+: ")


#: how a sampler's own refusal begins (``sampling.raise_row_errors``); a
#: failure of its own begins with its type ("MemoryError: row 3: ...")
_REFUSAL = re.compile(r"row \d+: ")


def names_a_row(message: str) -> bool:
    """Whether a sampler's error `message`, as the sampler model answered
    it, refuses a row: it begins by naming the row."""
    return _REFUSAL.match(message) is not None


def refuses_rows(error: BaseException) -> bool:
    """Whether a sampler's `error` refuses rows of its call (a row the
    kernels cannot sample: NaN logits, +inf after temperature, every token
    banned) rather than being the sampler's own failure (MemoryError,
    RuntimeError, a transport error): a ValueError, or a remote sampler's
    refusal marked ``retryable = False`` (``triton.sampler_targets.
    SamplerCallError``: INVALID_ARG), that names a row. A refusal naming no
    row (a request too large for a remote sampler, a bug of ours) would fail
    every half too: it fails the step at once."""
    refused = isinstance(error, ValueError) or getattr(error, "retryable", True) is False
    return refused and _ROW_NAMED.search(str(error)) is not None


async def sample_around_refusals(sampler: AsyncSampler, logits: torch.Tensor,
                                 batch: SamplingBatch, refusal: BaseException
                                 ) -> tuple[SampleResult, Refusals]:
    """A step whose sampler call was refused (`refusal`: ``refuses_rows``),
    sampled again in halves down to the refused rows, so that only their
    requests fail. Returns the step's SampleResult (tokens -1 where
    refused, logprobs NaN where refused or not asked, top logprobs where a
    row asked, padding where refused) and each refused row's error.

    What is refused comes from the model's logits (a request's values are
    checked at submission), so only this failure path pays: about
    2 log2(n) calls per refused row. The tokens are those the whole call
    would have drawn: a row's randomness is its (seed, step), and an
    unseeded request gets its seed at submission (``decoder``). An error
    that refuses no rows ends the search and is raised."""
    tokens = np.full(len(batch), -1, np.int64)
    logprobs = np.full(len(batch), np.nan, np.float32)
    width = min(widest_top(batch), logits.shape[-1])
    top = (np.full((len(batch), width), -1, np.int32),
           np.full((len(batch), width), -np.inf, np.float32))
    refused: Refusals = {}

    async def search(start: int, stop: int, error: BaseException) -> None:
        if stop - start == 1:
            refused[start] = f"{type(error).__name__}: {error}"
            return
        middle = (start + stop) // 2
        for a, b in ((start, middle), (middle, stop)):
            try:
                part = await sampler(logits[a:b], batch.take(np.arange(a, b)))
            except Exception as half_error:  # noqa: BLE001 - sorted by refuses_rows
                if not refuses_rows(half_error):
                    raise
                await search(a, b, half_error)
            else:
                tokens[a:b], logprobs[a:b], part_top = result_parts(part)
                for whole, columns in zip(top, part_top or ()):
                    width = min(columns.shape[1], whole.shape[1])  # a part may pad past V
                    whole[a:b, :width] = columns[:, :width]

    await search(0, len(batch), refusal)
    return ((tokens, logprobs, top) if width else (tokens, logprobs)), refused
