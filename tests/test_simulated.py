"""The simulated data plane (serving/simulated.py) and `bench serve-sim`:
the engine keeps the engine protocol, returns bank views (no copy) that vary
per sequence and step, sleeps its modelled step time, is never the default
and says "simulated" wherever it shows up."""
import asyncio
import json
import time

import numpy as np
import pytest
import torch

from simple_sampler.cli import build_parser, main
from simple_sampler.params import SamplingParams
from simple_sampler.rows import (HOT_ROWS_SOURCE, SYNTHETIC_SOURCE_ROWS, map_hot_ids, real_rows,
                                  synthetic_hot_rows, synthetic_rows)
from simple_sampler.serving.decoder import Decoder
from simple_sampler.serving.samplers import threaded
from simple_sampler.serving.generation import GenerationRequest
from simple_sampler.serving.simulated import BANK_OFFSETS, LABEL, SimulatedEngine, SimulatedSpec
from simple_sampler.serving.simulated_text import SimulatedCodec
from simple_sampler.settings import LlmSettings, SamplerSettings
from simple_sampler.shvs.hot_vocab import load_profile
from simple_sampler.launch.install import project_file
from simple_sampler.launch.serve import assemble_repository

VOCAB = 128_256
FAST = SimulatedSpec(vocab=VOCAB, dtype="float32", step_a_ms=0.0, step_b_ms=0.0)


@pytest.fixture(scope="module")
def codec():
    return SimulatedCodec.from_source(None)


def bank_rows(max_batch_size: int) -> np.ndarray:
    """The rows a fresh engine's bank holds (seed 0)."""
    return synthetic_hot_rows(real_rows(SYNTHETIC_SOURCE_ROWS), VOCAB, 0,
                              n=max_batch_size + BANK_OFFSETS)


@pytest.fixture(scope="module")
def engine_rows():
    return bank_rows(4)


def test_spec_takes_its_defaults_and_ranges_from_the_settings():
    spec = SimulatedSpec()
    assert (spec.vocab, spec.dtype, spec.step_a_ms, spec.step_b_ms) == (
        LlmSettings.sim_vocab, LlmSettings.sim_dtype, LlmSettings.sim_step_a_ms,
        LlmSettings.sim_step_b_ms) == (151_936, "bfloat16", 9.0, 0.04)
    assert spec.step_ms(256) == pytest.approx(19.24)
    settings = LlmSettings(engine="simulated", sim_vocab=128_256, sim_dtype="float32",
                           sim_step_a_ms=5.0, sim_step_b_ms=0.5)
    assert SimulatedSpec.from_settings(settings) == SimulatedSpec(128_256, "float32", 5.0, 0.5)
    assert SimulatedSpec.from_settings(settings).describe().startswith(LABEL)
    with pytest.raises(ValueError, match="sim_vocab must be one of 49152, 128256, 151936"):
        SimulatedSpec(vocab=1000)
    with pytest.raises(ValueError, match="sim_dtype must be one of float32, bfloat16"):
        SimulatedSpec(dtype="fp8")
    with pytest.raises(ValueError, match="sim_step_b_ms must be >= 0.0, got -1"):
        SimulatedSpec(step_b_ms=-1.0)


def test_steps_return_bank_views_that_vary_per_sequence_and_step(engine_rows):
    engine = SimulatedEngine(FAST, max_batch_size=4, max_context=64)
    ids = ["a", "b", "c", "d"]
    for key in ids:
        engine.add(key, [1, 2, 3])
    seen = []
    for step in range(3):
        logits = engine.step(ids)
        assert logits.shape == (4, VOCAB) and logits.dtype == torch.float32
        # A view of the bank: no B x V copy per step.
        assert logits.untyped_storage().data_ptr() == engine.bank.untyped_storage().data_ptr()
        offset = (logits.data_ptr() - engine.bank.data_ptr()) // (VOCAB * 4)
        assert torch.equal(logits, torch.from_numpy(engine_rows[offset:offset + 4]))
        assert len({row.numpy().tobytes() for row in logits}) == 4  # rows differ across sequences
        seen.append(offset)
        engine.append(ids, [step] * 4)
        assert [engine.length(key) for key in ids] == [4 + step] * 4
    assert len(set(seen)) == 3  # and across steps


def test_bfloat16_rows_are_the_float32_rows_rounded():
    engine = SimulatedEngine(SimulatedSpec(vocab=VOCAB, step_a_ms=0.0, step_b_ms=0.0),
                             max_batch_size=2, max_context=8)
    engine.add(0, [5])
    logits = engine.step([0])
    assert logits.dtype == torch.bfloat16
    expected = torch.from_numpy(bank_rows(2)[:1])
    assert torch.equal(logits, expected.to(torch.bfloat16))


def test_the_calibrated_hot_set_covers_a_bank_row_as_it_covers_a_real_row(engine_rows):
    """The shipped SmolLM2 profile's hot set, mapped into V, holds about the
    share of a bank row's probability mass (temperature 1) that it holds of
    the real row the bank row was made from, and far more than of an
    afresh-permuted synthetic row, where it is chance (|H| / V)."""
    profile = load_profile(project_file("model_repository/simple_sampler/hot_vocab.npz"))
    order = profile.order[:profile.chosen_size]
    assert "real token ids kept" in HOT_ROWS_SOURCE in FAST.describe()

    def hot_mass(rows, ids):
        rows = rows.astype(np.float64)
        weights = np.exp(rows - rows.max(axis=1, keepdims=True))
        return weights[:, ids].sum(axis=1) / weights.sum(axis=1)

    bank = hot_mass(engine_rows, map_hot_ids(order, VOCAB))
    real = hot_mass(real_rows(SYNTHETIC_SOURCE_ROWS), order)
    permuted = hot_mass(synthetic_rows(VOCAB, len(engine_rows), 0), map_hot_ids(order, VOCAB))
    source = np.arange(len(engine_rows)) % SYNTHETIC_SOURCE_ROWS
    # The tail stretched over the added ids takes some mass from the hot set,
    # never much of it (measured: at most 0.06 of a row, 0.01 on average).
    np.testing.assert_allclose(bank, real[source], atol=0.1)
    assert abs(bank.mean() - real[source].mean()) < 0.03
    assert bank.mean() > 0.5  # the profile's held-out rows: 0.86 at its chosen size
    # Chance: |H| / V = 0.01 expected (a peaked row is all in or all out).
    assert permuted.mean() < 0.05
    assert bank.mean() > 10 * permuted.mean()


def test_step_sleeps_its_modelled_time():
    engine = SimulatedEngine(SimulatedSpec(vocab=VOCAB, dtype="float32", step_a_ms=20.0,
                                           step_b_ms=5.0), max_batch_size=2, max_context=8)
    engine.add("x", [1])
    engine.add("y", [2])
    started = time.perf_counter()
    engine.step(["x", "y"])
    assert time.perf_counter() - started >= 0.030  # t(2) = 20 + 5 * 2 ms, a lower bound


def test_step_then_models_the_work_behind_the_forward_as_device_time():
    """``step_then``: the rows' follow-up work (the hot-first summary) runs
    on this CPU while the forward is modelled, so the step takes t(B) plus
    the follow-up's modelled device time, not t(B) plus the emulation's own
    time; the engine-protocol helper gives every other engine the plain
    sequence."""
    from simple_sampler.serving.engine import step_then
    from simple_sampler.serving.simulated import HBM_BYTES_PER_S, SUMMARY_READS

    engine = SimulatedEngine(SimulatedSpec(vocab=VOCAB, dtype="float32", step_a_ms=150.0,
                                           step_b_ms=0.0), max_batch_size=2, max_context=8)
    engine.add("x", [1])
    engine.add("y", [2])
    hot = np.arange(0, VOCAB, 97)

    # 120 ms of CPU inside a 150 ms forward: overlapped, it begins before the
    # modelled forward ends (run after it, it would begin at 150 ms). Asserted
    # on when it began, not on the step's total, which a loaded machine's
    # scheduling stretches (a CI run saw 273 ms against a 270 ms bound).
    ran = []

    def emulate(rows):
        ran.append(time.perf_counter())
        deadline = ran[0] + 0.120
        while time.perf_counter() < deadline:
            pass
        return engine.hot_first_summary(rows, hot, np.zeros(3, np.int64), np.zeros(0, np.int64),
                                        np.ones(2), 0)

    started = time.perf_counter()
    rows, summary = step_then(engine, ["x", "y"], emulate)
    took = time.perf_counter() - started
    device_s = SUMMARY_READS * rows.numel() * rows.element_size() / HBM_BYTES_PER_S
    assert ran[0] - started < 0.150  # begun while the forward was modelled
    assert took >= 0.150 + device_s  # the forward's time, then the follow-up's device time
    assert summary.hot_logits.shape == (2, hot.size)
    np.testing.assert_array_equal(np.asarray(summary.hot_logits), rows[:, hot].numpy())
    assert engine.queued.device_s is None  # no step is modelling any more

    class Plain:  # an engine without step_then: the step, then the work
        calls = []

        def step(self, seq_ids):
            self.calls.append("step")
            return torch.zeros(len(seq_ids), 4)

    plain = Plain()
    rows, after = step_then(plain, [1, 2], lambda rows: plain.calls.append("then") or rows.shape)
    assert plain.calls == ["step", "then"] and after == (2, 4)


def test_a_sequence_stops_taking_tokens_at_max_context():
    # The rest of the protocol's errors: test_engine_contract.py.
    engine = SimulatedEngine(FAST, max_batch_size=1, max_context=4)
    engine.add("x", [1, 2])
    while engine.length("x") < 4:
        engine.step(["x"])
        engine.append(["x"], [1])
    engine.step(["x"])
    with pytest.raises(ValueError, match="at max_context=4"):
        engine.append(["x"], [1])


def test_codec_decodes_known_ids_with_the_tokenizer_and_the_rest_as_ids(codec):
    tokenizer = codec.tokenizer
    hello = tokenizer("Hello world", add_special_tokens=False)["input_ids"]
    assert codec.known == len(tokenizer) < VOCAB
    assert codec.encode("Hello world") == hello
    assert codec.decode(hello) == "Hello world"
    assert codec.decode([*hello, 100_000, 128_000, *hello]) == \
        "Hello world t100000 t128000" + tokenizer.decode(hello)


def test_streamed_text_is_the_one_shot_decode(codec):
    """Random ids (known and past the vocabulary, a multi-byte character
    cut by an unknown id among them) streamed one to three at a time give
    decode()'s text."""
    assert codec.backend is not None  # SmolLM2's tokenizer: the DecodeStream path
    rng = np.random.default_rng(0)
    emoji = codec.tokenizer("🦊 ü", add_special_tokens=False)["input_ids"]
    for trial in range(40):
        ids = rng.integers(0, VOCAB if trial % 2 else codec.known, 30).tolist()
        ids[5:5] = emoji[:1] + [codec.known + 7] + emoji  # a character cut by an unknown id
        chunk = 1 + trial % 3
        detokenizer, each = codec.detokenizer([1, 2, 3]), codec.detokenizer([1, 2, 3])
        deltas = [detokenizer.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
        # push of a chunk is push_token of each of its ids in turn
        assert deltas == ["".join(map(each.push_token, ids[i:i + chunk]))
                          for i in range(0, len(ids), chunk)]
        assert "".join(deltas) + detokenizer.flush() == codec.decode(ids)


def test_decoder_streams_text_of_the_simulated_codec(codec):
    async def generate():
        engine = SimulatedEngine(FAST, max_batch_size=4, max_context=64)
        decoder = Decoder(engine, codec, "simple", threaded(), micro_batches=2)
        await decoder.start()
        try:
            handles = [decoder.submit(GenerationRequest(text=f"Question {i}?", chat=True,
                                                        max_tokens=12, ignore_end=True,
                                                        sampling=SamplingParams(seed=i)))
                       for i in range(3)]
            answers = []
            for handle in handles:
                answers.append([event async for event in handle])
            return answers
        finally:
            await decoder.close()

    for events in asyncio.run(generate()):
        ids = [t for event in events for t in event.token_ids]
        assert len(ids) == 12 and events[-1].finish_reason == "length"
        text = "".join(event.text for event in events)
        beyond = [f" t{t}" for t in ids if t >= codec.known]
        assert beyond
        at = 0
        for piece in beyond:  # each in the text, in the order generated (ids may repeat)
            at = text.index(piece, at) + len(piece)


def test_never_the_default_and_served_with_its_own_settings(tmp_path):
    args = build_parser().parse_args(["serve"])
    assert LlmSettings.from_arguments(args).engine == LlmSettings().engine == "torch"
    args = build_parser().parse_args(["serve", "--engine", "simulated", "--sim-vocab", "128256",
                                      "--sim-dtype", "float32", "--sim-step-a-ms", "3"])
    settings = LlmSettings.from_arguments(args)
    assert SimulatedSpec.from_settings(settings) == SimulatedSpec(128_256, "float32", 3.0,
                                                                  LlmSettings.sim_step_b_ms)
    # The llm model reads them back from its config.pbtxt.
    repository = assemble_repository(tmp_path, SamplerSettings(), settings)
    text = (repository / "llm" / "config.pbtxt").read_text()
    assert 'key: "sim_vocab"\n  value: { string_value: "128256" }' in text
    with pytest.raises(ValueError, match="tensorrt_llm only"):
        LlmSettings(engine="simulated", tensor_parallel_size=2).validate()


def test_serve_rejects_a_logits_dtype_other_than_the_engines(capsys):
    assert main(["serve", "--engine", "simulated", "--sim-dtype", "bfloat16",
                 "--logits-dtype", "fp32"]) == 2
    assert "differs from the simulated engine's logits (bf16)" in capsys.readouterr().err


@pytest.mark.parametrize("shvs, top_p", [(False, 1.0), (True, 1.0), (True, 0.9)])
def test_bench_serve_sim_quick_json(capsys, shvs, top_p):
    assert main(["bench", "serve-sim", "--quick", "--json", "--vocab", "128256",
                 "--dtype", "float32", "--step-ms", "10", "--top-p", str(top_p),
                 *(["--shvs"] if shvs else [])]) == 0
    report = json.loads(capsys.readouterr().out)
    assert ("no truncation" in report["settings"]["params"]) == (top_p == 1.0)
    assert report["settings"]["rows"] == HOT_ROWS_SOURCE
    assert (report["settings"]["hot_set"] is not None) == shvs
    assert report["data_plane"].startswith(LABEL) and "machine" in report
    rows = report["results"]
    assert {(r["mode"], r["micro_batches"]) for r in rows} == {
        ("simple", 1), ("simple", 2), ("inline_kernels", 1)}
    assert {r["batch"] for r in rows} == {8, 16}
    for r in rows:
        assert (r["vocab"], r["dtype"], r["step_ms"], r["top_p"]) == (VOCAB, "float32", 10.0,
                                                                      top_p)
        assert r["ideal_tokens_per_s"] == pytest.approx(r["batch"] / 0.010)
        assert r["efficiency"] == pytest.approx(r["tokens_per_s"] / r["ideal_tokens_per_s"])
        # A pass over B rows sleeps at least step_ms on the one data-plane thread.
        assert 0 < r["efficiency"] <= 1
        assert 0 <= r["exposed_sampling_ms_per_step"] <= r["sampler_ms_per_step"] + 1e-9
        assert r["loop_ms_per_step"] > 0 and r["loop_thread_cpu_ms_per_step"] > 0
        assert r["itl_ms_p95"] >= r["itl_ms_p50"] >= 0
        assert np.isfinite(list(v for v in r.values() if isinstance(v, float))).all()
        assert r["shvs"] == shvs
        if shvs and top_p == 1.0:
            # temperature 1, no truncation: SHVS tries every row, and the hot
            # set decides about the share of the mass it holds (0.6 on the
            # bank; chance, |H| / V, would be 0.01).
            assert 0.3 < r["shvs_acceptance"] < 0.95
        elif shvs:
            # top_p 0.9: decided whenever the hot set holds the nucleus (the
            # profile measured 1.0 on held-out SmolLM2 rows at this |H|).
            assert r["shvs_acceptance"] > 0.9
        else:
            assert r["shvs_acceptance"] is None


def test_bench_serve_sim_shvs_and_top_p_are_in_process_only_and_checked(capsys):
    assert main(["bench", "serve-sim", "--server", "--shvs"]) == 2
    assert "in-process only" in capsys.readouterr().err
    assert main(["bench", "serve-sim", "--server", "--top-p", "0.9"]) == 2
    assert "in-process only" in capsys.readouterr().err
    assert main(["bench", "serve-sim", "--top-p", "0"]) == 2
    assert "top_p must be in (0, 1], got 0.0" in capsys.readouterr().err


@pytest.mark.slow  # starts a server: about 30 s
def test_bench_serve_sim_through_a_real_server():
    from simple_sampler.bench.serve_sim import measuring as serve_sim

    report = serve_sim.run_server(batches=[8], vocab=VOCAB, dtype="bfloat16", step_ms=10.0,
                                  max_tokens=8, modes=[("simple", "simple", 2)])
    assert report["data_plane"].startswith(LABEL) and "Triton server" in report["data_plane"]
    (row,) = report["results"]
    assert (row["mode"], row["micro_batches"], row["batch"], row["dtype"]) == \
        ("simple", 2, 8, "bfloat16")
    # Every token passed a real sampler instance (bfloat16 rows over BLS) and a 10 ms pass.
    assert 0 < row["efficiency"] <= 1 and row["sampler_ms_per_step"] > 0
    assert row["loop_ms_per_step"] is None  # the server does not export it


def test_the_engines_hot_first_summary_is_the_handoffs_on_its_rows(tmp_path):
    """The summary the simulated engine hands out as part of its modelled step
    (prepared per bank row, rows with touched ids or another temperature
    summarized on the spot) equals ``hot_first_summary`` of the same rows."""
    from simple_sampler.serving.hot_first import hot_first_summary
    from simple_sampler.launch.serve import MAPPED_PROFILE
    from simple_sampler.serving.simulated import simulated_profile

    engine = SimulatedEngine(SimulatedSpec(VOCAB, "bfloat16", 0.0, 0.0), max_batch_size=8)
    profile = load_profile(project_file("model_repository/simple_sampler/hot_vocab.npz"))
    hot = simulated_profile(profile, VOCAB).hot_vocab(256).kernel_arrays()[0]
    engine.prepare_hot_first(hot, 16)
    for seq in range(8):
        engine.add(seq, [1, 2, 3])
    engine.step(list(range(8)))
    engine.append(list(range(8)), [0] * 8)
    logits = engine.step(list(range(8)))  # a run of bank rows past the first offset
    untouched = hot_first_summary(logits, hot, np.zeros(9, np.int64), np.zeros(0, np.int64),
                                  np.ones(8), 16).cpu()
    # Row 1 has touched ids (its mass adjusted), row 3 its cold argmax among
    # them (summarized on its own), row 2 another temperature, row 4 is greedy.
    offsets = np.array([0, 0, 2, 2, 3, 3, 3, 3, 3])
    ids = np.r_[np.setdiff1d(np.arange(5), hot)[:2], untouched.cold_argmax[3]]
    temperature = np.array([1.0, 1.0, 0.7, 1.0, 0.0, 1.0, 1.0, 1.0])
    # and each row with its own cold_top (hot_first.row_cold_tops): 16 or none
    tops = np.array([16, 0, 0, 16, 0, 16, 0, 16])
    for cold_top in (16, tops):
        got = engine.hot_first_summary(logits, hot, offsets, ids, temperature, cold_top)
        want = hot_first_summary(logits, hot, offsets, ids, temperature, cold_top).cpu()
        for name in want.__dict__:
            if name == "cold_mass":  # row 1's: a float64 difference, within float32 rounding
                np.testing.assert_allclose(got.cold_mass, want.cold_mass, rtol=1e-6)
            else:
                np.testing.assert_array_equal(np.asarray(getattr(got, name)),
                                              np.asarray(getattr(want, name)), err_msg=name)
    assert (np.diff(want.touched_offsets) - np.diff(offsets) == tops).all()
    # The simulated repository's sampler and handoff get the profile mapped to these ids.
    settings = LlmSettings(engine="simulated", sim_vocab=VOCAB, handoff="hot-first",
                           hot_vocab_profile="hot_vocab.npz")
    repository = assemble_repository(tmp_path, SamplerSettings(hot_vocab_profile="hot_vocab.npz"),
                                     settings)
    mapped = load_profile(repository / "simple_sampler" / MAPPED_PROFILE)
    assert mapped.vocab_size == VOCAB
    np.testing.assert_array_equal(mapped.order, map_hot_ids(profile.order, VOCAB))
    for model in ("simple_sampler", "llm"):
        assert f'string_value: "{MAPPED_PROFILE}"' in (repository / model / "config.pbtxt").read_text()


def test_the_engines_cold_draw_picks_the_whole_rows_token():
    """The block walk over the prepared rows (``_ColdBlocks``, touched ids
    taken out) picks the token ``hot_first_summary``'s cumulative sum over
    the whole row picks, but for the float32 exps' rounding (torch's and
    numpy's may differ in the last bit). The rows that draw hand over no
    cold ids (``hot_first.row_cold_tops``); a row with cold ids and a draw
    is summarized in torch, exactly."""
    from simple_sampler.serving.hot_first import hot_first_summary
    from simple_sampler.serving.simulated import simulated_profile

    engine = SimulatedEngine(SimulatedSpec(VOCAB, "bfloat16", 0.0, 0.0), max_batch_size=32)
    profile = load_profile(project_file("model_repository/simple_sampler/hot_vocab.npz"))
    hot = simulated_profile(profile, VOCAB).hot_vocab(256).kernel_arrays()[0]
    engine.prepare_hot_first(hot, 16)
    logits = engine.bank[3:35]
    rng = np.random.default_rng(8)
    # every row touches one id (an end id before min_length), row 5 a second
    touched = np.setdiff1d(np.arange(64), hot)
    offsets = np.r_[0, np.arange(1, 33) + (np.arange(1, 33) > 5)]
    ids = np.insert(np.full(32, touched[0]), 6, touched[1])
    agree = total = 0
    for _ in range(16):
        draws = rng.random(32)
        draws[rng.random(32) < 0.2] = np.nan
        got = engine.hot_first_summary(logits, hot, offsets, ids, np.ones(32), 0, draws)
        want = hot_first_summary(logits, hot, offsets, ids, np.ones(32), 0, draws).cpu()
        drawn = np.isfinite(draws)
        assert (got.cold_token[~drawn] == -1).all() and (got.cold_token[drawn] >= 0).all()
        np.testing.assert_array_equal(got.touched_ids, want.touched_ids)
        agree += int((got.cold_token == want.cold_token)[drawn].sum())
        total += int(drawn.sum())
        same = got.cold_token == want.cold_token
        np.testing.assert_array_equal(got.cold_token_logit[same], want.cold_token_logit[same])
    assert agree >= 0.98 * total, f"{agree} of {total} cold tokens agree"
    tops = np.where(np.arange(32) % 4 == 0, 16, 0)  # drawing with cold ids: torch's own
    got = engine.hot_first_summary(logits, hot, offsets, ids, np.ones(32), tops, draws)
    want = hot_first_summary(logits, hot, offsets, ids, np.ones(32), tops, draws).cpu()
    for name in ("touched_offsets", "touched_ids", "touched_logits"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
    for name in ("cold_token", "cold_token_logit"):
        np.testing.assert_array_equal(getattr(got, name)[tops > 0], getattr(want, name)[tops > 0])


def test_the_bench_clock_counts_every_forward_hot_first_or_not():
    """bench serve-sim's ForwardClock records a forward whether the decode
    loop calls the engine's step or its step_then (the hot-first summary
    behind the forward), once each; an engine without step_then by step."""
    from simple_sampler.bench.serve_sim.measuring import ForwardClock

    engine = SimulatedEngine(SimulatedSpec(VOCAB, "bfloat16", 0.0, 0.0), max_batch_size=8)
    clock = ForwardClock(engine)
    for seq in ("a", "b"):
        engine.add(seq, [1, 2])
    engine.step(["a", "b"])
    engine.append(["a"], [3])
    engine.step_then(["a"], lambda rows: len(rows))
    assert [rows for _, rows in clock.ends] == [2, 1]

    class Plain:
        def step(self, seq_ids):
            return seq_ids
    plain = Plain()
    plain_clock = ForwardClock(plain)
    assert plain.step(["x"]) == ["x"] and [rows for _, rows in plain_clock.ends] == [1]
