"""`bench handoff`: hot-first compact rows against full rows."""
from __future__ import annotations

import argparse

from ..markdown import FigureWriter, Source, number, table
from ..spec import BenchSpec, given

#: --quick: fewer repeats.
QUICK = {"repeats": 3}


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", help="hot-vocabulary profile (.npz); default as bench shvs")
    parser.add_argument("--hot-size", type=int, help="|H| (default: the profile's chosen size)")
    parser.add_argument("--cold-top", type=int,
                        help="each row's largest cold logits handed over with the touched ids "
                             "(default: handoff.DEFAULT_COLD_TOP)")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--clock", choices=["wall", "cpu"], help="as bench kernels' --clock")


def measure(args: argparse.Namespace) -> dict:
    from . import measuring as handoff

    return handoff.run(profile_path=args.profile,
                       **(QUICK if args.quick else given(args, repeats="repeats")),
                       **given(args, hot_size="hot_size", cold_top="cold_top", clock="clock"))


def terminal_table(report: dict) -> str:
    from .measuring import format_table

    return format_table(report)


def section(source: Source, writer: FigureWriter) -> list[str]:
    """Per vocabulary, dtype and config: bytes per row and us per row, full
    rows against hot-first's compact ones, and the fallback rate."""
    report = source.data
    lines = [f"us per row ({report['clock']} clock), one thread, |H| = {report['hot_size']}, "
             f"cold_top = {report['cold_top']}; {report['note']}", ""]
    return lines + table(
        ["vocab", "dtype", "config", "bytes full", "bytes hot-first", "share", "full us",
         "hot-first us", "summary us", "fallback", "rows"],
        [[f"{r['vocab']:,}", r["dtype"], r["config"], number(r["bytes_per_row"]["full"], 0),
          number(r["bytes_per_row"]["hot_first"], 0),
          f"{r['bytes_per_row']['hot_first'] / r['bytes_per_row']['full']:.1%}",
          number(r["us_per_row"]["full"]), number(r["us_per_row"]["hot_first"]),
          number(r["us_per_row"]["summary"]), f"{r['fallback_rate']:.2%}", r["rows"]]
         for r in report["results"]])


SPEC = BenchSpec(
    name="handoff", help="hot-first compact rows against full rows",
    heading="Hot-first compact rows against full rows", arguments=arguments, measure=measure,
    table=terminal_table, section=section, quick="fewer repeats")
