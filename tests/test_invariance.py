"""Batch invariance: a row's token (and logprob) is a function of that row's
logits, parameters, history, seed and step only, never of the batch around
it, its position, the batch size, the row stride or the thread count."""
import numpy as np
import pytest

from conftest import MIXED_VOCAB as VOCAB
from conftest import make_requests, make_rows
from simple_sampler.params import History, SamplingBatch, SamplingParams
from simple_sampler.sampling import kernel_params, sample, sample_requests

N_TOP = 5


@pytest.fixture(scope="module")
def mixed():
    rng = np.random.default_rng(2024)
    count = 36
    rows = make_rows(rng, count)
    params, histories, steps = make_requests(rng, count)
    out = sample_requests(rows, params, histories, steps, num_top_logprobs=N_TOP, num_threads=1)
    return rows, params, histories, steps, out


def assert_same_rows(expected, expected_rows, actual, actual_rows):
    """Rows expected_rows of `expected` equal rows actual_rows of `actual`, bit for bit."""
    e, a = list(expected_rows), list(actual_rows)
    np.testing.assert_array_equal(actual.token_ids[a], expected.token_ids[e])
    np.testing.assert_array_equal(actual.logprobs[a], expected.logprobs[e])
    np.testing.assert_array_equal(actual.top_token_ids[a], expected.top_token_ids[e])
    np.testing.assert_array_equal(actual.top_logprobs[a], expected.top_logprobs[e])


def test_mixed_batch_is_sane(mixed):
    """The fixture exercises what it claims: valid, varied draws."""
    rows, params, _, _, out = mixed
    assert np.all((out.token_ids >= 0) & (out.token_ids < VOCAB))
    assert np.all(np.isfinite(out.logprobs)) and np.all(out.logprobs <= 0)
    assert len(set(out.token_ids.tolist())) > len(rows) // 2
    for r, p in enumerate(params):
        if p.greedy and not p.logit_bias and p.repetition_penalty == 1.0 and not p.min_tokens:
            assert out.token_ids[r] == int(np.argmax(rows[r]))


def test_same_call_twice(mixed):
    rows, params, histories, steps, out = mixed
    again = sample_requests(rows, params, histories, steps, num_top_logprobs=N_TOP, num_threads=1)
    assert_same_rows(out, range(len(rows)), again, range(len(rows)))


def test_permuted_rows(mixed):
    rows, params, histories, steps, out = mixed
    for seed in (0, 1):
        perm = np.random.default_rng(seed).permutation(len(rows))
        shuffled = sample_requests(rows[perm], [params[i] for i in perm],
                                   [histories[i] for i in perm], [steps[i] for i in perm],
                                   num_top_logprobs=N_TOP, num_threads=1)
        assert_same_rows(out, perm, shuffled, range(len(rows)))


def test_single_row_batches(mixed):
    rows, params, histories, steps, out = mixed
    for r in range(len(rows)):
        alone = sample_requests(rows[r:r + 1], [params[r]], [histories[r]], [steps[r]],
                                num_top_logprobs=N_TOP, num_threads=1)
        assert_same_rows(out, [r], alone, [0])
        one_d = sample_requests(rows[r], [params[r]], [histories[r]], [steps[r]],
                                num_top_logprobs=N_TOP, num_threads=1)
        assert_same_rows(out, [r], one_d, [0])


def test_inside_larger_padded_batches(mixed):
    rows, params, histories, steps, out = mixed
    rng = np.random.default_rng(77)
    for size in (len(rows) + 5, 3 * len(rows) + 1):
        filler = size - len(rows)
        extra_rows = make_rows(rng, filler)
        extra_params, extra_histories, extra_steps = make_requests(rng, filler, seed_base=1)
        positions = np.sort(rng.choice(size, len(rows), replace=False))
        all_rows = np.empty((size, VOCAB), np.float32)
        mask = np.zeros(size, bool)
        mask[positions] = True
        all_rows[positions] = rows
        all_rows[~mask] = extra_rows
        order = iter(range(len(rows)))
        others = iter(range(filler))
        all_params, all_histories, all_steps = [], [], []
        for slot in range(size):
            if mask[slot]:
                i = next(order)
                all_params.append(params[i]), all_histories.append(histories[i])
                all_steps.append(steps[i])
            else:
                j = next(others)
                all_params.append(extra_params[j]), all_histories.append(extra_histories[j])
                all_steps.append(extra_steps[j])
        big = sample_requests(all_rows, all_params, all_histories, all_steps,
                              num_top_logprobs=N_TOP, num_threads=1)
        assert_same_rows(out, range(len(rows)), big, positions)


def test_num_threads_one_and_two_agree(mixed):
    """(e) num_threads=1 and 2 give the mixed batch's tokens. Repeated, and
    on a larger batch under 2-4 threads, so that rows sharing state between
    threads (a data race) would show up in most runs."""
    rows, params, histories, steps, out = mixed
    for threads in (1,) + (2,) * 12:
        again = sample_requests(rows, params, histories, steps,
                                num_top_logprobs=N_TOP, num_threads=threads)
        assert_same_rows(out, range(len(rows)), again, range(len(rows)))
    rng = np.random.default_rng(5)
    count = 512
    rows = make_rows(rng, count, vocab=2000)
    params, histories, steps = make_requests(rng, count, vocab=2000)
    batch = SamplingBatch.from_params(params, histories, steps)
    single = sample(rows, batch, num_top_logprobs=N_TOP, num_threads=1)
    for threads in (2, 3, 4) * 4:
        threaded = sample(rows, batch, num_top_logprobs=N_TOP, num_threads=threads)
        assert_same_rows(single, range(count), threaded, range(count))


def test_default_threads_come_from_the_environment(mixed, monkeypatch):
    """The thread count a call without ``num_threads`` runs on is
    SIMPLE_SAMPLER_NUM_THREADS (1 without it), and its tokens are the same."""
    rows, params, histories, steps, out = mixed
    batch = SamplingBatch.from_params(params, histories, steps)
    monkeypatch.delenv("SIMPLE_SAMPLER_NUM_THREADS", raising=False)
    assert kernel_params(batch, rows.shape[1], N_TOP, None)[1] == 1
    monkeypatch.setenv("SIMPLE_SAMPLER_NUM_THREADS", "3")
    assert kernel_params(batch, rows.shape[1], N_TOP, None)[1] == 3
    again = sample_requests(rows, params, histories, steps, num_top_logprobs=N_TOP)
    assert_same_rows(out, range(len(rows)), again, range(len(rows)))
    for wrong in ("0", "two", "-1"):
        monkeypatch.setenv("SIMPLE_SAMPLER_NUM_THREADS", wrong)
        with pytest.raises(ValueError, match=f"SIMPLE_SAMPLER_NUM_THREADS must be an integer >= 1, got '{wrong}'"):
            sample_requests(rows, params, histories, steps, num_top_logprobs=N_TOP)


# ------------------------------------------------------ seeds and steps


def uniform_draws(count, seeds, steps, vocab=1000):
    """Tokens of `count` rows of equal logits (uniform over `vocab`)."""
    rows = np.zeros((count, vocab), np.float32)
    batch = SamplingBatch.from_params([SamplingParams(seed=int(s)) for s in seeds],
                                      steps=[int(s) for s in steps])
    return sample(rows, batch, num_threads=1).token_ids


def test_changing_the_step_changes_the_draws():
    count = 400
    seeds = np.arange(count)
    base = uniform_draws(count, seeds, np.zeros(count))
    for step in (1, 2, 1000, 2**40):
        moved = uniform_draws(count, seeds, np.full(count, step))
        # uniform over 1000 tokens: a coincidence has probability 1/1000
        assert np.mean(moved == base) < 0.02, step
    assert len(set(base.tolist())) > 250


def test_a_different_seed_gives_different_draws():
    count = 400
    steps = np.full(count, 7)
    seeds = np.arange(count, dtype=np.uint64)
    base = uniform_draws(count, seeds, steps)
    for shift in (count, 2**32, 2**63):   # both 32-bit halves of the key matter
        other = uniform_draws(count, seeds + np.uint64(shift), steps)
        assert np.mean(other == base) < 0.02, shift


def test_the_same_seed_and_step_repeat_the_token():
    count = 64
    seeds = np.full(count, 12345)
    steps = np.full(count, 3)
    tokens = uniform_draws(count, seeds, steps)
    assert len(set(tokens.tolist())) == 1            # every copy of the row agrees
    again = uniform_draws(1, seeds[:1], steps[:1])
    assert again[0] == tokens[0]
    # other rows of a batch do not shift it
    mixed_seeds = np.r_[np.arange(10), 12345, np.arange(10)]
    mixed_steps = np.r_[np.zeros(10), 3, np.zeros(10)]
    assert uniform_draws(21, mixed_seeds, mixed_steps)[10] == tokens[0]


def test_step_defaults_to_the_output_length():
    rows = np.zeros((2, 1000), np.float32)
    params = [SamplingParams(seed=5)] * 2
    by_default = sample_requests(rows, params, [History(output_ids=[1, 2, 3])] * 2).token_ids
    explicit = sample_requests(rows, params, [History()] * 2, steps=[3, 3]).token_ids
    assert by_default.tolist() == explicit.tolist()


# ----------------------------------------------------------- row strides


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_strided_rows_match_a_contiguous_copy(mixed, dtype):
    rows, params, histories, steps, _ = mixed
    big = np.zeros((2 * len(rows), VOCAB), dtype)
    big[::2] = rows.astype(dtype)
    big[1::2] = np.nan             # never read: a stray read would raise
    view = big[::2]
    assert not view.flags.c_contiguous
    strided = sample_requests(view, params, histories, steps, num_top_logprobs=N_TOP,
                              num_threads=1)
    contiguous = sample_requests(np.ascontiguousarray(view), params, histories, steps,
                                 num_top_logprobs=N_TOP, num_threads=1)
    assert_same_rows(contiguous, range(len(rows)), strided, range(len(rows)))


def test_rows_cut_from_a_wider_array(mixed):
    """Row stride larger than the row: a column slice of padded logits."""
    rows, params, histories, steps, out = mixed
    padded = np.full((len(rows), VOCAB + 37), np.nan, np.float32)
    padded[:, :VOCAB] = rows
    view = padded[:, :VOCAB]
    assert not view.flags.c_contiguous
    cut = sample_requests(view, params, histories, steps, num_top_logprobs=N_TOP, num_threads=1)
    assert_same_rows(out, range(len(rows)), cut, range(len(rows)))


def test_non_contiguous_columns_are_copied(mixed):
    rows, params, histories, steps, out = mixed
    wide = np.full((len(rows), 2 * VOCAB), np.nan, np.float32)
    wide[:, ::2] = rows
    view = wide[:, ::2]
    cut = sample_requests(view, params, histories, steps, num_top_logprobs=N_TOP, num_threads=1)
    assert_same_rows(out, range(len(rows)), cut, range(len(rows)))


@pytest.mark.parametrize("kind", [{}, {"top_k": 3}, {"top_k": 50}, {"top_k": 40, "top_p": 0.8},
                                  {"top_k": 100, "min_p": 0.01}, {"min_p": 0.05},
                                  {"top_k": 50, "top_p": 0.9}])
def test_a_rows_own_top_logprobs_leave_its_token(kind):
    """A row asking for its top-n logprobs draws the token it draws without
    them, on the full path and as a compact row decided both times (the
    top-n selection once reordered the candidates the draw walks)."""
    import torch

    from simple_sampler.handoff import sample_compact
    from simple_sampler.serving.hot_first import compact_rows
    from simple_sampler.shvs.hot_vocab import HotVocab

    rng = np.random.default_rng(3)
    vocab, count = 4096, 200
    row = (-1.1 * np.log(rng.permutation(vocab) + 1.0)
           + 0.3 * rng.standard_normal(vocab)).astype(np.float32)
    rows = np.broadcast_to(row, (count, vocab))
    batch = SamplingBatch.from_params([SamplingParams(seed=int(seed), **kind)
                                       for seed in rng.integers(0, 2**63, count)])
    without = sample(rows, batch, return_logprobs=False, num_threads=1).token_ids
    assert len(set(without.tolist())) > 1  # seeded draws, not one token
    hot = HotVocab(np.argsort(-row)[:600], vocab)
    compact = compact_rows(torch.from_numpy(rows.copy()), batch, hot)
    compact_without = sample_compact(compact, batch, hot, return_logprobs=False, num_threads=1)
    for n_top in (1, 5, 20):
        asked = sample(rows, batch, num_top_logprobs=n_top, num_threads=1)
        np.testing.assert_array_equal(asked.token_ids, without)
        compact_asked = sample_compact(compact, batch, hot, num_top_logprobs=n_top, num_threads=1)
        decided = (compact_without.outcome == 0) & (compact_asked.outcome == 0)
        np.testing.assert_array_equal(compact_asked.token_ids[decided],
                                      compact_without.token_ids[decided])
        assert decided.all()  # so the compact comparison covers every row
