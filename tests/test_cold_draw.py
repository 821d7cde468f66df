"""The data plane's cold draw (docs/HANDOFF.md, "The cold draw"): a token
drawn inside C next to the logits, which decides a NEED_COLD row with no
full row. The two-stage result with it matches the float64 reference; a
wrong cold draw is caught by the same test; the token is a function of
(seed, step, row); the simulated engine's block walk picks the whole row's
token; the sampler's codec carries and checks it."""
import numpy as np
import pytest
import torch

from conftest import ZIPF_VOCAB as VOCAB
from conftest import P_VALUE_FLOOR, goodness_of_fit, hot_sets, repeated_batch, total_variation
from simple_sampler import reference
from simple_sampler._sampling import HandoffOutcome
from simple_sampler.handoff import CompactRows, cold_draws, sample_compact
from simple_sampler.params import History, SamplingBatch, SamplingParams
from simple_sampler.serving.hot_first import hot_first_summary, sample_hot_first, touched_lists

DRAWS = 100_000
WRONG_DRAWS = 20_000
CHUNK = 4096  # rows summarized at a time: bounds the [rows, V] temporaries
DECIDED, NEED_COLD = HandoffOutcome.HANDOFF_DECIDED, HandoffOutcome.HANDOFF_NEED_COLD


def summarized(row, batch, hot, draws):
    """Compact rows (cpu form) of len(batch) copies of `row`, each with its
    cold token from `draws`, in chunks."""
    parts = []
    for start in range(0, len(batch), CHUNK):
        part = batch.take(np.arange(start, min(len(batch), start + CHUNK)))
        offsets, ids = touched_lists(part, hot)
        rows = torch.from_numpy(row).expand(len(part), row.size)
        parts.append(hot_first_summary(rows, hot.kernel_arrays()[0], offsets, ids,
                                       part.temperature, 0, draws[start:start + len(part)]).cpu())
    return CompactRows(
        hot_logits=np.concatenate([p.hot_logits for p in parts]),
        touched_offsets=np.r_[0, np.cumsum(np.concatenate([np.diff(p.touched_offsets)
                                                           for p in parts]))],
        **{name: np.concatenate([getattr(p, name) for p in parts])
           for name in ("touched_ids", "touched_logits", "cold_max", "cold_argmax", "cold_mass",
                        "cold_token", "cold_token_logit")})


def drawn_counts(row, params, hot, draws=None):
    batch = repeated_batch(params, DRAWS)
    compact = summarized(row, batch, hot, cold_draws(batch) if draws is None else draws)
    out = sample_compact(compact, batch, hot, return_logprobs=False)
    return out, compact, batch


@pytest.mark.parametrize("hot_kind, params", [
    ("head", SamplingParams()),
    ("misses-most-mass", SamplingParams(temperature=1.2)),
])
def test_compact_rows_with_cold_tokens_follow_the_reference(zipf_row, hot_kind, params):
    """Every row decided in one round, the tokens exactly distributed."""
    hot = hot_sets(zipf_row)[hot_kind]
    out, compact, batch = drawn_counts(zipf_row, params, hot)
    cold = np.asarray(compact.cold_token) >= 0
    assert cold.all() and (out.outcome == DECIDED).all()
    counts = np.bincount(out.token_ids, minlength=VOCAB)
    in_cold = np.ones(VOCAB, bool)
    in_cold[hot.ids] = False
    assert 0.01 < counts[in_cold].sum() / DRAWS  # the cold tokens were used
    probs = reference.probabilities(zipf_row, batch, 0)
    p_value = goodness_of_fit(counts, probs)
    assert p_value > P_VALUE_FLOOR, f"p={p_value:.2e}, TV={total_variation(counts, probs):.4f}"


def test_a_wrong_cold_draw_is_caught(zipf_row):
    """Cold tokens drawn uniformly over C instead of by weight: the same
    test rejects them. WRONG_DRAWS, not DRAWS: the error is gross, and
    20,000 draws already reject it at p about 2e-193 (the floor is 1e-4),
    for a fifth of the summaries' cost."""
    hot = hot_sets(zipf_row)["head"]
    batch = repeated_batch(SamplingParams(), WRONG_DRAWS)
    compact = summarized(zipf_row, batch, hot, cold_draws(batch))
    cold_ids = np.setdiff1d(np.arange(VOCAB), hot.ids)
    rng = np.random.default_rng(4)
    compact.cold_token = rng.choice(cold_ids, WRONG_DRAWS).astype(np.int32)
    compact.cold_token_logit = zipf_row[compact.cold_token]
    out = sample_compact(compact, batch, hot, return_logprobs=False)
    counts = np.bincount(out.token_ids, minlength=VOCAB)
    assert goodness_of_fit(counts, reference.probabilities(zipf_row, batch, 0)) < P_VALUE_FLOOR


def test_cold_tokens_and_their_logprobs_match_the_second_round(zipf_row):
    """Rows that drew in C: the cold token's logprob is the whole row's;
    rows that cannot reach C (greedy, truncated) get no draw."""
    hot = hot_sets(zipf_row)["head"]
    rng = np.random.default_rng(7)
    params = [SamplingParams(seed=int(s), **kind) for s, kind in zip(
        rng.integers(0, 2**63, 60), [dict(), dict(temperature=1.3), dict(temperature=0.0),
                                     dict(top_p=0.9)] * 15)]
    batch = SamplingBatch.from_params(params, [History()] * 60, list(rng.integers(0, 50, 60)))
    draws = cold_draws(batch)
    untruncated = np.asarray(batch.temperature) > 0.5
    untruncated &= np.asarray(batch.top_p) == 1.0
    assert np.isfinite(draws[untruncated]).all() and np.isnan(draws[~untruncated]).all()
    rows = np.broadcast_to(zipf_row, (60, VOCAB))
    out = sample_hot_first(rows, batch, hot, cold_top=0)
    assert (out.outcome != NEED_COLD).all()
    in_cold = ~np.isin(out.token_ids, hot.ids)
    assert in_cold[untruncated].sum() >= 3
    for r in np.flatnonzero(in_cold):
        expected = reference.log_softmax(reference.scaled_logits(zipf_row, batch, r))
        assert abs(out.logprobs[r] - expected[out.token_ids[r]]) < 1e-4


def test_a_cold_token_is_a_function_of_seed_step_and_row(zipf_row):
    """Alone or among other rows, in any order: the same cold token."""
    hot = hot_sets(zipf_row)["random"]
    rng = np.random.default_rng(11)
    rows = np.stack([zipf_row, rng.normal(0, 3, VOCAB).astype(np.float32),
                     zipf_row[::-1].copy(), rng.normal(0, 1, VOCAB).astype(np.float32)])
    batch = SamplingBatch.from_params([SamplingParams(seed=s) for s in (1, 2, 3, 4)],
                                      [History()] * 4, [5, 6, 7, 8])

    def tokens(picked):
        part = batch.take(picked)
        offsets, ids = touched_lists(part, hot)
        return hot_first_summary(torch.from_numpy(rows[picked]), hot.kernel_arrays()[0],
                                 offsets, ids, part.temperature, 8, cold_draws(part)).cpu()
    base = tokens(np.arange(4))
    assert (base.cold_token >= 0).all()
    for picked in ([3, 1, 0, 2], [2], [1, 3]):
        again = tokens(np.asarray(picked))
        np.testing.assert_array_equal(again.cold_token, base.cold_token[picked])
        np.testing.assert_array_equal(again.cold_token_logit, base.cold_token_logit[picked])
    np.testing.assert_array_equal(base.cold_token_logit, rows[np.arange(4), base.cold_token])


def _forty_compact_rows(zipf_row, drawn: bool):
    """(hot set, batch, compact rows): 40 seeded untruncated copies of
    `zipf_row` summarized with the "head" hot set, cold tokens drawn or not."""
    hot = hot_sets(zipf_row)["head"]
    batch = SamplingBatch.from_params([SamplingParams(seed=s) for s in range(40)])
    offsets, ids = touched_lists(batch, hot)
    compact = hot_first_summary(torch.from_numpy(zipf_row).expand(40, VOCAB),
                                hot.kernel_arrays()[0], offsets, ids, batch.temperature, 0,
                                cold_draws(batch) if drawn else None).cpu()
    return hot, batch, compact


def test_the_codec_carries_and_checks_cold_tokens(zipf_row):
    from simple_sampler.schema import InvalidRequest
    from simple_sampler.triton.sampler_codec import batch_arrays, compact_arrays
    from simple_sampler.triton.sampler_decode import decode_request
    from simple_sampler.triton.sampler_serve import sample_request

    hot, batch, compact = _forty_compact_rows(zipf_row, drawn=True)
    direct = sample_compact(compact, batch, hot)
    inputs = {**compact_arrays(compact), **batch_arrays(batch),
              "return_log_probs": np.ones((40, 1), bool)}
    outputs, _ = sample_request(decode_request(inputs, VOCAB, hot), 1, hot)
    np.testing.assert_array_equal(outputs["output_ids"][:, 0], direct.token_ids)
    np.testing.assert_array_equal(outputs["output_log_probs"][:, 0], direct.logprobs)
    assert "handoff_outcome" not in outputs  # every row decided: the outcome is not sent
    assert (~np.isin(direct.token_ids, hot.ids)).any()
    drawn = {"cold_token": inputs["cold_token"], "cold_token_logit": inputs["cold_token_logit"]}
    with pytest.raises(InvalidRequest, match="comes with compact rows"):
        decode_request({"logits": np.broadcast_to(zipf_row, (40, VOCAB)), **drawn}, VOCAB, hot)
    with pytest.raises(InvalidRequest, match="must be sent together"):
        decode_request({**inputs, "cold_token_logit": None}, VOCAB, hot)
    hot_token = np.full((40, 1), hot.ids[0], np.int32)
    for bad, message in ((hot_token, "cold_token must be an id of the cold region"),
                         (np.full((40, 1), VOCAB, np.int32), r"cold_token must be -1 or a token id")):
        with pytest.raises(InvalidRequest, match=message):
            sample_request(decode_request({**inputs, "cold_token": bad}, VOCAB, hot), 1, hot)
    # a cold summary at odds with itself once came back as the token (-1, a hot id) or
    # as a NaN logprob and a token that ignored the seed
    argmax = "cold_argmax must be -1 when cold_max is -inf and an id of the cold region"
    touched = compact.touched_ids[compact.touched_offsets[0]:compact.touched_offsets[1]]
    for name, value, message in (("cold_argmax", -1, argmax), ("cold_argmax", hot.ids[0], argmax),
                                 *((("cold_argmax", touched[0], argmax),) if touched.size else ()),
                                 ("cold_mass", np.nan, "cold_mass must be a finite number >= 0"),
                                 ("cold_mass", np.inf, "cold_mass must be a finite number >= 0"),
                                 ("cold_mass", -1.0, "cold_mass must be a finite number >= 0")):
        bad = inputs[name].copy()
        bad[0] = value
        with pytest.raises(InvalidRequest, match=f"row 0: {message}"):
            sample_request(decode_request({**inputs, name: bad}, VOCAB, hot), 1, hot)


@pytest.mark.parametrize("drawn", [False, True])
def test_the_packed_cold_summary_decodes_as_its_five_tensors(zipf_row, drawn):
    """``compact_arrays(packed=True)`` sends the cold summary as one
    ``cold_summary`` record per row (the llm model's form); the sampler
    answers it exactly as the five tensors, with or without cold tokens
    (none drawn: cold_token -1 on every row), and refuses it by name when
    it is malformed, comes with a field it packs, or comes without
    compact rows."""
    from simple_sampler.schema import COLD_SUMMARY_RECORD, InvalidRequest
    from simple_sampler.triton.sampler_codec import batch_arrays, compact_arrays
    from simple_sampler.triton.sampler_decode import decode_request
    from simple_sampler.triton.sampler_serve import sample_request

    hot, batch, compact = _forty_compact_rows(zipf_row, drawn)
    scalars = batch_arrays(batch, packed=True)
    separate, packed = (compact_arrays(compact, packed=flag) for flag in (False, True))
    assert packed.keys() == {"hot_logits", "touched_ids", "touched_logits", "cold_summary"}
    assert packed["cold_summary"].dtype == np.uint8
    assert packed["cold_summary"].shape == (40, COLD_SUMMARY_RECORD.itemsize)
    answers = [sample_request(decode_request({**arrays, **scalars}, VOCAB, hot), 1, hot)[0]
               for arrays in (separate, packed)]
    assert answers[0].keys() == answers[1].keys()
    for name in answers[0]:
        np.testing.assert_array_equal(answers[1][name], answers[0][name], err_msg=name)
    # without cold tokens some rows stay undecided (NEED_COLD): the forms still agree,
    # and only then is the outcome sent
    assert ("handoff_outcome" in answers[0]) != drawn
    if not drawn:
        assert (answers[0]["handoff_outcome"] != DECIDED).any()
    inputs = {**packed, **scalars}
    with pytest.raises(InvalidRequest, match="cold_summary carries cold_mass: send one"):
        decode_request({**inputs, "cold_mass": separate["cold_mass"]}, VOCAB, hot)
    with pytest.raises(InvalidRequest, match=r"cold_summary must be UINT8 \[40, 20\]"):
        decode_request({**inputs, "cold_summary": packed["cold_summary"][:, :12]}, VOCAB, hot)
    with pytest.raises(InvalidRequest, match=r"cold_summary must be UINT8 \[40, 20\]"):
        decode_request({**inputs, "cold_summary": packed["cold_summary"][:39]}, VOCAB, hot)
    for name in ("cold_summary", "cold_max", "touched_ids"):  # without hot_logits: not ignored
        part = packed.get(name, separate.get(name))
        with pytest.raises(InvalidRequest, match=f"{name} comes with compact rows"):
            decode_request({"logits": np.broadcast_to(zipf_row, (40, VOCAB)), name: part},
                           VOCAB, hot)
    with pytest.raises(InvalidRequest, match="hot_logits needs touched_logits too"):
        decode_request({**inputs, "touched_logits": None}, VOCAB, hot)


def test_the_two_level_cold_draw_picks_the_whole_rows_token():
    """The cold token found by block masses, then inside one block, is the
    id a float64 cumulative sum over the whole row picks (numpy's, in id
    order), for draws anywhere in (0, 1), u next to 1 included: at a V with a
    short last block, with ids handed over (weight 0) and a whole block of
    them; never a handed-over id."""
    from simple_sampler.serving.hot_first import COLD_DRAW_BLOCK, _block_masses, _cold_tokens

    vocab, size = 3 * COLD_DRAW_BLOCK + 517, 48
    rng = np.random.default_rng(5)
    logits = torch.from_numpy(rng.normal(0, 2, (size, vocab)).astype(np.float32))
    weights = torch.exp(logits - logits.max(dim=1, keepdim=True).values)
    weights[:, rng.choice(vocab, 700, replace=False)] = 0.0
    weights[:, COLD_DRAW_BLOCK:2 * COLD_DRAW_BLOCK] = 0.0
    weights[:, -3:] = 0.0
    u = rng.random(size)
    u[:4] = [0.0, np.nextafter(1.0, 0.0), 0.5, np.nan]
    token, token_logit = _cold_tokens(logits, weights, _block_masses(weights),
                                      torch.ones(size, dtype=torch.bool), torch.from_numpy(u))
    token = token.numpy()
    cumulative = np.cumsum(weights.numpy().astype(np.float64), axis=1)
    for r in range(size):
        if np.isnan(u[r]):
            assert token[r] == -1 and token_logit[r] == 0
            continue
        expected = np.searchsorted(cumulative[r], u[r] * cumulative[r, -1], side="right")
        expected = min(expected, np.flatnonzero(weights[r].numpy() > 0)[-1])
        assert token[r] == expected, (r, u[r])
        assert weights[r, token[r]] > 0 and token_logit[r] == logits[r, token[r]]
