"""`bench sampler-server`: rows/s through a real Triton server for 1..N
sampler instances, or 1..N sampler-only servers.

example.json: a published run (docs/BENCHMARKS.md), its sampler-server counters
that the table does not print filled in."""
from __future__ import annotations

import argparse

from ..markdown import FigureWriter, Source, number, table
from ..spec import BenchSpec, given


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--instances", type=int, help="largest instance count")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--seconds", type=float, help="per measurement")
    parser.add_argument("--endpoints", type=int, default=0, metavar="N",
                        help="instead: 1..N sampler-only servers (1 instance each) driven "
                             "by the decode loop's sampler pool over gRPC")


def measure(args: argparse.Namespace) -> dict:
    from . import measuring as sampler_server

    sizes = given(args, batch_size="batch", vocab="vocab", seconds="seconds")
    if args.endpoints:
        return sampler_server.run_endpoints(max_endpoints=args.endpoints, **sizes)
    return sampler_server.run(**given(args, max_instances="instances"), **sizes)


def endpoints(report: dict) -> bool:
    """Whether `report` is run_endpoints' (sampler-only servers)."""
    return "in_process_rows_per_s" not in report


def terminal_table(report: dict) -> str:
    from .measuring import format_endpoints_report, format_report

    return (format_endpoints_report if endpoints(report) else format_report)(report)


def endpoints_section(source: Source, writer: FigureWriter) -> list[str]:
    """--endpoints: rows/s against sampler-only servers, and the bytes per step."""
    results = source.data["results"]
    first = results[0]["rows_per_s"]
    return table(["endpoints", "rows/s", "vs 1 endpoint", "MB per step"],
                 [[r["endpoints"], number(r["rows_per_s"], 0),
                   number(r["rows_per_s"] / first, 2, "x"), number(r["bytes_per_step"] / 1e6)]
                  for r in results])


def section(source: Source, writer: FigureWriter) -> list[str]:
    """`bench sampler-server`: rows/s against instances and in-process; the
    per-request breakdown."""
    report = source.data
    if endpoints(report):
        return endpoints_section(source, writer)
    ceiling = report["in_process_rows_per_s"]
    first = report["results"][0]["rows_per_s"]
    rows = [[r["instances"], number(r["rows_per_s"], 0), number(r["rows_per_s"] / first, 2, "x"),
             number(r["rows_per_s"] / ceiling, 2, "x")] for r in report["results"]]
    rows.append(["in-process, 1 thread", number(ceiling, 0), "", "1.00x"])
    lines = table(["instances", "rows/s", "vs 1 instance", "vs in-process"], rows)
    overhead = report.get("overhead_us_per_request") or {}
    if overhead:
        lines += ["Per request at 1 instance, one in flight (us):", ""]
        lines += table(["counter", "us"], [[k, number(v)] for k, v in overhead.items()])
    figure, axes = writer.new()
    instances = [r["instances"] for r in report["results"]]
    axes.plot(instances, [r["rows_per_s"] for r in report["results"]], "o-", label="server")
    axes.axhline(ceiling, color="black", ls="--", label="in-process, 1 thread")
    axes.set_xticks(instances)
    axes.set_xlabel("sampler instances")
    axes.set_ylabel("rows per second")
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    axes.legend()
    return lines + writer.save(figure, "sampler-server",
                               "Sampler server rows/s against instances", source)


SPEC = BenchSpec(
    name="sampler-server",
    help="rows/s through a real Triton server for 1..N sampler instances",
    heading="Sampler server: rows/s against instances", arguments=arguments, measure=measure,
    table=terminal_table, section=section)
