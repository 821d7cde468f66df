"""`bench serve`: tokens/s, TTFT, ITL and sampling share through the whole
server per mode.

example.json: a published run (docs/BENCHMARKS.md) trimmed to two modes and
concurrency 1 and 32."""
from __future__ import annotations

import argparse

from ...settings import SERVED_MODES
from ..markdown import FigureWriter, Source, number, per_mode_plot, simple_vs_inline, table
from ..spec import BenchSpec, given, positive_int


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", type=int, nargs="+")
    parser.add_argument("--modes", nargs="+", choices=SERVED_MODES)
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--instances", type=int)
    parser.add_argument("--batch-invariant", nargs="+", choices=["on", "off"],
                        help="engine batch-invariant mode per server ('on off': its cost)")
    parser.add_argument("--stream-interval", type=positive_int,
                        help="each request's stream_interval (default: the server's, 1); the "
                             "time to first token is the first chunk's, ITL the gaps between chunks")


def measure(args: argparse.Namespace) -> dict:
    from . import measuring as serve

    invariant = {} if args.batch_invariant is None else {
        "batch_invariant": [value == "on" for value in args.batch_invariant]}
    return serve.run(**invariant, **given(args, concurrencies="concurrency", modes="modes",
                                          max_tokens="max_tokens", instances="instances",
                                          stream_interval="stream_interval"))


def terminal_table(report: dict) -> str:
    from .measuring import format_report

    return format_report(report)


def section(source: Source, writer: FigureWriter) -> list[str]:
    """`bench serve`: per mode and concurrency, tokens/s, latencies, sampling share."""
    results = source.data["results"]
    lines = table(["mode", "concurrency", "tok/s", "TTFT P50 ms", "ITL P50 ms", "ITL P95 ms",
                   "sampling share"],
                  [[r["mode"], r["concurrency"], number(r["tokens_per_s"]),
                    number(r["ttft_ms_p50"], 0), number(r["itl_ms_p50"], 0),
                    number(r["itl_ms_p95"], 0), number(r["sampling_share"], 3)]
                   for r in results])
    lines += simple_vs_inline(results, "tokens_per_s", "itl_ms_p95")
    lines += per_mode_plot(writer, source, results, "tokens_per_s", "output tokens per second",
                           "serve-throughput", "Output tokens/s against concurrency (bench serve)")
    lines += per_mode_plot(writer, source, results, "itl_ms_p95", "P95 inter-token latency (ms)",
                           "serve-itl-p95", "P95 inter-token latency against concurrency "
                           "(bench serve)")
    figure, axes = writer.new()
    modes = list(dict.fromkeys(r["mode"] for r in results))
    concurrencies = sorted({r["concurrency"] for r in results})
    share = {(r["mode"], r["concurrency"]): r["sampling_share"] for r in results}
    width = 0.8 / len(modes)
    for index, mode in enumerate(modes):
        axes.bar([c + (index - (len(modes) - 1) / 2) * width for c in range(len(concurrencies))],
                 [share.get((mode, c), 0.0) for c in concurrencies], width, label=mode)
    axes.set_xticks(range(len(concurrencies)), [f"concurrency {c}" for c in concurrencies])
    axes.set_ylabel("sampling share of step time")
    axes.legend()
    return lines + writer.save(figure, "serve-sampling-share",
                               "Sampling share of step time per mode and concurrency", source)


SPEC = BenchSpec(
    name="serve", help="tokens/s, TTFT, ITL and sampling share through the whole server per "
                       "mode", heading="Whole server per sampling mode", arguments=arguments,
    measure=measure, table=terminal_table, section=section)
