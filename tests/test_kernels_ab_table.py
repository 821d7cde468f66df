"""scripts/kernels_ab_table.py: the before/after table of scripts/kernels_ab.sh
shows each config's ratio to the read floor and, where both sides have one,
to each side's own exp floor."""
import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "kernels_ab_table.py"
CONFIGS = ("simple_top_p", "simple_min_p", "simple", "simple_logprobs", "simple_greedy")


def table_module():
    spec = importlib.util.spec_from_file_location("kernels_ab_table_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cell(rows: str, us: float, floor: float, exp_floor: float | None) -> dict:
    us_per_row = {config: us for config in CONFIGS} | {"floor": floor}
    if exp_floor is not None:
        us_per_row["exp_floor"] = exp_floor
    return {"vocab": 151936, "dtype": "bfloat16", "temperatures": {"simple": 1.0},
            "rows": rows, "us_per_row": us_per_row}


def write_runs(out: Path, before_exp: float | None) -> None:
    """One round a side, two cells: flat rows at 80 µs a config (read floor
    10, exp floor 40 after), fitted rows at 60 µs (read floor 20)."""
    for side, us, exp_floor in (("before", 100.0, before_exp), ("after", 80.0, 40.0)):
        results = [cell("flat N(0, 0.02)", us, 10.0, exp_floor),
                   cell("fitted (model rows)", us * 0.75, 20.0, exp_floor)]
        (out / f"{side}-1.json").write_text(json.dumps({"results": results}))


def test_each_config_shows_its_ratio_to_both_floors(tmp_path, capsys):
    write_runs(tmp_path, before_exp=50.0)
    table_module().main(tmp_path)
    lines = capsys.readouterr().out.splitlines()
    flat = next(line for line in lines if "| flat |" in line)
    assert "| 50.0 | 40.0 |" in flat                   # each side's exp floor
    assert flat.count("100 | 80 (8.0x, 2.0x exp)") == len(CONFIGS)
    top_p = next(line for line in lines if line.startswith("| top_p |"))
    # worst over the read floor: flat (100 / 10, 80 / 10); over the exp floor: flat, 2.0 each
    assert top_p.split(" | ")[1:3] == ["10.0x", "8.0x"]
    assert top_p.split(" | ")[4:6] == ["2.0x", "2.0x"]


def test_a_side_without_the_exp_floor_leaves_its_ratios_out(tmp_path, capsys):
    write_runs(tmp_path, before_exp=None)
    table_module().main(tmp_path)
    lines = capsys.readouterr().out.splitlines()
    flat = next(line for line in lines if "| flat |" in line)
    assert "| n/a | n/a |" in flat and "exp)" not in flat
    assert flat.count("100 | 80 (8.0x)") == len(CONFIGS)
    top_p = next(line for line in lines if line.startswith("| top_p |"))
    assert top_p.split(" | ")[4:7] == ["n/a", "n/a", "n/a |"]
