"""TensorRT-LLM's tensorrt_llm model's answer (triton.trtllm_core), without
a server: its shapes, the prompt first when asked, the logprobs only when
asked, and no end token, as that model's executor gives them."""
import numpy as np
import pytest

from simple_sampler.serving.generation import GenerationEvent
from simple_sampler.triton.trtllm_core import core_outputs


def event(ids, finish=None, stop_reason=None):
    return GenerationEvent(0, "", list(ids), [-0.5] * len(ids), 3, len(ids),
                           -0.5 * len(ids), finish, stop_reason=stop_reason)


def test_a_response_is_its_tokens_in_beams_with_the_prompt_first_when_given():
    outputs = core_outputs(event([7, 8]), None, logprobs=False)
    assert set(outputs) == {"beam_output_ids", "sequence_length"}
    assert outputs["beam_output_ids"].tolist() == [[7, 8]]
    assert outputs["beam_output_ids"].dtype == np.int32
    assert outputs["sequence_length"].tolist() == [2]
    whole = core_outputs(event([7, 8], "length"), [1, 2, 3], logprobs=True)
    assert whole["beam_output_ids"].tolist() == [[1, 2, 3, 7, 8]]
    assert whole["sequence_length"].tolist() == [5]
    assert whole["beam_output_log_probs"].tolist() == [[-0.5, -0.5]]  # the generated tokens'
    assert whole["beam_cum_log_probs"].tolist() == [-1.0]


@pytest.mark.parametrize("finish, stop_reason, kept", [
    ("stop", None, [7]),  # an end id: not an output there
    ("stop", "END", [7, 8]), ("stop", 8, [7, 8]),  # a stop string's or stop id's token stays
    ("length", None, [7, 8]), ("cancelled", None, [7, 8]), (None, None, [7, 8])])
def test_the_end_id_that_ended_a_request_is_left_out(finish, stop_reason, kept):
    outputs = core_outputs(event([7, 8], finish, stop_reason), [1], logprobs=True)
    assert outputs["beam_output_ids"].tolist() == [[1, *kept]]
    assert outputs["sequence_length"].tolist() == [1 + len(kept)]
    assert outputs["beam_output_log_probs"].tolist() == [[-0.5] * len(kept)]
    alone = core_outputs(event([8], finish, stop_reason), None, logprobs=False)
    assert alone["beam_output_ids"].shape == (1, len(kept) - 1)  # a stream's last: maybe empty
