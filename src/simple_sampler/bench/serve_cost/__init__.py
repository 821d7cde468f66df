"""`bench serve-cost`: server CPU per streamed token by process, beside
Triton's floor model, on a SIMULATED data plane (docs/SERVED_COST.md)."""
from __future__ import annotations

import argparse

from ...settings import HANDOFFS, SAMPLING_MODES, LlmSettings
from ..markdown import FigureWriter, Source, number, table
from ..spec import BenchSpec, given, positive_int, simulated_rows

#: --quick: instant pace, B 16, stream intervals 1 and 4, 32 tokens.
QUICK_PLAN = {"paces": ["instant"], "batches": [16], "intervals": [1, 4]}
QUICK_TOKENS = 32


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pace", nargs="+", choices=["instant", "gpu"],
                        help="simulated step: instant (0 ms) or gpu (a + b * B, the "
                             "simulated engine's defaults)")
    parser.add_argument("--batch", type=int, nargs="+", help="concurrent streams (B)")
    parser.add_argument("--stream-interval", type=int, nargs="+",
                        help="stream_interval of the ensemble's requests (llm direct: the "
                             "first)")
    parser.add_argument("--routes", nargs="+", choices=["floor", "floor-llm", "ensemble", "llm"],
                        help="floor model, the floor model in the llm model's request and "
                             "response shape, ensemble, llm called directly")
    parser.add_argument("--max-tokens", type=int,
                        help="tokens per request (at least 8 x the largest stream interval)")
    parser.add_argument("--instances", type=int, help="simple_sampler instances")
    parser.add_argument("--micro-batches", type=int, nargs="+",
                        help="the decode loop's lanes (several: one server each)")
    parser.add_argument("--handoff", nargs="+", choices=HANDOFFS,
                        help="rows to the sampler: full, or hot-first's compact rows with "
                             "the repository's hot set (several: one server each)")
    parser.add_argument("--sampling-mode", choices=SAMPLING_MODES,
                        help="simple: the sampler instances (a BLS request per shard per "
                             "step); inline_kernels: in the llm stub, so that tritonserver's "
                             "column is streaming alone")
    parser.add_argument("--sampler-shard-min-rows", type=int,
                        help="full rows per sampler request at least (1: one request per "
                             "instance per step, whatever the rows)")
    parser.add_argument("--python-thread-pool", type=int, nargs="+", metavar="N",
                        help="the Python backend's thread-pool-size, one server per size "
                             "(default: Triton's own, 32, as serve runs it)")
    parser.add_argument("--send-threads", type=positive_int, nargs="+", metavar="N",
                        help="the llm model's send_threads, one server per count (default: "
                             f"the llm model's, {LlmSettings.send_threads})")
    simulated_rows(parser)
    parser.add_argument("--profile", metavar="DIR",
                        help="run the llm stub's decode-loop thread under cProfile and "
                             "write DIR/llm-<pid>.prof when each server stops")


def measure(args: argparse.Namespace) -> dict:
    from . import measuring as serve_cost

    if args.quick:
        configs, tokens = serve_cost.plan(**QUICK_PLAN), {"max_tokens": QUICK_TOKENS}
    else:
        configs = serve_cost.plan(**given(args, paces="pace", batches="batch",
                                          intervals="stream_interval", routes="routes"))
        tokens = given(args, max_tokens="max_tokens")
    return serve_cost.run(configs, vocab=args.vocab, dtype=args.dtype, profile_dir=args.profile,
                          **tokens, **given(args, instances="instances",
                                            micro_batches="micro_batches", handoffs="handoff",
                                            sampling_mode="sampling_mode",
                                            shard_min_rows="sampler_shard_min_rows",
                                            python_thread_pools="python_thread_pool",
                                            send_threads="send_threads"))


def terminal_table(report: dict) -> str:
    from .measuring import format_report

    return format_report(report)


#: serve-cost's processes, stacked in this order.
COST_PARTS = (("tritonserver", "tritonserver"), ("llm", "llm stub"), ("floor", "floor stub"),
              ("samplers", "sampler stubs"), ("preprocessing", "preprocessing stub"))


def switches(row: dict) -> list[str]:
    """Voluntary context switches per token of tritonserver and of the
    route's stub (llm or floor); absent from reports made before them."""
    counts = row.get("switches_per_token", {})
    stub = "floor" if row["route"].startswith("floor") else "llm"
    return [number(counts.get("tritonserver"), 2), number(counts.get(stub), 2)]


def section(source: Source, writer: FigureWriter) -> list[str]:
    """`bench serve-cost`: per configuration, tokens/s against the bound and
    server CPU per token by process, with its ratio to the floor model's;
    a stacked bar per configuration (ours and the floor side by side)."""
    report = source.data
    results = report["results"]

    # what tells a run's servers apart, named where it differs between them
    varied = {"python_thread_pool": "pool {}", "micro_batches": "m={}", "handoff": "{}",
              "send_threads": "{} send threads"}
    varied = {key: text for key, text in varied.items()
              if len({r.get(key) for r in results}) > 1}

    def label(r):
        a, b = r["step_ms"]
        pace = "instant" if not (a or b) else f"{a:g}+{b:g}*B ms"
        k = f", k={r['stream_interval']}" if not r["route"].startswith("floor") else ""
        server = "".join(f", {text.format(r.get(key))}" for key, text in varied.items())
        return f"{r['route']}{k}, {pace}, B={r['batch']}{server}"

    lines = [f"Data plane: **{report['data_plane']}**. CPU: microseconds of each process per "
             "token received (each process's CPU clock); vs floor = (llm + tritonserver) over "
             "(floor + tritonserver) at the same pace and B; llm decode loop = the llm stub's "
             "decode-loop thread (its streaming part), over the whole level; switches: "
             "voluntary context switches per token (a thread slept and was woken); per llm "
             "step (ms, over the whole level): the forward, the forward's wait (for the "
             "data-plane thread to start it and for the decode loop to take its rows) and the "
             "sampler (wall, overlapped or not); sampler requests per llm step, and per request "
             "the sampler stubs' CPU and the part of it in execute (ours: decoding, kernels, "
             "responses; the rest is the Python backend's own), over the whole level.", ""]
    lines += table(["configuration", "tok/s", "bound tok/s", "efficiency",
                    "bound with the micro-batches", "tokens/response",
                    *(name for _, name in COST_PARTS), "llm decode loop", "server", "client",
                    "vs floor", "server vs floor", "tritonserver switches/token",
                    "stub switches/token", "forward ms/step", "forward wait ms/step",
                    "sampler ms/step", "sampler requests/step", "sampler stubs us/request",
                    "of it in execute us/request"],
                   [[label(r), number(r["tokens_per_s"], 0), number(r["bound_tokens_per_s"], 0),
                     number(r["efficiency"], 2), number(r.get("lanes_bound_tokens_per_s"), 0),
                     number(r["tokens_per_response"], 1),
                     *(number(r["cpu_us_per_token"][key], 0) for key, _ in COST_PARTS),
                     number(r.get("llm_loop_us_per_token"), 0),
                     number(r["cpu_us_per_token"]["server"], 0),
                     number(r["cpu_us_per_token"]["client"], 0),
                     number(r["vs_floor"], 2, "x"), number(r["server_vs_floor"], 2, "x"),
                     *switches(r),
                     *(number((r.get("llm_ms_per_step") or {}).get(key), 1)
                       for key in ("forward", "forward_wait", "sampler")),
                     number(r.get("sampler_requests_per_step"), 2),
                     *(number((r.get("sampler_us_per_request") or {}).get(key), 0)
                       for key in ("stubs", "execute"))]
                    for r in results])
    many = len(results) > 8  # room for the rotated labels
    figure, axes = writer.new(width=0.5 * len(results) + 2 if many else 7.0,
                              height=6.5 if many else 4.2)
    positions = range(len(results))
    bottom = [0.0] * len(results)
    for key, name in COST_PARTS:
        values = [r["cpu_us_per_token"][key] for r in results]
        axes.bar(positions, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    axes.set_xticks(list(positions), [label(r) for r in results], rotation=60, ha="right",
                    fontsize=7)
    axes.set_ylabel("server CPU per token received (us)")
    axes.grid(axis="y", alpha=0.3)
    axes.legend(fontsize=7, ncol=len(COST_PARTS), loc="lower center", bbox_to_anchor=(0.5, 1.0))
    title = "Server CPU per streamed token by process, ours and the floor model (SIMULATED data plane)"
    return lines + writer.save(figure, "serve-cost-cpu-per-token", title, source)


SPEC = BenchSpec(
    name="serve-cost", help="server CPU per streamed token by process, beside Triton's floor "
                            "model, on a SIMULATED data plane (docs/SERVED_COST.md)",
    heading="Server CPU per streamed token, beside Triton's floor (simulated data plane)",
    arguments=arguments, measure=measure, table=terminal_table, section=section,
    quick="instant pace, B 16, k 1 and 4, 32 tokens (seconds; for tests)")
