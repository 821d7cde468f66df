"""Where each step's rows are sampled: the local `simple_sampler` instances
(BLS inside this server) and/or the same model on other Triton servers
(gRPC), with failover.

A step's rows are split over the targets that are up in proportion to their
capacity (a target's instance count), and each target's part into one shard
per instance, all sent at once; but no shard of full rows holds fewer than
``min_rows`` (``LlmSettings.sampler_shard_min_rows``, where the default is
reasoned) when the decode loop has two lanes or more: a step of few rows
goes to fewer instances, taken in turn from one step to the next, so every
instance still gets work and two lanes' steps land on different instances.
With one lane a step's sampling is on its critical path (the next forward
waits for its tokens) and no other step wants the instances meanwhile, so
its rows are spread over them, :data:`ONE_LANE_ROWS_PER_REQUEST` to a shard
at least (fewer only where ``min_rows`` asks for fewer).

A shard whose request fails for a reason that is not the rows' own (a dead
instance, a server that went away, a timeout) is sent again at once to
another target that is up, and the target that failed is marked down for
``probe_after_s``; after that it is tried again with the next step's rows
(and marked down again if it still fails), a remote one once its readiness
probe has answered (``sampler_targets.SamplerTarget``). A shard a remote
target has not answered within its ``late_after`` (its answers' usual time
and spread, backed off by each late) is sent again at once to another target
that is up, the late call left running, its answer unread: a host that
hangs some requests costs each of them that, not the request's whole
timeout. The target takes no shard while a late call of its runs; two late
episodes in a row, or the late call's failure with no answer in time since,
mark it down. When no other
target is up the shard waits (backoff from RETRY_FIRST_S, doubling to
RETRY_MAX_S) and goes to the target that will be back soonest, until
``deadline_s`` has passed. A shard the sampler refused (INVALID_ARG: the rows
themselves are bad, which would be our bug) is never sent again.

Sampling is stateless and every draw is keyed by (seed, step), so a row gives
the same token on whichever target samples it, however often it is sent.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from ..histories import HistoryRef
from ..params import SamplingBatch
from ..sampling import logits_array
from ..settings import LlmSettings
from ..schema import TOP_OUTPUTS
from .sampler_codec import TOP_PADDING, batch_arrays, outcome_of, padded
from .sampler_targets import PROBE_AFTER_S, SamplerCall, SamplerCallError, SamplerTarget

log = logging.getLogger(__name__)
#: Full rows per shard at least with one lane: a row's kernel (tens to
#: hundreds of us at V = 128K) against a request's fixed cost (a few hundred
#: us of CPU, spread over the llm stub, tritonserver and the sampler stub),
#: where latency, not CPU, is what the step pays. The first GPU run (H200,
#: commit 11079fb, scripts/gpu_session.sh) sampled B = 64 served on ONE of
#: its 8 instances (64 rows to a request at least), 15.6 ms a step, where 8
#: threads in-process took about a third of that
#: (docs/results/gpu-2026-11-28.md). The hot-first handoff's second round
#: goes the same way (docs/results/fallback-shards-2026-11-29.md).
ONE_LANE_ROWS_PER_REQUEST = 8

#: Retries: the first wait, its doubling cap, and the time after which a
#: shard's rows fail (a reload of the sampler model takes ~2-5 s).
RETRY_FIRST_S, RETRY_MAX_S, RETRY_DEADLINE_S = 0.05, 1.0, 30.0
@dataclass
class SamplerPool:
    """The decoder's sampler over `targets` (module docstring). Call it as
    ``await pool(logits, batch)``; `on_retry` is called for every shard
    sent again. With an `arena` (``row_arena.RowArena``), the rows go to
    targets that share memory by reference: placed in the arena once, the
    slot given back when every shard has answered (a retry reads the same
    slot); other targets, and every target when no slot is free or
    /dev/shm has no room for its pages, get them in the request. min_rows:
    full rows per shard at least with `lanes` > 1 (``shards``); lanes: the
    decode loop's (micro-batches)."""

    targets: list[SamplerTarget]
    on_retry: Callable[[], None] = lambda: None
    arena: object = None
    deadline_s: float = RETRY_DEADLINE_S
    probe_after_s: float = PROBE_AFTER_S
    rows_sent: dict[str, int] = field(default_factory=dict)
    min_rows: int = LlmSettings.sampler_shard_min_rows
    lanes: int = LlmSettings.micro_batches
    #: the capacity slot the next step of fewer shards than slots starts at
    turn: int = 0
    #: the threads that send ``send_now``'s shards after its first, and every
    #: remote shard (made on first use)
    helpers: ThreadPoolExecutor | None = field(default=None, init=False, repr=False)
    _helpers_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    closed: bool = field(default=False, init=False)

    #: the rows' top logprobs come back (serving/samplers.SampleResult)
    gives_top_logprobs = True

    def __post_init__(self):
        if not self.targets:
            raise ValueError("a sampler pool needs at least one target")

    @property
    def history_arena(self):
        """Where a batch may name its histories (``SamplingBatch.history_ref``):
        the arena, where some target maps it (others get the lists); else None."""
        return self.arena if any(t.shares_memory for t in self.targets) else None

    async def __call__(self, logits: torch.Tensor, batch: SamplingBatch,
                       most_shards: int | None = None):
        # bfloat16 rows stay bfloat16 (ml_dtypes): no cast, no copy.
        rows = logits_array(logits)
        lease = None
        if self.arena is not None and any(t.shares_memory for t in self.targets):
            # A copy into a slot is B x V bytes of memcpy: off the event loop.
            lease = self.arena.reference(rows) or await asyncio.to_thread(self.arena.lease, rows)
        try:
            outputs = await self.send({"logits": rows}, batch, lease, most_shards)
        except BaseException:
            if lease is not None:  # the decode loop may sample these rows again (data_plane)
                lease.release_after(logits)
            raise
        if lease is not None:
            lease.release()
        sampled = outputs["output_ids"].astype(np.int64), outputs["output_log_probs"]
        if TOP_OUTPUTS[0] not in outputs:
            return sampled
        return (*sampled, tuple(outputs[name] for name in TOP_OUTPUTS))

    def reference(self, logits: torch.Tensor):
        """A lease of `logits` where they already lie in a shared region of
        the arena (the simulated engine's bank, the TensorRT-LLM bridge's
        staging block), for the targets that share memory; None when there
        is no arena, no such target, or the rows lie elsewhere (no copy is
        made). Rows in a ring slot the engine took (``RowArena.take``) are
        not claimed: the caller (the hot-first sampler) never gives its
        lease back, and the slot comes back when the rows die."""
        if (self.arena is None or logits.device.type != "cpu"
                or not any(t.shares_memory for t in self.targets)):
            return None
        return self.arena.reference(logits_array(logits), claim=False)

    async def send(self, rows: dict[str, np.ndarray], batch: SamplingBatch,
                   lease=None, most_shards: int | None = None,
                   scalars: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """The rows (``logits``, or the compact inputs: arrays of len(batch)
        rows) with `batch`'s parameters, sharded over the targets; returns
        each output concatenated, [B] (output_log_probs NaN where not asked).
        lease: the logits' place in the arena (``row_arena.RowLease``), for
        the targets that share memory; every shard has answered, failed or
        (a remote one, never given the lease) been given up on as late
        when this returns or raises. most_shards: at most that many requests
        (``shards``). scalars: ``batch_arrays(batch, packed=True)``, when
        the caller has it already."""
        arrays = self._arrays(rows, batch, scalars)
        shards = self.shards(len(batch), most_shards)
        histories = batch.history_ref.ids if batch.history_ref is not None else None
        # return_exceptions: no shard may still read the arena's slot once
        # this returns (the caller gives it back).
        parts = await asyncio.gather(*(
            self._send({k: v[a:b] for k, v in arrays.items()}, target,
                       lease.refs(a, b) if lease is not None else None, histories)
            for target, a, b in shards), return_exceptions=True)
        for part in parts:
            if isinstance(part, BaseException):
                raise part
        return _per_row(parts, len(batch))

    def send_now(self, rows: dict[str, np.ndarray], batch: SamplingBatch, lease=None,
                 most_shards: int | None = None,
                 scalars: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray] | None:
        """``send`` in this thread, when every shard of the rows goes to a
        target that is up (and, given a `lease`, maps the arena) and each
        answers in time: their outputs ([B]), else None (a target down or
        unable to read the lease; a shard failed or was late, its target
        marked down: ``send`` sends the rows again elsewhere). A first shard
        for this server's own instances is sent from this thread, the others
        at once from the pool's own threads, and this thread waits for every
        answer (a remote one until the latest of their ``late_after``): no
        hop to the event loop and back."""
        sent_at = now = time.monotonic()  # before the targets are chosen (SamplerTarget.abandon)
        shards = self.shards(len(batch), most_shards)
        if any(not target.is_up(now) or (lease is not None and not target.shares_memory)
               for target, _, _ in shards):
            return None
        inputs = self._arrays(rows, batch, scalars)
        parts = [{k: v[a:b] for k, v in inputs.items()} if len(shards) > 1 else inputs
                 for _, a, b in shards]
        if lease is not None:
            parts = [_by_reference(part, lease.refs(a, b))
                     for part, (_, a, b) in zip(parts, shards)]
        if "history_ref" in inputs:
            histories = batch.history_ref.ids if batch.history_ref is not None else None
            parts = [part if target.shares_memory else _by_value(part, histories)
                     for part, (target, _, _) in zip(parts, shards)]
        limits = [target.late_after(part) for (target, _, _), part in zip(shards, parts)]
        here = int(limits[0] is None)  # a remote first shard would hold this thread past late
        left = [threading.Event() for _ in shards]  # set: abandoned as late
        calls = [self._helpers().submit(_answer, target.timed_call, part, abandoned)
                 for (target, _, _), part, abandoned in zip(shards[here:], parts[here:], left[here:])]
        answers = [_answer(shards[0][0].timed_call, parts[0])] if here else []
        remote = [(call, limit) for call, limit in zip(calls, limits[here:]) if limit is not None]
        wait([call for call, _ in remote], timeout=max((limit for _, limit in remote), default=0))
        now = time.monotonic()  # who is up before any shard here is given up on
        up = [t for t in self.targets if t.is_up(now)]
        for call, (target, _, _), part, limit, abandoned in zip(calls, shards[here:], parts[here:],
                                                                limits[here:], left[here:]):
            if limit is None or call.done() or not any(t is not target for t in up):
                answers.append(call.result())  # a slow answer beats none
                continue
            answers.append(self._give_up(target, call, part, sent_at, abandoned, limit))
        for (target, _, _), answer in zip(shards, answers):
            if isinstance(answer, SamplerCallError):
                if not answer.retryable:
                    raise answer
                self._failed(target, answer)
        if any(isinstance(answer, SamplerCallError) for answer in answers):
            return None
        for target, a, b in shards:
            self._served(target, b - a)
        return _per_row(answers, len(batch))

    def close(self) -> None:
        """Stop the pool's threads (idle once the decode loop has stopped) and
        close the remote targets' clients, which ends a call left late."""
        self.closed = True
        with self._helpers_lock:
            if self.helpers is not None:
                self.helpers.shutdown(wait=False, cancel_futures=True)
        for target in self.targets:
            if hasattr(target.call, "close"):
                target.call.close()

    def _helpers(self) -> ThreadPoolExecutor:
        """``helpers``: a thread per capacity slot and lane, since a lane's
        step has at most one shard per slot (``shards``), and one more per
        remote slot and lane for the late calls, each holding its thread
        until it ends (within REMOTE_TIMEOUT_S): a target whose late call
        runs takes no shard (``SamplerTarget.is_up``), so at most a lane's
        shards per slot are late at a time (threads are made only as
        needed)."""
        with self._helpers_lock:  # asked from the event loop and the data-plane thread
            if self.helpers is None:
                slots = sum(target.capacity for target in self.targets)
                remote = sum(target.capacity for target in self.targets
                             if target.probe is not None)
                self.helpers = ThreadPoolExecutor(max(1, self.lanes) * (slots + remote),
                                                  thread_name_prefix="sampler-shard")
            return self.helpers

    @staticmethod
    def _arrays(rows: dict[str, np.ndarray], batch: SamplingBatch,
                scalars: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        # packed: the fewest tensors per request (batch_arrays)
        return {**rows, **(batch_arrays(batch, packed=True) if scalars is None else scalars)}

    def shards(self, rows: int, most: int | None = None) -> list[tuple[SamplerTarget, int, int]]:
        """(target, first row, end row) for every shard of `rows` rows: the
        targets that are up share them in proportion to their capacity (all
        of them, if none is up), one shard per instance: a few rows are not
        worth the fixed cost of one request per instance, so at most `most`
        shards (the largest targets first: the hot-first compact rows' own
        rule) or, without `most`, shards of :meth:`least_rows` rows at least,
        on the capacity slots taken in turn from one call to the next."""
        now = time.monotonic()
        targets = [t for t in self.targets if t.is_up(now)] or self.targets
        if most is not None:
            targets = sorted(targets, key=lambda t: -t.capacity)
        slots = [t for t in targets for _ in range(t.capacity)]
        if most is not None:
            slots = slots[:max(min(rows, most), 1)]
        else:
            count = max(1, rows // self.least_rows())
            if count < len(slots):
                first, self.turn = self.turn % len(slots), self.turn + count
                slots = [slots[(first + i) % len(slots)] for i in range(count)]
        count = len(slots)
        bounds = [rows * i // count for i in range(count + 1)]  # exact, no float
        return [(target, a, b) for target, a, b in zip(slots, bounds[:-1], bounds[1:]) if b > a]

    def least_rows(self) -> int:
        """Full rows per shard at least: `min_rows` with two lanes or more;
        with one, at most ONE_LANE_ROWS_PER_REQUEST (module docstring)."""
        return self.min_rows if self.lanes > 1 else min(self.min_rows, ONE_LANE_ROWS_PER_REQUEST)

    async def _send(self, inputs: dict[str, np.ndarray], target: SamplerTarget,
                    refs: np.ndarray | None = None, histories: np.ndarray | None = None):
        loop = asyncio.get_running_loop()
        deadline, delay = loop.time() + self.deadline_s, RETRY_FIRST_S
        by_reference = _by_reference(inputs, refs) if refs is not None else None
        while True:
            try:
                if target.shares_memory:
                    sent = by_reference or _by_value(inputs, keep_history_ref=True)
                else:
                    sent = _by_value(inputs, histories)
                outputs = await self._call(target, sent)
            except SamplerCallError as error:
                if not error.retryable or loop.time() > deadline:
                    raise
                self._failed(target, error)
                others = self._others_up(target)
                if others:
                    target = max(others, key=lambda t: t.capacity)
                    continue
                if loop.time() + delay > deadline:
                    raise
                await asyncio.sleep(delay)
                delay = min(2 * delay, RETRY_MAX_S)
                # back soonest; of those, not one whose late call still runs
                now = time.monotonic()
                target = min(self.targets, key=lambda t: (max(t.down_until, now), t.abandoned > 0))
                continue
            self._served(target, len(inputs["row_scalars"]))
            return outputs

    async def _call(self, target: SamplerTarget, inputs: dict[str, np.ndarray]):
        """``target``'s answer, called in a thread; raises a late
        SamplerCallError where it has not answered within its ``late_after``
        and another target is up to take the shard (the late call is left
        running on a thread of the pool's, not one the event loop's other
        work waits for; its end is ``_abandoned_end``). With no other target
        up it keeps waiting: a slow answer beats none."""
        late = target.late_after(inputs)
        if late is None:
            return await asyncio.to_thread(target.timed_call, inputs)
        abandoned, sent_at = threading.Event(), time.monotonic()
        running = self._helpers().submit(target.timed_call, inputs, abandoned)
        call = asyncio.wrap_future(running)
        try:
            while not (await asyncio.wait({call}, timeout=late))[0]:
                if self._others_up(target) and not running.done():
                    call.add_done_callback(_retrieved)
                    raise self._give_up(target, running, inputs, sent_at, abandoned, late)
            return await call
        except asyncio.CancelledError:
            call.cancel()
            raise

    def _give_up(self, target: SamplerTarget, running, inputs: dict[str, np.ndarray],
                 sent_at: float, abandoned: threading.Event, late: float) -> SamplerCallError:
        """Give up on a late call (`running`, its concurrent future; sent at
        `sent_at`): not counted when it ends (`abandoned`), never sent if it
        is still queued, its end ``_abandoned_end``; the late error to send
        its shard again with (``SamplerTarget.abandon``: whether it begins a
        late episode, and marks the target down)."""
        message = f"{target.name}: no answer within {late * 1e3:.0f} ms"
        abandoned.set()
        if running.cancel():  # still in the pool's queue: never sent, nothing of the host's
            return SamplerCallError(message, late=True, down=False)
        struck, down = target.abandon(inputs, sent_at)
        running.add_done_callback(functools.partial(self._abandoned_end, target, sent_at))
        return SamplerCallError(message, late=True, struck=struck, down=down)

    def _failed(self, target: SamplerTarget, error: SamplerCallError) -> None:
        """A shard's call failed or was late: its shard is sent again; the
        target is marked down unless it was only late and that did not make
        LATE_STRIKES episodes in a row (logged once an episode)."""
        self.on_retry()
        if error.late and not error.down:
            if error.struck:
                log.info("sampler %s was late (%s); its shards go elsewhere until that call "
                         "ends", target.name, error)
            return
        self._mark_down(target, error)

    def _abandoned_end(self, target: SamplerTarget, sent_at: float, call) -> None:
        """A late call's end (a concurrent future, in the thread that ends
        it): its failure marks the target down, unless it answered in time
        since the call was sent, is down already, or the pool is closed (a
        closed client's error); an error of ours is logged, not lost."""
        outcome = None if call.cancelled() else call.exception() or call.result()
        failed = isinstance(outcome, SamplerCallError) and outcome.retryable
        if target.abandoned_end(sent_at, failed):
            if not self.closed and target.down_until <= time.monotonic():
                self._mark_down(target, outcome)
        elif isinstance(outcome, BaseException) and not isinstance(outcome, SamplerCallError):
            log.error("a late call to sampler %s raised", target.name, exc_info=outcome)

    def _others_up(self, target: SamplerTarget) -> list[SamplerTarget]:
        now = time.monotonic()
        return [t for t in self.targets if t is not target and t.is_up(now)]

    def _served(self, target: SamplerTarget, rows: int) -> None:
        if target.failures:
            log.warning("sampler %s is serving again", target.name)
            target.failures = 0
        target.answered = True  # it served (the path taken when every target was down)
        self.rows_sent[target.name] = self.rows_sent.get(target.name, 0) + rows

    def _mark_down(self, target: SamplerTarget, error: Exception) -> None:
        target.failed(self.probe_after_s)
        log.warning("sampler %s failed (%s); its rows go elsewhere, and it is tried again in "
                    "%.1f s", target.name, error, self.probe_after_s)


def _retrieved(call: asyncio.Future) -> None:
    """An abandoned call's asyncio side: its exception is its concurrent
    future's to report (``_abandoned_end``), not "never retrieved"."""
    if not call.cancelled():
        call.exception()


def _answer(call: SamplerCall, *arguments):
    """A shard's outputs, or the SamplerCallError it failed with."""
    try:
        return call(*arguments)
    except SamplerCallError as error:
        return error


def _by_value(inputs: dict[str, np.ndarray], histories: np.ndarray | None = None,
              keep_history_ref: bool = False) -> dict[str, np.ndarray]:
    """`inputs` as sent in a request: rows that are a strided view (rows of
    a shared region by reference, ``hot_first.rows_in_place``) made
    contiguous, as a BLS tensor must be; unless `keep_history_ref` (a
    target that maps the arena), the ids ``history_ref`` names gathered
    from `histories` (the batch's ``HistoryRef.ids``) into the lists."""
    logits = inputs.get("logits")
    if logits is not None and not logits.flags.c_contiguous:
        inputs = {**inputs, "logits": np.ascontiguousarray(logits)}
    if keep_history_ref or "history_ref" not in inputs:
        return inputs
    if histories is None:
        raise RuntimeError("history_ref came without its batch's histories (SamplingBatch."
                           "history_ref): the lists cannot be sent by value")
    sent = {k: v for k, v in inputs.items() if k != "history_ref"}
    prompt_offsets, prompt_ids, output_offsets, output_ids = HistoryRef(
        inputs["history_ref"], histories).lists()
    sent["prompt_ids"] = padded(prompt_offsets, prompt_ids)
    sent["generated_ids"] = padded(output_offsets, output_ids)
    return sent


def _by_reference(inputs: dict[str, np.ndarray], refs: np.ndarray) -> dict[str, np.ndarray]:
    """`inputs` with the rows named by `refs` (logits_ref) instead of sent."""
    sent = {k: v for k, v in inputs.items() if k != "logits"}
    sent["logits_ref"] = refs
    return sent


def _per_row(parts: list[dict[str, np.ndarray]], rows: int) -> dict[str, np.ndarray]:
    """The [n, 1] outputs of the shards' answers, in order, concatenated to
    [rows]; output_log_probs NaN for a shard none of whose rows asked, and
    for compact rows handoff_outcome 0 for a shard that sent none (every
    row decided: ``sampler_codec.decided_all``). Where a shard answered top
    logprobs, those too, [rows, the widest shard's n]: padded -1 and -inf
    (a shard none of whose rows asked answers none)."""
    nan = np.full((rows, 1), np.nan, np.float32)
    compact = any("handoff_outcome" in part for part in parts)
    for part in parts:
        part.setdefault("output_log_probs", nan[:len(part["output_ids"])])
        if compact:
            part["handoff_outcome"] = outcome_of(part, len(part["output_ids"]))
    merged = {name: np.concatenate([p[name][:, 0] for p in parts]) for name in parts[0]
              if parts[0][name].ndim == 2 and parts[0][name].shape[1] == 1
              and name not in TOP_OUTPUTS}
    width = max((p[TOP_OUTPUTS[0]].shape[1] for p in parts if TOP_OUTPUTS[0] in p), default=0)
    if width:
        for name, (fill, dtype) in zip(TOP_OUTPUTS, TOP_PADDING):
            merged[name] = np.concatenate([
                np.pad(p[name], ((0, 0), (0, width - p[name].shape[1])), constant_values=fill)
                if name in p else np.full((len(p["output_ids"]), width), fill, dtype)
                for p in parts])
    return merged

