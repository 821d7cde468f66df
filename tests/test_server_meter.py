"""The served benches' CPU reading of other processes (bench/server_meter)."""
import os
import subprocess
import sys
import time

from simple_sampler.bench.server_meter import process_stat

SPIN = """
import sys, threading, time
def spin(seconds):
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
thread = threading.Thread(target=spin, args=(0.003,))
thread.start(); thread.join()  # an ended thread's CPU still counts
print("spun", flush=True)
sys.stdin.readline()
"""


def test_a_few_milliseconds_of_another_process_read_as_more_than_nothing():
    """/proc/<pid>/stat counts 10 ms ticks, where 3 ms would read 0 or 10; the
    process's CPU clock sees the 3 ms of a thread that has already ended."""
    child = subprocess.Popen([sys.executable, "-c", "import sys, threading, time\n"
                              "print('started', flush=True); sys.stdin.readline()\n" + SPIN],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "started"  # its start-up's CPU before the reading
        before, _ = process_stat(child.pid)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "spun"
        after, faults = process_stat(child.pid)
        spent = after - before  # the spin, a thread's start and a print
        # ticks would read 0 or a whole number of 10 ms; under load (CI's
        # two cores shared by two test workers) the rest may take more than
        # the spin itself, so the bound is loose and the tick check exact
        assert 0.003 <= spent < 0.05, spent
        assert abs(spent * 100 - round(spent * 100)) > 1e-6, f"{spent} s: whole 10 ms ticks"
        assert faults > 0
    finally:
        child.stdin.close()
        child.wait(timeout=10)


def test_where_the_clock_is_refused_the_ticks_are_read(monkeypatch):
    from simple_sampler.bench import server_meter

    def refused(clock_id):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(server_meter.time, "clock_gettime_ns", refused)
    end = time.thread_time() + 0.05
    while time.thread_time() < end:  # half a dozen ticks of this process's own CPU
        pass
    seconds, _ = process_stat(os.getpid())
    ticks = seconds * server_meter.CLK_TCK
    assert seconds >= 0.05 and abs(ticks - round(ticks)) < 1e-6  # whole ticks
