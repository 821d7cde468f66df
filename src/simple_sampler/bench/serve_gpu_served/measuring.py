"""`simple-sampler bench serve-gpu-served`: the served GPU benchmark (issue
43, item 4): real Triton servers on the static data plane (``--engine static
--device cuda``), driven over gRPC from this host, beside the data plane's
bound measured in this process.

Per sampling mode one server (``serving.engines``' ``static`` engine over a
shipped shape's random weights, ``--model-config``, or a checkpoint,
``--model``): ``simple`` (full rows to the simple_sampler instances over the
shared-memory arena), ``simple_hot_first`` (the same with ``--handoff
hot-first``: the hot set's logits and a summary cross, the rest only when
needed) and ``inline`` (``serving/inline.py``'s batched ``gpu_inline``, in
the llm model, on the engine's device). Per (B, top_p) on each server: B
streams of a few tokens to warm up (each batch bucket's CUDA graph is
captured by its first step), then B concurrent streamed requests of
``max_tokens`` tokens from one asyncio client (``serve_cost.drive``), measured
between the first and last eighth of their tokens: tokens/s, ITL p50/p95, CPU
per token of every server process and of the client (``server_meter.Meter``,
from /proc), and the **server cores busy** (all server processes' CPU seconds
over the window's seconds: one GPU, so cores per GPU).

The bound (``forward_only``): ``bench serve-gpu``'s, in this process, before
any server starts: the decode step replayed with its argmax fed back on the
device, no host copy, no sampler, over the same shape, dtype, device and
static cache length (``max_context``) as the servers'. efficiency = a mode's
tokens/s over the bound's at the same B.

Random weights give nearly flat rows (the sampler's worst case): every
output names its rows. On the CPU (``--device cpu``, the tests) the figures
mean nothing. Run on an H200 once, from the offline bundle
(``scripts/gpu_session.sh``; docs/results/gpu-2026-11-28.md).
"""
from __future__ import annotations

import asyncio
import gc
import json
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from ...launch.serve import assemble_in_temp, shared_memory_bytes
from ...serving.engines import engine_spec, startup_timeout
from ...settings import LlmSettings
from ...stacks import INTERVAL_S as STACKS_INTERVAL_S, STACKS_ENV
from ..serve_cost.measuring import (RESPONSES_PER_REQUEST, drive, figures, sampler_figures,
                                    step_figures)
from ..serve_cost.repository import sampler_settings
from ..loop_profile import server_directory
from ..server_meter import Meter, llm_counters, sampler_counters, server_processes
from ..serve_cost.measuring import Config as Load

logger = logging.getLogger(__name__)

KIND = "serve-gpu-served"
BATCHES = (64, 256)
TOP_PS = (1.0, 0.95)
#: The shape the issue's goal is stated at (V >= 128K).
DEFAULT_SHAPE = "llama-3.2-1b"
#: A prompt's tokens at most (the ensemble's "Tell me a story." with or
#: without a chat template): the static cache holds it and max_tokens.
PROMPT_ROOM = 64
#: Each (B, top_p)'s warm-up: B streams of this many tokens.
WARM_UP_TOKENS = 4
#: forward_only's untimed steps before its window (the first one captures).
FORWARD_WARM_UP = 8
#: The route every request takes: what a user's client calls.
ROUTE = "ensemble"
#: The results so far, in the log folder, rewritten after each server.
PARTIAL = "partial.json"


@dataclass(frozen=True)
class ServedMode:
    """One server: its label, the llm model's sampling mode and handoff, and
    its decode loop's lanes (None: the run's ``micro_batches``)."""

    name: str
    sampling_mode: str
    handoff: str
    lanes: int | None = None


# inline first: the baseline every other mode's "x inline" needs, kept by a
# run cut off before its end
MODES = (ServedMode("inline", "inline", "full"),
         ServedMode("simple", "simple", "full"),
         ServedMode("simple_hot_first", "simple", "hot-first"),
         # two lanes, each its own window of the static engine's slots: the
         # sampler of one beside the other's forward (not run by default)
         ServedMode("simple_overlap", "simple", "full", lanes=2))
#: The modes a run takes unless told
DEFAULT_MODES = tuple(m for m in MODES if m.lanes is None)


def rows_label(model_config: str | None) -> str:
    return ("flat (random weights)" if model_config
            else "the checkpoint's own rows (its weights)")


def settled_llm_counters(server, before: dict, timeout_s: float = 10.0) -> dict:
    """``server_meter.llm_counters`` once the llm model's report of the level
    has arrived (it sends it as its last request ends): steps moved on."""
    deadline = time.monotonic() + timeout_s
    while (after := llm_counters(server))["steps"] <= before["steps"] \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    return after


def left_in_dev_shm(stubs) -> list[str]:
    """What a stopped server's stubs left in /dev/shm: their Python-backend
    regions and row arenas (``TritonServer.stop`` removes both)."""
    from ...launch.processes import SHM_DIRECTORY
    from ...launch.supervisor import arena_regions

    return [stub.shm_region for stub in stubs if (SHM_DIRECTORY / stub.shm_region).exists()] \
        + arena_regions(stub.pid for stub in stubs)


def static_settings(mode: ServedMode, device: str, dtype: str, model_config: str | None,
                    model: str | None, largest: int, instances: int, micro_batches: int,
                    stream_interval: int, max_context: int, hot_vocab_profile: str,
                    launch_ahead: str = LlmSettings.launch_ahead,
                    decode_step: str = "eager",
                    send_threads: int = LlmSettings.send_threads) -> LlmSettings:
    """The llm model's settings for one mode's server."""
    return LlmSettings(engine="static", device=device, torch_dtype=dtype,
                       model_config=model_config or "", model=model or "",
                       sampling_mode=mode.sampling_mode, handoff=mode.handoff,
                       engine_max_batch_size=largest, generate_max_batch_size=largest,
                       max_context=max_context, micro_batches=micro_batches,
                       stream_interval=stream_interval, launch_ahead=launch_ahead,
                       sampler_shards=instances, hot_vocab_profile=hot_vocab_profile,
                       compile_decode=decode_step == "compiled", send_threads=send_threads)


def forward_only_bounds(device: str, dtype: str, model_config: str | None, model: str | None,
                        batches, max_context: int,
                        decode_step: str = "eager") -> tuple[dict[int, dict], dict]:
    """forward_only per B (``serve_gpu.run_forward_only``) over a static cache
    of ``max_context`` positions and the servers' decode step; and what it
    ran on. The model is freed before the servers start."""
    import torch

    from ...serving.device import resolve
    from ...serving.static_decode import copy_bandwidth
    from ..serve_gpu.measuring import load, run_forward_only
    from ..serve_sim.measuring import PROMPT_TOKENS

    torch_device, torch_dtype = resolve(device, dtype)
    loaded, _, label = load(model, model_config, False, torch_device, torch_dtype)
    # a smaller copy on the CPU: the tests' runs, where the figure means nothing
    bandwidth = copy_bandwidth(torch_device, 512 if torch_device.type == "cuda" else 16)
    # run_forward_only's cache: PROMPT_TOKENS + warm-up + measured + 4 positions
    measure = max_context - PROMPT_TOKENS - 4 - FORWARD_WARM_UP
    bounds = {b: run_forward_only(loaded, b, FORWARD_WARM_UP, measure, bandwidth, decode_step)
              for b in batches}
    gpu = {"name": (torch.cuda.get_device_name(torch_device) if torch_device.type == "cuda"
                    else "CPU (not a GPU: figures mean nothing)"),
           "torch": torch.__version__, "cuda": torch.version.cuda, "dtype": dtype,
           "copy_bandwidth_gb_s": bandwidth / 1e9, "model": label,
           "vocab": loaded.config.vocab_size}
    del loaded
    gc.collect()
    if torch_device.type == "cuda":
        torch.cuda.empty_cache()
    return bounds, gpu


def measure_cell(server, processes: dict[str, int], mode: ServedMode, batch: int, top_p: float,
                 max_tokens: int, settings: dict) -> dict:
    """One (mode, B, top_p): a warm-up, then the measured level."""
    # the pace is the simulated engine's: unused here
    load = Load("instant", batch, ROUTE, settings["stream_interval"])
    asyncio.run(drive(server.grpc_url, load, WARM_UP_TOKENS, None, top_p))
    before = llm_counters(server)
    sampled = mode.sampling_mode == "simple"  # inline: no sampler request
    sampler_before = sampler_counters(server) if sampled else None
    measured = asyncio.run(drive(server.grpc_url, load, max_tokens, Meter(processes), top_p))
    sampler_after = sampler_counters(server) if sampled else None
    after = settled_llm_counters(server, before)
    cost = figures(load, measured, settings["micro_batches"])
    cpu = {name: us for name, us in cost["cpu_us_per_token"].items() if name != "floor"}
    return {"mode": mode.name, "sampling_mode": mode.sampling_mode, "handoff": mode.handoff,
            "batch": batch, "top_p": top_p, "micro_batches": settings["micro_batches"],
            "stream_interval": settings["stream_interval"],
            "tokens_per_s": cost["tokens_per_s"],
            "itl_ms_p50": measured["itl_ms_p50"], "itl_ms_p95": measured["itl_ms_p95"],
            "tokens_per_response": cost["tokens_per_response"], "cpu_us_per_token": cpu,
            "sampler_us_per_token": cost["sampler_us_per_token"],
            # CPU seconds of every server process per second of the window
            "server_cores_busy": cpu["server"] * cost["tokens_per_s"] / 1e6,
            # near 1: the one client process may be what limits tokens/s
            "client_cores_busy": cpu["client"] * cost["tokens_per_s"] / 1e6,
            **step_figures(before, after, batch * max_tokens),
            # how the step's rows were sharded over the instances, and each request's CPU
            **sampler_figures(sampler_before, sampler_after, cost["cpu_us_per_token"]["samplers"],
                              batch * max_tokens, after["steps"] - before["steps"])}


def run_server(mode: ServedMode, settings: dict, batches, top_ps, max_tokens: int,
               log_dir: Path, stacks: bool = False) -> tuple[list[dict], dict]:
    """One mode's server: started, measured at every (B, top_p), stopped
    (its log kept in ``log_dir``); its rows, and what it ran and left.
    stacks: its llm stub samples its threads' stacks (``simple_sampler.stacks``)
    into ``log_dir/stacks/<mode>/``."""
    from ...launch.processes import list_stubs
    from ...launch.server import TritonServer

    largest = max(batches)
    # the inline modes sample in the data plane: one lane (LlmSettings.check)
    settings = {**settings, "micro_batches": mode.lanes or (
        settings["micro_batches"] if mode.sampling_mode == "simple" else 1)}
    sampler = sampler_settings(largest, settings["instances"], "float32", mode.handoff)
    llm = static_settings(mode, largest=largest, hot_vocab_profile=sampler.hot_vocab_profile,
                          **settings)
    # the engine's rows as they come (bfloat16 on a GPU), as ``serve`` configures it
    sampler = replace(sampler, logits_dtype=engine_spec(llm.engine).logits_dtype(llm))
    repository = assemble_in_temp(sampler, llm, "simple-sampler-served-gpu-")
    log = log_dir / f"{mode.name}.log"
    server = TritonServer(repository, shm_bytes=shared_memory_bytes(sampler), log_path=log,
                          temporary_repository=True)
    stubs, processes, rows, error = [], {}, [], None
    try:
        with server_directory(STACKS_ENV, log_dir / "stacks" / mode.name if stacks else None):
            server.start(startup_timeout("static"))
        stubs = list_stubs(server.process.pid)
        processes = server_processes(server.process.pid)
        for b in batches:
            for p in top_ps:
                rows.append(measure_cell(server, processes, mode, b, p, max_tokens, settings))
    except Exception as failure:  # noqa: BLE001 - this server's: reported, the next modes run
        error = f"{type(failure).__name__}: {failure}"
        logger.exception("served mode %s failed after %d cells", mode.name, len(rows))
    finally:
        status = server.stop()
        shutil.rmtree(repository, ignore_errors=True)
    return rows, {"mode": mode.name, "log": str(log), "exit_status": status, "error": error,
                  "processes": sorted(processes), "left_in_dev_shm": left_in_dev_shm(stubs)}


def run(device: str = "cuda", model_config: str | None = DEFAULT_SHAPE,
        model: str | None = None, dtype: str | None = None, batches=BATCHES, top_ps=TOP_PS,
        modes=DEFAULT_MODES, max_tokens: int = 128, instances: int = 2, micro_batches: int = 1,
        stream_interval: int = 1, log_dir: str | Path | None = None,
        launch_ahead: str = LlmSettings.launch_ahead, decode_step: str = "eager",
        stacks: bool = False, send_threads: int = LlmSettings.send_threads) -> dict:
    """Every mode's server at every (B, top_p), and forward_only at every B,
    on the static engine's ``decode_step`` (eager, or compiled: ``serve
    --compile-decode``). dtype: bfloat16 on cuda, float32 on the CPU unless
    given. RuntimeError (the reason) when ``device`` cannot run here;
    CompileDecodeError when the compiled step does not compile here.
    stacks: each llm stub's threads sampled (``run_server``), said in the report."""
    if max_tokens < RESPONSES_PER_REQUEST * stream_interval:
        raise ValueError(f"max_tokens must be at least {RESPONSES_PER_REQUEST} x the stream "
                         f"interval ({RESPONSES_PER_REQUEST * stream_interval}), got {max_tokens}")
    dtype = dtype or ("bfloat16" if device == "cuda" else "float32")
    model_config = None if model else model_config
    max_context = PROMPT_ROOM + max_tokens
    bounds, gpu = forward_only_bounds(device, dtype, model_config, model, batches, max_context,
                                      decode_step)
    logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="served-gpu-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    settings = {"device": device, "dtype": dtype, "model_config": model_config, "model": model,
                "instances": instances, "micro_batches": micro_batches,
                "stream_interval": stream_interval, "max_context": max_context,
                "launch_ahead": launch_ahead, "decode_step": decode_step,
                "send_threads": send_threads}
    rows = rows_label(model_config)
    results, servers = [], []
    for mode in modes:
        rows_of_mode, server = run_server(mode, settings, batches, top_ps, max_tokens, logs,
                                          stacks)
        results += rows_of_mode
        servers.append(server)
        # what a run cut off before its end keeps: the modes measured so far
        (logs / PARTIAL).write_text(json.dumps({"kind": KIND, "rows": rows, "results": results,
                                                "forward_only": list(bounds.values()),
                                                "servers": servers}, default=str))
    for row in results:
        bound = bounds[row["batch"]]["tokens_per_s"]
        row.update(rows=rows, vocab=gpu["vocab"], forward_only_tokens_per_s=bound,
                   efficiency=row["tokens_per_s"] / bound)
    inline = {(r["batch"], r["top_p"]): r["tokens_per_s"] for r in results
              if r["mode"] == "inline"}
    for row in results:
        key = (row["batch"], row["top_p"])
        row["vs_inline"] = row["tokens_per_s"] / inline[key] if key in inline else None
    return {"kind": KIND, "rows": rows, "results": results,
            "forward_only": [{**bounds[b], "rows": rows} for b in batches], "gpu": gpu,
            "server_logs": str(logs), "servers": servers,
            "settings": {**settings, "max_tokens": max_tokens, "route": ROUTE,
                         "warm_up_tokens": WARM_UP_TOKENS,
                         "stacks": (f"the llm stub's threads sampled every "
                                    f"{1e3 * STACKS_INTERVAL_S:g} ms (simple_sampler.stacks), "
                                    f"in {logs / 'stacks'}" if stacks else None),
                         "client": "one asyncio process (tritonclient.grpc.aio), one gRPC "
                                   "stream per request, on this host",
                         "params": "temperature 1, top_p as listed, seeded, min_length = "
                                   "max_tokens",
                         "window": "from the first eighth of a level's tokens to the last"}}


def _cell(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_report(report: dict) -> str:
    """A Markdown report: what ran, the bound, one row per (mode, B, top_p)."""
    gpu, settings = report["gpu"], report["settings"]
    lines = [f"# bench {KIND}: served on {gpu['name']}", "",
             f"- data plane: static engine on {settings['device']} ({gpu['model']}, "
             f"{gpu['dtype']}; torch {gpu['torch']}, CUDA {gpu['cuda']}; static cache "
             f"{settings['max_context']} positions; {settings['micro_batches']} micro-batch(es); "
             f"stream_interval {settings['stream_interval']}; launch_ahead "
             f"{settings.get('launch_ahead', 'off (before the setting)')}; decode step "
             f"{settings.get('decode_step', 'eager')}; send_threads "
             f"{settings.get('send_threads', '1 (before the setting)')})",
             f"- rows: **{report['rows']}**",
             f"- sampler: {settings['instances']} simple_sampler instances; inline: the batched "
             f"gpu_inline in the llm model",
             f"- client: {settings['client']}; route {settings['route']}; requests: "
             f"{settings['params']}, {settings['max_tokens']} tokens; window: "
             f"{settings['window']}",
             f"- server logs: {report['server_logs']}",
             *([f"- stacks: {settings['stacks']}"] if settings.get("stacks") else []), "",
             "| B | forward_only tok/s | ms/step | HBM estimate ms |", "|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['tokens_per_s']:.0f} | {r['ms_per_step']:.2f} | "
              f"{r['hbm_estimate_ms']:.2f} |" for r in report["forward_only"]]
    lines += ["", "| mode | B | top_p | tok/s | efficiency | x inline | ITL p50 ms | ITL p95 ms "
              "| server cores busy | client cores busy | server us/tok | tritonserver | llm | "
              "preprocessing | samplers | client | forward ms/step | sampler ms/step | "
              "gc ms/step | sampler rq/step | us/rq |",
              "|" + "---|" * 21]
    for r in report["results"]:
        cpu, step = r["cpu_us_per_token"], r["llm_ms_per_step"]
        per_request = r.get("sampler_us_per_request") or {}
        lines.append(
            f"| {r['mode']} | {r['batch']} | {r['top_p']:g} | {r['tokens_per_s']:.0f} | "
            f"{r['efficiency']:.2f} | {_cell(r['vs_inline'], '.2f')} | "
            f"{_cell(r['itl_ms_p50'], '.1f')} | {_cell(r['itl_ms_p95'], '.1f')} | "
            f"{r['server_cores_busy']:.2f} | {r['client_cores_busy']:.2f} | "
            f"{cpu['server']:.0f} | {cpu['tritonserver']:.0f} | "
            f"{cpu['llm']:.0f} | {cpu['preprocessing']:.0f} | {cpu['samplers']:.0f} | "
            f"{cpu['client']:.0f} | {_cell(step['forward'], '.2f')} | "
            f"{_cell(step['sampler'], '.2f')} | {_cell(step.get('gc'), '.2f')} | "
            f"{_cell(r.get('sampler_requests_per_step'), '.2f')} | "
            f"{_cell(per_request.get('stubs'), '.0f')} |")
    lines += ["", "efficiency = tok/s over forward_only's at the same B (the data plane alone, "
              "in-process, argmax fed back on the device); x inline = over inline's at the same "
              "B and top_p; CPU columns: microseconds per token received (each process's CPU "
              "clock); server cores busy = every server process's CPU seconds per second of "
              "the window (one GPU); client cores busy near 1: the one client process may be "
              "what limits tok/s; gc = the llm process's garbage collections (every thread "
              "waits), its heap frozen at start; sampler rq/step = sampler requests per llm "
              "step (its rows' shards), us/rq = the sampler stubs' CPU per request. Rows: "
              + report["rows"] + "."]
    if any(r["mode"] == "simple_overlap" for r in report["results"]):
        lines[-1] += (" simple_overlap: simple on two lanes (micro-batches), each stepping its "
                      "own window of the static engine's slots, one lane's sampler beside the "
                      "other's forward.")
    lines += ["", "| server | exit status | left in /dev/shm | failed | log |",
              "|---|---|---|---|---|"]
    lines += [f"| {s['mode']} | {s['exit_status']} | {', '.join(s['left_in_dev_shm']) or 'none'} "
              f"| {'**' + s['error'] + '**' if s.get('error') else 'no'} | {s['log']} |"
              for s in report["servers"]]
    return "\n".join(lines)
