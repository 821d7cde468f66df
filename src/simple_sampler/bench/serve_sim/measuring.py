"""`simple-sampler bench serve-sim`: the decode loop at GPU pace, on a
SIMULATED data plane (``serving.simulated``; every output says so).

In-process, ``serving.decoder.Decoder`` runs over a ``SimulatedEngine`` whose
step sleeps like a host thread waiting on a GPU, per (mode, micro_batches, B):
``simple`` (the sampler's kernels in a worker thread over ``instances`` kernel
threads, 1 or 2 micro-batches) and ``inline_kernels`` (the baseline: kernels on
the data-plane thread). A full pass over the B sequences takes ``step_ms``
however it is split, so every mode has the same ideal, ``B / step_s``, and
``efficiency = tokens_per_s / ideal_tokens_per_s``. ``tokens_per_s`` is counted
in whole forwards (:class:`ForwardClock`); the other columns come from
``DecoderStats``. ``--shvs`` samples with the calibrated hot set
(:class:`HotSetSample`) and reports its acceptance; ``--server`` runs the same
through a real server.

The step model, the load, every column and how to read them: docs/SIMULATED.md.
"""
from __future__ import annotations

import asyncio
import functools
import time

import numpy as np

from ... import heap
from ...params import SamplingBatch, SamplingParams
from ...rows import HOT_ROWS_SOURCE, map_hot_ids
from ...sampling import sample
from ...serving.decoder import Decoder
from ...serving.samplers import kernel_sample, threaded
from ...serving.generation import GenerationRequest
from ...serving.engine import StepsThen
from ...serving.simulated import LABEL, SimulatedEngine, SimulatedSpec
from ...serving.simulated_text import SimulatedCodec
from ...shvs.hot_vocab import HotVocab

#: (mode label, decoder mode, micro_batches)
MODES = (("simple", "simple", 1), ("simple", "simple", 2),
         ("inline_kernels", "inline_kernels", 1))
BATCHES = (64, 128, 256)
PROMPT_TOKENS = 16
#: The engines' bank seed, which fixes the id map the hot set is mapped with.
BANK_SEED = 0


def data_plane(instances: int) -> str:
    return (f"{LABEL} (serving.simulated.SimulatedEngine: the forward sleeps, rows are "
            f"synthetic); simple mode's sampler: {instances} kernel threads in-process standing "
            f"in for {instances} simple_sampler instances")


class HotSetSample:
    """``kernel_sample`` with SHVS on: ``sample(..., hot_vocab=hot,
    return_logprobs=False)`` over ``num_threads`` threads, keeping each
    call's ``hot_accepted``. A batch in which a row asks for logprobs goes to
    ``kernel_sample`` (SHVS serves such rows on the full path anyway; this
    bench's requests ask none). Safe to call from several threads at once
    (list appends)."""

    def __init__(self, hot: HotVocab, num_threads: int | None = None):
        self.hot, self.num_threads = hot, num_threads
        self.outcomes: list[np.ndarray] = []

    def __call__(self, logits, batch: SamplingBatch):
        if batch.want_logprobs is None or np.any(batch.want_logprobs):
            return kernel_sample(logits, batch, self.num_threads)
        out = sample(logits, batch, return_logprobs=False, num_threads=self.num_threads,
                     hot_vocab=self.hot)
        self.outcomes.append(out.hot_accepted)
        return out.token_ids, out.logprobs

    def acceptance(self) -> float | None:
        """Rows decided from the hot set / rows SHVS tried; None if none tried."""
        outcomes = np.concatenate(self.outcomes) if self.outcomes else np.empty(0, np.int8)
        tried = outcomes >= 0
        return float(np.mean(outcomes[tried] == 1)) if tried.any() else None


class ForwardClock:
    """The end time and rows of every forward, recorded on the data-plane
    thread by wrapping the engine's forward on the instance: ``step_then``
    where the engine has one (``engine.StepsThen``: the simulated engine's
    ``step`` calls it, and the decode loop calls it alone for a step with
    follow-up work, the hot-first summary), else ``step``."""

    def __init__(self, engine):
        self.ends: list[tuple[float, int]] = []
        self.seconds: list[float] = []  # each forward's own duration, in step with ends
        name = "step_then" if isinstance(engine, StepsThen) else "step"
        forward = getattr(engine, name)

        def timed(seq_ids, *then):
            start = time.perf_counter()
            result = forward(seq_ids, *then)
            end = time.perf_counter()
            self.ends.append((end, len(seq_ids)))
            self.seconds.append(end - start)
            return result
        setattr(engine, name, timed)

    def forward_seconds(self, start: float, end: float) -> float:
        """The forwards' own time, summed over those that ended in (start, end]
        (with ``step_then``, the simulated engine's, the modelled device time
        of the work behind the forward, the hot-first summary, included)."""
        return sum(s for (t, _), s in zip(self.ends, self.seconds) if start < t <= end)

    def rows_per_s(self, start: float, end: float) -> float:
        """Rows per second of the forwards that ended after the last one to
        end by ``start`` and by ``end``, over the time between those ends.
        Forwards run one at a time, so each of them started in that time."""
        ends = [(t, rows) for t, rows in self.ends if t <= end]
        first = max(i for i, (t, _) in enumerate(ends) if t <= start)
        return sum(rows for _, rows in ends[first + 1:]) / (ends[-1][0] - ends[first][0])


async def _measure(decoder: Decoder, clock: ForwardClock, batch: int, vocab: int,
                   warmup: int, measure: int, top_p: float) -> dict:
    """Run B requests through a started decoder; figures of the steady window."""
    rng = np.random.default_rng(0)
    handles = [decoder.submit(GenerationRequest(
        prompt_ids=rng.integers(0, vocab, PROMPT_TOKENS).tolist(),
        max_tokens=warmup + measure + 2, ignore_end=True,
        sampling=SamplingParams(seed=i, top_p=top_p)))
        for i in range(batch)]
    start_at, end_at = warmup * batch, (warmup + measure) * batch
    marks: dict[str, tuple] = {}
    ended = asyncio.Event()
    delivered = 0
    arrivals: list[list[float]] = [[] for _ in handles]

    def mark(name: str) -> None:
        stats = decoder.stats
        marks[name] = (time.perf_counter(), time.thread_time(), stats.tokens,
                       stats.sampling_exposed_s, stats.sampler_s, stats.loop_s,
                       stats.summary_s)

    async def consume(index: int, handle) -> None:
        nonlocal delivered
        async for event in handle:
            if event.error:
                raise RuntimeError(f"request {index} failed: {event.error}")
            arrivals[index].append(time.perf_counter())
            delivered += len(event.token_ids)
            if delivered == start_at:
                mark("start")
            elif delivered == end_at:
                mark("end")
                ended.set()

    consumers = [asyncio.create_task(consume(i, h)) for i, h in enumerate(handles)]
    waiter = asyncio.create_task(ended.wait())
    pending = {waiter, *consumers}
    # a consumer may drain all its tokens before the others are read (a
    # loaded event loop), so one finishing does not end the window
    while pending and not ended.is_set():
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        failed = [t for t in done if not t.cancelled() and t.exception()]
        if failed:
            break
    for task in [waiter, *consumers]:
        task.cancel()
    failed = [t for t in consumers if t.done() and not t.cancelled() and t.exception()]
    if failed:
        raise failed[0].exception()
    (t0, cpu0, tok0, exp0, smp0, loop0, sum0), (t1, cpu1, tok1, exp1, smp1, loop1, sum1) = \
        marks["start"], marks["end"]
    passes = (tok1 - tok0) / batch
    gaps = np.concatenate([np.diff([t for t in times if t0 <= t <= t1]) for times in arrivals])
    return {"tokens_per_s": clock.rows_per_s(t0, t1),
            "exposed_sampling_ms_per_step": 1e3 * (exp1 - exp0) / passes,
            "sampler_ms_per_step": 1e3 * (smp1 - smp0) / passes,
            "forward_ms_per_step": 1e3 * clock.forward_seconds(t0, t1) / passes,
            # the work run behind the forward in the data-plane thread (the
            # hot-first summary), timed around it step by step
            "summary_ms_per_step": 1e3 * (sum1 - sum0) / passes,
            "loop_ms_per_step": 1e3 * (loop1 - loop0) / passes,
            "loop_thread_cpu_ms_per_step": 1e3 * (cpu1 - cpu0) / passes,
            "itl_ms_p50": float(np.percentile(gaps, 50)) * 1e3,
            "itl_ms_p95": float(np.percentile(gaps, 95)) * 1e3}


def hot_first_sampler(engine, hot: HotVocab, instances: int, lanes: int = 1):
    """The llm model's hot-first sampler in-process: the engine's summary
    (the simulated engine's modelled GPU step, the torch engine's CUDA
    graph: ``triton.hot_first_sampler.hot_first_sampler``), compact rows
    sharded over `instances` threads standing in for the sampler instances
    (the sampler model's own code, ``serve_request``), the undecided rows
    whole."""
    from ...triton import hot_first_sampler as hot_first
    from ...triton.sampler_serve import serve_request
    from ...triton.sampler_pool import SamplerPool
    from ...triton.sampler_targets import SamplerTarget

    def instance(inputs):
        return serve_request(inputs, engine.vocab_size, hot).outputs

    pool = SamplerPool([SamplerTarget(f"instance-{i}", instance) for i in range(instances)],
                       lanes=lanes)
    return hot_first.hot_first_sampler(engine, pool, hot)


async def run_one(codec: SimulatedCodec, mode: str, micro_batches: int, batch: int, vocab: int,
                  dtype: str, step_ms: float, instances: int, warmup: int, measure: int,
                  hot_order: np.ndarray | None = None, top_p: float = 1.0,
                  handoff: str = "full", launch_ahead: str = "auto") -> dict:
    """One row of the report: a fresh engine and decoder for (mode, micro_batches, B);
    SHVS on with ``hot_order`` (SmolLM2 token ids, the hot set); with handoff
    hot-first, simple mode's rows cross hot-first (``hot_first_sampler``)."""
    spec = SimulatedSpec(vocab=vocab, dtype=dtype, step_a_ms=0.0, step_b_ms=step_ms / batch)
    engine = SimulatedEngine(spec, max_batch_size=batch,
                             max_context=PROMPT_TOKENS + warmup + measure + 4, seed=BANK_SEED)
    threads = instances if mode == "simple" else None
    hot = None if hot_order is None else HotVocab(map_hot_ids(hot_order, vocab, BANK_SEED), vocab)
    hot_sample = None if hot is None or handoff == "hot-first" else HotSetSample(hot, threads)
    sample_fn = hot_sample or functools.partial(kernel_sample, num_threads=threads)
    sampler = threaded(sample_fn) if mode == "simple" else None
    if mode == "simple" and handoff == "hot-first":
        sampler = hot_first_sampler(engine, hot, instances, micro_batches)
    decoder = Decoder(engine, codec, mode, sampler, micro_batches, launch_ahead=launch_ahead)
    if mode == "inline_kernels":
        # The decoder's inline path calls local_sample (samplers.kernel_sample
        # by default) on the data-plane thread; this keeps it, SHVS on or off.
        decoder.data_plane.local_sample = sample_fn
    clock = ForwardClock(engine)
    await decoder.start()
    try:
        with heap.frozen("bench serve-sim"):  # as a served stub's heap (llm/1/model.py)
            figures = await _measure(decoder, clock, batch, vocab, warmup, measure, top_p)
    finally:
        await decoder.close()
    ideal = batch / (step_ms / 1e3)
    return {"mode": mode, "micro_batches": micro_batches, "batch": batch, "vocab": vocab,
            "dtype": dtype, "step_ms": step_ms, "top_p": top_p, **figures,
            "ideal_tokens_per_s": ideal,
            "efficiency": figures["tokens_per_s"] / ideal, "shvs": hot_sample is not None,
            "shvs_acceptance": hot_sample and hot_sample.acceptance(),
            "handoff": handoff if mode == "simple" else "full",
            "launch_ahead": "on" if decoder.launches_ahead else "off"}


def run(batches=BATCHES, vocab: int = 151_936, dtype: str = "bfloat16", step_ms: float = 25.0,
        instances: int = 2, warmup: int = 8, measure: int = 40, modes=MODES,
        shvs: bool = False, profile_path: str | None = None, top_p: float = 1.0,
        handoff: str = "full", launch_ahead=("auto",)) -> dict:
    """Every (mode, micro_batches) of ``modes`` at every B of ``batches``, for
    each decoder setting of ``launch_ahead`` (auto: on, the engine is
    simulated); with
    ``shvs``, the kernels use the hot set of the profile at ``profile_path``
    (default as ``bench shvs``: ``bench.shvs.measuring.resolve_profile``); every request
    samples with ``top_p`` (ValueError outside (0, 1])."""
    from ..shvs.measuring import resolve_profile

    SamplingParams(top_p=top_p).validate()
    codec = SimulatedCodec.from_source(None)
    profile = resolve_profile(profile_path, quick=False) if shvs or handoff != "full" else None
    hot_order = profile.order[:profile.chosen_size] if profile else None
    results = [asyncio.run(run_one(codec, mode, micro_batches, batch, vocab, dtype, step_ms,
                                   instances, warmup, measure, hot_order, top_p, handoff, ahead))
               for mode, _, micro_batches in modes for batch in batches
               for ahead in launch_ahead]
    return {"results": results, "data_plane": data_plane(instances),
            "settings": {"rows": HOT_ROWS_SOURCE,
                         "hot_set": (f"SmolLM2 profile's first {profile.chosen_size} ids "
                                     f"(calibrated on {profile.meta.get('prompts')} other "
                                     f"prompts), mapped into V by rows.map_hot_ids"
                                     if profile else None),
                         "handoff": handoff,
                         "sampler_instances": instances, "warmup_tokens": warmup,
                         "measured_tokens": measure,
                         "params": f"temperature 1, "
                                   f"{'no truncation' if top_p == 1 else f'top_p {top_p:g}'}, "
                                   f"seeded, ignore_end",
                         "step_model": "a full pass over B rows takes step_ms; a micro-batch "
                                       "of n rows step_ms * n / B (no cost for the split)"}}


def server_data_plane(instances: int) -> str:
    return (f"{LABEL} (serving.simulated.SimulatedEngine: the forward sleeps, rows are "
            f"synthetic) inside a real Triton server: preprocessing, llm and {instances} "
            f"simple_sampler instances over BLS, gRPC streaming clients on the same machine")


def run_server(batches=BATCHES, vocab: int = 151_936, dtype: str = "bfloat16",
               step_ms: float = 25.0, instances: int = 2, max_tokens: int = 64,
               modes=MODES, handoff: str = "full", row_transport: str = "arena") -> dict:
    """The same rows through a real server (``serve --engine simulated``):
    per (mode, micro_batches, B) a fresh server; B streaming clients each send
    one request of ``max_tokens`` tokens (``bench serve``'s ``run_level``:
    chat prompts, temperature 1, min_length = max_tokens) at once. Figures
    over the whole level, ramp included (unlike the in-process window):
    tokens/s from the clients' wall time, ITL from their arrival gaps,
    sampler and exposed sampling from the llm model's counters. No loop
    figures (the server does not export them)."""

    from ...settings import SIMULATED_DTYPES, LlmSettings, SamplerSettings
    from ...launch.serve import assemble_in_temp, shared_memory_bytes
    from ...launch.server import TritonServer
    from ..serve.measuring import COUNTERS, prompts, run_level
    from ..server_meter import llm_counters

    texts, results = prompts(), []
    for mode, decoder_mode, micro_batches in modes:
        for batch in batches:
            profile = "hot_vocab.npz" if handoff == "hot-first" else ""
            sampler = SamplerSettings(sampler_instances=instances, sampler_max_batch_size=batch,
                                      logits_dtype=SIMULATED_DTYPES[dtype],
                                      hot_vocab_profile=profile)
            llm = LlmSettings(engine="simulated", sim_vocab=vocab, sim_dtype=dtype,
                              handoff=handoff, row_transport=row_transport,
                              hot_vocab_profile=profile,
                              sim_step_a_ms=0.0, sim_step_b_ms=step_ms / batch,
                              sampling_mode=decoder_mode, micro_batches=micro_batches,
                              sampler_shards=instances, engine_max_batch_size=batch,
                              generate_max_batch_size=batch, max_context=512)
            repository = assemble_in_temp(sampler, llm, "simple-sampler-serve-sim-")
            with TritonServer(repository, shm_bytes=shared_memory_bytes(sampler),
                              temporary_repository=True) as server:
                run_level(server, 2, 2, 8, texts)  # warm up: first steps, first BLS calls
                before = llm_counters(server, COUNTERS)
                level = run_level(server, batch, batch, max_tokens, texts)
                after = llm_counters(server, COUNTERS)
            passes = max_tokens  # every request yields max_tokens tokens, B rows per pass
            ideal = batch / (step_ms / 1e3)
            results.append({
                "mode": mode, "micro_batches": micro_batches, "batch": batch, "vocab": vocab,
                "dtype": dtype, "step_ms": step_ms, "top_p": 1.0,
                "tokens_per_s": level["tokens_per_s"],
                "ideal_tokens_per_s": ideal, "efficiency": level["tokens_per_s"] / ideal,
                "exposed_sampling_ms_per_step": (after["sampling_exposed_us"]
                                                 - before["sampling_exposed_us"]) / 1e3 / passes,
                "sampler_ms_per_step": (after["sampler_us"] - before["sampler_us"]) / 1e3 / passes,
                "loop_ms_per_step": None, "loop_thread_cpu_ms_per_step": None,
                "itl_ms_p50": level["itl_ms_p50"], "itl_ms_p95": level["itl_ms_p95"],
                "shvs": False, "shvs_acceptance": None,
                "handoff": handoff if mode == "simple" else "full",
                "row_transport": row_transport})
    return {"results": results, "data_plane": server_data_plane(instances),
            "settings": {"rows": HOT_ROWS_SOURCE, "sampler_instances": instances,
                         "max_tokens": max_tokens,
                         "params": "chat prompts, temperature 1, no truncation, "
                                   "min_length = max_tokens",
                         "step_model": "a full pass over B rows takes step_ms; a micro-batch "
                                       "of n rows step_ms * n / B (no cost for the split)",
                         "window": "the whole level, ramp included"}}


def milliseconds(value: float | None, width: int) -> str:
    return f"{'n/a':>{width + 2}}" if value is None else f"{value:>{width}.1f}ms"


def shvs_cell(row: dict) -> str:
    if not row["shvs"]:
        return "off"
    return "n/a" if row["shvs_acceptance"] is None else f"{row['shvs_acceptance']:.1%}"


def launched_ahead(result: dict) -> str:
    """Whether the result's steps were launched ahead (off: files from before
    ``launch_ahead``, which had no such thing)."""
    return result.get("launch_ahead", "off")


def format_report(report: dict) -> str:
    lines = [f"data plane: {report['data_plane']}",
             f"requests: {report['settings']['params']}; rows: {report['settings']['rows']}",
             f"{'mode':<15} {'mb':>2} {'B':>4} {'V':>7} {'dtype':>8} {'step':>5} {'tok/s':>8} "
             f"{'ideal':>8} {'eff':>5} {'exposed':>8} {'sampler':>8} {'loop':>6} {'thread':>6} "
             f"{'ITL p50':>8} {'ITL p95':>8} {'shvs':>6} {'handoff':>9} {'ahead':>5}"]
    for r in report["results"]:
        lines.append(
            f"{r['mode']:<15} {r['micro_batches']:>2} {r['batch']:>4} {r['vocab']:>7} "
            f"{r['dtype']:>8} {r['step_ms']:>4.0f}ms {r['tokens_per_s']:>8.0f} "
            f"{r['ideal_tokens_per_s']:>8.0f} {r['efficiency']:>5.2f} "
            f"{r['exposed_sampling_ms_per_step']:>6.2f}ms {r['sampler_ms_per_step']:>6.2f}ms "
            f"{milliseconds(r['loop_ms_per_step'], 4)} "
            f"{milliseconds(r['loop_thread_cpu_ms_per_step'], 4)} "
            f"{r['itl_ms_p50']:>6.1f}ms {r['itl_ms_p95']:>6.1f}ms "
            f"{shvs_cell(r):>6} {r.get('handoff', 'full'):>9} {launched_ahead(r):>5}")
    lines.append("per step = per full pass over the B sequences; exposed = sampling while no "
                 "forward ran; loop = DecoderStats.loop_s; thread = all CPU time of "
                 "the event-loop thread (loop, asyncio, the bench's consumers); shvs = "
                 "the share of rows the hot set decided (whole run), off without --shvs; "
                 "ahead = each step launched before the step before it made its events "
                 "(launch_ahead)")
    return "\n".join(lines)
