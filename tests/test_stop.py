"""`serve` stopped at any moment leaves nothing behind: a SIGINT or SIGTERM
before Triton starts, while its models load and the front door prepares,
right after Triton is ready, or once every port answers ends in the same
clean stop; a launcher killed without warning (SIGKILL) takes its server
with it (launch/lifeline.py). Each case asserts, within a bound: no process
holding the run's model repository, no lifeline watcher, no shared-memory
region of the run's stubs, every port free, neither the repository serve
assembled nor the server's backend copy left in /tmp.

The server is the simulated engine's (no model weights to load: the
cheapest whole repository with the OpenAI front door), one sampler
instance. Only processes these tests started are signalled."""
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import slow_tritonserver

from simple_sampler.launch.processes import SHM_DIRECTORY, list_stubs, held_regions
from simple_sampler.pids import alive
from simple_sampler.launch.ports import free_ports, port_in_use
from simple_sampler.launch.server import TritonServer
from simple_sampler.launch.supervisor import arena_prefix

#: How long after the signal everything must be gone (the issue's bound for
#: a killed launcher; a clean stop of an idle server takes about 5 s).
GONE_WITHIN_S = 15.0
#: A stop while serving: the drain (nothing in flight) and Triton's exit,
#: within its exit timeout; slower on a loaded 2-core machine.
SERVING_STOP_S = 30.0


class ServeRun:
    """`simple-sampler serve` on free loopback ports with the OpenAI port,
    its output read as it comes, the stubs of its server recorded as they
    appear (their regions are what a stop must remove)."""

    def __init__(self, tmp_path):
        self.ports = dict(zip(("http", "grpc", "metrics", "openai"), free_ports(4)))
        self.started_at = time.monotonic()
        # serve starts with SIGINT at its default, as from a terminal. A test
        # run that ignores SIGINT (a background job of a non-interactive
        # shell, as CI runners and `cmd &` start it) would pass SIG_IGN on
        # through exec, and Python then installs no SIGINT handler of its
        # own: a SIGINT before console.py's first line would be dropped by
        # the kernel (seen: the signal at 0.1 s lost, serve started and ran).
        # A Python-level handler is reset to SIG_DFL at exec.
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            self.process = subprocess.Popen(
                [str(Path(sys.executable).parent / "simple-sampler"), "serve", "--engine",
                 "simulated", "--instances", "1", "--shutdown-grace", "5", "--openai-host",
                 "127.0.0.1", "--log", str(tmp_path / "tritonserver.log"),
                 *(arg for name, port in self.ports.items()
                   for arg in (f"--{name}-port", str(port)))],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        finally:
            signal.signal(signal.SIGINT, previous)
        self.lines: list[str] = []
        self.server_pid = self.lifeline_pid = self.repository = self.backends = None
        self.stubs = {}
        self.held: set[str] = set()  # backend regions the server was seen to map or hold open
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._watch, daemon=True).start()

    def _read(self):
        for line in self.process.stdout:
            self.lines.append(line)
            if match := re.search(r"model repository (\S+): ", line):
                self.repository = match[1]
            if match := re.search(r"tritonserver started \(pid (\d+).*lifeline pid (\d+)", line):
                self.server_pid, self.lifeline_pid = int(match[1]), int(match[2])

    def _watch(self):
        while self.process.poll() is None:
            if self.server_pid is not None:
                if self.backends is None:
                    self.backends = _backend_directory(self.server_pid)
                self.stubs.update((stub.pid, stub) for stub in list_stubs(self.server_pid))
                # Triton maps a stub's region before the stub starts: one
                # stopped in that moment leaves a region no stub names.
                self.held.update(held_regions(self.server_pid))
            time.sleep(0.05)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.output:
            assert self.process.poll() is None, f"serve exited before {text!r}:\n{self.output}"
            assert time.monotonic() < deadline, f"no {text!r} in {timeout_s} s:\n{self.output}"
            time.sleep(0.02)

    def signal(self, number: int) -> float:
        self.process.send_signal(number)
        return time.monotonic()

    def leftovers(self) -> dict:
        """What the run left: processes holding its repository (tritonserver,
        the stubs) or its lifeline watcher, its stubs' regions and row
        arenas, its ports still taken."""
        held = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or not alive(int(entry.name)):
                continue
            try:
                argv = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if (self.repository and self.repository in argv) or int(entry.name) == self.lifeline_pid:
                held.append(int(entry.name))
        arenas = tuple(f"{arena_prefix()}{pid}-" for pid in self.stubs)
        regions = sorted(name for name in {stub.shm_region for stub in self.stubs.values()}
                         | self.held if (SHM_DIRECTORY / name).exists())
        regions += [name for name in os.listdir(SHM_DIRECTORY) if arenas and name.startswith(arenas)]
        ports = [port for port in self.ports.values() if port_in_use(port)]
        # the temporary repository serve assembled, and the server's backend copy
        folders = [folder for folder in (self.repository, self.backends)
                   if folder and Path(folder).exists()]
        return {key: value for key, value in
                dict(processes=held, regions=regions, ports=ports, folders=folders).items()
                if value}

    def gone_within(self, signalled_at: float, bound_s: float = GONE_WITHIN_S) -> float:
        """Seconds from the signal until nothing is left; fails past `bound_s`."""
        while (left := self.leftovers()) and time.monotonic() - signalled_at < bound_s:
            time.sleep(0.1)
        assert not left, f"left after {bound_s} s: {left}\n{self.output}"
        return time.monotonic() - signalled_at

    def stopped(self, signalled_at: float, timeout_s: float) -> tuple[int, float]:
        """(exit status, seconds from the signal)."""
        try:
            status = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"serve still running {timeout_s} s after the signal:\n{self.output}")
        return status, time.monotonic() - signalled_at

    def sigint_stops_cleanly(self, said: str) -> str:
        """SIGINT while serving: exit 0 within SERVING_STOP_S, `said` in the
        output, then nothing left; the times, for the test's line."""
        signalled = self.signal(signal.SIGINT)
        status, stop_s = self.stopped(signalled, SERVING_STOP_S)
        assert status == 0 and said in self.output, self.output
        return f"exit 0 in {stop_s:.1f} s, gone in {self.gone_within(signalled):.1f} s"

    def close(self):
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def _backend_directory(server_pid: int) -> str | None:
    """The backend copy tritonserver runs from (its --backend-directory)."""
    try:
        argv = Path(f"/proc/{server_pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return None
    return next((arg.split("=", 1)[1] for arg in argv
                 if arg.startswith("--backend-directory=")), None)


@pytest.fixture
def serve_run(tmp_path):
    run = ServeRun(tmp_path)
    try:
        yield run
    finally:
        run.close()


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


@pytest.mark.slow
def test_sigint_at_one_second_leaves_nothing(serve_run):
    """Within its first second `serve` is still importing (the command's entry
    notes the signal and exits 128 + SIGINT before anything starts) or starting
    (serve.run's handler: a clean stop, status 0). Either way it stops."""
    time.sleep(max(0.0, serve_run.started_at + 1.0 - time.monotonic()))
    signalled = serve_run.signal(signal.SIGINT)
    status, _ = serve_run.stopped(signalled, GONE_WITHIN_S)
    assert status in (0, 128 + signal.SIGINT), serve_run.output
    serve_run.gone_within(signalled)


@pytest.mark.slow
def test_a_signal_during_the_imports_is_not_lost(serve_run):
    """At 0.1 s Python is importing: the signal is noted, not swallowed by an
    import's except clause, and the command ends without starting a server."""
    time.sleep(max(0.0, serve_run.started_at + 0.1 - time.monotonic()))
    signalled = serve_run.signal(signal.SIGINT)
    status, _ = serve_run.stopped(signalled, GONE_WITHIN_S)
    assert status in (0, 128 + signal.SIGINT), serve_run.output
    assert "tritonserver ready" not in serve_run.output
    serve_run.gone_within(signalled)


@pytest.mark.slow
def test_sigterm_while_the_models_load_and_the_front_door_prepares(serve_run):
    """The front door's tokenizer and web stack load in a thread while
    Triton loads its models: a SIGTERM then stops both, status 0."""
    serve_run.wait_for("tritonserver started")
    signalled = serve_run.signal(signal.SIGTERM)
    status, stop_s = serve_run.stopped(signalled, GONE_WITHIN_S)
    assert status == 0, serve_run.output
    assert "openai frontend ready" not in serve_run.output
    assert "stopping before it was ready" in serve_run.output
    print(f"SIGTERM while loading: exit 0 in {stop_s:.1f} s, "
          f"gone in {serve_run.gone_within(signalled):.1f} s")


@pytest.mark.slow
def test_sigint_right_after_triton_is_ready_while_the_front_door_starts(serve_run):
    serve_run.wait_for("tritonserver ready")
    print("SIGINT right after Triton's ready:",
          serve_run.sigint_stops_cleanly("simple-sampler serve: stopped"))


@pytest.mark.slow
def test_ready_means_every_port_answers_and_sigint_then_leaves_nothing(serve_run):
    serve_run.wait_for("openai frontend ready on")
    ports = serve_run.ports
    # "ready" is printed once: each endpoint answers at that moment
    assert answers(f"http://127.0.0.1:{ports['http']}/v2/health/ready")
    assert answers(f"http://127.0.0.1:{ports['openai']}/health")
    assert answers(f"http://127.0.0.1:{ports['metrics']}/metrics")
    socket.create_connection(("127.0.0.1", ports["grpc"]), timeout=5).close()
    assert serve_run.output.count("Triton is ready") == 1
    assert len(serve_run.stubs) >= 3  # preprocessing, llm, the sampler
    assert serve_run.repository and serve_run.backends  # the folders gone_within checks
    print("SIGINT while serving:", serve_run.sigint_stops_cleanly(""))


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llm", "ensemble"])
def test_a_client_keeping_its_grpc_stream_open_does_not_hold_the_stop(serve_run, model):
    """A tritonclient.grpc client that keeps its stream open after its last
    response (as one reusing it does) holds the request's model in Triton
    2.51: llm is never finalized, the ensemble never unloads, and Triton
    waits out its exit timeout and exits 1. serve ends what only such a
    client holds once nothing is in flight and nothing else unloads
    (launch/processes.StubsUnloading): status 0, nothing left."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    serve_run.wait_for("openai frontend ready on")
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{serve_run.ports['grpc']}")
    finals = []
    client.start_stream(callback=lambda result, error: finals.append(
        error or result.as_numpy("finish_reason")))
    inputs = []
    for name, value in (("text_input", np.array([[b"Tell me a story."]], object)),
                        ("max_tokens", np.array([[4]], np.int32)),
                        ("stream", np.array([[True]]))):
        inputs.append(grpcclient.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype)))
        inputs[-1].set_data_from_numpy(value)
    try:
        client.async_stream_infer(model, inputs)
        deadline = time.monotonic() + 60
        while not any(isinstance(final, np.ndarray) and final.size for final in finals):
            assert time.monotonic() < deadline and not any(
                isinstance(final, Exception) for final in finals), finals
            time.sleep(0.02)
        print(f"{model}: a stream left open, SIGINT:", serve_run.sigint_stops_cleanly(
            "a client keeping its gRPC stream open after it"))
    finally:
        client.close()


def test_a_restart_that_cannot_launch_leaves_no_backend_copy(tmp_path, monkeypatch):
    """The supervisor's kill then ``start_again``, whose tritonserver cannot
    be executed: the start raises, and neither it nor the stop after it
    leaves the backend copy it made."""
    monkeypatch.setenv("READY_AFTER_S", "0")
    server = TritonServer(tmp_path / "repository", install=slow_tritonserver.install(tmp_path))
    server.start(timeout=60)
    server.kill()
    monkeypatch.setattr(server, "command", lambda backends: [str(tmp_path / "no-such-binary")])
    with pytest.raises(OSError):
        server.start_again()
    assert not server._workdir.exists()
    server.stop()
    assert server.watcher.wait(5) is not None


def test_what_only_clients_hold_is_settled_before_tritons_exit_timeout(monkeypatch, tmp_path):
    """``StubsUnloading.settled``: with a stub still loaded, once no stub
    has unloaded for held_s; with every stub gone (an ensemble left, which
    has no work of its own), just before Triton's exit timeout at the
    latest: held_s more outlasted it where the stubs were slow to unload.
    Not sooner: Triton takes a moment to exit after its last stub."""
    from types import SimpleNamespace

    from simple_sampler.launch import processes

    clock = [100.0]
    monkeypatch.setattr(processes.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(processes, "SHM_DIRECTORY", tmp_path)
    live = {1, 2}
    monkeypatch.setattr(processes, "alive", lambda pid: pid in live)
    stubs = [SimpleNamespace(pid=pid, shm_region=f"region-{pid}", model=f"m{pid}") for pid in (1, 2)]
    unloading = processes.StubsUnloading(stubs, held_s=8.0, exit_timeout_s=15.0)
    assert not unloading.settled()  # nothing unloaded yet: Triton has not begun
    live.discard(1)
    assert not unloading.settled()  # m1 gone: quiet from here
    clock[0] = 107.9
    assert not unloading.settled() and unloading.loaded() == ["m2"]
    clock[0] = 108.1
    assert unloading.settled()  # m2 held: quiet for held_s
    clock[0] = 108.6
    live.discard(2)  # every stub gone
    assert not unloading.settled()
    timeout_at = 100.0 + 15.0 - processes.ALL_GONE_MARGIN_S
    clock[0] = timeout_at - 0.1
    assert not unloading.settled()  # Triton may still exit by itself
    clock[0] = timeout_at
    assert unloading.settled() and unloading.loaded() == []  # before its exit timeout


@pytest.mark.slow
def test_a_killed_launcher_takes_its_server_with_it(serve_run):
    serve_run.wait_for("tritonserver ready")
    assert serve_run.stubs and serve_run.repository and serve_run.backends  # gone_within's folders
    signalled = serve_run.signal(signal.SIGKILL)
    assert serve_run.stopped(signalled, 5)[0] == -signal.SIGKILL
    gone_s = serve_run.gone_within(signalled)
    assert "the launcher of tritonserver" in Path(
        re.search(r"log (\S+), lifeline", serve_run.output)[1]).read_text()
    print(f"launcher SIGKILLed: tritonserver, {len(serve_run.stubs)} stubs and their regions "
          f"gone in {gone_s:.1f} s")


LAUNCHER = """
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[2])
import slow_tritonserver
from simple_sampler.launch.server import TritonServer
server = TritonServer(Path(sys.argv[1]) / "repository", install=slow_tritonserver.install(Path(sys.argv[1])))
server.start(timeout=60)
print(server.process.pid, server.watcher.pid, flush=True)
time.sleep(600)
"""


def test_a_killed_fixture_or_bench_process_takes_its_server_with_it(tmp_path):
    """Every TritonServer has its lifeline, whoever starts it: a test run
    or a bench killed without warning leaves no server behind (a stand-in
    tritonserver here, tests/slow_tritonserver.py: no model to load)."""
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tmp_path), str(Path(__file__).parent)],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "READY_AFTER_S": "0"})
    try:
        server_pid, watcher_pid = map(int, launcher.stdout.readline().split())
        launcher.kill()
        killed_at = time.monotonic()
        launcher.wait()
        while (alive(server_pid) or alive(watcher_pid)) and time.monotonic() - killed_at < 15:
            time.sleep(0.05)
        assert not alive(server_pid) and not alive(watcher_pid)
    finally:
        launcher.kill()
        launcher.wait()


def test_a_stopped_server_releases_its_lifeline(tmp_path, monkeypatch):
    monkeypatch.setenv("READY_AFTER_S", "0")
    server = TritonServer(tmp_path / "repository", install=slow_tritonserver.install(tmp_path))
    server.start(timeout=60)
    watcher = server.watcher
    assert alive(watcher.pid)
    server.stop()
    assert watcher.poll() is not None and not alive(server.process.pid)


def test_stubs_settle_once_some_unloaded_and_none_moved_for_a_while():
    """StubsUnloading: settled only after a stub has unloaded (exited, its
    region gone) and no other has since for held_s; a stub unloading later
    starts the wait again."""
    from types import SimpleNamespace

    from simple_sampler.launch.processes import StubsUnloading

    sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    stubs = [SimpleNamespace(pid=p.pid, model=f"m{i}", shm_region=f"no-such-region-{p.pid}")
             for i, p in enumerate(sleepers)]
    try:
        unloading = StubsUnloading(stubs, held_s=0.3)
        time.sleep(0.4)
        assert not unloading.settled()  # none unloaded: Triton has not begun
        sleepers[0].kill()
        sleepers[0].wait()
        assert not unloading.settled() and unloading.loaded() == ["m1"]
        time.sleep(0.4)
        assert unloading.settled()
        sleepers[1].kill()
        sleepers[1].wait()
        assert not unloading.settled() and unloading.loaded() == []
        time.sleep(0.4)
        assert unloading.settled()
    finally:
        for sleeper in sleepers:
            if sleeper.poll() is None:
                sleeper.kill()
                sleeper.wait()


@pytest.mark.parametrize("released", [False, True])
def test_the_lifeline_removes_the_servers_folders_only_when_its_launcher_died(tmp_path, released):
    """The lifeline ends what is left of the server's group either way, but
    removes the backend copy and the temporary repository only when the
    launcher did not end the server itself: after a supervisor's kill
    (released), the restarted server runs from the same repository."""
    from simple_sampler.launch import lifeline
    from simple_sampler.launch.server import RELEASED

    folders = [tmp_path / "backends", tmp_path / "repository"]
    for folder in folders:
        folder.mkdir()
    # a server's straggler: a process of a group of its own, as tritonserver's
    group = subprocess.Popen(["sleep", "60"], start_new_session=True)
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, f"{group.pid}\n{folders[0]}\n{folders[1]}\n".encode()
                 + (RELEASED if released else b""))
        os.close(write_end)
        assert lifeline.main(["lifeline.py", str(read_end), "no-arena-"]) == 0
        assert group.wait(5) == -signal.SIGKILL
        assert [folder.exists() for folder in folders] == [released, released]
    finally:
        os.close(read_end)
        if group.poll() is None:
            group.kill()
            group.wait()


def test_a_stop_requested_while_starting_ends_the_wait_and_the_server(tmp_path, monkeypatch, caplog):
    """A stop asked while Triton starts ends the wait and the server, and is
    logged once: a second stop (a `with` block's) says nothing more."""
    caplog.set_level("INFO", logger="simple_sampler.launch.server")
    monkeypatch.setenv("READY_AFTER_S", "30")
    server = TritonServer(tmp_path / "repository", install=slow_tritonserver.install(tmp_path))
    asked = time.monotonic() + 1.0
    from simple_sampler.launch.startup import StartInterrupted

    with pytest.raises(StartInterrupted):
        server.start(timeout=60, stop_requested=lambda: time.monotonic() > asked)
    assert time.monotonic() - asked < 5
    assert server.process.poll() is not None and server.watcher.poll() is not None
    assert server.stop() == server.process.returncode
    stopped = [r.getMessage() for r in caplog.records if "stopped" in r.getMessage()]
    assert stopped == ["tritonserver stopped before it was ready"], stopped


HOLDER = """
import mmap, os, sys, time, uuid
names = [f"triton_python_backend_shm_region_{uuid.uuid4()}" for _ in range(2)]
opened = os.open(f"/dev/shm/{names[0]}", os.O_CREAT | os.O_RDWR)  # not sized, not mapped yet
mapped = os.open(f"/dev/shm/{names[1]}", os.O_CREAT | os.O_RDWR)
os.ftruncate(mapped, 4096)
region = mmap.mmap(mapped, 4096)
os.close(mapped)
print(*names, flush=True)
time.sleep(60)
"""


def test_a_killed_group_leaves_no_region_it_held_open_or_mapped():
    """A server killed while its models load may hold a stub's region only
    open, empty, before sizing and mapping it (a CI run left three such):
    end_group finds it by the process's file descriptors, and a mapped one
    by its maps, and removes both."""
    from simple_sampler.launch.processes import end_group

    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    names = holder.stdout.readline().split()
    try:
        assert len(names) == 2 and held_regions(holder.pid) == set(names)
        killed, removed = end_group(holder.pid)
        assert killed == [holder.pid] and sorted(removed) == sorted(names)
        assert not any((SHM_DIRECTORY / name).exists() for name in names)
    finally:
        holder.kill()
        holder.wait()
        for name in names:  # this test's own, should it fail
            (SHM_DIRECTORY / name).unlink(missing_ok=True)
