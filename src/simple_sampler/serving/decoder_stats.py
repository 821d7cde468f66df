"""What the decode loop measures (``Decoder.stats``): cumulative timings, the
last steps' records, and the overlap of forwards and samplers they come from
(docs/DECODE_LOOP.md)."""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

TIMING_RECORDS = 4096  # per-step records kept (the oldest are dropped)


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

    def record(self, rows: int, data_plane_s: float, sampler_s: float, loop_s: float) -> None:
        """Count one step of ``rows`` rows and keep its record."""
        self.steps += 1
        self.tokens += rows
        self.data_plane_s += data_plane_s
        self.sampler_s += sampler_s
        self.loop_s += loop_s
        self.records.append(StepRecord(rows, data_plane_s, sampler_s, loop_s))


class Activity:
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
