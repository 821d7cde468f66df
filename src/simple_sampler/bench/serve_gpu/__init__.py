"""`bench serve-gpu`: the decode loop over a real model on a CUDA GPU."""
from __future__ import annotations

import argparse

from ...settings import DECODE_STEPS, LAUNCH_AHEAD, TORCH_DTYPES
from ..markdown import FigureWriter, Source, number, table
from ..spec import BenchSpec, given

#: --quick: B 8 and 16, a short window.
QUICK = {"batches": [8, 16], "warmup": 2, "measure": 6}


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, nargs="+")
    parser.add_argument("--model", help="Hugging Face directory (default SmolLM2-135M)")
    parser.add_argument("--dtype", choices=tuple(TORCH_DTYPES))
    parser.add_argument("--instances", type=int,
                        help="kernel threads standing in for simple_sampler instances")
    parser.add_argument("--top-p", type=float, nargs="+",
                        help="every request's top_p, one run per value")
    parser.add_argument("--model-config",
                        help="a shipped shape (smollm2-135m, qwen2.5-0.5b, llama-3.2-1b, "
                             "llama-3.1-8b) or a config.json: random weights on the device")
    parser.add_argument("--engine", choices=["static", "eager"],
                        help="static: static KV cache, CUDA graphs per batch bucket (and "
                             "forward_only, the bound); eager: the Hugging Face forward")
    parser.add_argument("--decode-step", nargs="+", choices=DECODE_STEPS,
                        help="static engine: every mode (forward_only too) once per step "
                             "listed; compiled: torch.compile over fused weights, its rows "
                             "suffixed _compiled, its compile time in forward_only's setup")
    parser.add_argument("--rows", nargs="+", choices=["flat", "fitted"],
                        help="the forward's own rows, or rows fitted to SmolLM2's substituted "
                             "after it")
    parser.add_argument("--launch-ahead", choices=LAUNCH_AHEAD,
                        help="the decode loop's launch_ahead in every mode (default auto: "
                             "on, on a GPU); off: each step after the step before has made "
                             "its events")
    parser.add_argument("--random-weights", action="store_true",
                        help="--model's architecture and tokenizer with fresh weights (its "
                             "config.json and tokenizer files suffice): its step times, "
                             "not its tokens")


def measure(args: argparse.Namespace) -> dict:
    from . import measuring as serve_gpu

    sizes = QUICK if args.quick else given(args, batches="batch")
    return serve_gpu.run(args.model, random_weights=args.random_weights,
                         model_config=args.model_config, **sizes,
                         **given(args, dtype="dtype", instances="instances", top_p="top_p",
                                 engine="engine", rows="rows", decode_steps="decode_step",
                                 launch_ahead="launch_ahead"))


def terminal_table(report: dict) -> str:
    from .measuring import format_report

    return format_report(report)


def ratio(value: float | None) -> str:
    return number(value, 2, "x")


def section(source: Source, writer: FigureWriter) -> list[str]:
    """Per mode, rows, top_p and B: tokens/s against gpu_inline's and the
    forward-only bound, the forward's and exposed sampling's ms per step."""
    report = source.data
    gpu, settings = report["gpu"], report["settings"]
    lines = [f"Data plane: {settings.get('engine', 'eager')} engine on {gpu['name']} "
             f"({settings['model']}, {gpu['dtype']}; torch {gpu['torch']}, CUDA {gpu['cuda']}); "
             f"simple: {settings['sampler_instances']} kernel threads in-process; x inline / x "
             "bound: tokens/s over gpu_inline's at the same decode step, rows, top_p and B / "
             "over forward_only's at the same step and B (_compiled: the compiled decode "
             "step); setup s: forward_only's first replay (capture; _compiled: torch.compile "
             "too).", ""]
    lines += [f"{step} decode step FAILED, its rows left out: {error}"
              for step, error in report.get("errors", {}).items()]
    return lines + table(
        ["mode", "rows", "top_p", "micro-batches", "B", "V", "tok/s", "x inline", "x bound",
         "forward ms/step", "exposed sampling ms/step", "ITL P50 ms", "ITL P95 ms", "setup s"],
        [[r["mode"], r.get("rows", "-"), number(r.get("top_p"), 2), r["micro_batches"],
          r["batch"], f"{r['vocab']:,}", number(r["tokens_per_s"], 0),
          ratio(r.get("vs_gpu_inline")), ratio(r.get("vs_forward_only")),
          number(r["forward_ms_per_step"], 2), number(r["exposed_sampling_ms_per_step"], 2),
          number(r["itl_ms_p50"]), number(r["itl_ms_p95"]), number(r.get("setup_s"), 1)]
         for r in report["results"]])


SPEC = BenchSpec(
    name="serve-gpu", help="the decode loop over a real model on a CUDA GPU: simple vs "
                           "sampling on the GPU (the static CUDA-graph engine by default; needs CUDA)",
    heading="Decode loop over a real model on a GPU", arguments=arguments, measure=measure,
    table=terminal_table, section=section, quick="B 8 and 16, a short window",
    # no CUDA, a dtype it lacks, --random-weights without --model or a
    # directory without config.json
    errors=(RuntimeError, ValueError, FileNotFoundError))
