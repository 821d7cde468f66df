"""`bench guided`: what structured outputs add to a decode step, beside the step's sampling."""
from __future__ import annotations

import argparse

from ..markdown import FigureWriter, Source, number, table
from ..spec import BenchSpec, given, positive_int

#: --quick: two batch sizes, fewer steps and compiles.
QUICK = {"batches": (8, 64), "steps": 12, "repeats": 2, "loop_batches": (16,)}


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", type=positive_int, nargs="+",
                        help="B, every row held to the guide (default 8 64 256)")
    parser.add_argument("--steps", type=positive_int, help="decode steps a cell (default 48)")
    parser.add_argument("--repeats", type=positive_int, help="fresh compiles a guide (default 5)")
    parser.add_argument("--loop-batches", type=positive_int, nargs="*",
                        help="B of the decode-loop runs on the simulated engine (default 64 256; "
                             "none: left out)")


def measure(args: argparse.Namespace) -> dict:
    from . import measuring

    # --quick's sizes, then the options given over them
    return measuring.run(**{**(QUICK if args.quick else {}),
                            **given(args, batches="batches", steps="steps", repeats="repeats",
                                    loop_batches="loop_batches")})


def terminal_table(report: dict) -> str:
    from .measuring import format_table

    return format_table(report)


def section(source: Source, writer: FigureWriter) -> list[str]:
    """Each guide's compile; per guide and B the guided step's columns in
    ms a step beside the same rows' plain sampling; the decode loop guided
    and not."""
    report = source.data
    compiled = report["compiling"]
    lines = [f"Compiling, fresh (ms) and a request's copy of a cached guide (us); llguidance's "
             f"tokenizer {number(compiled['tokenizer_ms'])} ms, once.", ""]
    lines += table(["guide", "compile ms", "copy us"],
                   [[kind, number(c["compile_ms"], 2), number(c["matcher_us"])]
                    for kind, c in compiled["guides"].items()])
    lines += [f"ms a step over {report['steps']} steps, V = {report['vocab']:,}, "
              f"{report['mask_threads']} mask threads, the sampler on "
              f"{report['sampler_threads']} thread; {report['rows']}; {report['note']}. "
              f"overhead = (fill + apply + consume) / plain.", ""]
    lines += table(
        ["guide", "B", "fill", "fill CPU", "apply", "consume", "sample (masked)", "plain",
         "overhead", "restarts"],
        [[r["guide"], r["batch"], *(number(r["ms_per_step"][k], 3) for k in
                                    ("fill", "fill_cpu", "apply", "consume", "sample", "plain")),
          number(r["overhead"], 2, "x"), r["restarts"]] for r in report["results"]])
    if not report["loops"]:
        return lines
    lines += [f"The decode loop, requests held to the JSON schema against as many unguided ones "
              f"as long: {report['loops'][0]['guided']['label']}.", ""]
    return lines + table(
        ["B", "requests", "guided tok/s", "guided ms/step", "plain tok/s", "plain ms/step",
         "guided / plain"],
        [[loop["batch"], loop["requests"], number(loop["guided"]["tokens_per_s"]),
          number(loop["guided"]["ms_per_step"], 2), number(loop["plain"]["tokens_per_s"]),
          number(loop["plain"]["ms_per_step"], 2), number(loop["ratio"], 3)]
         for loop in report["loops"]])


SPEC = BenchSpec(
    name="guided", help="structured outputs' cost a decode step (grammar masks) beside sampling",
    heading="Structured outputs: the grammar masks' cost a step", arguments=arguments,
    measure=measure, table=terminal_table, section=section,
    quick="B 8 and 64, 12 steps, 2 compiles a guide, the decode loop at B 16")
