"""Every bad input raises ValueError naming the field, the row (in a batch)
and the allowed range; a failed call leaves the sampler usable."""
import dataclasses
import re

import ml_dtypes
import numpy as np
import pytest
import torch

from simple_sampler.params import History, SamplingBatch, SamplingParams
from simple_sampler._sampling import RowError
from simple_sampler.sampling import raise_row_errors, sample, sample_requests

V = 8
ROW = np.linspace(-1.0, 1.0, V).astype(np.float32)
ROWS3 = np.stack([ROW, ROW, ROW])


def raises(*patterns):
    """pytest.raises(ValueError) whose message contains every pattern (regex)."""
    class Check:
        def __enter__(self):
            self.ctx = pytest.raises(ValueError)
            self.info = self.ctx.__enter__()
            return self.info

        def __exit__(self, *exc):
            handled = self.ctx.__exit__(*exc)
            if not handled:          # another exception type: let it propagate
                return False
            message = str(self.info.value)
            for pattern in patterns:
                assert re.search(pattern, message), f"{pattern!r} not in {message!r}"
            return handled
    return Check()


def middle(bad_params=None, bad_history=None):
    """sample_requests on three rows whose second (row 1) is the bad one."""
    params = [SamplingParams(seed=0), bad_params or SamplingParams(seed=1), SamplingParams(seed=2)]
    histories = [History(), bad_history or History(), History()]
    return sample_requests(ROWS3, params, histories)


def good_call():
    out = sample_requests(ROWS3, [SamplingParams(seed=s) for s in range(3)],
                          [History(prompt_ids=[1], output_ids=[2])] * 3, num_top_logprobs=3)
    assert out.token_ids.shape == (3,) and np.all((out.token_ids >= 0) & (out.token_ids < V))
    return out


# ------------------------------------------------------------------- logits


def test_nan_names_row_and_column():
    rows = ROWS3.copy()
    rows[1, 5] = np.nan
    with raises(r"^row 1: ", "NaN", r"column 5\b"):
        sample_requests(rows, [SamplingParams()] * 3)


def test_nan_in_a_later_block_names_its_column():
    rows = np.zeros((2, 300), np.float32)
    rows[1, 257] = np.nan
    rows[1, 290] = np.nan
    with raises(r"^row 1: ", "NaN", r"column 257\b"):
        sample_requests(rows, [SamplingParams(temperature=0.0), SamplingParams(top_k=3)])


def test_positive_infinity_names_row_and_column():
    rows = ROWS3.copy()
    rows[2, 3] = np.inf
    with raises(r"^row 2: ", r"\+inf", r"column 3\b", "finite or -inf"):
        sample_requests(rows, [SamplingParams()] * 3)


def test_positive_infinity_is_rejected_for_greedy_and_truncating_rows():
    for params in (SamplingParams(temperature=0.0), SamplingParams(top_p=0.5),
                   SamplingParams(top_k=2, min_p=0.1)):
        row = ROW.copy()
        row[6] = np.inf
        with raises(r"^row 0: ", r"\+inf", r"column 6\b"):
            sample_requests(row, [params])


def test_positive_infinity_reached_through_bias_or_penalty_names_the_column():
    """Finite inputs whose adjusted float32 logit overflows are reported as
    +inf at that column, not sampled."""
    row = ROW.copy()
    row[4] = 3e38
    with raises(r"^row 0: ", r"\+inf", r"column 4\b", "once bias, penalties and temperature apply"):
        sample_requests(row, [SamplingParams(temperature=0.5)])
    with raises(r"^row 0: ", r"\+inf", r"column 4\b"):
        sample_requests(row, [SamplingParams(repetition_penalty=0.5)], [History(prompt_ids=[4])])
    # the same row with neither adjustment samples fine
    assert sample_requests(row, [SamplingParams(temperature=0.0)]).token_ids[0] == 4


def test_negative_infinity_is_allowed():
    row = ROW.copy()
    row[[0, 7]] = -np.inf
    out = sample_requests(row, [SamplingParams(temperature=0.0)], num_top_logprobs=V)
    assert out.token_ids[0] == 6
    assert out.top_logprobs[0][-1] == -np.inf


def test_all_tokens_banned_by_logit_bias():
    params = SamplingParams(logit_bias={t: -np.inf for t in range(V)})
    with raises(r"^row 1: ", "every token is banned"):
        middle(params)


def test_all_tokens_banned_by_bias_and_min_tokens():
    params = SamplingParams(logit_bias={t: -np.inf for t in range(V - 1)}, min_tokens=1,
                            stop_token_ids=[V - 1])
    with raises(r"^row 0: ", "every token is banned"):
        sample_requests(ROW, [params])
    # once min_tokens is reached the stop token is allowed again
    out = sample_requests(ROW, [params], [History(output_ids=[0])])
    assert out.token_ids[0] == V - 1


def test_all_minus_infinity_row():
    rows = ROWS3.copy()
    rows[1] = -np.inf
    with raises(r"^row 1: ", "every token is banned"):
        sample_requests(rows, [SamplingParams()] * 3)


@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.int64, np.bool_])
def test_bad_numpy_dtype(dtype):
    with raises("logits must be float32, float16 or bfloat16", np.dtype(dtype).name):
        sample_requests(ROW.astype(dtype), [SamplingParams()])


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32])
def test_bad_torch_dtype(dtype):
    with raises("logits must be float32, float16 or bfloat16"):
        sample_requests(torch.from_numpy(ROW).to(dtype), [SamplingParams()])


def test_three_dimensional_logits():
    with raises("logits must have shape", r"\[B, V\]", r"\[1, 1, 8\]"):
        sample_requests(ROW[None, None], [SamplingParams()])


def test_empty_vocabulary():
    with raises("logits must have shape", "V >= 1", r"\[1, 0\]"):
        sample_requests(np.zeros((1, 0), np.float32), [SamplingParams()])
    with raises("V >= 1"):
        sample_requests(np.zeros((1, 0), ml_dtypes.bfloat16), [SamplingParams()])


def test_batch_length_mismatch():
    with raises("logits has 3 rows", "parameters have 2"):
        sample_requests(ROWS3, [SamplingParams()] * 2)
    with raises("logits has 1 rows", "parameters have 3"):
        sample_requests(ROW, [SamplingParams()] * 3)
    with raises("histories has 2 entries for 3 rows"):
        sample_requests(ROWS3, [SamplingParams()] * 3, [History()] * 2)


@pytest.mark.parametrize("n", [21, -1, 100])
def test_num_top_logprobs_out_of_range(n):
    with raises("num_top_logprobs", r"\[0, 20\]", f"got {n}"):
        sample_requests(ROW, [SamplingParams()], num_top_logprobs=n)


def test_num_top_logprobs_20_is_allowed():
    rows = np.linspace(0, 1, 30, dtype=np.float32)
    out = sample_requests(rows, [SamplingParams()], num_top_logprobs=20)
    assert out.top_token_ids.shape == (1, 20)


@pytest.mark.parametrize("threads", [0, -1])
def test_num_threads_must_be_positive(threads):
    with raises("num_threads", ">= 1", f"got {threads}"):
        sample_requests(ROW, [SamplingParams()], num_threads=threads)


# ------------------------------------------------------ parameters in a batch

BAD_FIELDS = [
    ("temperature", -0.5, r"a finite value >= 0"),
    ("temperature", float("nan"), r"a finite value >= 0"),
    ("temperature", float("inf"), r"a finite value >= 0"),
    ("top_p", 0.0, r"in \(0, 1\]"),
    ("top_p", 1.5, r"in \(0, 1\]"),
    ("top_p", float("nan"), r"in \(0, 1\]"),
    ("min_p", -0.1, r"in \[0, 1\]"),
    ("min_p", 1.1, r"in \[0, 1\]"),
    ("top_k", -2, r">= -1"),
    ("repetition_penalty", 0.0, r"in \[1e-6, 1e6\]"),
    ("repetition_penalty", -1.0, r"in \[1e-6, 1e6\]"),
    ("repetition_penalty", float("inf"), r"in \[1e-6, 1e6\]"),
    ("presence_penalty", 2.5, r"in \[-2, 2\]"),
    ("presence_penalty", -2.5, r"in \[-2, 2\]"),
    ("frequency_penalty", 2.5, r"in \[-2, 2\]"),
    ("frequency_penalty", float("nan"), r"in \[-2, 2\]"),
]
IDS = [f"{name}={value}" for name, value, _ in BAD_FIELDS]


@pytest.mark.parametrize("name, value, allowed", BAD_FIELDS, ids=IDS)
def test_bad_field_in_a_batch_names_row_field_and_range(name, value, allowed):
    with raises(r"^row 1: ", rf"\b{name} must be", allowed):
        middle(SamplingParams(**{name: value}))
    good_call()


@pytest.mark.parametrize("name, value, allowed", BAD_FIELDS, ids=IDS)
def test_sampling_params_validate_names_field_and_range(name, value, allowed):
    with raises(rf"^{name} must be", allowed):
        SamplingParams(**{name: value}).validate()
    with raises(rf"^{name} must be", allowed):
        SamplingParams(**{name: value}).validate(vocab_size=V)


@pytest.mark.parametrize("name, value", [
    ("temperature", 0.0), ("temperature", 1e-6), ("top_k", -1), ("top_k", 0), ("top_k", 10**6),
    ("top_p", 1.0), ("top_p", 1e-9), ("min_p", 0.0), ("min_p", 1.0),
    ("repetition_penalty", 1e-3), ("presence_penalty", -2.0), ("frequency_penalty", 2.0),
])
def test_boundary_values_are_accepted(name, value):
    params = SamplingParams(**{name: value}, seed=3)
    params.validate(vocab_size=V)
    out = sample_requests(ROW, [params], [History(prompt_ids=[1], output_ids=[7])])
    assert 0 <= out.token_ids[0] < V


def test_negative_step():
    with raises(r"^row 1: ", r"\bstep must be", ">= 0", "-1"):
        sample_requests(ROWS3, [SamplingParams()] * 3, steps=[0, -1, 0])


@pytest.mark.parametrize("bad", [V, V + 100, -1])
@pytest.mark.parametrize("field", ["prompt_ids", "output_ids"])
def test_history_ids_out_of_range(field, bad):
    history = History(**{field: [0, 1, bad]})
    for params in (SamplingParams(), SamplingParams(repetition_penalty=1.2)):
        with raises(r"^row 1: ", rf"\b{field}\b", rf"token ids in \[0, {V}\)", str(bad)):
            middle(params, history)


@pytest.mark.parametrize("bad", [V, -1])
def test_logit_bias_id_out_of_range(bad):
    with raises(r"^row 1: ", r"bias", rf"token ids in \[0, {V}\)", str(bad)):
        middle(SamplingParams(logit_bias={0: 1.0, bad: 1.0}))
    with raises(r"^logit_bias must be", rf"token ids in \[0, {V}\)", str(bad)):
        SamplingParams(logit_bias={bad: 1.0}).validate(vocab_size=V)


@pytest.mark.parametrize("bad", [V, -1])
def test_stop_token_id_out_of_range_while_banned(bad):
    params = SamplingParams(min_tokens=2, stop_token_ids=[1, bad])
    with raises(r"^row 1: ", r"ban_ids|stop_token_ids", rf"token ids in \[0, {V}\)", str(bad)):
        middle(params)
    with raises(r"^stop_token_ids must be", rf"token ids in \[0, {V}\)", str(bad)):
        SamplingParams(stop_token_ids=[bad]).validate(vocab_size=V)


@pytest.mark.parametrize("bad", [V, -1])
def test_stop_token_id_out_of_range_when_not_banned(bad):
    with raises(r"^row 1: ", r"stop_token_ids", rf"\[0, {V}\)"):
        middle(SamplingParams(min_tokens=0, stop_token_ids=[bad]))


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_logit_bias_value_must_be_finite_or_minus_infinity(value):
    """+inf cannot reach a row through logit_bias: it is rejected up front."""
    with raises(r"^row 1: ", "logit_bias value", r"in \[-1e6, 1e6\] or -inf"):
        middle(SamplingParams(logit_bias={3: value}))
    with raises(r"^logit_bias value must be", r"in \[-1e6, 1e6\] or -inf"):
        SamplingParams(logit_bias={3: value}).validate()


def test_logit_bias_error_names_the_row_of_the_bad_value():
    params = [SamplingParams(logit_bias={1: 1.0, 2: 2.0}), SamplingParams(),
              SamplingParams(logit_bias={0: 0.5, 4: float("inf")})]
    with raises(r"^row 2: ", "logit_bias value", r"in \[-1e6, 1e6\] or -inf"):
        sample_requests(ROWS3, params)


def test_duplicate_logit_bias_ids_in_a_row():
    batch = SamplingBatch.from_params([SamplingParams(logit_bias={3: 1.0}),
                                       SamplingParams(logit_bias={1: 1.0, 2: 2.0}),
                                       SamplingParams()])
    batch.bias_ids = np.array([3, 5, 5], np.int64)
    with raises(r"^row 1: ", "logit_bias", r"token 5\b", "more than once"):
        sample(ROWS3, batch)
    # the same id in two different rows is fine (rows 0 and 1 both bias 3)
    batch.bias_ids = np.array([3, 3, 5], np.int64)
    assert sample(ROWS3, batch).token_ids.shape == (3,)
    # and each row takes its own bias of it: 3 lifted to the top in rows 0
    # and 1, banned with the argmax 7 in row 2 (greedy, so the tokens are known)
    shared = SamplingBatch.from_params([
        SamplingParams(temperature=0.0, logit_bias={3: 100.0}),
        SamplingParams(temperature=0.0, logit_bias={5: 1.0, 3: 100.0}),
        SamplingParams(temperature=0.0, logit_bias={3: -np.inf, 7: -np.inf})])
    assert ROW.argmax() == 7
    assert sample(ROWS3, shared).token_ids.tolist() == [3, 3, 6]


def test_malformed_csr_offsets():
    batch = SamplingBatch.from_params([SamplingParams()] * 3)
    batch.prompt_offsets = np.array([0, 2, 1, 1], np.int64)
    batch.prompt_ids = np.array([0], np.int64)
    with raises("prompt_offsets", "non-decreasing"):
        sample(ROWS3, batch)


def test_column_of_the_wrong_length():
    batch = SamplingBatch.from_params([SamplingParams()] * 3)
    batch.top_p = np.ones(2)
    with raises("top_p must have shape", r"\[3\]"):
        sample(ROWS3, batch)


# ------------------------------------------------------ SamplingParams only


@pytest.mark.parametrize("seed", [-1, 2**64])
def test_validate_seed(seed):
    with raises(r"^seed must be", r"\[0, 2\*\*64\)"):
        SamplingParams(seed=seed).validate()
    SamplingParams(seed=0).validate()
    SamplingParams(seed=2**64 - 1).validate()


def test_validate_min_tokens():
    with raises(r"^min_tokens must be", ">= 0", "-1"):
        SamplingParams(min_tokens=-1).validate()
    SamplingParams(min_tokens=0).validate()


def test_validate_accepts_the_defaults():
    SamplingParams().validate()
    SamplingParams().validate(vocab_size=1)
    SamplingParams(logit_bias={0: -np.inf, 7: 100.0}, stop_token_ids=[7]).validate(vocab_size=V)


@pytest.mark.parametrize("seed", [-1, 2**64])
def test_bad_seed_in_a_batch(seed):
    with raises(r"^row 1: ", r"\bseed\b", r"\[0, 2\*\*64\)"):
        middle(SamplingParams(seed=seed))


def test_negative_min_tokens_in_a_batch():
    with raises(r"^row 1: ", r"\bmin_tokens\b", ">= 0"):
        middle(SamplingParams(min_tokens=-1, stop_token_ids=[1]))


# ----------------------------------------------------------- recovery


def test_a_bad_row_does_not_break_later_calls():
    expected = good_call()
    rows = ROWS3.copy()
    rows[1, 2] = np.nan
    for _ in range(3):
        with raises(r"^row 1: ", "NaN", r"column 2\b"):
            sample_requests(rows, [SamplingParams()] * 3)
        with raises(r"^row 1: ", "every token is banned"):
            middle(SamplingParams(logit_bias={t: -np.inf for t in range(V)}))
        with raises(r"^row 1: ", "temperature"):
            middle(SamplingParams(temperature=-1.0))
        again = good_call()
        np.testing.assert_array_equal(again.token_ids, expected.token_ids)
        np.testing.assert_array_equal(again.top_logprobs, expected.top_logprobs)


def test_only_the_first_bad_row_is_reported():
    rows = np.stack([ROW] * 4)
    rows[1, 0] = np.nan
    rows[3, 4] = np.inf
    with raises(r"^row 1: ", "NaN", r"column 0\b"):
        sample_requests(rows, [SamplingParams()] * 4)


def test_error_for_the_second_of_three_rows_says_row_1():
    with raises(r"^row 1: "):
        middle(SamplingParams(top_p=0.0))
    with raises(r"^row 1: "):
        middle(SamplingParams(logit_bias={V: 1.0}))
    rows = ROWS3.copy()
    rows[1, 4] = np.inf
    with raises(r"^row 1: "):
        sample_requests(rows, [SamplingParams()] * 3)


# ------------------------------------------- values the kernels cannot read


@pytest.mark.parametrize("params, pattern", [
    # the kernels read float32: 1e46 would be an inverse temperature of 0 (token -1, once)
    (SamplingParams(temperature=1e46), r"temperature must be a finite value >= 0 in float32"),
    (SamplingParams(repetition_penalty=1e39), r"repetition_penalty must be in \[1e-6, 1e6\]"),
    (SamplingParams(top_p=1e-46), r"top_p must be in \(0, 1\] in float32"),
    (SamplingParams(logit_bias={5: 1e39}), r"logit_bias value must be in \[-1e6, 1e6\] or -inf"),
    # -1e39 would be a ban (-inf) the client did not ask for
    (SamplingParams(logit_bias={5: -1e39}), r"logit_bias value must be in \[-1e6, 1e6\] or"),
    (SamplingParams(top_k=2**63), r"top_k must be in \[-9223372036854775808, 9223372036854775807\]"),
    (SamplingParams(top_k=2.5), r"top_k must be an integer, got 2.5"),
    (SamplingParams(seed=1.5), r"seed must be an integer, got 1.5"),
    (SamplingParams(min_tokens=1.5), r"min_tokens must be an integer"),
    (SamplingParams(logit_bias={1.5: 1.0}), r"logit_bias token id must be an integer"),
], ids=["t", "rep", "p", "bias", "ban", "k-huge", "k-float", "seed", "min-tokens", "bias-id"])
def test_a_value_the_kernels_would_read_otherwise_is_refused(params, pattern):
    with raises(r"^row 1: ", pattern):
        middle(params)
    good_call()


def test_a_batch_whose_columns_disagree_in_length_is_refused():
    batch = SamplingBatch.from_params([SamplingParams(seed=1, logit_bias={3: 5.0}),
                                       SamplingParams(seed=2)], vocab_size=V)
    # too few bias values once read past its end (a crash, or another row's token)
    with raises(r"bias_values must hold one value per bias_ids entry"):
        sample(ROWS3[:2], dataclasses.replace(batch, bias_values=np.zeros(0)))
    for name in ("seed", "step"):  # once broadcast from one row to both
        with raises(rf"{name} must have shape \[2\], got \[1\]"):
            sample(ROWS3[:2], dataclasses.replace(batch, **{name: getattr(batch, name)[:1]}))
    good_call()


@pytest.mark.parametrize("code, error", [(RowError.ERROR_INTERNAL, RuntimeError),
                                         (RowError.ERROR_OUT_OF_MEMORY, MemoryError),
                                         (RowError.ERROR_NAN, ValueError)])
def test_a_row_error_of_the_samplers_own_is_not_the_requests(code, error):
    """A 5xx where the failure is ours: only ValueError becomes a client's 400."""
    errors = np.array([0, int(code)], np.int32)
    with pytest.raises(error, match="^row 1: ") as raised:
        raise_row_errors(errors, np.array([-1, 3], np.int64))
    assert isinstance(raised.value, ValueError) == (error is ValueError)
