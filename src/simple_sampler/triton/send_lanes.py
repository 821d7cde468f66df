"""A step's built responses sent over several threads (the llm model's
``send_threads``), each request's on one thread and in order.

A response's send is a round trip to the server process: python_backend's
``ResponseSender::Send`` (src/response_sender.cc) releases the GIL, writes
the response into shared memory, posts it and waits until a thread of
tritonserver has taken it. Sent one after the other from the decode loop, a
step of B streams waits B round trips, while that step's forward may be
long done. With several threads the waits overlap, and tritonserver's
thread pool takes the responses in parallel; each thread's own share (the
shared-memory write, the wake-ups) still needs a core (measured on 2 cores:
docs/results/send-threads-2026-12-02.md)."""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Hashable, Sequence, TypeVar

log = logging.getLogger(__name__)
Owner = TypeVar("Owner")
#: (who the response is for, the transmit that sends it, whether it is the request's final one)
Item = tuple[Owner, Callable[[], None], bool]


class SendLanes:
    """Sends a burst of built responses on ``threads`` threads, the caller's
    own the first, and returns once every one has gone or failed.

    ``request_of(owner)``: a key shared by every response of one Triton
    request (its generations share the request's response sender), so that
    they go on one thread, in the burst's order: a stream's responses must
    reach Triton in order, and its final flag last. Requests are dealt to
    the threads in turn by their first response in the burst. Each of the
    other threads has its own queue (a shared pool's idle thread could take
    a second lane before another woke, and send the two one after the other)."""

    def __init__(self, threads: int, request_of: Callable[[Owner], Hashable]):
        if threads < 1:
            raise ValueError(f"send_threads must be at least 1, got {threads}")
        self.threads, self.request_of = threads, request_of
        self.closed = False
        self.inboxes: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(threads - 1)]
        self.answers: queue.SimpleQueue = queue.SimpleQueue()
        # daemons: a send that never returns (a server gone) must not hold the process's exit
        self.workers = [threading.Thread(target=self._work, args=(inbox,), daemon=True,
                                         name=f"llm-send-{index}")
                        for index, inbox in enumerate(self.inboxes, start=1)]
        for worker in self.workers:
            worker.start()

    def send(self, burst: Sequence[Item]) -> tuple[list[tuple[Owner, bool]], float]:
        """Every transmit of ``burst`` called once. Returns the (owner,
        final) of those that raised, in the burst's order within each
        thread, for the caller to handle on its own thread, and the CPU
        seconds the other threads spent on them (the caller's own are on
        its clock). After ``close``, the caller's thread sends them all."""
        if self.closed or not self.inboxes or len(burst) < 2:
            return _transmit(burst), 0.0
        lanes: list[list[Item]] = [[] for _ in range(self.threads)]
        lane_of: dict[Hashable, int] = {}
        for item in burst:
            key = self.request_of(item[0])
            lanes[lane_of.setdefault(key, len(lane_of) % self.threads)].append(item)
        posted = 0
        try:
            for inbox, lane in zip(self.inboxes, lanes[1:]):
                if lane:
                    inbox.put(lane)
                    posted += 1
            failed = _transmit(lanes[0])
        finally:  # every posted lane answered before the next burst, whatever lane 0 raised
            answers = [self.answers.get() for _ in range(posted)]
        cpu_s = 0.0
        for lane_failed, lane_cpu_s in answers:
            failed += lane_failed
            cpu_s += lane_cpu_s
        return failed, cpu_s

    def _work(self, inbox: queue.SimpleQueue) -> None:
        while (lane := inbox.get()) is not None:
            started = time.thread_time()
            try:
                failed = _transmit(lane)
            except BaseException:  # noqa: BLE001 - the lane must be answered, the thread kept
                log.exception("a send thread's lane failed: its requests are ended")
                failed = [(owner, final) for owner, _, final in lane]
            self.answers.put((failed, time.thread_time() - started))
            del lane, failed  # a request's objects not held until the next burst

    def close(self, wait: bool = True) -> None:
        """The threads stopped (later bursts go out on the caller's thread);
        ``wait``: joined (none is sending once ``send`` has returned; a
        caller still inside it passes False)."""
        self.closed = True
        for inbox in self.inboxes:
            inbox.put(None)
        if wait:
            for worker in self.workers:
                worker.join()


def _transmit(lane: Sequence[Item]) -> list[tuple[Owner, bool]]:
    failed = []
    for owner, transmit, final in lane:
        try:
            transmit()
        except Exception:  # noqa: BLE001 - the client has gone: the caller's to handle
            failed.append((owner, final))
    return failed
