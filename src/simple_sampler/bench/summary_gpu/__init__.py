"""`bench summary-gpu`: the hot-first summary on the logits' device against
the full rows' copy to the host."""
from __future__ import annotations

import argparse

from ..markdown import FigureWriter, Source, number, table
from ..spec import BenchSpec, given, positive_int

#: --quick: one shape, one B, two configs, three rounds.
QUICK = {"shapes": ((49_152, "float32"),), "batches": (8,), "configs": ("plain", "top_p"),
         "repeats": 3}


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=["cuda", "cpu"],
                        help="where the rows lie (cpu: this CPU, for a check only)")
    parser.add_argument("--batch", type=positive_int, nargs="+")
    parser.add_argument("--repeats", type=positive_int)
    parser.add_argument("--profile", help="hot-vocabulary profile (.npz); default as bench shvs")


def measure(args: argparse.Namespace) -> dict:
    from . import measuring as summary_gpu

    sizes = QUICK if args.quick else given(args, batches="batch", repeats="repeats")
    return summary_gpu.run(profile_path=args.profile, **given(args, device_name="device"),
                           **sizes)


def terminal_table(report: dict) -> str:
    from .measuring import format_report

    return format_report(report)


def section(source: Source, writer: FigureWriter) -> list[str]:
    """Per shape, B and config: ms per step of the summary (eager, graphed,
    on the device alone) against the full rows' copy and the simulated
    engine's charge; bytes per row each way."""
    report = source.data
    lines = [f"On {report['device']} (torch {report['torch']}, CUDA {report['cuda']}), "
             f"|H| = {report['hot_size']}, cold_top = {report['cold_top']}; ms per step, wall, "
             f"median of {report['repeats']} interleaved rounds; modelled: the simulated "
             "engine's charge; vs cpu: rows whose compact row differs from CPU torch's.", ""]
    return lines + table(
        ["vocab", "dtype", "B", "config", "summary ms", "graphed ms", "device ms",
         "full copy ms", "modelled ms", "x model", "bytes full", "bytes compact", "vs cpu",
         "rows"],
        [[f"{r['vocab']:,}", r["dtype"], r["batch"], r["config"],
          number(r["ms_per_step"]["summary"], 3), number(r["ms_per_step"]["graphed"], 3),
          number(r["ms_per_step"]["device"], 3), number(r["ms_per_step"]["full_copy"], 3),
          number(r["modelled_ms"], 3), number(r["summary_vs_modelled"], 1, "x"),
          number(r["bytes_per_row"]["full"], 0), number(r["bytes_per_row"]["compact"], 0),
          r["against_cpu"]["rows_differing"], r["rows"]] for r in report["results"]])


SPEC = BenchSpec(
    name="summary-gpu", help="the hot-first summary on the logits' device against the full "
                             "rows' copy to the host and the simulated engine's charge for it",
    heading="Hot-first summary on the device against the full rows' copy",
    arguments=arguments, measure=measure, table=terminal_table, section=section,
    quick="V 49,152 float32, B 8, two configs, 3 rounds", errors=(RuntimeError, ValueError))
