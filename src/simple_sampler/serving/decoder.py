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
more than its share hands sequences to the smallest lane between its steps;
on an engine whose step computes a window of slots whole
(``engine.SplitsSlots``: the static engine) each lane owns a window, and a
sequence stays in the lane whose window holds its slot.

Sampling modes (``mode``):

* ``simple``: ``sampler`` is an async callable
  ``async def sample(logits, batch) -> (token_ids, logprobs)`` (logits
  ``[n, V]`` in the engine's dtype, float32, bfloat16 or float16; ``batch``
  a :class:`SamplingBatch` of n rows; returns int64 ``[n]`` and float32
  ``[n]``, and a third element, the rows' top logprobs, where a row asks
  for them: ``samplers.SampleResult``; a sampler that gives them says so,
  ``samplers.gives_top_logprobs``, or such requests are refused): the decision plane, remote in a server
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

Launching ahead (``launch_ahead``, ``LlmSettings.launch_ahead``): once a
step is sampled, the tokens that go on are fed back and the lane's next
step is handed to the data-plane thread before this step's events and
final events are made, so their Python runs beside the next forward
(``StepTokens.deliver``'s `then`). It needs to know which rows go on before
their text is made, so a step with a request that has stop strings is
answered first, then launched. A request admitted meanwhile joins the step
after. On by default where the forward leaves the host's cores free
(``engine.ComputesOffHost``: a GPU, the simulated engine); on a CPU data
plane the events' Python would take a core from the forward.

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

Requests, their events and handles: ``serving/generation.py``; the loop's
timings: ``serving/decoder_stats.py``; a step's data-plane side (its thread,
the sampler): ``serving/data_plane.py``.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import sys
import time
from concurrent.futures import Future
from typing import Callable, Sequence

import numpy as np

from ..params import SamplingBatch
from ..settings import LAUNCH_AHEAD, SAMPLING_MODES, LlmSettings
from .admission import prepare
from .batch_state import BatchState
from .data_plane import DataPlane, Launched
from .decoder_stats import DecoderStats
from .engine import ComputesOffHost, Engine, SelfScheduling, SequenceFailed, SplitsSlots, WarmsUp
from .generation import FINISH_CANCELLED, DecodeSequence, GenerationRequest, RequestHandle
from .prompt_scorer import PromptScorer
from .step_tokens import StepTokens
from .structured import Grammars, complete_and_banned
from .samplers import AsyncSampler
from .text import TextCodec

log = logging.getLogger(__name__)


#: the interpreter's switch interval while steps are launched ahead: the
#: data-plane thread needs the GIL for its step's Python (inputs, the graph's
#: launch) while the loop thread makes the step before's events, and a
#: thread waiting on the GIL gets it only after the holder's switch interval
#: (Python's default: 5 ms, a whole GPU step) or when the holder blocks
LAUNCH_AHEAD_SWITCH_S = 0.0005


def warm_up(engine: Engine) -> None:
    """``engine.WarmsUp``'s steps prepared before the first request, logged:
    a capture or a compile at a bucket's first step would stall the requests
    in flight, and on CUDA a capture in the default (global) mode fails while
    another thread launches device work (a lane's summary, the rows' copies)."""
    if not isinstance(engine, WarmsUp):
        return
    started = time.perf_counter()
    prepared = engine.warm_up()
    if prepared:
        log.info("%s warmed up: %d decode steps prepared in %.1f s", engine.label, prepared,
                 time.perf_counter() - started)


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
                 launch_ahead: str = LlmSettings.launch_ahead,
                 logprobs_mode: str = LlmSettings.logprobs_mode):
        if mode not in SAMPLING_MODES:
            raise ValueError(f"sampling_mode must be one of {', '.join(SAMPLING_MODES)}, "
                             f"got {mode!r}")
        if mode == "simple" and sampler is None:
            raise ValueError("sampling_mode 'simple' needs a sampler")
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        if launch_ahead not in LAUNCH_AHEAD:
            raise ValueError(f"launch_ahead must be one of {', '.join(LAUNCH_AHEAD)}, "
                             f"got {launch_ahead!r}")
        self.engine, self.codec, self.mode, self.sampler = engine, codec, mode, sampler
        #: the model's end ids the engine can generate (generation_config.json may name more)
        self.end_ids = [i for i in codec.end_ids if 0 <= i < engine.vocab_size]
        if outside := sorted(set(codec.end_ids) - set(self.end_ids)):
            log.warning("end ids %s lie outside the engine's V=%d: they end nothing", outside, engine.vocab_size)
        self.self_scheduling = isinstance(engine, SelfScheduling)
        # Inline modes cannot overlap; an engine with its own batches has one lane.
        lanes = micro_batches if mode == "simple" and not self.self_scheduling else 1
        self.lanes: list[list[DecodeSequence]] = [[] for _ in range(lanes)]
        #: each lane's sequences in a window of slots of its own, never moved
        #: (``engine.SplitsSlots``: a step computes its window whole)
        # (not with more lanes than slots: some lanes would have no window)
        self.windowed = 1 < lanes <= engine.max_batch_size and isinstance(engine, SplitsSlots)
        if self.windowed:
            engine.split_slots(lanes)
        warm_up(engine)  # after the split: the lanes' own steps
        #: launch each step before the step before it makes its events
        #: (``StepTokens.deliver``'s `then`); never with an engine that
        #: schedules its own batches (it asks which sequences are ready)
        self.launches_ahead = not self.self_scheduling and (
            launch_ahead == "on" or launch_ahead == "auto"
            and isinstance(engine, ComputesOffHost) and engine.off_host)
        self.switch_interval: float | None = None  # the one ``start`` replaced
        self.queue: collections.deque[DecodeSequence] = collections.deque()
        self.by_id: dict[int, DecodeSequence] = {}
        self.ids = itertools.count()
        self.stats = DecoderStats()
        # histories in the sampler's arena, named there (SamplerPool.history_arena)
        self.state = BatchState(engine.max_batch_size, engine.max_context,
                                raw_logprobs=logprobs_mode == "raw_logprobs",
                                arena=getattr(sampler, "history_arena", None))
        #: what a step's tokens become: events, on_step's hand-outs, held tokens
        self.step_tokens = StepTokens(self)
        #: requests cancelled or ended while in a lane (their rows take the
        #: per-row path until they leave it)
        self.interrupted: set[int] = set()
        #: the data-plane side of a lane's step: its thread, the sampler
        self.data_plane = DataPlane(engine, mode, sampler, lanes, self.stats)
        #: guided requests' grammars (``structured``), and the ids of those in a
        #: lane (with allowed_token_ids too: their rows are masked as theirs)
        self.grammars = Grammars(codec.tokenizer, engine.vocab_size, self.end_ids)
        self.guided: set[int] = set()
        self.tasks: list[asyncio.Task] = []
        self.scorer = PromptScorer(self)  # prompt_logprobs: scored before queued
        self.wake: list[asyncio.Event] = []
        #: on_step(handles, texts, ids): once per step with any due, the
        #: tokens of listened-to requests (``RequestHandle.listen``'s sink)
        #: that did not end them, each request's `interval` at a time: the
        #: i-th request due is handles[i], its new text texts[i] and its
        #: ids ids[i] (int32 [1, n], its own copy); set before requests arrive
        self.on_step: Callable[[list[RequestHandle], list[str], list[np.ndarray]], None] \
            | None = None

    async def start(self) -> None:
        """Start the lanes; launching ahead, lower the interpreter's switch
        interval (process-wide, restored by ``close``) to
        :data:`LAUNCH_AHEAD_SWITCH_S`."""
        if self.launches_ahead:
            self.switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(min(self.switch_interval, LAUNCH_AHEAD_SWITCH_S))
        self.wake = [asyncio.Event() for _ in self.lanes]
        self.tasks = [asyncio.create_task(self._lane(i)) for i in range(len(self.lanes))]

    async def close(self) -> None:
        """Stop the lanes; requests still running get no further events."""
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.scorer.close()
        if self.switch_interval is not None:
            sys.setswitchinterval(self.switch_interval)
        self.data_plane.executor.shutdown(wait=True)

    @property
    def num_active(self) -> int:
        return sum(len(lane) for lane in self.lanes)

    @property
    def num_queued(self) -> int:
        return len(self.queue)

    @property
    def num_in_flight(self) -> int:
        """Requests submitted and not yet ended (their prompts scored, queued or decoding)."""
        return len(self.by_id)

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Validate, encode and queue a request (``prepare``, ``admit``)."""
        return self.admit(self.prepare(request))

    def prepare(self, request: GenerationRequest) -> DecodeSequence:
        """Validate and encode a request, not yet queued (a request of several
        generations prepares all before admitting any); raise InvalidRequest
        naming the bad field (the decoder keeps serving the others):
        ``admission.prepare``."""
        return prepare(self, request)

    def admit(self, sequence: DecodeSequence) -> RequestHandle:
        """Queue a prepared request (its prompt scored first when asked)."""
        self.by_id[sequence.request_id] = sequence
        (self.enqueue if sequence.request.prompt_logprobs is None else self.scorer.submit)(sequence)
        return sequence.handle

    def enqueue(self, sequence: DecodeSequence) -> None:
        """Queue a submitted request for a slot."""
        self.queue.append(sequence)
        self._admit()

    def cancel(self, request_id: int) -> None:
        """Stop a request (``RequestHandle.cancel``)."""
        sequence = self.by_id.get(request_id)
        if sequence is None:
            return
        sequence.cancelled = True
        if sequence in self.queue:
            self.queue.remove(sequence)
            self.finish(sequence, FINISH_CANCELLED)
        elif sequence.slot >= 0:  # in a lane: its row takes the per-row path
            self.interrupted.add(request_id)
        else:  # its prompt waits to be scored, or is: its scores will be dropped
            self.finish(sequence, FINISH_CANCELLED)

    def _admit(self) -> None:
        """Move queued requests into free slots, each to the smallest lane
        (with windows, the smallest whose window has a free slot)."""
        while self.queue and self.num_active < self.engine.max_batch_size:
            lanes = range(len(self.lanes))
            if self.windowed:
                lanes = [i for i in lanes if self.engine.free_in_lane(i)]
            lane = min(lanes, key=lambda i: len(self.lanes[i]), default=None)
            if lane is None:  # the free slots are held by finished rows until _reap
                return
            sequence = self.queue.popleft()
            where = {"lane": lane} if self.windowed else {}
            try:
                self.engine.add(sequence.request_id, sequence.prompt_ids,
                                max_tokens=sequence.max_tokens, **where)
            except (ValueError, RuntimeError) as error:
                self.finish(sequence, error=str(error))
                continue
            sequence.slot = self.state.add(sequence.params, sequence.prompt_ids,
                                           sequence.request.return_log_probs,
                                           sequence.bad_words_ids,
                                           sequence.request.num_top_logprobs)
            self.step_tokens.admit(sequence)
            if sequence.matcher is not None or sequence.allowed is not None:
                self.guided.add(sequence.request_id)
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
            self.finish(sequence, error=error, retryable=True, release=False)
        for wake in self.wake:
            wake.set()
        return aborted

    def _reap(self, lane: list[DecodeSequence]) -> None:
        """Free the slots of sequences finished outside their lane's step."""
        for sequence in [s for s in lane if s.done]:
            lane.remove(sequence)
            self._release(sequence)
        self._admit()

    def _release(self, sequence: DecodeSequence) -> None:
        """Free a sequence's engine slot and batch-state slot (it has left its lane)."""
        self.engine.release(sequence.request_id)
        self.state.release(sequence.slot)
        self.step_tokens.release(sequence.slot)
        self.interrupted.discard(sequence.request_id)
        self.guided.discard(sequence.request_id)

    def finish(self, sequence: DecodeSequence, reason: str | None = None,
                error: str | None = None,
                text: str = "", token_ids: Sequence[int] = (), logprobs: Sequence[float] = (),
                retryable: bool = False, release: bool = True, top_logprobs: list | None = None):
        """Send the one final event and (with `release`) free the slot
        (``StepTokens`` too, for the rows a step ends)."""
        if sequence.done:
            return
        held_text, held_ids = self.step_tokens.take(sequence)  # before the slot is freed
        sequence.done = True
        if not release and sequence.slot >= 0:  # in a lane until _reap takes it out
            self.interrupted.add(sequence.request_id)
        self.by_id.pop(sequence.request_id, None)
        for lane in self.lanes if release else ():
            if sequence in lane:
                lane.remove(sequence)
                self._release(sequence)
        event = sequence.event(held_text + text, held_ids + list(token_ids), list(logprobs),
                               reason, error, top_logprobs)
        event.retryable = retryable
        sequence.handle.put(event)
        if release:
            self._admit()

    async def _lane(self, index: int) -> None:
        wake = self.wake[index]
        ahead: Launched | None = None  # the next step, launched before this one's events
        while True:
            launched, ahead = ahead, None
            if launched is None:
                started = time.thread_time()  # the loop's own work: up to the forward
                sequences = self._prelude(index)
                if not sequences:
                    wake.clear()
                    await wake.wait()
                    continue
                loop_s = time.thread_time() - started
            else:
                sequences, loop_s = launched.sequences, launched.loop_s
            try:
                waited_s = 0.0
                if launched is None:
                    if self.self_scheduling:
                        ready, waited_s = await self.data_plane.ready(
                            [s.request_id for s in sequences])
                        sequences = [s for s in sequences if s.request_id in ready]
                        if not sequences:
                            continue
                    started = time.thread_time()
                    launched = self._launch(sequences, loop_s)
                    loop_s += time.thread_time() - started
                step = await self.data_plane.landed(launched)
                tokens, logprobs, top, sampler_s, refused = await self.data_plane.sampled(
                    step, launched.batch)
                started = time.thread_time()
                ids = launched.ids
                refused = {row: complete_and_banned(sequences[row].matcher, error)
                           or f"the sampler could not sample this request's logits from the "
                              f"model: {error}" for row, error in refused.items()}
                if self.guided:  # each matcher takes its row's token
                    refused.update(self.grammars.consume([s.matcher for s in sequences], tokens,
                                                         refused))
                if refused:
                    sequences, ids, tokens, logprobs, top = self._end_rows(
                        sequences, ids, tokens, logprobs, top, refused)

                def launch_ahead(ending: set[int]) -> None:
                    nonlocal ahead
                    following = self._prelude(index, ending)
                    if following:
                        ahead = self._launch(following, 0.0)

                if sequences:
                    self.step_tokens.deliver(sequences, ids, np.asarray(tokens),
                                             np.asarray(logprobs),
                                             launch_ahead if self.launches_ahead else None, top)
                loop_s += time.thread_time() - started
                self.stats.record(len(sequences), waited_s + step.forward_s, sampler_s, loop_s)
            except SequenceFailed as error:  # the engine failed only these: the others go on
                for sequence in sequences:
                    if sequence.request_id in error.failed:
                        self.finish(sequence, error=error.failed[sequence.request_id])
            except Exception as error:  # noqa: BLE001 - every request must get its final event
                log.exception("decode step of %d sequences failed", len(sequences))
                # a sequence in a step launched ahead leaves its lane after that step
                stepping = set(ahead.ids) if ahead is not None else set()
                for sequence in sequences:
                    self.finish(sequence, error=f"{type(error).__name__}: {error}",
                                 release=sequence.request_id not in stepping)

    def _end_rows(self, sequences: list[DecodeSequence], ids: list[int], tokens, logprobs,
                  top, errors: dict[int, str]):
        """End the requests of rows that cannot go on (the sampler refused
        their logits: ``data_plane``; their grammar refused their token),
        each with its row's error; the step's other sequences, ids, tokens,
        logprobs and top logprobs, to deliver."""
        for row, error in errors.items():
            log.error("request %s ends: %s", ids[row], error)
            self.finish(sequences[row], error=error)
        kept = [row for row in range(len(sequences)) if row not in errors]
        return ([sequences[row] for row in kept], [ids[row] for row in kept],
                np.asarray(tokens)[kept], np.asarray(logprobs)[kept],
                None if top is None else tuple(columns[kept] for columns in top))

    def _prelude(self, index: int, ending: set[int] = frozenset()) -> list[DecodeSequence]:
        """Lane `index`'s sequences for its next step, after its bookkeeping
        between steps: finished ones reaped, cancelled ones finished,
        sequences handed to smaller lanes. `ending`: request ids of the step
        just answered whose rows end there but whose final events are not
        made yet (``StepTokens.deliver``'s `then`): they stay in the lane,
        out of the step."""
        lane = self.lanes[index]
        self._reap(lane)
        for sequence in [s for s in lane if s.cancelled]:
            self.finish(sequence, FINISH_CANCELLED)
        self._rebalance(index, ending)
        return [s for s in lane if s.request_id not in ending]

    def _launch(self, sequences: list[DecodeSequence], loop_s: float) -> Launched:
        batch = self._sampling_batch(sequences)
        if not self.guided or not any(s.matcher is not None or s.allowed is not None
                                      for s in sequences):
            return self.data_plane.launch(sequences, batch, loop_s)
        # the step's masks are filled here while its forward runs: the
        # data-plane thread waits for them only once the forward is done (as
        # vLLM's EngineCore.step, vllm/v1/engine/core.py, has its scheduler
        # fill the grammar bitmask between launching the forward and its result)
        masks, launched = Future(), None
        try:
            launched = self.data_plane.launch(sequences, batch, loop_s, masks)
            masks.set_result(self.grammars.masks([s.matcher for s in sequences],
                                                 [s.allowed for s in sequences]))
        except BaseException as error:  # the step fails with it (``_lane``), its thread not left waiting
            masks.set_exception(error)
            if launched is None or not isinstance(error, Exception):
                raise
        return launched

    def _rebalance(self, index: int, staying: set[int] = frozenset()) -> None:
        """Move sequences from lane ``index`` (between its steps, so they are
        idle) to the smallest lanes while it holds more than its share:
        finishing requests would otherwise leave one lane with all the work
        and nothing to overlap it with. `staying`: request ids that keep
        their lane (ending: ``_prelude``). Not with windows of slots: a
        sequence's slot, and so its lane, is fixed; admissions even them out."""
        if self.windowed:
            return
        lane = self.lanes[index]
        share = -(-self.num_active // len(self.lanes))  # ceil
        while len(lane) > share:
            target = min(range(len(self.lanes)), key=lambda i: len(self.lanes[i]))
            movable = next((s for s in reversed(lane) if s.request_id not in staying), None)
            if movable is None or len(self.lanes[target]) + 1 >= len(lane):
                return
            lane.remove(movable)
            self.lanes[target].append(movable)
            self.wake[target].set()

    def _sampling_batch(self, sequences: list[DecodeSequence]) -> SamplingBatch:
        """Gathered from the persistent state (parameters were checked at submission)."""
        return self.state.batch(np.array([s.slot for s in sequences], np.int64))

    def output_ids(self, sequence: DecodeSequence) -> list[int]:
        """The ids a sequence in a lane has generated (its history in the
        batch state: the decode loop keeps no list of its own)."""
        state, slot = self.state, sequence.slot
        return state.tokens[slot, state.prompt_length[slot]:state.length[slot]].tolist()
