"""The pieces every bench's report section is drawn with: where its figures
came from (Source), Markdown tables and numbers, and numbered PNGs that carry
their provenance in a footnote, so a plot copied elsewhere keeps its origin."""
from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Source:
    """One input of the report.

    path: the file (for raw perf_analyzer exports, the first of the group).
    kind: the bench (a spec's name), "perf" or "perf_export".
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
