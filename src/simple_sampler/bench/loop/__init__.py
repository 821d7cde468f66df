"""`bench loop`: the decode loop's own CPU time per step and its batch building."""
from __future__ import annotations

import argparse

from ..markdown import FigureWriter, Source, number, table
from ..spec import BenchSpec, given


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int)
    parser.add_argument("--history", type=int, help="prompt tokens per row")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--rounds", type=int,
                        help="alternated runs per decoder (the median is reported)")


def measure(args: argparse.Namespace) -> dict:
    from . import measuring as loop

    return loop.run(**given(args, batch="batch", history="history", steps="steps",
                            rounds="rounds"))


def terminal_table(report: dict) -> str:
    from .measuring import format_table

    return format_table(report)


def section(source: Source, writer: FigureWriter) -> list[str]:
    """Per penalty setting: the loop's ms per step with BatchState against a
    rebuild per step, and one step's batch built each way."""
    report = source.data
    lines = [f"SIMULATED instant engine and sampler: B = {report['batch']}, "
             f"{report['history']}-token histories, {report['steps']} steps, one lane; loop: "
             f"median of {report['rounds']} alternated runs.", ""]
    return lines + table(
        ["penalties", "loop BatchState ms", "loop rebuild ms", "ratio", "batch BatchState ms",
         "batch from_params ms", "ratio"],
        [[r["penalties"], number(r["loop_ms_batch_state"], 3), number(r["loop_ms_rebuild"], 3),
          number(r["loop_ms_rebuild"] / r["loop_ms_batch_state"], 1, "x"),
          number(r["batch_state_ms"], 3), number(r["from_params_ms"], 3),
          number(r["from_params_ms"] / r["batch_state_ms"], 1, "x")] for r in report["rows"]]) + [
        "", "A served step's sampler request (`batch_arrays`, packed), timed in-process with the "
        "histories in it (value) and named in a row arena (ref, `history_ref`): the llm's side "
        "(its batch and the request's tensors), the tensors' size, and the sampler's side "
        "(`decode_request`).", ""] + table(
        ["penalties", "llm ms, value", "llm ms, ref", "KiB, value", "KiB, ref",
         "sampler ms, value", "sampler ms, ref"],
        [[r["penalties"], number(r["request_value_ms"], 3), number(r["request_ref_ms"], 3),
          number(r["request_bytes_value"] / 1024, 1), number(r["request_bytes_ref"] / 1024, 1),
          number(r["decode_value_ms"], 3), number(r["decode_ref_ms"], 3)]
         for r in report["rows"] if "request_ref_ms" in r])


SPEC = BenchSpec(
    name="loop", help="the decode loop's own CPU time per step (simulated instant engine and "
                      "sampler) and its batch building against a rebuild per step",
    heading="Decode loop CPU per step (simulated instant engine)", arguments=arguments,
    measure=measure, table=terminal_table, section=section)
