"""`simple-sampler bench row-transport`: what moving rows costs the sampler
instances, by transport (``bls``, ``arena``, ``hot-first``), through a real
server on a SIMULATED data plane (``serving.simulated``; every output says so).

Per (V, dtype, B) and transport, one fresh server with a 0-ms step serves B
gRPC streams from one asyncio client; the figures are per token the clients received: CPU
per process from /proc, rows, bytes and full-row copies per row, beside the
kernels' us/row and the stub codec's on the same rows in the same run.
``sampler_cpu_per_token`` is the measurement for one configuration, to be
folded into a served-cost bench.

The load, the transports and every column: docs/BENCHMARKS.md, "Row transport".
"""
from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import numpy as np

from ...params import SamplingBatch, SamplingParams
from ...settings import SIMULATED_DTYPES, LlmSettings, SamplerSettings
from ...serving.simulated import LABEL
from ..server_meter import process_stat

TRANSPORTS = {"bls": ("bls", "full"), "arena": ("arena", "full"),
              "hot-first": ("arena", "hot-first")}
#: (V, dtype): Qwen2.5's and Llama-3's vocabularies, and SmolLM2's in the
#: first one's dtype (hot-first's cost should not depend on V)
SHAPES = ((151_936, "bfloat16"), (128_256, "float32"), (49_152, "bfloat16"))
BATCHES = (64, 256)
INSTANCES = 2
#: the llm model computes SmolLM2's rows behind the bank at its first start
#: on a machine (then cached): minutes on a loaded 2-core one
STARTUP_TIMEOUT_S = 900.0
#: copies of a full row on the way to the sampler (docs/COPIES.md): the python
#: backend's three for BLS; none for the arena here, where the simulated
#: bank lies in it (on a GPU host: the device-to-host DMA into a slot)
COPIES = {"bls": 3, "arena": 0}


def _sampler_rows(server, at_least: float = 0.0, settled_after: float | None = None):
    """(rows the sampler instances were sent, undecided compact rows they
    decided from their full rows in place, the requests Triton counted for
    the sampler model), over every instance, once the
    rows are at least `at_least` and every count made before
    `settled_after` has arrived (the instances send theirs in batches:
    ``triton.counters``)."""
    from ...triton.counters import read_counter, wait_for_counter

    rows = wait_for_counter(server.metrics_url, "simple_sampler_rows_total",
                            lambda value: value >= at_least, settled_after=settled_after)
    return (rows, read_counter(server.metrics_url, "simple_sampler_handoff_full_rows_total"),
            read_counter(server.metrics_url, "nv_inference_request_success",
                         'model="simple_sampler"'))


def _processes(server) -> dict[str, list[int]]:
    from ...launch.processes import list_stubs

    stubs = list_stubs(server.process.pid)
    return {"tritonserver": [server.process.pid],
            "llm": [s.pid for s in stubs if s.model == "llm"],
            "samplers": [s.pid for s in stubs if s.model == "simple_sampler"]}


def _cpu(processes: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds by process group, and the samplers' minor page faults."""
    stats = {name: [process_stat(pid) for pid in pids] for name, pids in processes.items()}
    return {**{name: sum(cpu for cpu, _ in found) for name, found in stats.items()},
            "sampler_faults": sum(faults for _, faults in stats["samplers"])}


def sampler_cpu_per_token(transport: str, vocab: int, dtype: str, batch: int,
                          instances: int = INSTANCES, max_tokens: int = 32,
                          profile_dir: str | None = None) -> dict:
    """CPU microseconds per received token of the server's processes
    (``samplers``, ``llm``, ``tritonserver``) with rows sent by `transport`
    (a TRANSPORTS key), plus sampler rows and the samplers' minor page faults
    per token, and the rows per sampler request (Triton's own request count:
    a request costs a stub a fixed share, so the shape of the load's steps
    matters as much as the rows); one fresh server. profile_dir: the sampler stubs' ``execute``
    profiles go there (``triton/stub_profile``; warm-up included)."""
    from ...launch.serve import assemble_in_temp, shared_memory_bytes
    from ...launch.server import TritonServer
    from ...triton.stub_profile import PROFILE_ENV
    from ..serve_cost.measuring import WARM_UP_REQUESTS, WARM_UP_TOKENS, Config, drive

    row_transport, handoff = TRANSPORTS[transport]
    profile = "hot_vocab.npz" if handoff == "hot-first" else ""
    sampler = SamplerSettings(sampler_instances=instances, sampler_max_batch_size=batch,
                              logits_dtype=SIMULATED_DTYPES[dtype], hot_vocab_profile=profile)
    llm = LlmSettings(engine="simulated", sim_vocab=vocab, sim_dtype=dtype, sim_step_a_ms=0.0,
                      sim_step_b_ms=0.0, sampler_shards=instances, engine_max_batch_size=batch,
                      generate_max_batch_size=batch, max_context=512,
                      row_transport=row_transport, handoff=handoff, hot_vocab_profile=profile)
    repository = assemble_in_temp(sampler, llm, "simple-sampler-row-transport-")
    server = TritonServer(repository, shm_bytes=shared_memory_bytes(sampler),
                          temporary_repository=True)
    previous = os.environ.pop(PROFILE_ENV, None)
    if profile_dir:
        os.environ[PROFILE_ENV] = str(Path(profile_dir).resolve())
    try:
        server.start(timeout=STARTUP_TIMEOUT_S)  # inside: an interrupted start stops it too
        # serve-cost's light client (one asyncio process: a thread per stream would
        # make the decode loop's steps ragged); warm up first: first steps, calls, mappings
        asyncio.run(drive(server.grpc_url, Config("instant", WARM_UP_REQUESTS, "ensemble"),
                          WARM_UP_TOKENS, None))
        processes = _processes(server)
        rows0 = _sampler_rows(server, settled_after=time.monotonic())
        cpu0 = _cpu(processes)
        started = time.perf_counter()
        asyncio.run(drive(server.grpc_url, Config("instant", batch, "ensemble"), max_tokens, None))
        seconds = time.perf_counter() - started
        cpu1 = _cpu(processes)
        # every token took a row at least
        rows1 = _sampler_rows(server, rows0[0] + batch * max_tokens, time.monotonic())
    finally:
        server.stop()
        os.environ.pop(PROFILE_ENV, None)
        if previous is not None:
            os.environ[PROFILE_ENV] = previous
    tokens = batch * max_tokens  # min_length = max_tokens: every request yields them all
    requests = max(1.0, rows1[2] - rows0[2])
    return {**{f"{name}_us_per_token": (cpu1[name] - cpu0[name]) * 1e6 / tokens
               for name in processes},
            "sampler_faults_per_token": (cpu1["sampler_faults"] - cpu0["sampler_faults"]) / tokens,
            "rows_per_token": (rows1[0] - rows0[0]) / tokens,
            "in_place_per_token": (rows1[1] - rows0[1]) / tokens, "tokens": tokens,
            "rows_per_request": (rows1[0] - rows0[0]) / requests,
            "samplers_us_per_request": (cpu1["samplers"] - cpu0["samplers"]) * 1e6 / requests,
            "tokens_per_s": tokens / seconds}


def _batch(size: int) -> SamplingBatch:
    return SamplingBatch.from_params([SamplingParams(seed=row) for row in range(size)])


def _requests(arrays: dict, size: int, shards: int) -> list[dict]:
    """`arrays` split into `shards` requests as the pool splits a step."""
    bounds = np.linspace(0, size, shards + 1).astype(int)
    return [({k: v[a:b] for k, v in arrays.items()}, a, b)
            for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def _stub_requests(rows, params: SamplingBatch, instances: int):
    """A function doing what the sampler instances' ``execute`` does in
    Python for one step of `rows` over the arena (``serve_request``: decoding,
    sampling, the slot check), one request per instance as the pool shards
    them, and one that runs just the kernel (``sample``) on the same mapped
    rows; the caller closes the returned arena."""
    from ...row_arena import RowArena
    from ...row_reader import RowReader
    from ...sampling import logits_array, sample
    from ...triton.sampler_codec import batch_arrays
    from ...triton.sampler_serve import serve_request

    host = logits_array(rows)
    arena = RowArena(1, host.nbytes)
    lease, reader = arena.lease(host), RowReader()
    params.want_logprobs = np.zeros(len(params), bool)
    requests = [{**inputs, "logits_ref": lease.refs(a, b)} for inputs, a, b in
                _requests(batch_arrays(params, packed=True), len(params), instances)]

    def step():
        for inputs in requests:
            serve_request(inputs, host.shape[1], None, reader)

    mapped = reader.rows(lease.refs())
    return step, lambda: sample(mapped, params, return_logprobs=False, num_threads=1), arena


def _stub_compact_requests(compact, params: SamplingBatch, hot, instances: int, arena, rows):
    """The sampler instances' Python for one step of compact rows, in the
    requests ``HotFirstSampler`` makes of them (its packed form, through
    ``serve_request`` with the hot set), each with its full rows by
    reference beside it where the served path sends them (a row may be left
    undecided: ``hot_first.undecidable_rows``; the rows shared in `arena`,
    as the simulated engine's bank is)."""
    from ...row_reader import RowReader
    from ...sampling import logits_array
    from ...serving.hot_first import undecidable_rows
    from ...triton.hot_first_sampler import COMPACT_ROWS_PER_REQUEST
    from ...triton.sampler_codec import batch_arrays, compact_arrays
    from ...triton.sampler_serve import serve_request

    params.want_logprobs = np.zeros(len(params), bool)
    lease, reader = arena.reference(arena.share(logits_array(rows))), RowReader()
    by_reference = bool(undecidable_rows(params, True).any())
    shards = min(instances, -(-len(params) // COMPACT_ROWS_PER_REQUEST))
    requests = [{**inputs, **({"logits_ref": lease.refs(a, b)} if by_reference else {})}
                for inputs, a, b in _requests(
                    {**compact_arrays(compact, packed=True), **batch_arrays(params, packed=True)},
                    len(params), shards)]

    def step():
        for inputs in requests:
            serve_request(inputs, hot.vocab_size, hot, reader)
    return step


def kernel_costs(vocab: int, dtype: str, batch: int, repeats: int = 10,
                 instances: int = INSTANCES) -> dict:
    """us/row of the kernels on the simulated bank's first B rows, one
    thread, CPU clock: full rows (``sample``), compact rows
    (``sample_compact`` on the engine's summary), and the sampler stub's
    Python work for full rows from the arena in `instances` requests
    (``_stub_requests``: the kernel plus our decoding) and for compact rows
    (``_stub_compact_requests``), the server load's parameters; and the
    compact rows' bytes per row."""
    from ...handoff import DEFAULT_COLD_TOP, sample_compact
    from ...serving.hot_first import compact_rows
    from ...sampling import sample
    from ...serving.simulated import SimulatedEngine, SimulatedSpec, simulated_profile
    from ...shvs.hot_vocab import load_profile
    from ...launch.install import project_file
    from ..kernels.measuring import time_interleaved

    engine = SimulatedEngine(SimulatedSpec(vocab, dtype, 0.0, 0.0), max_batch_size=batch)
    profile = load_profile(project_file("model_repository/simple_sampler/hot_vocab.npz"))
    hot = simulated_profile(profile, vocab).hot_vocab()
    hot_ids = hot.kernel_arrays()[0]
    engine.prepare_hot_first(hot_ids, DEFAULT_COLD_TOP)
    rows, params = engine.bank[:batch], _batch(batch)
    # the served path's compact rows: cold tokens drawn, cold ids where needed
    compact = compact_rows(rows, params, hot, summary=engine.hot_first_summary)
    stub, mapped_kernel, arena = _stub_requests(rows, params, instances)
    try:
        costs = time_interleaved({
            "full": lambda: sample(rows, params, return_logprobs=False, num_threads=1),
            "compact": lambda: sample_compact(compact, params, hot, return_logprobs=False,
                                              num_threads=1),
            "stub": stub, "mapped": mapped_kernel,
            "compact_stub": _stub_compact_requests(compact, params, hot, instances, arena,
                                                   rows)},
            batch, repeats, clock="cpu")
    finally:
        arena.close()
    return {"kernel_us_per_row": costs["full"], "compact_kernel_us_per_row": costs["compact"],
            "codec_us_per_row": costs["stub"] - costs["mapped"],
            "compact_codec_us_per_row": costs["compact_stub"] - costs["compact"],
            "row_bytes": vocab * rows.element_size(),
            "compact_bytes_per_row": compact.nbytes() / batch,
            "hot_set": len(hot_ids)}


def run(shapes=SHAPES, batches=BATCHES, transports=tuple(TRANSPORTS), max_tokens: int = 32,
        instances: int = INSTANCES, profile_dir: str | None = None) -> dict:
    """Every (V, dtype) x B x transport (module docstring). profile_dir: each
    configuration's sampler stub profiles in ``<transport>-<V>-<dtype>-<B>/``
    under it."""
    results = []
    for vocab, dtype in shapes:
        for batch in batches:
            kernels = kernel_costs(vocab, dtype, batch, instances=instances)
            for transport in transports:
                profile = (os.path.join(profile_dir, f"{transport}-{vocab}-{dtype}-{batch}")
                           if profile_dir else None)
                served = sampler_cpu_per_token(transport, vocab, dtype, batch, instances,
                                               max_tokens, profile)
                # undecided rows: sent again whole, or read whole in place
                fallback = served["rows_per_token"] - 1.0 + served["in_place_per_token"]
                if transport == "hot-first":
                    moved = kernels["compact_bytes_per_row"] + max(0.0, fallback) * kernels["row_bytes"]
                    copies = COPIES["arena"] * max(0.0, fallback)
                else:
                    moved, copies = kernels["row_bytes"], COPIES[transport]
                results.append({
                    "transport": transport, "vocab": vocab, "dtype": dtype, "batch": batch,
                    **served, "fallback_rate": max(0.0, fallback) if transport == "hot-first"
                    else None, "bytes_per_row": moved,
                    "bytes_share": moved / kernels["row_bytes"], "copies_per_row": copies,
                    "kernel_us_per_row": kernels["kernel_us_per_row"],
                    "compact_kernel_us_per_row": kernels["compact_kernel_us_per_row"],
                    "codec_us_per_row": kernels["codec_us_per_row"],
                    "compact_codec_us_per_row": kernels["compact_codec_us_per_row"],
                    "vs_kernel": served["samplers_us_per_token"] / kernels["kernel_us_per_row"],
                    "hot_set": kernels["hot_set"]})
    return {"results": results,
            "data_plane": f"{LABEL}: 0-ms step, rows synthetic; a real Triton server with "
                          f"{instances} simple_sampler instances, B gRPC streams from one asyncio "
                          f"client process on the same machine",
            "settings": {"max_tokens": max_tokens, "instances": instances,
                         "params": "bench serve-cost's prompt and client, temperature 1, "
                                   "no truncation, min_length = max_tokens",
                         "window": "the whole level, ramp included",
                         "kernels": "same run, the bank's first B rows, one thread, CPU clock"}}


def format_report(report: dict) -> str:
    lines = [f"data plane: {report['data_plane']}",
             f"requests: {report['settings']['params']}",
             f"{'transport':<10} {'V':>7} {'dtype':>8} {'B':>4} {'samplers':>9} {'llm':>8} "
             f"{'triton':>8} {'kernel':>7} {'compact':>7} {'codec':>7} {'c.codec':>7} {'vs kern':>7} "
             f"{'rows/tok':>8} {'rows/req':>8} {'s.us/req':>8} "
             f"{'fallback':>8} {'bytes/row':>9} {'share':>6} {'copies':>6} {'faults':>6} "
             f"{'tok/s':>7}"]
    for r in report["results"]:
        lines.append(
            f"{r['transport']:<10} {r['vocab']:>7} {r['dtype']:>8} {r['batch']:>4} "
            f"{r['samplers_us_per_token']:>7.1f}us {r['llm_us_per_token']:>6.1f}us "
            f"{r['tritonserver_us_per_token']:>6.1f}us {r['kernel_us_per_row']:>5.1f}us "
            f"{r['compact_kernel_us_per_row']:>5.1f}us {r['codec_us_per_row']:>5.1f}us "
            f"{r['compact_codec_us_per_row']:>5.1f}us "
            f"{r['vs_kernel']:>6.2f}x "
            f"{r['rows_per_token']:>8.3f} {r['rows_per_request']:>8.1f} "
            f"{r['samplers_us_per_request']:>8.0f} "
            f"{'-' if r['fallback_rate'] is None else format(r['fallback_rate'], '.2%'):>8} "
            f"{r['bytes_per_row']:>9.0f} {r['bytes_share']:>6.1%} "
            f"{r['copies_per_row']:>6.2f} {r['sampler_faults_per_token']:>6.1f} "
            f"{r['tokens_per_s']:>7.0f}")
    lines.append("CPU us per received token by process (samplers: the simple_sampler stubs "
                 "together); kernel / compact: us/row of sample / sample_compact on the same "
                 "rows, one thread, CPU clock; codec: what the stub's decoding adds to the "
                 "kernel per row (in process, full rows from the arena, one request per "
                 "instance); c.codec: the same for compact rows (hot-first's requests, "
                 "full rows by reference beside them); "
                 "vs kern = samplers / kernel; rows/req: rows per sampler request "
                 "(Triton's count); s.us/req: the samplers' "
                 "CPU per request (what a request costs them, whatever its rows); fallback: hot-first rows undecided "
                 "by their compact row, read whole in the same request from the arena "
                 "(in place) or sent again whole (rows/tok - 1); bytes/row: row data the "
                 "sampler reads per token (hot-first: compact arrays + fallback rows); "
                 "copies: full-row copies on the way (docs/COPIES.md); faults: the "
                 "samplers' minor page faults per token (first touches of mapped rows)")
    return "\n".join(lines)
