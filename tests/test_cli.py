"""`simple-sampler bench kernels --json` prints the documented JSON object."""
import json

import pytest

from simple_sampler.cli import main


@pytest.mark.slow
def test_bench_kernels_json(capsys):
    assert main(["bench", "kernels", "--json", "--vocab", "49152", "4096", "--batch", "4",
                 "--repeats", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["machine"]["cores"] >= 1 and report["machine"]["date"]
    results = report["results"]
    assert [(r["vocab"], r["dtype"]) for r in results] == [
        (49152, "float32"), (49152, "bfloat16"), (4096, "float32"), (4096, "bfloat16")]
    assert results[0]["rows"] == "smollm2" and results[2]["rows"].startswith("synthetic")
    for r in results:
        assert r["batch"] == 4
        us = r["us_per_row"]
        assert set(us) >= {"simple", "simple_top_p", "simple_greedy", "torch_sort", "floor"}
        assert all(value > 0 for value in us.values())
        assert r["ratios"]["simple_over_floor"] == pytest.approx(us["simple"] / us["floor"], rel=0.02)


def test_bench_requires_a_target():
    with pytest.raises(SystemExit):
        main(["bench"])
