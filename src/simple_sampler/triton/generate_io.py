"""The user-facing generation tensors (TensorRT-LLM's ensemble names),
decoded into a ``GenerationRequest`` and encoded back from its events.

Every input has batch dimension 1 (one prompt per request, as TensorRT-LLM's
streaming ensemble requires): scalars are [1, 1], word lists [1, N].

======================= ====== ======= =====================================
input                   dtype  dims    default, allowed
======================= ====== ======= =====================================
text_input              BYTES  [1]     required, non-empty UTF-8
max_tokens              INT32  [1]     16; [1, context - 1]
stream                  BOOL   [1]     false: one response at the end
temperature             FP32   [1]     1.0; >= 0, < 1e-5 is greedy
top_k                   INT32  [1]     0 (off); >= -1
top_p                   FP32   [1]     1.0 (off); (0, 1]
min_p                   FP32   [1]     0.0 (off); [0, 1]
repetition_penalty      FP32   [1]     1.0; > 0
presence_penalty        FP32   [1]     0.0; [-2, 2]
frequency_penalty       FP32   [1]     0.0; [-2, 2]
random_seed (or seed)   UINT64 [1]     a fresh random seed
stop_words              BYTES  [-1]    none; generation stops before them
bad_words               BYTES  [-1]    none; never generated
end_id                  INT32  [1]     the tokenizer's end of sequence
min_length              INT32  [1]     0; end id banned until reached
return_log_probs        BOOL   [1]     false
exclude_input_in_output BOOL   [1]     false: a non-streaming answer starts
                                       with the prompt text (TensorRT-LLM's
                                       behaviour); streams never repeat it
apply_chat_template     BOOL   [1]     false: text_input is sent as one user
                                       turn through the model's template
======================= ====== ======= =====================================

Outputs: text_output BYTES [1]; output_log_probs FP32 [N] (this response's
tokens, when asked); cum_log_probs FP32 [1] (0 unless asked); num_input_tokens and
num_output_tokens INT32 [1]; finish_reason BYTES [1] ("" until the last
response, then "stop", "length" or "cancelled"); output_ids INT32 [N], this
response's token ids.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from ..params import SamplingParams
from ..serving.decoder import GenerationEvent, GenerationRequest

#: input -> SamplingParams field, for the plain numeric parameters.
SAMPLING_INPUTS = {
    "temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "min_length": "min_tokens",
}
FLAG_INPUTS = ("stream", "return_log_probs", "exclude_input_in_output", "apply_chat_template")
INPUT_NAMES = ("text_input", "input_ids", "max_tokens", *SAMPLING_INPUTS, "random_seed", "seed",
               "stop_words", "bad_words", "end_id", *FLAG_INPUTS)


@dataclass
class DecodedRequest:
    """A generation request plus how its answer is to be delivered."""

    request: GenerationRequest
    stream: bool
    exclude_input_in_output: bool


def _single(name: str, array) -> object:
    """The one value of a [1, 1] (or [1]) input."""
    values = np.asarray(array).reshape(-1)
    if values.size != 1:
        raise ValueError(f"{name} must hold one value per request (shape [1, 1]), "
                         f"got shape {list(np.shape(array))}")
    value = values[0]
    return value.item() if isinstance(value, np.generic) else value


def _text(name: str, value) -> str:
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"{name} must be UTF-8 text: {error}") from None
    return str(value)


def _words(name: str, array) -> list[str]:
    array = np.asarray(array, dtype=object)
    if array.ndim == 2 and array.shape[0] != 1:
        raise ValueError(f"{name} must be one list of strings per request, got shape "
                         f"{list(array.shape)}")
    words = [_text(name, w) for w in array.reshape(-1)]
    if not all(words):
        raise ValueError(f"{name} must be a list of non-empty strings")
    return words


def decode_generate(inputs: Mapping[str, object]) -> DecodedRequest:
    """Turn the tensors of one request into a GenerationRequest.

    inputs: name -> numpy array (absent optional inputs missing or None).
    ``input_ids`` (INT32 [1, L], from the preprocessing model) replaces
    ``text_input`` when given. Raises ValueError naming the input; ranges are
    checked by ``GenerationRequest.validate`` when the decoder takes it.
    """
    present = {k: v for k, v in inputs.items() if v is not None}
    unknown = sorted(set(present) - set(INPUT_NAMES))
    if unknown:
        raise ValueError(f"unknown input {unknown[0]}")
    flags = {name: bool(_single(name, present[name])) if name in present else False
             for name in FLAG_INPUTS}
    sampling = {field: _single(name, present[name])
                for name, field in SAMPLING_INPUTS.items() if name in present}
    seeds = [name for name in ("random_seed", "seed") if name in present]
    if len(seeds) == 2 and _single("seed", present["seed"]) != _single("random_seed",
                                                                        present["random_seed"]):
        raise ValueError("seed and random_seed are the same parameter; they disagree")
    if seeds:
        sampling["seed"] = int(_single(seeds[0], present[seeds[0]]))
    if "input_ids" in present:
        ids = np.asarray(present["input_ids"])
        if ids.ndim != 2 or ids.shape[0] != 1:
            raise ValueError(f"input_ids must have shape [1, L], got {list(ids.shape)}")
        text, prompt_ids = None, [int(t) for t in ids[0]]
    elif "text_input" in present:
        text, prompt_ids = _text("text_input", _single("text_input", present["text_input"])), None
        if not text:
            raise ValueError("text_input must be a non-empty string")
    else:
        raise ValueError("text_input (or input_ids) is required")
    request = GenerationRequest(
        text=text, prompt_ids=prompt_ids, chat=flags["apply_chat_template"],
        max_tokens=int(_single("max_tokens", present["max_tokens"])) if "max_tokens" in present
        else GenerationRequest.max_tokens,
        sampling=SamplingParams(**sampling),
        end_id=int(_single("end_id", present["end_id"])) if "end_id" in present else None,
        stop_words=_words("stop_words", present["stop_words"]) if "stop_words" in present else (),
        bad_words=_words("bad_words", present["bad_words"]) if "bad_words" in present else (),
        return_log_probs=flags["return_log_probs"],
    )
    return DecodedRequest(request, flags["stream"], flags["exclude_input_in_output"])


def encode_prompt(codec, inputs: Mapping[str, object]) -> list[int]:
    """The preprocessing step: text_input (through the chat template when
    apply_chat_template is true) as token ids. Raises ValueError naming the
    input."""
    if inputs.get("text_input") is None:
        raise ValueError("text_input (or input_ids) is required")
    text = _text("text_input", _single("text_input", inputs["text_input"]))
    if not text:
        raise ValueError("text_input must be a non-empty string")
    chat = inputs.get("apply_chat_template")
    return codec.encode(text, bool(_single("apply_chat_template", chat)) if chat is not None
                        else False)


def encode_event(event: GenerationEvent, prefix: str = "") -> dict[str, np.ndarray]:
    """The output tensors of one response (see the module table)."""
    return {
        "text_output": np.array([(prefix + event.text).encode("utf-8")], dtype=object),
        "output_ids": np.asarray(event.token_ids, dtype=np.int32),
        "output_log_probs": np.asarray(event.logprobs, dtype=np.float32),
        # 0 when not asked, as TensorRT-LLM does (NaN is not valid JSON).
        "cum_log_probs": np.array([0.0 if np.isnan(event.cum_log_prob) else event.cum_log_prob],
                                  dtype=np.float32),
        "num_input_tokens": np.array([event.num_input_tokens], dtype=np.int32),
        "num_output_tokens": np.array([event.num_output_tokens], dtype=np.int32),
        "finish_reason": np.array([(event.finish_reason or "").encode()], dtype=object),
    }


def merge_events(events: list[GenerationEvent]) -> GenerationEvent:
    """One event holding a whole non-streamed generation."""
    last = events[-1]
    return GenerationEvent(
        last.request_id, "".join(e.text for e in events),
        [t for e in events for t in e.token_ids], [p for e in events for p in e.logprobs],
        last.num_input_tokens, last.num_output_tokens, last.cum_log_prob,
        last.finish_reason, last.error)
