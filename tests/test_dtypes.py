"""dtype parity: a row of float16 (bfloat16) values samples identically
whether it arrives as float32, as a float16 (bfloat16) numpy array or as a
CPU torch tensor, because the kernels convert every half exactly."""
import ml_dtypes
import numpy as np
import pytest
import torch

from simple_sampler import reference
from simple_sampler.params import History, SamplingBatch, SamplingParams
from simple_sampler.sampling import sample, sample_requests

VOCAB = 3000
N_TOP = 8
BF16 = np.dtype(ml_dtypes.bfloat16)


def to_torch(array):
    if array.dtype == BF16:
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(array.copy())


def mixed_case(rng):
    rows = (-1.1 * np.log(np.argsort(rng.random((8, VOCAB)), axis=1) + 1.0)
            + 0.5 * rng.standard_normal((8, VOCAB)))
    rows[:, rng.integers(0, VOCAB, 20)] = -np.inf
    rows[3, :VOCAB - 1] = -np.inf          # a row with a single finite token
    rows[3, VOCAB - 1] = -2.0
    params = [
        SamplingParams(temperature=0.0, seed=1),
        SamplingParams(temperature=0.8, top_p=0.9, seed=2),
        SamplingParams(top_k=30, min_p=0.05, seed=3),
        SamplingParams(top_p=0.7, seed=4),
        SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5,
                       logit_bias={5: 2.0, 17: -np.inf, 900: 1.25}, seed=5),
        SamplingParams(temperature=0.0, repetition_penalty=1.5, logit_bias={11: 1.0},
                       min_tokens=3, stop_token_ids=[int(np.argmax(rows[5]))], seed=6),
        SamplingParams(temperature=1.4, seed=7),
        SamplingParams(top_k=5, top_p=0.8, min_p=0.01, temperature=0.6,
                       repetition_penalty=0.9, seed=8),
    ]
    histories = [History(prompt_ids=np.argsort(-rows[r])[:15].tolist(),
                         output_ids=np.argsort(-rows[r])[3:9].tolist() * (r % 3))
                 for r in range(8)]
    histories[3] = History()
    histories[5] = History(prompt_ids=[int(np.argmax(rows[5]))], output_ids=[1])
    return rows, params, histories


def run(logits, params, histories, **kwargs):
    return sample_requests(logits, params, histories, steps=[4] * len(params),
                           num_top_logprobs=N_TOP, num_threads=1, **kwargs)


def assert_identical(a, b):
    np.testing.assert_array_equal(a.token_ids, b.token_ids)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    np.testing.assert_array_equal(a.top_token_ids, b.top_token_ids)
    np.testing.assert_array_equal(a.top_logprobs, b.top_logprobs)


@pytest.mark.parametrize("half", [np.dtype(np.float16), BF16], ids=["float16", "bfloat16"])
def test_half_rows_match_their_float32_values(half):
    rng = np.random.default_rng(31)
    rows, params, histories = mixed_case(rng)
    halves = rows.astype(half)
    assert np.isneginf(halves.astype(np.float32)).sum() > 8
    as_f32 = run(halves.astype(np.float32), params, histories)
    as_half = run(halves, params, histories)
    as_torch = run(to_torch(halves), params, histories)
    assert as_torch is not None and to_torch(halves).dtype in (torch.float16, torch.bfloat16)
    assert_identical(as_f32, as_half)
    assert_identical(as_f32, as_torch)
    # one-dimensional inputs of each kind agree too
    for r in (0, 4):
        single = [params[r]], [histories[r]]
        for logits in (halves[r], to_torch(halves[r])):
            one = sample_requests(logits, *single, steps=[4], num_top_logprobs=N_TOP,
                                  num_threads=1)
            assert one.token_ids[0] == as_f32.token_ids[r]
            assert one.logprobs[0] == as_f32.logprobs[r]


@pytest.mark.parametrize("half", [np.dtype(np.float16), BF16], ids=["float16", "bfloat16"])
def test_half_rows_follow_the_semantics(half):
    """Not merely self-consistent: greedy picks the argmax of the penalized
    half values and logprobs match the float64 reference on them."""
    rng = np.random.default_rng(32)
    rows, params, histories = mixed_case(rng)
    halves = rows.astype(half)
    out = run(halves, params, histories)
    values = halves.astype(np.float32)
    batch = SamplingBatch.from_params(params, histories, [4] * len(params))
    for r, p in enumerate(params):
        z = reference.scaled_logits(values[r], batch, r)
        expected = reference.log_softmax(z)
        if p.greedy:
            assert out.token_ids[r] == int(np.argmax(z))
        assert reference.probabilities(values[r], batch, r)[out.token_ids[r]] > 0
        assert abs(out.logprobs[r] - expected[out.token_ids[r]]) < 1e-4
        np.testing.assert_allclose(out.top_logprobs[r], expected[out.top_token_ids[r]],
                                   rtol=0, atol=1e-4)
    assert out.token_ids[3] == VOCAB - 1
    assert out.logprobs[3] == 0.0


def test_torch_float32_tensors_match_numpy():
    rng = np.random.default_rng(33)
    rows, params, histories = mixed_case(rng)
    rows = rows.astype(np.float32)
    assert_identical(run(rows, params, histories), run(torch.from_numpy(rows), params, histories))


def test_strided_torch_rows():
    rng = np.random.default_rng(34)
    rows, params, histories = mixed_case(rng)
    halves = rows.astype(np.float16)
    big = torch.zeros((16, VOCAB), dtype=torch.float16)
    big[::2] = torch.from_numpy(halves)
    assert_identical(run(halves, params, histories), run(big[::2], params, histories))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kernels_read_the_rows_in_place(dtype):
    """No copy of the logits between the caller and the kernels (docs/COPIES.md),
    strided rows included, in every dtype (no float32 upcast)."""
    from simple_sampler.sampling import kernel_rows

    big = torch.randn(8, VOCAB).to(dtype)
    for logits in (big, big[::2]):
        rows, _ = kernel_rows(logits)
        assert rows.shape == (len(logits), VOCAB * big.element_size())
        assert rows.__array_interface__["data"][0] == logits.data_ptr()
        assert rows.strides[0] == logits.stride(0) * big.element_size()


def test_non_cpu_torch_tensor_is_rejected():
    meta = torch.empty((1, 4), dtype=torch.float16, device="meta")
    with pytest.raises(ValueError, match="CPU"):
        sample_requests(meta, [SamplingParams()])


# ------------------------------------------- every half value converts exactly


def all_finite_halves(dtype):
    """Every bit pattern of a 16-bit float except NaN and +inf."""
    values = np.arange(2**16, dtype=np.uint16).view(dtype)
    as_f32 = values.astype(np.float32)
    keep = ~np.isnan(as_f32) & (as_f32 != np.inf)
    return values[keep]


@pytest.mark.parametrize("half", [np.dtype(np.float16), BF16], ids=["float16", "bfloat16"])
def test_every_half_value_converts_exactly(half):
    """Row r is [v_r, 0]: its top logprobs are v_r - lse and -lse, which
    depend on v_r exactly; the half and float32 inputs must agree bit for bit
    (subnormals, zeros of both signs, the extremes and -inf included)."""
    values = all_finite_halves(half)
    rows = np.zeros((values.size, 2), half)
    rows[:, 0] = values
    batch = SamplingBatch.from_params([SamplingParams(temperature=0.0)] * values.size)
    as_half = sample(rows, batch, num_top_logprobs=2, num_threads=1)
    as_f32 = sample(rows.astype(np.float32), batch, num_top_logprobs=2, num_threads=1)
    assert_identical(as_f32, as_half)
    # greedy: token 0 exactly where v > 0 (ties go to the lower id, token 0)
    expected = np.where(values.astype(np.float32) >= 0, 0, 1)
    np.testing.assert_array_equal(as_half.token_ids, expected)


def test_float16_subnormals_keep_their_values():
    """Crafted row of float16 subnormals, read at temperature 1e-5 so their
    tiny differences become visible: logprob differences must equal numpy's
    float16 -> float32 values times 1e5."""
    tiny = np.float32(2.0**-24)
    codes = np.array([0x0000, 0x0001, 0x0003, 0x0010, 0x0155, 0x03FF, 0x8001, 0x8200,
                      0x0400, 0x8000, 0x0200], np.uint16)
    halves = codes.view(np.float16)
    values = halves.astype(np.float32)
    assert values[1] == tiny and values[5] == 1023 * tiny and values[8] == 2.0**-14
    assert np.all(np.abs(values[[1, 2, 3, 4, 5, 6, 7, 10]]) < 2.0**-14)    # subnormal
    params = SamplingParams(temperature=1e-5, seed=0)
    out = sample_requests(halves, [params], num_top_logprobs=values.size, num_threads=1)
    z = values.astype(np.float64) * np.float64(np.float32(1e5))
    full = np.empty(values.size)
    full[out.top_token_ids[0]] = out.top_logprobs[0]
    np.testing.assert_allclose(full - full[0], z - z[0], rtol=0, atol=2e-5)
    # the largest value (2**-14, a normal) first, then the biggest subnormal
    assert out.top_token_ids[0][:3].tolist() == [8, 5, 10]
    # and the torch route agrees bit for bit
    same = sample_requests(torch.from_numpy(halves.copy()), [params],
                           num_top_logprobs=values.size, num_threads=1)
    assert_identical(out, same)


def test_float16_subnormal_decides_the_greedy_token():
    """Zeros first, then a single positive subnormal: flushing subnormals to
    zero would pick token 0."""
    codes = np.array([0x0000, 0x8000, 0x8001, 0x0001, 0x0000], np.uint16)
    halves = codes.view(np.float16)
    out = sample_requests(halves, [SamplingParams(temperature=0.0)], num_threads=1)
    assert out.token_ids[0] == 3
    out = sample_requests(torch.from_numpy(halves.copy()), [SamplingParams(temperature=0.0)],
                          num_threads=1)
    assert out.token_ids[0] == 3
    # bfloat16 subnormal (smallest positive: bits 0x0001)
    bf = np.array([0x0000, 0x8001, 0x0001], np.uint16).view(BF16)
    assert bf.astype(np.float32)[2] > 0
    assert sample_requests(bf, [SamplingParams(temperature=0.0)]).token_ids[0] == 2


@pytest.mark.parametrize("half", [np.dtype(np.float16), BF16], ids=["float16", "bfloat16"])
def test_half_rows_with_nan_or_infinity_are_rejected(half):
    row = np.zeros(70, half)       # two blocks; the bad value in the second
    for bad, words in ((np.nan, "NaN"), (np.inf, r"\+inf")):
        broken = row.copy()
        broken[66] = bad
        for logits in (broken, to_torch(broken)):
            with pytest.raises(ValueError, match=rf"row 0: .*{words}.*column 66"):
                sample_requests(logits, [SamplingParams()])
