"""Broad rows: min_p and top_p where most of the vocabulary survives (a high
temperature, an untrained model's flat row), drawn by rejection and, after
MAX_REJECTION_ROUNDS rejections, by buckets (cython_kernels/nucleus.pxi):
exactly the float64 reference's distribution, in every dtype."""
import ml_dtypes
import numpy as np
import pytest

from conftest import (PARAM_ON, P_VALUE_FLOOR, draw_counts, goodness_of_fit, moved_one_percent,
                      total_variation)
from simple_sampler import reference
from simple_sampler.params import TRUNCATIONS, History, SamplingParams
from simple_sampler.sampling import sample

VOCAB = 4096
DRAWS = 60_000


def flat_row(seed=5, vocab=VOCAB, scale=0.02):
    """An untrained model's row: N(0, scale) logits."""
    return (np.random.default_rng(seed).standard_normal(vocab) * scale).astype(np.float32)


def tied_row(seed=6, vocab=VOCAB):
    """Broad, with every value shared by a hundred tokens or so: ties at
    every possible nucleus boundary."""
    return np.round(np.random.default_rng(seed).normal(0, 0.3, vocab), 1).astype(np.float32)


def check(row, params, draws=DRAWS, history=None):
    counts, batch = draw_counts(row, params, draws, history)
    probs = reference.probabilities(np.asarray(row, np.float32), batch, 0)
    p_value = goodness_of_fit(counts, probs)
    assert p_value > P_VALUE_FLOOR, (
        f"{params}: chi-square p={p_value:.2e}, TV={total_variation(counts, probs):.4f}")
    return counts, probs


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=2.0, top_p=0.95),
    SamplingParams(top_p=0.9),
    SamplingParams(temperature=0.7, top_p=0.5),
    SamplingParams(top_p=0.05),               # many rejections: the bucket path serves some
    SamplingParams(top_p=1 - 1e-7),
    SamplingParams(min_p=0.9),
    SamplingParams(temperature=1.5, min_p=0.5, top_p=0.8),
    SamplingParams(temperature=0.3, min_p=0.02, top_p=0.95, repetition_penalty=1.3,
                   presence_penalty=0.5, logit_bias={7: 0.3, 4000: -0.2}),
], ids=["T2-p.95", "p.9", "T.7-p.5", "p.05", "p-1e-7", "minp.9", "minp-p", "penalties"])
@pytest.mark.parametrize("make_row", [flat_row, tied_row], ids=["flat", "tied"])
def test_broad_rows_follow_the_reference(make_row, params):
    history = History(prompt_ids=list(range(0, 300, 3)), output_ids=[7, 7, 11, 4000])
    check(make_row(), params, history=history)


def warped(probs: np.ndarray, distance: float) -> np.ndarray:
    """A smooth distortion of probs, `distance` away in TV: its log-probabilities
    scaled by the exponent (found by bisection) that moves it that far, the
    support kept."""
    log_probs = np.log(np.where(probs > 0, probs, 1.0))
    log_probs -= log_probs[probs > 0].max()

    def scaled(exponent):
        out = np.exp(log_probs * exponent) * (probs > 0)
        return out / out.sum()

    low, high = 1.0, 64.0
    assert total_variation(scaled(high), probs) > distance
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if total_variation(scaled(middle), probs) < distance else (low, middle)
    return scaled(high)


@pytest.mark.parametrize("make_row", [flat_row, tied_row], ids=["flat", "tied"])
def test_the_statistic_fails_a_distribution_one_percent_off(make_row):
    """Power at DRAWS: 1% of the mass moved onto the least likely token fails,
    and so does a smooth distortion 2% away in TV (the log-probabilities
    scaled: on the flat row a temperature about 6x off, for a temperature 2%
    off moves it by 7e-5 in TV, beyond any draw count's reach). A smooth 1%
    error fails about half the time at DRAWS (150,000 draws catch it)."""
    counts, probs = check(make_row(), SamplingParams(temperature=2.0, top_p=0.95))
    for wrong, distance in ((moved_one_percent(probs), 0.01), (warped(probs, 0.02), 0.02)):
        assert 0.99 * distance < total_variation(wrong, probs) < 1.01 * distance
        assert goodness_of_fit(counts, wrong) < P_VALUE_FLOOR, distance


def test_a_nucleus_boundary_inside_a_tie_is_cut_by_token_id():
    """All tokens tied: the nucleus is the lowest ids whose mass reaches top_p."""
    row = np.full(VOCAB, 0.5, np.float32)
    counts, _ = check(row, SamplingParams(top_p=0.25), draws=20_000)
    assert np.flatnonzero(counts).max() == VOCAB // 4 - 1


def test_min_p_at_its_edge_keeps_exactly_the_tokens_at_the_bound():
    """A token whose probability is exactly min_p times the max's is kept, and
    the next float below is not."""
    row = flat_row()
    top = float(row.max())
    row[100] = np.float32(top + np.log(0.5))                       # at the bound
    row[200] = np.nextafter(row[100], np.float32(-np.inf))          # just under
    counts, probs = check(row, SamplingParams(min_p=0.5), draws=20_000)
    assert probs[100] > 0 and probs[200] == 0 and counts[200] == 0


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_half_precision_broad_rows(dtype):
    row = flat_row(scale=0.5).astype(dtype)
    for params in (SamplingParams(temperature=2.0, top_p=0.95), SamplingParams(min_p=0.2, top_p=0.7)):
        counts, batch = draw_counts(row, params, 40_000)
        probs = reference.probabilities(row.astype(np.float32), batch, 0)
        assert goodness_of_fit(counts, probs) > P_VALUE_FLOOR, params


def deep_row(seed=7, vocab=VOCAB):
    """Eight tokens at 0 and the rest N(-9.2, 0.5), holding 5% of the mass:
    top_p 0.97 reaches into them, and about half their blocks have a max
    within 8 (row.pxi's TERMS_GAP) of the row max, whose terms the row pass
    keeps for top_p alone on a float32 row, the others not (a bfloat16 row
    keeps every block's)."""
    row = (np.random.default_rng(seed).standard_normal(vocab) * 0.5 - 9.2).astype(np.float32)
    row[np.arange(8) * (vocab // 8) + 3] = 0.0
    return row


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_top_p_alone_reaching_blocks_with_and_without_kept_terms(dtype):
    row = deep_row().astype(dtype)
    block_max = row.astype(np.float32).reshape(-1, 64).max(axis=1)
    assert 8 < np.count_nonzero(block_max >= -8.0) < block_max.size - 8, "both kinds of block"
    params = SamplingParams(top_p=0.97)
    counts, batch = draw_counts(row, params, DRAWS)
    probs = reference.probabilities(row.astype(np.float32), batch, 0)
    assert 8 < np.count_nonzero(probs) < probs.size - 8, "the nucleus ends among the low tokens"
    assert goodness_of_fit(counts, probs) > P_VALUE_FLOOR, params


def test_top_logprobs_of_a_broad_row():
    row = flat_row()
    from simple_sampler.params import SamplingBatch

    batch = SamplingBatch.from_params([SamplingParams(temperature=2.0, top_p=0.9, seed=3)])
    out = sample(row[None], batch, num_top_logprobs=5, return_logprobs=True)
    z = row.astype(np.float64) / 2.0
    logp = z - z.max() - np.log(np.exp(z - z.max()).sum())
    best = np.lexsort((np.arange(VOCAB), -logp))[:5]
    assert out.top_token_ids[0].tolist() == best.tolist()
    np.testing.assert_allclose(out.top_logprobs[0], logp[best], atol=2e-5)
    np.testing.assert_allclose(out.logprobs[0], logp[out.token_ids[0]], atol=2e-5)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=2.0, top_k=5),
    SamplingParams(temperature=2.0, top_k=20, top_p=0.95, min_p=0.05),
], ids=["k5", "k20-p-minp"])
@pytest.mark.parametrize("make_row", [flat_row, tied_row], ids=["flat", "tied"])
def test_top_k_on_a_broad_row(make_row, params):
    """top_k collects at a level k block maxima reach, bisected down to about
    k blocks (row.pxi, count_lower_bound): on a flat row every block's max
    is near the row max, and on a tied one many share it."""
    check(make_row(), params, draws=30_000)


@pytest.mark.parametrize("make_row", [flat_row, tied_row], ids=["flat", "tied"])
def test_top_logprobs_of_a_broad_row_with_ties(make_row):
    """The top-n logprobs, n = MAX_TOP_LOGPROBS, collected at count_lower_bound's level."""
    from simple_sampler.params import SamplingBatch
    from simple_sampler.sampling import MAX_TOP_LOGPROBS

    row = make_row()
    batch = SamplingBatch.from_params([SamplingParams(temperature=2.0, seed=3)])
    out = sample(row[None], batch, num_top_logprobs=MAX_TOP_LOGPROBS)
    z = row.astype(np.float64) / 2.0
    logp = z - z.max() - np.log(np.exp(z - z.max()).sum())
    best = np.lexsort((np.arange(VOCAB), -logp))[:MAX_TOP_LOGPROBS]
    assert out.top_token_ids[0].tolist() == best.tolist()
    np.testing.assert_allclose(out.top_logprobs[0], logp[best], atol=2e-5)


def test_seeded_tokens_do_not_depend_on_batch_position_or_threads():
    from simple_sampler.params import SamplingBatch

    rows = np.stack([flat_row(seed) for seed in range(24)])
    params = [SamplingParams(temperature=2.0, top_p=0.3, seed=100 + i) if i % 2 else
              SamplingParams(min_p=0.7, top_p=0.2, seed=100 + i) for i in range(24)]
    alone = [int(sample(rows[i:i + 1], SamplingBatch.from_params([params[i]]), num_threads=1)
                 .token_ids[0]) for i in range(24)]
    order = np.random.default_rng(0).permutation(24)
    for threads in (1, 2, 3):
        shuffled = sample(rows[order], SamplingBatch.from_params([params[i] for i in order]),
                          num_threads=threads).token_ids
        assert [int(t) for t in shuffled] == [alone[i] for i in order]


@pytest.mark.parametrize("param", TRUNCATIONS, ids=lambda p: p.name)
def test_each_truncation_of_the_table_on_a_broad_row(param):
    """Every truncation of params.RULES, alone and beside top_p, on a flat row
    at a high temperature: a new one that the broad path (nucleus.pxi: min_p
    and top_p only, routed there by sample_row in row.pxi) does not apply is
    drawn outside the reference's support."""
    value = {"top_p": 0.3, "min_p": 0.5}.get(param.name, PARAM_ON[param.name])
    for params in (SamplingParams(temperature=2.0, **{param.name: value}),
                   SamplingParams(temperature=2.0, **{"top_p": 0.9, param.name: value})):
        _, probs = check(flat_row(scale=0.5), params, draws=20_000)
        assert 0 < np.count_nonzero(probs) < probs.size * 0.95, "the value truncates this row"
