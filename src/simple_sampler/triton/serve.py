"""`simple-sampler serve`: a real Triton server with our model repository.

The repository is assembled in a temporary directory from the project's
``model_repository/`` templates with the placeholders filled (the source is
never modified), or taken as given with --model-repository. The server runs
in the foreground: Ctrl-C or SIGTERM stops it cleanly (Triton finishes the
requests in flight), and its exit status is ours.
"""
from __future__ import annotations

import signal
import sys
import tempfile
from pathlib import Path

from .install import InstallError
from .server import MiB, SamplerConfig, TritonServer, write_model


def assemble_repository(destination: Path, sampler: SamplerConfig) -> Path:
    sampler.validate()
    write_model(destination, "simple_sampler", "simple_sampler", vars(sampler))
    return destination


def shared_memory_bytes(sampler: SamplerConfig) -> int:
    """Per-instance pool: one full request of logits plus room for its
    parameters and outputs, at least the 64 MiB floor."""
    return max(64 * MiB, sampler.request_bytes() + 16 * MiB)


def run(sampler: SamplerConfig, http_port: int, grpc_port: int, metrics_port: int,
        repository: Path | None = None, log_path: Path | None = None) -> int:
    try:
        if repository is None:
            repository = assemble_repository(Path(tempfile.mkdtemp(prefix="simple-sampler-repo-")),
                                             sampler)
        log_path = log_path or Path(tempfile.mkdtemp(prefix="simple-sampler-log-")) / "tritonserver.log"
        server = TritonServer(repository, http_port, grpc_port, metrics_port,
                              shm_bytes=shared_memory_bytes(sampler), log_path=log_path)
        server.start()
    except (InstallError, ValueError, RuntimeError, TimeoutError) as error:
        print(f"simple-sampler serve: {error}", file=sys.stderr)
        return 2
    print(f"Triton is ready: HTTP {server.http_url}, gRPC {server.grpc_url}, "
          f"metrics {server.metrics_url}")
    print(f"model repository: {repository}; server log: {log_path}")
    stopping = []

    def stop(signum, _frame):
        # Only forward here: the main thread is blocked in wait() and stops
        # the server (with its SIGKILL fallback) once that returns.
        stopping.append(signum)
        server.terminate()

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        status = server.process.wait()
    finally:
        server.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
    if stopping:
        print("simple-sampler serve: stopped")
        return 0
    print(f"simple-sampler serve: tritonserver exited with status {status}", file=sys.stderr)
    return status or 1
