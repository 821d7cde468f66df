"""`simple-sampler serve`: a real Triton server with our model repository.

The repository is assembled in a temporary directory from the project's
``model_repository/`` templates with the placeholders filled (the source is
never modified), and removed with the server, or taken as given with
--model-repository. The server runs
in the foreground: Ctrl-C or SIGTERM stops it cleanly at any moment, from
the first line of `run` on (while the models load, while the front door
starts, while serving: in-flight requests get a grace period, then a final
error). Nothing is left behind, and a launcher killed without warning takes
its server with it (lifeline.py). A model whose stub process dies is
reloaded while the server runs (supervisor.py).
"""
from __future__ import annotations

import dataclasses
import logging
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from .. import heap
from ..serving.engines import engine_spec, startup_timeout as engine_startup_timeout
from ..addresses import LOCAL, parse_endpoints
from ..settings import FrontendSettings, LlmSettings, SamplerSettings
from .install import InstallError, project_file
from .ports import port_in_use
from .server import MiB, StartInterrupted, TritonServer
from .templates import write_model
from .supervisor import Supervisor

log = logging.getLogger(__name__)


#: The ensemble, and the same ensemble again under the name of TensorRT-LLM's
#: BLS model, for its clients that name that model (its
#: end_to_end_grpc_client.py --model-name tensorrt_llm_bls; genai-perf -m
#: tensorrt_llm_bls): the same steps and tensors, not a BLS model.
ENSEMBLE_NAMES = ("ensemble", "tensorrt_llm_bls")


#: The text steps' instance counts: Triton fields of their configs, not llm's
TEXT_STEP_INSTANCES = ("preprocessing_instances", "postprocessing_instances")


def assemble_repository(destination: Path, sampler: SamplerSettings,
                        llm: LlmSettings | None = None) -> Path:
    """The sampler alone, or (with `llm`) the whole generation repository:
    ensemble (and tensorrt_llm_bls, ``ENSEMBLE_NAMES``), preprocessing, llm,
    tensorrt_llm (TensorRT-LLM's core model's interface over llm) and
    postprocessing (its postprocessing model's interface; neither with
    generate_max_batch_size 0: those models' tensors have the batch
    dimension) and simple_sampler. Raises ValueError for settings out of
    range."""
    if llm is not None:
        sampler.validate()  # first: the llm's shards default to its instances
        check_llm_against_sampler(llm.validate(), sampler)
    if llm is not None and engine_spec(llm.engine).hot_profile and sampler.hot_vocab_profile:
        sampler, llm = _map_hot_vocab(destination, sampler, llm)
    write_model(destination, "simple_sampler", "simple_sampler",
                sampler.validate().template_values())
    _check_profile_vocab(destination / "simple_sampler", sampler)
    if llm is not None:
        values = llm.validate().template_values()
        for name in ENSEMBLE_NAMES:
            write_model(destination, name, "ensemble",
                        {"generate_max_batch_size": llm.generate_max_batch_size})
        write_model(destination, "preprocessing", "preprocessing",
                    {k: values[k] for k in ("generate_max_batch_size", "preprocessing_instances",
                                            "model")})
        write_model(destination, "llm", "llm", {k: v for k, v in values.items()
                                                if k not in TEXT_STEP_INSTANCES})
        if llm.generate_max_batch_size:
            write_model(destination, "tensorrt_llm", "tensorrt_llm",
                        {"generate_max_batch_size": llm.generate_max_batch_size})
            write_model(destination, "postprocessing", "postprocessing",
                        {k: values[k] for k in ("generate_max_batch_size",
                                                "postprocessing_instances", "model")})
    return destination


def check_llm_against_sampler(llm: LlmSettings, sampler: SamplerSettings) -> None:
    """Raise ValueError where the llm's settings ask for requests this
    server's sampler model would refuse at run time: a step's rows (up to
    engine_max_batch_size) in one request to a local instance whose Triton
    max_batch_size is smaller (one left up takes them all)."""
    if LOCAL not in parse_endpoints(llm.sampler_endpoints):
        return
    if llm.engine_max_batch_size > sampler.sampler_max_batch_size:
        raise ValueError(f"engine_max_batch_size ({llm.engine_max_batch_size}) is more than the "
                         f"sampler's sampler_max_batch_size ({sampler.sampler_max_batch_size}, "
                         f"--max-batch-size), the most rows one sampler request may carry: "
                         f"raise it or lower --engine-max-batch-size")

def _check_profile_vocab(model_dir: Path, sampler: SamplerSettings) -> None:
    """Raise ValueError where the sampler's hot-vocab profile is for another
    vocabulary than its vocab_size (the model would refuse it at load, after
    Triton started)."""
    if not (sampler.hot_vocab_profile and sampler.vocab_size):
        return
    from ..shvs.hot_vocab import load_profile

    profile = load_profile(model_dir / sampler.hot_vocab_profile)  # an absolute path stays
    if profile.vocab_size != sampler.vocab_size:
        raise ValueError(f"the hot-vocab profile {sampler.hot_vocab_profile} is for a vocabulary "
                         f"of {profile.vocab_size} tokens, the sampler's vocab_size is "
                         f"{sampler.vocab_size} (--hot-vocab off, or another profile)")


#: The file a repository's sampler reads a mapped hot set from.
MAPPED_PROFILE = "hot_vocab_simulated.npz"


def _map_hot_vocab(destination: Path, sampler: SamplerSettings, llm: LlmSettings):
    """An engine whose rows keep SmolLM2's tokens at other ids (simulated):
    its sampler and hot-first handoff use the profile mapped to them, written
    next to the sampler's config as MAPPED_PROFILE."""
    from ..shvs.hot_vocab import load_profile

    source = Path(sampler.hot_vocab_profile)
    if not source.is_absolute():
        source = project_file(f"model_repository/simple_sampler/{source}")
    profile = load_profile(source)
    mapped = engine_spec(llm.engine).hot_profile(profile, llm)
    if mapped.vocab_size != profile.vocab_size:
        mapped.save(destination / "simple_sampler" / MAPPED_PROFILE)
        sampler = dataclasses.replace(sampler, hot_vocab_profile=MAPPED_PROFILE)
        llm = dataclasses.replace(llm, hot_vocab_profile=MAPPED_PROFILE)
    return sampler, llm


def shared_memory_bytes(sampler: SamplerSettings) -> int:
    """Per-instance pool: one full request of logits plus room for its
    parameters and outputs, at least the 64 MiB floor."""
    return max(64 * MiB, sampler.request_bytes() + 16 * MiB)


def show_demo(server: TritonServer, prompt: str, stopping: threading.Event,
              streams: bool = True) -> None:
    """Stream one answer over gRPC, as a user's client would (or, from an
    llm model that is not decoupled, ask for it whole); a stop ends it (the
    stream is cancelled, which stops its generation)."""
    from ..client import GenerateClient, GenerationError

    print(f"\n> {prompt}\n", flush=True)
    client, params = GenerateClient(server.grpc_url, "grpc"), dict(
        max_tokens=64, apply_chat_template=True, temperature=0.7, top_p=0.9, seed=0)
    try:
        for chunk in (client.stream(prompt, **params) if streams
                      else [client.generate(prompt, exclude_input_in_output=True, **params)]):
            print(chunk.text, end="", flush=True)
            if stopping.is_set():
                print(flush=True)
                return
        print(f"\n\n(curl -s http://{server.http_url}/v2/models/ensemble/generate -d "
              f"'{{\"text_input\": \"Hello\", \"max_tokens\": 16}}')\nCtrl-C stops the server.",
              flush=True)
    except GenerationError as error:
        print(f"demo request failed: {error}", file=sys.stderr, flush=True)


#: How long the front door may take to answer /health once it listens and
#: Triton is ready (it asks Triton whether llm is ready).
FRONTDOOR_HEALTH_TIMEOUT_S = 60.0
#: Triton's log in the temporary folder serve makes when given no --log
LOG_NAME = "tritonserver.log"


class Preparation(threading.Thread):
    """The front door's slow start (FrontendServer.prepare) off the main
    thread, which keeps watching for a stop meanwhile. A daemon: a stop
    during it just leaves it behind with the process."""

    def __init__(self, frontdoor, settings: LlmSettings | None):
        super().__init__(name="openai-frontend-prepare", daemon=True)
        self.frontdoor, self.settings, self.error = frontdoor, settings, None

    def run(self) -> None:
        started = time.monotonic()
        try:
            self.frontdoor.prepare(self.settings)
        except Exception as error:  # noqa: BLE001 - reported by serve, with the traceback
            log.exception("the OpenAI frontend could not be prepared")
            self.error = error
        else:
            log.info("openai frontend prepared in %.1f s (tokenizer of %s)",
                     time.monotonic() - started, self.frontdoor.served.model_id)


def wait_for(condition, stopping: threading.Event, timeout_s: float,
             poll_s: float = 0.1) -> bool:
    """Poll `condition()` until it holds (True), a stop, or the timeout."""
    deadline = time.monotonic() + timeout_s
    while not stopping.is_set() and time.monotonic() < deadline:
        if condition():
            return True
        stopping.wait(poll_s)
    return False


def frontdoor_healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


class StartFailed(Exception):
    """A start that cannot go on: its message is the one line `serve` prints."""


def run(sampler: SamplerSettings, http_port: int, grpc_port: int, metrics_port: int,
        llm: LlmSettings | None = None, repository: Path | None = None,
        log_path: Path | None = None, demo: str | None = None,
        shutdown_grace_s: float = 30.0, supervise: bool = True, log_level: str = "INFO",
        startup_timeout: float | None = None, frontend: FrontendSettings | None = None) -> int:
    """Serve until SIGINT/SIGTERM: then in-flight requests get
    `shutdown_grace_s` to finish and a final error after it, Triton stops,
    and no stub or shared-memory region is left. With `supervise`, a model
    whose stub process dies is reloaded (supervisor.py). `startup_timeout`:
    how long the models may take to load (default per engine, startup.py).
    `frontend`: the OpenAI-compatible API (with an llm; port 0: off),
    prepared while Triton loads and stopped before Triton.

    SIGINT and SIGTERM only set an event, from this function's first line
    to its last: every wait polls it, so a stop at any moment ends in the
    same cleanup, and no KeyboardInterrupt can escape it. "Ready" is printed
    once every endpoint asked for answers. Exit status: 0 after a stop that
    left nothing (while starting too), 1 when Triton had to be killed at its
    exit timeout or died by itself, 2 when it could not start."""
    stopping = threading.Event()

    def stop(signum, _frame):
        # Only note it: the main thread drains and stops the server.
        stopping.set()

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    # The command's entry (console.py) notes signals from its first line; one
    # noted before this line stops the start as one after it would.
    if any(getattr(handler, "received", None) for handler in previous.values()):
        stopping.set()
    try:
        return _run(stopping, sampler, http_port, grpc_port, metrics_port, llm, repository,
                    log_path, demo, shutdown_grace_s, supervise, log_level, startup_timeout,
                    frontend)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def assemble_in_temp(sampler: SamplerSettings, llm: LlmSettings | None,
                     prefix: str = "simple-sampler-repo-") -> Path:
    """``assemble_repository`` into a new temporary directory (its name
    starting with `prefix`), removed again when the settings are refused
    (nothing half-written is left)."""
    destination = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        return assemble_repository(destination, sampler, llm)
    except BaseException:
        shutil.rmtree(destination, ignore_errors=True)
        raise


def _run(stopping, sampler, http_port, grpc_port, metrics_port, llm, repository, log_path, demo,
         shutdown_grace_s, supervise, log_level, startup_timeout, frontend) -> int:
    server = supervisor = openai = None
    status = None
    assembled = False
    log_dir = None  # ours: removed where no server wrote a log in it
    try:
        try:
            assembled = repository is None
            if assembled:
                repository = assemble_in_temp(sampler, llm)
                log.info("model repository %s: %s; %s", repository, sampler,
                         llm or "no llm (--sampler-only)")
            if log_path is None:
                log_dir = Path(tempfile.mkdtemp(prefix="simple-sampler-log-"))
                log_path = log_dir / LOG_NAME
            server = TritonServer(repository, http_port, grpc_port, metrics_port,
                                  shm_bytes=shared_memory_bytes(sampler), log_path=log_path,
                                  shutdown_grace_s=shutdown_grace_s, log_level=log_level,
                                  temporary_repository=assembled)
            wants_api = _wants_frontdoor(llm, frontend, startup_timeout)
            startup_timeout = startup_timeout or engine_startup_timeout(llm and llm.engine)
            preparation = None
            if wants_api:
                # lazy: fastapi and uvicorn (and the tokenizer) only with the API on
                from ..frontend.backend import FrontendServer

                openai = FrontendServer.of(frontend, server.grpc_url, shutdown_grace_s + 5,
                                           server.metrics_url)
                if assembled:  # the llm's settings are ours: prepare while Triton loads
                    preparation = Preparation(openai, llm)
                    preparation.start()
            if stopping.is_set():
                raise StartInterrupted("stopped before tritonserver was started")
            # start(), not launch(): a supervisor's restart waits as it did
            server.start(startup_timeout, stop_requested=stopping.is_set)
        except (InstallError, ValueError, RuntimeError, TimeoutError, OSError) as error:
            # OSError: a path of the options (--log, a profile) or a port refused
            print(f"simple-sampler serve: {error}", file=sys.stderr)
            return 2
        supervisor = Supervisor(server).start() if supervise else None
        if openai is not None:
            try:
                start_frontdoor(openai, preparation, stopping)
            except StartFailed as error:
                print(f"simple-sampler serve: the OpenAI frontend did not start: {error} "
                      f"(--openai-port 0 turns it off)", file=sys.stderr)
                return 2
        if stopping.is_set():
            raise StartInterrupted("stopped before every endpoint answered")
        described = engine_spec(llm.engine).describe(llm) if llm is not None else ""
        print(f"Triton is ready{f' ({described})' if described else ''}: HTTP {server.http_url}, "
              f"gRPC {server.grpc_url}, metrics {server.metrics_url}")
        print(f"model repository: {repository}; server log: {log_path}", flush=True)
        if openai is not None:
            print(f"openai frontend ready on {openai.url}/v1 (model {openai.served.model_id})",
                  flush=True)
            heap.freeze("serve (the OpenAI front door)")  # its tokenizer and app stay
        if demo:
            show_demo(server, demo, stopping, streams=llm is None or llm.decoupled_mode)
        while not stopping.is_set() and (server.process.poll() is None or (
                supervisor is not None and supervisor.restarting.is_set())):
            stopping.wait(0.5)
    except StartInterrupted:
        pass  # the cleanup below; stopping is set
    finally:
        status = _stop(server, supervisor, openai, stopping, shutdown_grace_s)
        if assembled and server is None and repository is not None:  # else the server does
            shutil.rmtree(repository, ignore_errors=True)
        _remove_unwritten(log_dir)
    if stopping.is_set() and (status == 0 or not server.was_ready):
        print("simple-sampler serve: stopped", flush=True)
        return 0
    if stopping.is_set():  # Triton gave up on a model at its exit timeout, or was killed
        print(f"simple-sampler serve: stopped, but tritonserver exited with status {status} "
              f"(a model died or did not unload in time: see {log_path})", file=sys.stderr)
        return 1
    print(f"simple-sampler serve: tritonserver exited with status {status}", file=sys.stderr)
    return status if status is not None and status > 0 else 1  # a signal's -N too


def _wants_frontdoor(llm, frontend, startup_timeout) -> bool:
    """Whether the OpenAI front door starts (an llm and a port), with the
    options refused before Triton starts: a timeout not above 0, its port taken."""
    if startup_timeout is not None and not startup_timeout > 0:
        raise ValueError(f"startup_timeout must be > 0 seconds, got {startup_timeout}")
    wants = llm is not None and frontend is not None and bool(frontend.openai_port)
    if wants and port_in_use(frontend.openai_port):
        raise ValueError(f"port {frontend.openai_port} (openai port) is already in use; "
                         f"choose another or stop what holds it (--openai-port 0: no API)")
    return wants


def _remove_unwritten(log_dir: Path | None) -> None:
    """Remove the temporary log folder of a start refused before Triton
    wrote to it (a port in use, bad settings): nothing to read is left
    behind. A log that was written stays where serve said it is."""
    log = None if log_dir is None else log_dir / LOG_NAME
    if log is not None and (not log.exists() or log.stat().st_size == 0):
        shutil.rmtree(log_dir, ignore_errors=True)


def start_frontdoor(openai, preparation: Preparation | None, stopping: threading.Event) -> None:
    """Finish the front door's start once Triton is ready: its preparation
    (here, in a thread, when the repository was not ours), listening, and
    its /health answering 200. Returns early on a stop; raises StartFailed."""
    if preparation is None:
        preparation = Preparation(openai, None)
        preparation.start()
    while preparation.is_alive() and not stopping.is_set():
        preparation.join(0.1)
    if stopping.is_set():
        return
    if preparation.error is not None:
        raise StartFailed(str(preparation.error))
    try:
        openai.start(stop_requested=stopping.is_set)
    except Exception as error:  # noqa: BLE001 - Triton is up: stop it, say why
        log.exception("the OpenAI frontend did not start")
        raise StartFailed(str(error)) from error
    if stopping.is_set():
        return
    if not wait_for(lambda: frontdoor_healthy(openai.url), stopping, FRONTDOOR_HEALTH_TIMEOUT_S):
        if not stopping.is_set():
            raise StartFailed(f"{openai.url}/health did not answer 200 within "
                              f"{FRONTDOOR_HEALTH_TIMEOUT_S:.0f} s")


#: How long a stop waits after the drain for the supervisor to end a reload
#: under way before Triton is stopped (out of the stop margin's 20 s)
SUPERVISOR_STOP_WAIT_S = 5.0


def _stop(server, supervisor, openai, stopping: threading.Event, shutdown_grace_s: float):
    """The one cleanup of every way `run` ends; returns tritonserver's status."""
    if openai is not None:  # first: no new request reaches a server going away
        openai.close()
    # The supervisor watches on through the drain (a sampler instance dying
    # then is reloaded: its requests still finish), restarting nothing; it
    # stops before Triton does, or now when a restart is under way.
    if supervisor is not None and (server is None or not stopping.is_set()
                                   or not supervisor.hold_restarts()):
        supervisor.stop()
    if server is None:
        return None
    if stopping.is_set():
        if server.was_ready:
            print(f"simple-sampler serve: stopping (in-flight requests get "
                  f"{shutdown_grace_s:.0f} s)", flush=True)
        else:
            print("simple-sampler serve: stopping before it was ready", flush=True)
    # drains: open OpenAI responses finish or get its error
    status = server.stop(drained=None if supervisor is None else
                         lambda: supervisor.stop(wait_s=SUPERVISOR_STOP_WAIT_S))
    if openai is not None:
        openai.stop()
    if supervisor is not None:
        supervisor.stop()  # had Triton exited already, `drained` was not called
        supervisor.cleanup()
    return status
