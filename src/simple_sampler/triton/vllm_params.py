"""vLLM's sampling parameters, by ``vllm.SamplingParams``' names, as the
generate inputs that carry them here: what a client of Triton's vLLM backend
sends, unchanged.

They come two ways, as they reach that backend
(triton-inference-server/vllm_backend, ``src/utils/request.py``,
``GenerateRequest._get_input_tensors``):

- the ``sampling_parameters`` input: one JSON object (tritonclient's and
  genai-perf's ``--backend vllm`` requests);
- a request's parameters: over HTTP generate a key of the body, or of its
  ``parameters`` object, arrives as an input where one has its name
  (``temperature``, ``max_tokens``, ``stream``) and as a parameter otherwise
  (``min_tokens``, ``stop``, ``logprobs``): the vLLM backend's README request
  ``{"text_input": ..., "parameters": {"stream": false, "temperature": 0}}``.

Each name becomes the input that carries it (``min_tokens`` min_length,
``stop`` stop_words, ``logprobs`` n return_log_probs and num_top_logprobs n,
``logit_bias`` logit_bias_ids and logit_bias_values); its range is that
input's, checked where the input's is. A name given twice (as an input and
here, or both here) is refused, as is a name this server does not implement
and a value of the wrong type: nothing a client sent is dropped or altered.
A null value is vLLM's default, as that backend takes it (but for
``max_tokens``, whose null, the context's rest, is refused).
"""
from __future__ import annotations

import json
from typing import Mapping

import numpy as np

from ..schema import LLM, NUMPY, InvalidRequest
from ..serving.structured import Guide

#: The input of vLLM's JSON object.
SAMPLING_PARAMETERS = "sampling_parameters"

#: vLLM's names (vllm/sampling_params.py, ``SamplingParams``) that are an
#: input's name here too, and vLLM's names for the inputs named otherwise.
SAME_NAMES = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
              "frequency_penalty", "repetition_penalty", "seed", "stop_token_ids", "allowed_token_ids",
              "ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "bad_words",
              "prompt_logprobs", "stream_interval",
              # the vLLM backend's own inputs, which a generate body may nest in "parameters"
              "stream", "exclude_input_in_output")
RENAMED = {"min_tokens": "min_length", "stop": "stop_words"}
#: vLLM's names this server does not implement (refused by name). ``n`` and
#: ``best_of`` are taken at 1 only, ``detokenize`` and
#: ``spaces_between_special_tokens`` at true only (vLLM's defaults).
NOT_IMPLEMENTED = frozenset({
    "truncate_prompt_tokens", "logits_processors", "output_kind",
    "lora_name", "extra_args", "flat_logprobs",
    "length_penalty", "early_stopping", "use_beam_search",
})
#: vLLM's structured outputs (``structured_outputs``; ``guided_decoding``
#: before it): the guided_decoding_guide_type and guided_decoding_guide inputs
STRUCTURED = ("structured_outputs", "guided_decoding")
_FIXED = {"n": 1, "best_of": 1, "detokenize": True, "spaces_between_special_tokens": True}
#: Request parameters of TensorRT-LLM's clients, read as the input they
#: mirror: inflight_batcher_llm_client.py sends ``Streaming`` with every
#: request, its --streaming as its ``streaming`` input is (TensorRT-LLM's
#: backend reads no request parameter but ``triton_trtllm_request_type``,
#: inflight_batcher_llm/src/utils.cc). One that disagrees with its input is
#: refused as any parameter given twice.
TRTLLM_PARAMETERS = {"Streaming": "stream"}

_TENSORS = {tensor.name: tensor for tensor in LLM.inputs}


def vllm_inputs(sampling_parameters, parameters: str | Mapping | None
                ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The inputs that the ``sampling_parameters`` input (its [1] or [1, 1]
    array of one JSON object, or None) and the request's `parameters` (its
    JSON, or a mapping) carry, by input name, shaped as a client sends them
    ([1, 1] scalars, [1, N] lists), and where each was sent (input name ->
    ``sampling_parameters.min_tokens``, ``stop``: ``as_sent``). A parameter
    that no identifier names passes unread: an HTTP header Triton forwards
    as one (``x-request-id``, ``--http-header-forward-pattern``), or one of
    Triton's own (``triton_``; Triton consumes those it knows). Raises
    InvalidRequest naming the field."""
    given = []
    if sampling_parameters is not None:
        given = [(name, f"{SAMPLING_PARAMETERS}.{name}", value)
                 for name, value in _json_object(sampling_parameters).items()]
    if isinstance(parameters, str):
        parameters = json.loads(parameters) if parameters.strip() else {}
    given += [(TRTLLM_PARAMETERS.get(name, name), name, value)
              for name, value in (parameters or {}).items()
              if name.isidentifier() and not name.startswith("triton_")]
    inputs: dict[str, np.ndarray] = {}
    places: dict[str, str] = {}
    for name, place, value in given:
        if value is None and name == "max_tokens":
            raise InvalidRequest(f"{place} must be an integer: null is vLLM's 'to the end of "
                                 f"the context', which this server does not guess; send the "
                                 f"number")
        if value is None:
            continue
        for input_name, array in _as_inputs(name, place, value).items():
            # the vLLM backend's sample client sends its parameters both ways
            # (samples/client.py): the same value twice is one
            if input_name in inputs and not (inputs[input_name].dtype == array.dtype
                                             and np.array_equal(inputs[input_name], array)):
                raise InvalidRequest(f"{place} and {places[input_name]} both set {input_name}, "
                                     f"to different values")
            inputs[input_name] = array
            places.setdefault(input_name, place)
    return inputs, places


def as_sent(error: InvalidRequest, places: Mapping[str, str]) -> InvalidRequest:
    """`error` (a range check's, which begins with the input's name) naming
    the vLLM parameter the client sent instead, where one carried that
    input (``vllm_inputs``' places): ``min_tokens (min_length here) must
    be >= 0``, ``sampling_parameters.temperature must be ...``."""
    message = str(error)
    for input_name, place in places.items():
        if place != input_name and message.startswith(f"{input_name} "):
            same = place.rsplit(".", 1)[-1] == input_name  # sampling_parameters.temperature
            label = place if same else f"{place} ({input_name} here)"
            return InvalidRequest(f"{label}{message[len(input_name):]}")
    return error


def _json_object(array) -> dict:
    """The one JSON object of a ``sampling_parameters`` array."""
    values = np.asarray(array, dtype=object).reshape(-1)
    if values.size != 1:
        raise InvalidRequest(f"{SAMPLING_PARAMETERS} must hold one JSON object per request, "
                             f"got {values.size} values")
    text = values[0]
    try:
        parsed = json.loads(bytes(text).decode("utf-8") if isinstance(text, bytes) else text)
    except (UnicodeDecodeError, ValueError) as error:
        raise InvalidRequest(f"{SAMPLING_PARAMETERS} must be a JSON object (vLLM's "
                             f"SamplingParams by name): {error}") from None
    if not isinstance(parsed, dict):
        raise InvalidRequest(f"{SAMPLING_PARAMETERS} must be a JSON object (vLLM's "
                             f"SamplingParams by name), got {type(parsed).__name__}")
    return parsed


def _as_inputs(name: str, place: str, value) -> dict[str, np.ndarray]:
    """One vLLM parameter as the inputs that carry it."""
    if name in _FIXED:
        fixed = _FIXED[name]
        if _typed(place, value, "BOOL" if isinstance(fixed, bool) else "INT32") != fixed:
            raise InvalidRequest(f"{place} must be {json.dumps(fixed)}: this server "
                                 f"implements no other (got {json.dumps(value)})")
        return {}
    if name == "logprobs":
        count = _typed(place, value, "INT32")
        if count < 0:
            raise InvalidRequest(f"{place} must be >= 0 (the n most likely tokens besides the "
                                 f"chosen one's logprob), got {count}")
        top = {"num_top_logprobs": _array(count, "INT32")} if count else {}
        return {"return_log_probs": _array(True, "BOOL"), **top}
    if name == "logit_bias":
        if not isinstance(value, dict):
            raise InvalidRequest(f"{place} must be an object of token id: bias")
        try:
            ids = [int(token) for token in value]
        except ValueError:
            raise InvalidRequest(f"{place}'s keys must be token ids (decimal integers)") from None
        biases = [_typed(f"{place}[{token}]", bias, "FP32") for token, bias in value.items()]
        return {"logit_bias_ids": np.array([ids], np.int32),
                "logit_bias_values": np.array([biases], np.float32)}
    if name in STRUCTURED:
        guide = Guide.of_vllm(value, place)
        text = {"guided_decoding_guide": _array(guide.text, "BYTES")} if guide.text else {}
        return {"guided_decoding_guide_type": _array(guide.type, "BYTES"), **text}
    if name in NOT_IMPLEMENTED:
        raise InvalidRequest(f"{place} is not supported by this server")
    input_name = RENAMED.get(name, name if name in SAME_NAMES else None)
    if input_name is None and name in _TENSORS:
        raise InvalidRequest(f"{place} is an input of this model, not a vLLM sampling parameter: "
                             f"send it as an input")
    if input_name is None:
        where = ("docs/TENSORS.md lists them" if place != name else
                 "docs/TENSORS.md lists them; over HTTP generate each is a top-level key")
        raise InvalidRequest(f"unknown field {place}: it names no input of this model nor "
                             f"vLLM sampling parameter it takes ({where}), so it would be "
                             f"ignored")
    tensor = _TENSORS[input_name]
    if tensor.dims == (-1,):  # a list: stop words, bad words, stop ids
        return {input_name: _list(place, value, tensor.dtype)}
    if name == "seed":
        seed = _seed(place, value)
        return {} if seed is None else {input_name: _array(seed, tensor.dtype)}
    return {input_name: _array(_typed(place, value, tensor.dtype), tensor.dtype)}


def _list(place: str, value, dtype: str) -> np.ndarray:
    """A list parameter as its [1, N] input: stop strings (one alone too),
    bad words, stop ids. An empty string is refused, as vLLM refuses it
    (vllm/sampling_params.py, ``SamplingParams._verify_args``: a stop
    string may not be empty), not dropped."""
    items = [value] if isinstance(value, str) and dtype == "BYTES" else value
    if not isinstance(items, list):
        raise InvalidRequest(f"{place} must be a list")
    typed = [_typed(f"{place}[{i}]", item, dtype) for i, item in enumerate(items)]
    for i, item in enumerate(typed):
        if dtype == "BYTES" and not item:
            raise InvalidRequest(f"{place}[{i}] must be a non-empty string")
    return np.array([typed], NUMPY[dtype]).reshape(1, len(items))


def _seed(place: str, value) -> int | None:
    """vLLM's int64 seed as this server's uint64 one: -1 none (a random
    draw, as vllm/sampling_params.py's ``SamplingParams.__post_init__`` reads
    it), another negative seed read modulo 2^64, as torch.manual_seed reads
    vLLM's."""
    number = _spelled(value, "INT64") if isinstance(value, str) else value
    if isinstance(number, float) and number.is_integer():  # as _typed reads it
        number = int(number)
    if isinstance(number, int) and not isinstance(number, bool) and not -2**63 <= number < 2**64:
        # the seed's whole range, not the one of the type its sign picks below
        raise InvalidRequest(f"{place} must be in [{-2**63}, {2**64 - 1}] (-1: none), got {number}")
    seed = _typed(place, value, "INT64" if _negative(value) else "UINT64")
    if seed == -1:
        return None
    return seed + 2**64 if seed < 0 else seed


def _negative(value) -> bool:
    spelled = _spelled(value, "INT64") if isinstance(value, str) else value
    return isinstance(spelled, (int, float)) and not isinstance(spelled, bool) and spelled < 0


def _typed(place: str, value, dtype: str):
    """`value` as the input's `dtype` takes it: a JSON value of its type (an
    integer is a number too, a number with no fraction an integer; a bool
    is neither), or a string that spells one (``"0.1"``, ``"100"``,
    ``"true"``), as the vLLM backend casts its parameters
    (vllm_backend, src/utils/vllm_backend_utils.py,
    ``TritonSamplingParams.from_dict``: its sample client sends
    ``{"temperature": "0.1"}``); but nothing is rounded or guessed: a
    fraction for an integer, or a word for a boolean other than true and
    false, is refused."""
    if isinstance(value, str) and dtype != "BYTES":
        value = _spelled(value, dtype)
    if dtype == "BOOL":
        ok = isinstance(value, bool)
    elif dtype == "BYTES":
        ok = isinstance(value, str)
    elif dtype.startswith("FP"):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        ok = isinstance(value, int) and not isinstance(value, bool)
        if ok and not np.iinfo(NUMPY[dtype]).min <= value <= np.iinfo(NUMPY[dtype]).max:
            raise InvalidRequest(f"{place} must be in [{np.iinfo(NUMPY[dtype]).min}, "
                                 f"{np.iinfo(NUMPY[dtype]).max}], got {value}")
    if not ok:
        kind = {"BOOL": "a boolean", "BYTES": "a string"}.get(
            dtype, "a number" if dtype.startswith("FP") else "an integer")
        raise InvalidRequest(f"{place} must be {kind}, got {json.dumps(value)}")
    return value.encode("utf-8") if dtype == "BYTES" else value


def _spelled(text: str, dtype: str):
    """The value a string spells for `dtype`, else the string (refused by
    ``_typed``, naming it)."""
    word = text.strip().lower()
    if dtype == "BOOL":
        return {"true": True, "false": False}.get(word, text)
    # "100.0" for an integer is read as a number too: _typed refuses a fraction
    for parse in (int, float) if not dtype.startswith("FP") else (float,):
        try:
            return parse(word)
        except ValueError:
            pass
    return text


def _array(value, dtype: str) -> np.ndarray:
    return np.array([[value]], NUMPY[dtype])
