"""The generation models' responses as tensors: one response's outputs
from the decode loop's events (``encode_event``), and the events held for
one response merged (``merge_events``). Their names, dtypes and dims are
``schema.LLM``'s (docs/TENSORS.md).

Outputs: text_output; output_ids and output_log_probs (this response's
tokens; their logprobs when asked, else 0.0 each, [beams, tokens] with one
beam); cum_log_probs (0 unless asked); top_logprobs_ids and top_logprobs
([tokens, n], only when num_top_logprobs n > 0); the prompt's scores
(``PROMPT_OUTPUTS``, only in the response that carries them: a stream's
first, a non-streamed answer, when prompt_logprobs is given);
num_input_tokens, num_output_tokens; finish_reason ("stop", "length" or
"cancelled"); stop_reason (vLLM's, JSON). A stream's responses before its
last carry only text_output and output_ids (and the logprob outputs when
asked), every ``stream_interval`` tokens. The vLLM backend's additional
outputs (finish_reason, num_input_tokens, num_output_tokens,
cumulative_logprob) come in every response of a request that asked for them
(its return_* inputs, ``vllm_extra_outputs``).
"""
from __future__ import annotations

import json

import numpy as np

from ..schema import PROMPT_OUTPUTS, TOP_OUTPUTS
from ..serving.generation import GenerationEvent


def encode_event(event: GenerationEvent, prefix: str = "", full: bool = True,
                 logprobs: bool = True, top: int = 0, extra: frozenset[str] = frozenset()
                 ) -> dict[str, np.ndarray]:
    """The output tensors of one response (see the module table). A stream's
    responses before its last (``full`` False) carry only text_output and
    output_ids, plus output_log_probs and cum_log_probs when the request
    asked for logprobs (``logprobs``): every output is one more tensor for
    this process, Triton, the ensemble and gRPC to build and copy per token.
    The last response (and a non-streamed answer) carries all eight. With
    ``top`` (the request's num_top_logprobs n), every response also carries
    top_logprobs_ids and top_logprobs [tokens, n] (padded -1 and LOGPROB_FLOOR where
    the vocabulary holds fewer than n). ``extra``: the vLLM backend's
    additional outputs the request asked for (``DecodedRequest.extra_outputs``),
    in this response whatever it is (``vllm_extra_outputs``)."""
    outputs = {"text_output": np.array([(prefix + event.text).encode("utf-8")], dtype=object),
               "output_ids": np.array(event.token_ids, dtype=np.int32)}
    if full or logprobs:
        # 0.0 per token when not asked, as cum_log_probs: an empty tensor
        # here made perf_analyzer 2.50 write garbage into its JSON export.
        outputs["output_log_probs"] = np.array(  # [beams, tokens], one beam
            [event.logprobs or [0.0] * len(event.token_ids)], dtype=np.float32)
        # 0 when not asked, as TensorRT-LLM does (NaN is not valid JSON).
        outputs["cum_log_probs"] = np.array(
            [0.0 if np.isnan(event.cum_log_prob) else event.cum_log_prob], dtype=np.float32)
    if top:
        outputs.update(zip(TOP_OUTPUTS, _top_arrays(event, top)))
    if event.prompt_scores is not None:
        outputs.update(prompt_outputs(event.prompt_scores))
    if full:
        outputs["num_input_tokens"] = np.array([event.num_input_tokens], dtype=np.int32)
        outputs["num_output_tokens"] = np.array([event.num_output_tokens], dtype=np.int32)
        outputs["finish_reason"] = np.array([(event.finish_reason or "").encode()], dtype=object)
        # JSON: vLLM's is a string, a token id or null
        outputs["stop_reason"] = np.array([json.dumps(event.stop_reason).encode()], dtype=object)
    if extra:
        outputs.update(vllm_extra_outputs(event, extra))
    return outputs


def vllm_extra_outputs(event: GenerationEvent, asked: frozenset[str]) -> dict[str, np.ndarray]:
    """The additional outputs of Triton's vLLM backend (``asked``, of
    ``schema.VLLM_EXTRA_OUTPUTS``' values but logprobs) for one response, as
    that backend writes them (vllm_backend, src/utils/request.py,
    ``GenerateRequest.create_response``): finish_reason is "None" until the
    last response (its str() of vLLM's None); num_output_tokens counts this
    response's tokens, not the request's; cumulative_logprob is the sum so
    far. Our dtypes stay INT32 where that backend's are UINT32."""
    values = {
        "finish_reason": lambda: np.array([str(event.finish_reason).encode()], dtype=object),
        "cumulative_logprob": lambda: np.array([event.cum_log_prob], dtype=np.float32),
        "num_input_tokens": lambda: np.array([event.num_input_tokens], dtype=np.int32),
        "num_output_tokens": lambda: np.array([len(event.token_ids)], dtype=np.int32),
    }
    return {name: values[name]() for name in asked}


#: What a logprob of -inf (a banned token among a token's top n, or padding)
#: is written as: Triton's JSON writer has no infinity (vLLM writes the same)
LOGPROB_FLOOR = -9999.0


def _top_arrays(event: GenerationEvent, top: int) -> tuple[np.ndarray, np.ndarray]:
    """An event's top logprobs as [tokens, top] arrays of ids and logprobs,
    a row per token (padding -1 and LOGPROB_FLOOR)."""
    ids = np.full((len(event.token_ids), top), -1, np.int32)
    logprobs = np.full((len(event.token_ids), top), LOGPROB_FLOOR, np.float32)
    for row, pairs in enumerate(event.top_logprobs[:len(event.token_ids)]):
        if pairs:
            ids[row, :len(pairs)], logprobs[row, :len(pairs)] = zip(*pairs)
    logprobs[np.isneginf(logprobs)] = LOGPROB_FLOOR  # a finite value stays as it is
    return ids, logprobs


def prompt_outputs(scores) -> dict[str, np.ndarray]:
    """The outputs of a prompt's scores (``prompt_scores.PromptScores``):
    ids [T], logprobs and ranks [T - 1], and the top ids and logprobs
    [T - 1, n] when n > 0; -inf written LOGPROB_FLOOR, as the top logprobs'."""
    arrays = (scores.prompt_ids, np.maximum(scores.token_logprobs, LOGPROB_FLOOR),
              scores.token_ranks)
    if scores.top_ids.shape[1]:
        arrays += (scores.top_ids, np.maximum(scores.top_logprobs, LOGPROB_FLOOR))
    return dict(zip(PROMPT_OUTPUTS, arrays))


def merge_events(events: list[GenerationEvent]) -> GenerationEvent:
    """One event holding a whole non-streamed generation."""
    last = events[-1]
    return GenerationEvent(
        last.request_id, "".join(e.text for e in events),
        [t for e in events for t in e.token_ids], [p for e in events for p in e.logprobs],
        last.num_input_tokens, last.num_output_tokens, last.cum_log_prob,
        last.finish_reason, last.error,
        top_logprobs=[pairs for e in events for pairs in e.top_logprobs],
        prompt_scores=next((e.prompt_scores for e in events if e.prompt_scores is not None),
                           None), stop_reason=last.stop_reason)
