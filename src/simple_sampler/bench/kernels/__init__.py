"""`bench kernels`: kernel us/row against torch sort, a numpy floor and the exp floor."""
from __future__ import annotations

import argparse

from ..markdown import FigureWriter, Source, number, table
from ..spec import BenchSpec, given

#: --quick: fewer repeats of the kernels and of the baselines.
QUICK = {"repeats": 5, "baseline_repeats": 1}
KERNEL_COLUMNS = ("simple", "simple_top_p", "simple_greedy", "simple_logprobs", "torch_sort",
                  "floor", "exp_floor")


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int)
    parser.add_argument("--vocab", type=int, nargs="+")
    parser.add_argument("--dtype", nargs="+", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--temperature", type=float, nargs="+",
                        help="the sampled configs' temperatures, each a set of cells (default:"
                             " theirs, 0.8 and 1)")
    parser.add_argument("--history-tokens", type=int, nargs="+",
                        help="history tokens of simple's rows and its logprobs configs' (half "
                             "prompt, half output), each a set of cells (default: 256)")
    parser.add_argument("--rows", nargs="+", choices=["flat", "heavy", "fitted", "real"],
                        help="row kinds, each a set of cells (default: real SmolLM2 rows at"
                             " V=49,152, fitted ones elsewhere)")
    parser.add_argument("--threads", type=int,
                        help="threads for the kernels, torch, vLLM and SGLang (the floor stays at 1)")
    parser.add_argument("--peer-python",
                        help="a python that imports vllm, for the vllm_cpu column (default: "
                             "this one if it can, else .peer/bin/python from `make peer`)")
    parser.add_argument("--sglang-python",
                        help="a python that imports sglang, for the sglang_cpu columns (default: "
                             "this one if it can, else .peer-sglang/bin/python from `make peer-sglang`)")
    parser.add_argument("--no-peer", action="store_true",
                        help="leave the peers' columns out (vllm_cpu and sglang_cpu)")
    parser.add_argument("--clock", choices=["wall", "cpu"],
                        help="wall: elapsed time; cpu: the process's CPU time (all threads "
                             "summed), for single-threaded runs on a machine others share")


def measure(args: argparse.Namespace) -> dict:
    from . import measuring as kernels

    peer = None if args.no_peer else (args.peer_python or kernels.default_peer_python("vllm"))
    sglang = None if args.no_peer else (args.sglang_python or kernels.default_peer_python("sglang"))
    results = kernels.run(
        peer_python=peer, sglang_python=sglang, **(QUICK if args.quick else given(args, repeats="repeats")),
        **given(args, vocabs="vocab", batch="batch", dtypes="dtype", threads="threads",
                clock="clock", temperatures="temperature", rows="rows",
                histories="history_tokens"))
    return {"results": results, "worst_over_floor": kernels.worst_over(results),
            "worst_over_exp_floor": kernels.worst_over(results, "exp_floor")}


def terminal_table(report: dict) -> str:
    from .measuring import format_table

    return format_table(report["results"])


def section(source: Source, writer: FigureWriter) -> list[str]:
    """`bench kernels`: the us/row table with ratios and, per dtype, us/row against
    vocabulary (log y) with torch_sort and both floors. Returns Markdown lines;
    `writer` saves the figures. A run without the exp floor (kernels built
    before it) shows n/a there."""
    from .measuring import history_tokens

    results = source.data["results"]
    lines = [f"us per row, single thread, B={results[0]['batch']}; ratios from these columns."
             " exp_floor: one read of each row with the kernels' exp of every logit and its"
             " sum, what a config that needs the row's mass cannot go below.", ""]
    rows = []
    for r in results:
        us = r["us_per_row"]
        exp_floor = us.get("exp_floor")
        rows.append([r["vocab"], r["dtype"], history_tokens(r), *(number(us.get(c)) for c in KERNEL_COLUMNS),
                     number(us["simple"] / us["floor"], 2, "x"),
                     number(us["simple_top_p"] / us["floor"], 2, "x"),
                     number(us["simple_top_p"] / exp_floor if exp_floor else None, 2, "x"),
                     number(us["simple_logprobs"] / exp_floor if exp_floor else None, 2, "x"),
                     number(us["torch_sort"] / us["simple"], 1, "x"), r["rows"]])
    lines += table(["vocab", "dtype", "history", *KERNEL_COLUMNS, "simple/floor", "top_p/floor",
                    "top_p/exp_floor", "logprobs/exp_floor", "torch_sort/simple", "rows"], rows)
    for dtype in dict.fromkeys(r["dtype"] for r in results):
        # against vocabulary: one history's cells (the run's first)
        chosen = sorted((r for r in results if r["dtype"] == dtype
                         and history_tokens(r) == history_tokens(results[0])),
                        key=lambda r: r["vocab"])
        figure, axes = writer.new()
        vocabs = [r["vocab"] for r in chosen]
        for column in KERNEL_COLUMNS:
            if any(column not in r["us_per_row"] for r in chosen):
                continue
            # The baseline and the floors dashed, so the kernels stand out between them.
            style = {"torch_sort": "s--", "floor": "k^--", "exp_floor": "kv--"}.get(column, "o-")
            axes.plot(vocabs, [r["us_per_row"][column] for r in chosen], style, label=column)
        axes.set_yscale("log")
        axes.set_xticks(vocabs, [f"{v:,}" for v in vocabs])
        axes.set_xlabel("vocabulary size")
        axes.set_ylabel("us per row (log)")
        axes.grid(alpha=0.3, which="both")
        axes.legend(fontsize=8)
        lines += writer.save(figure, f"kernels-{dtype}",
                             f"Kernel us/row against vocabulary, {dtype}", source)
    return lines


SPEC = BenchSpec(
    name="kernels", help="kernel us/row against torch sort, a numpy floor and the exp floor",
    heading="Kernels: microseconds per row", arguments=arguments, measure=measure,
    table=terminal_table, section=section, quick="fewer repeats (under a minute)")
