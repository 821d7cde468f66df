"""`bench serve-cost`: its plan and ratios without a server, and one quick run
through a real server with the floor model beside the project's models."""
import json
import tempfile

import pytest

from simple_sampler.bench import loop_profile
from simple_sampler.bench.serve_cost import measuring as serve_cost
from simple_sampler.bench.serve_cost.repository import build_repository
from simple_sampler.cli import main
from simple_sampler.serving.simulated import LABEL


def test_the_plan_puts_the_floor_beside_every_pace_and_batch():
    configs = serve_cost.plan(paces=["instant", "gpu"], batches=[64], intervals=[1, 4])
    assert [(c.pace, c.route, c.stream_interval) for c in configs] == [
        ("instant", "floor", 1), ("instant", "floor-llm", 1), ("instant", "ensemble", 1),
        ("instant", "ensemble", 4), ("instant", "llm", 1), ("gpu", "floor", 1),
        ("gpu", "floor-llm", 1), ("gpu", "ensemble", 1), ("gpu", "ensemble", 4),
        ("gpu", "llm", 1)]
    assert configs[0].bound() is None
    # 9 + 0.04 * 64 ms per step: 64 tokens per 11.56 ms
    assert configs[5].bound() == pytest.approx(64 / 11.56e-3)


def test_ratios_are_taken_against_the_floor_at_the_same_pace_and_batch():
    def row(route, triton, llm=0.0, floor=0.0, batch=8):
        cpu = {"tritonserver": triton, "llm": llm, "floor": floor, "preprocessing": 0.0,
               "samplers": 0.0, "client": 5.0}
        cpu["server"] = triton + llm + floor
        return {"pace": "instant", "batch": batch, "route": route, "cpu_us_per_token": cpu}

    rows = [row("floor", 70, floor=30), row("ensemble", 150, llm=150), row("llm", 100, llm=50, batch=16)]
    serve_cost.add_ratios(rows)
    assert rows[0]["vs_floor"] == 1.0 and rows[1]["vs_floor"] == 3.0
    assert rows[2]["vs_floor"] is None  # no floor at B = 16
    # an idle llm stub's tick in the floor's window is not the floor's streaming cost
    ticked = [row("floor", 70, llm=10, floor=30), row("ensemble", 150, llm=150)]
    serve_cost.add_ratios(ticked)
    assert ticked[0]["vs_floor"] == 1.0 and ticked[1]["vs_floor"] == 3.0
    # a floor whose window read no /proc tick has no ratio, rather than a division by 0
    idle = [row("floor", 0), row("ensemble", 150, llm=150)]
    serve_cost.add_ratios(idle)
    assert idle[1]["vs_floor"] is None and idle[1]["server_vs_floor"] is None
    # one floor per Python thread pool size: each row against its own server's
    pools = [row("floor", 70, floor=30), row("floor", 35, floor=15), row("ensemble", 150, llm=150)]
    for entry, pool in zip(pools, (32, 6, 6)):
        entry["python_thread_pool"] = pool
    serve_cost.add_ratios(pools)
    assert pools[2]["vs_floor"] == 6.0
    # and per decode-loop lanes and handoff: a server of its own each
    variants = [row("floor", 70, floor=30), row("floor", 35, floor=15),
                row("ensemble", 150, llm=150), row("ensemble", 150, llm=150)]
    for entry, (lanes, handoff) in zip(variants, [(2, "full"), (1, "hot-first"), (2, "full"),
                                                  (1, "hot-first")]):
        entry.update(micro_batches=lanes, handoff=handoff)
    serve_cost.add_ratios(variants)
    assert variants[2]["vs_floor"] == 3.0 and variants[3]["vs_floor"] == 6.0


def test_sampler_figures_are_per_request_and_per_step():
    before = {"requests": 10, "execute_cpu_us": 5_000}
    after = {"requests": 110, "execute_cpu_us": 105_000}
    # 100 requests for 64 x 100 tokens at 30 us a token, over 50 steps
    got = serve_cost.sampler_figures(before, after, 30.0, 6_400, 50)
    assert got == {"sampler_requests_per_step": 2.0,
                   "sampler_us_per_request": {"stubs": 1_920.0, "execute": 1_000.0}}
    assert serve_cost.sampler_figures(before, before, 30.0, 6_400, 50)[
        "sampler_us_per_request"] is None


def test_a_stream_interval_below_one_or_too_few_tokens_is_refused(capsys):
    assert main(["bench", "serve-cost", "--stream-interval", "0"]) == 2
    assert "stream interval < 1" in capsys.readouterr().err
    assert main(["bench", "serve-cost", "--stream-interval", "16", "--max-tokens", "64"]) == 2
    assert "--max-tokens must be at least 8 x the largest stream interval (128), got 64" in \
        capsys.readouterr().err


@pytest.mark.slow  # starts a server with the simulated engine: 20-60 s
def test_serve_cost_quick_through_a_real_server(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # its server's kept log goes there
    monkeypatch.setattr(tempfile, "tempdir", None)
    # the llm model's responses over three send threads (send_lanes), through real Triton
    assert main(["bench", "serve-cost", "--quick", "--json", "--send-threads", "3"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {r["send_threads"] for r in report["results"]} == {3}
    assert report["data_plane"].startswith(LABEL) and "floor model" in report["data_plane"]
    rows = {(r["route"], r["stream_interval"]): r for r in report["results"]}
    assert set(rows) == {("floor", 1), ("floor-llm", 1), ("ensemble", 1), ("ensemble", 4),
                         ("llm", 1)}
    floor, one, four = rows[("floor", 1)], rows[("ensemble", 1)], rows[("ensemble", 4)]
    # the floor routes are not charged to the llm stub (their own share of a quick
    # window may be under one 10 ms /proc tick: a cheap floor can read 0)
    shaped = rows[("floor-llm", 1)]["cpu_us_per_token"]
    assert shaped["llm"] < one["cpu_us_per_token"]["llm"]
    assert floor["cpu_us_per_token"]["llm"] < one["cpu_us_per_token"]["llm"]
    assert one["cpu_us_per_token"]["samplers"] > 0 and one["llm_loop_us_per_token"] > 0
    assert floor["llm_loop_us_per_token"] == 0  # the llm model served nothing
    assert floor["llm_ms_per_step"] == {"forward": None, "sampler": None, "forward_wait": None,
                                        "gc": None}
    assert one["llm_ms_per_step"]["gc"] >= 0  # the llm model's counter, read (not None)
    # the sampler instances' requests and their execute's CPU are counted (Triton's request
    # count and the llm's step count are read at slightly different moments: no ratio of 1)
    assert floor["sampler_requests_per_step"] is None and floor["sampler_us_per_request"] is None
    assert one["sampler_requests_per_step"] > 0
    assert one["sampler_us_per_request"]["execute"] > 0
    # instant pace: a forward is the engine's bookkeeping, the sampler a BLS round trip
    steps = one["llm_ms_per_step"]
    assert 0 <= steps["forward"] < steps["sampler"] and steps["forward_wait"] >= 0
    assert one["tokens_per_response"] == pytest.approx(1.0)
    assert 3.0 <= four["tokens_per_response"] <= 4.0
    # the floor's own ratio is 1, or none where its quick window read no /proc tick
    streaming = floor["cpu_us_per_token"]["floor"] + floor["cpu_us_per_token"]["tritonserver"]
    assert floor["vs_floor"] == (pytest.approx(1.0) if streaming else None)
    assert one["vs_floor"] is None if not streaming else one["vs_floor"] > 0
    assert one["python_thread_pool"] == report["settings"]["python_thread_pools"][0]


def test_the_llm_model_gets_the_shard_minimum_asked_for(tmp_path):
    repository = build_repository(tmp_path / "repository", "instant", 16, 2, 2,
                                             151_936, "bfloat16", shard_min_rows=3)
    config = (repository / "llm" / "config.pbtxt").read_text()
    assert 'key: "sampler_shard_min_rows"\n  value: { string_value: "3" }' in config


def test_a_hot_first_server_hands_compact_rows_to_a_sampler_with_the_hot_set(tmp_path):
    repository = build_repository(tmp_path / "repository", "gpu", 64, 2, 1,
                                             151_936, "bfloat16", handoff="hot-first")
    llm = (repository / "llm" / "config.pbtxt").read_text()
    sampler = (repository / "simple_sampler" / "config.pbtxt").read_text()
    assert 'key: "handoff"\n  value: { string_value: "hot-first" }' in llm
    assert 'key: "micro_batches"\n  value: { string_value: "1" }' in llm
    # the simulated engine's vocabulary gets the hot set mapped onto it (launch.serve)
    profile = 'key: "hot_vocab_profile"\n  value: { string_value: "hot_vocab_simulated.npz" }'
    assert profile in llm and profile in sampler
    assert (repository / "simple_sampler" / "hot_vocab_simulated.npz").is_file()
    full = build_repository(tmp_path / "full", "gpu", 64, 2, 2, 151_936, "bfloat16")
    assert 'string_value: "hot-first"' not in (full / "llm" / "config.pbtxt").read_text()


def test_the_llm_model_gets_the_send_threads_asked_for(tmp_path):
    repository = build_repository(tmp_path / "repository", "gpu", 64, 2, 1, 151_936,
                                  "bfloat16", send_threads=3)
    config = (repository / "llm" / "config.pbtxt").read_text()
    assert 'key: "send_threads"\n  value: { string_value: "3" }' in config


def test_the_decode_loops_profile_reads_as_calls_per_token(tmp_path):
    """Counts, not times: a function called once per token reads 1.0."""
    import cProfile

    def per_token(token):
        return [token].append(token)

    profile = cProfile.Profile()
    profile.enable()
    for token in range(40):
        per_token(token)
    profile.disable()
    profile.dump_stats(tmp_path / "llm-1.prof")
    calls = loop_profile.profile_calls(tmp_path / "llm-1.prof", tokens=40, server="instant")
    top = dict(calls["top"])
    assert top[f"test_serve_cost.py:{per_token.__code__.co_firstlineno}(per_token)"] == 1.0
    assert top["{method 'append' of 'list' objects}"] == 1.0
    assert calls["calls_per_token"] >= 2.0
    assert "decode-loop calls per token (instant, 40 tokens" in loop_profile.format_profile(calls)
    assert serve_cost.llm_tokens([serve_cost.Config("instant", 4, "floor"),
                                  serve_cost.Config("instant", 4, "llm")], 10) == 48
