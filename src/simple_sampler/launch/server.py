"""Start a real Triton server with our repository, wait until it is ready,
and stop it cleanly. Used by `simple-sampler serve`, the tests and the
benchmarks alike.
"""
from __future__ import annotations

import http.client
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from . import startup
from .startup import StartInterrupted
from .install import (InstallError, TritonInstall, assemble_backends, find_triton,
                      is_system_library_dir)
from ..logs import LOG_LEVEL_ENV
from ..schema import ENSEMBLE
from ..serving.engines import DEFAULT_STARTUP_TIMEOUT_S
from ..pids import alive
from .ports import free_ports, port_in_use
from .processes import (SHM_DIRECTORY, StubsUnloading, end_group, held_regions, list_stubs,
                        remove_orphaned_env_folders, unlink_shm)
from .supervisor import arena_prefix, arena_regions

log = logging.getLogger(__name__)

MiB = 1 << 20
#: The decode loop's gauge of requests decoding or queued (llm/1/model.py).
IN_FLIGHT_METRIC = "simple_llm_requests_in_flight"
#: The decode loop's gauge of its model's finalize running (llm/1/model.py).
CLOSING_METRIC = "simple_llm_closing"
#: How long past its grace a draining decode loop may take to send its errors.
DRAIN_MARGIN_S = 5.0
#: After the drain, how long Triton waits for its models to unload: each model's finalize,
#: then its stub process's exit (Python's teardown), which took up to 6 s on a loaded 2-core
#: machine (load average 9) after a load. Triton exits as soon as they are unloaded; only a
#: model that never unloads waits all of it.
TRITON_EXIT_TIMEOUT_S = 15
#: After the drain, with nothing in flight and Triton unloading, how long no
#: stub may exit or give up its region before what is still loaded counts as
#: held by clients' open gRPC streams (TritonServer._wait_exit): longer than
#: a stub's slowest exit seen after a load (above), shorter than Triton's wait.
CLIENT_HELD_S = 8.0
#: After the grace, how long the drain's errors and Triton's exit may take before SIGKILL.
STOP_MARGIN_S = DRAIN_MARGIN_S + TRITON_EXIT_TIMEOUT_S
#: The watcher that ends the server when its launcher dies (lifeline.py); RELEASED: the launcher ended it
LIFELINE = Path(__file__).with_name("lifeline.py")
RELEASED = b"released\n"


@dataclass
class TritonServer:
    """A tritonserver process serving `repository`.

    Ports of 0 are replaced by free loopback ports. `shm_bytes` sizes the
    Python backend's per-instance shared-memory pool (initial size and
    growth step): at least one full request plus its outputs.
    `python_thread_pool`: the Python backend's `thread-pool-size` per model
    instance (python_backend src/python_be.cc); None: Triton's default, 32
    (docs/SERVED_COST.md, "The Python backend's thread pool").
    `temporary_repository`: the repository is a temporary folder made for
    this server, removed when it stops for good (``stop``; by its lifeline
    when the launcher dies first), not when the supervisor restarts it.
    """

    repository: Path
    http_port: int = 0
    grpc_port: int = 0
    metrics_port: int = 0
    shm_bytes: int = 64 * MiB
    python_thread_pool: int | None = None
    log_path: Path | None = None
    shutdown_grace_s: float = 30.0
    log_level: str = "INFO"
    extra_args: tuple[str, ...] = ()
    install: TritonInstall = field(default_factory=find_triton)
    process: subprocess.Popen | None = None
    watcher: subprocess.Popen | None = None
    was_ready: bool = False  # wait_ready saw every endpoint answer
    #: pids of the stubs of model generations Triton will never finish unloading (a stub
    #: died under a request: abandon()); stop() does not wait out Triton's exit timeout for them.
    abandoned: set[int] = field(default_factory=set)
    launched_at: float = 0.0  # time.monotonic() of the last launch
    temporary_repository: bool = False

    def __post_init__(self):
        names = [name for name in ("http_port", "grpc_port", "metrics_port")
                 if not getattr(self, name)]
        given = {self.http_port, self.grpc_port, self.metrics_port}
        for name, port in zip(names, free_ports(len(names), given)):
            setattr(self, name, port)

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def command(self, backend_directory: Path) -> list[str]:
        return [
            str(self.install.server),
            f"--model-repository={self.repository}",
            f"--backend-directory={backend_directory}",
            f"--http-port={self.http_port}", f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            f"--backend-config=python,shm-default-byte-size={self.shm_bytes}",
            f"--backend-config=python,shm-growth-byte-size={self.shm_bytes}",
            *([f"--backend-config=python,thread-pool-size={self.python_thread_pool}"]
              if self.python_thread_pool else []),
            # Explicit control: the repository API can reload a model whose
            # stub died (supervisor.py); every model is loaded at start.
            "--model-control-mode=explicit", "--load-model=*",
            # stop() drains the requests before it signals Triton, so Triton's
            # own wait only covers models it cannot unload (one whose stub
            # died never finishes unloading).
            f"--exit-timeout-secs={TRITON_EXIT_TIMEOUT_S}",
            # Every config.pbtxt is complete (launch.serve writes it); with
            # auto-complete on, the Python backend starts one extra stub per
            # model only to ask it for its config (python_be.cc,
            # ModelState::LaunchAutoCompleteStubProcess), each importing the
            # model's modules: several seconds of a small host's start.
            "--disable-auto-complete-config",
            "--log-verbose=0", *self.extra_args,
        ]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        libs = [str(p) for p in self.install.library_dirs]
        # The backend stub links libpython3.X.so dynamically; without this it
        # finds the system's copy, whose patch release may lack symbols this
        # interpreter's extension modules need (Debian's 3.11.2 under a 3.11.7
        # stdlib: `import ssl`, and so transformers, fails in every model).
        # Not when LIBDIR is a system directory (a distribution's Python, e.g.
        # NGC's /usr/lib/x86_64-linux-gnu): the loader searches it anyway, and
        # first on the path it would shadow the CUDA forward-compatibility
        # libraries NGC images put on LD_LIBRARY_PATH.
        libdir = sysconfig.get_config_var("LIBDIR")
        if sysconfig.get_config_var("Py_ENABLE_SHARED") and not is_system_library_dir(libdir):
            libs.insert(0, libdir)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [*libs, env.get("LD_LIBRARY_PATH")]))
        env[LOG_LEVEL_ENV] = self.log_level  # the models' logs.configure()
        # Model processes must import this interpreter's packages (the venv's).
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        return env

    def start(self, timeout: float = DEFAULT_STARTUP_TIMEOUT_S,
              progress_s: float = startup.PROGRESS_S,
              stop_requested: Callable[[], bool] | None = None) -> "TritonServer":
        """Launch the server and wait until every endpoint answers (wait_ready)."""
        self._startup = (timeout, progress_s)  # start_again() waits as long
        self.launch()
        self.wait_ready(timeout, progress_s, stop_requested)
        return self

    def launch(self) -> "TritonServer":
        """Start tritonserver in a session of its own (a Ctrl-C in the
        launcher's terminal is the launcher's to handle) with its lifeline
        watcher beside it; returns at once."""
        for name in ("http_port", "grpc_port", "metrics_port"):
            port = getattr(self, name)
            if port_in_use(port):
                raise InstallError(f"port {port} ({name.replace('_', ' ')}) is already in use; "
                                   f"choose another or stop what holds it")
        self.was_ready, self.abandoned = False, set()
        # the log first: a path that cannot be written leaves nothing behind
        output = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        self._workdir = Path(tempfile.mkdtemp(prefix="simple-sampler-backends-"))
        backends = assemble_backends(self._workdir, self.install)
        # The watcher first, so that no moment exists where a server runs
        # without one: it learns the server's pid through the pipe and ends
        # the server's process group when the pipe's write end (held only
        # here) closes, however this process exits (lifeline.py).
        read_end, self._lifeline = os.pipe()  # neither end is inherited by exec
        try:
            self.watcher = subprocess.Popen(
                [sys.executable, "-E", "-s", str(LIFELINE), str(read_end), arena_prefix()],
                pass_fds=(read_end,), stdin=subprocess.DEVNULL, stdout=output,
                stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            os.close(read_end)
        try:
            self.process = subprocess.Popen(self.command(backends), env=self.environment(),
                                            stdout=output, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        except BaseException:
            self._release_lifeline()  # nothing to watch: the watcher exits
            shutil.rmtree(self._workdir, ignore_errors=True)
            raise
        # what the lifeline removes once it had to end the server: the backend copy, our repository
        os.write(self._lifeline, f"{self.process.pid}\n{self._workdir}\n"
                                 f"{self.repository if self.temporary_repository else ''}\n"
                 .encode())
        if output is not subprocess.DEVNULL:
            output.close()  # the children hold their own copies
        self.launched_at = time.monotonic()
        log.info("tritonserver started (pid %d, repository %s, log %s, lifeline pid %d)",
                 self.process.pid, self.repository, self.log_path, self.watcher.pid)
        return self

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def metrics_up(self) -> bool:
        """Whether the metrics endpoint answers: Triton opens it after the
        HTTP endpoint, so /v2/health/ready may answer first (seen in CI:
        the first scrape right after ready was refused)."""
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def grpc_up(self) -> bool:
        """Whether the gRPC port accepts a connection (the port `generate`
        and the OpenAI front door use)."""
        try:
            with socket.create_connection(("127.0.0.1", self.grpc_port), timeout=2):
                return True
        except OSError:
            return False

    def endpoints_ready(self) -> bool:
        """Ready as a client needs it: HTTP says ready and the gRPC and
        metrics ports answer (Triton opens them one after another)."""
        return self.ready() and self.grpc_up() and self.metrics_up()

    def wait_ready(self, timeout: float, progress_s: float = startup.PROGRESS_S,
                   stop_requested: Callable[[], bool] | None = None) -> None:
        """Poll readiness (every endpoint, endpoints_ready); every
        `progress_s` print which models are still loading. Raises
        StartInterrupted, the server stopped, once `stop_requested()`."""
        started = time.monotonic()
        deadline, next_progress = started + timeout, started + progress_s
        while time.monotonic() < deadline:
            if stop_requested is not None and stop_requested():
                self.stop()
                raise StartInterrupted("stopped while tritonserver was starting")
            if time.monotonic() >= next_progress:
                next_progress += progress_s
                print(startup.progress_line(time.monotonic() - started, timeout,
                                            startup.model_states(self.http_url)),
                      file=sys.stderr, flush=True)
            if self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with status {self.process.returncode} "
                                   f"before it was ready{self._log_hint()}")
            if self.endpoints_ready():
                self.was_ready = True
                log.info("tritonserver ready in %.1f s: HTTP %s, gRPC %s, metrics %s",
                         time.monotonic() - self.launched_at, self.http_url, self.grpc_url,
                         self.metrics_url)
                return
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"tritonserver was not ready after {timeout:.0f} s (raise "
                           f"--startup-timeout if a model is still loading){self._log_hint()}")

    def _log_hint(self) -> str:
        if not self.log_path:
            return " (start it with a log path to see why)"
        lines = Path(self.log_path).read_text(errors="replace").strip().splitlines()
        errors = [line[:2000] for line in lines if line.startswith("E") and "CudaDriver" not in line]
        return "; errors in the log:\n" + "\n".join(errors[-5:] or lines[-15:])

    def terminate(self) -> None:
        """Ask the server to exit (SIGTERM: Triton finishes in-flight requests)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)

    def kill(self) -> list[str]:
        """SIGKILL the server and its stubs at once (their clients see the
        connection close) and remove the shared memory the stubs held and
        the backend copy; returns the regions removed."""
        removed = []
        if self.process is not None and self.process.poll() is None:
            killed, removed = end_group(self.process.pid, arena_prefix())
            self.process.wait()
            log.info("tritonserver killed: %d process(es), shared memory removed: %s",
                     len(killed), ", ".join(removed) or "none")
        self._release_lifeline()
        shutil.rmtree(self._workdir, ignore_errors=True)
        return removed

    def _release_lifeline(self) -> None:
        """The server is gone: tell the watcher so (it then removes no folder:
        a supervisor's restart reuses the repository) and close its pipe, so
        that it exits; remove the Python backend's folders a killed server left."""
        if getattr(self, "_lifeline", None) is None:
            return
        try:
            os.write(self._lifeline, RELEASED)
        except OSError:  # the watcher is gone already
            pass
        os.close(self._lifeline)
        self._lifeline = None
        try:
            self.watcher.wait(10)
        except subprocess.TimeoutExpired:
            log.warning("the lifeline watcher (pid %d) did not exit: killed", self.watcher.pid)
            self.watcher.kill()
            self.watcher.wait()
        remove_orphaned_env_folders()  # those made while this launcher ran

    def start_again(self, stop_requested: Callable[[], bool] | None = None) -> "TritonServer":
        """After kill(): start on the same ports, waiting as the first start did."""
        return self.start(*self._startup, stop_requested=stop_requested)

    def in_flight(self) -> float:
        """Requests the decode loop still holds (its metric; 0 without one)."""
        return self._gauges(IN_FLIGHT_METRIC)[0]

    def _gauges(self, *names: str) -> list[float]:
        """Each of the llm model's gauges `names`, summed over its instances,
        from one read of the metrics (0 when they cannot be read: a server
        gone, or no such gauge)."""
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=2) as response:
                lines = response.read().decode().splitlines()
        except (OSError, http.client.HTTPException):  # URLError, timeouts, a cut answer
            return [0.0] * len(names)
        return [sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name))
                for name in names]

    def drain(self, stubs, grace_s: float | None = None) -> float:
        """Ask the models to finish (SIGTERM to each of `stubs`: the decode
        loop stops admitting, finishes its requests within `grace_s`, then
        ends the rest with an error; stubs of other models ignore it) and
        wait until nothing is in flight. Returns the seconds it took.

        The ensemble is unloaded first, so that its readiness (what a load
        balancer polls) says the server is going: a Python model has no way
        to mark itself unready in Triton 2.51. Its streams in flight finish
        (they hold the model; llm and preprocessing stay loaded)."""
        grace_s = self.shutdown_grace_s if grace_s is None else grace_s
        started = time.monotonic()
        self._unload(ENSEMBLE.name)
        for stub in stubs:
            try:
                os.kill(stub.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = started + grace_s + DRAIN_MARGIN_S
        while time.monotonic() < deadline and self.process.poll() is None and self.in_flight() > 0:
            time.sleep(0.1)
        return time.monotonic() - started

    def _unload(self, model: str) -> None:
        """Ask Triton to unload `model` if the repository has it (a failure is logged)."""
        if not (Path(self.repository) / model).is_dir():
            return
        try:
            urllib.request.urlopen(urllib.request.Request(
                f"http://{self.http_url}/v2/repository/models/{model}/unload", data=b"{}",
                method="POST"), timeout=5).close()
        except (OSError, http.client.HTTPException) as error:
            log.warning("%s not unloaded before the drain: %s", model, error)

    def stop(self, timeout: float | None = None,
             drained: Callable[[], None] | None = None) -> int | None:
        """Drain (in-flight requests finish or end with an error), call
        `drained` (serve stops its supervisor there: during the drain it
        still brings a dead sampler instance back), SIGTERM, and SIGKILL
        what is left `timeout` seconds after the start (default: the grace
        plus STOP_MARGIN_S); removes the backend copy, the shared-memory
        regions of the stubs it stopped and a temporary repository.
        Returns Triton's exit status (None: never launched)."""
        try:
            return self._stop(timeout, drained)
        finally:
            if self.temporary_repository and (self.process is None
                                              or self.process.poll() is not None):
                shutil.rmtree(self.repository, ignore_errors=True)

    def _stop(self, timeout: float | None, drained: Callable[[], None] | None) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None and not self.was_ready:
            # Stopped while starting: no client was served, so nothing is
            # drained; Triton loads its models before it reads a signal, so
            # only a kill ends it at once. kill() removes the stubs' regions.
            self.kill()
            log.info("tritonserver stopped before it was ready")
            return self.process.returncode
        if self.process.poll() is None:
            deadline = time.monotonic() + (self.shutdown_grace_s + STOP_MARGIN_S
                                           if timeout is None else timeout)
            stubs, held = list_stubs(self.process.pid), held_regions(self.process.pid)
            log.info("stopping tritonserver (pid %d): %d model process(es) drained in %.1f s",
                     self.process.pid, len(stubs), self.drain(stubs))
            if drained is not None:
                drained()
            self.terminate()
            status = self._wait_exit(max(deadline, time.monotonic() + 1.0),
                                     [s for s in stubs if s.pid not in self.abandoned])
            # Triton removes a model's region as it unloads it, the model's finalize its row
            # arena; a model given up at the exit timeout (or a SIGKILL) leaves both, and a dead
            # stub's region (its generation never unloads: abandon) only Triton held (`held`).
            left = unlink_shm([*(stub.shm_region for stub in stubs), *held,
                               *arena_regions(stub.pid for stub in stubs)])
            if status != 0:
                log.warning("tritonserver did not stop cleanly (status %s); removed the shared "
                            "memory its models left: %s", status, ", ".join(left) or "none")
        elif getattr(self, "_lifeline", None) is None:  # stopped, and said so, already
            return self.process.returncode
        else:
            status = self.process.returncode
        self._release_lifeline()
        shutil.rmtree(self._workdir, ignore_errors=True)
        log.info("tritonserver stopped (status %s)", status)
        return status

    def abandon(self, stubs) -> None:
        """Note `stubs` as a model generation Triton will never finish
        unloading: the supervisor reloaded their model after one of them died.

        Why it never unloads (Triton 2.51's Python backend, python_be.cc):
        each request an instance executes gets a response factory
        (TRITONBACKEND_ResponseFactoryNew, in SaveRequestsToSharedMemory),
        which holds a reference to the model; the stub deletes it when it is
        done with the request. When the stub is dead, ProcessRequests returns
        its "Stub process ... is not healthy" error before that, so the
        factory of every request that met the dead stub is never deleted and
        the old model object is never destroyed: it stays UNLOADING, its
        surviving instances are never finalized, and at exit Triton waits
        out --exit-timeout-secs for it ("Found 1 live models") and exits
        with status 1. stop() ends Triton once every other model is
        unloaded instead (_wait_exit)."""
        self.abandoned.update(stub.pid for stub in stubs)

    def _wait_exit(self, deadline: float, stubs) -> int:
        """After SIGTERM: Triton's status once it exits, SIGKILL at `deadline`.
        With an abandoned generation (abandon()), Triton's own exit can only
        come at its exit timeout, with status 1; so once every stub in
        `stubs` (the current generations') has exited and Triton removed its
        region, which is the last step of a model's unload, nothing but the
        abandoned generation is left: the group is killed and the stop
        counts as clean (0). Likewise what a client's open gRPC stream holds
        (``processes.StubsUnloading``)."""
        unloading = StubsUnloading(stubs, CLIENT_HELD_S, TRITON_EXIT_TIMEOUT_S)  # from the SIGTERM
        while True:
            try:
                return self.process.wait(0.1)
            except subprocess.TimeoutExpired:
                pass
            if time.monotonic() >= deadline:
                os.killpg(self.process.pid, signal.SIGKILL)
                return self.process.wait()
            if self.abandoned and not any(
                    alive(stub.pid) or (SHM_DIRECTORY / stub.shm_region).exists()
                    for stub in stubs):
                killed, _ = end_group(self.process.pid, arena_prefix())
                self.process.wait()
                log.info("tritonserver unloaded every model but the abandoned generation of "
                         "a stub that died (pids %s), which it never finishes unloading: "
                         "ended it (%d process(es)) rather than wait out its exit timeout",
                         ", ".join(map(str, sorted(self.abandoned))), len(killed))
                return 0
            # the llm's in-flight requests and its finalize (closing) are work
            if unloading.settled() and not any(self._gauges(IN_FLIGHT_METRIC, CLOSING_METRIC)):
                killed, _ = end_group(self.process.pid, arena_prefix())
                self.process.wait()
                log.info("tritonserver unloaded what it could and nothing is in flight; what it "
                         "still holds (%s) is held by requests that got their last response "
                         "(a client keeping its gRPC stream open after it, most likely): "
                         "ended it (%d process(es)) rather than wait out its exit timeout",
                         ", ".join(sorted(unloading.loaded())) or "a model without a process, "
                         "the ensemble", len(killed))
                return 0

    def __enter__(self) -> "TritonServer":
        try:
            return self.start()
        except BaseException:
            self.stop()  # a start that failed leaves nothing either
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

