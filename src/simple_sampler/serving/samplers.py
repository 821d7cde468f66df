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

SampleResult = tuple[np.ndarray, np.ndarray]
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


def kernel_sample(logits: torch.Tensor, batch: SamplingBatch,
                  num_threads: int | None = None) -> SampleResult:
    """``simple_sampler.sample`` as ``(token_ids int64 [n], logprobs float32 [n])``
    (logprobs NaN when no row of the batch wants them), its rows spread over
    ``num_threads`` threads (default: ``sampling.default_num_threads()``)."""
    wanted = batch.want_logprobs is None or bool(np.any(batch.want_logprobs))
    out = sample(logits, batch, return_logprobs=wanted, num_threads=num_threads)
    return out.token_ids, out.logprobs


def threaded(sample_fn: Callable[[torch.Tensor, SamplingBatch], SampleResult] = kernel_sample
             ) -> AsyncSampler:
    """An async sampler running ``sample_fn`` in a worker thread: a stand-in
    for the remote decision plane (the kernels release the GIL)."""
    async def sampler(logits: torch.Tensor, batch: SamplingBatch) -> SampleResult:
        return await asyncio.to_thread(sample_fn, logits, batch)
    return sampler


#: how a sampler names the row it refuses (``sampling.raise_row_errors``, the
#: sampler model's INVALID_ARG messages): "row 3: logits must not contain NaN ..."
_ROW_NAMED = re.compile(r"\brow \d+: ")


def refuses_rows(error: BaseException) -> bool:
    """Whether a sampler's `error` refuses rows of its call (a row the
    kernels cannot sample: NaN logits, +inf after temperature, every token
    banned) rather than being the sampler's own failure (MemoryError,
    RuntimeError, a transport error): a ValueError, or a remote sampler's
    refusal marked ``retryable = False`` (``triton.sampler_pool.
    SamplerCallError``: INVALID_ARG), that names a row. A refusal naming no
    row (a request too large for a remote sampler, a bug of ours) would fail
    every half too: it fails the step at once."""
    refused = isinstance(error, ValueError) or getattr(error, "retryable", True) is False
    return refused and _ROW_NAMED.search(str(error)) is not None


async def sample_around_refusals(sampler: AsyncSampler, logits: torch.Tensor,
                                 batch: SamplingBatch, refusal: BaseException
                                 ) -> tuple[np.ndarray, np.ndarray, Refusals]:
    """A step whose sampler call was refused (`refusal`: ``refuses_rows``),
    sampled again in halves down to the refused rows, so that only their
    requests fail. Returns tokens (int64 [n], -1 where refused), logprobs
    (float32 [n], NaN where refused or not asked) and each refused row's
    error.

    What is refused comes from the model's logits (a request's values are
    checked at submission), so only this failure path pays: about
    2 log2(n) calls per refused row. The tokens are those the whole call
    would have drawn: a row's randomness is its (seed, step), and an
    unseeded request gets its seed at submission (``decoder``). An error
    that refuses no rows ends the search and is raised."""
    tokens = np.full(len(batch), -1, np.int64)
    logprobs = np.full(len(batch), np.nan, np.float32)
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
                tokens[a:b], logprobs[a:b] = (np.asarray(p) for p in part)

    await search(0, len(batch), refusal)
    return tokens, logprobs, refused
