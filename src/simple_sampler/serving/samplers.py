"""The samplers that run in this process: the kernels as the decoder's
``inline_kernels`` mode calls them (:func:`kernel_sample`), and an async
stand-in for the remote decision plane (:func:`threaded`)."""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Protocol, runtime_checkable

import numpy as np
import torch

from ..params import SamplingBatch
from ..sampling import sample

SampleResult = tuple[np.ndarray, np.ndarray]
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
