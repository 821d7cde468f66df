"""`simple-sampler bench serve-gpu`: the decode loop over a real model on a
CUDA GPU (``TorchEngine``, ``--device cuda``), SIMPLE against sampling on the
GPU, in one process.

Per (mode, B) a fresh engine over the same model (loaded once): ``simple``
(one pinned device-to-host copy per step, the kernels in a worker thread over
``instances`` kernel threads, as ``bench serve-sim``), ``simple_overlap`` (the
same with two micro-batches), ``simple_hot_first`` (one micro-batch, the rows
crossing hot-first as the llm model sends them with ``--handoff hot-first``:
they stay on the GPU, the summary is replayed there as a CUDA graph
(``TorchEngine.prepare_hot_first``, ``summary_graph.GraphedSummary``), the
compact rows go to ``instances`` threads running the sampler model's own code
(``serve_sim.hot_first_sampler``) and only an undecided row crosses whole;
the hot set is the shipped SmolLM2 profile's, so the model must have
SmolLM2's vocabulary) and ``gpu_inline`` (``serving/inline.py``: the whole
batch in one pass of torch ops on the GPU, vLLM v1's native design: penalties
by scatter, one batched sort for top-k / top-p, one draw per row keyed by
(seed, step); no copy of the rows, no overlap). Load and window as ``bench serve-sim`` (``serve_sim._measure``), with
``top_p`` 0.9 by default (the sort is the GPU baseline's cost). Refuses clearly
without CUDA (``serving.device.resolve``); run on an H200 once
(docs/results/gpu-2026-11-28.md), never in this project's CI (no GPU there).

The data plane (``--engine``): ``static`` (default; ``serving/static_decode``:
a static KV cache, the decode step replayed as CUDA graphs per batch bucket,
GPU-bound) or ``eager`` (``TorchEngine``: the Hugging Face forward, launch
bound). ``--model-config NAME`` (a shipped config: smollm2-135m,
qwen2.5-0.5b, llama-3.2-1b, llama-3.1-8b, or a config.json) draws random
weights on the device: the model's step times, not its tokens.

``forward_only`` (static engine): the data plane's bound, the decode step
replayed with its argmax fed back on the device (no host copy, no sampler),
beside an HBM estimate: the bytes a step must read (weights once, the static
cache's window) over the device's measured copy bandwidth, and ``setup_s``, the
bucket's first replay (its graph's capture; the compiled step's compile).

Decode steps (``--decode-step``, static engine): ``eager`` (default) and
``compiled`` (``StaticEngine(..., compile_decode=True)``,
``serving/compiled_decode``: torch.compile over fused weights); every mode,
forward_only included, runs once per step listed, a compiled row's mode
suffixed ``_compiled`` and its ratios taken against the compiled rows. A
compiled step that fails, compiling or running, is reported (``errors``) and
its rows left out: the eager rows still run.

Rows (``--rows``): ``flat`` are the forward's own (a random model's rows are
nearly flat: the sampler's worst case); ``fitted`` replaces them, after the
real forward and inside the step, with rows fitted to SmolLM2's (real rows at
V = 49,152, ``rows.synthetic_hot_rows`` at other V: NOT MODEL OUTPUTS, real
token ids kept, so the shipped hot set maps onto them): the step's time is the
model's, the rows realistic. Every result carries its rows' label.

The engine on CUDA, the modes and what the bench prints: docs/GPU.md, "The
PyTorch data plane on CUDA" and "GPU-bound data plane".
"""
from __future__ import annotations

import asyncio
import functools
import gc
import time

from ... import heap
from ...models import load_model, random_model
from ...rows import HOT_ROWS_SOURCE, SMOLLM2_VOCAB, map_hot_ids, real_rows, synthetic_hot_rows
from ...serving.decoder import Decoder
from ...serving.samplers import kernel_sample, threaded
from ...serving.device import resolve
from ...settings import DECODE_STEPS, LlmSettings
from ...serving.compiled_decode import CompileDecodeError
from ...serving.static_decode import (StaticEngine, bytes_per_step, copy_bandwidth,
                                     forward_only_ms, model_from_config, synchronize)
from ...serving.text import TextCodec
from ...serving.torch_engine import TorchEngine
from ...launch.install import project_file
from ...shvs.hot_vocab import HotVocab, load_profile
from ..calibrate import DEFAULT_OUTPUT
from ..serve_sim.measuring import PROMPT_TOKENS, ForwardClock, _measure, hot_first_sampler

#: (label, decoder mode, micro_batches, handoff); forward_only runs no decoder
MODES = (("simple", "simple", 1, "full"), ("simple_overlap", "simple", 2, "full"),
         ("simple_hot_first", "simple", 1, "hot-first"), ("gpu_inline", "inline", 1, "full"))
FORWARD_ONLY = "forward_only"
BATCHES = (64, 128, 256)
ENGINES = {"static": StaticEngine, "eager": TorchEngine}
ROWS = ("flat", "fitted")
#: fitted rows per bank: a row's is picked by its slot and position
FITTED_BANK = 64


def rows_label(rows: str, vocab: int) -> str:
    if rows == "flat":
        return "flat (the model's own rows)"
    return ("fitted: real SmolLM2 rows" if vocab == SMOLLM2_VOCAB
            else f"fitted: {HOT_ROWS_SOURCE}, NOT MODEL OUTPUTS")


@functools.lru_cache(maxsize=2)
def _fitted_host_rows(vocab: int):
    real = real_rows(FITTED_BANK)
    return real if vocab == SMOLLM2_VOCAB else synthetic_hot_rows(real, vocab)


def fitted_bank(vocab: int, device):
    """float32 [FITTED_BANK, vocab] on the device (module docstring); the
    host rows are made once per V."""
    import torch

    return torch.from_numpy(_fitted_host_rows(vocab)).to(device)


def substitute_rows(engine, bank) -> None:
    """The engine's forward, then each row replaced by a bank row picked by
    its (slot, position): on the device, before the host copy."""
    import torch

    forward = engine._forward

    def fitted(work):
        logits = forward(work)
        picks = torch.tensor([(slot * 7 + cached) % bank.shape[0] for slot, cached, _ in work],
                             device=bank.device)
        return bank.index_select(0, picks).to(logits.dtype)
    engine._forward = fitted


def make_engine(model, engine: str, batch: int, warmup: int, measure: int, host_logits: bool,
                decode_step: str = "eager"):
    compiled = {"compile_decode": True} if decode_step == "compiled" else {}
    return ENGINES[engine](model, max_batch_size=batch,
                           max_context=PROMPT_TOKENS + warmup + measure + 4,
                           host_logits=host_logits, **compiled)


def step_label(mode: str, decode_step: str) -> str:
    """A result's mode as printed: suffixed on the compiled step."""
    return mode if decode_step == "eager" else f"{mode}_{decode_step}"


async def run_one(model, codec: TextCodec, mode: str, decoder_mode: str, micro_batches: int,
                  batch: int, instances: int, warmup: int, measure: int, top_p: float,
                  handoff: str = "full", hot: HotVocab | None = None, engine_kind: str = "eager",
                  bank=None, decode_step: str = "eager",
                  launch_ahead: str = LlmSettings.launch_ahead) -> dict:
    """One row of the report; `hot`: the hot set, for handoff hot-first;
    `bank`: fitted rows to substitute (None: the forward's own)."""
    engine = make_engine(model, engine_kind, batch, warmup, measure, decoder_mode != "inline",
                         decode_step)
    if bank is not None:
        substitute_rows(engine, bank)
    sampler = threaded(functools.partial(kernel_sample, num_threads=instances)) \
        if decoder_mode == "simple" else None
    if handoff == "hot-first":
        sampler = hot_first_sampler(engine, hot, instances, micro_batches)
    decoder = Decoder(engine, codec, decoder_mode, sampler, micro_batches,
                      launch_ahead=launch_ahead)
    clock = ForwardClock(engine)
    await decoder.start()
    try:
        with heap.frozen("bench serve-gpu"):  # as a served stub's heap (llm/1/model.py)
            figures = await _measure(decoder, clock, batch, engine.vocab_size, warmup,
                                     measure, top_p)
    finally:
        await decoder.close()
    stats = getattr(sampler, "stats", None)  # the hot-first sampler's rows and fallbacks
    # a row the compact decision left NEED_FULL or NEED_COLD went whole
    fallback = (stats["need_full"] + stats["need_cold"]) / stats["rows"] \
        if stats and stats["rows"] else None
    return {"mode": step_label(mode, decode_step), "decode_step": decode_step,
            "micro_batches": micro_batches, "batch": batch, "handoff": handoff,
            "launch_ahead": "on" if decoder.launches_ahead else "off",
            "vocab": engine.vocab_size, "top_p": top_p, "fallback_rate": fallback,
            "sampler_threads": instances if decoder_mode == "simple" else 0, **figures}


def run_forward_only(model, batch: int, warmup: int, measure: int, bandwidth: float,
                     decode_step: str = "eager") -> dict:
    """forward_only at B: the bucket's first replay timed (``setup_s``: its
    capture, and the compiled step's compile; it writes a position no step
    reads), B sequences prefilled, then ``warmup + measure`` decode steps
    replayed on the device; ms per step beside the HBM estimate.
    CompileDecodeError when the compiled step does not compile."""
    import numpy as np
    from torch._dynamo.utils import counters

    engine = make_engine(model, "static", batch, warmup, measure, False, decode_step)
    graphs_before = counters["stats"]["unique_graphs"]
    start = time.perf_counter()
    engine.graphs.replay(batch)
    synchronize(engine.device)
    setup_s = time.perf_counter() - start
    rng = np.random.default_rng(0)
    ids = list(range(batch))
    for i in ids:
        engine.add(i, rng.integers(0, engine.vocab_size, PROMPT_TOKENS).tolist())
    engine.append(ids, engine.step(ids).argmax(dim=-1).tolist())  # the eager prefill
    ms = forward_only_ms(engine, warmup + measure)
    read = bytes_per_step(engine, batch)
    estimate_ms = read["total"] / bandwidth * 1e3
    return {"mode": step_label(FORWARD_ONLY, decode_step), "decode_step": decode_step,
            "rows": "-", "micro_batches": 1, "batch": batch, "handoff": "-",
            # dynamo's graphs made by the setup: 0 where an earlier B's serve this one
            "setup_s": setup_s, "graphs_compiled": counters["stats"]["unique_graphs"] - graphs_before,
            "vocab": engine.vocab_size, "top_p": None, "fallback_rate": None,
            "sampler_threads": 0, "tokens_per_s": batch / (ms / 1e3),
            "ms_per_step": ms, "hbm_estimate_ms": estimate_ms, "vs_hbm_estimate": ms / estimate_ms,
            "bytes_per_step": read, "forward_ms_per_step": ms,
            "exposed_sampling_ms_per_step": 0.0, "summary_ms_per_step": 0.0,
            "itl_ms_p50": ms, "itl_ms_p95": ms}


def load(model_source, model_config, random_weights: bool, device, torch_dtype):
    """(model on the device, codec, label)."""
    from ...serving.simulated_text import SimulatedCodec

    if model_config is not None:
        model = model_from_config(model_config, device, torch_dtype)
        # SmolLM2's tokenizer decodes its ids; wider ids read " t<id>" (never shown here)
        return model, SimulatedCodec.from_source(None), \
            f"--model-config {model_config}, RANDOM WEIGHTS (its shapes, not its tokens)"
    if random_weights and model_source is None:
        raise ValueError("--random-weights needs --model DIR (its config.json and tokenizer)")
    model, _ = (random_model(model_source, torch_dtype) if random_weights
                else load_model(model_source, torch_dtype))
    label = (model_source or "SmolLM2-135M-Instruct") + (
        ", RANDOM WEIGHTS (its shapes, not its tokens)" if random_weights else "")
    return model.to(device), TextCodec.from_source(model_source), label


def hot_set(vocab: int) -> HotVocab:
    """The shipped SmolLM2 profile's hot set, mapped as the fitted rows map
    SmolLM2's ids at another V (the same ``rows.id_map``)."""
    hot = load_profile(project_file(str(DEFAULT_OUTPUT))).hot_vocab()
    return hot if vocab == hot.vocab_size else HotVocab(map_hot_ids(hot.ids, vocab), vocab)


def run(model_source: str | None = None, dtype: str = "bfloat16", batches=BATCHES,
        instances: int = 2, warmup: int = 8, measure: int = 40, top_p=(0.9,),
        modes=MODES, random_weights: bool = False, model_config: str | None = None,
        engine: str = "static", rows=("flat",), forward_only: bool = True,
        device: str = "cuda", loaded: tuple | None = None, decode_steps=("eager",),
        launch_ahead: str = LlmSettings.launch_ahead) -> dict:
    """Every mode at every (decode step, rows, top_p, B), and forward_only at
    every (decode step, B) (static engine), the decoder's ``launch_ahead``
    as given (auto: on, on a GPU); RuntimeError (the reason) without
    CUDA (``device`` cpu: the tests' tiny runs, figures that mean nothing).
    ``loaded``: ``load``'s (model, codec, label), to run several times over
    one model. A decode step that does not compile leaves its rows out and
    its error in ``errors`` (module docstring)."""
    import torch

    if engine != "static" and tuple(decode_steps) != ("eager",):
        raise ValueError("--decode-step compiled needs --engine static")
    unknown = set(decode_steps) - set(DECODE_STEPS)
    if unknown:
        raise ValueError(f"decode steps are {', '.join(DECODE_STEPS)}, not {sorted(unknown)}")
    device, torch_dtype = resolve(device, dtype)
    model, codec, label = loaded or load(model_source, model_config, random_weights, device,
                                         torch_dtype)
    vocab = model.config.vocab_size
    hot = hot_set(vocab)
    results, errors = [], {}

    def attempt(step: str, measure_one) -> None:
        """One result on ``step`` unless that step failed before."""
        if step in errors:
            return
        try:
            results.append(measure_one())
        except Exception as error:
            if step == "eager":
                raise
            # the compiled step has not run on a GPU yet: its failure, compiling
            # (CompileDecodeError names the option) or running, is reported, and
            # the eager rows still run
            errors[step] = (str(error) if isinstance(error, CompileDecodeError)
                            else f"{type(error).__name__}: {error}")
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the next engine's cache gets the freed memory

    cells = [(s, r, p, m, b) for s in decode_steps for r in rows for p in top_p for m in modes
             for b in batches]
    if forward_only and engine == "static":
        bandwidth = copy_bandwidth(device)
        for step in decode_steps:
            for b in batches:
                attempt(step, lambda: run_forward_only(model, b, warmup, measure, bandwidth,
                                                       step))
    banks = {r: None if r == "flat" else fitted_bank(vocab, device) for r in rows}
    for step, rows_kind, p, (mode, decoder_mode, micro_batches, handoff), batch in cells:
        attempt(step, lambda: {
            **asyncio.run(run_one(model, codec, mode, decoder_mode, micro_batches, batch,
                                  instances, warmup, measure, p, handoff, hot, engine,
                                  banks[rows_kind], step, launch_ahead)),
            "rows": rows_label(rows_kind, vocab)})
    return {"results": add_ratios(results), "errors": errors,
            "gpu": {"name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                             else "CPU (not a GPU: figures mean nothing)"),
                    "torch": torch.__version__, "cuda": torch.version.cuda, "dtype": dtype,
                    "copy_bandwidth_gb_s": bandwidth / 1e9 if forward_only and engine == "static"
                    else None},
            "settings": {"model": label, "engine": engine, "decode_steps": list(decode_steps),
                         "launch_ahead": launch_ahead,
                         "sampler_instances": instances,
                         "hot_set": hot.size, "warmup_tokens": warmup, "measured_tokens": measure,
                         "params": "temperature 1, top_p as listed, seeded, ignore_end"}}


def add_ratios(results: list[dict]) -> list[dict]:
    """Each result's tokens/s over gpu_inline's and over forward_only's on
    the same decode step, at the same (rows, top_p, B) and B."""
    step = lambda r: r.get("decode_step", "eager")  # noqa: E731 (results before the option)
    inline = {(step(r), r["rows"], r["top_p"], r["batch"]): r["tokens_per_s"]
              for r in results if r["mode"] == step_label("gpu_inline", step(r))}
    bound = {(step(r), r["batch"]): r["tokens_per_s"]
             for r in results if r["mode"] == step_label(FORWARD_ONLY, step(r))}
    for r in results:
        key, batch = (step(r), r.get("rows"), r["top_p"], r["batch"]), (step(r), r["batch"])
        r["vs_gpu_inline"] = r["tokens_per_s"] / inline[key] if key in inline else None
        r["vs_forward_only"] = r["tokens_per_s"] / bound[batch] if batch in bound else None
    return results


def format_report(report: dict) -> str:
    gpu, settings = report["gpu"], report["settings"]
    bandwidth = gpu.get("copy_bandwidth_gb_s")
    lines = [f"data plane: {settings.get('engine', 'eager')} engine on {gpu['name']} "
             f"({settings['model']}, {gpu['dtype']}; torch {gpu['torch']}, CUDA {gpu['cuda']}"
             + (f"; copy bandwidth {bandwidth:.0f} GB/s" if bandwidth else "") + "); simple: "
             f"{settings['sampler_instances']} kernel threads in-process standing in for "
             f"simple_sampler instances; gpu_inline: one batched torch pass on the GPU",
             f"requests: {settings['params']}; launch_ahead "
             f"{settings.get('launch_ahead', 'auto')} (auto: on, on a GPU; each row's as it ran "
             "in the JSON)",
             f"{'mode':<25} {'rows':<7} {'top_p':>5} {'mb':>2} {'B':>4} {'V':>7} {'tok/s':>8} "
             f"{'x inline':>8} {'x bound':>7} {'forward':>8} {'exposed':>8} {'ITL p50':>8} "
             f"{'ITL p95':>8} {'thr':>3} {'fallback':>8} {'HBM est':>8} {'setup':>7}"]
    for r in report["results"]:
        ratio = lambda key: f"{r[key]:.2f}" if r.get(key) is not None else "-"  # noqa: E731
        fallback = f"{100 * r['fallback_rate']:.1f}%" if r.get("fallback_rate") is not None \
            else "-"
        estimate = f"{r['hbm_estimate_ms']:.2f}ms" if "hbm_estimate_ms" in r else "-"
        setup = f"{r['setup_s']:.1f}s" if "setup_s" in r else "-"
        top_p = f"{r['top_p']:g}" if r.get("top_p") is not None else "-"
        lines.append(f"{r['mode']:<25} {r.get('rows', 'flat').split(' ')[0].rstrip(':'):<7} "
                     f"{top_p:>5} {r['micro_batches']:>2} {r['batch']:>4} {r['vocab']:>7} "
                     f"{r['tokens_per_s']:>8.0f} {ratio('vs_gpu_inline'):>8} "
                     f"{ratio('vs_forward_only'):>7} {r['forward_ms_per_step']:>6.2f}ms "
                     f"{r['exposed_sampling_ms_per_step']:>6.2f}ms {r['itl_ms_p50']:>6.1f}ms "
                     f"{r['itl_ms_p95']:>6.1f}ms {r.get('sampler_threads', 0):>3} {fallback:>8} "
                     f"{estimate:>8} {setup:>7}")
    labels = sorted({r["rows"] for r in report["results"] if r.get("rows", "-") != "-"})
    lines.append("x inline / x bound = tokens/s over gpu_inline's at the same decode step, "
                 "rows, top_p and B / over forward_only's at the same step and B, measured in "
                 "this run (_compiled: the compiled decode step); forward = the "
                 "engine's steps (forward_only: the replayed decode step alone, argmax fed back "
                 "on the device); exposed = sampling while no forward ran, per full pass over "
                 "the B sequences; thr = sampler threads; HBM est = (weights + the static "
                 "cache's window) / the measured copy bandwidth; setup = forward_only's first "
                 "replay: the graph's capture and, _compiled, torch.compile; fallback = rows "
                 f"simple_hot_first sent whole (|H| = {settings['hot_set']}); rows: "
                 + "; ".join(labels))
    lines += [f"{step} decode step FAILED, its rows left out: {error}"
              for step, error in report.get("errors", {}).items()]
    return "\n".join(lines)
