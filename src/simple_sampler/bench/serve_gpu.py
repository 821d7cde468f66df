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
without CUDA (``serving.device.resolve``); never run in this project's CI or on
its development machines (no GPU there).

The engine on CUDA, the modes and what the bench prints: docs/GPU.md, "The
PyTorch data plane on CUDA".
"""
from __future__ import annotations

import asyncio
import functools
import gc

from ..models import load_model, random_model
from ..serving.decoder import Decoder, kernel_sample, threaded
from ..serving.device import resolve
from ..serving.text import TextCodec
from ..serving.torch_engine import TorchEngine
from ..launch.install import project_file
from ..shvs.hot_vocab import HotVocab, load_profile
from .calibrate import DEFAULT_OUTPUT
from .serve_sim import PROMPT_TOKENS, ForwardClock, _measure, hot_first_sampler

#: (label, decoder mode, micro_batches, handoff)
MODES = (("simple", "simple", 1, "full"), ("simple_overlap", "simple", 2, "full"),
         ("simple_hot_first", "simple", 1, "hot-first"), ("gpu_inline", "inline", 1, "full"))
BATCHES = (64, 128, 256)


async def run_one(model, codec: TextCodec, mode: str, decoder_mode: str, micro_batches: int,
                  batch: int, instances: int, warmup: int, measure: int, top_p: float,
                  handoff: str = "full", hot: HotVocab | None = None) -> dict:
    """One row of the report; `hot`: the hot set, for handoff hot-first."""
    engine = TorchEngine(model, max_batch_size=batch,
                         max_context=PROMPT_TOKENS + warmup + measure + 4,
                         host_logits=decoder_mode != "inline")
    sampler = threaded(functools.partial(kernel_sample, num_threads=instances)) \
        if decoder_mode == "simple" else None
    if handoff == "hot-first":
        sampler = hot_first_sampler(engine, hot, instances)
    decoder = Decoder(engine, codec, decoder_mode, sampler, micro_batches)
    clock = ForwardClock(engine)
    await decoder.start()
    try:
        figures = await _measure(decoder, clock, batch, engine.vocab_size, warmup, measure,
                                 top_p)
    finally:
        await decoder.close()
    stats = getattr(sampler, "stats", None)  # the hot-first sampler's rows and fallbacks
    # a row the compact decision left NEED_FULL or NEED_COLD went whole
    fallback = (stats["need_full"] + stats["need_cold"]) / stats["rows"] \
        if stats and stats["rows"] else None
    return {"mode": mode, "micro_batches": micro_batches, "batch": batch, "handoff": handoff,
            "vocab": engine.vocab_size, "top_p": top_p, "fallback_rate": fallback, **figures}


def run(model_source: str | None = None, dtype: str = "bfloat16", batches=BATCHES,
        instances: int = 2, warmup: int = 8, measure: int = 40, top_p: float = 0.9,
        modes=MODES, random_weights: bool = False) -> dict:
    """Every mode at every B; RuntimeError (the reason) without CUDA.
    random_weights: the model directory's architecture with fresh weights
    (``models.random_model``): the step times of the model, not its tokens."""
    import torch

    device, torch_dtype = resolve("cuda", dtype)
    if random_weights and model_source is None:
        raise ValueError("--random-weights needs --model DIR (its config.json and tokenizer)")
    model, _ = (random_model(model_source, torch_dtype) if random_weights
                else load_model(model_source, torch_dtype))
    model = model.to(device)
    codec = TextCodec.from_source(model_source)
    # the shipped profile, wherever the bench runs from (never a calibration)
    hot = load_profile(project_file(str(DEFAULT_OUTPUT))).hot_vocab()
    if hot.vocab_size != model.config.vocab_size:  # the profile is SmolLM2's
        modes = [m for m in modes if m[3] != "hot-first"]
    results = []
    for mode, decoder_mode, micro_batches, handoff in modes:
        for batch in batches:
            results.append(asyncio.run(run_one(model, codec, mode, decoder_mode, micro_batches,
                                               batch, instances, warmup, measure, top_p,
                                               handoff, hot)))
            gc.collect()
            torch.cuda.empty_cache()  # the next engine's cache gets the freed memory
    inline = {r["batch"]: r["tokens_per_s"] for r in results if r["mode"] == "gpu_inline"}
    for result in results:
        result["vs_gpu_inline"] = (result["tokens_per_s"] / inline[result["batch"]]
                                   if result["batch"] in inline else None)
    return {"results": results,
            "gpu": {"name": torch.cuda.get_device_name(device), "torch": torch.__version__,
                    "cuda": torch.version.cuda, "dtype": dtype},
            "settings": {"model": (model_source or "SmolLM2-135M-Instruct")
                         + (", RANDOM WEIGHTS (its shapes, not its tokens)" if random_weights
                            else ""),
                         "sampler_instances": instances, "hot_set": hot.size,
                         "warmup_tokens": warmup,
                         "measured_tokens": measure,
                         "params": f"temperature 1, top_p {top_p:g}, seeded, ignore_end"}}


def format_report(report: dict) -> str:
    gpu, settings = report["gpu"], report["settings"]
    lines = [f"data plane: TorchEngine on {gpu['name']} ({settings['model']}, {gpu['dtype']}; "
             f"torch {gpu['torch']}, CUDA {gpu['cuda']}); simple: "
             f"{settings['sampler_instances']} kernel threads in-process standing in for "
             f"simple_sampler instances; gpu_inline: torch sampling on the GPU",
             f"requests: {settings['params']}",
             f"{'mode':<17} {'mb':>2} {'B':>4} {'V':>7} {'tok/s':>8} {'x inline':>8} "
             f"{'forward':>8} {'summary':>8} {'exposed':>8} {'ITL p50':>8} {'ITL p95':>8} "
             f"{'fallback':>8}"]
    for r in report["results"]:
        ratio = f"{r['vs_gpu_inline']:.2f}" if r["vs_gpu_inline"] is not None else "-"
        fallback, summary = "-", "-"
        if r["handoff"] == "hot-first":
            fallback = f"{100 * r['fallback_rate']:.1f}%"
            summary = f"{r['summary_ms_per_step']:.2f}ms"
        lines.append(f"{r['mode']:<17} {r['micro_batches']:>2} {r['batch']:>4} {r['vocab']:>7} "
                     f"{r['tokens_per_s']:>8.0f} {ratio:>8} "
                     f"{r['forward_ms_per_step']:>6.2f}ms {summary:>8} "
                     f"{r['exposed_sampling_ms_per_step']:>6.2f}ms {r['itl_ms_p50']:>6.1f}ms "
                     f"{r['itl_ms_p95']:>6.1f}ms {fallback:>8}")
    lines.append("x inline = tokens/s over gpu_inline's at the same B, measured in this run; "
                 "forward = the engine's steps (the forward and the logits' copy to the host; "
                 "for gpu_inline, whose logits stay on the GPU, the launches alone, the GPU's "
                 "time falling in its sampling; for simple_hot_first, whose rows stay on the "
                 "GPU, the launches alone, the GPU's time falling in its summary), summary = "
                 "simple_hot_first's summary behind the forward in the data-plane thread (the "
                 "graphed summary and the compact rows' copy to the host) and exposed = "
                 "sampling while no forward ran, each per full pass over the B sequences; "
                 f"fallback = rows simple_hot_first sent whole (|H| = {settings['hot_set']})")
    return "\n".join(lines)
