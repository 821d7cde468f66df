"""Speculative hot-vocab sampling: exactly the full distribution, whatever the
hot set; acceptance accounted for; batch-invariant."""
import numpy as np
import pytest
from scipy import stats

from conftest import ZIPF_VOCAB as VOCAB
from conftest import (P_VALUE_FLOOR, PARAM_ON, goodness_of_fit, hot_sets, make_requests, make_rows,
                      repeated_batch, total_variation)
from simple_sampler import reference
from simple_sampler.params import TRUNCATIONS, History, SamplingBatch, SamplingParams
from simple_sampler.sampling import sample, sample_requests
from simple_sampler.shvs import HotVocab

DRAWS = 100_000


def hot_draws(row, params, hot_vocab, draws=DRAWS, history=None, **kwargs):
    """(token counts, hot_accepted flags, batch) of `draws` seeded samples of one row."""
    batch = repeated_batch(params, draws, history)
    rows = np.broadcast_to(row, (draws, row.shape[-1]))
    out = sample(rows, batch, return_logprobs=False, hot_vocab=hot_vocab, **kwargs)
    return np.bincount(out.token_ids, minlength=row.shape[-1]), out.hot_accepted, batch


def check(row, params, hot_vocab, history=None, draws=DRAWS):
    counts, flags, batch = hot_draws(row, params, hot_vocab, draws, history)
    probs = reference.probabilities(row.astype(np.float32), batch, 0)
    p_value = goodness_of_fit(counts, probs)
    assert p_value > P_VALUE_FLOOR, (
        f"{params}: chi-square p={p_value:.2e}, TV={total_variation(counts, probs):.4f}, "
        f"accepted {np.mean(flags == 1):.3f}")
    return counts, flags, probs


GRID = [
    SamplingParams(),
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.7),
    SamplingParams(top_p=0.9),
    SamplingParams(top_p=0.5, temperature=0.7),
    SamplingParams(top_p=0.5, temperature=1.3),
    SamplingParams(top_p=0.2),
    SamplingParams(top_k=40, top_p=0.9),                       # not tried: full path
    SamplingParams(min_p=0.05, temperature=0.8),               # not tried: full path
]
GRID_IDS = ["plain", "t0.6", "t1.7", "p0.9", "p0.5-t0.7", "p0.5-t1.3", "p0.2", "k40-p0.9", "minp"]


@pytest.mark.parametrize("hot_kind", ["head", "random",
                                      pytest.param("misses-most-mass", marks=pytest.mark.slow),
                                      pytest.param("one-token", marks=pytest.mark.slow)])
@pytest.mark.parametrize("params", GRID, ids=GRID_IDS)
def test_distribution_equals_the_reference(zipf_row, hot_kind, params):
    hot = hot_sets(zipf_row)[hot_kind]
    _, flags, _ = check(zipf_row, params, hot)
    tried = params.top_k <= 0 and params.min_p <= 0
    assert (np.all(flags >= 0) if tried else np.all(flags == -1))


@pytest.mark.parametrize("param", TRUNCATIONS, ids=lambda p: p.name)
def test_each_truncation_of_the_table_is_applied(zipf_row, param):
    """Every truncation of params.RULES, alone, through SHVS (GRID is written
    by hand): one the kernels' level_truncated (cython_kernels/row.pxi)
    misses is drawn as an untruncated row, outside the reference's support."""
    params = SamplingParams(**{param.name: PARAM_ON[param.name]})
    _, _, probs = check(zipf_row, params, hot_sets(zipf_row)["head"], draws=20_000)
    assert 0 < np.count_nonzero(probs) < probs.size // 2, "the value truncates this row"


@pytest.mark.slow
@pytest.mark.parametrize("hot_kind", ["head", "random"])
def test_penalties_bias_and_bans_touching_hot_and_cold_tokens(zipf_row, hot_kind):
    hot = hot_sets(zipf_row)[hot_kind]
    order = np.argsort(-zipf_row)
    hot_ids = set(hot.ids.tolist())
    cold = [int(t) for t in order if int(t) not in hot_ids]
    history = History(prompt_ids=order[:25].tolist() + cold[:10],
                      output_ids=order[5:15].tolist() * 2 + cold[3:8])
    for params in (
        SamplingParams(repetition_penalty=1.4, presence_penalty=0.6, frequency_penalty=0.3),
        SamplingParams(top_p=0.8, repetition_penalty=0.7, presence_penalty=-0.5,
                       logit_bias={int(order[0]): -4.0, cold[40]: 6.0}),   # a cold token on top
        SamplingParams(top_p=0.6, logit_bias={int(order[1]): -np.inf, cold[100]: 2.5},
                       min_tokens=5, stop_token_ids=[int(order[2]), cold[0]]),
        SamplingParams(temperature=1.3, logit_bias={int(t): -np.inf for t in order[:50]}),
    ):
        check(zipf_row, params, hot, history)


@pytest.mark.slow
def test_real_smollm2_rows_with_a_calibrated_style_hot_set():
    """Real rows; the hot set is the head of other rows' mean probabilities."""
    from simple_sampler.rows import real_rows

    rows = real_rows(64)
    mean = np.mean([np.exp(r - r.max()) / np.exp(r - r.max()).sum() for r in rows[1::2]], axis=0)
    hot = HotVocab(np.argsort(-mean)[:2048], rows.shape[1])
    for r, params in ((0, SamplingParams(top_p=0.9)), (10, SamplingParams()),
                      (22, SamplingParams(top_p=0.95, temperature=0.8,
                                          repetition_penalty=1.1, presence_penalty=0.5)),
                      (40, SamplingParams(temperature=1.2))):
        history = History(prompt_ids=np.argsort(-rows[r])[:40].tolist(),
                          output_ids=np.argsort(-rows[r])[2:12].tolist())
        check(rows[r], params, hot, history, draws=20_000)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.05),
                                    SamplingParams(top_p=0.9, temperature=0.3)],
                         ids=["plain", "t0.05", "p0.9-t0.3"])
def test_logits_far_apart(params):
    """Blocks whose max rises far above the earlier ones (the bound's
    reference must move) and very low temperatures (huge exponents)."""
    rng = np.random.default_rng(12)
    row = rng.normal(-150.0, 3.0, VOCAB).astype(np.float32)
    row[VOCAB // 2:] = rng.normal(0.0, 2.0, VOCAB - VOCAB // 2)
    row[rng.choice(VOCAB, 40, replace=False)] += 6.0
    hot = HotVocab(np.argsort(-row)[::3][:300], VOCAB)
    check(row, params, hot)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(top_p=0.8)],
                         ids=["plain", "p0.8"])
def test_vocabulary_not_a_multiple_of_the_block(params):
    rng = np.random.default_rng(5)
    vocab = 1000                                   # the last block holds 40 columns
    row = (-1.0 * np.log(rng.permutation(vocab) + 1.0)).astype(np.float32)
    hot = HotVocab(np.r_[rng.choice(960, 60, replace=False), [963, 999]], vocab)
    _, flags, _ = check(row, params, hot)
    assert np.any(flags == 1)


def test_power_a_one_percent_error_is_caught(zipf_row):
    """The same SHVS draws fail against distributions 1% away in TV."""
    counts, _, probs = check(zipf_row, SamplingParams(top_p=0.9), hot_sets(zipf_row)["random"])
    support = np.flatnonzero(probs)
    moved = probs.copy()
    moved[support[np.argmax(probs[support])]] -= 0.01
    moved[support[np.argmin(probs[support])]] += 0.01
    assert goodness_of_fit(counts, moved) < P_VALUE_FLOOR


def test_both_branches_of_the_top_p_correction_are_exact():
    """A row whose nucleus boundary sits among many small hot tokens while a
    third of the mass is cold: the bounds on S leave a band of undecided
    tokens, so some draws need the exact correction, and the result is still
    the reference distribution."""
    rng = np.random.default_rng(8)
    row = np.full(VOCAB, -30.0, np.float32)
    hot_ids = rng.choice(VOCAB, 400, replace=False)
    row[hot_ids] = rng.normal(0.0, 0.05, 400)                   # 400 near-equal hot tokens
    cold_ids = np.setdiff1d(np.arange(VOCAB), hot_ids)
    row[cold_ids] = np.log(200 / cold_ids.size) + rng.normal(-0.4, 0.3, cold_ids.size)
    hot = HotVocab(hot_ids, VOCAB)
    _, flags, _ = check(row, SamplingParams(top_p=0.5), hot)
    assert 0.005 < np.mean(flags == 0) < 0.5 and np.mean(flags == 1) > 0.5


def test_acceptance_is_the_hot_mass_for_plain_sampling():
    """With every logit a multiple of ln 2, each bound term is exact (the
    bound interpolates 2^e linearly between integers e), so acceptance is
    M_H / S up to the bound's margins (a few 1e-4): checked within 5 sigma."""
    rng = np.random.default_rng(4)
    row = np.full(VOCAB, -np.log(2), np.float32)
    hot_ids = rng.choice(VOCAB, 64, replace=False)
    row[hot_ids] = np.log(2) * rng.integers(0, 7, 64)
    weights = np.exp(row.astype(np.float64) - row.max())
    hot_mass = weights[hot_ids].sum() / weights.sum()
    _, flags, _ = check(row, SamplingParams(), HotVocab(hot_ids, VOCAB))
    assert np.all(flags >= 0)
    sigma = np.sqrt(hot_mass * (1 - hot_mass) / DRAWS)
    assert abs(np.mean(flags == 1) - hot_mass) < 5 * sigma + 5e-4


@pytest.mark.slow
def test_on_and_off_give_the_same_distribution(zipf_row):
    """SHVS on vs off: a two-sample chi-square over 32 equal-mass groups."""
    params = SamplingParams(top_p=0.8, temperature=0.9)
    on, _, batch = hot_draws(zipf_row, params, hot_sets(zipf_row)["head"], draws=50_000)
    off, _, _ = hot_draws(zipf_row, params, None, draws=50_000)
    probs = reference.probabilities(zipf_row, batch, 0)
    order = np.lexsort((np.arange(probs.size), -probs))
    edges = np.unique(np.r_[0, np.searchsorted(np.cumsum(probs[order]), np.linspace(0, 1, 33)[1:-1])])
    table = np.array([np.add.reduceat(on[order], edges), np.add.reduceat(off[order], edges)])
    table = table[:, table.sum(axis=0) > 0]
    assert stats.chi2_contingency(table).pvalue > P_VALUE_FLOOR


def test_rows_shvs_does_not_take_report_not_tried(zipf_row):
    hot = hot_sets(zipf_row)["head"]
    rows = np.stack([zipf_row] * 5)
    params = [SamplingParams(temperature=0.0, seed=1), SamplingParams(top_k=5, seed=1),
              SamplingParams(min_p=0.1, seed=1), SamplingParams(top_p=0.9, seed=1),
              SamplingParams(seed=1)]
    out = sample_requests(rows, params, hot_vocab=hot, return_logprobs=False)
    assert out.hot_accepted.tolist()[:3] == [-1, -1, -1] and min(out.hot_accepted[3:]) >= 0
    with_logprobs = sample_requests(rows, params, hot_vocab=hot)
    assert np.all(with_logprobs.hot_accepted == -1)
    off = sample_requests(rows, params, return_logprobs=False)
    assert np.all(off.hot_accepted == -1)
    # rows SHVS does not take get the full path's token, bit for bit
    assert out.token_ids[:3].tolist() == off.token_ids[:3].tolist()


def test_batch_position_and_thread_invariance():

    rng = np.random.default_rng(21)
    count = 48
    rows = make_rows(rng, count)
    params, histories, steps = make_requests(rng, count)
    hot = HotVocab(rng.choice(rows.shape[1], 900, replace=False), rows.shape[1])
    kwargs = dict(hot_vocab=hot, return_logprobs=False)
    base = sample_requests(rows, params, histories, steps, num_threads=1, **kwargs)
    assert set(base.hot_accepted.tolist()) >= {0, 1}
    for threads in (1, 2, 2, 3):
        again = sample_requests(rows, params, histories, steps, num_threads=threads, **kwargs)
        np.testing.assert_array_equal(again.token_ids, base.token_ids)
        np.testing.assert_array_equal(again.hot_accepted, base.hot_accepted)
    perm = rng.permutation(count)
    shuffled = sample_requests(rows[perm], [params[i] for i in perm], [histories[i] for i in perm],
                               [steps[i] for i in perm], num_threads=1, **kwargs)
    np.testing.assert_array_equal(shuffled.token_ids, base.token_ids[perm])
    for r in range(0, count, 7):
        alone = sample_requests(rows[r], [params[r]], [histories[r]], [steps[r]], **kwargs)
        assert alone.token_ids[0] == base.token_ids[r]


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"])
def test_half_rows(zipf_row, dtype):
    import ml_dtypes

    dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    half = zipf_row.astype(dtype)
    counts, _, batch = hot_draws(half, SamplingParams(top_p=0.9), hot_sets(zipf_row)["random"],
                                 draws=30_000)
    probs = reference.probabilities(half.astype(np.float32), batch, 0)
    assert goodness_of_fit(counts, probs) > P_VALUE_FLOOR


def test_nan_and_infinity_are_reported_as_without_shvs(zipf_row):
    hot = hot_sets(zipf_row)["head"]
    for bad, column in ((np.nan, int(hot.ids[3])), (np.inf, 17)):
        row = zipf_row.copy()
        row[column] = bad
        with pytest.raises(ValueError, match=f"row 0: .*column {column}"):
            sample_requests(row, [SamplingParams(top_p=0.9)], hot_vocab=hot, return_logprobs=False)
    banned = {t: -np.inf for t in range(VOCAB)}
    with pytest.raises(ValueError, match="every token is banned"):
        sample_requests(zipf_row, [SamplingParams(logit_bias=banned)], hot_vocab=hot,
                        return_logprobs=False)


@pytest.mark.parametrize("ids, vocab, message", [
    ([0, 5, 4096], 4096, r"hot_vocab.ids must be token ids in \[0, 4096\), got 4096"),
    ([-1, 2], 4096, r"hot_vocab.ids must be token ids in \[0, 4096\), got -1"),
    ([3, 9, 3], 4096, "hot_vocab.ids must be distinct, got 3 more than once"),
    ([0.5, 1.0], 4096, "hot_vocab.ids must be a 1-D array of integer token ids"),
    ([[1, 2]], 4096, "hot_vocab.ids must be a 1-D array"),
    ([1], 0, "hot_vocab.vocab_size must be >= 1, got 0"),
])
def test_bad_hot_sets_name_the_field(ids, vocab, message):
    with pytest.raises(ValueError, match=message):
        HotVocab(np.asarray(ids), vocab)


def test_hot_set_for_another_vocabulary_is_rejected(zipf_row):
    with pytest.raises(ValueError, match="hot_vocab.vocab_size is 5000 but the logits have V=4096"):
        sample_requests(zipf_row, [SamplingParams()], hot_vocab=HotVocab(np.arange(10), 5000))


def test_kernel_index_of_a_hot_set():
    hot = HotVocab(np.array([130, 2, 64, 63, 0]), 200)
    ids, block_start, bits = hot.kernel_arrays()
    assert ids.tolist() == [0, 2, 63, 64, 130]
    assert block_start.tolist() == [0, 3, 4, 5, 5]
    assert [int(b) for b in bits] == [(1 << 0) | (1 << 2) | (1 << 63), 1, 1 << 2, 0]


def test_empty_hot_set_is_shvs_off(zipf_row):
    out = sample(zipf_row, SamplingBatch.from_params([SamplingParams(seed=3)]),
                 hot_vocab=HotVocab(np.array([], np.int64), VOCAB), return_logprobs=False)
    off = sample(zipf_row, SamplingBatch.from_params([SamplingParams(seed=3)]),
                 return_logprobs=False)
    assert out.hot_accepted.tolist() == [-1] and out.token_ids[0] == off.token_ids[0]


# ------------------------------------------- profiles, calibration, bench


def small_profile(**overrides):
    from simple_sampler.shvs import HotProfile, SizingCurve

    curves = {"plain": SizingCurve(acceptance=np.array([0.5, 0.8, 0.9]),
                                   us_per_row=np.array([30.0, 25.0, 30.0]), slope_us=0.1,
                                   intercept_us=15.0, full_us=40.0),
              "top_p": SizingCurve(acceptance=np.array([1.0, 1.0, 1.0]),
                                   us_per_row=np.array([20.0, 24.0, 29.0]), slope_us=0.1,
                                   intercept_us=19.0, full_us=45.0)}
    fields = dict(order=np.arange(100, 0, -1, dtype=np.int32), vocab_size=200,
                  sizes=np.array([10, 50, 100]), curves=curves, chosen_size=50,
                  mass=np.linspace(0.5, 1.0, 100), meta={"model": "test"})
    fields.update(overrides)
    return HotProfile(**fields)


def test_profile_round_trip(tmp_path):
    from simple_sampler.shvs import load_profile

    profile = small_profile()
    loaded = load_profile(profile.save(tmp_path / "sub" / "hot.npz"))
    assert loaded.order.tolist() == profile.order.tolist() and loaded.chosen_size == 50
    assert loaded.meta == {"model": "test"} and loaded.curves["plain"].full_us == 40.0
    np.testing.assert_array_equal(loaded.curves["top_p"].us_per_row, [20.0, 24.0, 29.0])
    assert loaded.hot_vocab().ids.tolist() == list(range(100, 50, -1))
    assert loaded.hot_vocab(10).size == 10
    with pytest.raises(ValueError, match=r"hot set size must be in \[1, 100\], got 101"):
        loaded.hot_vocab(101)


def test_a_file_that_is_not_a_profile_is_rejected(tmp_path):
    from simple_sampler.shvs import load_profile

    np.savez(tmp_path / "other.npz", order=np.arange(3))
    with pytest.raises(ValueError, match="is not a hot-vocabulary profile"):
        load_profile(tmp_path / "other.npz")


def test_monitor_recommends_a_size_only_on_drift():
    from simple_sampler.shvs import HotVocabMonitor

    profile = small_profile()
    monitor = HotVocabMonitor(profile, window=100, tolerance=0.05)
    assert monitor.size == 50 and np.isnan(monitor.acceptance) and monitor.predicted == 0.8
    plain = np.ones(150, bool)
    plain[100:] = False                                                # top_p rows: not counted
    monitor.observe(np.array([1] * 79 + [0] * 21 + [0] * 50, np.int8), plain)
    monitor.observe(np.array([-1] * 10, np.int8), np.ones(10, bool))  # not tried: not counted
    assert monitor.rows == 100 and monitor.acceptance == pytest.approx(0.79)
    assert not monitor.drifted and monitor.recommended_size() == 50
    monitor.observe(np.array([1] * 8 + [0] * 92, np.int8), np.ones(100, bool))
    assert monitor.drifted and monitor.acceptance == pytest.approx(0.08)
    # acceptance scaled by 0.1: a larger hot set no longer pays for itself
    assert monitor.recommended_size() == 10
    assert np.argmax(profile.mixed_rows_per_s(0.1)) == 0


def test_the_monitor_warns_of_drift_once_per_interval_with_the_recommended_size():
    from simple_sampler.shvs import HotVocabMonitor

    monitor = HotVocabMonitor(small_profile(), window=100, tolerance=0.05)
    monitor.observe(np.array([1] * 79 + [0] * 21, np.int8), np.ones(100, bool))
    assert monitor.drift_warning(now=0.0) is None                      # 0.79 vs 0.8: no drift
    monitor.observe(np.array([1] * 8 + [0] * 92, np.int8), np.ones(100, bool))
    warning = monitor.drift_warning(now=1.0, interval_s=600)
    assert warning.startswith("hot-vocab drift: SHVS acceptance 0.080 over the last 100 "
                              "untruncated rows, the profile predicts 0.800 at |H| = 50; "
                              "recommended |H| = 10")
    assert monitor.drift_warning(now=500.0, interval_s=600) is None    # rate-limited
    assert monitor.drift_warning(now=601.0, interval_s=600) == warning


def test_untruncated_rows_are_those_drawn_from_the_whole_distribution():
    from simple_sampler.shvs.hot_vocab import untruncated_rows

    params = [SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(temperature=0),
              SamplingParams(top_p=0.9), SamplingParams(min_p=0.05), SamplingParams(top_k=5),
              SamplingParams(top_k=-1), SamplingParams(repetition_penalty=1.2)]
    batch = SamplingBatch.from_params(params)
    assert untruncated_rows(batch).tolist() == [True, True, False, False, False, False, True,
                                                True]


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """A small calibration run: 3 prompts, 4 tokens each, 3 sizes."""
    from simple_sampler.cli import main

    out = tmp_path_factory.mktemp("calibrate") / "hot_vocab.npz"
    assert main(["calibrate", "--prompts", "3", "--tokens", "4", "--sizes", "64", "512", "4096",
                 "--repeats", "1", "--output", str(out)]) == 0
    return out


@pytest.mark.slow
def test_calibrate_writes_profile_and_plot(calibrated, capsys):
    from simple_sampler.shvs import load_profile

    profile = load_profile(calibrated)
    assert profile.vocab_size == 49152 and profile.order.size == 4096
    assert profile.sizes.tolist() == [64, 512, 4096] and profile.chosen_size in (64, 512, 4096)
    assert np.all(np.diff(profile.mass) >= 0) and 0 < profile.mass[-1] <= 1 + 1e-9
    for curve in profile.curves.values():
        assert np.all((curve.acceptance >= 0) & (curve.acceptance <= 1))
        assert curve.full_us > 0 and curve.us_per_row.shape == (3,)
    assert calibrated.stat().st_size < 300_000
    assert calibrated.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_bench_shvs_quick_json(calibrated, capsys):
    import json

    from simple_sampler.cli import main

    capsys.readouterr()
    assert main(["bench", "shvs", "--quick", "--json", "--profile", str(calibrated)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(r["rows"], r["vocab"], r["config"]) for r in report["results"]] == [
        ("smollm2", 49152, "top_p"), ("smollm2", 49152, "all"),
        ("synthetic", 151936, "top_p"), ("synthetic", 151936, "all"),
        ("flat", 151936, "top_p"), ("flat", 151936, "all")]
    # the hot set holds almost none of a flat row's mass: every row goes whole
    assert all(r["acceptance"] == 0 for r in report["results"] if r["rows"] == "flat")
    for r in report["results"]:
        assert set(r) == {"rows", "vocab", "config", "hot_size", "acceptance", "us_per_row"}
        assert set(r["us_per_row"]) == {"shvs", "full"} and min(r["us_per_row"].values()) > 0
        assert 0 <= r["acceptance"] <= 1
    assert report["machine"]["cores"] >= 1


def test_synthetic_rows_keep_token_identity_and_the_quantiles():
    from simple_sampler.rows import id_map, resample_quantiles, synthetic_hot_rows

    rng = np.random.default_rng(0)
    real = rng.normal(size=(3, 2000)).astype(np.float32)
    rows = synthetic_hot_rows(real, 5000)
    mapping = id_map(5000, 2000)
    assert len(set(mapping.tolist())) == 2000
    np.testing.assert_array_equal(-np.sort(-rows, axis=1),
                                  resample_quantiles(-np.sort(-real, axis=1), 5000))
    for j in range(3):   # real tokens keep their order
        assert np.all(np.diff(rows[j, mapping[np.argsort(-real[j])]]) <= 0)
    # More rows than real ones: row j comes from real row j % 3, the same
    # values on the real tokens' ids, the added ids shuffled afresh.
    cycled = synthetic_hot_rows(real, 5000, n=7)
    np.testing.assert_array_equal(cycled[:3], rows)
    np.testing.assert_array_equal(cycled[5][mapping], rows[2][mapping])
    assert not np.array_equal(cycled[5], rows[2])


def test_a_flat_long_row_goes_to_the_full_path_at_once():
    """top_p on a flat row of a real vocabulary: the nucleus reaches over most
    blocks, so SHVS hands the row to the full path (the token SHVS off gives)
    instead of collecting and ranking ~V candidates (34x the full path's cost
    before: docs/results/shvs-2026-11-28.md)."""
    rng = np.random.default_rng(21)
    vocab, rows = 151_936, 8
    logits = (0.05 * rng.standard_normal((rows, vocab))).astype(np.float32)
    hot = HotVocab(np.sort(rng.choice(vocab, 1536, replace=False)), vocab)
    batch = SamplingBatch.from_params([SamplingParams(top_p=0.95, seed=s) for s in range(rows)])
    with_hot = sample(logits, batch, hot_vocab=hot, return_logprobs=False)
    without = sample(logits, batch, return_logprobs=False)
    assert np.all(with_hot.hot_accepted == 0)
    np.testing.assert_array_equal(with_hot.token_ids, without.token_ids)
