"""`simple-sampler perf`: Triton's perf_analyzer against the `ensemble`.

For each sampling mode a fresh server runs the whole repository (the same
servers as `bench serve`), and perf_analyzer drives it over gRPC streaming
with the shipped input data (client/perf_inputs.json: the bench prompt set,
chat template, max_tokens = min_length = 64, temperature 1, a seed per
prompt) at each concurrency of the sweep. perf_analyzer measures in windows
of `2 x concurrency` completed requests (4 at least) until three in a row agree within
`stability_percent`; its profile export (every request's send time and
response times) is kept, and the figures are computed from the requests of
those last three windows:

* tokens/s: responses (one per generated token: the decode loop streams
  each step) inside the windows, over the windows' duration;
* inter-token latency: gaps between a request's consecutive responses;
* latency: first send to last response; TTFT: to the first response.

perf_analyzer's own summary (requests/s, responses/s, P95 latency) is
reported beside them.
"""
from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from ..launch.install import project_file
from .serve.measuring import mode_server, settings

PERF_MODES = ("simple", "inline")
STABLE_WINDOWS = 3  # perf_analyzer's default: the measurement is the last three windows


class PerfError(RuntimeError):
    """perf_analyzer is missing or failed; the message says what to do."""


def find_perf_analyzer(explicit: str | None = None) -> str:
    """An explicit path, else $PERF_ANALYZER, else `make perf`'s .perf/, else PATH."""
    candidates = [explicit, os.environ.get("PERF_ANALYZER")]
    try:
        candidates.append(str(project_file(".perf/bin/perf_analyzer")))
    except RuntimeError:
        pass
    candidates.append(shutil.which("perf_analyzer"))
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise PerfError("perf_analyzer not found: run `make perf` (it installs one into .perf/), "
                    "or pass --perf-analyzer PATH, or set $PERF_ANALYZER")


def shipped_inputs() -> Path:
    return project_file("client/perf_inputs.json")


def analyzer_command(binary: str, url: str, concurrency: int, inputs: Path, export: Path,
                     summary: Path, stability_percent: int) -> list[str]:
    return [binary, "-m", "ensemble", "-u", url, "-i", "grpc", "--streaming",
            "--input-data", str(inputs), "--concurrency-range", f"{concurrency}:{concurrency}",
            "--measurement-mode", "count_windows",
            "--measurement-request-count", str(max(4, 2 * concurrency)),
            "--stability-percentage", str(stability_percent),
            "--profile-export-file", str(export), "-f", str(summary)]


def run_analyzer(command: list[str], label: str) -> None:
    """Runs perf_analyzer, its progress lines on stderr."""
    print(f"[perf] {label}: {' '.join(command)}", file=sys.stderr, flush=True)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    head, tail = [], []  # perf_analyzer states an error first, then prints its usage
    for line in process.stdout:
        if len(head) < 5:
            head.append(line)
        else:
            tail = (tail + [line])[-15:]
        if line.strip().startswith(("Pass [", "Request concurrency", "Client:", "Throughput",
                                    "Response Throughput", "p95 latency")):
            print(f"[perf] {label}: {line.strip()}", file=sys.stderr, flush=True)
    if process.wait() != 0:
        skipped = ["...\n"] if tail else []
        raise PerfError(f"perf_analyzer failed ({label}, exit {process.returncode}):\n"
                        + "".join(head + skipped + tail))


def figures_from_export(export: dict) -> dict:
    """The figures of the last experiment in a perf_analyzer profile export."""
    experiment = export["experiments"][-1]
    bounds = experiment["window_boundaries"]
    start, end = bounds[max(0, len(bounds) - 1 - STABLE_WINDOWS)], bounds[-1]
    tokens, gaps, latencies, ttfts, completed = 0, [], [], [], 0
    for request in experiment["requests"]:
        times = request["response_timestamps"]
        tokens += sum(start <= t < end for t in times)
        if not times or not start <= times[-1] < end:
            continue
        completed += 1
        latencies.append(times[-1] - request["timestamp"])
        ttfts.append(times[0] - request["timestamp"])
        gaps.extend(np.diff(times).tolist())
    if not completed:
        raise PerfError("perf_analyzer's export has no request completed in its last windows")
    seconds, ms = (end - start) / 1e9, lambda ns, q: float(np.percentile(ns, q)) / 1e6
    return {"concurrency": experiment["experiment"]["value"],
            "requests_per_s": completed / seconds, "tokens_per_s": tokens / seconds,
            "p50_latency_ms": ms(latencies, 50), "p95_latency_ms": ms(latencies, 95),
            "p50_itl_ms": ms(gaps, 50), "p95_itl_ms": ms(gaps, 95),
            "p50_ttft_ms": ms(ttfts, 50), "p95_ttft_ms": ms(ttfts, 95),
            "requests": completed, "tokens": tokens, "window_s": seconds}


def analyzer_summary(path: Path) -> dict:
    """perf_analyzer's own figures from its -f CSV."""
    with open(path) as handle:
        row = next(csv.DictReader(handle))
    return {"requests_per_s": float(row["Inferences/Second"]),
            "responses_per_s": float(row.get("Response Throughput") or "nan"),
            "p95_latency_ms": float(row["p95 latency"]) / 1e3}


def measure(command: list[str], export: Path, label: str, attempts: int = 2) -> dict:
    """Runs perf_analyzer and returns its parsed profile export. perf_analyzer
    2.50 has been seen to exit 0 with the export cut off at a 64 KiB
    boundary; such a level is measured again, said on stderr."""
    for attempt in range(1, attempts + 1):
        export.unlink(missing_ok=True)  # perf_analyzer refuses to overwrite it
        run_analyzer(command, label)
        try:
            return json.loads(export.read_text())
        except json.JSONDecodeError as error:
            print(f"[perf] {label}: the profile export is not complete JSON ({error}; "
                  f"{export.stat().st_size} bytes), attempt {attempt} of {attempts}",
                  file=sys.stderr, flush=True)
    raise PerfError(f"perf_analyzer wrote an incomplete profile export {attempts} times ({label})")


def run(perf_analyzer: str, concurrencies=(1, 8, 32), modes=PERF_MODES,
        inputs: Path | None = None, export_dir: Path | None = None, instances: int = 2,
        stability_percent: int = 20) -> dict:
    inputs = inputs or shipped_inputs()
    export_dir = export_dir or Path(tempfile.mkdtemp(prefix="simple-sampler-perf-"))
    export_dir.mkdir(parents=True, exist_ok=True)
    max_tokens = json.loads(inputs.read_text())["data"][0]["max_tokens"][0]
    results = []
    for mode in modes:
        print(f"[perf] starting the server for {mode}", file=sys.stderr, flush=True)
        with mode_server(mode, max(concurrencies), instances, log_dir=export_dir) as server:
            for concurrency in concurrencies:
                export = export_dir / f"{mode}-c{concurrency}.json"
                summary = export_dir / f"{mode}-c{concurrency}.csv"
                command = analyzer_command(perf_analyzer, server.grpc_url, concurrency, inputs,
                                           export, summary, stability_percent)
                figures = figures_from_export(measure(command, export, f"{mode} c={concurrency}"))
                results.append({"mode": mode, **figures,
                                "perf_analyzer": analyzer_summary(summary),
                                "export": str(export)})
    return {"kind": "perf_analyzer", "results": results,
            "settings": {**settings(max_tokens, instances), "inputs": str(inputs),
                         "stability_percent": stability_percent}}


def format_table(report: dict) -> str:
    lines = [f"{'mode':<8} {'conc':>4} {'tok/s':>7} {'req/s':>6} {'P95 lat':>8} "
             f"{'ITL p50':>8} {'ITL p95':>8} {'TTFT p95':>9}"]
    for r in report["results"]:
        lines.append(f"{r['mode']:<8} {r['concurrency']:>4} {r['tokens_per_s']:>7.1f} "
                     f"{r['requests_per_s']:>6.2f} {r['p95_latency_ms'] / 1e3:>7.2f}s "
                     f"{r['p50_itl_ms']:>6.0f}ms {r['p95_itl_ms']:>6.0f}ms "
                     f"{r['p95_ttft_ms']:>7.0f}ms")
    by = {(r["mode"], r["concurrency"]): r for r in report["results"]}
    for concurrency in sorted({r["concurrency"] for r in report["results"]}):
        if ("simple", concurrency) in by and ("inline", concurrency) in by:
            s, i = by[("simple", concurrency)], by[("inline", concurrency)]
            lines.append(f"c={concurrency}: simple/inline tokens/s "
                         f"{s['tokens_per_s'] / i['tokens_per_s']:.2f}x, P95 ITL "
                         f"{s['p95_itl_ms']:.0f} vs {i['p95_itl_ms']:.0f} ms")
    return "\n".join(lines)
