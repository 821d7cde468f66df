"""Hot-first handoff: compact rows (hot logits, touched logits, a cold
summary) decide exactly today's distribution; the two-stage procedure
(compact, then the undecided rows whole, conditioned on C where the draw
fell there) matches the float64 reference; batch- and thread-invariant."""
import time

import ml_dtypes
import numpy as np
import pytest
import torch

from conftest import ZIPF_VOCAB as VOCAB
from conftest import (P_VALUE_FLOOR, PARAM_ON, goodness_of_fit, hot_sets, make_requests, make_rows,
                      moved_one_percent, repeated_batch, total_variation)
from simple_sampler import reference
from simple_sampler._sampling import HandoffOutcome
from simple_sampler.handoff import (CompactRows, fallback_batch, merge_fallback,
                                    sample_compact)
from simple_sampler.params import TRUNCATIONS, History, SamplingBatch, SamplingParams
from simple_sampler.sampling import sample, sample_requests
from simple_sampler.serving.hot_first import (compact_rows, hot_first_summary, row_cold_tops,
                                              sample_hot_first, touched_lists)
from simple_sampler.shvs import HotVocab

DRAWS = 100_000
DECIDED, NEED_FULL, NEED_COLD = (HandoffOutcome.HANDOFF_DECIDED, HandoffOutcome.HANDOFF_NEED_FULL,
                                 HandoffOutcome.HANDOFF_NEED_COLD)


def as_tensor(rows):
    rows = np.ascontiguousarray(rows)
    if rows.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(rows.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(rows)


def tiled_compact(row, batch, hot, draws, cold_top=0):
    """Compact rows for `draws` copies of one row: its summary (computed
    once, from the batch's first row) repeated, not recomputed."""
    one = batch.take([0])
    offsets, ids = touched_lists(one, hot)
    c = hot_first_summary(as_tensor(row[None]), hot.kernel_arrays()[0], offsets, ids,
                          one.temperature, cold_top).cpu()
    n = c.touched_ids.size
    repeat = lambda a: np.repeat(a, draws)
    return CompactRows(hot_logits=np.broadcast_to(c.hot_logits, (draws, hot.size)),
                       touched_offsets=np.arange(draws + 1, dtype=np.int64) * n,
                       touched_ids=np.tile(c.touched_ids, draws),
                       touched_logits=np.tile(c.touched_logits, draws),
                       cold_max=repeat(c.cold_max), cold_argmax=repeat(c.cold_argmax),
                       cold_mass=repeat(c.cold_mass))


def handoff_draws(row, params, hot, draws=DRAWS, history=None, cold_top=0,
                  unconditioned_fallback=False):
    """(token counts, outcomes, batch) of `draws` seeded two-stage samples of
    one row. unconditioned_fallback: the WRONG second stage (NEED_COLD rows
    sampled from the whole row), to show the tests catch it."""
    batch = repeated_batch(params, draws, history)
    compact = tiled_compact(row, batch, hot, draws, cold_top)
    first = sample_compact(compact, batch, hot, return_logprobs=False)
    outcome = first.outcome.copy()
    undecided, second_batch = fallback_batch(batch, first, compact, hot)
    if unconditioned_fallback:
        second_batch = batch.take(undecided)
    second = sample(np.broadcast_to(row, (undecided.size, row.size)), second_batch,
                    return_logprobs=False)
    merge_fallback(first, undecided, second)
    return np.bincount(first.token_ids, minlength=row.size), outcome, batch


def check(row, params, hot, history=None, draws=DRAWS, cold_top=0):
    counts, outcome, batch = handoff_draws(row, params, hot, draws, history, cold_top)
    probs = reference.probabilities(np.asarray(row, np.float32), batch, 0)
    p_value = goodness_of_fit(counts, probs)
    assert p_value > P_VALUE_FLOOR, (
        f"{params}: chi-square p={p_value:.2e}, TV={total_variation(counts, probs):.4f}, "
        f"outcomes {np.bincount(outcome, minlength=3)}")
    return counts, outcome, probs


GRID = [
    SamplingParams(),
    SamplingParams(temperature=0.6),
    SamplingParams(top_p=0.9),
    SamplingParams(top_p=0.5, temperature=0.7),
    SamplingParams(top_k=40, top_p=0.9),
    SamplingParams(min_p=0.05, temperature=0.8),
    SamplingParams(temperature=0.8, top_k=50, top_p=0.95, min_p=0.05),
]
GRID_IDS = ["plain", "t0.6", "p0.9", "p0.5-t0.7", "k40-p0.9", "minp", "all"]


@pytest.mark.parametrize("hot_kind", ["head", "random", "misses-most-mass"])
@pytest.mark.parametrize("params", GRID, ids=GRID_IDS)
def test_two_stage_distribution_equals_the_reference(zipf_row, hot_kind, params):
    check(zipf_row, params, hot_sets(zipf_row)[hot_kind])


@pytest.mark.parametrize("masked", ["tail", "every-cold-id"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=0.6),
                                    SamplingParams(temperature=0.5, top_p=0.9)], ids=["t", "t-p"])
def test_a_vocabulary_masked_with_the_lowest_float_below_t_1(zipf_row, masked, params):
    """Ids masked with float32's lowest value (a padded vocabulary): their z
    is -inf below T = 1, in the summary and in the fallback's full rows, as
    in the reference. Every cold id masked: a finite cold max, no cold mass."""
    hot = hot_sets(zipf_row)["head"]
    lowest = np.finfo(np.float32).min
    row = zipf_row.copy()
    if masked == "tail":
        row[-1200:] = lowest
    else:
        row[~np.isin(np.arange(VOCAB), hot.ids)] = lowest
    check(row, params, hot, draws=20_000)


@pytest.mark.parametrize("ruled_out", ["most-ids", "every-hot-id"])
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.7, top_p=0.8),
                                    SamplingParams(min_p=0.05, top_k=30)],
                         ids=["plain", "t-p", "minp-k"])
def test_a_row_a_grammar_masked_follows_the_reference(zipf_row, ruled_out, params):
    """A guided request's row (serving/structured.py) has -inf at every id
    its grammar rules out, before the summary: hot ids among them (or all
    of them), the allowed ones scattered. The two stages draw the
    reference's distribution over the allowed ids, and never another."""
    hot = hot_sets(zipf_row)["head"]
    row = zipf_row.copy()
    if ruled_out == "most-ids":
        out = np.random.default_rng(11).random(VOCAB) < 0.7
        out[int(np.argmax(row))] = True  # the row's most likely id, a hot one, ruled out
    else:
        out = np.isin(np.arange(VOCAB), hot.ids)
    row[out] = -np.inf
    counts, _, _ = check(row, params, hot, draws=30_000)
    assert counts[out].sum() == 0


@pytest.mark.parametrize("hot_kind", ["head", "whole"])
@pytest.mark.parametrize("param", TRUNCATIONS, ids=lambda p: p.name)
def test_each_truncation_of_the_table_is_applied(zipf_row, param, hot_kind):
    """Every truncation of params.RULES, alone, through the compact rows
    (GRID is written by hand) against the reference: one missed in
    level_truncated (cython_kernels/row.pxi) is drawn as an untruncated row;
    one missed in compact_row (compact.pxi) is drawn untruncated where the
    cold region is empty (the whole vocabulary hot), a row decided there."""
    hot = (HotVocab(np.arange(VOCAB), VOCAB) if hot_kind == "whole"
           else hot_sets(zipf_row)[hot_kind])
    params = SamplingParams(**{param.name: PARAM_ON[param.name]})
    _, _, probs = check(zipf_row, params, hot, draws=20_000)
    assert 0 < np.count_nonzero(probs) < probs.size // 2, "the value truncates this row"


def test_both_fallbacks_happen_and_are_exact(zipf_row):
    """A hot set holding the head: plain sampling falls in C on some draws
    (NEED_COLD), top_p 0.99 reaches into C (NEED_FULL), each exact."""
    hot = hot_sets(zipf_row)["head"]
    _, outcome, _ = check(zipf_row, SamplingParams(), hot)
    assert 0.01 < np.mean(outcome == NEED_COLD) < 0.9 and np.all(outcome != NEED_FULL)
    _, outcome, _ = check(zipf_row, SamplingParams(top_p=0.99), hot)
    assert np.all(outcome == NEED_FULL)
    _, outcome, _ = check(zipf_row, SamplingParams(top_p=0.5), hot)
    assert np.all(outcome == DECIDED)


def test_mass_in_the_cold_region(zipf_row):
    """Most of the mass outside H: the draw lands in C on most rows. 20,000
    draws measure that share within about 0.002 (one standard error); the
    distribution of such rows is held to DRAWS by the grid's misses-most-mass
    cases, on the same path."""
    _, outcome, _ = check(zipf_row, SamplingParams(temperature=1.2),
                          hot_sets(zipf_row)["misses-most-mass"], draws=20_000)
    assert np.mean(outcome == NEED_COLD) > 0.9


def test_an_unconditioned_fallback_is_caught(zipf_row):
    """The note in docs/HANDOFF.md: sampling a NEED_COLD row from its whole
    row (not conditioned on C) over-weights the known tokens; the same test
    rejects it, while the conditioned fallback passes."""
    hot = hot_sets(zipf_row)["head"]
    counts, outcome, batch = handoff_draws(zipf_row, SamplingParams(), hot,
                                           unconditioned_fallback=True)
    assert np.mean(outcome == NEED_COLD) > 0.1
    probs = reference.probabilities(zipf_row, batch, 0)
    assert goodness_of_fit(counts, probs) < P_VALUE_FLOOR


def test_power_a_one_percent_error_is_caught(zipf_row):
    counts, _, probs = check(zipf_row, SamplingParams(top_p=0.9), hot_sets(zipf_row)["random"])
    assert goodness_of_fit(counts, moved_one_percent(probs)) < P_VALUE_FLOOR


@pytest.mark.parametrize("hot_kind", ["head", "random"])
def test_penalties_bias_and_bans_touching_hot_and_cold_tokens(zipf_row, hot_kind):
    """Negative presence / frequency penalties raise cold tokens, a bias
    lifts a cold token to the top, bans hit hot and cold ids."""
    hot = hot_sets(zipf_row)[hot_kind]
    order = np.argsort(-zipf_row)
    hot_ids = set(hot.ids.tolist())
    cold = [int(t) for t in order if int(t) not in hot_ids]
    history = History(prompt_ids=order[:25].tolist() + cold[:10],
                      output_ids=order[5:15].tolist() * 2 + cold[3:8] * 3)
    for params in (
        SamplingParams(repetition_penalty=1.4, presence_penalty=0.6, frequency_penalty=0.3),
        SamplingParams(top_p=0.8, repetition_penalty=0.7, presence_penalty=-2.0,
                       frequency_penalty=-2.0),
        SamplingParams(top_p=0.8, logit_bias={int(order[0]): -4.0, cold[40]: 6.0}),
        SamplingParams(top_k=5, logit_bias={cold[200]: 9.0}),
        SamplingParams(min_p=0.1, logit_bias={cold[300]: 9.0}, temperature=0.0),
        SamplingParams(top_p=0.6, logit_bias={int(order[1]): -np.inf, cold[100]: 2.5},
                       min_tokens=5, stop_token_ids=[int(order[2]), cold[0]]),
    ):
        check(zipf_row, params, hot, history, draws=40_000)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(top_p=0.9),
                                    SamplingParams(temperature=0.0),
                                    SamplingParams(top_k=3, min_p=0.01)],
                         ids=["plain", "p0.9", "greedy", "k3"])
def test_every_hot_token_banned(zipf_row, params):
    """No hot token left: a greedy row is decided from the cold summary (its
    argmax), every other row goes on to a second stage."""
    hot = hot_sets(zipf_row)["head"]
    bans = {int(t): -np.inf for t in hot.ids}
    _, outcome, _ = check(zipf_row, SamplingParams(**{**params.__dict__, "logit_bias": bans}),
                          hot, draws=30_000)
    if params.temperature == 0.0:
        assert np.all(outcome == DECIDED)
    else:
        assert np.all(outcome != DECIDED)


@pytest.mark.parametrize("cold_wins", [True, False])
def test_greedy_ties_with_the_cold_argmax(cold_wins):
    """A hot and a cold id tie at the max: the lower id wins, as today."""
    row = np.linspace(-5, 0, 300).astype(np.float32)
    low, high = 40, 200
    row[[low, high]] = 3.0
    hot_id, cold_id = (high, low) if cold_wins else (low, high)
    hot = HotVocab(np.array([hot_id, 7, 299]), row.size)
    for temperature in (0.0, 9e-6):
        counts, outcome, _ = handoff_draws(row, SamplingParams(temperature=temperature), hot,
                                           draws=50)
        assert counts[low] == 50 and np.all(outcome == DECIDED)
    assert sample_requests(row, [SamplingParams(temperature=0.0)]).token_ids[0] == low


def test_cold_top_makes_top_p_rows_decidable(zipf_row):
    """cold_top hands the row's own largest cold logits over as touched ids:
    the nucleus then lies in the known set and the distribution holds."""
    hot = HotVocab(np.argsort(-zipf_row)[::2][:300], VOCAB)
    _, without, _ = check(zipf_row, SamplingParams(top_p=0.85), hot, draws=30_000)
    _, with_top, _ = check(zipf_row, SamplingParams(top_p=0.85), hot, draws=30_000, cold_top=2000)
    assert np.mean(without == NEED_FULL) == 1.0 and np.mean(with_top == DECIDED) == 1.0


def test_only_the_rows_that_need_cold_ids_carry_them(zipf_row):
    """row_cold_tops: truncated rows hand their largest cold logits over;
    greedy rows (always decided) and untruncated rows with a cold token
    (a draw in C takes it) carry none, unless the cold draw is off, and
    are decided all the same."""
    hot = hot_sets(zipf_row)["head"]
    batch = SamplingBatch.from_params([
        SamplingParams(seed=1), SamplingParams(temperature=0.0), SamplingParams(top_p=0.9, seed=2),
        SamplingParams(top_k=50, seed=3), SamplingParams(min_p=0.05, seed=4)])
    assert row_cold_tops(batch, 16, cold_draw=True).tolist() == [0, 0, 16, 16, 16]
    assert row_cold_tops(batch, 16, cold_draw=False).tolist() == [16, 0, 16, 16, 16]
    rows = compact_rows(torch.from_numpy(zipf_row).expand(5, VOCAB), batch, hot, 16)
    assert np.diff(rows.touched_offsets).tolist() == [0, 0, 16, 16, 16]
    assert (rows.cold_token[[0]] >= 0).all() and (rows.cold_token[1:] == -1).all()
    assert (sample_compact(rows, batch, hot).outcome[:2] == DECIDED).all()


def test_nucleus_boundary_within_the_mass_margin_falls_back():
    """top_p alone whose boundary moves with S_C by less than its margin:
    undecided (NEED_FULL), never a guess."""
    row = np.full(64, -np.inf, np.float32)
    row[:4] = 0.0                            # four known tokens of weight 1
    row[10] = -1.0                           # C: one token, weight e^-1
    hot = HotVocab(np.arange(4), 64)
    total = 4 + np.exp(-1.0)
    for top_p, expected in ((2.0 / total, NEED_FULL), (2.5 / total, DECIDED)):
        _, outcome, _ = handoff_draws(row, SamplingParams(top_p=top_p), hot, draws=20)
        assert np.all(outcome == expected), top_p


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"])
def test_half_rows(zipf_row, dtype):
    dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    half = zipf_row.astype(dtype)
    for params in (SamplingParams(top_p=0.9), SamplingParams()):
        counts, _, batch = handoff_draws(half, params, hot_sets(zipf_row)["random"], draws=30_000)
        probs = reference.probabilities(half.astype(np.float32), batch, 0)
        assert goodness_of_fit(counts, probs) > P_VALUE_FLOOR


def test_summary_against_float64(zipf_row):
    rng = np.random.default_rng(1)
    rows = np.stack([zipf_row, rng.normal(0, 4, VOCAB).astype(np.float32),
                     np.full(VOCAB, -np.inf, np.float32)])
    rows[2, hot_sets(zipf_row)["head"].ids[:5]] = 1.0     # no finite logit in C
    hot = hot_sets(zipf_row)["head"]
    batch = SamplingBatch.from_params(
        [SamplingParams(temperature=0.7, presence_penalty=0.5), SamplingParams(temperature=0.0),
         SamplingParams(logit_bias={3000: 1.0})],
        [History(prompt_ids=[1, 2, int(hot.ids[0])], output_ids=[9, 9]), History(), History()])
    offsets, ids = touched_lists(batch, hot)
    assert offsets.tolist() == [0, 3, 3, 4] and ids.tolist() == [1, 2, 9, 3000]
    c = hot_first_summary(torch.from_numpy(rows), hot.kernel_arrays()[0], offsets, ids,
                          batch.temperature).cpu()
    np.testing.assert_array_equal(c.hot_logits, rows[:, hot.kernel_arrays()[0]])
    np.testing.assert_array_equal(c.touched_logits, rows[[0, 0, 0, 2], [1, 2, 9, 3000]])
    for r, inv_t in ((0, 1 / 0.7), (1, 1.0)):
        cold = np.ones(VOCAB, bool)
        cold[hot.ids] = False
        cold[ids[offsets[r]:offsets[r + 1]]] = False
        x = np.where(cold, rows[r].astype(np.float64), -np.inf)
        assert c.cold_max[r] == x.max() and c.cold_argmax[r] == np.argmax(x)
        exact = np.exp((x - x.max()) * inv_t).sum()
        assert abs(c.cold_mass[r] / exact - 1) < 2e-6
    assert c.cold_max[2] == -np.inf and c.cold_argmax[2] == -1 and c.cold_mass[2] == 0


def outcomes_seen(cold_draw: bool) -> set:
    """The outcomes a mixed batch shows: no NEED_COLD with the cold draw."""
    return {DECIDED, NEED_FULL} if cold_draw else {DECIDED, NEED_FULL, NEED_COLD}


@pytest.mark.parametrize("cold_draw", [False, True])
def test_logprobs_are_the_full_paths(zipf_row, cold_draw):
    """Decided rows and fallback rows alike (with the data plane's cold
    tokens, the rows that drew in C are decided too): the chosen token's
    logprob and the top logprobs under the whole row's softmax."""
    rng = np.random.default_rng(5)
    hot = hot_sets(zipf_row)["head"]
    params = [SamplingParams(seed=int(s), **kind) for s, kind in zip(
        rng.integers(0, 2**63, 40), [dict(), dict(top_p=0.9), dict(temperature=0.0),
                                     dict(min_p=0.05, top_k=20), dict(top_p=0.999)] * 8)]
    rows = np.broadcast_to(zipf_row, (40, VOCAB))
    batch = SamplingBatch.from_params(params)
    out = sample_hot_first(rows, batch, hot, num_top_logprobs=3, cold_top=0, cold_draw=cold_draw)
    assert set(out.outcome.tolist()) == outcomes_seen(cold_draw)
    assert (~np.isin(out.token_ids, hot.ids)).any()  # tokens drawn in C
    for r in range(40):
        z = reference.scaled_logits(zipf_row, batch, r)
        expected = reference.log_softmax(z)
        assert abs(out.logprobs[r] - expected[out.token_ids[r]]) < 1e-4
        top = reference.rank_order(z)[:3]
        np.testing.assert_array_equal(out.top_token_ids[r], top)
        np.testing.assert_allclose(out.top_logprobs[r], expected[top], atol=1e-4)
    full = sample(rows, batch, num_top_logprobs=3)
    greedy = np.asarray(batch.temperature) == 0
    np.testing.assert_array_equal(out.token_ids[greedy], full.token_ids[greedy])


@pytest.mark.parametrize("cold_draw", [False, True])
def test_batch_position_and_thread_invariance(cold_draw):

    rng = np.random.default_rng(21)
    count = 48
    rows = make_rows(rng, count)
    params, histories, steps = make_requests(rng, count)
    batch = SamplingBatch.from_params(params, histories, steps)
    hot = HotVocab(rng.choice(rows.shape[1], 900, replace=False), rows.shape[1])
    run = lambda r, b, threads=1: sample_hot_first(r, b, hot, num_top_logprobs=2, cold_top=16,
                                                   num_threads=threads, cold_draw=cold_draw)
    base = run(rows, batch)
    assert set(base.outcome.tolist()) == outcomes_seen(cold_draw)
    for threads in (1, 2, 3):
        again = run(rows, batch, threads)
        np.testing.assert_array_equal(again.token_ids, base.token_ids)
        np.testing.assert_array_equal(again.logprobs, base.logprobs)
        np.testing.assert_array_equal(again.outcome, base.outcome)
    perm = rng.permutation(count)
    shuffled = run(rows[perm], batch.take(perm))
    np.testing.assert_array_equal(shuffled.token_ids, base.token_ids[perm])
    np.testing.assert_array_equal(shuffled.logprobs, base.logprobs[perm])
    for r in range(0, count, 5):
        alone = run(rows[r:r + 1], batch.take([r]))
        assert alone.token_ids[0] == base.token_ids[r] and alone.outcome[0] == base.outcome[r]


def test_bad_input_names_the_field(zipf_row):
    hot = hot_sets(zipf_row)["head"]
    batch = SamplingBatch.from_params([SamplingParams(presence_penalty=0.5, seed=1)],
                                      [History(output_ids=[4000])])
    offsets, ids = touched_lists(batch, hot)
    good = hot_first_summary(torch.from_numpy(zipf_row[None]), hot.kernel_arrays()[0], offsets,
                             ids, batch.temperature).cpu()
    missing = CompactRows(**{**good.__dict__, "touched_offsets": np.zeros(2, np.int64),
                             "touched_ids": np.zeros(0, np.int32),
                             "touched_logits": np.zeros(0, np.float32)})
    with pytest.raises(ValueError, match="row 0: touched_ids must list .* 4000 is missing"):
        sample_compact(missing, batch, hot)
    with pytest.raises(ValueError, match="hot_logits must have shape"):
        sample_compact(CompactRows(**{**good.__dict__, "hot_logits": good.hot_logits[:, :5]}),
                       batch, hot)
    hot_id = int(hot.ids[0])
    with pytest.raises(ValueError, match=f"touched_ids must not hold hot ids, got {hot_id}"):
        sample_compact(CompactRows(**{**good.__dict__, "touched_ids": np.array([hot_id], np.int32)}),
                       batch, hot)
    cold = [t for t in range(VOCAB) if hot.positions()[t] < 0][:2]
    two = {"touched_offsets": np.array([0, 2]), "touched_logits": np.zeros(2, np.float32)}
    for changed, message in (
            ({"touched_ids": np.array([VOCAB], np.int32)}, rf"token ids in \[0, {VOCAB}\), got {VOCAB}"),
            ({"touched_ids": np.array([-3], np.int64)}, r"got -3"),
            ({"touched_ids": np.array([2**40], np.int64)}, rf"got {2**40}"),
            ({**two, "touched_ids": np.array(cold[::-1], np.int32)}, "ascending and distinct"),
            ({**two, "touched_ids": np.array([cold[0]] * 2, np.int32)}, "ascending and distinct"),
            ({"cold_argmax": np.array([VOCAB])}, r"cold_argmax must be -1 or a token id")):
        with pytest.raises(ValueError, match=message):
            sample_compact(CompactRows(**{**good.__dict__, **changed}), batch, hot)
    for bad, column in ((np.nan, 17), (np.inf, int(hot.ids[3]))):
        row = zipf_row.copy()
        row[column] = bad
        with pytest.raises(ValueError, match=f"row 0: .*column {column}"):
            sample_hot_first(row[None], batch, hot)
    banned = SamplingBatch.from_params([SamplingParams(logit_bias={t: -np.inf
                                                                   for t in range(VOCAB)})])
    with pytest.raises(ValueError, match="every token is banned"):
        sample_hot_first(zipf_row[None], banned, hot)


def _local_call(hot, requests=None):
    """The sampler model's code in-process (``serve_request``: the llm
    model's compact requests by its C path), with the model's hot set;
    `requests` (a list) gets each request's (compact or full, rows, by
    reference or not)."""
    from simple_sampler.row_reader import RowReader
    from simple_sampler.triton.sampler_serve import serve_request

    reader = RowReader()  # full rows come from the service's arena by reference

    def call(inputs):
        if requests is not None:
            requests.append(("compact" if "hot_logits" in inputs else "full",
                             len(inputs["row_scalars"]), "logits_ref" in inputs))
        return serve_request(inputs, 0, hot, reader).outputs
    return call


def _local_pool(hot, capacity=2, requests=None, arena=None, lanes=1):
    """A SamplerPool of one target running ``_local_call``; with `arena`, the
    target maps it (rows by reference); `lanes`: the decode loop's."""
    from simple_sampler.triton.sampler_pool import SamplerPool
    from simple_sampler.triton.sampler_targets import SamplerTarget

    return SamplerPool([SamplerTarget("local", _local_call(hot, requests), capacity,
                                      shares_memory=arena is not None)], arena=arena,
                       lanes=lanes)


def test_compact_rows_through_the_sampler_codec(zipf_row):
    """compact_arrays -> decode_request -> sample_request gives
    sample_compact's answers; bad combinations are refused by name."""
    from simple_sampler.schema import InvalidRequest
    from simple_sampler.triton.sampler_codec import batch_arrays, compact_arrays
    from simple_sampler.triton.sampler_decode import decode_request
    from simple_sampler.triton.sampler_serve import sample_request

    hot = hot_sets(zipf_row)["random"]
    rng = np.random.default_rng(9)
    params = [SamplingParams(seed=int(s), **kind) for s, kind in zip(
        rng.integers(0, 2**63, 12), [dict(), dict(top_p=0.9, presence_penalty=-1.0),
                                     dict(temperature=0.0), dict(top_p=0.999)] * 3)]
    histories = [History(prompt_ids=[5, 6], output_ids=[int(t)]) for t in rng.integers(0, VOCAB, 12)]
    batch = SamplingBatch.from_params(params, histories)
    rows = np.broadcast_to(zipf_row, (12, VOCAB))
    offsets, ids = touched_lists(batch, hot)
    compact = hot_first_summary(torch.from_numpy(np.ascontiguousarray(rows)),
                                hot.kernel_arrays()[0], offsets, ids, batch.temperature, 0).cpu()
    direct = sample_compact(compact, batch, hot)
    inputs = {**compact_arrays(compact), **batch_arrays(batch),
              "return_log_probs": np.ones((12, 1), bool)}
    outputs, _ = sample_request(decode_request(inputs, VOCAB, hot), 1, hot)
    np.testing.assert_array_equal(outputs["output_ids"][:, 0], direct.token_ids)
    np.testing.assert_array_equal(outputs["handoff_outcome"][:, 0], direct.outcome)
    np.testing.assert_array_equal(outputs["output_log_probs"][:, 0], direct.logprobs)
    assert set(direct.outcome.tolist()) == {DECIDED, NEED_FULL, NEED_COLD}
    with pytest.raises(InvalidRequest, match="hot_logits needs a sampler with a hot set"):
        decode_request(inputs, VOCAB)
    with pytest.raises(InvalidRequest, match="send logits or the compact rows"):
        decode_request({**inputs, "logits": rows}, VOCAB, hot)
    with pytest.raises(InvalidRequest, match=r"hot_logits must have shape \[B, 700\]"):
        decode_request({**inputs, "hot_logits": compact.hot_logits[:, :10]}, VOCAB, hot)


@pytest.mark.parametrize("cold_draw", [False, True])
def test_the_one_host_handoff_draws_the_served_tokens(cold_draw):
    """``sample_hot_first`` samples its undecided rows with the hot set on,
    as a sampler instance holding it does (``decide_from_full_rows``, the
    served in-place round): the same token for every row, those SHVS can
    decide among them (rows that ask for no logprob)."""
    from simple_sampler.handoff import decide_from_full_rows

    rng = np.random.default_rng(5)
    count, vocab = 240, 5000
    rows = make_rows(rng, count, vocab)
    params, histories, steps = make_requests(rng, count, vocab=vocab)
    batch = SamplingBatch.from_params(params, histories, steps, vocab)
    batch.want_logprobs = np.zeros(count, bool)
    hot = HotVocab(np.sort(rng.choice(vocab, 300, replace=False)), vocab)
    one_host = sample_hot_first(rows, batch, hot, return_logprobs=False, num_threads=1,
                                cold_draw=cold_draw)
    compact = compact_rows(torch.from_numpy(rows), batch, hot, cold_draw=cold_draw)
    served = sample_compact(compact, batch, hot, return_logprobs=False, num_threads=1)
    assert (served.outcome != DECIDED).sum() > count // 10
    decide_from_full_rows(served, compact, batch, hot, rows, batch.want_logprobs, num_threads=1)
    np.testing.assert_array_equal(one_host.token_ids, served.token_ids)


class _RefusesFullRows:
    """A pool whose compact requests are answered and whose full rows are
    refused, as the kernels refuse a row (serving/samplers.refuses_rows)."""

    def __init__(self, pool):
        self.pool = pool

    def __getattr__(self, name):
        return getattr(self.pool, name)

    async def __call__(self, logits, batch):
        raise ValueError("row 0: logits must not contain NaN; found at column 7")


@pytest.mark.parametrize("cold_draw", [False, True])
def test_hot_first_sampler_through_a_pool(cold_draw):
    """The decode loop's wrapper: compact rows to the pool's targets, then
    the undecided rows whole; the same tokens as the steps run in-process,
    whatever the sharding, with the cold tokens drawn or not. The second
    round: ONE_LANE_ROWS_PER_REQUEST rows to a request over the instances
    with one lane, sampler_shard_min_rows with two: as the pool shards full rows."""
    import asyncio

    from simple_sampler.triton.hot_first_sampler import HotFirstSampler
    from simple_sampler.triton.sampler_pool import ONE_LANE_ROWS_PER_REQUEST

    rng = np.random.default_rng(33)
    rows = make_rows(rng, 40)
    params, histories, steps = make_requests(rng, 40)
    batch = SamplingBatch.from_params(params, histories, steps)
    hot = HotVocab(rng.choice(rows.shape[1], 900, replace=False), rows.shape[1])
    compact = compact_rows(torch.from_numpy(rows), batch, hot, 16, cold_draw=cold_draw)
    expected = sample_compact(compact, batch, hot)
    undecided, second_batch = fallback_batch(batch, expected, compact, hot)
    merge_fallback(expected, undecided, sample(rows[undecided], second_batch, hot_vocab=hot))
    assert set(expected.outcome.tolist()) == outcomes_seen(cold_draw)
    undecided_rows = len(undecided)
    assert undecided_rows > ONE_LANE_ROWS_PER_REQUEST  # so that one lane's round is split
    cases = ((1, 8, 1, 1), (3, 8, 3, 1), (3, 16, 3, 1), (3, 40, 1, 1), (3, 8, 3, 2))
    for capacity, per_request, compact_requests, lanes in cases:
        requests = []
        sampler = HotFirstSampler(_local_pool(hot, capacity, requests, lanes=lanes), hot,
                                  cold_top=16, rows_per_request=per_request,
                                  cold_draw=cold_draw)
        tokens, logprobs = asyncio.run(sampler(torch.from_numpy(rows), batch))
        np.testing.assert_array_equal(tokens, expected.token_ids)
        np.testing.assert_array_equal(logprobs, expected.logprobs)
        assert sampler.stats["rows"] == 40 and sampler.stats["need_full"] > 0
        second = [rows for kind, rows, _ in requests if kind == "full"]
        assert sum(second) == undecided_rows
        # one lane: over the instances, ONE_LANE_ROWS_PER_REQUEST rows at least;
        # two: as full rows are (the pool's 64 at least: one request here)
        shards = min(capacity, undecided_rows // ONE_LANE_ROWS_PER_REQUEST) if lanes == 1 else 1
        assert len(second) == shards and min(second) >= min(undecided_rows,
                                                            ONE_LANE_ROWS_PER_REQUEST), second
        assert sum(1 for kind, _, _ in requests if kind == "compact") == compact_requests, \
            "a request per instance, but at least rows_per_request rows in each"
        refused = HotFirstSampler(_RefusesFullRows(sampler.pool), hot, cold_top=16,
                                  rows_per_request=per_request, cold_draw=cold_draw)
        with pytest.raises(ValueError, match="row 0: "):
            asyncio.run(refused(torch.from_numpy(rows), batch))
        # counted once answered: the search around the refusal counts its parts
        assert refused.stats == dict.fromkeys(refused.stats, 0)


def test_full_rows_are_referenced_only_when_a_row_may_be_left_undecided():
    """The decode loop's compact requests name the full rows (logits_ref)
    only when a row may need them (``hot_first.undecidable_rows``: a
    truncated row, or any sampled row without the cold draw); without, the
    synchronous path answers wherever the rows lie, the event loop's tokens.
    A row left undecided all the same is sent once more with its full row
    where it lies in the arena, else takes the event loop's second round."""
    import asyncio

    from simple_sampler.row_arena import RowArena
    from simple_sampler.serving.hot_first import undecidable_rows
    from simple_sampler.triton.hot_first_sampler import HotFirstSampler

    rng = np.random.default_rng(72)
    rows = make_rows(rng, 24)
    hot = HotVocab(rng.choice(rows.shape[1], 900, replace=False), rows.shape[1])
    kinds = [dict(), dict(temperature=0.0), dict(temperature=0.7, repetition_penalty=1.2)]
    plain = SamplingBatch.from_params([SamplingParams(seed=s, **kinds[s % 3]) for s in range(24)])
    truncated = SamplingBatch.from_params([SamplingParams(seed=s, top_p=0.9) if s == 5
                                           else SamplingParams(seed=s) for s in range(24)])
    assert not undecidable_rows(plain, True).any() and undecidable_rows(plain, False).any()
    assert undecidable_rows(truncated, True).tolist() == [s == 5 for s in range(24)]
    arena = RowArena(1, 4096)
    try:
        shared = torch.from_numpy(arena.share(rows))
        for batch, cold_draw, by_reference in ((plain, True, False), (plain, False, True),
                                               (truncated, True, True)):
            expected = asyncio.run(HotFirstSampler(_local_pool(hot), hot, cold_top=16,
                                                   cold_draw=cold_draw)(shared, batch))
            requests = []
            sampler = HotFirstSampler(_local_pool(hot, 2, requests, arena), hot, cold_top=16,
                                      cold_draw=cold_draw)
            tokens, logprobs = sampler.sample_now(shared, batch, sampler.summarize(shared, batch))
            np.testing.assert_array_equal(tokens, expected[0])
            np.testing.assert_array_equal(logprobs, expected[1])
            assert requests == [("compact", 24, by_reference)]
        # rows outside the arena, none undecidable: answered all the same, the
        # event loop's tokens and logprobs (seeded)
        outside = torch.from_numpy(rows)
        expected = asyncio.run(HotFirstSampler(_local_pool(hot), hot, cold_top=16)(outside, plain))
        sampler = HotFirstSampler(_local_pool(hot), hot, cold_top=16)
        answer = sampler.sample_now(outside, plain, sampler.summarize(outside, plain))
        assert answer is not None
        np.testing.assert_array_equal(answer[0], expected[0])
        np.testing.assert_array_equal(answer[1], expected[1])
        # rows left undecided all the same (told none could be): sent once more
        # with their full rows, or, outside the arena, the event loop's two rounds
        expected = asyncio.run(HotFirstSampler(_local_pool(hot), hot, cold_top=16,
                                               cold_draw=False)(shared, plain))
        requests = []
        sampler = HotFirstSampler(_local_pool(hot, 2, requests, arena), hot, cold_top=16,
                                  cold_draw=False)
        summary = sampler.summarize(shared, plain)._replace(undecidable=False)
        tokens, logprobs = sampler.sample_now(shared, plain, summary)
        np.testing.assert_array_equal(tokens, expected[0])
        np.testing.assert_array_equal(logprobs, expected[1])
        assert requests == [("compact", 24, False), ("compact", 24, True)]
        assert sampler.stats["in_place"] > 0
        requests.clear()
        summary = summary._replace(full_rows=None)
        assert sampler.sample_now(shared, plain, summary) is None
        tokens, logprobs = asyncio.run(sampler(shared, plain, summary))
        np.testing.assert_array_equal(tokens, expected[0])
        np.testing.assert_array_equal(logprobs, expected[1])
        assert [(kind, by_reference) for kind, _, by_reference in requests] == [
            ("compact", False), ("compact", False), ("full", False)]
    finally:
        arena.close()


def _two_rounds_and_in_place(rows, batch, hot, arena, targets=None, capacity=2):
    """(the two-round path's HotFirstSampler answers, the answers and
    sampler with the rows shared in `arena`, its requests); `targets`: the
    second pool's targets (default: one that maps the arena)."""
    import asyncio

    from simple_sampler.triton.hot_first_sampler import HotFirstSampler
    from simple_sampler.triton.sampler_pool import SamplerPool

    # Without the cold draw: the NEED_COLD rows' second round is what is tested.
    two_rounds = HotFirstSampler(_local_pool(hot, capacity), hot, cold_top=16, rows_per_request=8,
                                 cold_draw=False)
    expected = asyncio.run(two_rounds(torch.from_numpy(rows), batch))
    shared = torch.from_numpy(arena.share(rows))  # as the simulated engine's bank
    requests = []
    pool = (SamplerPool(targets, arena=arena) if targets is not None
            else _local_pool(hot, capacity, requests, arena))
    sampler = HotFirstSampler(pool, hot, cold_top=16, rows_per_request=8, cold_draw=False)
    return expected, asyncio.run(sampler(shared, batch)), sampler, requests, two_rounds


def test_undecided_rows_with_mapped_full_rows_are_decided_in_the_same_request():
    """Compact requests that carry the full rows by reference (logits_ref)
    decide NEED_FULL and NEED_COLD rows in place: no second request, and
    row for row the two-round path's tokens and logprobs, over many seeds
    and the rows' own return_log_probs."""
    from simple_sampler.row_arena import RowArena

    totals = {"need_full": 0, "need_cold": 0, "in_place": 0}
    for seed in range(8):
        rng = np.random.default_rng(100 + seed)
        rows = make_rows(rng, 48)
        params, histories, steps = make_requests(rng, 48, seed_base=1000 * seed)
        batch = SamplingBatch.from_params(params, histories, steps)
        if seed % 2:
            batch.want_logprobs = rng.random(48) < 0.3
        hot = HotVocab(rng.choice(rows.shape[1], 900, replace=False), rows.shape[1])
        arena = RowArena(1, 4096)
        try:
            expected, got, sampler, requests, two_rounds = _two_rounds_and_in_place(
                rows, batch, hot, arena)
        finally:
            arena.close()
        np.testing.assert_array_equal(got[0], expected[0])
        np.testing.assert_array_equal(got[1], expected[1])
        assert all(kind == "compact" and by_reference for kind, _, by_reference in requests), \
            "every row decided in the compact requests"
        assert sampler.stats["in_place"] == sampler.stats["need_full"] + sampler.stats["need_cold"]
        assert two_rounds.stats["in_place"] == 0
        for name in totals:
            totals[name] += sampler.stats[name]
    assert totals["need_full"] > 10 and totals["need_cold"] > 10, totals


@pytest.mark.parametrize("asking, in_place", [(np.s_[:], True), (np.s_[1::3], True),
                                              ([0, 1, 5, 30], False)])
def test_rows_asking_top_logprobs_are_scored_where_they_lie_in_the_arena(asking, in_place):
    """Rows of a shared region (the simulated engine's bank) that ask for
    top logprobs are scored in a request of their own (``decide_hot_first``):
    evenly spaced (every row, every third), by reference where they lie, no
    slot taken; unevenly spaced, copied into a slot as before. Either way
    the tokens, logprobs and top logprobs of the rows outside the arena."""
    import asyncio

    from simple_sampler.row_arena import RowArena
    from simple_sampler.triton.hot_first_sampler import HotFirstSampler

    rng = np.random.default_rng(83)
    rows = make_rows(rng, 48)
    params, histories, steps = make_requests(rng, 48)
    batch = SamplingBatch.from_params(params, histories, steps)
    batch.num_top_logprobs = np.zeros(48, np.int32)
    batch.num_top_logprobs[asking] = 3
    hot = HotVocab(rng.choice(rows.shape[1], 900, replace=False), rows.shape[1])
    expected = asyncio.run(HotFirstSampler(_local_pool(hot), hot, cold_top=16)(
        torch.from_numpy(rows), batch))
    arena = RowArena(1, rows.nbytes)
    try:
        shared = torch.from_numpy(arena.share(rows))
        requests = []
        sampler = HotFirstSampler(_local_pool(hot, 2, requests, arena), hot, cold_top=16)
        got = asyncio.run(sampler(shared, batch))
        slots_taken = arena.generation
    finally:
        arena.close()
    for got_part, expected_part in zip((*got[:2], *got[2]), (*expected[:2], *expected[2])):
        np.testing.assert_array_equal(got_part, expected_part)
    asked = int(np.count_nonzero(batch.num_top_logprobs))
    scoring = [(size, by_reference) for kind, size, by_reference in requests if kind == "full"]
    assert sum(size for size, _ in scoring) == asked and all(by_reference for _, by_reference in scoring)
    assert slots_taken == (0 if in_place else 1)


def test_the_synchronous_path_answers_as_the_event_loops_and_gives_way_when_it_cannot():
    """``HotFirstSampler.sample_now`` (the decode loop's one-lane path, in
    its data-plane thread): with the full rows in the arena, one compact
    request answers every row, with the event loop's tokens and logprobs;
    rows not in the arena, a step of several requests, a target that cannot
    map the arena and a failed request (its target marked down, a retry
    counted) give way (None), and a refused one raises. A step of several
    requests is answered so too, the requests sent at once."""
    import asyncio

    from simple_sampler.row_arena import RowArena
    from simple_sampler.triton.hot_first_sampler import HotFirstSampler
    from simple_sampler.triton.sampler_pool import SamplerPool
    from simple_sampler.triton.sampler_targets import SamplerCallError, SamplerTarget

    rng = np.random.default_rng(71)
    rows = make_rows(rng, 48)
    params, histories, steps = make_requests(rng, 48)
    batch = SamplingBatch.from_params(params, histories, steps)
    hot = HotVocab(rng.choice(rows.shape[1], 900, replace=False), rows.shape[1])
    arena = RowArena(1, 4096)
    try:
        expected = asyncio.run(HotFirstSampler(_local_pool(hot), hot, cold_top=16)(
            torch.from_numpy(rows), batch))
        shared = torch.from_numpy(arena.share(rows))
        requests = []
        sampler = HotFirstSampler(_local_pool(hot, 2, requests, arena), hot, cold_top=16)
        summary = sampler.summarize(shared, batch)
        tokens, logprobs = sampler.sample_now(shared, batch, summary)
        np.testing.assert_array_equal(tokens, expected[0])
        np.testing.assert_array_equal(logprobs, expected[1])
        assert requests == [("compact", 48, True)]
        assert sampler.stats["rows"] == 48
        assert sampler.stats["in_place"] > 0, "undecided rows were decided in the same request"
        # not in the arena: the event loop's two rounds
        assert sampler.sample_now(torch.from_numpy(rows), batch,
                                  sampler.summarize(torch.from_numpy(rows), batch)) is None
        # more than one request for the step: sent at once, the same answers
        requests.clear()
        split = HotFirstSampler(_local_pool(hot, 2, requests, arena), hot, cold_top=16,
                                rows_per_request=8)
        tokens, logprobs = split.sample_now(shared, batch, summary)
        np.testing.assert_array_equal(tokens, expected[0])
        np.testing.assert_array_equal(logprobs, expected[1])
        assert requests == [("compact", 24, True)] * 2 and split.stats["rows"] == 48

        def failing(retryable):
            def call(inputs):
                raise SamplerCallError("instance gone", retryable=retryable)
            return call

        # a target that cannot map the arena (a remote one) is not sent to
        calls = []
        pool = SamplerPool([SamplerTarget("remote", calls.append, 2),
                            SamplerTarget("local", calls.append, 1, shares_memory=True)],
                           arena=arena)
        assert HotFirstSampler(pool, hot, cold_top=16).sample_now(shared, batch,
                                                                  summary) is None
        assert calls == []
        retries = []
        pool = SamplerPool([SamplerTarget("local", failing(True), 2, shares_memory=True)],
                           on_retry=lambda: retries.append(1), arena=arena)
        failed = HotFirstSampler(pool, hot, cold_top=16)
        assert failed.sample_now(shared, batch, summary) is None
        assert retries == [1] and not pool.targets[0].is_up(time.monotonic())
        # one request of the step's two fails: given way, only its target marked down
        pool = SamplerPool([SamplerTarget("gone", failing(True), 1, shares_memory=True),
                            SamplerTarget("local", _local_call(hot), 1, shares_memory=True)],
                           on_retry=lambda: retries.append(2), arena=arena)
        assert HotFirstSampler(pool, hot, cold_top=16, rows_per_request=24).sample_now(
            shared, batch, summary) is None
        assert retries == [1, 2] and [t.is_up(time.monotonic()) for t in pool.targets] == \
            [False, True]
        pool = SamplerPool([SamplerTarget("local", failing(False), 2, shares_memory=True)],
                           arena=arena)
        with pytest.raises(SamplerCallError, match="instance gone"):
            HotFirstSampler(pool, hot, cold_top=16).sample_now(shared, batch, summary)
    finally:
        arena.close()


def test_full_rows_by_reference_beside_compact_rows_are_checked(zipf_row):
    """logits_ref beside the compact rows must name exactly their rows; not
    beside logits."""
    from simple_sampler.row_arena import RowArena
    from simple_sampler.row_reader import RowReader
    from simple_sampler.schema import InvalidRequest
    from simple_sampler.triton.sampler_codec import batch_arrays, compact_arrays
    from simple_sampler.triton.sampler_decode import decode_request
    from simple_sampler.triton.sampler_serve import serve_request

    hot = hot_sets(zipf_row)["random"]
    batch = SamplingBatch.from_params([SamplingParams(seed=s) for s in range(4)])
    rows = np.ascontiguousarray(np.broadcast_to(zipf_row, (4, VOCAB)))
    offsets, ids = touched_lists(batch, hot)
    compact = hot_first_summary(torch.from_numpy(rows), hot.kernel_arrays()[0], offsets, ids,
                                batch.temperature, 0).cpu()
    arena = RowArena(1, 4096)
    try:
        lease = arena.reference(arena.share(rows))
        inputs = {**compact_arrays(compact), **batch_arrays(batch, packed=True)}
        reader = RowReader()
        decoded = decode_request({**inputs, "logits_ref": lease.refs()}, VOCAB, hot, reader)
        assert decoded.logits.shape == (4, VOCAB) and decoded.compact is not None
        with pytest.raises(InvalidRequest, match=r"must name their 4 full rows of V=4096, got \[3"):
            decode_request({**inputs, "logits_ref": lease.refs(0, 3)}, VOCAB, hot, reader)
        # the llm model's form, which serve_request decides in C: refused the same way
        packed = {**compact_arrays(compact, packed=True), **batch_arrays(batch, packed=True)}
        assert serve_request({**packed, "logits_ref": lease.refs()}, VOCAB, hot, reader).rows == 4
        # references of another dtype go the general way, which reads (and here refuses) them
        with pytest.raises(InvalidRequest, match="logits_ref names region"):
            serve_request({**packed, "logits_ref": lease.refs().astype(np.int32)}, VOCAB, hot,
                          reader)
        with pytest.raises(InvalidRequest, match=r"must name their 4 full rows of V=4096, got \[3"):
            serve_request({**packed, "logits_ref": lease.refs(0, 3)}, VOCAB, hot, reader)
        with pytest.raises(InvalidRequest, match="logits_ref needs a sampler on the llm model's"):
            serve_request({**packed, "logits_ref": lease.refs()}, VOCAB, hot, None)
        with pytest.raises(InvalidRequest, match="send logits_ref or logits, not both"):
            decode_request({**batch_arrays(batch, packed=True), "logits": rows,
                            "logits_ref": lease.refs()}, VOCAB, hot, reader)
    finally:
        arena.close()


def test_references_are_resolved_only_for_rows_the_compact_decision_leaves(zipf_row):
    """On serve_request's C path the full rows behind logits_ref are read
    (mapped, their slot's generation checked) only for an undecided row: a
    slot given back meanwhile costs nothing when every row is decided from
    its compact form, and is caught when a row needs it."""
    from simple_sampler.row_arena import RowArena, StaleRows
    from simple_sampler.row_reader import RowReader
    from simple_sampler.triton.sampler_codec import batch_arrays, compact_arrays
    from simple_sampler.triton.sampler_serve import serve_request

    hot = hot_sets(zipf_row)["head"]  # top_p 0.5 decided from it, 0.99 needs the full row
    rows = np.ascontiguousarray(np.broadcast_to(zipf_row, (4, VOCAB)))
    arena = RowArena(1, rows.nbytes)
    try:
        lease = arena.lease(rows)
        refs = lease.refs()
        lease.release()  # given back: the references are stale
        for top_p, decided in ((0.5, True), (0.99, False)):
            batch = SamplingBatch.from_params([SamplingParams(seed=s, top_p=top_p)
                                               for s in range(4)])
            offsets, ids = touched_lists(batch, hot)
            compact = hot_first_summary(torch.from_numpy(rows), hot.kernel_arrays()[0], offsets,
                                        ids, batch.temperature, 0).cpu()
            packed = {**compact_arrays(compact, packed=True), **batch_arrays(batch, packed=True),
                      "logits_ref": refs}
            if decided:
                served = serve_request(packed, VOCAB, hot, RowReader())
                assert served.rows == 4 and served.in_place == 0
                assert "handoff_outcome" not in served.outputs  # all decided: not sent
            else:
                with pytest.raises(StaleRows, match="was given back"):
                    serve_request(packed, VOCAB, hot, RowReader())
    finally:
        arena.close()


@pytest.mark.parametrize("dtype, bad", [(np.int32, -5), (np.int32, 4096), (np.int64, 5000)])
def test_touched_ids_out_of_range_are_refused_by_name(zipf_row, dtype, bad):
    """decode_request checks int32 touched ids in its Cython pass and
    others through numpy: either way the request is refused by name, row
    and range."""
    from simple_sampler.schema import InvalidRequest
    from simple_sampler.triton.sampler_codec import batch_arrays, compact_arrays
    from simple_sampler.triton.sampler_decode import decode_request
    from simple_sampler.triton.sampler_serve import sample_request, serve_request

    message = rf"row 0: touched_ids must be token ids in \[0, 4096\) or -1 \(padding\), got {bad}"

    hot = hot_sets(zipf_row)["random"]
    batch = SamplingBatch.from_params([SamplingParams(seed=s) for s in range(2)])
    offsets, ids = touched_lists(batch, hot)
    compact = hot_first_summary(torch.from_numpy(np.ascontiguousarray(
        np.broadcast_to(zipf_row, (2, VOCAB)))), hot.kernel_arrays()[0], offsets, ids,
        batch.temperature, 4).cpu()
    inputs = {**compact_arrays(compact), **batch_arrays(batch, packed=True)}
    touched = inputs["touched_ids"].astype(dtype)
    touched[0, 0] = bad
    with pytest.raises(InvalidRequest, match=message):
        sample_request(decode_request({**inputs, "touched_ids": touched}, VOCAB, hot), 1, hot)
    packed = {**compact_arrays(compact, packed=True), **batch_arrays(batch, packed=True)}
    with pytest.raises(InvalidRequest, match=message):  # the C path leaves it to the general one
        serve_request({**packed, "touched_ids": touched}, VOCAB, hot)


def test_a_target_without_the_arena_keeps_the_second_round():
    """A target that does not map the arena (a remote server) gets the
    compact rows alone; its undecided rows go whole in a second request;
    the tokens are the same as everywhere."""
    from simple_sampler.row_arena import RowArena
    from simple_sampler.triton.sampler_targets import SamplerTarget

    rng = np.random.default_rng(7)
    rows = make_rows(rng, 64)
    params, histories, steps = make_requests(rng, 64)
    batch = SamplingBatch.from_params(params, histories, steps)
    hot = HotVocab(rng.choice(rows.shape[1], 900, replace=False), rows.shape[1])
    local, remote = [], []
    arena = RowArena(1, 4096)
    try:
        expected, got, sampler, _, _ = _two_rounds_and_in_place(
            rows, batch, hot, arena,
            [SamplerTarget("local", _local_call(hot, local), 1, shares_memory=True),
             SamplerTarget("remote", _local_call(hot, remote), 1)])
    finally:
        arena.close()
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_array_equal(got[1], expected[1])
    assert [by_reference for kind, _, by_reference in local if kind == "compact"] == [True]
    assert [by_reference for kind, _, by_reference in remote if kind == "compact"] == [False]
    from simple_sampler.triton.sampler_pool import ONE_LANE_ROWS_PER_REQUEST

    second = [rows for kind, rows, _ in local + remote if kind == "full"]
    left = sampler.stats["need_full"] + sampler.stats["need_cold"] - sampler.stats["in_place"]
    assert 0 < sampler.stats["in_place"] and sum(second) == left > 0, sampler.stats
    # one lane: the second round over both targets, ONE_LANE_ROWS_PER_REQUEST rows at least
    assert len(second) == max(1, min(2, left // ONE_LANE_ROWS_PER_REQUEST)), second


@pytest.mark.parametrize("survivor_maps_the_arena", [True, False])
def test_a_dead_instance_mid_step_gives_the_same_tokens_hot_first(survivor_maps_the_arena):
    """Failover with the full rows by reference: the compact request sent
    again to an instance that maps the arena decides its undecided rows
    there; to one that does not, they go whole in a second request; the
    tokens are the two-round path's either way."""
    from simple_sampler.row_arena import RowArena
    from simple_sampler.triton.sampler_targets import SamplerCallError, SamplerTarget

    def dead(inputs):
        raise SamplerCallError("Stub process 'simple_sampler_0_0' is not healthy.")

    rng = np.random.default_rng(11)
    rows = make_rows(rng, 32)
    params, histories, steps = make_requests(rng, 32)
    batch = SamplingBatch.from_params(params, histories, steps)
    hot = HotVocab(rng.choice(rows.shape[1], 900, replace=False), rows.shape[1])
    survivor = []
    arena = RowArena(1, 4096)
    try:
        expected, got, sampler, _, _ = _two_rounds_and_in_place(
            rows, batch, hot, arena,
            [SamplerTarget("dead", dead, 2, shares_memory=True),
             SamplerTarget("alive", _local_call(hot, survivor), 1,
                           shares_memory=survivor_maps_the_arena)])
    finally:
        arena.close()
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_array_equal(got[1], expected[1])
    undecided = sampler.stats["need_full"] + sampler.stats["need_cold"]
    assert undecided > 0
    second = [rows for kind, rows, _ in survivor if kind == "full"]
    if survivor_maps_the_arena:
        assert sampler.stats["in_place"] == undecided and not second
    else:
        assert sampler.stats["in_place"] == 0 and second == [undecided]


def test_rows_off_the_cpu_or_outside_the_arena_are_not_referenced():
    from simple_sampler.row_arena import RowArena
    from simple_sampler.triton.sampler_pool import SamplerPool
    from simple_sampler.triton.sampler_targets import SamplerTarget

    arena = RowArena(1, 4096)
    try:
        shared = torch.from_numpy(arena.share(np.zeros((4, 8), np.float32)))
        pool = SamplerPool([SamplerTarget("local", None, 1, shares_memory=True)], arena=arena)
        assert pool.reference(shared[1:3]).refs().shape == (2, 6)
        assert pool.reference(torch.zeros(4, 8)) is None  # not in a shared region
        assert pool.reference(torch.empty(4, 8, device="meta")) is None  # on a device
        pool.targets[0].shares_memory = False
        assert pool.reference(shared) is None  # no instance maps the arena
    finally:
        arena.close()


def test_the_decode_loop_hands_rows_over_hot_first(tmp_path):
    """LlmService with handoff hot-first and a sampler profile wraps its pool
    in a HotFirstSampler; greedy generations equal the full rows' ones."""
    from simple_sampler.serving.text import TextCodec
    from simple_sampler.settings import LlmSettings
    from simple_sampler.shvs.hot_vocab import HotProfile
    from simple_sampler.triton.llm_service import LlmService
    from fakes import VOCAB as FAKE_VOCAB, FakeEngine, FakeTokenizer
    from fakes import Client, inputs

    hot = HotVocab(np.arange(2, FAKE_VOCAB, 3), FAKE_VOCAB)
    HotProfile(order=hot.ids.astype(np.int32), vocab_size=FAKE_VOCAB, sizes=np.array([hot.size]),
               curves={}, chosen_size=hot.size, mass=np.ones(hot.size)).save(
        tmp_path / "simple_sampler" / "hot.npz")

    def generate(handoff):
        settings = LlmSettings(sampling_mode="simple", sampler_shards=2, handoff=handoff,
                               hot_vocab_profile="hot.npz")
        service = LlmService(settings, sampler_call=_local_pool(hot).targets[0].call,
                             engine=FakeEngine(max_batch_size=4), codec=TextCodec(FakeTokenizer()),
                             repository=str(tmp_path))
        try:
            clients = [Client() for _ in range(3)]
            for client, text in zip(clients, ("a", "k", "x")):
                service.submit({**inputs(text, max_tokens=8), "temperature": np.array([[0.0]],
                                                                                     np.float32)},
                               client.send, on_done=client.done.set)
            assert all(client.done.wait(30) for client in clients)
            sampler = service.decoder.sampler
        finally:
            service.close()
        assert all(error is None for c in clients for _, error, _ in c.responses)
        return [[o["output_ids"].tolist() for o, _, _ in c.responses] for c in clients], sampler

    full, plain_pool = generate("full")
    hot_first, wrapper = generate("hot-first")
    assert hot_first == full and not hasattr(plain_pool, "stats") and wrapper.stats["rows"] >= 8


@pytest.mark.slow
def test_a_real_server_generates_the_same_greedy_text_hot_first(llm_server, tmp_path):
    """SmolLM2 on tritonserver with the shipped profile: the compact rows
    cross the BLS call and the sampler model; greedy text equals the full
    rows' text (the shared llm_server's: the same engine settings, batch-
    invariant), and a seeded sampled text is reproducible, with or without
    top logprobs asked. The same
    server sampling on a sampler-only server over gRPC (an endpoint on
    another host: it holds the same hot set) gives the same texts, the
    compact rows crossing there."""
    from concurrent.futures import ThreadPoolExecutor

    from conftest import LLM_CONTEXT
    from simple_sampler.client import GenerateClient
    from simple_sampler.settings import LlmSettings, SamplerSettings
    from simple_sampler.launch.serve import assemble_repository
    from simple_sampler.launch.server import TritonServer

    question = "What is the capital of France?"

    def texts(server):
        def text(**sampling):
            return GenerateClient(server.grpc_url, "grpc").generate(
                question, max_tokens=16, apply_chat_template=True, exclude_input_in_output=True,
                **sampling).text

        # at once: batch-invariant, so the company changes no token
        with ThreadPoolExecutor(5) as pool:
            seeded = [pool.submit(text, seed=7, top_p=0.9) for _ in range(2)]
            greedy = pool.submit(text, temperature=0.0)
            # untruncated rows, decided from their compact rows: asking for
            # top logprobs leaves their tokens as they are
            asked = [pool.submit(text, seed=9, return_log_probs=True, num_top_logprobs=n)
                     for n in (0, 5)]
            assert seeded[0].result() == seeded[1].result()
            assert asked[0].result() == asked[1].result()
            return seeded[0].result(), greedy.result()

    sampler = SamplerSettings(sampler_instances=1, sampler_max_batch_size=64, vocab_size=49_152,
                              hot_vocab_profile="hot_vocab.npz")

    def serving(name, endpoints="local"):
        return TritonServer(assemble_repository(tmp_path / name, sampler, LlmSettings(
            engine_max_batch_size=32, max_context=LLM_CONTEXT, sampler_shards=1,
            batch_invariant=True, handoff="hot-first", hot_vocab_profile="hot_vocab.npz",
            sampler_endpoints=endpoints)), log_path=tmp_path / f"{name}.log")

    with serving("local") as server:
        hot_first = texts(server)
    assert "rows cross to the sampler hot-first" in (tmp_path / "local.log").read_text()
    _, full = texts(llm_server)
    assert "rows cross to the sampler hot-first" not in llm_server.log_path.read_text()
    assert hot_first[1] == full and "Paris" in full
    with TritonServer(assemble_repository(tmp_path / "sampler", sampler),
                      log_path=tmp_path / "sampler.log") as remote:
        with serving("remote", remote.grpc_url) as server:
            assert texts(server) == hot_first
    # its pool's one target is the remote server: the compact rows went there
    assert "rows cross to the sampler hot-first" in (tmp_path / "remote.log").read_text()


def test_touched_lists_are_each_rows_bias_and_penalized_history_outside_h():
    """Per row, ascending and without repeats: its bias ids, and its prompt
    and output ids where a penalty is on, less the hot set's."""
    rng = np.random.default_rng(0)
    vocab = 5000
    hot = HotVocab(rng.choice(vocab, 700, replace=False), vocab)
    for _ in range(20):
        size = int(rng.integers(1, 30))
        params = [SamplingParams(repetition_penalty=1.1 if rng.random() < 0.5 else 1.0,
                                 logit_bias={int(i): 1.0 for i in rng.choice(
                                     vocab, int(rng.integers(0, 5)), replace=False)})
                  for _ in range(size)]
        histories = [History(prompt_ids=list(rng.integers(0, vocab, int(rng.integers(0, 60)))),
                             output_ids=list(rng.integers(0, vocab, int(rng.integers(0, 60)))))
                     for _ in range(size)]
        offsets, ids = touched_lists(SamplingBatch.from_params(params, histories), hot)
        for r in range(size):
            expected = set(params[r].logit_bias)
            if params[r].repetition_penalty != 1.0:
                expected |= set(histories[r].prompt_ids) | set(histories[r].output_ids)
            assert ids[offsets[r]:offsets[r + 1]].tolist() == sorted(expected - set(hot.ids.tolist()))


def test_rows_decided_from_their_full_rows_keep_their_own_top_logprobs():
    """Per-row top-n with the second round in place (``decide_from_full_rows``):
    the undecided rows ask fewer than the widest row, so the second round is
    narrower than the first; each gets its own n from its full row, padding
    beyond (a shape error before)."""
    from simple_sampler.handoff import decide_from_full_rows, sample_compact

    vocab = 8192
    hot = HotVocab(np.arange(16), vocab)
    rng = np.random.default_rng(0)
    logits = np.full((3, vocab), -5.0, np.float32)
    logits[0, :16] = rng.normal(size=16) * 3 + 10  # its mass in the hot set: decided
    logits[1] = logits[2] = rng.normal(size=vocab).astype(np.float32) * 0.1  # flat: its nucleus is cold
    batch = SamplingBatch.from_params([SamplingParams(seed=1), SamplingParams(seed=2, top_p=0.9),
                                       SamplingParams(seed=3, top_p=0.9)], vocab_size=vocab)
    wanted, want = np.array([5, 2, 0]), np.ones(3, bool)
    batch.want_logprobs = want
    first = sample_compact(compact_rows(torch.from_numpy(logits), batch, hot), batch, hot,
                           num_top_logprobs=wanted)
    assert first.undecided.tolist() == [False, True, True]
    decide_from_full_rows(first, compact_rows(torch.from_numpy(logits), batch, hot), batch, hot,
                          logits, want, num_top_logprobs=wanted)
    full = sample(logits[1:2], batch.take([1]), num_top_logprobs=2)
    assert first.top_token_ids[1, :2].tolist() == full.top_token_ids[0].tolist()
    assert (first.top_token_ids[1, 2:] == -1).all() and (first.top_token_ids[2] == -1).all()
    assert (first.top_logprobs[2] == -np.inf).all() and first.top_token_ids[0, 4] >= 0


def test_hot_first_names_the_histories_in_the_arena_with_the_gathered_lists_tokens():
    """Under hot-first, a step whose histories lie in the arena (``history_ref``)
    sends them by reference to the instances that map it, compact and
    second-round requests alike, and its tokens and logprobs are those of
    the same rows with the histories gathered into the batch."""
    import asyncio

    from simple_sampler.row_arena import RowArena
    from simple_sampler.serving.batch_state import BatchState
    from simple_sampler.triton.hot_first_sampler import HotFirstSampler

    rng = np.random.default_rng(91)
    rows = make_rows(rng, 24)
    hot = HotVocab(rng.choice(rows.shape[1], 900, replace=False), rows.shape[1])
    arena = RowArena(1, 4096)
    try:
        state = BatchState(24, 64, arena=arena)
        for row in range(24):
            state.add(SamplingParams(seed=500 + row, temperature=float(rng.choice([0.0, 0.8, 1.5])),
                                     repetition_penalty=1.3 if row % 2 else 1.0,
                                     presence_penalty=0.0 if row % 3 else 0.9),
                      rng.integers(0, rows.shape[1], 20).tolist(), want_logprobs=True)
        for _ in range(8):
            state.append(np.arange(24), rng.integers(0, rows.shape[1], 24).astype(np.int32))
        batch = state.batch(np.arange(24))
        named = []
        pool = _local_pool(hot, 2, arena=arena)
        call = pool.targets[0].call
        pool.targets[0].call = lambda inputs: named.append("history_ref" in inputs) or call(inputs)
        sampler = HotFirstSampler(pool, hot, cold_top=16)
        assert sampler.history_arena is arena and batch.history_ref is not None
        got = asyncio.run(sampler(torch.from_numpy(rows), batch))
        expected = asyncio.run(HotFirstSampler(_local_pool(hot), hot, cold_top=16)(
            torch.from_numpy(rows), batch.with_histories()))
    finally:
        arena.close()
    for got_part, expected_part in zip(got, expected):
        np.testing.assert_array_equal(got_part, expected_part)
    assert named and all(named)
