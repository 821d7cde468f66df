"""`bench shvs`: speculative hot-vocab sampling against the full path."""
from __future__ import annotations

import argparse

from ..markdown import FigureWriter, Source, number, table
from ..spec import BenchSpec, given

#: --quick: fewer repeats, a smaller profile run.
QUICK = {"repeats": 3, "quick": True}


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", help="hot-vocabulary profile (.npz) to use; default: the "
                        "model repository's, else a calibration run")
    parser.add_argument("--repeats", type=int)


def measure(args: argparse.Namespace) -> dict:
    from . import measuring as shvs

    return shvs.run(profile_path=args.profile,
                    **(QUICK if args.quick else given(args, repeats="repeats")))


def terminal_table(report: dict) -> str:
    from .measuring import format_table

    return format_table(report)


def section(source: Source, writer: FigureWriter) -> list[str]:
    """`bench shvs`: SHVS against the full path (and the hot-first prefix)."""
    report = source.data
    prefix = {(h["rows"], h["config"]): h["prefix_us"] for h in report.get("hot_first", [])}
    profile = report.get("profile", {})
    lines = [f"us per row, one thread, hot set |H| = {profile.get('chosen_size', '?')}.", ""]
    rows, labels, shvs_us, full_us, prefix_us = [], [], [], [], []
    for r in report["results"]:
        us = r["us_per_row"]
        hot_first = prefix.get((r["rows"], r["config"]))
        rows.append([r["rows"], r["vocab"], r["config"], number(r["acceptance"], 3),
                     number(us["shvs"]), number(us["full"]),
                     number(us["full"] / us["shvs"], 2, "x"), number(hot_first)])
        labels.append(f"{r['rows']}\n{r['config']}")
        shvs_us.append(us["shvs"])
        full_us.append(us["full"])
        prefix_us.append(hot_first or 0.0)
    lines += table(["rows", "vocab", "config", "acceptance", "shvs us", "full us", "full/shvs",
                    "hot-first prefix us"], rows)
    figure, axes = writer.new()
    width = 0.27
    for offset, values, label in ((-width, full_us, "full path"), (0, shvs_us, "SHVS"),
                                  (width, prefix_us, "hot-first prefix")):
        axes.bar([i + offset for i in range(len(labels))], values, width, label=label)
    axes.set_xticks(range(len(labels)), labels)
    axes.set_ylabel("us per row")
    axes.legend()
    return lines + writer.save(figure, "shvs", "SHVS against the full path", source)


SPEC = BenchSpec(
    name="shvs", help="speculative hot-vocab sampling against the full path",
    heading="SHVS against the full path", arguments=arguments, measure=measure,
    table=terminal_table, section=section, quick="fewer repeats, a smaller profile run")
