"""logit_bias, min_tokens bans and the repetition / frequency / presence
penalties on small exact examples.

Every expected value is computed by hand from a short explicit row, then
compared with the kernels' view of the row: with ``num_top_logprobs=V`` the
sampler returns every token's logprob under softmax(penalized logits /
temperature), so the penalized logits are recovered up to one additive
constant. Greedy rows pin down the argmax of the penalized logits.

Each test runs on every way the kernels group a row's entries (a sort, or
a bitmap for long histories) and apply them (block by block, or to a
penalized copy of the row), forced on these short rows; the last tests hold
the four ways to the same floats on long and short histories.
"""
import ml_dtypes
import numpy as np
import pytest

from simple_sampler import _sampling
from simple_sampler.params import History, SamplingBatch, SamplingParams
from simple_sampler.sampling import sample, sample_requests
from simple_sampler.shvs import HotVocab

NEVER = 2**62
#: (bitmap_min_entries, penalized_min_overrides) for _sampling._force_override_paths
OVERRIDE_PATHS = {"sorted-blocks": (NEVER, NEVER), "bitmap-blocks": (0, NEVER),
                  "sorted-copy": (NEVER, 0), "bitmap-copy": (0, 0)}


@pytest.fixture(autouse=True, params=OVERRIDE_PATHS, ids=list(OVERRIDE_PATHS))
def override_path(request):
    previous = _sampling._force_override_paths(*OVERRIDE_PATHS[request.param])
    yield request.param
    _sampling._force_override_paths(*previous)

TOL = 1e-5
ROW = np.array([2.0, -1.0, 0.5, 3.0, -2.5, 0.0, 1.0, -0.5], np.float32)   # V = 8


def all_logprobs(row, params, history=None, step=None):
    """(token, logprob of token, [V] logprobs of every token) for one row."""
    row = np.asarray(row, np.float32)
    out = sample_requests(row, [params], [history or History()],
                          None if step is None else [step], num_top_logprobs=row.size)
    ids, values = out.top_token_ids[0], out.top_logprobs[0]
    assert sorted(ids.tolist()) == list(range(row.size)), f"not every token returned: {ids}"
    full = np.empty(row.size, np.float64)
    full[ids] = values
    return int(out.token_ids[0]), float(out.logprobs[0]), full


def log_softmax(z):
    z = np.asarray(z, np.float64)
    finite = z[np.isfinite(z)]
    top = finite.max()
    return z - top - np.log(np.exp(finite - top).sum())


def assert_logprobs(actual, expected_logits, temperature=1.0):
    expected = log_softmax(np.asarray(expected_logits, np.float64) / temperature)
    assert np.array_equal(np.isneginf(actual), np.isneginf(expected)), (actual, expected)
    finite = np.isfinite(expected)
    np.testing.assert_allclose(actual[finite], expected[finite], rtol=0, atol=TOL)


def greedy_token(row, params, history=None):
    params.temperature = 0.0
    return all_logprobs(row, params, history)[0]


# ---------------------------------------------------------------- baseline


def test_no_adjustments_is_plain_log_softmax():
    token, logprob, full = all_logprobs(ROW, SamplingParams(seed=3))
    assert_logprobs(full, ROW)
    assert abs(logprob - full[token]) < TOL


def test_top_logprobs_are_ordered_most_likely_first_ties_by_lower_id():
    row = np.array([1.0, 3.0, 1.0, 3.0, -np.inf, 2.0], np.float32)
    out = sample_requests(row, [SamplingParams(seed=0)], num_top_logprobs=6)
    assert out.top_token_ids[0].tolist() == [1, 3, 5, 0, 2, 4]
    assert np.all(np.diff(out.top_logprobs[0]) <= 0)
    assert out.top_logprobs[0][-1] == -np.inf


def test_temperature_divides_the_penalized_logits():
    history = History(output_ids=[0, 3])
    params = SamplingParams(temperature=0.5, frequency_penalty=0.75, seed=1)
    _, _, full = all_logprobs(ROW, params, history)
    expected = ROW.astype(np.float64).copy()
    expected[[0, 3]] -= 0.75
    assert_logprobs(full, expected, temperature=0.5)


def test_greedy_logprobs_use_temperature_one():
    history = History(output_ids=[3])
    token, logprob, full = all_logprobs(ROW, SamplingParams(temperature=0.0, presence_penalty=1.5),
                                        history)
    expected = ROW.astype(np.float64).copy()
    expected[3] -= 1.5                       # 3.0 -> 1.5: token 0 (2.0) is now the argmax
    assert token == 0
    assert_logprobs(full, expected)
    assert abs(logprob - log_softmax(expected)[0]) < TOL


# ------------------------------------------------------ repetition penalty


def test_repetition_divides_positive_and_multiplies_negative_logits():
    history = History(prompt_ids=[0, 1], output_ids=[2, 4])
    _, _, full = all_logprobs(ROW, SamplingParams(repetition_penalty=2.0, seed=0), history)
    expected = ROW.astype(np.float64).copy()
    expected[0] = 2.0 / 2.0       # prompt, positive: divided
    expected[1] = -1.0 * 2.0      # prompt, negative: multiplied
    expected[2] = 0.5 / 2.0       # output, positive
    expected[4] = -2.5 * 2.0      # output, negative
    assert_logprobs(full, expected)


def test_repetition_penalty_below_one_boosts():
    history = History(prompt_ids=[3, 4])
    _, _, full = all_logprobs(ROW, SamplingParams(repetition_penalty=0.5, seed=0), history)
    expected = ROW.astype(np.float64).copy()
    expected[3] = 3.0 / 0.5
    expected[4] = -2.5 * 0.5
    assert_logprobs(full, expected)


def test_repetition_applies_once_however_often_a_token_repeats():
    history = History(prompt_ids=[3, 3, 3, 1], output_ids=[3, 3, 1, 1, 1])
    _, _, full = all_logprobs(ROW, SamplingParams(repetition_penalty=1.5, seed=0), history)
    expected = ROW.astype(np.float64).copy()
    expected[3] = 3.0 / 1.5
    expected[1] = -1.0 * 1.5
    assert_logprobs(full, expected)


def test_repetition_leaves_zero_and_banned_logits_alone():
    row = ROW.copy()
    row[6] = -np.inf
    history = History(prompt_ids=[5, 6], output_ids=[5])
    _, _, full = all_logprobs(row, SamplingParams(repetition_penalty=3.0, seed=0), history)
    expected = row.astype(np.float64)
    assert_logprobs(full, expected)              # 0 / 3 = 0 * 3 = 0; -inf stays -inf
    assert full[6] == -np.inf


def test_repetition_changes_the_greedy_token():
    history = History(prompt_ids=[3])
    assert greedy_token(ROW, SamplingParams()) == 3
    # 3.0 / 2 = 1.5 < 2.0: token 0 wins
    assert greedy_token(ROW, SamplingParams(repetition_penalty=2.0), history) == 0
    # a prompt token seen only there is still penalized without any output
    assert greedy_token(ROW, SamplingParams(repetition_penalty=1.4), history) == 3   # 2.14 > 2
    assert greedy_token(ROW, SamplingParams(repetition_penalty=1.6), history) == 0   # 1.875 < 2


# ------------------------------------------------ frequency and presence


def test_frequency_counts_output_occurrences_only():
    history = History(prompt_ids=[0, 0, 0, 6], output_ids=[3, 3, 3, 2, 6])
    _, _, full = all_logprobs(ROW, SamplingParams(frequency_penalty=0.5, seed=0), history)
    expected = ROW.astype(np.float64).copy()
    expected[3] -= 0.5 * 3
    expected[2] -= 0.5 * 1
    expected[6] -= 0.5 * 1        # once in the output; its prompt occurrence does not count
    # token 0 is only in the prompt: untouched
    assert_logprobs(full, expected)


def test_presence_subtracts_once_for_output_tokens_only():
    history = History(prompt_ids=[0, 1, 1], output_ids=[3, 3, 3, 3, 4])
    _, _, full = all_logprobs(ROW, SamplingParams(presence_penalty=0.8, seed=0), history)
    expected = ROW.astype(np.float64).copy()
    expected[3] -= 0.8            # four times, subtracted once
    expected[4] -= 0.8
    assert_logprobs(full, expected)


def test_negative_frequency_and_presence_raise_logits():
    history = History(output_ids=[4, 4, 1])
    params = SamplingParams(frequency_penalty=-0.25, presence_penalty=-1.0, seed=0)
    _, _, full = all_logprobs(ROW, params, history)
    expected = ROW.astype(np.float64).copy()
    expected[4] += 0.25 * 2 + 1.0
    expected[1] += 0.25 * 1 + 1.0
    assert_logprobs(full, expected)


def test_all_three_penalties_combine_in_order():
    """repetition first (on the biased logit), then - f * count - p."""
    history = History(prompt_ids=[0, 5, 7], output_ids=[3, 3, 4, 7, 7, 7])
    params = SamplingParams(repetition_penalty=1.25, frequency_penalty=0.3,
                            presence_penalty=0.6, seed=0)
    _, _, full = all_logprobs(ROW, params, history)
    expected = ROW.astype(np.float64).copy()
    expected[0] = 2.0 / 1.25                           # prompt only
    expected[5] = 0.0                                   # prompt only, zero
    expected[3] = 3.0 / 1.25 - 0.3 * 2 - 0.6
    expected[4] = -2.5 * 1.25 - 0.3 * 1 - 0.6
    expected[7] = -0.5 * 1.25 - 0.3 * 3 - 0.6            # prompt and output
    assert_logprobs(full, expected)


def test_frequency_changes_the_greedy_token():
    history = History(output_ids=[3, 3])
    # 3 - 2 * 0.4 = 2.2 > 2.0: still 3; 3 - 2 * 0.6 = 1.8 < 2.0: token 0
    assert greedy_token(ROW, SamplingParams(frequency_penalty=0.4), history) == 3
    assert greedy_token(ROW, SamplingParams(frequency_penalty=0.6), history) == 0
    # presence is applied once: 3 - 0.9 = 2.1 > 2.0
    assert greedy_token(ROW, SamplingParams(presence_penalty=0.9), history) == 3
    assert greedy_token(ROW, SamplingParams(presence_penalty=1.1), history) == 0


# ----------------------------------------------------------------- no-ops


@pytest.mark.parametrize("history", [
    History(prompt_ids=[0, 3, 3, 5], output_ids=[3, 1, 1, 7]),
    History(prompt_ids=list(range(8)) * 2, output_ids=list(range(8))),
])
def test_neutral_penalties_are_no_ops(history):
    neutral = SamplingParams(repetition_penalty=1.0, frequency_penalty=0.0,
                             presence_penalty=0.0, seed=9)
    # the same step for both: by default the step is len(output_ids)
    plain = all_logprobs(ROW, SamplingParams(seed=9), step=0)
    with_history = all_logprobs(ROW, neutral, history, step=0)
    assert plain[0] == with_history[0]
    assert plain[1] == with_history[1]
    assert np.array_equal(plain[2], with_history[2])
    assert_logprobs(with_history[2], ROW)


def test_history_does_not_touch_other_tokens():
    history = History(prompt_ids=[1, 2], output_ids=[2, 6, 6])
    params = SamplingParams(repetition_penalty=1.7, frequency_penalty=1.1,
                            presence_penalty=-0.4, seed=0)
    _, _, full = all_logprobs(ROW, params, history)
    untouched = [0, 3, 4, 5, 7]
    # differences between untouched tokens are those of the raw row
    np.testing.assert_allclose(full[untouched] - full[untouched[0]],
                               ROW[untouched].astype(np.float64) - ROW[untouched[0]],
                               rtol=0, atol=TOL)
    expected = ROW.astype(np.float64).copy()
    expected[1] = -1.0 * 1.7
    expected[2] = 0.5 / 1.7 - 1.1 + 0.4
    expected[6] = 1.0 / 1.7 - 2 * 1.1 + 0.4
    assert_logprobs(full, expected)


def test_penalties_without_history_are_no_ops():
    params = SamplingParams(repetition_penalty=3.0, frequency_penalty=2.0,
                            presence_penalty=2.0, seed=4)
    plain = all_logprobs(ROW, SamplingParams(seed=4))
    penalized = all_logprobs(ROW, params, History())
    assert plain[0] == penalized[0]
    assert np.array_equal(plain[2], penalized[2])


# -------------------------------------------------------------- logit_bias


def test_logit_bias_adds_to_the_named_tokens():
    params = SamplingParams(logit_bias={1: 4.0, 3: -1.5, 5: 0.25}, seed=0)
    _, _, full = all_logprobs(ROW, params)
    expected = ROW.astype(np.float64).copy()
    expected[1] += 4.0
    expected[3] -= 1.5
    expected[5] += 0.25
    assert_logprobs(full, expected)


def test_logit_bias_minus_infinity_bans():
    params = SamplingParams(temperature=0.0, logit_bias={3: -np.inf, 0: -np.inf})
    token, _, full = all_logprobs(ROW, params)
    assert token == 6
    assert full[3] == -np.inf and full[0] == -np.inf
    expected = ROW.astype(np.float64).copy()
    expected[[0, 3]] = -np.inf
    assert_logprobs(full, expected)


def test_logit_bias_changes_the_greedy_token():
    assert greedy_token(ROW, SamplingParams(logit_bias={4: 5.6})) == 4    # -2.5 + 5.6 = 3.1 > 3
    assert greedy_token(ROW, SamplingParams(logit_bias={4: 5.4})) == 3    # 2.9 < 3


def test_bias_is_added_before_repetition_flips_sign_positive_to_negative():
    """Token 6: 1.0 + bias -3.0 = -2.0, then multiplied by 2 -> -4.0.
    (Penalty first would give 1.0 / 2 - 3 = -2.5.)"""
    history = History(prompt_ids=[6])
    params = SamplingParams(repetition_penalty=2.0, logit_bias={6: -3.0}, seed=0)
    _, _, full = all_logprobs(ROW, params, history)
    expected = ROW.astype(np.float64).copy()
    expected[6] = (1.0 - 3.0) * 2.0
    assert_logprobs(full, expected)
    assert abs((full[6] - full[5]) - (-4.0)) < TOL      # token 5 has logit 0


def test_bias_is_added_before_repetition_flips_sign_negative_to_positive():
    """Token 4: -2.5 + bias 4.5 = 2.0, then divided by 4 -> 0.5.
    (Penalty first would give -2.5 * 4 + 4.5 = -5.5.)"""
    history = History(output_ids=[4])
    params = SamplingParams(repetition_penalty=4.0, logit_bias={4: 4.5}, seed=0)
    _, _, full = all_logprobs(ROW, params, history)
    expected = ROW.astype(np.float64).copy()
    expected[4] = (-2.5 + 4.5) / 4.0
    assert_logprobs(full, expected)
    assert abs((full[4] - full[5]) - 0.5) < TOL


def test_bias_then_all_penalties_on_one_token():
    history = History(prompt_ids=[2], output_ids=[2, 2])
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5,
                            presence_penalty=0.25, logit_bias={2: -1.5}, seed=0)
    _, _, full = all_logprobs(ROW, params, history)
    expected = ROW.astype(np.float64).copy()
    expected[2] = (0.5 - 1.5) * 1.5 - 0.5 * 2 - 0.25
    assert_logprobs(full, expected)


# --------------------------------------------------------------- min_tokens


def test_min_tokens_bans_stop_ids_until_reached():
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[3, 0])
    for n_out, banned in ((0, True), (1, True), (2, True), (3, False), (5, False)):
        history = History(output_ids=[7] * n_out)
        token, _, full = all_logprobs(ROW, params, history)
        expected = ROW.astype(np.float64).copy()
        if banned:
            expected[[3, 0]] = -np.inf
        assert_logprobs(full, expected)
        assert token == (6 if banned else 3), (n_out, token)


def test_min_tokens_ban_is_recorded_in_the_batch():
    params = SamplingParams(min_tokens=2, stop_token_ids=[5, 1])
    batch = SamplingBatch.from_params([params, params, params],
                                      [History(), History(output_ids=[4]),
                                       History(output_ids=[4, 4])])
    assert batch.ban_offsets.tolist() == [0, 2, 4, 4]
    assert batch.ban_ids.tolist() == [5, 1, 5, 1]


def test_min_tokens_zero_bans_nothing():
    params = SamplingParams(temperature=0.0, min_tokens=0, stop_token_ids=[3])
    token, _, full = all_logprobs(ROW, params)
    assert token == 3
    assert_logprobs(full, ROW)


def test_min_tokens_ban_overrides_a_positive_bias_and_penalties():
    history = History(prompt_ids=[3], output_ids=[3])
    params = SamplingParams(min_tokens=5, stop_token_ids=[3], logit_bias={3: 10.0},
                            repetition_penalty=0.5, frequency_penalty=-2.0,
                            presence_penalty=-2.0, seed=0)
    token, _, full = all_logprobs(ROW, params, history)
    assert full[3] == -np.inf
    assert token != 3
    expected = ROW.astype(np.float64).copy()
    expected[3] = -np.inf
    assert_logprobs(full, expected)


def test_min_tokens_through_sample_with_a_direct_ban_list():
    """The columnar batch: ban ids of the current step go to -inf."""
    batch = SamplingBatch.from_params([SamplingParams(temperature=0.0)] * 2)
    batch.ban_offsets = np.array([0, 1, 1], np.int64)
    batch.ban_ids = np.array([3], np.int64)
    out = sample(np.stack([ROW, ROW]), batch, num_top_logprobs=8)
    assert out.token_ids.tolist() == [0, 3]
    assert out.top_token_ids[0][-1] == 3 and out.top_logprobs[0][-1] == -np.inf
    assert np.all(np.isfinite(out.top_logprobs[1]))


# -------------------------------------------------- rows side by side


def test_rows_of_one_batch_get_their_own_adjustments():
    rows = np.stack([ROW, ROW, ROW])
    params = [SamplingParams(repetition_penalty=2.0, seed=0),
              SamplingParams(frequency_penalty=1.0, seed=0),
              SamplingParams(logit_bias={7: 2.0}, seed=0)]
    histories = [History(prompt_ids=[0]), History(output_ids=[3, 3]), History(output_ids=[0])]
    out = sample_requests(rows, params, histories, num_top_logprobs=8)
    expected = [ROW.astype(np.float64).copy() for _ in range(3)]
    expected[0][0] = 1.0
    expected[1][3] = 1.0
    expected[2][7] = 1.5
    for r in range(3):
        full = np.empty(8)
        full[out.top_token_ids[r]] = out.top_logprobs[r]
        assert_logprobs(full, expected[r])


def test_greedy_tie_made_by_a_penalty_goes_to_the_lower_id():
    row = np.array([-1.0, 1.0, 2.0, 0.5], np.float32)
    history = History(output_ids=[2])
    # 2.0 / 2 = 1.0 ties token 1: the lower id wins
    assert greedy_token(row, SamplingParams(repetition_penalty=2.0), history) == 1
    # 2.0 - 1.0 = 1.0 ties token 1 again, now through the presence penalty
    assert greedy_token(row, SamplingParams(presence_penalty=1.0), history) == 1
    # -1.0 + 2.0 = 1.0 ties token 1 from below: token 0 wins
    assert greedy_token(row, SamplingParams(logit_bias={0: 2.0, 2: -5.0})) == 0


@pytest.mark.parametrize("vocab", [150, 193])
def test_adjustments_at_block_boundaries(vocab):
    """Vocabulary of several 64-column blocks: adjusted tokens at block edges
    (0, 63, 64, 127, 128, last) are patched in where they belong."""
    row = np.full(vocab, -6.0, np.float32)
    row[::7] = -5.0
    edges = [0, 63, 64, 127, 128, vocab - 1]
    row[edges] = [1.0, 2.0, -1.0, 0.5, 3.0, 1.5]
    history = History(prompt_ids=[0, 64, 128], output_ids=[63, 63, vocab - 1, 127])
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.25,
                            presence_penalty=0.5, logit_bias={64: 4.0, vocab - 1: -0.5, 5: 9.0},
                            seed=11)
    expected = row.astype(np.float64).copy()
    expected[0] = 1.0 / 1.5
    expected[63] = 2.0 / 1.5 - 0.25 * 2 - 0.5
    expected[64] = (-1.0 + 4.0) / 1.5
    expected[127] = 0.5 / 1.5 - 0.25 - 0.5
    expected[128] = 3.0 / 1.5
    expected[vocab - 1] = (1.5 - 0.5) / 1.5 - 0.25 - 0.5
    expected[5] = -6.0 + 9.0
    lp = log_softmax(expected)
    for step in range(6):
        out = sample_requests(row, [params], [history], [step], num_top_logprobs=20)
        ids = out.top_token_ids[0]
        order = np.lexsort((np.arange(vocab), -expected))[:20]
        assert ids.tolist() == order.tolist()
        np.testing.assert_allclose(out.top_logprobs[0], lp[ids], rtol=0, atol=TOL)
        assert abs(out.logprobs[0] - lp[out.token_ids[0]]) < TOL
    params.temperature = 0.0
    assert sample_requests(row, [params], [history]).token_ids[0] == 5


# ------------------------------------------------- the four ways, long rows


def history_batch(vocab: int, size: int, rng, untruncated: bool, long: bool) -> SamplingBatch:
    """Rows with bias, bans and a history (repeats, prompt and output
    overlapping): long, thousands of entries, overrides in every block of
    the row; or short, a hundred entries, most blocks plain (read in place,
    bfloat16 and float16 widened as they stream by, where the copy holds
    them as float32). untruncated: rows SHVS tries (sampled, no top_k or
    min_p)."""
    params, histories = [], []
    for r in range(size):
        prompt = rng.integers(0, vocab, int(rng.integers(1500, 4000) if long else rng.integers(20, 60)))
        output = np.concatenate([rng.integers(0, vocab, 600 if long else 10), prompt[:200 if long else 5]])
        bias = {int(i): float(rng.normal()) for i in rng.choice(vocab, 40, replace=False)}
        params.append(SamplingParams(
            temperature=float(rng.choice([0.7, 1.3] if untruncated else [0.0, 0.7, 1.3])),
            top_k=0 if untruncated else int(rng.choice([0, 40])), top_p=float(rng.choice([1.0, 0.9])),
            min_p=0.0 if untruncated else float(rng.choice([0.0, 0.05])),
            repetition_penalty=float(rng.choice([1.0, 1.15, 0.9])),
            frequency_penalty=float(rng.choice([0.0, 0.4])), presence_penalty=float(rng.choice([0.0, -0.3])),
            logit_bias=bias, min_tokens=3, stop_token_ids=[int(rng.integers(vocab))], seed=100 + r))
        histories.append(History(prompt_ids=prompt.tolist(), output_ids=output.tolist()))
    return SamplingBatch.from_params(params, histories, [1] * size, vocab)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
@pytest.mark.parametrize("hot", [False, True], ids=["full", "shvs"])
@pytest.mark.parametrize("long", [True, False], ids=["long", "short"])
def test_every_way_gives_the_same_floats_on_any_history(override_path, dtype, hot, long):
    """Tokens, logprobs and top logprobs bit for bit as the defaults give
    them (which, at these sizes, group a long history by the bitmap and
    sample a copy, and a short one by the sort, block by block)."""
    rng = np.random.default_rng(7)
    vocab, size = 20_000, 12
    rows = (rng.standard_normal((size, vocab)) * 2.0).astype(dtype)
    batch = history_batch(vocab, size, rng, untruncated=hot, long=long)
    # SHVS: a hot set holding most of row 0's mass, tried on rows asking no logprobs
    kwargs = ({"hot_vocab": HotVocab(np.argsort(-rows[0].astype(np.float32))[:2000], vocab),
               "return_logprobs": False} if hot else {"num_top_logprobs": 5})
    kwargs["num_threads"] = 2
    got = sample(rows, batch, **kwargs)
    if hot:
        assert (got.hot_accepted >= 0).all()
    previous = _sampling._force_override_paths(-1, -1)
    try:
        expected = sample(rows, batch, **kwargs)
    finally:
        _sampling._force_override_paths(*previous)
    np.testing.assert_array_equal(got.token_ids, expected.token_ids)
    for name in ("logprobs", "top_logprobs", "top_token_ids", "hot_accepted"):
        np.testing.assert_array_equal(getattr(got, name), getattr(expected, name), err_msg=name)
