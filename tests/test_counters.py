"""BatchedCounters without a server: counts add up in the instance, are sent
at most every interval (from add when due, else from the idle thread), and
all of them arrive, the last ones at close."""
import threading
import time

import pytest

from simple_sampler.triton.counters import BatchedCounters, wait_for_counter


class Metric:
    """pb_utils.Metric's increment, recording each call and when."""

    def __init__(self):
        self.calls, self.threads = [], set()

    def increment(self, value):
        self.calls.append((time.monotonic(), value))
        self.threads.add(threading.current_thread().name)

    @property
    def total(self):
        return sum(value for _, value in self.calls)


def poll(condition, timeout_s=30.0):
    """Waits for `condition`: a bound only a lost count reaches, however
    loaded the machine."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "not within the bounded wait"
        time.sleep(0.01)


def test_counts_of_many_requests_go_in_few_sends_and_all_arrive():
    rows, failed = Metric(), Metric()
    counters = BatchedCounters({"rows": rows, "failed": failed}, interval_s=0.2)
    try:
        started = time.monotonic()
        for request in range(200):  # 200 requests over ~0.4 s
            counters.add({"rows": 3, "failed": request % 2})
            time.sleep(0.002)
        poll(lambda: rows.total == 600 and failed.total == 100)
    finally:
        counters.close()
    assert rows.total == 600 and failed.total == 100
    assert len(rows.calls) <= (time.monotonic() - started) / 0.2 + 2, rows.calls
    sent_at = [at for at, _ in rows.calls]
    assert all(b - a >= 0.19 for a, b in zip(sent_at, sent_at[1:])), "at most every interval"


def test_an_idle_instance_sends_from_its_thread_and_zeros_are_not_sent():
    rows, failed = Metric(), Metric()
    counters = BatchedCounters({"rows": rows, "failed": failed}, interval_s=0.2)
    try:
        counters.add({"rows": 5, "failed": 0})  # the last request before going idle
        assert rows.calls == []  # not on the request path
        poll(lambda: rows.total == 5)
        assert rows.threads == {"counters"} and failed.calls == []
    finally:
        counters.close()


def test_close_sends_what_is_pending():
    rows = Metric()
    counters = BatchedCounters({"rows": rows}, interval_s=60.0)
    counters.add({"rows": 7})
    counters.add({"rows": 1})
    assert rows.calls == []
    counters.close()
    assert rows.total == 8 and len(rows.calls) == 1 and not counters.thread.is_alive()


def test_a_send_that_fails_in_the_thread_keeps_its_counts_for_the_next():
    class Failing(Metric):
        def increment(self, value):
            if not self.calls:
                self.calls.append((time.monotonic(), 0))
                raise RuntimeError("the server is going away")
            super().increment(value)

    rows = Failing()
    counters = BatchedCounters({"rows": rows}, interval_s=0.05)
    counters.add({"rows": 2})
    poll(lambda: rows.calls)
    counters.add({"rows": 3})
    counters.close()
    assert rows.total == 5


def test_wait_for_counter_polls_and_times_out(monkeypatch):
    from simple_sampler.triton import counters as module

    values = iter([1.0, 2.0, 4.0])
    monkeypatch.setattr(module, "read_counter", lambda *args: next(values))
    assert wait_for_counter("url", "x_total", lambda v: v >= 3) == 4.0
    monkeypatch.setattr(module, "read_counter", lambda *args: 1.0)
    with pytest.raises(TimeoutError, match=r"x_total\{\} is 1.0 after 0.1 s"):
        wait_for_counter("url", "x_total", lambda v: v >= 3, timeout_s=0.1)
