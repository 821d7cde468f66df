"""The sampler model's tensors: decoding, defaults, checks and outputs,
without a server (the server tests run the same code behind Triton)."""
import numpy as np
import pytest

from simple_sampler.params import History, SamplingParams
from simple_sampler.sampling import sample_requests
from simple_sampler.launch import templates
from simple_sampler.schema import ROW_SCALARS_RECORD, InvalidRequest
from simple_sampler.triton.sampler_decode import decode_request
from simple_sampler.triton.sampler_serve import sample_request

V = 50


@pytest.fixture
def logits():
    return np.random.default_rng(3).standard_normal((3, V)).astype(np.float32) * 2


def column(values, dtype=np.float32):
    return np.asarray(values, dtype=dtype)[:, None]


def test_defaults_match_the_python_api(logits):
    inputs = {"logits": logits, "random_seed": column([1, 2, 3], np.uint64)}
    tokens = sample_request(decode_request(inputs))[0]["output_ids"]
    expected = sample_requests(logits, [SamplingParams(seed=s) for s in (1, 2, 3)]).token_ids
    assert tokens.dtype == np.int32 and tokens.shape == (3, 1)
    np.testing.assert_array_equal(tokens[:, 0], expected)


def test_every_input_reaches_the_kernels(logits):
    inputs = {
        "logits": logits,
        "temperature": column([0.7, 1.3, 0.0]),
        "runtime_top_k": column([5, 0, 0], np.int32),
        "runtime_top_p": column([1.0, 0.8, 1.0]),
        "min_p": column([0.0, 0.0, 0.1]),
        "repetition_penalty": column([1.2, 1.0, 1.0]),
        "presence_penalty": column([0.0, 0.5, 0.0]),
        "frequency_penalty": column([0.0, 0.0, 0.3]),
        "random_seed": column([7, 8, 9], np.uint64),
        "step": column([4, 0, 2], np.int64),
        "prompt_ids": np.array([[1, 2, -1], [3, -1, -1], [-1, -1, -1]], np.int32),
        "generated_ids": np.array([[4, 4], [5, -1], [6, 7]], np.int32),
        "logit_bias_ids": np.array([[9, -1], [10, 11], [-1, -1]], np.int32),
        "logit_bias_values": np.array([[3.0, 0.0], [-np.inf, 2.0], [0.0, 0.0]], np.float32),
        "min_tokens": column([0, 0, 5], np.int32),
        "end_id": column([12, 12, 12], np.int32),
        "return_log_probs": column([True, False, True], bool),
        "num_top_logprobs": column([2, 0, 1], np.int32),
    }
    out, _ = sample_request(decode_request(inputs))
    params = [
        SamplingParams(temperature=0.7, top_k=5, repetition_penalty=1.2, seed=7,
                       logit_bias={9: 3.0}, stop_token_ids=[12]),
        SamplingParams(temperature=1.3, top_p=0.8, presence_penalty=0.5, seed=8,
                       logit_bias={10: -np.inf, 11: 2.0}, stop_token_ids=[12]),
        SamplingParams(temperature=0.0, min_p=0.1, frequency_penalty=0.3, seed=9,
                       min_tokens=5, stop_token_ids=[12]),
    ]
    histories = [History([1, 2], [4, 4]), History([3], [5]), History([], [6, 7])]
    expected = sample_requests(logits, params, histories, steps=[4, 0, 2], num_top_logprobs=2)
    np.testing.assert_array_equal(out["output_ids"][:, 0], expected.token_ids)
    assert np.isnan(out["output_log_probs"][1, 0])
    np.testing.assert_array_equal(out["output_log_probs"][[0, 2], 0], expected.logprobs[[0, 2]])
    np.testing.assert_array_equal(out["top_logprobs_ids"][0], expected.top_token_ids[0])
    assert out["top_logprobs_ids"][1].tolist() == [-1, -1]
    assert out["top_logprobs_ids"][2, 1] == -1 and out["top_logprobs"][2, 1] == -np.inf
    assert out["top_logprobs_ids"][2, 0] == expected.top_token_ids[2, 0]


def test_min_tokens_bans_end_ids_until_reached():
    logits = np.zeros((2, 4), np.float32)
    logits[:, 3] = 30.0  # the end id would win every draw
    inputs = {"logits": logits, "end_id": column([3, 3], np.int32),
              "min_tokens": column([2, 2], np.int32), "step": column([1, 2], np.int64),
              "temperature": column([0, 0])}
    assert sample_request(decode_request(inputs))[0]["output_ids"][:, 0].tolist() == [0, 3]


def test_step_defaults_to_the_generated_count(logits):
    generated = np.array([[1, 2, -1], [-1, -1, -1], [3, 3, 3]], np.int32)
    decoded = decode_request({"logits": logits, "generated_ids": generated})
    assert decoded.batch.step.tolist() == [2, 0, 3]


def test_no_outputs_beyond_what_was_asked(logits):
    out, _ = sample_request(decode_request({"logits": logits}))
    assert set(out) == {"output_ids"}


@pytest.mark.parametrize("name, value, message", [
    ("temperature", column([1, -1, 1]), "row 1: temperature must be a finite value >= 0"),
    ("runtime_top_p", column([1, 1, 1.5]), "row 2: runtime_top_p must be in (0, 1]"),
    ("runtime_top_k", column([-2, 0, 0], np.int32), "row 0: runtime_top_k must be >= -1"),
    ("min_p", column([0, 2, 0]), "row 1: min_p must be in [0, 1]"),
    ("presence_penalty", column([0, 0, 3]), "row 2: presence_penalty must be in [-2, 2]"),
    ("repetition_penalty", column([0, 1, 1]), "row 0: repetition_penalty must be in [1e-6, 1e6]"),
    ("temperature", np.ones((2, 1), np.float32), "temperature must have shape [3, 1]"),
    ("prompt_ids", np.array([[1], [V], [2]], np.int32),
     f"row 1: prompt_ids must be token ids in [0, {V}) or -1 (padding), got {V}"),
    ("generated_ids", np.array([[1], [-2], [2]], np.int32), "row 1: generated_ids must be token ids"),
    ("end_id", np.array([[V + 5]] * 3, np.int32), "row 0: end_id must be token ids"),
    ("step", column([0, -1, 0], np.int64), "row 1: step must be >= 0"),
    ("min_tokens", column([0, -1, 0], np.int32), "row 1: min_tokens must be >= 0"),
    ("num_top_logprobs", column([0, 21, 0], np.int32), "row 1: num_top_logprobs must be in [0, 20]"),
    ("logit_bias_ids", np.array([[1]] * 3, np.int32), "must be sent together"),
    ("bogus", column([1, 1, 1]), "unknown input bogus"),
])
def test_bad_inputs_name_the_field(logits, name, value, message):
    with pytest.raises(InvalidRequest, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        decode_request({"logits": logits, name: value})


def test_logit_bias_checks():
    logits = np.zeros((1, V), np.float32)
    ids = np.array([[1, 1]], np.int32)
    with pytest.raises(InvalidRequest, match="row 0: logit_bias names token 1 more than once"):
        decode_request({"logits": logits, "logit_bias_ids": ids,
                        "logit_bias_values": np.ones((1, 2), np.float32)})
    with pytest.raises(InvalidRequest, match="logit_bias_values must have the shape"):
        decode_request({"logits": logits, "logit_bias_ids": ids,
                        "logit_bias_values": np.ones((1, 3), np.float32)})
    with pytest.raises(InvalidRequest, match=r"logit_bias value must be in \[-1e6, 1e6\] or -inf"):
        decode_request({"logits": logits, "logit_bias_ids": np.array([[1]], np.int32),
                        "logit_bias_values": np.array([[np.nan]], np.float32)})


def test_logits_checks():
    with pytest.raises(InvalidRequest, match="logits is required"):
        decode_request({"temperature": column([1.0])})
    with pytest.raises(InvalidRequest, match="logits must have shape"):
        decode_request({"logits": np.zeros((2, 3, 4), np.float32)})
    with pytest.raises(InvalidRequest, match="logits must have 100 columns"):
        decode_request({"logits": np.zeros((1, 99), np.float32)}, vocab_size=100)
    bad = np.zeros((2, 8), np.float32)
    bad[1, 5] = np.nan
    with pytest.raises(InvalidRequest, match="row 1: logits must not contain NaN; found at column 5"):
        sample_request(decode_request({"logits": bad}))


def test_templates_fill_every_placeholder_and_nothing_else():
    text = "a: ${one}\n# cost: $5\nb: ${two}"
    assert templates.fill(text, {"one": 1, "two": "x"}) == "a: 1\n# cost: $5\nb: x"
    with pytest.raises(ValueError, match="no value for two"):
        templates.fill(text, {"one": 1})
    with pytest.raises(ValueError, match="no placeholder named three"):
        templates.fill(text, {"one": 1, "two": 2, "three": 3})
    assert templates.parse_assignments("a:1, b:x:y,") == {"a": "1", "b": "x:y"}
    # a comma in a value escaped as TensorRT-LLM's fill_template.py takes it; a name once
    assert templates.parse_assignments(r"a:local\,h:8001,b:2") == {"a": "local,h:8001", "b": "2"}
    with pytest.raises(ValueError, match="a is given twice"):
        templates.parse_assignments("a:1,a:2")
    assert templates.fill('path: "${p}"', {"p": 'x"y\\z'}) == 'path: "x\\"y\\\\z"'
    with pytest.raises(ValueError, match="expected name:value"):
        templates.parse_assignments("a=1")


def test_batch_arrays_round_trip(logits):
    from simple_sampler.params import SamplingBatch
    from simple_sampler.triton.sampler_codec import batch_arrays

    # values exact in float32, the tensors' dtype
    params = [SamplingParams(temperature=0.5, top_k=3, seed=1, logit_bias={4: 1.5}),
              SamplingParams(top_p=0.75, repetition_penalty=1.25, seed=2),
              SamplingParams(min_p=0.25, frequency_penalty=-1.0, seed=3, logit_bias={1: -2.0, 7: 0.5})]
    histories = [History([1, 2, 3], [4]), History([], [5, 6]), History([7], [])]
    batch = SamplingBatch.from_params(params, histories, steps=[9, 1, 0])
    decoded = decode_request({"logits": logits, **batch_arrays(batch)}).batch
    for name, value in vars(batch).items():
        np.testing.assert_array_equal(getattr(decoded, name), value, err_msg=name)


def test_bans_travel_as_minus_infinity_bias(logits):
    from simple_sampler.params import SamplingBatch
    from simple_sampler.sampling import sample
    from simple_sampler.triton.sampler_codec import batch_arrays

    params = [SamplingParams(seed=s, min_tokens=3, stop_token_ids=[int(np.argmax(logits[s]))],
                             logit_bias={int(np.argmax(logits[s])): 1.0, 2: 0.5}, temperature=0.0)
              for s in range(3)]
    batch = SamplingBatch.from_params(params)
    assert batch.ban_ids.size == 3
    served, _ = sample_request(decode_request({"logits": logits, **batch_arrays(batch)}))
    direct = sample(logits, batch)
    np.testing.assert_array_equal(served["output_ids"][:, 0], direct.token_ids)
    assert not np.isin(direct.token_ids, batch.ban_ids).any()


def test_bans_merge_into_the_bias_row_by_row():
    from simple_sampler.params import SamplingBatch
    from simple_sampler.triton.sampler_codec import _bias_with_bans

    rng = np.random.default_rng(0)
    params = [SamplingParams(seed=r, min_tokens=int(rng.integers(0, 2)),
                             stop_token_ids=rng.choice(8, rng.integers(0, 3), replace=False).tolist(),
                             logit_bias={int(t): float(rng.normal())
                                         for t in rng.choice(8, rng.integers(0, 3), replace=False)})
              for r in range(40)]
    batch = SamplingBatch.from_params(params)
    assert batch.ban_ids.size and batch.bias_ids.size
    offsets, ids, values = _bias_with_bans(batch)
    for row, p in enumerate(params):
        want = dict(p.logit_bias)
        want.update({t: -np.inf for t in (p.stop_token_ids if p.min_tokens else [])})
        a, b = offsets[row], offsets[row + 1]
        assert dict(zip(ids[a:b].tolist(), values[a:b].tolist())) == want
        assert len(set(ids[a:b].tolist())) == b - a


def test_packed_form_gives_the_same_outputs_with_fewer_tensors():
    """batch_arrays(packed=True), the sampler pool's form: one row_scalars
    record per row, bans as end_id (min_tokens = step + 1), histories only for
    rows with a penalty; every output identical to the one-tensor-each form."""
    from simple_sampler.params import SamplingBatch
    from simple_sampler.triton.sampler_codec import batch_arrays

    rng = np.random.default_rng(1)
    vocab = 64
    rows = rng.normal(0, 3, (12, vocab)).astype(np.float32)
    params = [SamplingParams(seed=r, temperature=[0.0, 0.7, 1.3][r % 3], top_p=[1.0, 0.8][r % 2],
                             top_k=[0, 5, 40][r % 3], repetition_penalty=[1.0, 1.3][r % 4 == 1],
                             frequency_penalty=[0.0, 0.5][r % 5 == 2], min_tokens=r % 3,
                             stop_token_ids=[int(np.argmax(rows[r])), 3],
                             logit_bias={int(np.argmax(rows[r])): 2.0, 9: -1.0} if r % 2 else {})
              for r in range(12)]
    histories = [History(rng.integers(0, vocab, r).tolist(), rng.integers(0, vocab, r % 4).tolist())
                 for r in range(12)]
    batch = SamplingBatch.from_params(params, histories, vocab_size=vocab)
    batch.want_logprobs = np.arange(12) % 2 == 0
    assert batch.ban_ids.size and batch.bias_ids.size
    separate = {**batch_arrays(batch), "return_log_probs": batch.want_logprobs[:, None]}
    packed = batch_arrays(batch, packed=True)
    assert "temperature" not in packed and packed["row_scalars"].dtype == np.uint8
    assert len(packed) < len(separate)
    # rows without a penalty send no history
    assert (packed["prompt_ids"][[0, 3, 4]] == -1).all() and (packed["prompt_ids"][1] != -1).any()
    one, _ = sample_request(decode_request({"logits": rows, **separate}))
    other, _ = sample_request(decode_request({"logits": rows, **packed}))
    assert one.keys() == other.keys()
    for name in one:
        np.testing.assert_array_equal(one[name], other[name], err_msg=name)
    # no penalty anywhere: no history at all
    plain = SamplingBatch.from_params([SamplingParams(seed=1)], [History([1, 2], [3])])
    assert "prompt_ids" not in batch_arrays(plain, packed=True)


def test_packed_scalars_are_checked_like_the_separate_tensors(logits):
    from simple_sampler.params import SamplingBatch
    from simple_sampler.triton.sampler_codec import batch_arrays

    batch = SamplingBatch.from_params([SamplingParams(seed=s) for s in range(len(logits))])
    packed = batch_arrays(batch, packed=True)
    records = packed["row_scalars"].copy().view(ROW_SCALARS_RECORD)
    records["runtime_top_p"][1] = 1.5
    with pytest.raises(InvalidRequest, match=r"row 1: runtime_top_p must be in \(0, 1\], got 1.5"):
        decode_request({"logits": logits, "row_scalars": records.view(np.uint8)})
    with pytest.raises(InvalidRequest, match="row_scalars carries temperature"):
        decode_request({"logits": logits, **packed, "temperature": np.ones((len(logits), 1))})
    size = ROW_SCALARS_RECORD.itemsize
    with pytest.raises(InvalidRequest, match=rf"row_scalars must be UINT8 \[B, {size}\]"):
        decode_request({"logits": logits, "row_scalars": packed["row_scalars"][:, :8]})
    with pytest.raises(InvalidRequest, match="must have shape"):
        decode_request({"logits": logits, "row_scalars": packed["row_scalars"][:1]})


def test_padded_int32_lists_decode_as_numpy_does():
    """The Cython pass (int32) and the numpy one (int64) give the same CSR
    and values for padding anywhere in a row, and name the same bad entry."""
    from simple_sampler.triton.sampler_decode import _id_lists

    rng = np.random.default_rng(5)
    ids = rng.integers(0, V, (6, 9))
    ids[rng.random(ids.shape) < 0.4] = -1
    ids[2] = -1  # a row of padding only
    values = rng.standard_normal(ids.shape).astype(np.float32)
    fast = _id_lists("touched_ids", ids.astype(np.int32), 6, V, values)
    slow = _id_lists("touched_ids", ids.astype(np.int64), 6, V, values)
    for a, b in zip(fast, slow):
        np.testing.assert_array_equal(a, b)
    assert fast[1].dtype == np.int32 and fast[2].dtype == np.float32
    ids[4, 3] = V
    for dtype in (np.int32, np.int64):
        with pytest.raises(InvalidRequest, match=rf"row 4: touched_ids must be token ids in "
                                                 rf"\[0, {V}\) or -1 \(padding\), got {V}"):
            _id_lists("touched_ids", ids.astype(dtype), 6, V)


def test_packed_records_are_checked_and_converted_as_numpy_does():
    """``_sampling.packed_row_scalars`` (the records' pass of serve_request's
    C path for the llm model's compact requests) refuses exactly the records
    decode_request refuses, reports the first of them, and builds the kernel
    scalars ``kernel_params`` builds, field by field, over the edge values
    of every field of ROW_SCALARS_RECORD."""
    from simple_sampler import _sampling
    from simple_sampler.sampling import ROW_SCALARS, kernel_params
    from simple_sampler.triton import sampler_decode
    from simple_sampler.triton import sampler_packed

    above_one, above_two = np.nextafter(np.float32(1), 2), np.nextafter(np.float32(2), 3)
    edges = {"temperature": [0.0, 1e-6, 9.99e-6, 1e-5, 0.7, 3.0, np.inf, -1e-9, np.nan],
             "runtime_top_k": [-2, -1, 0, 1, 7, V - 1, V, V + 1, 2**31 - 1, -2**31],
             "runtime_top_p": [0.0, 1e-9, 0.5, 1.0, above_one, -0.5, np.nan, np.inf],
             "min_p": [0.0, 0.3, 1.0, above_one, -1e-7, np.nan],
             "repetition_penalty": [0.0, 1e-7, 1e-6, 1e-3, 1.0, 1.7, 1e6, 2e6, np.inf, -1.0,
                                    np.nan],
             "presence_penalty": [-above_two, -2.0, 0.0, 2.0, above_two, np.nan],
             "frequency_penalty": [-above_two, -2.0, 0.5, 2.0, above_two, np.inf],
             "random_seed": [0, 1, 2**63, 2**64 - 1],
             "step": [-1, 0, 3, 2**40, -2**63],
             "min_tokens": [-1, 0, 5],
             "return_log_probs": [False, True],
             "num_top_logprobs": [-1, 0, 1, 20, 21]}
    good = {"temperature": 0.7, "runtime_top_k": 0, "runtime_top_p": 1.0, "min_p": 0.0,
            "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "random_seed": 5, "step": 3, "min_tokens": 0, "return_log_probs": True,
            "num_top_logprobs": 0, "given_token_id": -1}  # -1: drawn (the C pass's rows)
    rng = np.random.default_rng(11)
    records = np.zeros(800, ROW_SCALARS_RECORD)
    for name, value in good.items():
        records[name] = value
    names = list(edges)
    for row in range(len(records)):  # one or two fields of each row on an edge value
        for name in rng.choice(names, rng.integers(1, 3), replace=False):
            values = edges[name]
            records[name][row] = values[rng.integers(len(values))]

    def c_pass(records):
        scalars = np.empty(len(records), ROW_SCALARS)
        failed, any_top = _sampling.packed_row_scalars(
            sampler_packed.PACKED_LAYOUT, records.view(np.uint8).reshape(len(records), -1), V, scalars)
        return failed, any_top, scalars

    refused = []
    for row in range(len(records)):
        one = records[row:row + 1]
        failed, any_top, scalars = c_pass(one)
        try:
            decoded = sampler_decode.decode_request(
                {"logits": np.zeros((1, V), np.float32),
                 "row_scalars": one.view(np.uint8).reshape(1, -1)},
                V, None, None)
        except InvalidRequest:
            assert failed == 0, f"row {row}: {one} refused by numpy, passed in C"
            refused.append(row)
            continue
        assert failed == -1, f"row {row}: {one} passed numpy, refused in C"
        assert any_top == bool(one["num_top_logprobs"][0])
        expected = kernel_params(decoded.batch, V, 0, 1, validated=True)[0]["scalars"]
        for field in ROW_SCALARS.names:
            np.testing.assert_array_equal(scalars[field], expected[field], err_msg=f"row {row} {field}")
    assert 0.2 < len(refused) / len(records) < 0.8, "the edges must give good and bad rows"
    assert c_pass(records)[0] == refused[0]


def test_the_llm_models_compact_requests_are_served_as_the_general_path_serves_them():
    """serve_request decides the llm model's packed compact requests in one
    C call (``decide_plain_compact``) with exactly the outputs of the general
    path (decode_request + sample_request); a request that call does not
    take (top logprobs, a bad record, a bad id) goes the general way, with
    the general outputs or errors."""
    import torch

    from simple_sampler.params import SamplingBatch
    from simple_sampler.serving.hot_first import compact_rows
    from simple_sampler.shvs import HotVocab
    from simple_sampler.triton import sampler_codec as codec
    from simple_sampler.triton import sampler_decode
    from simple_sampler.triton import sampler_packed
    from simple_sampler.triton import sampler_serve

    vocab, rows = 3000, 40
    rng = np.random.default_rng(4)
    logits = rng.normal(0, 2, (rows, vocab)).astype(np.float32)
    hot = HotVocab(rng.choice(vocab, 400, replace=False), vocab)
    logits[:, hot.ids] += 3
    kinds = [dict(), dict(temperature=0.0), dict(top_p=0.9), dict(top_k=20), dict(min_p=0.2),
             dict(temperature=1.7, top_p=0.5), dict(top_k=3, top_p=0.8)]
    # some rows short of min_tokens: their stop ids (a hot one, a cold one) banned
    stops = [int(hot.ids[0]), int(np.setdiff1d(np.arange(vocab), hot.ids)[0])]
    params = [SamplingParams(seed=int(s), **kinds[r % len(kinds)], min_tokens=(r % 2) * 10,
                             stop_token_ids=stops)
              for r, s in enumerate(rng.integers(0, 2**63, rows))]
    batch = SamplingBatch.from_params(params, steps=rng.integers(0, 100, rows).tolist())
    batch.want_logprobs = np.arange(rows) % 3 == 0
    compact = compact_rows(torch.from_numpy(logits), batch, hot)
    inputs = {**codec.compact_arrays(compact, packed=True), **codec.batch_arrays(batch, packed=True)}
    assert inputs.keys() == {*sampler_packed._PLAIN_COMPACT, "end_id"}
    # the banned stop ids change the rows that have them: tokens differ without the bans
    assert not np.array_equal(
        sampler_serve.serve_request({k: v for k, v in inputs.items() if k != "end_id"}, vocab,
                            hot).outputs["output_ids"],
        sampler_serve.serve_request(inputs, vocab, hot).outputs["output_ids"])

    def both(inputs):
        general = sampler_serve.sample_request(sampler_decode.decode_request(inputs, vocab, hot), 1, hot)
        return (sampler_packed.decide_plain_compact(inputs, vocab, hot, None, 1),
                sampler_serve.serve_request(inputs, vocab, hot), general)

    plain, served, (outputs, outcomes) = both(inputs)
    assert plain is not None, "the llm model's form must take the C path"
    # every row decided (the cold draw): no handoff_outcome sent, either way
    assert served.outputs.keys() == outputs.keys() == {"output_ids", "output_log_probs"}
    for name in outputs:
        np.testing.assert_array_equal(served.outputs[name], outputs[name], err_msg=name)
        assert served.outputs[name].dtype == outputs[name].dtype, name
    np.testing.assert_array_equal(served.outcomes, outcomes)
    assert served.batch is None and served.rows == rows and served.in_place == 0
    assert (outputs["output_ids"] >= 0).mean() > 0.5
    assert np.isnan(outputs["output_log_probs"][~batch.want_logprobs]).all()

    # rows whose mass is mostly cold, without the cold draw, are left undecided:
    # then the outcome is sent
    cold = torch.from_numpy(rng.normal(0, 2, (rows, vocab)).astype(np.float32))
    undrawn = {**inputs, **codec.compact_arrays(compact_rows(cold, batch, hot, cold_draw=False),
                                                packed=True)}
    plain, served, (outputs, _) = both(undrawn)
    assert plain is not None and "handoff_outcome" in served.outputs
    assert served.outputs.keys() == outputs.keys()
    for name in outputs:
        np.testing.assert_array_equal(served.outputs[name], outputs[name], err_msg=name)
    assert 0 < (outputs["handoff_outcome"] != 0).sum() < rows

    # rows that are not C-contiguous (Triton's never are) go the general way
    wide = np.zeros((rows, 2 * hot.size), inputs["hot_logits"].dtype)
    wide[:, :hot.size] = inputs["hot_logits"]
    plain, served, (outputs, _) = both({**inputs, "hot_logits": wide[:, :hot.size]})
    assert plain is None
    for name in outputs:
        np.testing.assert_array_equal(served.outputs[name], outputs[name], err_msg=name)

    records = inputs["row_scalars"].copy().view(ROW_SCALARS_RECORD)
    records["num_top_logprobs"][5] = 2
    plain, served, (outputs, _) = both({**inputs, "row_scalars": records.view(np.uint8)})
    assert plain is None and "top_logprobs" in served.outputs
    for name in outputs:
        np.testing.assert_array_equal(served.outputs[name], outputs[name], err_msg=name)
    records["runtime_top_p"][7] = 0.0
    with pytest.raises(InvalidRequest, match=r"row 7: runtime_top_p must be in \(0, 1\], got 0.0"):
        sampler_serve.serve_request({**inputs, "row_scalars": records.view(np.uint8)}, vocab, hot)
    touched = inputs["touched_ids"].copy()
    touched[3, 0] = hot.ids[1]  # a hot id among the touched ones
    with pytest.raises(InvalidRequest, match=f"touched_ids must not hold hot ids, got {hot.ids[1]}"):
        sampler_serve.serve_request({**inputs, "touched_ids": touched}, vocab, hot)


def test_the_packed_layout_and_the_id_checks_refuse_what_they_cannot_read():
    """A layout whose field lies outside its record, records of another
    size, and cold arrays shorter than the rows are refused, not read."""
    from simple_sampler import _sampling
    from simple_sampler.sampling import ROW_SCALARS
    from simple_sampler.triton import sampler_packed

    layout = sampler_packed.PACKED_LAYOUT
    with pytest.raises(ValueError, match=rf"records must be \[B, {ROW_SCALARS_RECORD.itemsize}\]"):
        _sampling.packed_row_scalars(layout, np.zeros((2, 60), np.uint8), V,
                                     np.empty(2, ROW_SCALARS))
    cold = np.array([[60, int(_sampling.FieldType.FIELD_FLOAT32)]] * 5, np.int64)
    with pytest.raises(ValueError, match="outside its record"):
        _sampling.PackedLayout(checked=np.zeros((0, 2), np.int64), bounds=np.zeros((0, 4)),
                               copies=np.zeros((0, 4), np.int64),
                               special=np.zeros((5, 2), np.int64), cold=cold, greedy_below=1e-5,
                               record_size=64, cold_size=20)
    hot_bits = np.zeros(1, np.uint64)
    with pytest.raises(ValueError, match="cold_argmax, cold_max and cold_mass must have 2 "):
        _sampling.check_compact_ids(np.zeros(3, np.int64), np.zeros(0, np.int32), hot_bits, V,
                                    np.zeros(1, np.int64), np.zeros(0, np.int64),
                                    np.zeros(0, np.float32), np.zeros(2, np.float32),
                                    np.zeros(2, np.float32))


def test_a_rows_token_does_not_depend_on_what_the_other_rows_ask():
    """Seeded rows on a sampler with a hot set (SHVS tried for full rows) and
    as compact rows: one row asking for its logprob or top logprobs changes
    no other row's token (it once turned SHVS off, or reordered the compact
    candidates, for the whole request)."""
    import torch

    from simple_sampler.params import SamplingBatch
    from simple_sampler.serving.hot_first import compact_rows
    from simple_sampler.shvs import HotVocab
    from simple_sampler.triton import sampler_codec as codec
    from simple_sampler.triton.sampler_serve import serve_request

    rng = np.random.default_rng(4)
    vocab, rows = 300, 400
    hot = HotVocab(np.sort(rng.choice(vocab, 40, replace=False)), vocab)
    row = rng.normal(0, 2, vocab).astype(np.float32)
    row[hot.ids] += 3
    logits = np.broadcast_to(row, (rows, vocab)).copy()
    batch = SamplingBatch.from_params([SamplingParams(seed=int(s))
                                       for s in rng.integers(0, 2**63, rows)])
    full = {"logits": logits, **codec.batch_arrays(batch)}
    compact = {**codec.compact_arrays(compact_rows(torch.from_numpy(logits), batch, hot)),
               **codec.batch_arrays(batch)}
    first_row = (np.arange(rows) == 0)[:, None]
    for inputs in (full, compact):
        alone = serve_request(inputs, vocab, hot).outputs["output_ids"][1:, 0]
        assert len(set(alone.tolist())) > 20  # seeded draws, not one token
        for asked in ({"return_log_probs": first_row}, {"num_top_logprobs":
                                                         (3 * first_row).astype(np.int32)}):
            tokens = serve_request({**inputs, **asked}, vocab, hot).outputs["output_ids"]
            assert np.array_equal(tokens[1:, 0], alone)


@pytest.mark.parametrize("vocab, wanted", [(1, 3), (4, 10)])
def test_top_logprobs_beyond_the_vocabulary_are_padding(vocab, wanted):
    logits = np.zeros((2, vocab), np.float32)
    out, _ = sample_request(decode_request({
        "logits": logits, "num_top_logprobs": column([wanted, 1], np.int32)}))
    ids, logprobs = out["top_logprobs_ids"], out["top_logprobs"]
    assert ids.shape == logprobs.shape == (2, wanted)
    assert sorted(ids[0, :vocab].tolist()) == list(range(vocab))
    assert np.allclose(logprobs[0, :vocab], -np.log(vocab))
    assert (ids[0, vocab:] == -1).all() and (logprobs[0, vocab:] == -np.inf).all()
    assert (ids[1, 1:] == -1).all() and (logprobs[1, 1:] == -np.inf).all()


def test_greedy_or_not_alike_in_the_python_api_and_through_the_sampler_model():
    """One greedy rule (``params.is_greedy``: below 1e-5 as FP32): a row
    at T = 1e-5 samples in the Python API (a float64 1e-5) and through the
    sampler model's FP32 tensors alike, as vLLM's does; the next FP32 below
    is greedy in both. The row ties at its top, so sampling shows as two tokens."""
    from simple_sampler.params import SamplingBatch, is_greedy
    from simple_sampler.sampling import sample
    from simple_sampler.triton.sampler_codec import batch_arrays

    vocab, rows = 64, 400
    row = np.linspace(-3, 0, vocab).astype(np.float32)
    row[7] = row[-1]
    logits = np.broadcast_to(row, (rows, vocab))
    below = float(np.nextafter(np.float32(1e-5), np.float32(0)))
    for temperature, distinct in ((1e-5, 2), (below, 1)):
        assert bool(is_greedy(temperature)) is (distinct == 1)
        batch = SamplingBatch.from_params([SamplingParams(temperature=temperature, seed=seed)
                                           for seed in range(rows)])
        in_process = sample(logits, batch, return_logprobs=False).token_ids
        served, _ = sample_request(decode_request(
            {"logits": logits, **batch_arrays(batch, packed=True)}, vocab))
        np.testing.assert_array_equal(served["output_ids"][:, 0], in_process)
        assert len(set(in_process.tolist())) == distinct


def test_a_request_for_another_hot_set_is_refused():
    """``hot_vocab_fingerprint``, sent by a decode loop to sampler servers
    other than its own, is refused unless it names this sampler's hot set
    (0: none), naming both; without it nothing is checked. A fingerprint
    names the ids and the vocabulary."""
    from simple_sampler.shvs.hot_vocab import HotVocab, fingerprint
    from simple_sampler.triton.sampler_serve import serve_request

    vocab = 64
    hot = HotVocab(np.arange(0, vocab, 4), vocab)
    assert fingerprint(None) == 0 and fingerprint(hot) > 0
    assert fingerprint(hot) == fingerprint(HotVocab(np.arange(0, vocab, 4)[::-1], vocab))
    assert len({fingerprint(hot), fingerprint(HotVocab(np.arange(1, vocab, 4), vocab)),
                fingerprint(HotVocab(np.arange(0, vocab, 4), vocab + 1))}) == 3
    inputs = {"logits": np.zeros((2, vocab), np.float32), "random_seed": column([1, 2], np.uint64)}
    for own, sent in ((hot, fingerprint(hot)), (None, 0), (hot, None)):
        given = {} if sent is None else {"hot_vocab_fingerprint": column([sent] * 2, np.int64)}
        assert serve_request({**inputs, **given}, vocab, own).rows == 2
    for own, sent, message in ((hot, 0, "hold no hot set, this one hot set 0x"),
                               (None, fingerprint(hot), "this one no hot set"),
                               (hot, fingerprint(hot) + 1, "this one hot set 0x")):
        with pytest.raises(InvalidRequest, match=f"hot_vocab_fingerprint: .*{message}"):
            serve_request({**inputs, "hot_vocab_fingerprint": column([sent] * 2, np.int64)},
                          vocab, own)


def test_a_remote_sampler_names_the_hot_set_it_expects():
    """RemoteSampler sends ``hot_vocab_fingerprint`` with every request when
    its pool checks one (one per row, full or compact rows), nothing else."""
    from simple_sampler.triton.sampler_targets import RemoteSampler

    sent = []

    class Client:
        def sample(self, logits, timeout_s=None, **arrays):
            sent.append(arrays)
            return {"output_ids": np.zeros((3, 1), np.int32)}

    for hot_set, inputs in ((7, {"logits": np.zeros((3, 8), np.float32)}),
                            (0, {"hot_logits": np.zeros((3, 2), np.float32),
                                 "row_scalars": np.zeros((3, 4), np.uint8)}),
                            (None, {"logits": np.zeros((3, 8), np.float32)})):
        remote = RemoteSampler("127.0.0.1:1", hot_set=hot_set)
        remote._client = Client
        remote({**inputs})
        if hot_set is None:
            assert "hot_vocab_fingerprint" not in sent[-1]
        else:
            np.testing.assert_array_equal(sent[-1]["hot_vocab_fingerprint"],
                                          np.full((3, 1), hot_set, np.int64))
