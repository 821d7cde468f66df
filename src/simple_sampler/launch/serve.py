"""`simple-sampler serve`: a real Triton server with our model repository.

The repository is assembled in a temporary directory from the project's
``model_repository/`` templates with the placeholders filled (the source is
never modified), or taken as given with --model-repository. The server runs
in the foreground: Ctrl-C or SIGTERM stops it cleanly (in-flight requests
get a grace period, then a final error), and its exit status is ours. A
model whose stub process dies is reloaded while the server runs
(supervisor.py).
"""
from __future__ import annotations

import dataclasses
import logging
import signal
import sys
import tempfile
import threading
from pathlib import Path

from ..serving.engines import engine_spec, startup_timeout as engine_startup_timeout
from ..settings import FrontendSettings, LlmSettings, SamplerSettings
from .install import InstallError, project_file
from .server import MiB, TritonServer, port_in_use, write_model
from .supervisor import Supervisor

log = logging.getLogger(__name__)


def assemble_repository(destination: Path, sampler: SamplerSettings,
                        llm: LlmSettings | None = None) -> Path:
    """The sampler alone, or (with `llm`) the whole generation repository:
    ensemble, preprocessing, llm and simple_sampler. Raises ValueError for
    settings out of range."""
    if llm is not None and engine_spec(llm.engine).hot_profile and sampler.hot_vocab_profile:
        sampler, llm = _map_hot_vocab(destination, sampler, llm)
    write_model(destination, "simple_sampler", "simple_sampler",
                sampler.validate().template_values())
    if llm is not None:
        values = llm.validate().template_values()
        write_model(destination, "ensemble", "ensemble",
                    {"generate_max_batch_size": llm.generate_max_batch_size})
        write_model(destination, "preprocessing", "preprocessing",
                    {k: values[k] for k in ("generate_max_batch_size", "preprocessing_instances",
                                            "model")})
        write_model(destination, "llm", "llm",
                    {k: v for k, v in values.items() if k != "preprocessing_instances"})
    return destination


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


def show_demo(server: TritonServer, prompt: str) -> None:
    """Stream one answer over gRPC, as a user's client would."""
    from ..client import GenerateClient, GenerationError

    print(f"\n> {prompt}\n", flush=True)
    try:
        for chunk in GenerateClient(server.grpc_url, "grpc").stream(
                prompt, max_tokens=64, apply_chat_template=True, temperature=0.7, top_p=0.9,
                seed=0):
            print(chunk.text, end="", flush=True)
        print(f"\n\n(curl -s http://{server.http_url}/v2/models/ensemble/generate -d "
              f"'{{\"text_input\": \"Hello\", \"max_tokens\": 16}}')\nCtrl-C stops the server.",
              flush=True)
    except GenerationError as error:
        print(f"demo request failed: {error}", file=sys.stderr, flush=True)


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
    `frontend`: the OpenAI-compatible API, started once Triton is ready
    (with an llm; port 0: off) and stopped before Triton."""
    try:
        if repository is None:
            repository = assemble_repository(Path(tempfile.mkdtemp(prefix="simple-sampler-repo-")),
                                             sampler, llm)
            log.info("model repository %s: %s; %s", repository, sampler,
                     llm or "no llm (--sampler-only)")
        log_path = log_path or Path(tempfile.mkdtemp(prefix="simple-sampler-log-")) / "tritonserver.log"
        server = TritonServer(repository, http_port, grpc_port, metrics_port,
                              shm_bytes=shared_memory_bytes(sampler), log_path=log_path,
                              shutdown_grace_s=shutdown_grace_s, log_level=log_level)
        if startup_timeout is not None and not startup_timeout > 0:
            raise ValueError(f"startup_timeout must be > 0 seconds, got {startup_timeout}")
        if (llm is not None and frontend is not None and frontend.openai_port
                and port_in_use(frontend.openai_port)):
            raise ValueError(f"port {frontend.openai_port} (openai port) is already in use; "
                             f"choose another or stop what holds it (--openai-port 0: no API)")
        startup_timeout = startup_timeout or engine_startup_timeout(llm and llm.engine)
        server.start(startup_timeout)
    except (InstallError, ValueError, RuntimeError, TimeoutError) as error:
        print(f"simple-sampler serve: {error}", file=sys.stderr)
        return 2
    supervisor = Supervisor(server).start() if supervise else None
    described = engine_spec(llm.engine).describe(llm) if llm is not None else ""
    print(f"Triton is ready{f' ({described})' if described else ''}: HTTP {server.http_url}, gRPC {server.grpc_url}, "
          f"metrics {server.metrics_url}")
    print(f"model repository: {repository}; server log: {log_path}", flush=True)
    openai = None
    if llm is not None and frontend is not None and frontend.openai_port:
        # lazy: fastapi and uvicorn (and the tokenizer it loads) only with the API on
        from ..frontend.backend import FrontendServer

        try:
            openai = FrontendServer(server.grpc_url, frontend.openai_host, frontend.openai_port,
                                    grace_s=shutdown_grace_s + 5).start()
        except Exception as error:  # noqa: BLE001 - Triton is up: stop it, say why
            log.exception("the OpenAI frontend did not start")
            print(f"simple-sampler serve: the OpenAI frontend did not start: {error} "
                  f"(--openai-port 0 turns it off)", file=sys.stderr)
            if supervisor is not None:
                supervisor.stop()
            server.stop()
            return 2
        print(f"openai frontend ready on {openai.url}/v1 (model {openai.served.model_id})",
              flush=True)
    stopping = threading.Event()

    def stop(signum, _frame):
        # Only note it: the main thread drains and stops the server.
        stopping.set()

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if demo:
            show_demo(server, demo)
        while not stopping.is_set() and (server.process.poll() is None or (
                supervisor is not None and supervisor.restarting.is_set())):
            stopping.wait(0.5)
    finally:
        if openai is not None:  # first: no new request reaches a server going away
            openai.close()
        if supervisor is not None:
            supervisor.stop()
        if stopping.is_set():
            print(f"simple-sampler serve: stopping (in-flight requests get "
                  f"{shutdown_grace_s:.0f} s)", flush=True)
        status = server.stop()  # drains: open OpenAI responses finish or get its error
        if openai is not None:
            openai.stop()
        if supervisor is not None:
            supervisor.cleanup()
        for s, handler in previous.items():
            signal.signal(s, handler)
    if stopping.is_set() and status == 0:
        print("simple-sampler serve: stopped", flush=True)
        return 0
    if stopping.is_set():  # Triton gave up on a model at its exit timeout, or was killed
        print(f"simple-sampler serve: stopped, but tritonserver exited with status {status} "
              f"(a model did not unload in time: see {log_path})", file=sys.stderr)
        return 1
    print(f"simple-sampler serve: tritonserver exited with status {status}", file=sys.stderr)
    return status or 1
