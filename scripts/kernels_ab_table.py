"""The before/after table of scripts/kernels_ab.sh's output folder, in Markdown.

    python scripts/kernels_ab_table.py OUT_DIR

Per cell (V, dtype, T, rows, history tokens): each config's µs per row, the mean of the
rounds on each side, and after over the floor (the floor: the mean of every
run's, both sides, as both sides time the same numpy read) and, where both
sides have it, over the exp floor (each side's own: the kernels' row pass,
which the change may have moved; kernels built before it have none); then
each config's worst ratio to each floor on each side, and the geometric mean
of after / before by rows and dtype."""
import json
import math
import sys
from pathlib import Path

CONFIGS = {"simple_top_p": "top_p", "simple_min_p": "min_p", "simple": "simple",
           "simple_logprobs": "logprobs", "simple_top_logprobs": "top20",
           "simple_greedy": "greedy"}
SIDES = ("before", "after")


def cell_key(cell: dict) -> tuple:
    return (cell["vocab"], cell["dtype"], cell["temperatures"]["simple"], cell["rows"],
            cell.get("history_tokens", 256))


def load(out: Path) -> dict[str, list[list[dict]]]:
    """Each side's runs (their cells), checked to hold the same cells."""
    runs = {side: [json.loads(p.read_text())["results"] for p in sorted(out.glob(f"{side}-*.json"))]
            for side in SIDES}
    cells = runs["after"][0]
    for results in runs["before"] + runs["after"]:
        assert [cell_key(c) for c in results] == [cell_key(c) for c in cells], "runs differ"
    return runs


def mean(runs: dict, side: str, index: int, name: str) -> float | None:
    """The mean of `name`'s µs in cell `index` over a side's rounds; None where
    a run lacks it (the exp floor of kernels built before it)."""
    values = [r[index]["us_per_row"].get(name) for r in runs[side]]
    return None if None in values else sum(values) / len(values)


def read_floor(runs: dict, index: int) -> float:
    every = [r[index]["us_per_row"]["floor"] for r in runs["before"] + runs["after"]]
    return sum(every) / len(every)


def exp_floors(runs: dict, index: int) -> dict[str, float] | None:
    """Each side's exp floor in cell `index`, or None unless both sides have one."""
    floors = {side: mean(runs, side, index, "exp_floor") for side in SIDES}
    return None if None in floors.values() else floors


def main(out: Path) -> None:
    runs = load(out)
    cells = runs["after"][0]
    # the configs both sides timed (runs from before a config was added lack it)
    configs = {c: name for c, name in CONFIGS.items()
               if all(c in r[0]["us_per_row"] for side in SIDES for r in runs[side])}
    print("| V | dtype | T | history | rows | floor | exp floor before | exp floor after | "
          + " | ".join(f"{n} before | {n} after" for n in configs.values()) + " |")
    print("|" + "---|" * (8 + 2 * len(configs)))
    worst = {(side, floor): {c: (0.0, "") for c in configs}
             for side in SIDES for floor in ("floor", "exp_floor")}
    speedups: dict[tuple, list[float]] = {}
    order = sorted(range(len(cells)), key=lambda i: ("fitted" not in cells[i]["rows"],
                                                    *cell_key(cells[i])[:1],
                                                    cells[i]["temperatures"]["simple"],
                                                    cell_key(cells[i])[4], cells[i]["dtype"]))
    for i in order:
        vocab, dtype, temperature, rows, history = cell_key(cells[i])
        rows = "fitted" if "fitted" in rows else rows.split()[0]
        floor = read_floor(runs, i)
        exp_floor = exp_floors(runs, i)
        where = f"{rows}, {dtype}, V = {vocab:,}, T = {temperature}, history {history}"
        parts = []
        for config in configs:
            us = {side: mean(runs, side, i, config) for side in SIDES}
            for side in SIDES:
                worst[side, "floor"][config] = max(worst[side, "floor"][config],
                                                   (us[side] / floor, where))
                if exp_floor:
                    worst[side, "exp_floor"][config] = max(worst[side, "exp_floor"][config],
                                                           (us[side] / exp_floor[side], where))
            speedups.setdefault((rows, dtype, config), []).append(us["after"] / us["before"])
            over_exp = f", {us['after'] / exp_floor['after']:.1f}x exp" if exp_floor else ""
            parts.append(f"{us['before']:.0f} | {us['after']:.0f} "
                         f"({us['after'] / floor:.1f}x{over_exp})")
        exp_cells = (f"{exp_floor['before']:.1f} | {exp_floor['after']:.1f}" if exp_floor
                     else "n/a | n/a")
        print(f"| {vocab:,} | {dtype} | {temperature} | {history} | {rows} | {floor:.1f} | {exp_cells} | "
              + " | ".join(parts) + " |")
    print_worst(worst, configs)
    print("\nGeometric mean of after / before:\n\n| rows, dtype | "
          + " | ".join(configs.values()) + " |\n|" + "---|" * (1 + len(configs)))
    for rows, dtype in sorted({(r, d) for r, d, _ in speedups}):
        print(f"| {rows} {dtype} | " + " | ".join(
            f"{math.exp(sum(map(math.log, speedups[rows, dtype, c])) / len(speedups[rows, dtype, c])):.2f}"
            for c in configs) + " |")


def print_worst(worst: dict, configs: dict[str, str]) -> None:
    """Each config's worst ratio to the read floor and to the exp floor (n/a
    when no cell has both sides' exp floors), with the cell of each after."""
    def ratio(side: str, floor: str, config: str) -> str:
        value, where = worst[side, floor][config]
        return f"{value:.1f}x" if where else "n/a"

    print("\n| config | worst before | worst after | cell (after) "
          "| worst over exp floor before | worst over exp floor after | cell (after) |"
          "\n|---|---|---|---|---|---|---|")
    for config, name in configs.items():
        print(f"| {name} | {ratio('before', 'floor', config)} | {ratio('after', 'floor', config)} "
              f"| {worst['after', 'floor'][config][1]} "
              f"| {ratio('before', 'exp_floor', config)} | {ratio('after', 'exp_floor', config)} "
              f"| {worst['after', 'exp_floor'][config][1] or 'n/a'} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
