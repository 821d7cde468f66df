"""`bench engine-step`: a data-plane engine's host time per decode step beyond its forward."""
from __future__ import annotations

import argparse

from ...settings import TORCH_DTYPES
from ..markdown import FigureWriter, Source, number, table
from ..spec import BenchSpec, given

#: --quick: a short window
QUICK = {"steps": 5, "rounds": 1}


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, nargs="+")
    parser.add_argument("--model-config",
                        help="the shipped shape (or config.json) whose family and vocabulary "
                             "the cut-down model keeps (default llama-3.2-1b)")
    parser.add_argument("--layers", type=int, help="the cut-down model's layers (default 1)")
    parser.add_argument("--hidden", type=int, help="its hidden width (default 64)")
    parser.add_argument("--vocab", type=int,
                        help="its vocabulary (default the shape's; on a CPU a small one keeps "
                             "the forward small beside the host work)")
    parser.add_argument("--steps", type=int, help="steps per round")
    parser.add_argument("--rounds", type=int, help="alternated rounds (medians reported)")
    parser.add_argument("--device", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", choices=tuple(TORCH_DTYPES))


def measure(args: argparse.Namespace) -> dict:
    from . import measuring as engine_step

    sizes = QUICK if args.quick else given(args, steps="steps", rounds="rounds")
    return engine_step.run(**sizes, **given(args, batches="batch", model_config="model_config",
                                            layers="layers", hidden="hidden", vocab="vocab",
                                            device="device",
                                            dtype="dtype"))


def terminal_table(report: dict) -> str:
    from .measuring import format_table

    return format_table(report)


def section(source: Source, writer: FigureWriter) -> list[str]:
    """Per B: the replay alone, a whole step, and their difference."""
    report = source.data
    lines = [f"Static engine on {report['device']}, {report['model_config']} CUT DOWN to "
             f"{report['layers']} layer(s) of width {report['hidden']} (V = "
             f"{report['vocab']:,}, random weights, {report['dtype']}); medians of "
             f"{report['rounds']} alternated rounds of {report['steps']} steps. host = step - "
             "replay: the engine's own work per decode step beyond its forward. step cpu: the "
             "stepping thread's CPU per step (waiting for the device asleep, it is about "
             "host; spinning, it would be step).", ""]
    return lines + table(
        ["B", "replay ms", "step ms", "host ms", "step cpu ms"],
        [[r["batch"], number(r["replay_ms"], 3), number(r["step_ms"], 3),
          number(r["host_ms"], 3), number(r.get("step_cpu_ms"), 3)] for r in report["rows"]])


SPEC = BenchSpec(
    name="engine-step", help="the static engine's host time per decode step beyond its "
                             "forward (replay alone against step + append), on a cut-down "
                             "shape",
    heading="Data-plane engine: host time per decode step", arguments=arguments,
    measure=measure, table=terminal_table, section=section, quick="5 steps, one round",
    errors=(RuntimeError, ValueError, FileNotFoundError))
