"""A Python backend model's counters, sent in batches off the request path,
and read back from the metrics port.

Every ``pb_utils.Metric.increment`` is a blocking round trip to the backend
process (python_backend src/metric.cc, ``Metric::SendIncrementRequest``: the
stub writes the value to shared memory and waits for the parent to apply
it), so a model that increments five counters per ``execute`` pays five
round trips per request. ``BatchedCounters`` adds the counts up in the
instance and sends them at most every REPORT_INTERVAL_S (the llm model's
reporting interval too), from ``execute`` when a send is due, else from a
small thread once the instance went idle, and at ``close``: every count
arrives, at most about REPORT_INTERVAL_S late. (A send from that thread is
safe: the parent applies metric messages on its own thread,
python_backend src/python_be.cc ``StubToParentMQMonitor``, not the one
running ``execute`` or ``finalize``; pybind keeps the GIL while it waits.) A reader of the metrics port
therefore polls until the value it expects (``wait_for_counter``).
"""
from __future__ import annotations

import logging
import re
import threading
import time
import urllib.request
from typing import Callable, Mapping

log = logging.getLogger(__name__)

#: The longest a count waits in the instance before it is sent.
REPORT_INTERVAL_S = 0.5


class BatchedCounters:
    """Counts by name, sent to `metrics` (name -> an object with
    ``increment(value)``, a ``pb_utils.Metric``) in batches (module docstring)."""

    def __init__(self, metrics: Mapping[str, object], interval_s: float = REPORT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic):
        self.metrics = dict(metrics)
        self.interval_s, self.clock = interval_s, clock
        self.pending = dict.fromkeys(self.metrics, 0)
        self.sent_at = clock()
        self.lock = threading.Lock()  # pending and sent_at
        # One sender at a time: SendIncrementRequest rewrites the Metric's
        # own shared-memory record before it sends it.
        self.send_lock = threading.Lock()
        self.has_pending = threading.Event()
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._send_when_idle, name="counters", daemon=True)
        self.thread.start()

    def add(self, counts: Mapping[str, int]) -> None:
        """Add `counts` (name -> value; zeros are fine); sends everything
        pending when the last send is REPORT_INTERVAL_S old."""
        with self.lock:
            for name, value in counts.items():
                self.pending[name] += value
            due = self.clock() - self.sent_at >= self.interval_s
        self.has_pending.set()
        if due:
            self.send(force=False)

    def send(self, force: bool = True) -> None:
        """Send what is pending (unless `force` is False and the last send
        is younger than the interval); no round trip for a zero."""
        with self.send_lock:
            with self.lock:
                if not force and self.clock() - self.sent_at < self.interval_s:
                    return
                counts = {name: value for name, value in self.pending.items() if value}
                self.pending = dict.fromkeys(self.metrics, 0)
                self.sent_at = self.clock()
                self.has_pending.clear()
            for name, value in counts.items():
                try:
                    self.metrics[name].increment(value)
                except Exception:
                    with self.lock:  # the unsent counts wait for the next send
                        for unsent, left in counts.items():
                            self.pending[unsent] += left
                        self.has_pending.set()
                    raise
                counts[name] = 0

    def _send_when_idle(self) -> None:
        while True:
            self.has_pending.wait()
            with self.lock:
                wait_s = self.sent_at + self.interval_s - self.clock()
            if self.closed.wait(max(0.0, wait_s)):
                return
            try:
                self.send(force=False)
            except Exception:  # noqa: BLE001 - a server shutting down: close() sends the rest
                log.exception("sending the counters failed")
                self.closed.wait(self.interval_s)

    def close(self) -> None:
        """Stop the thread and send what is pending (the model's finalize)."""
        self.closed.set()
        self.has_pending.set()
        self.thread.join()
        self.send()


def read_counter(metrics_url: str, name: str, labels: str = "") -> float:
    """The sum of every series of counter `name` on a Prometheus metrics
    port whose labels match the regular expression `labels` (anywhere
    between the braces)."""
    with urllib.request.urlopen(metrics_url) as response:
        text = response.read().decode()
    pattern = rf"^{name}\{{(?=[^}}]*{labels})[^}}]*\}} (\S+)"
    return sum(float(value) for value in re.findall(pattern, text, re.M))


def wait_for_counter(metrics_url: str, name: str, done: Callable[[float], bool],
                     labels: str = "", timeout_s: float = 10 * REPORT_INTERVAL_S,
                     settled_after: float | None = None) -> float:
    """Poll counter `name` (``read_counter``) until ``done(value)``; returns
    the value. settled_after: a ``time.monotonic()`` after which nothing
    more is counted (the load ended): polling also goes on until
    REPORT_INTERVAL_S past it, when every instance has sent all it counted,
    for a caller that knows only a lower bound. Raises TimeoutError with the
    last value after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    settled = -1.0 if settled_after is None else settled_after + 2 * REPORT_INTERVAL_S
    while True:
        read_at = time.monotonic()
        value = read_counter(metrics_url, name, labels)
        if done(value) and read_at >= settled:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name}{{{labels}}} is {value} after {timeout_s} s")
        time.sleep(REPORT_INTERVAL_S / 10)
