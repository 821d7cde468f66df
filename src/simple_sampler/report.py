"""`simple-sampler report`: the bench commands' JSON as one Markdown report
with PNG plots.

Inputs are what `simple-sampler bench kernels|shvs|sampler-server|serve|serve-sim
--json` and `simple-sampler perf --json` print (one object: the report plus
a "machine" key), or raw perf_analyzer profile exports ({"experiments":
[...]}, the file of --profile-export-file), which carry no machine. The
kind of each input is read from its structure. Every table and figure names
the command, machine and date its figures came from, in the Markdown and in
a footnote inside each PNG, so a plot copied elsewhere keeps its origin.
"""
from __future__ import annotations

import json
import math
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

from .bench.perf import PerfError, figures_from_export
from .serving.engines import ENGINES

DEFAULT_OUTPUT_DIR = Path("results/report")
KERNEL_COLUMNS = ("simple", "simple_top_p", "simple_greedy", "simple_logprobs", "torch_sort",
                  "floor")
#: Section order in the report, and each kind's heading.
HEADINGS = {
    "kernels": "Kernels: microseconds per row",
    "shvs": "SHVS against the full path",
    "sampler_server": "Sampler server: rows/s against instances",
    "serve": "Whole server per sampling mode",
    "perf": "perf_analyzer against the ensemble",
    "perf_export": "perf_analyzer profile exports",
    "serve_sim": "Decode loop at GPU pace (simulated data plane)",
    "serve_cost": "Server CPU per streamed token, beside Triton's floor (simulated data plane)",
    "row_transport": "Sampler stubs' CPU per token by row transport (simulated data plane)",
}


class ReportError(ValueError):
    """An input the report cannot use; the message names the file."""


@dataclass
class Source:
    """One input of the report.

    path: the file (for raw perf_analyzer exports, the first of the group).
    kind: one of HEADINGS' keys.
    data: the parsed JSON; for raw exports {"results": [figures per file]}.
    command: the command that printed it.
    machine, date: "CPU model, N cores" and the run's date; None where the
        input does not say (raw perf_analyzer exports).
    """
    path: Path
    kind: str
    data: dict
    command: str
    machine: str | None
    date: str | None

    def origin(self) -> tuple[str, str]:
        """("machine: ...", "date: ...") or their "unknown" forms."""
        return (f"machine: {self.machine}" if self.machine else "machine unknown",
                f"date: {self.date}" if self.date else "date unknown")

    def markdown_provenance(self) -> str:
        machine, date = self.origin()
        return f"Source: `{self.command}`; {machine}; {date}."

    def footnote(self) -> str:
        """Command on its own line(s), wrapped so a long one stays inside the PNG."""
        machine, date = self.origin()
        return "\n".join([*textwrap.wrap(f"source: {self.command}", 120), f"{machine}; {date}"])


def kind_of(data: object) -> str | None:
    """The bench command whose --json printed `data` (a HEADINGS key), or None."""
    if not isinstance(data, dict):
        return None
    if isinstance(data.get("experiments"), list):
        return "perf_export"
    if data.get("kind") == "perf_analyzer":
        return "perf"
    results = data.get("results")
    first = results[0] if isinstance(results, list) and results else None
    if isinstance(first, dict) and "cpu_us_per_token" in first:
        return "serve_cost"
    if isinstance(first, dict) and "samplers_us_per_token" in first and "transport" in first:
        return "row_transport"
    if str(data.get("data_plane", "")).startswith(ENGINES["simulated"].label):
        return "serve_sim"
    if "in_process_rows_per_s" in data:
        return "sampler_server"
    if "hot_first" in data:
        return "shvs"
    if isinstance(first, dict) and "us_per_row" in first and "dtype" in first:
        return "kernels"
    if isinstance(first, dict) and "mode" in first and "sampling_share" in first:
        return "serve"
    return None


def read_json(path: Path) -> dict:
    """The JSON object in `path`; ReportError naming the file if it is not one."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ReportError(f"{path}: cannot read it as JSON ({error})") from None


def machine_source(path: Path, kind: str, data: dict) -> Source:
    """A Source for a bench command's --json output (its "machine" key)."""
    machine = data.get("machine") or {}
    described = f"{machine['cpu']}, {machine['cores']} cores" if "cpu" in machine else None
    return Source(path, kind, data, command=machine.get("command", f"unknown ({path.name})"),
                  machine=described, date=machine.get("date"))


def export_mode(path: Path) -> str:
    """The sampling mode of a raw export: `simple-sampler perf` names its
    exports MODE-cN.json; any other name stands for itself."""
    match = re.fullmatch(r"(.+)-c\d+", path.stem)
    return match.group(1) if match else path.stem


def export_source(paths: list[Path], exports: list[dict]) -> Source:
    """One Source for all raw perf_analyzer exports: their figures, one row
    per file, computed exactly as `simple-sampler perf` computes its own."""
    results = []
    for path, export in zip(paths, exports):
        try:
            results.append({"mode": export_mode(path), **figures_from_export(export),
                            "file": path.name})
        except (PerfError, KeyError, IndexError, TypeError) as error:
            raise ReportError(f"{path}: not a usable perf_analyzer profile export "
                              f"({type(error).__name__}: {error})") from None
    names = ", ".join(path.name for path in paths)
    return Source(paths[0], "perf_export", {"results": results},
                  command=f"perf_analyzer --profile-export-file ({names})",
                  machine=None, date=None)


def load_sources(paths: list[Path]) -> list[Source]:
    """The inputs in HEADINGS' order (input order within a kind); raw exports
    become one Source. ReportError names any file of an unknown kind."""
    sources, export_paths, exports = [], [], []
    for path in map(Path, paths):
        data = read_json(path)
        kind = kind_of(data)
        if kind is None:
            raise ReportError(
                f"{path}: not a recognized benchmark JSON (expected the --json output of "
                "`simple-sampler bench kernels|shvs|sampler-server|serve|serve-sim|serve-cost` or "
                "`simple-sampler perf`, or a perf_analyzer profile export)")
        if kind == "perf_export":
            export_paths.append(path)
            exports.append(data)
        else:
            sources.append(machine_source(path, kind, data))
    if exports:
        sources.append(export_source(export_paths, exports))
    order = list(HEADINGS)
    return sorted(sources, key=lambda source: order.index(source.kind))


def number(value: float | None, digits: int = 1, suffix: str = "") -> str:
    """`value` with thousands separators, `digits` decimals and `suffix` (e.g. "x"),
    for a table; "n/a" where a figure is missing (perf_analyzer leaves Response
    Throughput empty for non-streaming runs, which becomes NaN)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:,.{digits}f}{suffix}"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table of `rows` (cells, any type) under `header`, then a blank line."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return lines + [""]


class FigureWriter:
    """Saves numbered PNGs into one directory and returns their Markdown.

    directory: where the PNGs go (it exists already).
    """

    def __init__(self, directory: Path):
        self.directory = directory
        self.count = 0

    def new(self, width: float = 7.0, height: float = 4.2):
        """A Figure of width x height inches with one Axes. A bare Figure, not
        pyplot: no global state, and PNGs render with Agg whatever backend the
        caller set."""
        from matplotlib.figure import Figure

        figure = Figure(figsize=(width, height), dpi=100)
        return figure, figure.add_subplot()

    def save(self, figure, name: str, title: str, source: Source) -> list[str]:
        """Titles `figure` with `title`, stamps `source`'s provenance into it,
        writes NN-`name`.png and returns its Markdown (image and caption)."""
        self.count += 1
        path = self.directory / f"{self.count:02d}-{name}.png"
        figure.suptitle(title, fontsize=11)
        footnote = source.footnote()
        figure.text(0.01, 0.01, footnote, fontsize=7, color="dimgray", va="bottom")
        # Room at the bottom for the footnote's lines (about 0.03 of the height each).
        figure.tight_layout(rect=(0, 0.03 * (footnote.count("\n") + 1) + 0.01, 1, 1))
        figure.savefig(path)
        return [f"![{title}]({path.name})", "",
                f"*Figure {self.count}: {title}. {source.markdown_provenance()}*", ""]


def concurrency_axes(axes, concurrencies: list[int]) -> None:
    """Sets `axes`' x axis for `concurrencies`: sweeps double or more per step,
    so a log scale with the measured levels as ticks."""
    axes.set_xscale("log", base=2)
    axes.set_xticks(concurrencies, [str(c) for c in concurrencies])
    axes.set_xlabel("concurrency (clients)")
    axes.grid(alpha=0.3)


def per_mode_plot(writer: FigureWriter, source: Source, results: list[dict], key: str,
                  ylabel: str, name: str, title: str) -> list[str]:
    """One line per sampling mode of results[i][key] against concurrency, saved
    by `writer` as `name` with `title` and `ylabel`; returns its Markdown."""
    figure, axes = writer.new()
    modes = list(dict.fromkeys(r["mode"] for r in results))
    for mode in modes:
        points = sorted((r["concurrency"], r[key]) for r in results if r["mode"] == mode)
        axes.plot(*zip(*points), "o-", label=mode)
    concurrency_axes(axes, sorted({r["concurrency"] for r in results}))
    axes.set_ylabel(ylabel)
    axes.set_ylim(bottom=0)
    axes.legend()
    return writer.save(figure, name, title, source)


def simple_vs_inline(results: list[dict], tokens: str, p95: str) -> list[str]:
    """Markdown table, per concurrency where both modes ran, of simple over inline
    in tokens/s (results' `tokens` key) and P95 ITL (`p95` key); [] if none."""
    by = {(r["mode"], r["concurrency"]): r for r in results}
    rows = []
    for concurrency in sorted({r["concurrency"] for r in results}):
        if ("simple", concurrency) in by and ("inline", concurrency) in by:
            s, i = by[("simple", concurrency)], by[("inline", concurrency)]
            rows.append([concurrency, number(s[tokens]), number(i[tokens]),
                         number(s[tokens] / i[tokens], 2, "x"), number(s[p95], 0),
                         number(i[p95], 0), number(s[p95] / i[p95], 2, "x"),
                         number(100 * (1 - s[p95] / i[p95]), 0, "%")])
    if not rows:
        return []
    return ["Simple against inline (ratios simple / inline):", ""] + table(
        ["concurrency", "simple tok/s", "inline tok/s", "tok/s ratio", "simple P95 ITL ms",
         "inline P95 ITL ms", "P95 ITL ratio", "P95 ITL lower by"], rows)


def kernels_section(source: Source, writer: FigureWriter) -> list[str]:
    """`bench kernels`: the us/row table with ratios and, per dtype, us/row against
    vocabulary (log y) with torch_sort and the floor. Returns Markdown lines;
    `writer` saves the figures. The other *_section functions take the same inputs."""
    results = source.data["results"]
    lines = [f"us per row, single thread, B={results[0]['batch']}; ratios from these columns.",
             ""]
    rows = []
    for r in results:
        us = r["us_per_row"]
        rows.append([r["vocab"], r["dtype"], *(number(us[c]) for c in KERNEL_COLUMNS),
                     number(us["simple"] / us["floor"], 2, "x"),
                     number(us["simple_top_p"] / us["floor"], 2, "x"),
                     number(us["torch_sort"] / us["simple"], 1, "x"), r["rows"]])
    lines += table(["vocab", "dtype", *KERNEL_COLUMNS, "simple/floor", "top_p/floor",
                    "torch_sort/simple", "rows"], rows)
    for dtype in dict.fromkeys(r["dtype"] for r in results):
        chosen = sorted((r for r in results if r["dtype"] == dtype), key=lambda r: r["vocab"])
        figure, axes = writer.new()
        vocabs = [r["vocab"] for r in chosen]
        for column in KERNEL_COLUMNS:
            # The baseline and the floor dashed, so the kernels stand out between them.
            style = {"torch_sort": "s--", "floor": "k^--"}.get(column, "o-")
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


def shvs_section(source: Source, writer: FigureWriter) -> list[str]:
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


def sampler_server_section(source: Source, writer: FigureWriter) -> list[str]:
    """`bench sampler-server`: rows/s against instances and in-process; the
    per-request breakdown."""
    report = source.data
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


def serve_section(source: Source, writer: FigureWriter) -> list[str]:
    """`bench serve`: per mode and concurrency, tokens/s, latencies, sampling share."""
    results = source.data["results"]
    lines = table(["mode", "concurrency", "tok/s", "TTFT P50 ms", "ITL P50 ms", "ITL P95 ms",
                   "sampling share"],
                  [[r["mode"], r["concurrency"], number(r["tokens_per_s"]),
                    number(r["ttft_ms_p50"], 0), number(r["itl_ms_p50"], 0),
                    number(r["itl_ms_p95"], 0), number(r["sampling_share"], 3)]
                   for r in results])
    lines += simple_vs_inline(results, "tokens_per_s", "itl_ms_p95")
    lines += per_mode_plot(writer, source, results, "tokens_per_s", "output tokens per second",
                           "serve-throughput", "Output tokens/s against concurrency (bench serve)")
    lines += per_mode_plot(writer, source, results, "itl_ms_p95", "P95 inter-token latency (ms)",
                           "serve-itl-p95", "P95 inter-token latency against concurrency "
                           "(bench serve)")
    figure, axes = writer.new()
    modes = list(dict.fromkeys(r["mode"] for r in results))
    concurrencies = sorted({r["concurrency"] for r in results})
    share = {(r["mode"], r["concurrency"]): r["sampling_share"] for r in results}
    width = 0.8 / len(modes)
    for index, mode in enumerate(modes):
        axes.bar([c + (index - (len(modes) - 1) / 2) * width for c in range(len(concurrencies))],
                 [share.get((mode, c), 0.0) for c in concurrencies], width, label=mode)
    axes.set_xticks(range(len(concurrencies)), [f"concurrency {c}" for c in concurrencies])
    axes.set_ylabel("sampling share of step time")
    axes.legend()
    return lines + writer.save(figure, "serve-sampling-share",
                               "Sampling share of step time per mode and concurrency", source)


def perf_section(source: Source, writer: FigureWriter) -> list[str]:
    """`perf --json` or raw perf_analyzer exports: tokens/s and latencies per mode."""
    results = source.data["results"]
    rows = []
    for r in results:
        own = r.get("perf_analyzer", {})
        rows.append([r.get("file", r["mode"]) if source.kind == "perf_export" else r["mode"],
                     r["concurrency"], number(r["tokens_per_s"]), number(r["requests_per_s"], 2),
                     number(r["p95_latency_ms"], 0), number(r["p50_itl_ms"], 0),
                     number(r["p95_itl_ms"], 0), number(r["p95_ttft_ms"], 0),
                     number(own.get("requests_per_s"), 2)])
    first = "file" if source.kind == "perf_export" else "mode"
    lines = ["Figures from the requests of perf_analyzer's last three (stable) windows; "
             "perf_analyzer's own requests/s beside them where it was kept.", ""]
    lines += table([first, "concurrency", "tok/s", "req/s", "P95 latency ms", "ITL P50 ms",
                    "ITL P95 ms", "TTFT P95 ms", "perf_analyzer req/s"], rows)
    lines += simple_vs_inline(results, "tokens_per_s", "p95_itl_ms")
    stem = source.kind.replace("_", "-")
    lines += per_mode_plot(writer, source, results, "tokens_per_s", "output tokens per second",
                           f"{stem}-throughput", "Output tokens/s against concurrency "
                           "(perf_analyzer)")
    lines += per_mode_plot(writer, source, results, "p95_itl_ms", "P95 inter-token latency (ms)",
                           f"{stem}-itl-p95", "P95 inter-token latency against concurrency "
                           "(perf_analyzer)")
    return lines


def serve_sim_section(source: Source, writer: FigureWriter) -> list[str]:
    """`bench serve-sim`: per mode, micro-batches and B, efficiency against the
    simulated data plane's bound, and where the rest of the step went."""
    report = source.data
    results = report["results"]
    lines = [f"Data plane: **{report['data_plane']}**. Per step = per full pass over the B "
             "sequences; efficiency = tokens/s over B / step time; loop = the decode loop's "
             "own Python time (DecoderStats.loop_s), loop thread = all CPU of the event-loop "
             "thread; SHVS = the share of rows the hot set decided (off: no hot set; files "
             "from before `--shvs` read off).", ""]
    lines += table(["mode", "micro-batches", "B", "V", "dtype", "step ms", "tok/s", "ideal tok/s",
                    "efficiency", "exposed sampling ms", "exposed / step", "sampler ms",
                    "loop ms", "loop thread CPU ms", "ITL P50 ms", "ITL P95 ms", "SHVS"],
                   [[r["mode"], r["micro_batches"], r["batch"], f"{r['vocab']:,}", r["dtype"],
                     number(r["step_ms"]), number(r["tokens_per_s"], 0),
                     number(r["ideal_tokens_per_s"], 0), number(r["efficiency"], 3),
                     number(r["exposed_sampling_ms_per_step"], 2),
                     number(100 * r["exposed_sampling_ms_per_step"] / r["step_ms"], 1, "%"),
                     number(r["sampler_ms_per_step"], 2), number(r["loop_ms_per_step"], 2),
                     number(r["loop_thread_cpu_ms_per_step"], 2), number(r["itl_ms_p50"]),
                     number(r["itl_ms_p95"]),
                     number(r["shvs_acceptance"] and 100 * r["shvs_acceptance"], 1, "%")
                     if r.get("shvs") else "off"]
                    for r in results])
    figure, axes = writer.new()
    lines_of = dict.fromkeys((r["mode"], r["micro_batches"]) for r in results)
    for mode, micro_batches in lines_of:
        points = sorted((r["batch"], r["efficiency"]) for r in results
                        if (r["mode"], r["micro_batches"]) == (mode, micro_batches))
        axes.plot(*zip(*points), "o-", label=f"{mode}, {micro_batches} micro-batch"
                  + ("es" if micro_batches > 1 else ""))
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


#: serve-cost's processes, stacked in this order.
COST_PARTS = (("tritonserver", "tritonserver"), ("llm", "llm stub"), ("floor", "floor stub"),
              ("samplers", "sampler stubs"), ("preprocessing", "preprocessing stub"))


def switches(row: dict) -> list[str]:
    """Voluntary context switches per token of tritonserver and of the
    route's stub (llm or floor); absent from reports made before them."""
    counts = row.get("switches_per_token", {})
    stub = "floor" if row["route"].startswith("floor") else "llm"
    return [number(counts.get("tritonserver"), 2), number(counts.get(stub), 2)]


def serve_cost_section(source: Source, writer: FigureWriter) -> list[str]:
    """`bench serve-cost`: per configuration, tokens/s against the bound and
    server CPU per token by process, with its ratio to the floor model's;
    a stacked bar per configuration (ours and the floor side by side)."""
    report = source.data
    results = report["results"]

    # what tells a run's servers apart, named where it differs between them
    varied = {"python_thread_pool": "pool {}", "micro_batches": "m={}", "handoff": "{}"}
    varied = {key: text for key, text in varied.items()
              if len({r.get(key) for r in results}) > 1}

    def label(r):
        a, b = r["step_ms"]
        pace = "instant" if not (a or b) else f"{a:g}+{b:g}*B ms"
        k = f", k={r['stream_interval']}" if not r["route"].startswith("floor") else ""
        server = "".join(f", {text.format(r.get(key))}" for key, text in varied.items())
        return f"{r['route']}{k}, {pace}, B={r['batch']}{server}"

    lines = [f"Data plane: **{report['data_plane']}**. CPU: microseconds of each process per "
             "token received (utime + stime from /proc); vs floor = (llm + tritonserver) over "
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


def row_transport_section(source: Source, writer: FigureWriter) -> list[str]:
    """`bench row-transport`: per (V, dtype, B) and transport, the sampler
    stubs' CPU per token beside the kernels' us/row of the same run, the
    other processes, bytes and the hot-first fallback rate; bars of the
    stubs' CPU per configuration, one per transport, the kernel marked."""
    report = source.data
    results = report["results"]
    lines = [f"Data plane: **{report['data_plane']}**. Requests: {report['settings']['params']}. "
             "CPU: microseconds per token received (utime + stime from /proc); kernel / "
             "compact kernel: us/row of the kernels on the same rows in the same run; codec / "
             "compact codec: what the stub's own Python adds per row (in process); vs kernel = "
             "sampler stubs / kernel; fallback: hot-first rows sent again whole.", ""]
    lines += table(["transport", "V", "dtype", "B", "sampler stubs", "llm stub", "tritonserver",
                    "kernel", "compact kernel", "codec", "compact codec", "vs kernel",
                    "fallback", "bytes/row", "share of a row", "tok/s"],
                   [[r["transport"], f"{r['vocab']:,}", r["dtype"], r["batch"],
                     number(r["samplers_us_per_token"]), number(r["llm_us_per_token"]),
                     number(r["tritonserver_us_per_token"]), number(r["kernel_us_per_row"]),
                     number(r["compact_kernel_us_per_row"]), number(r["codec_us_per_row"]),
                     number(r.get("compact_codec_us_per_row")), number(r["vs_kernel"], 2, "x"),
                     "-" if r.get("fallback_rate") is None else f"{r['fallback_rate']:.2%}",
                     number(r["bytes_per_row"], 0), f"{r['bytes_share']:.1%}",
                     number(r["tokens_per_s"], 0)] for r in results])
    configurations = list(dict.fromkeys((r["vocab"], r["dtype"], r["batch"]) for r in results))
    transports = list(dict.fromkeys(r["transport"] for r in results))
    by_key = {(r["vocab"], r["dtype"], r["batch"], r["transport"]): r for r in results}
    figure, axes = writer.new(width=max(7.0, 1.2 * len(configurations) + 2))
    width = 0.8 / len(transports)
    for i, transport in enumerate(transports):
        found = [(j, by_key[(*c, transport)]) for j, c in enumerate(configurations)
                 if (*c, transport) in by_key]
        axes.bar([j + (i - (len(transports) - 1) / 2) * width for j, _ in found],
                 [r["samplers_us_per_token"] for _, r in found], width, label=transport)
    kernels = {c: r["kernel_us_per_row"] for r in results
               for c in [(r["vocab"], r["dtype"], r["batch"])]}
    axes.scatter(range(len(configurations)), [kernels[c] for c in configurations], marker="_",
                 s=900, color="black", zorder=3, label="kernel us/row (full rows)")
    axes.set_xticks(range(len(configurations)),
                    [f"V={v:,} {d}\nB={b}" for v, d, b in configurations], fontsize=7)
    axes.set_ylabel("sampler stubs' CPU per token received (us)")
    axes.grid(axis="y", alpha=0.3)
    axes.legend(fontsize=7)
    title = "Sampler stubs' CPU per token by row transport (SIMULATED data plane)"
    return lines + writer.save(figure, "row-transport-cpu-per-token", title, source)


SECTIONS = {"kernels": kernels_section, "shvs": shvs_section,
            "sampler_server": sampler_server_section, "serve": serve_section,
            "perf": perf_section, "perf_export": perf_section, "serve_sim": serve_sim_section,
            "serve_cost": serve_cost_section, "row_transport": row_transport_section}


def build(paths: list[Path | str], output_dir: Path | str = DEFAULT_OUTPUT_DIR) -> Path:
    """Writes output_dir/report.md and its PNGs from the JSON files at `paths`
    (any mix of the kinds above, in any order); returns the Markdown's path.
    Raises ReportError, naming the file, for an input it cannot use."""
    sources = load_sources([Path(p) for p in paths])
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    writer = FigureWriter(output_dir)
    lines = ["# SIMPLE benchmark report", "",
             "Built by `simple-sampler report` from these inputs:", ""]
    lines += table(["input", "kind", "command", "machine", "date"],
                   [[f"`{s.path}`", s.kind, f"`{s.command}`", s.machine or "unknown",
                     s.date or "unknown"]
                    for s in sources])
    for source in sources:
        repeated = sum(s.kind == source.kind for s in sources) > 1
        heading = HEADINGS[source.kind] + (f" ({source.path.name})" if repeated else "")
        lines += [f"## {heading}", "", source.markdown_provenance(), ""]
        settings = source.data.get("settings")
        if settings:
            lines += ["Settings: " + "; ".join(f"{k} {v}" for k, v in settings.items()) + ".", ""]
        try:
            lines += SECTIONS[source.kind](source, writer)
        except (KeyError, TypeError, ZeroDivisionError) as error:
            # Structure said which command; a field it always prints is missing or empty.
            raise ReportError(f"{source.path}: looks like {source.kind} output but cannot be "
                              f"read as one ({type(error).__name__}: {error})") from None
    markdown = output_dir / "report.md"
    markdown.write_text("\n".join(lines))
    return markdown
