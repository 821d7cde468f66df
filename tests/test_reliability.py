"""Faults on a real server: a killed sampler instance costs no request and
changes no token; a killed decode loop ends its streams with an error at once
and the service comes back; SIGTERM under load answers every client and
leaves no process or shared-memory region behind. Only processes these tests
started are killed: the stubs are found as children of their own server."""
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import SAMPLED_SEEDS, SAMPLED_TOKENS, llm_server_settings
from fakes import PROMPT, SAMPLED, Streams
from simple_sampler.client import GenerateClient, GenerationError
from simple_sampler.launch.serve import assemble_repository
from simple_sampler.launch.ports import free_ports
from simple_sampler.launch.server import TritonServer
from simple_sampler.pids import alive
from simple_sampler.launch.processes import SHM_DIRECTORY, list_stubs
from simple_sampler.launch.supervisor import Supervisor, arena_regions

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def supervised(tmp_path_factory):
    """The whole repository on a real server watched by a Supervisor, as
    `simple-sampler serve` runs it, with llm_server's settings (so that
    `sampled_tokens` are its tokens too)."""
    repository = assemble_repository(tmp_path_factory.mktemp("repository"),
                                     *llm_server_settings())
    log = tmp_path_factory.mktemp("logs") / "tritonserver.log"
    server = TritonServer(repository, log_path=log, shutdown_grace_s=5).start()
    supervisor = Supervisor(server).start()
    try:
        yield server, supervisor
    finally:
        supervisor.stop()
        server.stop()
        supervisor.cleanup()


def ready(server, path="v2/health/ready") -> bool:
    try:
        with urllib.request.urlopen(f"http://{server.http_url}/{path}", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def stubs_of(server, model):
    return [stub for stub in list_stubs(server.process.pid) if stub.model == model]


def sampler_retries(server) -> float:
    """simple_llm_sampler_retries_total: sampler requests the decode loop sent
    again after a failure (reported at most 0.5 s after the retry)."""
    with urllib.request.urlopen(server.metrics_url) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.split()[-1]) for line in lines
               if line.startswith("simple_llm_sampler_retries_total"))


def test_a_killed_sampler_instance_costs_no_request_and_no_token(supervised, sampled_tokens):
    server, supervisor = supervised
    faulted = Streams(server.grpc_url, SAMPLED_SEEDS, max_tokens=SAMPLED_TOKENS, **SAMPLED)
    faulted.wait_started()
    before = stubs_of(server, "simple_sampler")
    victim = before[0]
    retries_before = sampler_retries(server)
    # Rows must be on the victim when it fails, or the test proves nothing
    # about them. A plain kill cannot see that: on a loaded machine 16
    # streams decoding through the reload once counted 0 retries (most
    # likely the supervisor, 0.75 s to confirm a death, unloaded the
    # instance before the decode loop's next step reached it). So the
    # victim is frozen first:
    # the next request Triton gives it waits on a stub that answers nothing,
    # fails with "Stub process ... is not healthy" within about 2 s, and the
    # decode loop sends its rows again (a retry counted); then it is killed.
    os.kill(victim.pid, signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        while (sampler_retries(server) == retries_before and time.monotonic() - frozen_at < 60
               and len(faulted.ended_at) < len(faulted.threads)):
            time.sleep(0.05)
    finally:
        os.kill(victim.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    rows_met_the_victim = sampler_retries(server) > retries_before
    assert rows_met_the_victim, (
        f"no sampler request failed over to another instance in {killed_at - frozen_at:.1f} s "
        f"with the victim frozen ({len(faulted.ended_at)} of 16 streams had ended)")

    def fresh():
        return [s for s in stubs_of(server, "simple_sampler") if s not in before]

    while time.monotonic() - killed_at < 30 and not (
            supervisor.recoveries.get("simple_sampler") and len(fresh()) == 2 and
            ready(server, "v2/models/simple_sampler/ready")):
        time.sleep(0.1)
    restored_s = time.monotonic() - killed_at
    faulted.join()
    # the old generation's survivor is killed orphan_grace_s after the reload
    deadline = time.monotonic() + supervisor.orphan_grace_s + 5
    while stubs_of(server, "simple_sampler") != fresh() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stubs_of(server, "simple_sampler") == fresh()

    assert not faulted.errors
    assert faulted.tokens == sampled_tokens  # (seed, step) decide the draw, not the instance
    assert restored_s < 30 and supervisor.recoveries["simple_sampler"] == 1
    assert not [(SHM_DIRECTORY / s.shm_region) for s in before
                if (SHM_DIRECTORY / s.shm_region).exists()]
    retries = sampler_retries(server) - retries_before
    print(f"sampler instance frozen, then killed: 16 streams, 0 failed, tokens identical, "
          f"{retries:.0f} sampler requests sent again, capacity back in {restored_s:.1f} s")


def test_a_killed_preprocessing_stub_is_reloaded_alone(supervised):
    """The tokenizer's model comes back without its ensemble being loaded
    again, whose load would load llm again too (a second data plane beside
    the one serving: on a GPU, twice its memory); llm's streams go on."""
    import json

    server, supervisor = supervised
    streams = Streams(server.grpc_url, range(4), max_tokens=120, **SAMPLED)
    streams.wait_started()
    [llm] = stubs_of(server, "llm")
    [victim] = stubs_of(server, "preprocessing")
    os.kill(victim.pid, signal.SIGKILL)
    killed_at, answered = time.monotonic(), None
    while time.monotonic() - killed_at < 30 and answered is None:
        request = urllib.request.Request(
            f"http://{server.http_url}/v2/models/ensemble/generate",
            json.dumps({"text_input": PROMPT, "max_tokens": 4}).encode(),
            {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                answered = json.loads(response.read())["text_output"]
        except urllib.error.HTTPError:
            time.sleep(0.2)  # the ensemble's step meets the dead stub until the reload
    streams.join()
    assert answered and supervisor.recoveries.get("preprocessing") == 1
    assert stubs_of(server, "llm") == [llm], "llm was loaded again"
    assert not streams.errors
    print(f"preprocessing killed: the ensemble answered again in "
          f"{time.monotonic() - killed_at:.1f} s, llm untouched, 4 streams unharmed")


def test_a_killed_decode_loop_ends_its_streams_and_the_service_comes_back(supervised):
    server, supervisor = supervised
    streams = Streams(server.grpc_url, range(8), max_tokens=400, **SAMPLED)
    streams.wait_started()
    [llm] = stubs_of(server, "llm")
    os.kill(llm.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    # The supervisor sees a decoupled stub's death at once (pidfd) and
    # restarts the server: readiness goes false within about 0.1 s. (Each
    # probe may wait its whole 2 s timeout on a dying server: the bound
    # leaves room for one.)
    while ready(server) and time.monotonic() - killed_at < 10:
        time.sleep(0.01)
    unready_after_s = time.monotonic() - killed_at
    assert unready_after_s < 5.0
    streams.join(timeout=30)
    assert sorted(streams.errors) == list(range(8))
    slowest_error_s = max(streams.ended_at.values()) - killed_at
    assert slowest_error_s < 10

    # Back is what the next request needs: the restart done (the old
    # server's readiness, before its kill, does not count) and the new
    # server's endpoints and ensemble ready.
    while time.monotonic() - killed_at < 60 and not (
            supervisor.restarts == 1 and not supervisor.restarting.is_set()
            and server.endpoints_ready() and ready(server, "v2/models/ensemble/ready")):
        time.sleep(0.2)
    back_s = time.monotonic() - killed_at
    answer = GenerateClient(server.grpc_url).generate(
        "What is the capital of France?", max_tokens=12, temperature=0, apply_chat_template=True)
    assert back_s < 60 and "Paris" in answer.text
    assert supervisor.restarts == 1
    print(f"llm killed: not ready {unready_after_s:.2f} s after the kill, 8 streams ended with "
          f"an error within {slowest_error_s:.1f} s, the service back {back_s:.1f} s after it")


class Output:
    """A process's output lines, read by a thread (so that waiting for one
    line never blocks on a process that writes nothing more)."""

    def __init__(self, stream):
        self.lines: list[str] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream):
        for line in stream:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self.lines.append(None)  # end of output
            self._changed.notify_all()

    def wait_for(self, text, timeout):
        deadline = time.monotonic() + timeout
        with self._changed:
            while not any(line and text in line for line in self.lines):
                if None in self.lines or not self._changed.wait(deadline - time.monotonic()):
                    return False
        return True

    def text(self):
        return "".join(line for line in self.lines if line)


def test_sigterm_under_load_after_a_sampler_fault_answers_every_client_and_leaves_nothing(
        tmp_path):
    """8 requests in flight, on a server whose sampler model was reloaded
    after one of its instances died under a request: the stop still ends
    with status 0 within the grace plus Triton's exit timeout. (The
    generation of the dead stub never finishes unloading in Triton 2.51,
    TritonServer.abandon; before, Triton waited out its exit timeout for it
    and exited with status 1.) The stop takes the whole grace, which the
    long streams outlast; it only has to let the short stream finish (8
    tokens among 8 streams), as 8 s did beside two busy processes on 2
    cores."""
    grace = 8
    ports = free_ports(3)
    serve = subprocess.Popen(
        [str(Path(sys.executable).parent / "simple-sampler"), "serve", "--http-port", str(ports[0]),
         "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]), "--instances", "2",
         "--max-context", "512", "--shutdown-grace", str(grace), "--openai-port", "0",
         "--log", str(tmp_path / "tritonserver.log")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = Output(serve.stdout)
    url = f"127.0.0.1:{ports[1]}"
    server = SimpleNamespace(http_url=f"127.0.0.1:{ports[0]}",  # what ready() and
                             metrics_url=f"http://127.0.0.1:{ports[2]}/metrics")  # sampler_retries() read
    try:
        assert output.wait_for("Triton is ready", 300), output.text()
        server_pid = tritonserver_pid(serve)
        # The fault: one sampler instance frozen until a request met it (as
        # in the test above), then killed; serve's supervisor reloads it.
        warm = Streams(url, range(8), max_tokens=64, **SAMPLED)
        warm.wait_started()
        victim = [s for s in list_stubs(server_pid) if s.model == "simple_sampler"][0]
        os.kill(victim.pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        try:
            while (sampler_retries(server) == 0 and time.monotonic() - frozen_at < 60
                   and len(warm.ended_at) < len(warm.threads)):
                time.sleep(0.05)
        finally:
            os.kill(victim.pid, signal.SIGKILL)
        assert sampler_retries(server) > 0, "no request met the frozen sampler instance"
        assert output.wait_for("reloaded", 60), output.text()
        warm.join()
        assert not warm.errors
        # Ready as the next requests need it: the fresh sampler instances too.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (
                ready(server, "v2/models/simple_sampler/ready")
                and ready(server, "v2/models/ensemble/ready")):
            time.sleep(0.1)

        long = Streams(url, range(7), max_tokens=400, **SAMPLED)
        long.wait_started()
        stubs = list_stubs(server_pid)
        short = Streams(url, [100], max_tokens=8, **SAMPLED)
        short.wait_started()
        serve.send_signal(signal.SIGTERM)
        signalled_at = time.monotonic()
        late = None
        # serve has begun the stop (however late a loaded machine runs it),
        # and its SIGTERM has had a second to reach the decode loop
        assert output.wait_for("simple-sampler serve: stopping", 60), output.text()
        time.sleep(1)
        # what a load balancer polls says the server is going, streams still running
        draining_ready = ready(server, "v2/models/ensemble/ready")
        try:
            GenerateClient(url).generate(PROMPT, max_tokens=4)
        except GenerationError as error:
            late = str(error)
        status = serve.wait(timeout=grace + 30)
        exited_s = time.monotonic() - signalled_at
        long.join(timeout=30), short.join(timeout=30)
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
    output.wait_for("never appears", 5)  # the rest of the output
    assert status == 0, output.text()
    assert exited_s < grace + 15, output.text()
    assert not short.errors and len(short.tokens[100]) == 8  # finished within the grace
    assert not draining_ready
    assert sorted(long.errors) == list(range(7))
    assert all("shutting down" in error for error in long.errors.values()), long.errors
    # the ensemble is unloaded as the drain begins (its readiness); Triton says so
    assert late is not None and ("shutting down" in late or "not ready" in late.lower()
                                 or "connect" in late.lower() or "no available versions" in late)
    assert {s.model for s in stubs} >= {"llm", "preprocessing", "simple_sampler"}
    # A zombie is gone too: stubs killed with their server are reaped by init.
    assert not [s for s in [victim, *stubs] if alive(s.pid)]
    assert not alive(server_pid)
    assert not [s.shm_region for s in [victim, *stubs] if (SHM_DIRECTORY / s.shm_region).exists()]
    print(f"SIGTERM under load after a sampler fault: 7 long streams ended with an error, the "
          f"short one finished, serve exited with status 0 in {exited_s:.1f} s (grace {grace} s)")


def start_serve(tmp_path, *args):
    """`simple-sampler serve ARGS` on free ports, no OpenAI port: (the
    process, its Output, [http, grpc, metrics] ports)."""
    ports = free_ports(3)
    serve = subprocess.Popen(
        [str(Path(sys.executable).parent / "simple-sampler"), "serve", "--http-port",
         str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]),
         "--openai-port", "0", "--log", str(tmp_path / "tritonserver.log"), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return serve, Output(serve.stdout), ports


def exit_of(serve, since: float, timeout: float) -> tuple[int, float]:
    """`serve`'s exit status and the seconds from `since` to its exit."""
    status = serve.wait(timeout=timeout)
    return status, time.monotonic() - since


def end_serve(serve, output) -> None:
    """Kill `serve` if a failed test left it running; read the rest of its output."""
    if serve.poll() is None:
        serve.kill()
        serve.wait()
    output.wait_for("never appears", 5)


def tritonserver_pid(serve) -> int:
    """The tritonserver `serve` runs now."""
    return int(subprocess.run(["pgrep", "-P", str(serve.pid), "tritonserver"],
                              capture_output=True, text=True).stdout.split()[0])


def ready_llm(serve, output):
    """Once `serve`'s Triton is ready: its pid, its llm stub and the row
    arenas that stub holds (asserted to exist: the tests check they are gone)."""
    assert output.wait_for("Triton is ready", 300), output.text()
    server_pid = tritonserver_pid(serve)
    (llm,) = [s for s in list_stubs(server_pid) if s.model == "llm"]
    arenas = arena_regions([llm.pid])
    assert arenas, "the llm stub holds no row arena to leave behind"
    return server_pid, llm, arenas


def test_serve_brings_a_dead_decode_loop_back_and_a_sampler_dying_in_the_drain_costs_nothing(
        tmp_path):
    """Through `serve` itself (the simulated engine): its llm stub killed,
    the server comes back on the same ports and serves, and the dead stub's
    row arenas are gone; then a sampler instance killed as SIGTERM arrives:
    the supervisor still reloads it during the drain, so every stream
    finishes within the grace (before, the supervisor stopped first and
    every shard routed to the dead instance waited on it: the streams ran
    out the grace), and serve exits 0 leaving no region behind."""
    serve, output, ports = start_serve(tmp_path, "--engine", "simulated", "--instances", "2",
                                       "--shutdown-grace", "40")
    url = f"127.0.0.1:{ports[1]}"
    server = SimpleNamespace(http_url=f"127.0.0.1:{ports[0]}")
    pids = []
    try:
        server_pid, llm, arenas = ready_llm(serve, output)
        os.kill(llm.pid, signal.SIGKILL)
        assert output.wait_for("server restarted", 120), output.text()
        assert ready(server, "v2/models/ensemble/ready")
        assert GenerateClient(url).generate(PROMPT, max_tokens=4, **SAMPLED).token_ids
        assert not [name for name in arenas if (SHM_DIRECTORY / name).exists()]
        server_pid = tritonserver_pid(serve)
        stubs = list_stubs(server_pid)
        pids = [server_pid, *(s.pid for s in stubs)]
        streams = Streams(url, range(8), max_tokens=300, **SAMPLED)
        streams.wait_started()
        victim = [s for s in stubs if s.model == "simple_sampler"][0]
        os.kill(victim.pid, signal.SIGKILL)
        serve.send_signal(signal.SIGTERM)
        status, exited_s = exit_of(serve, time.monotonic(), 120)
        streams.join(timeout=30)
    finally:
        end_serve(serve, output)
    assert status == 0, output.text()
    assert not streams.errors, streams.errors
    assert all(len(tokens) == 300 for tokens in streams.tokens.values())
    assert "reloaded" in output.text(), output.text()
    assert not [pid for pid in pids if alive(pid)]
    assert not [s.shm_region for s in stubs if (SHM_DIRECTORY / s.shm_region).exists()]
    assert not arena_regions(pids)
    print(f"serve: the llm stub killed, the server back and serving; a sampler instance killed "
          f"with SIGTERM: 8 streams of 300 tokens finished, serve exited 0 in {exited_s:.1f} s")


def test_a_decode_loop_dying_in_the_drain_ends_the_stop_at_once_leaving_no_arena(tmp_path):
    """The llm stub killed while a stop drains its streams: the supervisor
    ends the server at once (its streams could end no other way; before,
    they hung until the stop's SIGKILL at the grace + 20 s), the clients
    see their connection close, serve says so (status 1), and the dead
    stub's row arenas, which nothing restarted would remove, are gone."""
    grace = 60
    serve, output, ports = start_serve(tmp_path, "--engine", "simulated", "--instances", "1",
                                       "--shutdown-grace", str(grace))
    try:
        server_pid, llm, arenas = ready_llm(serve, output)
        streams = Streams(f"127.0.0.1:{ports[1]}", range(4), max_tokens=900, **SAMPLED)
        streams.wait_started()
        serve.send_signal(signal.SIGTERM)
        assert output.wait_for("simple-sampler serve: stopping", 60), output.text()
        time.sleep(1)
        os.kill(llm.pid, signal.SIGKILL)
        status, exited_s = exit_of(serve, time.monotonic(), grace + 30)
        streams.join(timeout=30)
    finally:
        end_serve(serve, output)
    assert status == 1 and "ending the server now" in output.text(), output.text()
    assert exited_s < 15, output.text()
    assert sorted(streams.errors) == list(range(4))
    assert not [name for name in arenas if (SHM_DIRECTORY / name).exists()]
    assert not alive(server_pid)
    print(f"the llm stub killed during a stop's drain (grace {grace} s): serve exited "
          f"{exited_s:.1f} s later, the 4 streams ended with an error, no arena left")
