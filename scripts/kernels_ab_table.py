"""The before/after table of scripts/kernels_ab.sh's output folder, in Markdown.

    python scripts/kernels_ab_table.py OUT_DIR

Per cell (V, dtype, T, rows): each config's µs per row, the mean of the
rounds on each side, and after over the floor (the floor: the mean of every
run's, both sides, as both sides time the same numpy read); then each
config's worst ratio to the floor on each side, and the geometric mean of
after / before by rows and dtype."""
import json
import math
import sys
from pathlib import Path

CONFIGS = {"simple_top_p": "top_p", "simple_min_p": "min_p", "simple": "simple",
           "simple_logprobs": "logprobs", "simple_greedy": "greedy"}


def cell_key(cell: dict) -> tuple:
    return cell["vocab"], cell["dtype"], cell["temperatures"]["simple"], cell["rows"]


def main(out: Path) -> None:
    runs = {side: [json.loads(p.read_text())["results"] for p in sorted(out.glob(f"{side}-*.json"))]
            for side in ("before", "after")}
    cells = runs["after"][0]
    for results in runs["before"] + runs["after"]:
        assert [cell_key(c) for c in results] == [cell_key(c) for c in cells], "runs differ"

    def mean(side: str, index: int, config: str) -> float:
        return sum(r[index]["us_per_row"][config] for r in runs[side]) / len(runs[side])

    print("| V | dtype | T | rows | floor | "
          + " | ".join(f"{n} before | {n} after" for n in CONFIGS.values()) + " |")
    print("|" + "---|" * (5 + 2 * len(CONFIGS)))
    worst = {side: {c: (0.0, "") for c in CONFIGS} for side in runs}
    speedups: dict[tuple, list[float]] = {}
    order = sorted(range(len(cells)), key=lambda i: ("fitted" not in cells[i]["rows"],
                                                    *cell_key(cells[i])[:1],
                                                    cells[i]["temperatures"]["simple"],
                                                    cells[i]["dtype"]))
    for i in order:
        vocab, dtype, temperature, rows = cell_key(cells[i])
        rows = "fitted" if "fitted" in rows else rows.split()[0]
        floor = (sum(r[i]["us_per_row"]["floor"] for r in runs["before"] + runs["after"])
                 / (len(runs["before"]) + len(runs["after"])))
        where = f"{rows}, {dtype}, V = {vocab:,}, T = {temperature}"
        parts = []
        for config in CONFIGS:
            before, after = mean("before", i, config), mean("after", i, config)
            for side, value in (("before", before), ("after", after)):
                worst[side][config] = max(worst[side][config], (value / floor, where))
            speedups.setdefault((rows, dtype, config), []).append(after / before)
            parts.append(f"{before:.0f} | {after:.0f} ({after / floor:.1f}x)")
        print(f"| {vocab:,} | {dtype} | {temperature} | {rows} | {floor:.1f} | "
              + " | ".join(parts) + " |")
    print("\n| config | worst before | worst after | cell (after) |\n|---|---|---|---|")
    for config, name in CONFIGS.items():
        print(f"| {name} | {worst['before'][config][0]:.1f}x | {worst['after'][config][0]:.1f}x "
              f"| {worst['after'][config][1]} |")
    print("\nGeometric mean of after / before:\n\n| rows, dtype | "
          + " | ".join(CONFIGS.values()) + " |\n|" + "---|" * (1 + len(CONFIGS)))
    for rows, dtype in sorted({(r, d) for r, d, _ in speedups}):
        print(f"| {rows} {dtype} | " + " | ".join(
            f"{math.exp(sum(map(math.log, speedups[rows, dtype, c])) / len(speedups[rows, dtype, c])):.2f}"
            for c in CONFIGS) + " |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
