"""Both row transports through real servers (docs/COPIES.md), on the three
servers of one `bench row-transport --quick` run (bls, arena, hot-first: the
simulated engine's float32 rows, V = 128,256, two sampler instances).

Each server, once ready and before the bench loads it, answers the same
seeded requests one at a time, so every server steps the same bank rows in
the same order: the arena and BLS give the same tokens (penalized rows'
histories named in the arena, and sent in the request), hot-first the same
greedy tokens. The arena's regions exist while its server runs and are gone
after it stops. The bench's JSON: the figures' shapes and the labels."""
import contextlib
import io
import json
import os
import re
import time

import pytest

from simple_sampler.cli import main
from simple_sampler.client import GenerateClient
from simple_sampler.launch import server as server_module
from simple_sampler.launch.processes import list_stubs
from simple_sampler.row_arena import PREFIX, SHM_DIR
from simple_sampler.serving.simulated import LABEL
from simple_sampler.triton.counters import read_counter, wait_for_counter

pytestmark = pytest.mark.slow
SEEDS = (7, 8, 9, 10)
PARAMS = ({"temperature": 0.0}, {"temperature": 1.0, "top_p": 1.0},
          {"temperature": 0.8, "top_p": 0.9},
          {"temperature": 1.0, "top_k": 50, "repetition_penalty": 1.2})


def regions(owners=None) -> set[str]:
    """The row regions in /dev/shm; of `owners` (pids) only when given: other
    servers on the machine (other jobs) make and unlink regions of their own."""
    found = {name for name in os.listdir(SHM_DIR) if name.startswith(PREFIX)}
    if owners is None:
        return found
    return {name for name in found if any(f"-{pid}-" in name for pid in owners)}


def llm_parameter(repository, key: str) -> str:
    config = (repository / "llm" / "config.pbtxt").read_text()
    return re.search(rf'key: "{key}"\n\s*value: {{ string_value: "([^"]*)" }}', config).group(1)


def seeded_answers(server) -> list:
    client = GenerateClient(server.grpc_url, "grpc")
    answers = []
    for params in PARAMS:
        for seed in SEEDS:
            answer = client.generate("Tell me about the sea.", seed=seed, max_tokens=6,
                                     min_length=6, return_log_probs=True,
                                     exclude_input_in_output=True, **params)
            answers.append((answer.token_ids, answer.logprobs))
    return answers


def history_ref_rows(server) -> float:
    """Rows the sampler instances read histories for by reference, once
    every row of the answers so far is counted (counts come in batches)."""
    wait_for_counter(server.metrics_url, "simple_sampler_rows_total", lambda rows: rows > 0,
                     settled_after=time.monotonic())
    return read_counter(server.metrics_url, "simple_sampler_history_ref_rows_total")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`bench row-transport --quick --json` once, each of its servers
    answering `seeded_answers` first: {transport: {answers, during, after,
    log}} and the bench's report under "report"."""
    logs = tmp_path_factory.mktemp("row-transport-logs")
    seen = {}

    class Answering(server_module.TritonServer):
        def __post_init__(self):
            super().__post_init__()
            self.log_path = self.log_path or logs / f"server-{len(seen)}.log"

        def start(self, *args, **kwargs):
            super().start(*args, **kwargs)
            transport = llm_parameter(self.repository, "row_transport")
            if llm_parameter(self.repository, "handoff") == "hot-first":
                transport = "hot-first"
            owners = [stub.pid for stub in list_stubs(self.process.pid) if stub.model == "llm"]
            self.seen = seen[transport] = {"owners": owners, "during": regions(owners),
                                           "answers": seeded_answers(self),
                                           "named": history_ref_rows(self)}
            return self

        def stop(self, *args, **kwargs):
            status = super().stop(*args, **kwargs)
            if hasattr(self, "seen"):
                self.seen.update(after=regions(self.seen["owners"]),
                                 log=self.log_path.read_text())
            return status

    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out):
        # the bench imports TritonServer when it starts each server
        patch.setattr(server_module, "TritonServer", Answering)
        assert main(["bench", "row-transport", "--quick", "--json"]) == 0
    assert set(seen) == {"bls", "arena", "hot-first"}, "the bench's servers were not ours"
    return {**seen, "report": json.loads(out.getvalue())}


def test_arena_and_bls_give_the_same_seeded_tokens_and_the_arena_leaves_nothing(served):
    arena, bls = served["arena"], served["bls"]
    assert "through the shared-memory arena" in arena["log"]
    assert len(arena["during"]) == 3, "the ring, the engine's shared bank, the token histories"
    # the penalized requests' histories named in the arena, not sent; over BLS, sent
    assert arena["named"] > 0 and served["hot-first"]["named"] > 0 and bls["named"] == 0
    assert "shared-memory arena" not in bls["log"] and not bls["during"]
    for transport in ("arena", "bls", "hot-first"):
        assert served[transport]["after"] == set(), f"{transport}: a region outlived the server"
    assert all(len(tokens) == 6 for tokens, _ in arena["answers"])
    assert len({tuple(tokens) for tokens, _ in arena["answers"]}) > len(arena["answers"]) // 2
    assert arena["answers"] == bls["answers"]


def test_hot_first_rows_run_end_to_end_on_the_simulated_engine(served):
    """serve --engine simulated --handoff hot-first: compact rows from the
    engine's summary, the rest whole from the arena. Greedy rows are decided
    exactly as on full rows (the same argmax); sampled rows follow the same
    distribution by another draw order, so only their count is checked."""
    full, hot = served["arena"]["answers"], served["hot-first"]["answers"]
    assert "rows cross to the sampler hot-first" in served["hot-first"]["log"]
    greedy = len(SEEDS)
    assert [tokens for tokens, _ in hot[:greedy]] == [tokens for tokens, _ in full[:greedy]]
    assert all(len(tokens) == 6 for tokens, _ in hot)


def test_bench_row_transport_quick_json(served):
    report = served["report"]
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
