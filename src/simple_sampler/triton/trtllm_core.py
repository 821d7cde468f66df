"""TensorRT-LLM's tensorrt_llm model's outputs, for a request in its dialect.

That model (its core model: tensorrtllm_backend,
all_models/inflight_batcher_llm/tensorrt_llm) takes token ids and gives token
ids; its clients (``inflight_batcher_llm_client.py``,
``tools/inflight_batcher_llm/benchmark_core_model.py``) tokenize and
detokenize themselves. The llm model takes its input names as aliases
(``schema.CORE_ALIASES``); a request that sends request_output_len is
answered as that model answers (its ``convert_response``), in the llm
model's outputs of that shape (``schema.CORE_OUTPUTS``), which the
tensorrt_llm ensemble here (model_repository/tensorrt_llm) gives under that
model's names.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from ..serving.generation import FINISH_STOP, GenerationEvent


def core_outputs(event: GenerationEvent, prompt_ids: Sequence[int] | None,
                 logprobs: bool) -> dict[str, np.ndarray]:
    """One response's outputs, per request row (the llm model adds the batch
    dimension): beam_output_ids [beams = 1, tokens], the prompt's ids first
    when ``prompt_ids`` are given (a non-streamed answer without
    exclude_input_in_output: that model's executor gives the input then),
    sequence_length [1] their count; with ``logprobs`` (the request's
    return_log_probs: that model gives them only then)
    beam_output_log_probs [1, tokens] of the generated tokens and
    beam_cum_log_probs [1], their running sum. The end id that ended a
    request is no output there ("seq len should always contain only tokens
    to be outputted", its sampling kernels): it is left out of the tokens and
    their logprobs (the sum keeps its logprob)."""
    token_ids, token_logprobs = list(event.token_ids), list(event.logprobs)
    if event.finish_reason == FINISH_STOP and event.stop_reason is None and token_ids:
        # ended by an end id (the stop reason of a stop string or stop id is
        # not None: GenerationEvent.stop_reason), the last token
        del token_ids[-1], token_logprobs[-1:]
    ids = np.asarray(token_ids, np.int32)
    if prompt_ids is not None:
        ids = np.concatenate([np.asarray(prompt_ids, np.int32), ids])
    outputs = {"beam_output_ids": ids[None], "sequence_length": np.array([ids.size], np.int32)}
    if logprobs:
        outputs["beam_output_log_probs"] = np.array(
            [token_logprobs or [0.0] * len(token_ids)], np.float32)
        outputs["beam_cum_log_probs"] = np.array(
            [0.0 if math.isnan(event.cum_log_prob) else event.cum_log_prob], np.float32)
    return outputs
