"""`bench serve-sim`: decode loop efficiency at GPU pace on a SIMULATED data
plane (docs/SIMULATED.md), in process or through a real server."""
from __future__ import annotations

import argparse

from ...settings import HANDOFFS, LAUNCH_AHEAD, ROW_TRANSPORTS
from ..markdown import FigureWriter, Source, number, table
from ..spec import BenchSpec, UsageError, given, simulated_rows

#: --quick: B 8 and 16 and a short window; through a server, 16 tokens a stream.
QUICK = {"batches": [8, 16], "warmup": 2, "measure": 6}
QUICK_SERVER = {"batches": [8, 16], "max_tokens": 16}


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, nargs="+")
    simulated_rows(parser)
    parser.add_argument("--step-ms", type=float,
                        help="simulated time of a forward over the whole batch")
    parser.add_argument("--server", action="store_true",
                        help="through a real Triton server (serve --engine simulated) with "
                             "streaming gRPC clients, instead of in-process")
    parser.add_argument("--instances", type=int,
                        help="kernel threads standing in for simple_sampler instances")
    parser.add_argument("--shvs", action="store_true",
                        help="the kernels use the calibrated hot set mapped into V "
                             "(speculative hot-vocab sampling; in-process only)")
    parser.add_argument("--profile", help="hot-vocabulary profile (.npz) for --shvs; default "
                        "as bench shvs")
    parser.add_argument("--top-p", type=float, help="every request's top_p (default 1: no "
                        "truncation; in-process only)")
    parser.add_argument("--handoff", choices=HANDOFFS,
                        help="how simple mode's rows cross: full, or hot-first (the engine's "
                             "summary as part of its modelled step)")
    parser.add_argument("--launch-ahead", nargs="+", choices=LAUNCH_AHEAD,
                        help="the decoder's launch_ahead, each value a set of rows side by side "
                             "(default auto: on, the engine is simulated; in-process only)")
    parser.add_argument("--row-transport", choices=ROW_TRANSPORTS,
                        help="--server: full rows by the shared-memory arena or inside BLS")


def measure(args: argparse.Namespace) -> dict:
    from ...params import SamplingParams
    from . import measuring as serve_sim

    if args.server and (args.shvs or args.profile or args.top_p not in (None, 1.0)
                        or args.launch_ahead):
        raise UsageError("--shvs, --profile, --top-p and --launch-ahead are in-process only "
                         "(not with --server)")
    if args.top_p is not None:
        try:
            SamplingParams(top_p=args.top_p).validate()
        except ValueError as error:
            raise UsageError(str(error)) from None
    common = given(args, vocab="vocab", dtype="dtype", step_ms="step_ms", instances="instances",
                   handoff="handoff")
    if args.server:
        sizes = QUICK_SERVER if args.quick else given(args, batches="batch")
        return serve_sim.run_server(**common, **sizes,
                                    **given(args, row_transport="row_transport"))
    sizes = QUICK if args.quick else given(args, batches="batch")
    return serve_sim.run(**common, **sizes, shvs=args.shvs, profile_path=args.profile,
                         **given(args, top_p="top_p", launch_ahead="launch_ahead"))


def terminal_table(report: dict) -> str:
    from .measuring import format_report

    return format_report(report)


def section(source: Source, writer: FigureWriter) -> list[str]:
    """`bench serve-sim`: per mode, micro-batches and B, efficiency against the
    simulated data plane's bound, and where the rest of the step went."""
    from .measuring import launched_ahead

    report = source.data
    results = report["results"]
    lines = [f"Data plane: **{report['data_plane']}**. Per step = per full pass over the B "
             "sequences; efficiency = tokens/s over B / step time; loop = the decode loop's "
             "own Python time (DecoderStats.loop_s), loop thread = all CPU of the event-loop "
             "thread; SHVS = the share of rows the hot set decided (off: no hot set; files "
             "from before `--shvs` read off).", ""]
    lines += table(["mode", "micro-batches", "B", "V", "dtype", "step ms", "tok/s", "ideal tok/s",
                    "efficiency", "exposed sampling ms", "exposed / step", "sampler ms",
                    "loop ms", "loop thread CPU ms", "ITL P50 ms", "ITL P95 ms", "SHVS",
                    "launched ahead"],
                   [[r["mode"], r["micro_batches"], r["batch"], f"{r['vocab']:,}", r["dtype"],
                     number(r["step_ms"]), number(r["tokens_per_s"], 0),
                     number(r["ideal_tokens_per_s"], 0), number(r["efficiency"], 3),
                     number(r["exposed_sampling_ms_per_step"], 2),
                     number(100 * r["exposed_sampling_ms_per_step"] / r["step_ms"], 1, "%"),
                     number(r["sampler_ms_per_step"], 2), number(r["loop_ms_per_step"], 2),
                     number(r["loop_thread_cpu_ms_per_step"], 2), number(r["itl_ms_p50"]),
                     number(r["itl_ms_p95"]),
                     number(r["shvs_acceptance"] and 100 * r["shvs_acceptance"], 1, "%")
                     if r.get("shvs") else "off", launched_ahead(r)]
                    for r in results])
    figure, axes = writer.new()
    lines_of = dict.fromkeys((r["mode"], r["micro_batches"], launched_ahead(r))
                             for r in results)
    for mode, micro_batches, ahead in lines_of:
        points = sorted((r["batch"], r["efficiency"]) for r in results
                        if (r["mode"], r["micro_batches"], launched_ahead(r))
                        == (mode, micro_batches, ahead))
        axes.plot(*zip(*points), "o-", label=f"{mode}, {micro_batches} micro-batch"
                  + ("es" if micro_batches > 1 else "")
                  + (", launched ahead" if ahead == "on" else ""))
    batches = sorted({r["batch"] for r in results})
    axes.set_xscale("log", base=2)
    axes.set_xticks(batches, [str(b) for b in batches])
    axes.set_xlabel("batch (sequences in flight)")
    axes.set_ylabel("efficiency (tokens/s over the data plane's bound)")
    axes.set_ylim(0, 1.05)
    axes.grid(alpha=0.3)
    axes.legend()
    first = results[0]
    title = (f"Efficiency against batch, SIMULATED data plane, V={first['vocab']:,} "
             f"{first['dtype']}, {first['step_ms']:g} ms step")
    return lines + writer.save(figure, "serve-sim-efficiency", title, source)


SPEC = BenchSpec(
    name="serve-sim", help="decode loop efficiency at GPU pace on a SIMULATED data plane "
                           "(docs/SIMULATED.md)",
    heading="Decode loop at GPU pace (simulated data plane)", arguments=arguments,
    measure=measure, table=terminal_table, section=section,
    quick="B 8 and 16 and a short window (seconds; for tests)")
