"""TensorRT-LLM's core model's names and shapes over the llm model
(triton.trtllm_core): the renaming of its inputs, and each llm response in
its shapes."""
import numpy as np
import pytest

from simple_sampler.schema import InvalidRequest
from simple_sampler.triton.trtllm_core import core_outputs, llm_inputs, prompts_of


def test_its_inputs_are_the_llm_models_by_their_names_there():
    inputs = {"input_ids": np.array([[5, 6, 7]], np.int32),
              "request_output_len": np.array([[8]], np.int32),
              "streaming": np.array([[True]]), "runtime_top_k": np.array([[3]], np.int32),
              "runtime_top_p": np.array([[0.9]], np.float32),
              "len_penalty": np.array([[1.0]], np.float32),
              "random_seed": np.array([[4]], np.uint64), "pad_id": None}
    renamed = llm_inputs(inputs)
    assert sorted(renamed) == ["input_ids", "length_penalty", "max_tokens", "random_seed",
                               "stream", "top_k", "top_p"]
    assert renamed["max_tokens"].tolist() == [[8]] and renamed["top_p"].dtype == np.float32
    with pytest.raises(InvalidRequest, match="request_output_len is required"):
        llm_inputs({"input_ids": inputs["input_ids"]})


def test_a_top_p_of_0_is_no_top_p_and_with_a_top_k_of_0_greedy():
    """TensorRT-LLM's reading, which its client's defaults (top_k 1, top_p 0) rely on."""
    renamed = llm_inputs({"request_output_len": np.array([[4], [4], [4]], np.int32),
                          "runtime_top_p": np.array([[0.0], [0.0], [0.5]], np.float32),
                          "runtime_top_k": np.array([[0], [7], [0]], np.int32)})
    assert renamed["top_p"].tolist() == [[1.0], [1.0], [0.5]]
    assert renamed["top_k"].tolist() == [[1], [7], [0]] and renamed["top_k"].dtype == np.int32
    alone = llm_inputs({"request_output_len": np.array([[4]], np.int32),
                        "runtime_top_p": np.array([[0.0]], np.float32)})
    assert alone["top_k"].tolist() == [[1]] and alone["top_p"].tolist() == [[1.0]]


def test_each_prompt_is_its_row_cut_to_its_length():
    assert prompts_of({"input_ids": np.array([[5, 6, 7], [8, 2, 2]], np.int32),
                       "input_lengths": np.array([[3], [1]], np.int32)}) == [[5, 6, 7], [8]]
    assert prompts_of({"input_ids": np.array([[5, 6]], np.int32)}) == [[5, 6]]


def test_a_response_comes_in_its_shapes_with_the_prompt_first_when_whole():
    prompts = [[5, 6, 7], [8]]
    answer = {"output_ids": np.array([[9, 10]], np.int32),
              "output_log_probs": np.array([[-0.5, -0.25]], np.float32),
              "cum_log_probs": np.array([[-0.75]], np.float32),
              "batch_index": np.array([[1]], np.int32)}
    whole = core_outputs(answer, prompts, whole=True, log_probs=True)
    assert whole["output_ids"].tolist() == [[[8, 9, 10]]]
    assert whole["sequence_length"].tolist() == [[3]] and whole["batch_index"].tolist() == [[1]]
    assert whole["output_log_probs"].tolist() == [[[-0.5, -0.25]]]
    assert whole["cum_log_probs"].tolist() == [[-0.75]]
    streamed = core_outputs({"output_ids": np.array([[9]], np.int32)}, prompts[:1],
                            whole=False, log_probs=False)
    assert streamed == {"output_ids": streamed["output_ids"],
                        "sequence_length": streamed["sequence_length"]}
    assert streamed["output_ids"].tolist() == [[[9]]] and streamed["sequence_length"].tolist() == [[1]]
    unasked = core_outputs(answer, prompts, whole=False, log_probs=False)
    assert "output_log_probs" not in unasked and "cum_log_probs" not in unasked
