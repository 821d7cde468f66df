"""vLLM's raw logprobs (``SamplingBatch.raw_logprobs``): a row that asks for
them gets the log_softmax of its logits as given (no bias, ban, penalty or
temperature), its own token's and its n most likely, as the float64
reference computes them, on every path (full rows, SHVS, the penalized
copy, the hot-first handoff); it draws the token it draws without them.
A row given its token (``SamplingBatch.given_token_ids``) is scored, not
drawn."""
import dataclasses

import ml_dtypes
import numpy as np
import pytest
import torch

from conftest import hot_sets, make_requests, make_rows
from simple_sampler._sampling import HandoffOutcome
from simple_sampler import reference
from simple_sampler.handoff import sample_compact, scored_rows
from simple_sampler.params import History, SamplingBatch, SamplingParams
from simple_sampler.sampling import sample
from simple_sampler.serving.batch_state import BatchState
from simple_sampler.schema import InvalidRequest
from simple_sampler.serving.hot_first import compact_rows, sample_hot_first
from simple_sampler.shvs import HotVocab
from simple_sampler.triton import sampler_codec, sampler_decode, sampler_packed, sampler_serve

TOP = 5


def raw_reference(rows: np.ndarray) -> np.ndarray:
    """float64 log_softmax of each row, -inf kept."""
    rows = rows.astype(np.float64)
    top = rows.max(axis=1, keepdims=True)
    return rows - top - np.log(np.exp(rows - top).sum(axis=1, keepdims=True))


def ranked(logprobs: np.ndarray, n: int) -> np.ndarray:
    """Each row's n most likely ids, ties by lower id."""
    return np.argsort(-logprobs, axis=1, kind="stable")[:, :n]


def check_raw(out, rows: np.ndarray, asked: np.ndarray) -> None:
    reference = raw_reference(rows)
    picked = np.arange(len(rows))
    np.testing.assert_allclose(out.logprobs[asked], reference[picked, out.token_ids][asked],
                               rtol=0, atol=2e-5)
    assert np.isnan(out.logprobs[~asked]).all()
    top = ranked(reference, TOP)
    assert (out.top_token_ids == top).all()
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(reference, top, axis=1),
                               rtol=0, atol=2e-5)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
def test_raw_logprobs_are_the_rows_own_and_leave_every_token_as_it_was(dtype):
    rng = np.random.default_rng(5)
    rows = make_rows(rng, 48).astype(dtype)
    rows[:, 8:12] = rows[:, [8]]  # ties: the lower id first
    batch = SamplingBatch.from_params(*make_requests(rng, 48, vocab=rows.shape[1]))
    plain = sample(rows, batch, return_logprobs=False)
    asked = np.arange(48) % 3 > 0
    raw = dataclasses.replace(batch, want_logprobs=asked, raw_logprobs=np.ones(48, bool))
    out = sample(rows, raw, num_top_logprobs=TOP)
    assert (out.token_ids == plain.token_ids).all()
    check_raw(out, rows.astype(np.float32), asked)
    adjusted = sample(rows, dataclasses.replace(raw, raw_logprobs=None), num_top_logprobs=TOP)
    assert (np.abs(adjusted.logprobs[asked] - out.logprobs[asked]) > 1e-3).any()


def test_raw_rows_of_a_long_history_are_scored_from_the_row_not_its_penalized_copy():
    """A row with overrides in most blocks is sampled from a penalized copy;
    its raw logprobs still come from its own logits."""
    rng = np.random.default_rng(8)
    rows = make_rows(rng, 4, vocab=8192)
    rows[np.isinf(rows)] = -5.0
    history = [rng.integers(0, 8192, 6000).tolist() for _ in range(4)]
    batch = SamplingBatch.from_params(
        [SamplingParams(seed=r, repetition_penalty=1.5, frequency_penalty=0.3,
                        temperature=0.6) for r in range(4)],
        [History(prompt_ids=h[:3000], output_ids=h[3000:]) for h in history])
    plain = sample(rows, batch, return_logprobs=False)
    out = sample(rows, dataclasses.replace(batch, raw_logprobs=np.ones(4, bool)),
                 num_top_logprobs=TOP)
    assert (out.token_ids == plain.token_ids).all()
    check_raw(out, rows, np.ones(4, bool))


def test_shvs_decides_a_raw_row_as_it_would_unasked(zipf_row):
    """Asking for raw logprobs leaves a row's path as it was: SHVS may still
    decide it from the hot set (the adjusted ones send it to the full path)."""
    hot = hot_sets(zipf_row)["head"]
    rows = np.repeat(zipf_row[None], 64, axis=0)
    batch = SamplingBatch.from_params([SamplingParams(seed=s) for s in range(64)])
    plain = sample(rows, batch, return_logprobs=False, hot_vocab=hot)
    raw = sample(rows, dataclasses.replace(batch, raw_logprobs=np.ones(64, bool)),
                 num_top_logprobs=TOP, hot_vocab=hot)
    assert plain.hot_accepted.any() and (raw.hot_accepted == plain.hot_accepted).all()
    assert (raw.token_ids == plain.token_ids).all()
    check_raw(raw, rows, np.ones(64, bool))


def test_the_handoff_draws_a_raw_rows_token_as_unasked_and_scores_it_on_its_full_row(zipf_row):
    """Under the hot-first handoff a raw row's token is the compact
    decision's, as without logprobs; its raw logprobs come from its full row,
    scored for that token (``SamplingBatch.given_token_ids``)."""
    hot = hot_sets(zipf_row)["head"]
    rng = np.random.default_rng(4)
    rows = (zipf_row[None] + rng.normal(0, 0.5, (32, zipf_row.size))).astype(np.float32)
    batch = SamplingBatch.from_params([SamplingParams(seed=s, temperature=0.8,
                                                      top_p=0.9 if s % 4 == 0 else 1.0)
                                       for s in range(32)])
    plain = sample_hot_first(rows, batch, hot, return_logprobs=False)
    asked = np.arange(32) % 2 == 0
    raw = dataclasses.replace(batch, raw_logprobs=asked)
    out = sample_hot_first(rows, raw, hot, num_top_logprobs=TOP)
    assert (out.token_ids == plain.token_ids).all()
    reference = raw_reference(rows)
    picked = np.arange(32)
    np.testing.assert_allclose(out.logprobs[asked], reference[picked, out.token_ids][asked],
                               rtol=0, atol=2e-5)
    assert (np.abs(out.logprobs[~asked] - reference[picked, out.token_ids][~asked]) > 1e-3).all()
    assert (out.top_token_ids[asked] == ranked(reference, TOP)[asked]).all()
    # a compact request that asks for them itself leaves the row to its full row
    compact = compact_rows(torch.from_numpy(rows), raw, hot, 16)
    first = sample_compact(compact, raw, hot)
    assert (first.outcome[asked] == HandoffOutcome.HANDOFF_NEED_FULL).all()
    assert scored_rows(raw).tolist() == asked.tolist()
    assert not scored_rows(dataclasses.replace(raw, want_logprobs=np.zeros(32, bool))).any()


@pytest.mark.parametrize("raw", [False, True])
def test_a_given_token_is_scored_not_drawn(raw):
    """``given_token_ids``: the row's token is the one given, its logprob and
    top n as the float64 reference's (adjusted or raw); a row given -1 draws."""
    rng = np.random.default_rng(11)
    rows = make_rows(rng, 12)
    batch = SamplingBatch.from_params(*make_requests(rng, 12, vocab=rows.shape[1]))
    drawn = sample(rows, batch, num_top_logprobs=TOP)
    given = rng.integers(0, rows.shape[1], 12)
    given[::3] = -1
    scored = dataclasses.replace(batch, given_token_ids=given,
                                 raw_logprobs=np.ones(12, bool) if raw else None)
    out = sample(rows, scored, num_top_logprobs=TOP)
    fixed = given >= 0
    assert (out.token_ids[fixed] == given[fixed]).all()
    assert (out.token_ids[~fixed] == drawn.token_ids[~fixed]).all()
    for r in np.flatnonzero(fixed):
        logprobs = (raw_reference(rows[r:r + 1])[0] if raw
                    else reference.log_softmax(reference.scaled_logits(rows[r], batch, r)))
        np.testing.assert_allclose(out.logprobs[r], logprobs[given[r]], rtol=0, atol=2e-5)
        assert (out.top_token_ids[r] == ranked(logprobs[None], TOP)[0]).all()
    with pytest.raises(ValueError, match=r"given_token_ids must be in \[-1, "):
        sample(rows, dataclasses.replace(batch, given_token_ids=np.full(12, rows.shape[1])))


def test_the_sampler_model_takes_a_given_token_on_full_rows_only():
    rng = np.random.default_rng(6)
    vocab, rows = 3000, 4
    logits = rng.normal(0, 2, (rows, vocab)).astype(np.float32)
    batch = SamplingBatch.from_params([SamplingParams(seed=s, temperature=0.6) for s in range(rows)])
    given = dataclasses.replace(batch, given_token_ids=np.array([7, -1, 2999, 0]),
                                raw_logprobs=np.ones(rows, bool))
    for packed in (False, True):
        inputs = {"logits": logits, **sampler_codec.batch_arrays(given, packed=packed)}
        tokens = sampler_serve.serve_request(inputs, vocab).outputs["output_ids"][:, 0]
        assert tokens[[0, 2, 3]].tolist() == [7, 2999, 0], packed
        wrong = {"logits": logits, **sampler_codec.batch_arrays(dataclasses.replace(
            given, given_token_ids=np.array([7, -1, vocab, 0])), packed=packed)}
        with pytest.raises(InvalidRequest, match=r"row 2: given_token_id must be in \[-1, 3000\)"):
            sampler_decode.decode_request(wrong, vocab)
    hot = HotVocab(rng.choice(vocab, 400, replace=False), vocab)
    inputs = {**sampler_codec.compact_arrays(compact_rows(torch.from_numpy(logits), batch, hot),
                                             packed=True),
              **sampler_codec.batch_arrays(dataclasses.replace(given, raw_logprobs=None),
                                           packed=True)}
    assert sampler_packed.decide_plain_compact(inputs, vocab, hot, None, 1) is None
    with pytest.raises(InvalidRequest, match="given_token_id is scored on full rows"):
        sampler_decode.decode_request(inputs, vocab, hot)


def test_the_sampler_model_takes_raw_logprobs_packed_or_not_and_its_c_path_leaves_them():
    """raw_logprobs crosses the sampler model's wire as its own tensor or in
    row_scalars; the one-call compact path answers no raw logprobs, so a
    request with a row that asks goes the general way, which does."""
    rng = np.random.default_rng(2)
    vocab, rows = 3000, 6
    logits = rng.normal(0, 2, (rows, vocab)).astype(np.float32)
    batch = SamplingBatch.from_params([SamplingParams(seed=s, temperature=0.6) for s in range(rows)])
    batch = dataclasses.replace(batch, want_logprobs=np.ones(rows, bool),
                                raw_logprobs=np.arange(rows) % 2 == 0)
    for packed in (False, True):
        inputs = {"logits": logits, **sampler_codec.batch_arrays(batch, packed=packed)}
        if not packed:  # each parameter its own tensor: return_log_probs too
            inputs["return_log_probs"] = np.ones((rows, 1), bool)
        decoded = sampler_decode.decode_request(inputs, vocab)
        assert decoded.batch.raw_logprobs.tolist() == batch.raw_logprobs.tolist(), packed
        outputs = sampler_serve.serve_request(inputs, vocab).outputs
        logprobs, tokens = outputs["output_log_probs"][:, 0], outputs["output_ids"][:, 0]
        reference = raw_reference(logits)[np.arange(rows), tokens]
        np.testing.assert_allclose(logprobs[::2], reference[::2], atol=2e-5)
        assert (np.abs(logprobs[1::2] - reference[1::2]) > 1e-3).all()  # T = 0.6: adjusted
    hot = HotVocab(rng.choice(vocab, 400, replace=False), vocab)
    compact = compact_rows(torch.from_numpy(logits), batch, hot)
    inputs = {**sampler_codec.compact_arrays(compact, packed=True),
              **sampler_codec.batch_arrays(batch, packed=True)}
    assert sampler_packed.decide_plain_compact(inputs, vocab, hot, None, 1) is None
    unasked = dataclasses.replace(batch, raw_logprobs=None)
    plain = {**inputs, **sampler_codec.batch_arrays(unasked, packed=True)}
    assert sampler_packed.decide_plain_compact(plain, vocab, hot, None, 1) is not None


def test_the_batch_state_marks_raw_only_the_rows_that_ask():
    """A raw-mode decode loop flags the rows that ask for logprobs (so a
    step where none asks keeps the samplers' usual path, the C call
    included)."""
    state = BatchState(4, 16, raw_logprobs=True)
    slots = np.array([state.add(SamplingParams(seed=s), [1, 2], want_logprobs=s == 1,
                                num_top_logprobs=2 if s == 2 else 0) for s in range(3)])
    assert state.batch(slots).raw_logprobs.tolist() == [False, True, True]
    assert state.batch(slots[:1]).raw_logprobs is None
    adjusted = BatchState(4, 16)
    slot = adjusted.add(SamplingParams(seed=1), [1], want_logprobs=True)
    assert adjusted.batch(np.array([slot])).raw_logprobs is None
