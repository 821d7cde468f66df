"""`bench row-transport --quick`: one small configuration through real
servers, every transport; the figures' shapes and the labels (slow: three
server starts)."""
import json

import pytest

from simple_sampler.cli import main
from simple_sampler.serving.simulated import LABEL

pytestmark = pytest.mark.slow


def test_bench_row_transport_quick_json(capsys):
    assert main(["bench", "row-transport", "--quick", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["data_plane"].startswith(LABEL) and "machine" in report
    rows = {r["transport"]: r for r in report["results"]}
    assert set(rows) == {"bls", "arena", "hot-first"}
    for r in rows.values():
        assert (r["vocab"], r["dtype"], r["batch"]) == (128_256, "float32", 8)
        assert r["samplers_us_per_token"] > 0 and r["llm_us_per_token"] > 0
        assert r["kernel_us_per_row"] > 0 and r["compact_kernel_us_per_row"] > 0
        assert abs(r["codec_us_per_row"]) < r["kernel_us_per_row"]  # ours, beside the kernel
        assert r["vs_kernel"] == pytest.approx(r["samplers_us_per_token"] / r["kernel_us_per_row"])
        # Triton's request count: at least one row each, at most the B streams' rows
        assert 1.0 <= r["rows_per_request"] <= 8
        assert r["samplers_us_per_request"] == pytest.approx(
            r["samplers_us_per_token"] * r["rows_per_request"] / r["rows_per_token"])
    row_bytes = 128_256 * 4
    assert rows["bls"]["bytes_per_row"] == rows["arena"]["bytes_per_row"] == row_bytes
    assert (rows["bls"]["copies_per_row"], rows["arena"]["copies_per_row"]) == (3, 0)
    assert rows["bls"]["rows_per_token"] == pytest.approx(1.0)
    hot = rows["hot-first"]
    # the undecided rows are read whole from the arena in the same request
    assert hot["rows_per_token"] == pytest.approx(1.0)
    assert hot["fallback_rate"] == pytest.approx(hot["in_place_per_token"])
    compact = hot["bytes_per_row"] - hot["fallback_rate"] * row_bytes
    assert 0 < compact < 0.03 * row_bytes  # |H| = 1,536 float32 + 256 cold ids, 8 B each
    assert hot["bytes_share"] < rows["arena"]["bytes_share"] == 1.0
