"""vLLM's sampling parameters (Triton's vLLM backend's request) decoded as
the generate inputs that carry them: the same GenerationRequest as those
inputs give, every refusal naming its field (no server)."""
import dataclasses
import json

import numpy as np
import pytest

from simple_sampler.schema import InvalidRequest
from simple_sampler.triton.generate_io import decode_generate
from simple_sampler.triton.vllm_params import as_sent

PROMPT = {"input_ids": np.array([[1, 2]], np.int32)}


def as_json(**parameters):
    return np.array([[json.dumps(parameters).encode()]], dtype=object)


def scalar(value, dtype):
    return np.array([[value]], dtype)


def test_every_vllm_name_gives_the_request_its_input_gives():
    """Each name of the table in docs/TENSORS.md, in the JSON input, decodes
    as the input that carries it: the same request, field for field, but
    that vLLM's stop strings are matched in the text, the stop_words
    input's as their tokens (TensorRT-LLM's), and that vLLM's bad words
    are also banned after a space."""
    by_vllm = decode_generate({**PROMPT, "sampling_parameters": as_json(
        max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, presence_penalty=0.5,
        frequency_penalty=-0.5, repetition_penalty=1.2, seed=11, stop_token_ids=[5, 6],
        ignore_eos=True, include_stop_str_in_output=True, skip_special_tokens=False,
        bad_words=["x y"], prompt_logprobs=2, min_tokens=3, stop=["\n", "END"], logprobs=4,
        logit_bias={"9": -1.5, "10": 2}, n=1, best_of=None, detokenize=True,
        exclude_input_in_output=True, stream=True)})
    by_inputs = decode_generate({
        **PROMPT, "max_tokens": scalar(7, np.int32), "temperature": scalar(0.5, np.float32),
        "top_p": scalar(0.9, np.float32), "top_k": scalar(40, np.int32),
        "min_p": scalar(0.05, np.float32), "presence_penalty": scalar(0.5, np.float32),
        "frequency_penalty": scalar(-0.5, np.float32),
        "repetition_penalty": scalar(1.2, np.float32), "seed": scalar(11, np.uint64),
        "stop_token_ids": np.array([[5, 6]], np.int32), "ignore_eos": scalar(True, bool),
        "include_stop_str_in_output": scalar(True, bool),
        "skip_special_tokens": scalar(False, bool),
        "bad_words": np.array([[b"x y"]], dtype=object), "prompt_logprobs": scalar(2, np.int32),
        "min_length": scalar(3, np.int32), "stop_words": np.array([[b"\n", b"END"]], object),
        "return_log_probs": scalar(True, bool), "num_top_logprobs": scalar(4, np.int32),
        "logit_bias_ids": np.array([[9, 10]], np.int32),
        "logit_bias_values": np.array([[-1.5, 2.0]], np.float32),
        "exclude_input_in_output": scalar(True, bool), "stream": scalar(True, bool)})
    assert not by_vllm.request.stop_words_as_tokens and by_inputs.request.stop_words_as_tokens
    assert by_vllm.request.bad_words_spaced and not by_inputs.request.bad_words_spaced
    assert dataclasses.replace(by_vllm, sent_as={}, request=dataclasses.replace(
        by_vllm.request, stop_words_as_tokens=True, bad_words_spaced=False)) == by_inputs
    request = by_vllm.request
    assert request.sampling.min_tokens == 3 and request.stop_words == ["\n", "END"]
    assert request.return_log_probs and request.num_top_logprobs == 4
    assert request.sampling.logit_bias == {9: -1.5, 10: 2.0} and not request.skip_special
    assert by_vllm.stream and by_vllm.exclude_input_in_output


def test_request_parameters_carry_the_names_no_input_has():
    """Over HTTP generate a key that names no input (``min_tokens``, ``stop``,
    ``logprobs``) arrives as a request parameter: taken as vLLM's."""
    decoded = decode_generate(PROMPT, json.dumps({"min_tokens": 2, "stop": "END", "logprobs": 0,
                                                  "triton_x": 1, "x-request-id": "a"}))
    request = decoded.request
    assert request.sampling.min_tokens == 2 and request.stop_words == ["END"]
    assert request.return_log_probs and request.num_top_logprobs == 0
    assert decode_generate(PROMPT, {"logprobs": None}).request.return_log_probs is False


def test_seed_minus_one_is_none_and_another_negative_seed_is_read_modulo_2_64_as_vllms():
    decoded = decode_generate({**PROMPT, "sampling_parameters": as_json(seed=-2)})
    assert decoded.request.sampling.seed == 2**64 - 2
    for sent in (-1, "-1"):
        decoded = decode_generate({**PROMPT, "sampling_parameters": as_json(seed=sent)})
        assert decoded.request.sampling.seed is None


@pytest.mark.parametrize("inputs, parameters, message", [
    ({"temperature": scalar(0.5, np.float32)}, {"temperature": 0.7},
     "temperature is given twice, with different values: as an input and by the vLLM sampling "
     "parameter sampling_parameters.temperature"),
    ({"min_length": scalar(1, np.int32)}, {"min_tokens": 2}, "min_length is given twice"),
    ({"max_tokens": scalar(4, np.int32)}, {"min_tokens": 5},
     r"sampling_parameters.min_tokens \(5\) must be at most max_tokens \(4\)"),
    ({}, {"min_tokens": 17}, r"min_tokens \(17\) must be at most max_tokens \(16\)"),
    ({}, {"logprobs": 1, "return_log_probs": True},
     "sampling_parameters.return_log_probs is an input of this model, not a vLLM sampling "
     "parameter: send it as an input"),
    ({}, {"temprature": 0.5}, "unknown field sampling_parameters.temprature: it names no input"),
    ({}, {"logits_processors": ["x"]},
     "sampling_parameters.logits_processors is not supported by this server"),
    ({}, {"n": 2}, r"sampling_parameters.n must be 1: this server implements no other \(got 2\)"),
    ({}, {"detokenize": False}, "sampling_parameters.detokenize must be true"),
    ({}, {"temperature": "warm"}, 'sampling_parameters.temperature must be a number, got "warm"'),
    ({}, {"max_tokens": 8.5}, "sampling_parameters.max_tokens must be an integer, got 8.5"),
    ({}, {"max_tokens": "8.5"}, "sampling_parameters.max_tokens must be an integer, got 8.5"),
    ({}, {"ignore_eos": 1}, "sampling_parameters.ignore_eos must be a boolean, got 1"),
    ({}, {"ignore_eos": "yes"}, 'sampling_parameters.ignore_eos must be a boolean, got "yes"'),
    ({}, {"stop": [1]}, r"sampling_parameters.stop\[0\] must be a string, got 1"),
    ({}, {"top_k": 2**40}, r"sampling_parameters.top_k must be in \[-2147483648, 2147483647\]"),
    ({}, {"logprobs": -1}, "sampling_parameters.logprobs must be >= 0"),
    ({}, {"logit_bias": {"a": 1}}, "sampling_parameters.logit_bias's keys must be token ids"),
    ({}, {"temperature": -1.0}, "^temperature must be a finite"),  # the input's range
    ({}, {"stop": ""}, r"sampling_parameters.stop\[0\] must be a non-empty string"),
    ({}, {"bad_words": ["x", ""]}, r"sampling_parameters.bad_words\[1\] must be a non-empty"),
    ({}, {"max_tokens": None}, "sampling_parameters.max_tokens must be an integer: null is"),
    ({}, {"seed": -2**63 - 1}, r"sampling_parameters.seed must be in \[-9223372036854775808, "
                               r"18446744073709551615\] \(-1: none\), got -9223372036854775809$"),
    ({}, {"seed": "99999999999999999999999"}, r"sampling_parameters.seed must be in "
                                               r"\[-9223372036854775808, 18446744073709551615\]"),
    ({}, {"seed": 1.5}, r"sampling_parameters.seed must be an integer, got 1.5"),
    ({}, {"n": "2"}, "sampling_parameters.n must be 1"),
    # the vLLM backend's input, not a sampling parameter there either
    ({}, {"return_logprobs": True}, "sampling_parameters.return_logprobs is an input of this "
                                    "model, not a vLLM sampling parameter"),
    ({}, {"truncate": True}, r"unknown field sampling_parameters.truncate: .*"
                             r"\(docs/TENSORS.md lists them\), so"),
])
def test_refusals_name_the_field(inputs, parameters, message):
    with pytest.raises(InvalidRequest, match=message):
        decoded = decode_generate({**PROMPT, **inputs, "sampling_parameters": as_json(**parameters)})
        decoded.request.validate(vocab_size=64)


@pytest.mark.parametrize("sampling_parameters, message", [
    (np.array([[b"[1, 2]"]], dtype=object), "must be a JSON object .* got list"),
    (np.array([[b"{temperature: 1}"]], dtype=object), "must be a JSON object"),
    (np.array([[b"{}", b"{}"]], dtype=object), "one JSON object per request, got 2"),
])
def test_the_json_input_must_be_one_object(sampling_parameters, message):
    with pytest.raises(InvalidRequest, match=message):
        decode_generate({**PROMPT, "sampling_parameters": sampling_parameters})


def test_the_vllm_sample_clients_request_is_taken_as_its_backend_takes_it():
    """vllm_backend's samples/client.py sends its parameters as strings, both
    in the JSON input and as request parameters: the numbers they spell
    (as that backend casts them), the same value twice being one."""
    sent = {"temperature": "0.1", "top_p": "0.95", "max_tokens": "100", "ignore_eos": "false"}
    decoded = decode_generate({**PROMPT, "sampling_parameters": as_json(**sent)}, sent)
    sampling = decoded.request.sampling
    assert (sampling.temperature, sampling.top_p) == (pytest.approx(0.1), pytest.approx(0.95))
    assert decoded.request.max_tokens == 100 and not decoded.request.ignore_end
    assert decode_generate(PROMPT, {"max_tokens": 8.0}).request.max_tokens == 8
    spelled = decode_generate({**PROMPT, "sampling_parameters": as_json(
        seed="-3", n="1", detokenize="true", stream_interval="4")})
    assert spelled.request.sampling.seed == 2**64 - 3 and spelled.stream_interval == 4


def test_an_input_sent_as_a_vllm_parameter_too_with_the_same_value_is_one():
    """genai-perf's --backend vllm with --extra-inputs max_tokens:16 sends
    max_tokens as an input and in sampling_parameters ("16")."""
    decoded = decode_generate({**PROMPT, "max_tokens": scalar(16, np.int32),
                               "sampling_parameters": as_json(max_tokens="16")})
    assert decoded.request.max_tokens == 16


@pytest.mark.parametrize("streaming", [False, True])
def test_tensorrt_llms_clients_streaming_parameter_is_read_as_the_input_it_mirrors(streaming):
    """inflight_batcher_llm_client.py sends parameters={'Streaming': its
    --streaming} with its streaming input, which TensorRT-LLM's backend
    reads; so does this server, and a Streaming that disagrees is refused."""
    request = {**PROMPT, "request_output_len": scalar(4, np.int32)}
    for inputs in (request, {**request, "streaming": scalar(streaming, bool)}):
        assert decode_generate(inputs, {"Streaming": streaming}).stream is streaming
    with pytest.raises(InvalidRequest, match="streaming and Streaming are the same parameter; "
                                             "they disagree"):
        decode_generate({**request, "streaming": scalar(streaming, bool)},
                        {"Streaming": not streaming})


def test_a_name_sent_twice_with_two_values_is_refused():
    with pytest.raises(InvalidRequest, match="min_tokens and sampling_parameters.min_tokens both "
                                             "set min_length, to different values"):
        decode_generate({**PROMPT, "sampling_parameters": as_json(min_tokens=1)}, {"min_tokens": 2})


@pytest.mark.parametrize("inputs, parameters, message", [
    ({}, {"min_tokens": -1}, r"^min_tokens \(min_length here\) must be >= 0"),
    ({"sampling_parameters": as_json(logprobs=50)}, None,
     r"sampling_parameters.logprobs \(num_top_logprobs here\) must be an integer in \[0, 20\]"),
    ({"sampling_parameters": as_json(temperature=-1.0)}, None,
     "^sampling_parameters.temperature must be a finite value >= 0"),
    ({"temperature": scalar(-1.0, np.float32)}, None, "^temperature must be"),  # an input's own
])
def test_a_ranges_refusal_names_the_field_as_the_client_sent_it(inputs, parameters, message):
    decoded = decode_generate({**PROMPT, **inputs}, parameters)
    with pytest.raises(InvalidRequest) as refused:
        decoded.request.validate(vocab_size=64)
    with pytest.raises(InvalidRequest, match=message):
        raise as_sent(refused.value, decoded.sent_as)
