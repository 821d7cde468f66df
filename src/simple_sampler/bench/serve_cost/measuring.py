"""`simple-sampler bench serve-cost`: what streaming a token through Triton
costs the server's CPU, by process, beside Triton's own floor, on a
SIMULATED data plane (``serving.simulated``; every output says so).

Per pace (``instant`` or ``gpu``) one real server runs the whole repository
plus the **floor model** (``bench/floor``: a decoupled Python model that does
no work and streams one token per request per step at the same pace; it lives
in the bench, not in model_repository/). Per configuration (pace, B, route
``ensemble``/``llm``/``floor``, stream_interval) B requests run at once from
ONE asyncio client in this process, and each level reports tokens/s against
the data plane's bound, CPU per token of every server process (from /proc)
and of the client, the decode loop's CPU per token, and the ratios to the
floor. With ``profile_dir`` the llm stub's decode-loop thread runs under
cProfile (``llm_service``, ``PROFILE_ENV``), and the report lists its calls
per token by function (``loop_profile.profile_calls``): counts, not times, so they do not
move with the machine's load.

The load, the window, every column and how to read them: docs/SERVED_COST.md.
"""
from __future__ import annotations

import asyncio
import itertools
import shutil
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...client.aio import let_triton_end
from ...serving.simulated import LABEL
from ...settings import LlmSettings
from ..loop_profile import format_profile, llm_profiles, profile_calls
from ..server_meter import LLM_COUNTERS, Meter, llm_counters, sampler_counters, server_processes
from ..spec import UsageError
from .repository import FLOOR_MODEL, PACES, build_repository, sampler_settings

#: floor-llm: the floor model sent the llm route's inputs, answering in the
#: llm model's response shape (bench/floor/model.py): Triton's cost of our
#: request and response shape, none of our own work.
ROUTES = ("floor", "floor-llm", "ensemble", "llm")
PROMPT = "Tell me a story."
STARTUP_TIMEOUT_S = 900.0
#: The fewest responses per request the window may see: tokens arrive k at a
#: time, so max_tokens must be at least this many times the largest k.
RESPONSES_PER_REQUEST = 8
#: Each route's warm-up before its level: requests of WARM_UP_TOKENS tokens.
WARM_UP_REQUESTS, WARM_UP_TOKENS = 2, 4
#: What may differ between a run's servers (a row's keys, each its own floor).
VARIANT = ("python_thread_pool", "micro_batches", "handoff", "send_threads")


@dataclass(frozen=True)
class Config:
    pace: str
    batch: int
    route: str
    stream_interval: int = 1

    @property
    def step_ms(self) -> tuple[float, float]:
        return PACES[self.pace]

    def bound(self, micro_batches: int = 1) -> float | None:
        """B / (a + b * B) tokens/s: one forward per token of every sequence.
        With m micro-batches the simulated engine runs m forwards per pass,
        each paying a: then B / (m * a + b * B) is all it allows."""
        a, b = self.step_ms
        step_ms = micro_batches * a + b * self.batch
        return self.batch / (step_ms / 1e3) if step_ms else None


def plan(paces=("instant", "gpu"), batches=(64, 256), intervals=(1, 4, 16),
         routes=ROUTES) -> list[Config]:
    """Per pace and B: the floor, the ensemble at each stream_interval, llm
    directly at the first (the ensemble hop's cost)."""
    configs = []
    for pace in paces:
        for batch in batches:
            configs += [Config(pace, batch, route) for route in ("floor", "floor-llm")
                        if route in routes]
            if "ensemble" in routes:
                configs += [Config(pace, batch, "ensemble", k) for k in intervals]
            if "llm" in routes:
                configs.append(Config(pace, batch, "llm", intervals[0]))
    return configs


def request_inputs(route: str, max_tokens: int, stream_interval: int, seed: int,
                   top_p: float | None = None):
    import tritonclient.grpc.aio as grpcclient

    if route.startswith(FLOOR_MODEL):
        arrays = {"max_tokens": np.array([[max_tokens]], np.int32)}
    else:
        arrays = {"text_input": np.array([[PROMPT.encode()]], object),
                  "max_tokens": np.array([[max_tokens]], np.int32),
                  "min_length": np.array([[max_tokens]], np.int32),  # no early end
                  "stream": np.array([[True]]),
                  "random_seed": np.array([[seed]], np.uint64)}
        if stream_interval != 1:
            arrays["stream_interval"] = np.array([[stream_interval]], np.int32)
        # 1 unless given: sampled (without top_k and top_p a request is greedy)
        arrays["top_p"] = np.array([[1.0 if top_p is None else top_p]], np.float32)
    inputs = []
    for name, value in arrays.items():
        tensor = grpcclient.InferInput(name, list(value.shape),
                                       "BYTES" if value.dtype == object else
                                       {np.dtype(np.int32): "INT32", np.dtype(np.bool_): "BOOL",
                                        np.dtype(np.uint64): "UINT64",
                                        np.dtype(np.float32): "FP32"}[value.dtype])
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return inputs


async def drive(url: str, config: Config, max_tokens: int, meter: Meter | None,
                top_p: float | None = None) -> dict:
    """B concurrent streams of max_tokens tokens (each with `top_p`, 1 when
    not given); marks `meter` at the window's ends. The inter-token latencies
    are a stream's gaps between responses within the window, per token."""
    import tritonclient.grpc.aio as grpcclient

    model = FLOOR_MODEL if config.route.startswith(FLOOR_MODEL) else config.route
    total = config.batch * max_tokens
    start_at, end_at = total // 8, total - total // 8
    delivered, responses_in_window, gaps_ms = 0, 0, []
    client = grpcclient.InferenceServerClient(url)

    async def one(index: int) -> None:
        nonlocal delivered, responses_in_window
        request = {"model_name": model, "request_id": uuid.uuid4().hex,
                   "inputs": request_inputs(config.route, max_tokens, config.stream_interval,
                                            index, top_p)}

        async def requests():
            yield request

        stream = client.stream_infer(requests())
        received, finished, last = 0, False, None
        try:
            async for result, error in stream:
                if error is not None:
                    raise RuntimeError(f"{model} request {index}: {error}")
                tokens = result.as_numpy("output_ids")
                count = 0 if tokens is None else tokens.size
                before, received, delivered = delivered, received + count, delivered + count
                if meter is not None:
                    now = time.perf_counter()
                    if before < start_at <= delivered or before < end_at <= delivered:
                        meter.mark(delivered)
                    if start_at <= before < end_at:
                        responses_in_window += 1
                        if last is not None and count:
                            gaps_ms.append((now - last) * 1e3 / count)
                    last = now if count else last
                if received >= max_tokens:
                    # left for Triton to end: cancelling a finished call races
                    # Triton 2.51's stream handler, and the model never unloads
                    finished = True
                    await let_triton_end(stream)
                    return
            raise RuntimeError(f"{model} request {index}: the stream ended after {received} "
                               f"of {max_tokens} tokens")
        finally:
            if not finished:
                stream.cancel()

    try:
        await asyncio.gather(*(one(i) for i in range(config.batch)))
    finally:
        await client.close()
    if meter is None:
        return {}
    seconds, tokens, cpu, switches = meter.window()
    return {"seconds": seconds, "cpu_s": cpu, "switches": switches, "tokens": tokens,
            "tokens_per_response": tokens / max(1, responses_in_window),
            "itl_ms_p50": float(np.percentile(gaps_ms, 50)) if gaps_ms else None,
            "itl_ms_p95": float(np.percentile(gaps_ms, 95)) if gaps_ms else None}


def step_figures(before: dict, after: dict, tokens: int) -> dict:
    """Over a level: the decode loop's CPU per token, and per step (ms) the
    forward, the sampler (wall, overlapped or not) and the forward's wait
    for the data-plane thread and the decode loop (``DecoderStats``), and
    the llm process's garbage collections (``heap.PauseClock``)."""
    delta = {name: after[name] - before[name] for name in LLM_COUNTERS}
    steps = delta["steps"]
    return {"llm_loop_us_per_token": delta["loop_us"] / tokens,
            "llm_ms_per_step": {key: delta[counter] / 1e3 / steps if steps else None
                                for key, counter in (("forward", "data_plane_us"),
                                                     ("sampler", "sampler_us"),
                                                     ("forward_wait", "forward_wait_us"),
                                                     ("gc", "gc_pause_us"))}}


def sampler_figures(before: dict | None, after: dict | None, samplers_us_per_token: float,
                    tokens: int, steps: float) -> dict:
    """Over a level: the sampler requests per llm step, and per request
    the sampler stubs' CPU (their CPU per token over the window times the
    level's tokens per request) and the part of it in ``execute`` (our
    decoding, kernels and responses, over the whole level); the rest is the
    Python backend's own work on the request and its response."""
    requests = after["requests"] - before["requests"] if before is not None else 0
    if not requests:  # a floor route, or no request reached the samplers
        return {"sampler_requests_per_step": None, "sampler_us_per_request": None}
    return {"sampler_requests_per_step": requests / steps if steps else None,
            "sampler_us_per_request": {
                "stubs": samplers_us_per_token * tokens / requests,
                "execute": (after["execute_cpu_us"] - before["execute_cpu_us"]) / requests}}


def figures(config: Config, measured: dict, micro_batches: int) -> dict:
    tokens, cpu = measured["tokens"], measured["cpu_s"]
    per_token = {name: 1e6 * seconds / tokens for name, seconds in cpu.items()}
    samplers = sorted(name for name in per_token if name.startswith("simple_sampler"))
    server = {name: us for name, us in per_token.items() if name != "client"}
    bound = config.bound()
    tokens_per_s = tokens / measured["seconds"]
    return {"pace": config.pace, "step_ms": list(config.step_ms), "batch": config.batch,
            "route": config.route, "stream_interval": config.stream_interval,
            "tokens_per_s": tokens_per_s, "bound_tokens_per_s": bound,
            "efficiency": tokens_per_s / bound if bound else None,
            "lanes_bound_tokens_per_s": config.bound(micro_batches),
            "tokens_per_response": measured["tokens_per_response"],
            "cpu_us_per_token": {
                "tritonserver": per_token["tritonserver"],
                "llm": per_token.get("llm", 0.0),
                "floor": per_token.get("floor", 0.0),
                "preprocessing": per_token.get("preprocessing", 0.0),
                "samplers": sum(per_token[name] for name in samplers),
                "server": sum(server.values()),
                "client": per_token["client"]},
            "sampler_us_per_token": {name: per_token[name] for name in samplers},
            "switches_per_token": {name: count / tokens
                                   for name, count in measured["switches"].items()}}


def add_ratios(results: list[dict]) -> None:
    """Each row's cost over the floor's at the same pace and B, on the same
    server (variant)."""
    def key(row):
        return (row["pace"], row["batch"], *(row.get(name) for name in VARIANT))

    def streaming(row):
        # the stubs that stream the route's tokens, and tritonserver; an idle
        # llm stub's tick during the floor's window is not the floor's cost
        cpu = row["cpu_us_per_token"]
        stubs = cpu["floor"] if row["route"] == "floor" else cpu["floor"] + cpu["llm"]
        return stubs + cpu["tritonserver"]

    floors = {key(r): r for r in results if r["route"] == "floor"}
    for row in results:
        floor = floors.get(key(row))
        cpu = row["cpu_us_per_token"]
        if floor is None:
            row["vs_floor"] = row["server_vs_floor"] = None
            continue
        base = floor["cpu_us_per_token"]
        row["vs_floor"] = streaming(row) / streaming(floor) if streaming(floor) else None
        row["server_vs_floor"] = cpu["server"] / base["server"] if base["server"] else None


def check_plan(configs: list[Config], max_tokens: int) -> None:
    """UsageError unless `configs` has something to run, every stream
    interval is at least 1, and max_tokens holds RESPONSES_PER_REQUEST
    responses of the largest: tokens arrive k at a time, and a window of a
    few responses per stream would count a burst more or less."""
    if not configs or min(c.stream_interval for c in configs) < 1:
        raise UsageError("nothing to run, or a stream interval < 1")
    largest = max(c.stream_interval for c in configs)
    if max_tokens < RESPONSES_PER_REQUEST * largest:
        raise UsageError(f"--max-tokens must be at least {RESPONSES_PER_REQUEST} x the largest "
                         f"stream interval ({RESPONSES_PER_REQUEST * largest}), got {max_tokens}")


def measure_server(server, processes: dict[str, int], configs: list[Config], max_tokens: int,
                   micro_batches: int) -> list[dict]:
    """One row per configuration of `configs` (one pace), each route warmed
    up first, on the running `server` whose `processes` the meter reads."""
    rows = []
    for config in configs:
        # warm up the route: first steps, first BLS calls, first responses
        asyncio.run(drive(server.grpc_url, Config(config.pace, WARM_UP_REQUESTS, config.route),
                          WARM_UP_TOKENS, None))
        counters = llm_counters(server)
        sampled = not config.route.startswith(FLOOR_MODEL)
        sampler_before = sampler_counters(server) if sampled else None
        measured = asyncio.run(drive(server.grpc_url, config, max_tokens, Meter(processes)))
        tokens = config.batch * max_tokens
        # the samplers' counts first: settling them gives the llm model's
        # report, sent as its last request ended, time to arrive too
        sampler_after = sampler_counters(server) if sampled else None
        after = llm_counters(server)
        row = {**figures(config, measured, micro_batches), **step_figures(counters, after, tokens)}
        row.update(sampler_figures(sampler_before, sampler_after,
                                   row["cpu_us_per_token"]["samplers"], tokens,
                                   after["steps"] - counters["steps"]))
        rows.append(row)
    return rows


def run(configs: list[Config] | None = None, max_tokens: int = 128, instances: int = 2,
        micro_batches: Sequence[int] = (2,), vocab: int = 151_936, dtype: str = "bfloat16",
        profile_dir: str | None = None, sampling_mode: str = LlmSettings.sampling_mode,
        shard_min_rows: int = LlmSettings.sampler_shard_min_rows,
        python_thread_pools: list[int] | None = None,
        handoffs: list[str] | None = None, send_threads: list[int] | None = None) -> dict:
    """Every configuration of `configs` (default :func:`plan`), one server per
    pace and server variant: each python_thread_pools size (the Python
    backend's `thread-pool-size`; None or absent: Triton's default, as
    `serve` starts it) x each micro_batches count (the decode loop's lanes;
    one with a sampling_mode other than "simple") x each handoff (full rows,
    or hot-first's compact rows with the hot set the repository ships) x each
    send_threads (the llm model's). Every variant serves its own floor, and
    each row's ratios are to its own server's. `sampling_mode` other than "simple"
    samples in the llm stub (no BLS request per step, the sampler instances
    idle): tritonserver's column is then streaming alone. shard_min_rows:
    the llm model's `sampler_shard_min_rows`."""
    from ...launch.serve import shared_memory_bytes
    from ...launch.server import TritonServer

    configs = plan() if configs is None else configs
    check_plan(configs, max_tokens)
    pools = python_thread_pools or [None]
    # the inline modes sample in the data plane: one lane (LlmSettings.check)
    lanes = list(micro_batches) if sampling_mode == "simple" else [1]
    handoffs = handoffs or [LlmSettings.handoff]
    senders = send_threads or [LlmSettings.send_threads]
    results, profiles = [], []
    for pool, lane_count, handoff, threads, pace in itertools.product(
            pools, lanes, handoffs, senders, dict.fromkeys(c.pace for c in configs)):
        mine = [c for c in configs if c.pace == pace]
        largest = max(c.batch for c in mine)
        repository = build_repository(
            Path(tempfile.mkdtemp(prefix="simple-sampler-serve-cost-")), pace, largest,
            instances, lane_count, vocab, dtype, sampling_mode, shard_min_rows, handoff, threads)
        sampler = sampler_settings(largest, instances, dtype, handoff)
        variant = {"python_thread_pool": pool, "micro_batches": lane_count, "handoff": handoff,
                   "send_threads": threads}
        try:
            with llm_profiles(profile_dir):
                server = TritonServer(repository, shm_bytes=shared_memory_bytes(sampler),
                                      log_path=repository.parent / f"{repository.name}.log",
                                      python_thread_pool=pool, temporary_repository=True)
                # The simulated engine's first start computes SmolLM2's rows (then cached).
                server.start(STARTUP_TIMEOUT_S)
                try:
                    processes = server_processes(server.process.pid)
                    results += [{**row, **variant} for row in
                                measure_server(server, processes, mine, max_tokens, lane_count)]
                finally:
                    server.stop()
                if profile_dir and "llm" in processes:
                    profiles.append(profile_calls(
                        Path(profile_dir) / f"llm-{processes['llm']}.prof",
                        llm_tokens(mine, max_tokens),
                        f"{pace}, thread pool {pool}, {lane_count} micro-batches, {handoff}, "
                        f"{threads} send threads"))
        finally:
            shutil.rmtree(repository, ignore_errors=True)
    add_ratios(results)
    return {"results": results, "profiles": profiles,
            "data_plane": data_plane(instances, lanes, sampling_mode, handoffs),
            "settings": {"vocab": vocab, "dtype": dtype, "sampler_instances": instances,
                         "sampling_mode": sampling_mode, "sampler_shard_min_rows": shard_min_rows,
                         "micro_batches": lanes, "handoffs": handoffs, "max_tokens": max_tokens,
                         "python_thread_pools": pools, "send_threads": senders,
                         "client": "one asyncio process (tritonclient.grpc.aio), one gRPC "
                                   "stream per request",
                         "params": "temperature 1, no truncation, seeded, min_length = "
                                   "max_tokens",
                         "window": "from the first eighth of the level's tokens to the last",
                         "profile_dir": profile_dir}}


def llm_tokens(configs: list[Config], max_tokens: int) -> int:
    """Tokens the llm model generated for `configs` (one server's), warm-ups
    included: what its decode-loop profile is divided by."""
    return sum(c.batch * max_tokens + WARM_UP_REQUESTS * WARM_UP_TOKENS for c in configs
               if c.route in ("ensemble", "llm"))


def data_plane(instances: int, micro_batches: Sequence[int], sampling_mode: str = "simple",
               handoffs: Sequence[str] = (LlmSettings.handoff,)) -> str:
    rows = " or ".join("compact rows (hot-first: the step model charges the summary)"
                       if handoff == "hot-first" else "full rows" for handoff in handoffs)
    sampling = (f"{instances} simple_sampler instances ({rows})" if sampling_mode == "simple"
                else f"sampling {sampling_mode} in the llm stub (the sampler instances idle)")
    lanes = " or ".join(str(m) for m in micro_batches)
    return (f"{LABEL} (serving.simulated.SimulatedEngine: the forward sleeps, rows are "
            f"synthetic) inside a real Triton server: ensemble, preprocessing, llm "
            f"({lanes} micro-batches) and {sampling}; "
            f"beside it the floor model (bench/floor: no work, one INT32 token per request "
            f"per step; on the floor-llm route the llm model's outputs instead)")


def pace_label(row: dict) -> str:
    a, b = row["step_ms"]
    return "instant" if not (a or b) else f"{a:g}+{b:g}*B ms"


def format_report(report: dict) -> str:
    def cell(value, spec):
        return f"{'-':>{len(format(0, spec))}}" if value is None else format(value, spec)

    lines = [f"data plane: {report['data_plane']}",
             f"client: {report['settings']['client']}; requests: {report['settings']['params']}",
             f"{'pace':<15} {'pool':>4} {'m':>2} {'handoff':<9} {'snd':>3} {'B':>4} {'route':<9} "
             f"{'k':>3} "
             f"{'tok/s':>7} {'bound':>7} {'eff':>5} "
             f"{'lanes':>7} "
             f"{'tok/rsp':>7} {'server':>7} {'triton':>7} {'llm':>6} {'loop':>5} {'floor':>6} "
             f"{'sampl':>6} {'prep':>5} {'client':>7} {'vs floor':>8} {'server/fl':>9} "
             f"{'cs:trit':>7} {'cs:stub':>7} {'fwd ms':>6} {'wait':>5} {'sampl ms':>8} "
             f"{'rq/step':>7} {'us/rq':>6} {'exec':>6}"]
    for r in report["results"]:
        cpu = r["cpu_us_per_token"]
        switches = r.get("switches_per_token", {})  # reports from before the column: none
        stub_switches = switches.get(FLOOR_MODEL if r["route"].startswith(FLOOR_MODEL)
                                     else "llm")
        step = r.get("llm_ms_per_step") or {}  # reports from before the columns: none
        per_request = r.get("sampler_us_per_request") or {}
        lines.append(
            f"{pace_label(r):<15} {cell(r.get('python_thread_pool'), '4d')} "
            f"{cell(r.get('micro_batches'), '2d')} {r.get('handoff', '-'):<9} "
            f"{cell(r.get('send_threads'), '3d')} {r['batch']:>4} "
            f"{r['route']:<9} {r['stream_interval']:>3} "
            f"{r['tokens_per_s']:>7.0f} {cell(r['bound_tokens_per_s'], '7.0f')} "
            f"{cell(r['efficiency'], '5.2f')} {cell(r['lanes_bound_tokens_per_s'], '7.0f')} "
            f"{r['tokens_per_response']:>7.1f} "
            f"{cpu['server']:>7.0f} {cpu['tritonserver']:>7.0f} {cpu['llm']:>6.0f} "
            f"{cell(r.get('llm_loop_us_per_token'), '5.0f')} "
            f"{cpu['floor']:>6.0f} {cpu['samplers']:>6.0f} {cpu['preprocessing']:>5.0f} "
            f"{cpu['client']:>7.0f} {cell(r['vs_floor'], '8.2f')} "
            f"{cell(r['server_vs_floor'], '9.2f')} "
            f"{cell(switches.get('tritonserver'), '7.2f')} {cell(stub_switches, '7.2f')} "
            f"{cell(step.get('forward'), '6.1f')} {cell(step.get('forward_wait'), '5.1f')} "
            f"{cell(step.get('sampler'), '8.1f')} "
            f"{cell(r.get('sampler_requests_per_step'), '7.2f')} "
            f"{cell(per_request.get('stubs'), '6.0f')} {cell(per_request.get('execute'), '6.0f')}")
    lines.append("CPU columns: microseconds per token received (each process's CPU clock); "
                 "pool = the Python backend's thread-pool-size (-: Triton's default, 32); "
                 "m = the decode loop's micro-batches; handoff = full or compact (hot-first) "
                 "rows to the sampler; snd = the llm model's send_threads; "
                 "server = tritonserver + every stub; k = stream_interval; bound = B / (a + b*B), "
                 "eff = tok/s over it, lanes = B / (m*a + b*B) with m micro-batches; tok/rsp = tokens per "
                 "response; loop = the llm stub's decode-loop thread (streaming; whole level); "
                 "vs floor = (llm + tritonserver) / (floor + tritonserver) at the "
                 "same pace and B; server/fl = whole server over the floor's; cs = voluntary "
                 "context switches per token (/proc/<pid>/task/*/status) of tritonserver and "
                 "of the route's stub (llm or floor); per llm step (ms, whole level): fwd = the "
                 "forward (with the hot-first summary, which runs behind it), wait = the "
                 "forward waiting for the data-plane thread to start it and "
                 "for the decode loop to take its rows, sampl = the sampler (wall, overlapped "
                 "or not); sampler requests (whole level): rq/step = per llm step, us/rq = the "
                 "sampler stubs' CPU per request, exec = the part of it in execute (ours: "
                 "decoding, kernels, responses; the rest is the Python backend's own)")
    lines += [format_profile(profile) for profile in report.get("profiles", ())]
    return "\n".join(lines)
