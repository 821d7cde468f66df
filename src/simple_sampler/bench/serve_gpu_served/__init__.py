"""`bench serve-gpu-served`: real servers on the static engine, driven over gRPC."""
from __future__ import annotations

import argparse
from pathlib import Path

from ...settings import DECODE_STEPS, LAUNCH_AHEAD, TORCH_DTYPES, LlmSettings
from ..markdown import FigureWriter, Source
from ..spec import BenchSpec, given, positive_int

#: --quick: one small cell (for tests).
QUICK = {"batches": [4], "top_ps": [0.95], "max_tokens": 16}


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-config",
                        help="a shipped shape or a config.json: RANDOM WEIGHTS")
    parser.add_argument("--model", help="a checkpoint directory instead (its weights)")
    parser.add_argument("--device", choices=["cuda", "cpu"],
                        help="cpu: the tests' runs, figures that mean nothing")
    parser.add_argument("--dtype", choices=tuple(TORCH_DTYPES),
                        help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--batch", type=positive_int, nargs="+")
    parser.add_argument("--top-p", type=float, nargs="+")
    parser.add_argument("--modes", nargs="+",
                        choices=["simple", "simple_hot_first", "inline", "simple_overlap"],
                        help="one server each (default the first three; simple_overlap: "
                             "simple on two lanes, each its own window of the slots)")
    parser.add_argument("--max-tokens", type=positive_int)
    parser.add_argument("--instances", type=positive_int, help="simple_sampler instances")
    parser.add_argument("--micro-batches", type=positive_int)
    parser.add_argument("--stream-interval", type=positive_int,
                        help="tokens per response (more: less client and server work)")
    parser.add_argument("--decode-step", choices=DECODE_STEPS,
                        help="the static engine's decode step in the servers and in the "
                             "forward_only bound (default eager; compiled: serve "
                             "--compile-decode)")
    parser.add_argument("--launch-ahead", choices=LAUNCH_AHEAD,
                        help="the llm model's launch_ahead (default auto: on, on a GPU)")
    parser.add_argument("--send-threads", type=positive_int,
                        help="the llm model's send_threads in every server (default its "
                             f"own, {LlmSettings.send_threads})")
    parser.add_argument("--log-dir", help="where the servers' logs go (default: a "
                                          "temporary folder, named in the report)")
    parser.add_argument("--markdown", metavar="FILE", help="also write the Markdown here")
    parser.add_argument("--stacks", action="store_true",
                        help="each llm stub samples its threads' Python stacks (wall time, "
                             "simple_sampler.stacks) into LOG_DIR/stacks/MODE/")


def measure(args: argparse.Namespace) -> dict:
    from . import measuring as served

    sizes = {**QUICK} if args.quick else given(args, batches="batch", top_ps="top_p",
                                              max_tokens="max_tokens")
    if args.modes:
        sizes["modes"] = [mode for mode in served.MODES if mode.name in args.modes]
    report = served.run(model=args.model, dtype=args.dtype, log_dir=args.log_dir,
                        stacks=args.stacks, **sizes,
                        **given(args, device="device", model_config="model_config",
                                instances="instances", micro_batches="micro_batches",
                                stream_interval="stream_interval",
                                launch_ahead="launch_ahead", decode_step="decode_step",
                                send_threads="send_threads"))
    if args.markdown:
        Path(args.markdown).write_text(served.format_report(report) + "\n")
    return report


def terminal_table(report: dict) -> str:
    from .measuring import format_report

    return format_report(report)


def section(source: Source, writer: FigureWriter) -> list[str]:
    """The bench's own Markdown, under the report's heading instead of its own."""
    return terminal_table(source.data).splitlines()[2:] + [""]


SPEC = BenchSpec(
    name="serve-gpu-served", help="real servers on the static engine (--device cuda), driven "
    "over gRPC: simple, simple hot-first and inline against the forward-only bound",
    heading="Served on a GPU: real servers on the static engine",
    arguments=arguments, measure=measure, table=terminal_table, section=section,
    quick="B 4, top_p 0.95, 16 tokens (for tests)",
    errors=(RuntimeError, ValueError, FileNotFoundError))  # no CUDA, a bad shape
