"""`bench row-transport`: sampler instances' CPU per token by row transport
through a real server on a SIMULATED data plane."""
from __future__ import annotations

import argparse

from ..markdown import FigureWriter, Source, number, table
from ..spec import BenchSpec, given, positive_int, vocab_shape

QUICK = {"shapes": [(128_256, "float32")], "batches": [8], "max_tokens": 64}


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, nargs="+")
    parser.add_argument("--max-tokens", type=positive_int,
                        help="tokens per stream")
    parser.add_argument("--transport", nargs="+", choices=["bls", "arena", "hot-first"])
    parser.add_argument("--shape", nargs="+", type=vocab_shape, metavar="V:DTYPE",
                        help="vocabulary sizes and logits dtypes (float32, bfloat16); "
                             "default: V=151,936 bfloat16, 128,256 float32, 49,152 bfloat16")
    parser.add_argument("--profile", metavar="DIR",
                        help="write each configuration's sampler stub profiles "
                             "(execute, thread CPU) under DIR (docs/COPIES.md)")


def measure(args: argparse.Namespace) -> dict:
    from . import measuring as row_transport

    sizes = QUICK if args.quick else given(args, batches="batch", shapes="shape",
                                           max_tokens="max_tokens")
    return row_transport.run(profile_dir=args.profile, **sizes,
                             **given(args, transports="transport"))


def terminal_table(report: dict) -> str:
    from .measuring import format_report

    return format_report(report)


def section(source: Source, writer: FigureWriter) -> list[str]:
    """`bench row-transport`: per (V, dtype, B) and transport, the sampler
    stubs' CPU per token beside the kernels' us/row of the same run, the
    other processes, bytes and the hot-first fallback rate; bars of the
    stubs' CPU per configuration, one per transport, the kernel marked."""
    report = source.data
    results = report["results"]
    lines = [f"Data plane: **{report['data_plane']}**. Requests: {report['settings']['params']}. "
             "CPU: microseconds per token received (each process's CPU clock); kernel / "
             "compact kernel: us/row of the kernels on the same rows in the same run; codec / "
             "compact codec: what the stub's own Python adds per row (in process); vs kernel = "
             "sampler stubs / kernel; fallback: hot-first rows sent again whole.", ""]
    lines += table(["transport", "V", "dtype", "B", "sampler stubs", "llm stub", "tritonserver",
                    "kernel", "compact kernel", "codec", "compact codec", "vs kernel",
                    "fallback", "bytes/row", "share of a row", "tok/s"],
                   [[r["transport"], f"{r['vocab']:,}", r["dtype"], r["batch"],
                     number(r["samplers_us_per_token"]), number(r["llm_us_per_token"]),
                     number(r["tritonserver_us_per_token"]), number(r["kernel_us_per_row"]),
                     number(r["compact_kernel_us_per_row"]), number(r["codec_us_per_row"]),
                     number(r.get("compact_codec_us_per_row")), number(r["vs_kernel"], 2, "x"),
                     "-" if r.get("fallback_rate") is None else f"{r['fallback_rate']:.2%}",
                     number(r["bytes_per_row"], 0), f"{r['bytes_share']:.1%}",
                     number(r["tokens_per_s"], 0)] for r in results])
    configurations = list(dict.fromkeys((r["vocab"], r["dtype"], r["batch"]) for r in results))
    transports = list(dict.fromkeys(r["transport"] for r in results))
    by_key = {(r["vocab"], r["dtype"], r["batch"], r["transport"]): r for r in results}
    figure, axes = writer.new(width=max(7.0, 1.2 * len(configurations) + 2))
    width = 0.8 / len(transports)
    for i, transport in enumerate(transports):
        found = [(j, by_key[(*c, transport)]) for j, c in enumerate(configurations)
                 if (*c, transport) in by_key]
        axes.bar([j + (i - (len(transports) - 1) / 2) * width for j, _ in found],
                 [r["samplers_us_per_token"] for _, r in found], width, label=transport)
    kernels = {c: r["kernel_us_per_row"] for r in results
               for c in [(r["vocab"], r["dtype"], r["batch"])]}
    axes.scatter(range(len(configurations)), [kernels[c] for c in configurations], marker="_",
                 s=900, color="black", zorder=3, label="kernel us/row (full rows)")
    axes.set_xticks(range(len(configurations)),
                    [f"V={v:,} {d}\nB={b}" for v, d, b in configurations], fontsize=7)
    axes.set_ylabel("sampler stubs' CPU per token received (us)")
    axes.grid(axis="y", alpha=0.3)
    axes.legend(fontsize=7)
    title = "Sampler stubs' CPU per token by row transport (SIMULATED data plane)"
    return lines + writer.save(figure, "row-transport-cpu-per-token", title, source)


SPEC = BenchSpec(
    name="row-transport", help="sampler instances' CPU per token by row transport (BLS, "
    "shared-memory arena, hot-first) through a real server on a SIMULATED data plane",
    heading="Sampler stubs' CPU per token by row transport (simulated data plane)",
    arguments=arguments, measure=measure, table=terminal_table, section=section,
    quick="one small configuration (V=128,256 float32, B=8, 64 tokens each)")
