"""`simple-sampler bench serve`: the whole server, per sampling mode.

For each mode a fresh server runs the whole repository (SmolLM2 on CPU,
2 sampler instances). `simple` is the default deployment (one micro-batch:
on a CPU data plane a split re-reads the weights and competes with the
sampler for the same cores); `simple_overlap` splits the batch into two
micro-batches so one is sampled while the other's forward runs, the
configuration meant for a GPU data plane. At each concurrency c, c gRPC streaming clients each
send prompts from the shipped prompt set (chat template, default sampling:
temperature 1, no truncation), every request producing exactly
`max_tokens` tokens (min_length = max_tokens, so no early end). Measured by
the clients: output tokens/s over the wall time of the level, time to first
token, and the gaps between consecutive tokens (inter-token latency), P50
and P95 over every request. Measured inside the server (the llm model's
counters): the sampling share of step time = time sampling ran while no
forward did, over the time a forward or a sampler ran. With
``batch_invariant=(True, False)`` each mode runs on a server per setting of
the engine's batch-invariant mode, to measure what the mode costs.
"""
from __future__ import annotations

import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import Iterator

import numpy as np

from ...client import GenerateClient
from ...settings import SERVED_MODES, LlmSettings, SamplerSettings
from ...launch.serve import assemble_repository
from ...launch.server import TritonServer
from ..server_meter import llm_counters

COUNTERS = ("sampling_exposed_us", "busy_us", "data_plane_us", "sampler_us")


def prompts() -> list[str]:
    data = resources.files("simple_sampler").joinpath("data/prompts.json").read_text()
    return [p if isinstance(p, str) else p["text"] for p in json.loads(data)]


def one_request(client: GenerateClient, prompt: str, max_tokens: int, seed: int,
                stream_interval: int | None = None) -> dict:
    start = time.perf_counter()
    arrivals, tokens = [], 0
    interval = {} if stream_interval is None else {"stream_interval": stream_interval}
    # top_p 1: sampled (without top_k and top_p a request is greedy)
    for chunk in client.stream(prompt, max_tokens=max_tokens, min_length=max_tokens, seed=seed,
                               top_p=1.0, apply_chat_template=True, **interval):
        if chunk.token_ids:
            arrivals.append(time.perf_counter())
            tokens += len(chunk.token_ids)
    return {"ttft": arrivals[0] - start, "gaps": np.diff(arrivals).tolist(), "tokens": tokens}


def run_level(server: TritonServer, concurrency: int, requests: int, max_tokens: int,
              texts: list[str], stream_interval: int | None = None) -> dict:
    client = GenerateClient(server.grpc_url, "grpc")
    before = llm_counters(server, COUNTERS)
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda i: one_request(client, texts[i % len(texts)], max_tokens, i,
                                                      stream_interval), range(requests)))
    wall = time.perf_counter() - start
    after = llm_counters(server, COUNTERS)
    delta = {k: after[k] - before[k] for k in COUNTERS}
    gaps = np.concatenate([r["gaps"] for r in results]) * 1e3
    return {
        "concurrency": concurrency,
        "tokens_per_s": sum(r["tokens"] for r in results) / wall,
        "ttft_ms_p50": float(np.percentile([r["ttft"] * 1e3 for r in results], 50)),
        "itl_ms_p50": float(np.percentile(gaps, 50)),
        "itl_ms_p95": float(np.percentile(gaps, 95)),
        "sampling_share": delta["sampling_exposed_us"] / delta["busy_us"] if delta["busy_us"] else 0.0,
        "requests": requests,
        "data_plane_ms_per_token": delta["data_plane_us"] / 1e3 / max(1, sum(r["tokens"]
                                                                          for r in results)),
    }


@contextmanager
def mode_server(label: str, max_concurrency: int, instances: int = 2,
                log_dir: Path | None = None,
                batch_invariant: bool = False) -> Iterator[TritonServer]:
    """A fresh, warmed-up server running the whole repository in one of SERVED_MODES."""
    mode, micro_batches = SERVED_MODES[label]
    llm = LlmSettings(sampling_mode=mode, micro_batches=micro_batches, sampler_shards=instances,
                      engine_max_batch_size=max_concurrency, max_context=512,
                      batch_invariant=batch_invariant)
    repository = assemble_repository(
        Path(tempfile.mkdtemp(prefix="simple-sampler-bench-")),
        SamplerSettings(sampler_instances=instances, sampler_max_batch_size=max(64, max_concurrency),
                        vocab_size=49_152),
        llm)
    suffix = "-invariant" if batch_invariant else ""
    log = log_dir / f"tritonserver-{label}{suffix}.log" if log_dir else None
    with TritonServer(repository, log_path=log, temporary_repository=True) as server:
        run_level(server, 2, 2, 8, prompts())  # warm up: first prefill, first BLS calls
        yield server


def run(concurrencies=(1, 8, 32), modes=tuple(SERVED_MODES), max_tokens: int = 64,
        requests_per_client: int = 1, instances: int = 2, log_dir: Path | None = None,
        batch_invariant=(False,), stream_interval: int | None = None) -> dict:
    texts = prompts()
    results = []
    for label, (mode, micro_batches) in ((m, SERVED_MODES[m]) for m in SERVED_MODES
                                         if m in modes):
        for invariant in batch_invariant:
            with mode_server(label, max(concurrencies), instances, log_dir, invariant) as server:
                for concurrency in concurrencies:
                    level = run_level(server, concurrency,
                                      max(2, concurrency * requests_per_client), max_tokens, texts,
                                      stream_interval)
                    results.append({"mode": label, "sampling_mode": mode,
                                    "micro_batches": micro_batches,
                                    "batch_invariant": invariant, **level})
    return {"results": results, "settings": settings(max_tokens, instances, stream_interval)}


def settings(max_tokens: int, instances: int, stream_interval: int | None = None) -> dict:
    return {"model": "SmolLM2-135M-Instruct (CPU, float32)", "max_tokens": max_tokens,
            "sampler_instances": instances, "stream_interval": stream_interval or 1,
            "params": "temperature 1, no truncation, min_length = max_tokens"}


def format_report(report: dict) -> str:
    interval = report["settings"].get("stream_interval", 1)  # reports from before it: 1
    lines = [f"stream_interval {interval}: ITL is the gap between responses of {interval} tokens"
             ] if interval > 1 else []
    lines += [f"{'mode':<15} {'invariant':>9} {'conc':>4} {'tok/s':>8} {'TTFT p50':>9} "
             f"{'ITL p50':>8} {'ITL p95':>8} {'sampling':>8}"]
    for r in report["results"]:
        invariant = "on" if r.get("batch_invariant") else "off"
        lines.append(f"{r['mode']:<15} {invariant:>9} {r['concurrency']:>4} {r['tokens_per_s']:>8.1f} "
                     f"{r['ttft_ms_p50']:>8.0f}ms {r['itl_ms_p50']:>6.0f}ms {r['itl_ms_p95']:>6.0f}ms "
                     f"{r['sampling_share']:>8.3f}")
    by = {(r["mode"], r["concurrency"]): r for r in report["results"]
          if not r.get("batch_invariant")}
    top = max(r["concurrency"] for r in report["results"])
    if ("simple", top) in by and ("inline", top) in by:
        s, i = by[("simple", top)], by[("inline", top)]
        lines.append(f"at concurrency {top}: simple/inline tokens/s {s['tokens_per_s'] / i['tokens_per_s']:.2f}x, "
                     f"P95 ITL {100 * (1 - s['itl_ms_p95'] / i['itl_ms_p95']):.0f}% lower")
    return "\n".join(lines)
