"""The generate codec's logit_bias inputs and its outputs when logprobs are
not asked (no server)."""
import numpy as np
import pytest

from simple_sampler.schema import InvalidRequest
from simple_sampler.serving.decoder import GenerationEvent
from simple_sampler.triton.generate_io import decode_generate, encode_event


def test_logit_bias_inputs_become_the_sampling_params_bias():
    decoded = decode_generate({"text_input": np.array([[b"hi"]], object),
                               "logit_bias_ids": np.array([[5, 9]], np.int32),
                               "logit_bias_values": np.array([[-np.inf, 1.5]], np.float32)})
    assert decoded.request.sampling.logit_bias == {5: -np.inf, 9: 1.5}
    assert decode_generate({"text_input": np.array([[b"hi"]], object)}).request.sampling \
        .logit_bias == {}


@pytest.mark.parametrize("inputs, message", [
    ({"logit_bias_ids": np.array([[5]], np.int32)}, "given together"),
    ({"logit_bias_ids": np.array([[5, 6]], np.int32),
      "logit_bias_values": np.array([[1.0]], np.float32)}, "one value per logit_bias_ids"),
    ({"logit_bias_ids": np.array([[5, 5]], np.int32),
      "logit_bias_values": np.array([[1.0, 2.0]], np.float32)}, "at most once"),
])
def test_bad_logit_bias_inputs_are_refused_by_name(inputs, message):
    with pytest.raises(InvalidRequest, match=message):
        decode_generate({"text_input": np.array([[b"hi"]], object), **inputs})


def test_output_log_probs_are_zero_per_token_when_not_asked():
    """Never an empty tensor: perf_analyzer 2.50's JSON export wrote garbage
    for one; cum_log_probs is 0 alike."""
    outputs = encode_event(GenerationEvent(0, " Paris", [3, 4], [], 5, 2, float("nan")))
    assert outputs["output_log_probs"].tolist() == [0.0, 0.0]
    assert outputs["cum_log_probs"].tolist() == [0.0]
    asked = encode_event(GenerationEvent(0, " Paris", [3], [-0.5], 5, 1, -0.5))
    assert asked["output_log_probs"].tolist() == [-0.5]
