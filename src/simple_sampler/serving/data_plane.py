"""The data-plane side of a decode-loop lane's step (``decoder.Decoder``):
the step handed to the one data-plane thread (``DataPlane.launch``), its
rows taken back (``landed``), and sampled (``sampled``): in that thread
right behind the forward (inline modes, a sampler's synchronous path) or by
awaiting the decision plane on the event loop.

A sampler with a data-plane half (``summarize(logits, batch)``: the
hot-first summary) has it run in the data-plane thread right behind the
forward (``engine.step_then``), with several lanes only where the engine
models it as device time (``engine.StepsThen``), since elsewhere it would
hold the other lane's forward; with one lane, such a sampler's synchronous
path (``sample_now``) runs there too (``decoder``'s module docstring).

A sampler that refuses rows of a step (``samplers.refuses_rows``: logits
it cannot sample, which come from the model) fails only their requests:
the step is sampled again around them (``samplers.sample_around_refusals``)
and ``sampled`` names them.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..params import SamplingBatch
from ..sampling import logits_array, logits_tensor
from .decoder_stats import Activity, DecoderStats
from .engine import Engine, SelfScheduling, StepsThen, step_then
from .generation import DecodeSequence
from .inline import sample_torch
from .samplers import (AsyncSampler, ReadsRowArena, Refusals, SampleResult, SamplesNow,
                       SummarizesOnDataPlane, TopLogprobs, gives_top_logprobs, kernel_sample,
                       refuses_rows, result_parts, sample_around_refusals, threaded)
from .structured import StepMasks


#: how long ``launch`` waits, holding no GIL, for a free data-plane thread
#: to begin the step it was handed: the thread needs the GIL for the step's
#: Python (its inputs, the graph's launch) and would otherwise wait for the
#: event loop's next blocking call or the switch interval, while the loop
#: goes on to the bench's or the server's own Python (or, launching ahead,
#: the events of the step before)
LAUNCH_WAIT_S = 0.002

log = logging.getLogger(__name__)


class SpareRows:
    """Host buffers for guided steps' masked rows (``StepMasks.applied``),
    kept from one step for a later one: a fresh B x V buffer has each of its
    pages faulted in by its first write, a kept one's are mapped already.
    The data-plane thread takes one; it is given back once its
    step is sampled (``DataPlane.sampled``), the last `kept` (at least 1)
    of them kept, for as long as the decoder lives (B x V each, held after
    the guided requests are gone)."""

    def __init__(self, kept: int = 2):
        if kept < 1:
            raise ValueError(f"kept must be at least 1, got {kept}")
        self.kept = kept
        self.buffers: list[torch.Tensor] = []
        self.lock = threading.Lock()  # taken in the data-plane thread, given back on the loop's

    def take(self, like: torch.Tensor) -> torch.Tensor:
        """A buffer of at least `like`'s rows, its V and dtype: a kept one,
        else a new one of `like`'s shape."""
        with self.lock:
            for index, buffer in enumerate(self.buffers):
                if buffer.shape[1:] == like.shape[1:] and buffer.dtype == like.dtype \
                        and len(buffer) >= len(like):
                    return self.buffers.pop(index)
        return torch.empty(like.shape, dtype=like.dtype)

    def give_back(self, buffer: torch.Tensor) -> None:
        with self.lock:
            self.buffers.append(buffer)
            del self.buffers[:-self.kept]


@dataclass(frozen=True, slots=True)
class DataPlaneStep:
    """One step as the data-plane thread ran it (``DataPlane.step``)."""

    logits: torch.Tensor
    #: the sampler's data-plane half's result; None without one, or once sampled
    summary: object
    #: the SampleResult when sampled in the thread; None: the event loop awaits the sampler
    sampled: SampleResult | None
    forward_s: float  # the forward and the data-plane half: data-plane time
    #: the sampling in the thread, or the time of a synchronous path that gave way
    sample_s: float
    #: ``time.perf_counter()`` when the thread began and ended the step
    began: float
    ended: float
    #: the error with which sampling in the thread refused rows (``refuses_rows``)
    refusal: BaseException | None = None
    #: the buffer of the masked rows ``logits`` lie in (``SpareRows``), given back once sampled
    spare: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class Launched:
    """A step handed to the data-plane thread (``DataPlane.launch``)."""

    sequences: list[DecodeSequence]
    ids: list[int]
    batch: SamplingBatch
    future: asyncio.Future
    handed_over: float  # time.perf_counter() at the hand-over
    loop_s: float  # the loop's own time for the step before it was launched


class DataPlane:
    """The engine's one thread and the sampler, for a decoder of `lanes`
    lanes in sampling `mode` (module docstring); its timings go to
    `stats`."""

    def __init__(self, engine: Engine, mode: str, sampler: AsyncSampler | None, lanes: int,
                 stats: DecoderStats):
        self.engine, self.sampler, self.stats = engine, sampler, stats
        self.local_sample = {"inline": sample_torch, "inline_kernels": kernel_sample}.get(mode)
        #: whether a row's top logprobs come back (``samplers.SampleResult``)
        self.gives_top_logprobs = gives_top_logprobs(self.local_sample or sampler)
        self.wait_ready = engine.wait_ready if isinstance(engine, SelfScheduling) else None
        #: the sampler's data-plane half (module docstring), or None: with
        #: several lanes only where the engine models it as device time, since
        #: on any other engine it would hold the other lane's forward
        self.summarize = (sampler.summarize
                          if isinstance(sampler, SummarizesOnDataPlane) and mode == "simple"
                          and (lanes == 1 or isinstance(engine, StepsThen)) else None)
        #: the sampler's synchronous path (module docstring): one lane only,
        #: since it holds the data-plane thread while the sampler answers
        self.sample_now = (sampler.sample_now
                           if self.summarize and lanes == 1 and isinstance(sampler, SamplesNow)
                           else None)
        self.activity = Activity(stats)
        self.spare_rows = SpareRows()
        #: where the sampler reads rows in place: a guided step's masked rows are written there
        self.arena = sampler.arena if isinstance(sampler, ReadsRowArena) else None
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="data-plane")

    def launch(self, sequences: list[DecodeSequence], batch: SamplingBatch,
               loop_s: float, masks: Future[StepMasks] | None = None) -> Launched:
        """Hand the step of `sequences` (its sampling `batch`; `masks`: its
        guided rows' grammar masks, ``structured``, which the caller fills
        while the forward runs) to the data-plane
        thread; the step as launched."""
        ids = [s.request_id for s in sequences]
        self.activity.change(forwards=1)
        handed_over = time.perf_counter()
        began = threading.Event()
        future = asyncio.get_running_loop().run_in_executor(self.executor, self.step, ids,
                                                            batch, began, masks)
        if self.activity.forwards == 1:  # the thread is free: let it take the GIL now
            began.wait(LAUNCH_WAIT_S)
        return Launched(sequences, ids, batch, future, handed_over, loop_s)

    async def landed(self, launched: Launched) -> DataPlaneStep:
        """The launched step's result, the data plane's idle time on either
        side of it counted (``DecoderStats.forward_wait_s``)."""
        awaited = time.perf_counter()
        try:
            step = await launched.future
        finally:
            self.activity.change(forwards=-1)
        self.stats.forward_wait_s += ((step.began - launched.handed_over)
                                      + max(0.0, time.perf_counter() - max(step.ended, awaited)))
        return step

    async def sampled(self, step: DataPlaneStep, batch: SamplingBatch
                      ) -> tuple[np.ndarray, np.ndarray, TopLogprobs | None, float, Refusals]:
        """(tokens, logprobs, top logprobs or None, sampler seconds, refused
        rows) of a landed step: sampled in the data-plane thread, or by
        awaiting the sampler now; where the sampler refused rows, sampled
        again around them (module docstring), their tokens -1. The step's
        masked rows' buffer is given back for a later step once sampled (not
        where sampling failed or was cancelled: a sampler may still read it)."""
        result = await self._sampled(step, batch)
        if step.spare is not None:
            self.spare_rows.give_back(step.spare)
        return result

    async def _sampled(self, step: DataPlaneStep, batch: SamplingBatch
                       ) -> tuple[np.ndarray, np.ndarray, TopLogprobs | None, float, Refusals]:
        # sampled in the data-plane thread (or tried to): nothing overlapped it
        self.stats.sampling_exposed_s += step.sample_s
        if step.sampled is not None:
            return (*result_parts(step.sampled), step.sample_s, {})
        started = time.perf_counter()
        self.activity.change(samplers=1)
        try:
            refusal, refused = step.refusal, {}
            if refusal is None:
                try:
                    result = await (self.sampler(step.logits, batch) if step.summary is None
                                    else self.sampler(step.logits, batch, step.summary))
                except Exception as error:  # noqa: BLE001 - sorted by refuses_rows
                    if not refuses_rows(error):
                        raise
                    refusal = error
            if refusal is not None:
                log.warning("the sampler refused rows of a step of %d; sampling it again "
                            "around them", len(batch), exc_info=refusal)
                result, refused = await sample_around_refusals(
                    threaded(self.local_sample) if self.local_sample else self.sampler,
                    step.logits, batch, refusal)
        finally:
            self.activity.change(samplers=-1)
        return (*result_parts(result), step.sample_s + time.perf_counter() - started, refused)

    async def ready(self, ids: Sequence[int]) -> tuple[set, float]:
        """The ids the engine has rows for (``engine.SelfScheduling``), and
        the seconds spent waiting for them (the engine was computing:
        counted as data plane)."""
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        self.activity.change(forwards=1)
        try:
            ready = set(await loop.run_in_executor(self.executor, self.wait_ready, list(ids)))
        finally:
            self.activity.change(forwards=-1)
        return ready, time.perf_counter() - started

    def step(self, ids: list[int], batch: SamplingBatch,
             started: threading.Event | None = None,
             masks: Future[StepMasks] | None = None) -> DataPlaneStep:
        """In the data-plane thread: the forward (its guided rows masked:
        `masks`) and the sampler's data-plane half, then in inline modes the
        sampling, or the sampler's synchronous path; `started` set as it
        begins."""
        began = time.perf_counter()
        if started is not None:
            started.set()
        summary = None
        spare = None
        if masks is not None:  # the summary is of the masked rows: after them
            # first: the masks are filled meanwhile (a fill that outlasts the
            # forward counts as the step's data-plane time)
            logits = self.engine.step(ids)
            if logits.device.type == "cpu":
                masked, spare = self._masked_buffer(logits)
                logits = masks.result().applied(logits, masked)
            else:
                logits = masks.result().applied(logits)
            if self.summarize is not None:
                summary = self._timed_summary(logits, batch)
        elif self.summarize is None:
            logits = self.engine.step(ids)
        else:
            logits, summary = step_then(self.engine, ids,
                                        lambda rows: self._timed_summary(rows, batch))
        forward_s = time.perf_counter() - began
        sampled = refusal = None
        try:
            if self.sample_now is not None:
                sampled = self.sample_now(logits, batch, summary)
            elif self.local_sample is not None:
                sampled = self.local_sample(logits, batch)
        except Exception as error:  # noqa: BLE001 - sorted by refuses_rows
            if not refuses_rows(error):
                raise
            refusal, summary = error, None  # ``sampled`` samples around the refused rows
        ended = time.perf_counter()
        return DataPlaneStep(logits, None if sampled is not None else summary, sampled,
                             forward_s, ended - began - forward_s, began, ended, refusal, spare)

    def _masked_buffer(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Where a guided step's masked host rows go, and the buffer to give
        back once they are sampled: a slot of the sampler's row arena (no
        copy on the way to the instances; it comes back by itself, so
        None), else a kept buffer (``SpareRows``)."""
        if self.arena is not None:
            slot = self.arena.take(tuple(logits.shape), logits_array(logits).dtype)
            if slot is not None:
                return logits_tensor(slot), None
        spare = self.spare_rows.take(logits)
        return spare[:len(logits)], spare

    def _timed_summary(self, logits, batch: SamplingBatch):
        """``summarize``, its time added to ``stats.summary_s`` (the
        data-plane thread is the only writer)."""
        started = time.perf_counter()
        try:
            return self.summarize(logits, batch)
        finally:
            self.stats.summary_s += time.perf_counter() - started
