"""The decode loop: requests in, streamed events out, sampling overlapped.

A :class:`Decoder` owns an :class:`~.engine.Engine` and a text codec. Requests
are admitted up to the engine's ``max_batch_size`` (the rest wait in a FIFO
queue) and spread over K *lanes* (micro-batches, ``micro_batches``, default
1: ``settings.LlmSettings`` says why). Each lane loops: the engine computes
the lane's logits (in a one-thread executor, so forwards run one at a time
and the event loop stays free), the sampler turns them into tokens, the
tokens go back to the engine. While one
lane waits on its sampler the engine computes the other lane's step, so with
K >= 2 sampling leaves the critical path; K = 1 is the plain serial loop.
A new request joins the lane with the fewest sequences, and a lane holding
more than its share hands sequences to the smallest lane between its steps.

Sampling modes (``mode``):

* ``simple``: ``sampler`` is an async callable
  ``async def sample(logits, batch) -> (token_ids, logprobs)`` (logits float32
  ``[n, V]``, ``batch`` a :class:`SamplingBatch` of n rows; returns int64
  ``[n]`` and float32 ``[n]``): the decision plane, remote in a server
  (:func:`threaded` wraps a local function for tests). A sampler with a
  data-plane half (``summarize(logits, batch)``: the hot-first summary,
  ``triton.hot_first_sampler``) has it run in the data-plane thread right
  behind the forward (``engine.step_then``: where a GPU engine's stream
  holds the rows, and where the simulated engine models it as device
  time; with several lanes only on such an engine, since elsewhere it would
  hold the other lane's forward), and is then called
  ``sampler(logits, batch, summary)``. With one
  lane, such a sampler's synchronous path (``sample_now(logits, batch,
  summary)``: one request, answered in that thread) runs there too, right
  after it, with no hop to the event loop and back; it returns None when it
  cannot answer so (a failed request, rows it cannot send that way), and
  the event loop awaits the sampler as ever;
* ``inline``: torch sampling in the data plane right after the forward
  (``inline.sample_torch``), one lane, no overlap: the baseline;
* ``inline_kernels``: the Cython kernels (``simple_sampler.sample``) in the
  data plane, one lane, no overlap.

Engines that schedule their own batches (TensorRT-LLM, ``trtllm``) are
``engine.SelfScheduling``, with a ``wait_ready(seq_ids)`` method: their iterations decide which sequences have a
row, so each loop first asks which of its sequences are ready (waiting briefly
for any) and steps only those, in one lane: the engine's own in-flight
batching (and its pipeline micro-batches) replaces the decoder's lanes.

The rows' sampling state (parameters, token histories) is kept by slot in a
:class:`~.batch_state.BatchState` from admission to release, so a step's
batch is gathered, not rebuilt; ``DecoderStats.loop_s`` is the loop's own
time per step (docs/DECODE_LOOP.md).

Randomness: a request's step is the number of tokens it has generated, and
an unseeded request gets one random seed at submission, so a seeded request
yields the same tokens whatever the batch composition, lane split or mode of
admission.

Events (:class:`GenerationEvent`) carry one generated token each; the last
one has ``finish_reason`` (TensorRT-LLM / OpenAI naming): ``"stop"`` (end id
or a stop word), ``"length"`` (max_tokens reached) or ``"cancelled"``; or
``error`` when the step or sampler failed. Every submitted request gets
exactly one final event; a request rejected by validation raises ValueError
from :meth:`Decoder.submit` instead. The end id and the tokens of a stop
word count as generated tokens and are in ``token_ids``; their text is not
in ``text``. A consumer that streams many requests (the llm model) takes
their other tokens a step at a time instead (``Decoder.on_step``,
``RequestHandle.listen`` with a sink): no event per token, one call per step.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Sequence

import numpy as np
import torch

from ..params import SamplingBatch, SamplingParams
from ..sampling import sample
from ..settings import SAMPLING_MODES, LlmSettings
from .batch_state import BatchState
from .engine import Engine, SelfScheduling, SequenceFailed, StepsThen, step_then
from .inline import sample_torch
from .text import Detokenizer, StopMatcher, TextCodec

log = logging.getLogger(__name__)

FINISH_STOP, FINISH_LENGTH, FINISH_CANCELLED = "stop", "length", "cancelled"
TIMING_RECORDS = 4096  # per-step records kept (the oldest are dropped)

SampleResult = tuple[np.ndarray, np.ndarray]
AsyncSampler = Callable[[torch.Tensor, SamplingBatch], Awaitable[SampleResult]]


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


def _string_list(name: str, value) -> None:
    if isinstance(value, str) or not all(isinstance(w, str) and w for w in value):
        raise ValueError(f"{name} must be a list of non-empty strings, got {value!r}")


@dataclass
class GenerationRequest:
    """One generation. Give ``text`` (encoded with the model's tokenizer,
    through the chat template when ``chat``) or ``prompt_ids``.

    ``end_id`` defaults to the tokenizer's end-of-sequence id; it stops the
    generation unless ``ignore_end``, and ``sampling.min_tokens`` bans it
    until that many tokens exist. ``stop_words`` end the generation (text cut
    before the word); ``bad_words`` are never generated (each word's last
    token is banned whenever the sequence ends with the word's other tokens).
    """

    text: str | None = None
    prompt_ids: Sequence[int] | None = None
    chat: bool = False
    max_tokens: int = 16
    sampling: SamplingParams = field(default_factory=SamplingParams)
    end_id: int | None = None
    ignore_end: bool = False
    stop_words: Sequence[str] = ()
    bad_words: Sequence[str] = ()
    return_log_probs: bool = False

    def validate(self, vocab_size: int, max_context: int, prompt_length: int | None = None,
                 max_tokens_limit: int | None = None) -> None:
        """Raise ValueError naming the field and its allowed range.

        ``prompt_length`` (once known) must leave room for ``max_tokens`` in
        ``max_context``; ``max_tokens_limit`` defaults to ``max_context - 1``.
        """
        if (self.text is None) == (self.prompt_ids is None):
            raise ValueError("give exactly one of text_input and prompt_ids")
        if self.text is not None and (not isinstance(self.text, str) or not self.text):
            raise ValueError("text_input must be a non-empty string")
        if self.prompt_ids is not None:
            ids = list(self.prompt_ids)
            if not ids or not all(isinstance(t, (int, np.integer)) and 0 <= t < vocab_size
                                  for t in ids):
                raise ValueError(f"prompt_ids must be a non-empty list of token ids in "
                                 f"[0, {vocab_size})")
        limit = max_context - 1 if max_tokens_limit is None else max_tokens_limit
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, (int, np.integer)) \
                or not 1 <= self.max_tokens <= limit:
            raise ValueError(f"max_tokens must be an integer in [1, {limit}], got {self.max_tokens!r}")
        if prompt_length is not None and prompt_length + self.max_tokens > max_context:
            raise ValueError(f"the prompt ({prompt_length} tokens) plus max_tokens "
                             f"({self.max_tokens}) must be at most the context, {max_context} "
                             f"tokens")
        self.sampling.validate(vocab_size)
        if self.end_id is not None and not 0 <= self.end_id < vocab_size:
            raise ValueError(f"end_id must be a token id in [0, {vocab_size}), got {self.end_id!r}")
        _string_list("stop_words", self.stop_words)
        _string_list("bad_words", self.bad_words)


@dataclass
class GenerationEvent:
    """One step of a request's stream. ``text`` is the new stable text (may
    be ''); ``token_ids`` and ``logprobs`` the tokens generated this step
    (logprobs empty unless ``return_log_probs``); ``cum_log_prob`` their
    running sum (NaN unless asked). The final event has ``finish_reason`` or
    ``error`` set."""

    request_id: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    num_input_tokens: int
    num_output_tokens: int
    cum_log_prob: float
    finish_reason: str | None = None
    error: str | None = None
    #: with ``error``: the server could not serve it now (it is shutting
    #: down); the same request sent again may succeed (UNAVAILABLE, 503)
    retryable: bool = False

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class RequestHandle:
    """A submitted request: iterate it for its events, ``cancel()`` to stop it."""

    def __init__(self, decoder: "Decoder", request_id: int):
        self.decoder, self.request_id = decoder, request_id
        # A deque and one waiter, not an asyncio.Queue: the decode loop puts
        # one event per request per step (B at a time), and the queue's
        # bookkeeping (getters, unfinished-task count, its join Event) is
        # work nobody here uses: one reader, no join.
        self.pending: collections.deque[GenerationEvent] = collections.deque()
        self.waiter: asyncio.Future | None = None
        self.sink: object = None  # listen()

    def listen(self, listener: Callable[[GenerationEvent], None], sink: object = None) -> None:
        """Hand every event to ``listener`` as the decode loop makes it,
        instead of iterating: a step's events are then delivered in the
        loop's one pass over the step's rows, with no reader coroutine to
        wake per event. Events already made go first. Call on the decoder's
        event loop; the handle is then no longer iterable.

        With a ``sink`` (anything the consumer finds its request by) and the
        decoder's ``on_step`` set, a token that does not end the request
        makes no event: the step's such tokens go to ``on_step`` together,
        once per step (``Decoder._deliver``); the final event still comes
        to ``listener``."""
        # The listener replaces put() on this handle: the decode loop's
        # put(event) is then the listener's call itself, no call in between.
        self.put = listener
        self.sink = sink
        sequence = self.decoder.by_id.get(self.request_id)
        if sequence is not None:
            sequence.stepped = sink is not None and self.decoder.on_step is not None
        while self.pending:
            listener(self.pending.popleft())

    def put(self, event: GenerationEvent) -> None:
        """Queue an event (on the decoder's event loop) and wake the reader
        (``listen`` replaces it)."""
        self.pending.append(event)
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():  # done: its reader was cancelled
            waiter.set_result(None)

    def cancel(self) -> None:
        """Ask to stop; the final event (``"cancelled"``) follows at the
        request's next step, or at once while it is still queued."""
        self.decoder._cancel(self.request_id)

    async def __aiter__(self) -> AsyncIterator[GenerationEvent]:
        while True:
            while not self.pending:
                self.waiter = asyncio.get_running_loop().create_future()
                await self.waiter
            event = self.pending.popleft()
            yield event
            if event.final:
                return


@dataclass
class StepRecord:
    """One engine forward: rows, its time, its sampler's time and the decode
    loop's own Python time around it (seconds; see ``DecoderStats.loop_s``)."""

    rows: int
    data_plane_s: float
    sampler_s: float
    loop_s: float


@dataclass
class DecoderStats:
    """Cumulative timings (seconds) since the decoder started.

    ``busy_s``: time a forward or a sampler was running; ``data_plane_s``:
    forward time, the sampler's data-plane half included; ``summary_s``:
    that half alone (the hot-first summary: ``summarize``), timed around it
    in the data-plane thread (with ``engine.StepsThen``, the simulated
    engine's, its emulation on this CPU, not the device time it models);
    ``sampler_s``: total sampler time (overlapped or not);
    ``sampling_exposed_s``: time sampling ran while no forward did, the part
    on the critical path. ``sampling_share`` = exposed / busy. ``loop_s``:
    the CPU time (``time.thread_time``) of the decode loop's own Python work
    (reaping and admission, building the sampling batch, delivering tokens
    and events, appending to the engine), forward and sampler time excluded:
    at GPU pace it is on the critical path of every step, so ``loop_s /
    steps`` must stay well under a step. CPU rather than wall time, so that
    on a small machine the time the sampler's threads take the loop thread's
    core does not count as the loop's: a GPU host has cores to spare.
    ``forward_wait_s``: wall time a step's forward waited on either side,
    for the data-plane thread to start it after the loop handed it over and
    for the loop to take its rows once it was done: the decode loop busy
    with other work (answering the step before, another lane) while the
    data plane sat idle, on the critical path of every step.
    """

    busy_s: float = 0.0
    data_plane_s: float = 0.0
    summary_s: float = 0.0
    sampler_s: float = 0.0
    loop_s: float = 0.0
    sampling_exposed_s: float = 0.0
    forward_wait_s: float = 0.0
    sampler_retries: int = 0
    steps: int = 0
    tokens: int = 0
    records: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=TIMING_RECORDS))

    @property
    def sampling_share(self) -> float:
        return self.sampling_exposed_s / self.busy_s if self.busy_s else 0.0


class _Activity:
    """Counts forwards and samplers in flight on the event loop and turns
    their overlap into ``busy_s`` and ``sampling_exposed_s``."""

    def __init__(self, stats: DecoderStats):
        self.stats = stats
        self.forwards = self.samplers = 0
        self.since = time.perf_counter()

    def change(self, forwards: int = 0, samplers: int = 0) -> None:
        now = time.perf_counter()
        elapsed, self.since = now - self.since, now
        if self.forwards or self.samplers:
            self.stats.busy_s += elapsed
        if self.samplers and not self.forwards:
            self.stats.sampling_exposed_s += elapsed
        self.forwards += forwards
        self.samplers += samplers


@dataclass(eq=False)
class _DecodeSequence:
    """A request's state inside the decoder."""

    request_id: int
    request: GenerationRequest
    handle: RequestHandle
    prompt_ids: list[int]
    params: SamplingParams  # seeded, end id among the stop ids
    detokenizer: Detokenizer
    stop: StopMatcher
    bad_words_ids: list[list[int]]
    num_input_tokens: int = 0  # len(prompt_ids), kept for every event
    #: tokens generated; the ids themselves are in the decoder's BatchState
    #: (``Decoder.output_ids``)
    generated: int = 0
    max_tokens: int = 0  # request.max_tokens, read per token
    stop_ids: frozenset = frozenset()  # params.stop_token_ids, tested per token
    cum_log_prob: float = 0.0
    cancelled: bool = False
    done: bool = False
    #: its tokens that do not end it go to Decoder.on_step (RequestHandle.listen)
    stepped: bool = False
    slot: int = -1  # in the decoder's BatchState while in a lane


class Decoder:
    """The decode loop (module docstring). Use on one event loop::

        decoder = Decoder(engine, codec, mode="simple", sampler=threaded())
        await decoder.start()
        handle = decoder.submit(GenerationRequest(text="Hi", chat=True))
        async for event in handle: ...
        await decoder.close()
    """

    def __init__(self, engine: Engine, codec: TextCodec, mode: str = "simple",
                 sampler: AsyncSampler | None = None,
                 micro_batches: int = LlmSettings.micro_batches,
                 max_tokens_limit: int | None = None):
        if mode not in SAMPLING_MODES:
            raise ValueError(f"sampling_mode must be one of {', '.join(SAMPLING_MODES)}, "
                             f"got {mode!r}")
        if mode == "simple" and sampler is None:
            raise ValueError("sampling_mode 'simple' needs a sampler")
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        self.engine, self.codec, self.mode, self.sampler = engine, codec, mode, sampler
        self.local_sample = {"inline": sample_torch, "inline_kernels": kernel_sample}.get(mode)
        self.wait_ready = engine.wait_ready if isinstance(engine, SelfScheduling) else None
        # Inline modes cannot overlap; an engine with its own batches has one lane.
        lanes = micro_batches if mode == "simple" and self.wait_ready is None else 1
        self.lanes: list[list[_DecodeSequence]] = [[] for _ in range(lanes)]
        #: the sampler's data-plane half (module docstring), or None: with
        #: several lanes only where the engine models it as device time, since
        #: on any other engine it would hold the other lane's forward
        self.summarize = (getattr(sampler, "summarize", None)
                          if mode == "simple" and (lanes == 1 or isinstance(engine, StepsThen))
                          else None)
        #: the sampler's synchronous path (module docstring): one lane only,
        #: since it holds the data-plane thread while the sampler answers
        self.sample_now = getattr(sampler, "sample_now", None) if self.summarize and lanes == 1 \
            else None
        self.max_tokens_limit = max_tokens_limit
        self.queue: collections.deque[_DecodeSequence] = collections.deque()
        self.by_id: dict[int, _DecodeSequence] = {}
        self.ids = itertools.count()
        self.stats = DecoderStats()
        self.state = BatchState(engine.max_batch_size, engine.max_context)
        self.activity = _Activity(self.stats)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="data-plane")
        self.tasks: list[asyncio.Task] = []
        self.wake: list[asyncio.Event] = []
        #: on_step(handles, texts, tokens): once per step, the tokens of
        #: listened-to requests (``RequestHandle.listen``'s sink) that did not
        #: end them: row r's request is handles[r], its new text texts[r]
        #: (None: row r is not one of them) and its token tokens[r] (the
        #: step's int array); set before requests arrive
        self.on_step: Callable[[list[RequestHandle], list[str | None], np.ndarray], None] \
            | None = None

    async def start(self) -> None:
        self.wake = [asyncio.Event() for _ in self.lanes]
        self.tasks = [asyncio.create_task(self._lane(i)) for i in range(len(self.lanes))]

    async def close(self) -> None:
        """Stop the lanes; requests still running get no further events."""
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.executor.shutdown(wait=True)

    @property
    def num_active(self) -> int:
        return sum(len(lane) for lane in self.lanes)

    @property
    def num_queued(self) -> int:
        return len(self.queue)

    @property
    def num_in_flight(self) -> int:
        """Requests submitted and not yet ended (queued or decoding)."""
        return len(self.by_id)

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Validate, encode and queue a request; raise ValueError naming the
        bad field (the decoder keeps serving the others)."""
        engine = self.engine
        request.validate(engine.vocab_size, engine.max_context,
                         max_tokens_limit=self.max_tokens_limit)
        prompt_ids = (list(request.prompt_ids) if request.prompt_ids is not None
                      else self.codec.encode(request.text, request.chat))
        request.validate(engine.vocab_size, engine.max_context, len(prompt_ids),
                         self.max_tokens_limit)
        end_id = self.codec.end_id if request.end_id is None else request.end_id
        params = request.sampling
        params = dataclasses.replace(
            params,
            seed=secrets.randbits(64) if params.seed is None else params.seed,
            stop_token_ids=list(params.stop_token_ids) + ([] if request.ignore_end else [end_id]))
        request_id = next(self.ids)
        handle = RequestHandle(self, request_id)
        sequence = _DecodeSequence(request_id, request, handle, prompt_ids, params,
                                   self.codec.detokenizer(prompt_ids),
                                   StopMatcher(request.stop_words),
                                   self.codec.bad_words_ids(request.bad_words),
                                   num_input_tokens=len(prompt_ids),
                                   max_tokens=request.max_tokens,
                                   stop_ids=frozenset(params.stop_token_ids))
        self.by_id[request_id] = sequence
        self.queue.append(sequence)
        self._admit()
        return handle

    def _cancel(self, request_id: int) -> None:
        sequence = self.by_id.get(request_id)
        if sequence is None:
            return
        sequence.cancelled = True
        if sequence in self.queue:
            self.queue.remove(sequence)
            self._finish(sequence, FINISH_CANCELLED)

    def _admit(self) -> None:
        """Move queued requests into free slots, each to the smallest lane."""
        while self.queue and self.num_active < self.engine.max_batch_size:
            sequence = self.queue.popleft()
            try:
                self.engine.add(sequence.request_id, sequence.prompt_ids,
                                max_tokens=sequence.request.max_tokens)
            except (ValueError, RuntimeError) as error:
                self._finish(sequence, error=str(error))
                continue
            sequence.slot = self.state.add(sequence.params, sequence.prompt_ids,
                                           sequence.request.return_log_probs,
                                           sequence.bad_words_ids)
            lane = min(range(len(self.lanes)), key=lambda i: len(self.lanes[i]))
            self.lanes[lane].append(sequence)
            self.wake[lane].set()

    def abort_all(self, error: str) -> int:
        """End every request now with `error` (retryable: the server is
        going away); returns how many. Sequences in a lane that is inside a
        step leave it at that lane's next step boundary (`_reap`), so the
        engine is never changed under a running forward."""
        aborted = 0
        for sequence in list(self.by_id.values()):
            if sequence in self.queue:
                self.queue.remove(sequence)
            aborted += not sequence.done
            self._finish(sequence, error=error, retryable=True, release=False)
        for wake in self.wake:
            wake.set()
        return aborted

    def _reap(self, lane: list[_DecodeSequence]) -> None:
        """Free the slots of sequences finished outside their lane's step."""
        for sequence in [s for s in lane if s.done]:
            lane.remove(sequence)
            self._release(sequence)
        self._admit()

    def _release(self, sequence: _DecodeSequence) -> None:
        """Free a sequence's engine slot and batch-state slot (it has left its lane)."""
        self.engine.release(sequence.request_id)
        self.state.release(sequence.slot)

    def _finish(self, sequence: _DecodeSequence, reason: str | None = None,
                error: str | None = None,
                text: str = "", token_ids: Sequence[int] = (), logprobs: Sequence[float] = (),
                retryable: bool = False, release: bool = True):
        """Send the one final event and (with `release`) free the slot."""
        if sequence.done:
            return
        sequence.done = True
        self.by_id.pop(sequence.request_id, None)
        for lane in self.lanes if release else ():
            if sequence in lane:
                lane.remove(sequence)
                self._release(sequence)
        event = self._event(sequence, text, list(token_ids), list(logprobs), reason, error)
        event.retryable = retryable
        sequence.handle.put(event)
        if release:
            self._admit()

    @staticmethod
    def _event(sequence: _DecodeSequence, text: str, token_ids: list[int],
               logprobs: list[float], reason: str | None = None,
               error: str | None = None) -> GenerationEvent:
        """The event owns ``token_ids`` and ``logprobs`` (fresh lists: one
        event per token, so no copy)."""
        asked = sequence.request.return_log_probs
        return GenerationEvent(
            sequence.request_id, text, token_ids, logprobs if asked else [],
            sequence.num_input_tokens, sequence.generated,
            sequence.cum_log_prob if asked else float("nan"), reason, error)

    async def _lane(self, index: int) -> None:
        lane, wake = self.lanes[index], self.wake[index]
        loop = asyncio.get_running_loop()
        while True:
            started = time.thread_time()  # the loop's own work: up to the forward
            self._reap(lane)
            for sequence in [s for s in lane if s.cancelled]:
                self._finish(sequence, FINISH_CANCELLED)
            self._rebalance(index)
            if not lane:
                wake.clear()
                await wake.wait()
                continue
            sequences = list(lane)
            try:
                waited_s = loop_s = 0.0
                if self.wait_ready is not None:
                    loop_s = time.thread_time() - started
                    sequences, waited_s = await self._ready(sequences)
                    started = time.thread_time()
                    if not sequences:
                        continue
                batch = self._sampling_batch(sequences)
                loop_s += time.thread_time() - started
                ids = [s.request_id for s in sequences]
                self.activity.change(forwards=1)
                handed_over = time.perf_counter()
                try:
                    logits, summary, tokens, logprobs, forward_s, local_sample_s, began, ended = \
                        await loop.run_in_executor(self.executor, self._data_plane_step, ids, batch)
                finally:
                    self.activity.change(forwards=-1)
                self.stats.forward_wait_s += (began - handed_over) + (time.perf_counter() - ended)
                # sampled in the data-plane thread (or tried to): nothing overlapped it
                self.stats.sampling_exposed_s += local_sample_s
                sampler_s = local_sample_s
                if tokens is None:  # not sampled in the data-plane thread
                    started = time.perf_counter()
                    self.activity.change(samplers=1)
                    try:
                        tokens, logprobs = await (self.sampler(logits, batch) if summary is None
                                                  else self.sampler(logits, batch, summary))
                    finally:
                        self.activity.change(samplers=-1)
                    sampler_s += time.perf_counter() - started
                started = time.thread_time()
                self._deliver(sequences, np.asarray(tokens), np.asarray(logprobs))
                loop_s += time.thread_time() - started
                self._record(len(sequences), waited_s + forward_s, sampler_s, loop_s)
            except SequenceFailed as error:  # the engine failed only these: the others go on
                for sequence in sequences:
                    if sequence.request_id in error.failed:
                        self._finish(sequence, error=error.failed[sequence.request_id])
            except Exception as error:  # noqa: BLE001 - every request must get its final event
                log.exception("decode step of %d sequences failed", len(sequences))
                for sequence in sequences:
                    self._finish(sequence, error=f"{type(error).__name__}: {error}")

    async def _ready(self, sequences: list[_DecodeSequence]) -> tuple[list[_DecodeSequence], float]:
        """The sequences the engine has rows for, and the seconds spent
        waiting for them (the engine was computing: counted as data plane)."""
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        self.activity.change(forwards=1)
        try:
            ready = set(await loop.run_in_executor(self.executor, self.wait_ready,
                                                   [s.request_id for s in sequences]))
        finally:
            self.activity.change(forwards=-1)
        return [s for s in sequences if s.request_id in ready], time.perf_counter() - started

    def _rebalance(self, index: int) -> None:
        """Move sequences from lane ``index`` (between its steps, so they are
        idle) to the smallest lanes while it holds more than its share:
        finishing requests would otherwise leave one lane with all the work
        and nothing to overlap it with."""
        lane = self.lanes[index]
        share = -(-self.num_active // len(self.lanes))  # ceil
        while len(lane) > share:
            target = min(range(len(self.lanes)), key=lambda i: len(self.lanes[i]))
            if len(self.lanes[target]) + 1 >= len(lane):
                return
            self.lanes[target].append(lane.pop())
            self.wake[target].set()

    def _data_plane_step(self, ids: list[int], batch: SamplingBatch):
        """In the data-plane thread: the forward and the sampler's
        data-plane half (forward_s counts both: data-plane time), then in
        inline modes the sampling, or the sampler's synchronous path.
        Returns (logits, summary, tokens, logprobs, forward_s, sample_s,
        started, done): summary None without a data-plane half, tokens None
        when the rows are still to be sampled (sample_s then the time of a
        synchronous path that gave way), the last two
        ``time.perf_counter()`` readings when the thread began and ended the
        step."""
        started = time.perf_counter()
        summary = None
        if self.summarize is None:
            logits = self.engine.step(ids)
        else:
            logits, summary = step_then(self.engine, ids,
                                        lambda rows: self._timed_summary(rows, batch))
        forward_s = time.perf_counter() - started
        sampled = None
        if self.sample_now is not None:
            sampled = self.sample_now(logits, batch, summary)
        elif self.local_sample is not None:
            sampled = self.local_sample(logits, batch)
        done = time.perf_counter()
        sample_s = done - started - forward_s  # a synchronous path that gave way included
        if sampled is None:  # the event loop awaits the sampler
            return logits, summary, None, None, forward_s, sample_s, started, done
        tokens, logprobs = sampled
        return logits, None, tokens, logprobs, forward_s, sample_s, started, done

    def _timed_summary(self, logits, batch: SamplingBatch):
        """``summarize``, its time added to ``stats.summary_s`` (the
        data-plane thread is the only writer)."""
        started = time.perf_counter()
        try:
            return self.summarize(logits, batch)
        finally:
            self.stats.summary_s += time.perf_counter() - started

    def _sampling_batch(self, sequences: list[_DecodeSequence]) -> SamplingBatch:
        """Gathered from the persistent state (parameters were checked at submission)."""
        return self.state.batch(np.array([s.slot for s in sequences], np.int64))

    def _record(self, rows: int, forward_s: float, sampler_s: float, loop_s: float) -> None:
        self.stats.steps += 1
        self.stats.tokens += rows
        self.stats.data_plane_s += forward_s
        self.stats.sampler_s += sampler_s
        self.stats.loop_s += loop_s
        self.stats.records.append(StepRecord(rows, forward_s, sampler_s, loop_s))

    def output_ids(self, sequence: _DecodeSequence) -> list[int]:
        """The ids a sequence in a lane has generated (its history in the
        batch state: the decode loop keeps no list of its own)."""
        state, slot = self.state, sequence.slot
        return state.tokens[slot, state.prompt_length[slot]:state.length[slot]].tolist()

    def _deliver(self, sequences: list[_DecodeSequence], tokens: np.ndarray, logprobs: np.ndarray):
        """Turn one step's tokens into deliveries, in one pass over the rows;
        feed the survivors back.

        A row whose token ends its request (an end or stop id, a stop
        string, max_tokens) makes the request's final event. Any other row
        of a stepped request (``RequestHandle.listen`` with a sink) costs
        only its detokenizer step: its text goes into the step's ``texts``,
        and ``on_step`` gets them all after the pass; a row of any other
        request makes an event. The rows that go on are appended to the
        batch state and the engine by index arrays, not one by one."""
        rows = len(sequences)
        token_list, logprob_list = tokens.tolist(), logprobs.tolist()
        texts: list[str | None] = [None] * rows
        going_on = [False] * rows
        stepped = False
        for row, sequence in enumerate(sequences):
            if sequence.done:
                continue
            if sequence.cancelled:
                self._finish(sequence, FINISH_CANCELLED)
                continue
            token = token_list[row]
            sequence.generated += 1
            sequence.cum_log_prob += logprob_list[row]
            ended = token in sequence.stop_ids  # the end id, unless ignore_end
            text, stopped = "", False
            if not ended:
                text = sequence.detokenizer.push_token(token)
                if sequence.stop.stop_words:  # without any, feed() returns the text as it is
                    text, stopped = sequence.stop.feed(text)
            if ended or stopped or sequence.generated >= sequence.max_tokens:
                self._last(sequence, token, logprob_list[row], text, ended or stopped, stopped)
                continue
            going_on[row] = True
            if sequence.stepped:
                texts[row], stepped = text, True
            else:
                sequence.handle.put(self._event(sequence, text, [token], [logprob_list[row]]))
        if stepped:
            self.on_step([s.handle for s in sequences], texts, tokens)
        kept = np.flatnonzero(going_on)
        if kept.size:
            kept_list = kept.tolist()
            self.state.append(np.array([sequences[r].slot for r in kept_list], np.int64),
                              tokens[kept].astype(np.int32))
            self.engine.append([sequences[r].request_id for r in kept_list],
                               [token_list[r] for r in kept_list])

    def _last(self, sequence: _DecodeSequence, token: int, logprob: float, text: str,
              stop: bool, stopped: bool) -> None:
        """The final event of a sequence whose `token` ended it: `stop` (an
        end or stop id, or a stop string: `stopped`) or its length. The
        held-back text is released unless a stop string cut it."""
        if not stopped:
            tail, stopped = sequence.stop.feed(sequence.detokenizer.flush())
            text += tail + sequence.stop.flush()
        self._finish(sequence, FINISH_STOP if stop or stopped else FINISH_LENGTH, text=text,
                     token_ids=[token], logprobs=[logprob])
