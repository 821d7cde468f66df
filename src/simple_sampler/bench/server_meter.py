"""What a running server's processes and counters say around a benchmark's
window: CPU seconds and voluntary context switches per process from /proc
(the server, each stub, the client), and the llm and sampler models' own
counters from Triton's metrics. Shared by the served benches
(``serve_cost``, ``serve_gpu_served``, ``row_transport``)."""
from __future__ import annotations

import os
import re
import time
import urllib.request

CLK_TCK = os.sysconf("SC_CLK_TCK")


def process_clock_id(pid: int) -> int:
    """The clock id of another process's CPU time (all its threads, those
    ended included), as glibc's ``clock_getcpuclockid`` makes it (the
    kernel's ``MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)``): nanoseconds
    where /proc/<pid>/stat counts in clock ticks (10 ms), which a short
    window of a few milliseconds' sampling reads as nothing at all."""
    return ((~pid) << 3) | 2


def process_stat(pid: int) -> tuple[float, int]:
    """(CPU seconds, minor page faults) of one process (all its threads)."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        fields = stat.read().rsplit(b")", 1)[1].split()
    try:
        seconds = time.clock_gettime_ns(process_clock_id(pid)) / 1e9
    except OSError:  # no such clock here: utime + stime, in ticks
        seconds = (int(fields[11]) + int(fields[12])) / CLK_TCK
    return seconds, int(fields[7])


def process_cpu_s(pid: int) -> float:
    """CPU seconds of one process (all its threads)."""
    return process_stat(pid)[0]


def server_processes(server_pid: int) -> dict[str, int]:
    """Name -> pid of the server and each stub (by model and instance)."""
    from ..launch.processes import list_stubs

    processes = {"tritonserver": server_pid}
    for stub in list_stubs(server_pid):
        name = stub.model if stub.model != "simple_sampler" else stub.instance
        processes[name] = stub.pid
    return processes


def context_switches(pid: int) -> int:
    """Voluntary context switches of all the process's threads so far: each
    time a thread went to sleep waiting (for a message, a lock), to be woken
    again. A count of the process's own waits: unlike CPU time and
    preemptions (involuntary switches, not counted) it barely moves with the
    machine's load, so what a cut of wake-ups buys shows here first."""
    switches = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/status", "rb") as status:
                for line in status:
                    if line.startswith(b"voluntary_ctxt_switches:"):
                        switches += int(line.split()[1])
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile
            continue
    return switches


class Meter:
    """CPU seconds and context switches of the named processes, read at two marks."""

    def __init__(self, processes: dict[str, int]):
        self.processes = {**processes, "client": os.getpid()}
        self.marks: list[tuple[float, int, dict[str, float], dict[str, int]]] = []

    def mark(self, tokens: int) -> None:
        """Now, with `tokens` received so far."""
        self.marks.append((time.perf_counter(), tokens,
                           {name: process_cpu_s(pid) for name, pid in self.processes.items()},
                           {name: context_switches(pid)
                            for name, pid in self.processes.items()}))

    def window(self) -> tuple[float, int, dict[str, float], dict[str, int]]:
        """Seconds, tokens, CPU seconds and context switches per process
        between the first and last marks."""
        (t0, tokens0, cpu0, cs0), (t1, tokens1, cpu1, cs1) = self.marks[0], self.marks[-1]
        return (t1 - t0, tokens1 - tokens0, {name: cpu1[name] - cpu0[name] for name in cpu0},
                {name: cs1[name] - cs0[name] for name in cs0})


#: The llm model's counters (``simple_llm_<name>_total``) read around a level.
LLM_COUNTERS = ("loop_us", "steps", "data_plane_us", "sampler_us", "forward_wait_us",
                "gc_pause_us")


def llm_counters(server, names: tuple[str, ...] = LLM_COUNTERS) -> dict[str, float]:
    """The llm model's counters `names` once nothing is in flight (the model
    reports its counters when its last request ends)."""
    deadline = time.monotonic() + 10
    while server.in_flight() > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    text = urllib.request.urlopen(server.metrics_url).read().decode()
    return {name: sum(float(v) for v in re.findall(
        rf"^simple_llm_{name}_total\{{[^}}]*\}} (\S+)", text, re.M)) for name in names}


def sampler_counters(server) -> dict[str, float]:
    """Triton's count of the sampler model's requests, and the CPU its
    instances spent in ``execute`` (``simple_sampler_execute_cpu_us_total``),
    once every count made so far has arrived (the instances send theirs in
    batches: ``triton.counters``)."""
    from ..triton.counters import read_counter, wait_for_counter

    return {"execute_cpu_us": wait_for_counter(
                server.metrics_url, "simple_sampler_execute_cpu_us_total", lambda _: True,
                settled_after=time.monotonic()),
            "requests": read_counter(server.metrics_url, "nv_inference_request_success",
                                     'model="simple_sampler"')}
