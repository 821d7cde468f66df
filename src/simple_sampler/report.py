"""`simple-sampler report`: the bench commands' JSON as one Markdown report
with PNG plots.

Inputs are what `simple-sampler bench NAME --json` and `simple-sampler perf
--json` print (one object: the report, its "kind" and a "machine" key), or
raw perf_analyzer profile exports ({"experiments": [...]}, the file of
--profile-export-file), which carry no machine. A bench's "kind" is its
name, and its spec (bench/NAME/__init__.py) draws its section. Every table and figure
names the command, machine and date its figures came from, in the Markdown
and in a footnote inside each PNG (bench/markdown.py).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from .bench.markdown import FigureWriter, Source, number, per_mode_plot, simple_vs_inline, table
from .bench.perf import PerfError, figures_from_export
from .bench import registry

DEFAULT_OUTPUT_DIR = Path("results/report")
#: The kinds that are no bench: `perf --json` and raw perf_analyzer exports.
PERF_HEADINGS = {"perf": "perf_analyzer against the ensemble",
                 "perf_export": "perf_analyzer profile exports"}


class ReportError(ValueError):
    """An input the report cannot use; the message names the file."""


def headings() -> dict[str, str]:
    """Every kind's section heading, in the report's order."""
    return {**{name: spec.heading for name, spec in registry().items()}, **PERF_HEADINGS}


def kind_of(data: object) -> str | None:
    """The kind of `data` (a bench's name, "perf" or "perf_export"), or None."""
    if not isinstance(data, dict):
        return None
    if isinstance(data.get("experiments"), list):
        return "perf_export"
    kind = data.get("kind")
    if kind == "perf_analyzer":
        return "perf"
    return kind if kind in registry() else None


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
    """The inputs in headings()' order (input order within a kind); raw exports
    become one Source. ReportError names any file of an unknown kind."""
    sources, export_paths, exports = [], [], []
    for path in map(Path, paths):
        data = read_json(path)
        kind = kind_of(data)
        if kind is None:
            raise ReportError(
                f"{path}: not a recognized benchmark JSON (expected the --json output of "
                f"`simple-sampler bench {'|'.join(registry())}` or `simple-sampler perf`, or a "
                "perf_analyzer profile export)")
        if kind == "perf_export":
            export_paths.append(path)
            exports.append(data)
        else:
            sources.append(machine_source(path, kind, data))
    if exports:
        sources.append(export_source(export_paths, exports))
    order = list(headings())
    return sorted(sources, key=lambda source: order.index(source.kind))


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


def section_of(kind: str):
    """The function that draws a `kind`'s section: its spec's, or perf_section."""
    return perf_section if kind in PERF_HEADINGS else registry()[kind].section


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
        heading = headings()[source.kind] + (f" ({source.path.name})" if repeated else "")
        lines += [f"## {heading}", "", source.markdown_provenance(), ""]
        settings = source.data.get("settings")
        if settings:
            lines += ["Settings: " + "; ".join(f"{k} {v}" for k, v in settings.items()) + ".", ""]
        try:
            lines += section_of(source.kind)(source, writer)
        except (KeyError, TypeError, ZeroDivisionError) as error:
            # Its kind said which command; a field it always prints is missing or empty.
            raise ReportError(f"{source.path}: looks like {source.kind} output but cannot be "
                              f"read as one ({type(error).__name__}: {error})") from None
    markdown = output_dir / "report.md"
    markdown.write_text("\n".join(lines))
    return markdown
