"""`simple-sampler bench sampler-server`: rows/s through a real Triton server.

For n = 1 .. N instances (a fresh server each), clients keep 2n requests in
flight over gRPC; each request is B rows of V logits (real SmolLM2 rows at
V=49,152) placed once in system shared memory and registered with the
server, so only the parameter tensors travel per request. Settings: the
kernels bench's `simple` (every feature on, 256 history tokens per row).
The ceiling is the same kernel call in this process, one thread.

The overhead breakdown at n = 1, one request in flight, comes from Triton's
own per-model counters (queue, input handling, execute, output handling)
and the sampler's own execute time, next to the client's round trip and the
in-process time for the same request, for shared-memory and inline logits.

With ``--endpoints N`` it measures the decision plane across servers instead:
for k = 1 .. N sampler-only servers of one instance each, one client process
drives the decode loop's own SamplerPool over all k endpoints (each step's
rows split between them and sent inline over gRPC, as between hosts), with
2k steps in flight.
"""
from __future__ import annotations

import re
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from ...rows import rows_for
from ...sampling import sample
from ...params import SamplingBatch
from ...triton.counters import wait_for_counter
from ...triton.sampler_client import SamplerClient
from ...triton.sampler_codec import batch_arrays
from ...triton.sampler_pool import SamplerPool
from ...triton.sampler_targets import RemoteSampler, SamplerTarget
from ...settings import SamplerSettings
from ...launch.server import MiB, TritonServer
from ...launch.templates import write_model
from ..kernels.measuring import ALL_FEATURES, make_batch

TRITON_COUNTERS = ("nv_inference_request_success", "nv_inference_queue_duration_us",
                   "nv_inference_compute_input_duration_us",
                   "nv_inference_compute_infer_duration_us",
                   "nv_inference_compute_output_duration_us")


def bench_rows(vocab: int, batch_size: int):
    """The benchmark's rows (real SmolLM2 rows at V=49,152), their batch
    (bench kernels' 'simple' settings) and a shared-memory pool that fits them."""
    rows = np.ascontiguousarray(rows_for(vocab, batch_size), np.float32)
    return rows, make_batch(ALL_FEATURES, rows, history_tokens=256), max(64 * MiB, 4 * rows.nbytes)


def sampler_server(instances: int, batch_size: int, vocab: int, shm_bytes: int,
                   log: Path | None) -> TritonServer:
    """A sampler-only server (not yet started) in a fresh repository."""
    repository = Path(tempfile.mkdtemp(prefix="simple-sampler-bench-"))
    write_model(repository, "simple_sampler", "simple_sampler",
                SamplerSettings(sampler_instances=instances, sampler_max_batch_size=batch_size,
                                vocab_size=vocab).template_values())
    return TritonServer(repository, shm_bytes=shm_bytes, log_path=log, temporary_repository=True)


def in_process_rows_per_s(rows: np.ndarray, batch, seconds: float) -> float:
    sample(rows, batch, num_threads=1)
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        sample(rows, batch, num_threads=1)
        done += 1
    return done * len(rows) / (time.perf_counter() - start)


def serve_rows_per_s(server: TritonServer, rows: np.ndarray, arrays: dict, in_flight: int,
                     seconds: float) -> float:
    """Rows/s with `in_flight` client threads each sending back to back."""
    clients = [SamplerClient(server.grpc_url, "grpc") for _ in range(in_flight)]
    regions = [client.share(rows) for client in clients]
    for client, region in zip(clients, regions):
        client.sample(shm_logits=region, **arrays)  # warm up every connection
    counts = [0] * in_flight
    stop = threading.Event()

    def worker(index: int):
        while not stop.is_set():
            clients[index].sample(shm_logits=regions[index], **arrays)
            counts[index] += 1

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(in_flight)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    for client in clients:
        client.close()
    return sum(counts) * len(rows) / elapsed


def metric_totals(server: TritonServer) -> dict[str, float]:
    """Sum of each counter over the sampler's instances and versions, once
    the instances have sent every count so far (in batches: triton.counters)."""
    wait_for_counter(server.metrics_url, "simple_sampler_sample_duration_us_total",
                     lambda _: True, settled_after=time.monotonic())
    text = urllib.request.urlopen(server.metrics_url).read().decode()
    totals = {}
    for name in (*TRITON_COUNTERS, "simple_sampler_sample_duration_us_total"):
        values = re.findall(rf'^{name}\{{[^}}]*model="simple_sampler"[^}}]*\}} (\S+)', text, re.M)
        totals[name] = sum(float(v) for v in values)
    return totals


def overhead(server: TritonServer, rows: np.ndarray, arrays: dict, batch,
             requests: int) -> dict[str, float]:
    """Per-request microseconds, one request in flight: where the time goes."""
    client = SamplerClient(server.grpc_url, "grpc")
    region = client.share(rows)
    result = {}
    for label, call in (("shm", lambda: client.sample(shm_logits=region, **arrays)),
                        ("inline", lambda: client.sample(rows, **arrays))):
        call()
        before = metric_totals(server)
        start = time.perf_counter()
        for _ in range(requests):
            call()
        result[f"client_round_trip_us_{label}"] = (time.perf_counter() - start) / requests * 1e6
        after = metric_totals(server)
        delta = {k: (after[k] - before[k]) / requests for k in after}
        result[f"triton_queue_us_{label}"] = delta["nv_inference_queue_duration_us"]
        result[f"triton_input_us_{label}"] = delta["nv_inference_compute_input_duration_us"]
        result[f"triton_execute_us_{label}"] = delta["nv_inference_compute_infer_duration_us"]
        result[f"triton_output_us_{label}"] = delta["nv_inference_compute_output_duration_us"]
        result[f"sampler_execute_us_{label}"] = delta["simple_sampler_sample_duration_us_total"]
    client.close()
    sample(rows, batch, num_threads=1)
    start = time.perf_counter()
    for _ in range(requests):
        sample(rows, batch, num_threads=1)
    result["in_process_us"] = (time.perf_counter() - start) / requests * 1e6
    return result


def run(max_instances: int = 2, batch_size: int = 64, vocab: int = 49_152,
        seconds: float = 5.0, overhead_requests: int = 200, log_dir: Path | None = None) -> dict:
    rows, batch, shm_bytes = bench_rows(vocab, batch_size)
    arrays = batch_arrays(batch)
    results, breakdown = [], None
    for instances in range(1, max_instances + 1):
        log = (log_dir / f"tritonserver-{instances}.log") if log_dir else None
        with sampler_server(instances, batch_size, vocab, shm_bytes, log) as server:
            if instances == 1:
                breakdown = overhead(server, rows, arrays, batch, overhead_requests)
            results.append({"instances": instances,
                            "rows_per_s": serve_rows_per_s(server, rows, arrays, 2 * instances,
                                                           seconds)})
    ceiling = in_process_rows_per_s(rows, batch, seconds)
    return {"results": results, "in_process_rows_per_s": ceiling,
            "overhead_us_per_request": breakdown,
            "settings": {"batch": batch_size, "vocab": vocab, "rows": "smollm2"
                         if vocab == 49_152 else "synthetic", "params": "bench kernels 'simple'",
                         "logits": "system shared memory, gRPC", "in_flight": "2 x instances"}}


def format_report(report: dict) -> str:
    ceiling = report["in_process_rows_per_s"]
    lines = [f"{'instances':>9}  {'rows/s':>10}  {'vs 1 instance':>13}  {'vs in-process':>13}"]
    first = report["results"][0]["rows_per_s"]
    for entry in report["results"]:
        lines.append(f"{entry['instances']:>9}  {entry['rows_per_s']:>10.0f}  "
                     f"{entry['rows_per_s'] / first:>12.2f}x  {entry['rows_per_s'] / ceiling:>12.2f}x")
    lines.append(f"in-process (1 thread): {ceiling:.0f} rows/s")
    lines.append("per request at 1 instance, 1 in flight (us):")
    for key, value in report["overhead_us_per_request"].items():
        lines.append(f"  {key:<32} {value:10.1f}")
    return "\n".join(lines)


def pool_rows_per_s(pool: SamplerPool, rows: np.ndarray, batch: SamplingBatch, in_flight: int,
                    seconds: float) -> float:
    """Rows/s with `in_flight` steps of `rows` at a time through `pool`."""
    import asyncio

    import torch

    logits = torch.from_numpy(rows)

    async def drive() -> float:
        await pool(logits, batch)  # warm up every connection
        done, deadline = 0, time.perf_counter() + seconds

        async def worker():
            nonlocal done
            while time.perf_counter() < deadline:
                await pool(logits, batch)
                done += 1

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(in_flight)))
        return done * len(rows) / (time.perf_counter() - start)

    return asyncio.run(drive())


def run_endpoints(max_endpoints: int = 2, batch_size: int = 64, vocab: int = 49_152,
                  seconds: float = 5.0, log_dir: Path | None = None) -> dict:
    rows, batch, shm_bytes = bench_rows(vocab, batch_size)
    servers, results = [], []
    try:
        for index in range(max_endpoints):
            log = (log_dir / f"tritonserver-endpoint-{index}.log") if log_dir else None
            servers.append(sampler_server(1, batch_size, vocab, shm_bytes, log).start())
        for count in range(1, max_endpoints + 1):
            # 2 x count steps in flight: sharded as the decode loop's lanes are
            pool = SamplerPool([SamplerTarget(s.grpc_url, RemoteSampler(s.grpc_url), 1)
                                for s in servers[:count]], lanes=2 * count)
            results.append({"endpoints": count,
                            "rows_per_s": pool_rows_per_s(pool, rows, batch, 2 * count, seconds),
                            "bytes_per_step": int(rows.nbytes)})
    finally:
        for server in servers:
            server.stop()
    return {"results": results,
            "settings": {"batch": batch_size, "vocab": vocab, "rows": "smollm2"
                         if vocab == 49_152 else "synthetic", "params": "bench kernels 'simple'",
                         "logits": "inline over gRPC (as between hosts), float32",
                         "instances_per_endpoint": 1, "in_flight": "2 x endpoints",
                         "hosts": "every server on this machine (loopback)"}}


def format_endpoints_report(report: dict) -> str:
    lines = [f"{'endpoints':>9}  {'rows/s':>10}  {'vs 1 endpoint':>13}  {'MB per step':>11}"]
    first = report["results"][0]["rows_per_s"]
    for entry in report["results"]:
        lines.append(f"{entry['endpoints']:>9}  {entry['rows_per_s']:>10.0f}  "
                     f"{entry['rows_per_s'] / first:>12.2f}x  "
                     f"{entry['bytes_per_step'] / 1e6:>11.1f}")
    lines.append(f"({report['settings']['logits']}; {report['settings']['hosts']})")
    return "\n".join(lines)
