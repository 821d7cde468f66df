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

import signal
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from ..serving.decoder import SAMPLING_MODES
from ..serving.batch_invariant import NEEDS_TORCH
from ..serving.engine import ENGINES
from ..serving.simulated import LABEL, SimulatedSpec

from .install import InstallError
from .server import MiB, SamplerConfig, TritonServer, write_model
from .sampler_pool import parse_endpoints
from .supervisor import Supervisor
from .startup import default_startup_timeout


@dataclass
class LlmConfig:
    """The values of the ensemble's, preprocessing's and llm's placeholders.

    model: "" for SmolLM2-135M-Instruct, else a local Hugging Face directory
    or GGUF file; engine: torch (PyTorch, CPU) | tensorrt_llm (GPUs, model a
    checkpoint or engine directory; docs/GPU.md), with tensor_parallel_size
    and pipeline_parallel_size for tensorrt_llm | simulated (no model, a
    GPU-paced stand-in for benchmarks; model is its ``simulated:...`` spec,
    docs/SIMULATED.md); sampling_mode: simple |
    inline | inline_kernels;
    engine_max_batch_size: sequences decoded together (more wait in a queue);
    micro_batches: lanes the active sequences are split into, so one is
        sampled while another's forward runs; 1 by default, since on a CPU
        data plane a split re-reads the weights and competes for the cores
        (bench serve measures both);
    sampler_shards: concurrent sampler requests per micro-batch to this
        server's sampler instances;
    sampler_endpoints: where rows are sampled: "local" (this server's
        instances) and/or host:port gRPC endpoints of other servers'
        simple_sampler model, comma-separated (sampler_pool.py);
    shutdown_grace_s: on shutdown, time in-flight requests get to finish;
    batch_invariant: the torch engine's batch-invariant mode (logits of a
        sequence independent of the rest of the step), off by default for its
        cost (README, "Same seed, same text").
    """

    model: str = ""
    engine: str = "torch"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    sampling_mode: str = "simple"
    triton_max_batch_size: int = 64
    preprocessing_instances: int = 1
    engine_max_batch_size: int = 32
    max_context: int = 1024
    micro_batches: int = 1
    sampler_shards: int = 2
    sampler_model: str = "simple_sampler"
    sampler_endpoints: str = "local"
    shutdown_grace_s: float = 30.0
    batch_invariant: bool = False

    def validate(self) -> None:
        if self.sampling_mode not in SAMPLING_MODES:
            raise ValueError(f"sampling_mode must be one of {', '.join(SAMPLING_MODES)}, "
                             f"got {self.sampling_mode!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if (self.engine == "simulated") != SimulatedSpec.is_spec(self.model):
            raise ValueError("engine simulated takes its spec as model ('simulated:vocab=...', "
                             "serving/simulated.py), and only it does")
        if self.engine == "simulated":
            SimulatedSpec.parse(self.model)
        if self.engine == "tensorrt_llm" and not self.model:
            raise ValueError("engine tensorrt_llm needs model: a Hugging Face checkpoint or "
                             "TensorRT-LLM engine directory")
        parse_endpoints(self.sampler_endpoints)
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        if self.engine != "tensorrt_llm" and (self.tensor_parallel_size, self.pipeline_parallel_size) != (1, 1):
            raise ValueError("tensor_parallel_size and pipeline_parallel_size apply to engine "
                             "tensorrt_llm only")
        if self.batch_invariant and self.engine != "torch":
            raise ValueError(NEEDS_TORCH)
        for name in ("triton_max_batch_size", "preprocessing_instances", "engine_max_batch_size",
                     "micro_batches", "sampler_shards", "tensor_parallel_size",
                     "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def assemble_repository(destination: Path, sampler: SamplerConfig,
                        llm: LlmConfig | None = None) -> Path:
    """The sampler alone, or (with `llm`) the whole generation repository:
    ensemble, preprocessing, llm and simple_sampler."""
    sampler.validate()
    write_model(destination, "simple_sampler", "simple_sampler", vars(sampler))
    if llm is not None:
        llm.validate()
        values = vars(llm)
        write_model(destination, "ensemble", "ensemble",
                    {"triton_max_batch_size": llm.triton_max_batch_size})
        write_model(destination, "preprocessing", "preprocessing",
                    {k: values[k] for k in ("triton_max_batch_size", "preprocessing_instances",
                                            "model")})
        write_model(destination, "llm", "llm",
                    {**{k: v for k, v in values.items() if k != "preprocessing_instances"},
                     "batch_invariant": str(llm.batch_invariant).lower()})
    return destination


def shared_memory_bytes(sampler: SamplerConfig) -> int:
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


def run(sampler: SamplerConfig, http_port: int, grpc_port: int, metrics_port: int,
        llm: LlmConfig | None = None, repository: Path | None = None,
        log_path: Path | None = None, demo: str | None = None,
        shutdown_grace_s: float = 30.0, supervise: bool = True, log_level: str = "INFO",
        startup_timeout: float | None = None) -> int:
    """Serve until SIGINT/SIGTERM: then in-flight requests get
    `shutdown_grace_s` to finish and a final error after it, Triton stops,
    and no stub or shared-memory region is left. With `supervise`, a model
    whose stub process dies is reloaded (supervisor.py). `startup_timeout`:
    how long the models may take to load (default per engine, startup.py)."""
    try:
        if repository is None:
            repository = assemble_repository(Path(tempfile.mkdtemp(prefix="simple-sampler-repo-")),
                                             sampler, llm)
        log_path = log_path or Path(tempfile.mkdtemp(prefix="simple-sampler-log-")) / "tritonserver.log"
        server = TritonServer(repository, http_port, grpc_port, metrics_port,
                              shm_bytes=shared_memory_bytes(sampler), log_path=log_path,
                              shutdown_grace_s=shutdown_grace_s, log_level=log_level)
        if startup_timeout is not None and not startup_timeout > 0:
            raise ValueError(f"startup_timeout must be > 0 seconds, got {startup_timeout}")
        startup_timeout = startup_timeout or default_startup_timeout(llm and llm.engine)
        server.start(startup_timeout)
    except (InstallError, ValueError, RuntimeError, TimeoutError) as error:
        print(f"simple-sampler serve: {error}", file=sys.stderr)
        return 2
    supervisor = Supervisor(server).start() if supervise else None
    simulated = f" ({LABEL}: {llm.model}; no model runs)" if llm and llm.engine == "simulated" \
        else ""
    print(f"Triton is ready{simulated}: HTTP {server.http_url}, gRPC {server.grpc_url}, "
          f"metrics {server.metrics_url}")
    print(f"model repository: {repository}; server log: {log_path}", flush=True)
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
        if supervisor is not None:
            supervisor.stop()
        if stopping.is_set():
            print(f"simple-sampler serve: stopping (in-flight requests get "
                  f"{shutdown_grace_s:.0f} s)", flush=True)
        status = server.stop()
        if supervisor is not None:
            supervisor.cleanup()
        for s, handler in previous.items():
            signal.signal(s, handler)
    if stopping.is_set():
        print("simple-sampler serve: stopped", flush=True)
        return 0
    print(f"simple-sampler serve: tritonserver exited with status {status}", file=sys.stderr)
    return status or 1
