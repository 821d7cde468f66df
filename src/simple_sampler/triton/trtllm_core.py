"""TensorRT-LLM's core model's interface over the llm model.

TensorRT-LLM's ``tensorrt_llm`` model (tensorrtllm_backend,
all_models/inflight_batcher_llm/tensorrt_llm) takes token ids and gives token
ids: its clients (``inflight_batcher_llm_client.py``,
``tools/inflight_batcher_llm/benchmark_core_model.py``, perf_analyzer with
ids) tokenize and detokenize themselves. The ``tensorrt_llm`` model here
(model_repository/tensorrt_llm) takes its names (``schema.TRTLLM_CORE``),
renames them to the llm model's (``llm_inputs``), streams the llm model's
responses through BLS and gives each in that model's shapes
(``core_outputs``): output_ids [1, beams, tokens], sequence_length [1, beams],
cum_log_probs [1, beams], output_log_probs [1, beams, tokens], one beam here.
A non-streamed answer's output_ids start with the prompt's ids unless
exclude_input_in_output, as that model's do (``convert_response``: its
executor's output tokens hold the input unless excluded). A compatibility
path: every response crosses one more stub than through llm directly.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from ..schema import CORE_RENAMED, TRTLLM_CORE, InvalidRequest
from .prompt_batch import split_prompts

#: The llm model's outputs the core model's are made from.
LLM_OUTPUTS = ("output_ids", "output_log_probs", "cum_log_probs", "batch_index",
               "sequence_index")


def llm_inputs(inputs: Mapping[str, object]) -> dict[str, np.ndarray]:
    """The core model's inputs (name -> array, None: absent) as the llm
    model's. Raises InvalidRequest for request_output_len absent (required
    there: "A value is required for request_output_len")."""
    present = {name: np.asarray(value) for name, value in inputs.items() if value is not None}
    if "request_output_len" not in present:
        raise InvalidRequest("request_output_len is required (the most tokens to generate)")
    if "runtime_top_p" in present:
        _top_p_zero_is_off(present)
    return {CORE_RENAMED.get(name, name): value for name, value in present.items()}


def _top_p_zero_is_off(present: dict[str, np.ndarray]) -> None:
    """runtime_top_p 0 is no top-p there, and with runtime_top_k 0 (or none)
    greedy, top_k 1 (TensorRT-LLM's sampling layers: "topk=0 and topp=0.0
    ... is equivalent to greedy search"); its client sends top_p 0 and top_k
    1 unless told. In place."""
    top_p = present["runtime_top_p"].astype(np.float32)
    off = top_p == 0
    if off.any():
        top_k = present.get("runtime_top_k", np.zeros(top_p.shape, np.int32)).astype(np.int32)
        present["runtime_top_k"] = np.where(off & (top_k == 0), 1, top_k).astype(np.int32)
        present["runtime_top_p"] = np.where(off, 1.0, top_p).astype(np.float32)


def prompts_of(inputs: Mapping[str, object]) -> list[list[int]]:
    """Each prompt's ids (input_ids' rows cut to input_lengths), by batch_index."""
    ids = {name: inputs[name] for name in ("input_ids", "input_lengths")
           if inputs.get(name) is not None}
    return [np.asarray(prompt["input_ids"]).reshape(-1).tolist()
            for prompt in split_prompts(ids)]


def core_outputs(outputs: Mapping[str, np.ndarray], prompts: list[list[int]], whole: bool,
                 log_probs: bool) -> dict[str, np.ndarray]:
    """One llm response's outputs (``LLM_OUTPUTS`` as it gives them, [1, ...])
    in the core model's shapes. whole: a non-streamed answer that keeps the
    prompt (its ids first); log_probs: the request's return_log_probs (the
    logprob outputs only then, as that model gives them)."""
    index = np.asarray(outputs["batch_index"]).reshape(-1) if "batch_index" in outputs else None
    generated = np.asarray(outputs["output_ids"], np.int32).reshape(-1)
    ids = np.concatenate([np.asarray(prompts[int(index[0]) if index is not None else 0],
                                     np.int32), generated]) if whole else generated
    made = {"output_ids": ids.reshape(1, 1, -1),
            "sequence_length": np.array([[ids.size]], np.int32)}
    if log_probs and "output_log_probs" in outputs:
        made["output_log_probs"] = np.asarray(outputs["output_log_probs"],
                                              np.float32).reshape(1, 1, -1)
        made["cum_log_probs"] = np.asarray(outputs["cum_log_probs"], np.float32).reshape(1, 1)
    for name in ("batch_index", "sequence_index"):
        if name in outputs:
            made[name] = np.asarray(outputs[name], np.int32).reshape(1, 1)
    return made


#: The core model's input names, in its schema's order.
INPUT_NAMES = TRTLLM_CORE.input_names
