"""What the sync and asyncio clients share: the request encoding for each
protocol, the response decoding, the error type."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from ..schema import (ENSEMBLE, GUIDED_DECODING_INPUTS, INPUT_IDS, PROMPT_OUTPUTS, TOP_OUTPUTS,
                      TRTLLM_INPUTS, VLLM_EXTRA_OUTPUTS)

PROMPT = "text_input"
#: The inputs this client leaves out: the vLLM backend's return_* ones, whose
#: outputs a Chunk does not read so (finish_reason "None" before the last
#: response), and TensorRT-LLM's that other clients send (other names, values
#: fixed or of no effect here), but its guided decoding's.
OTHER_CLIENTS_INPUTS = frozenset([*VLLM_EXTRA_OUTPUTS, *(t.name for t in TRTLLM_INPUTS
                                                         if t not in GUIDED_DECODING_INPUTS)])
_OWN_INPUTS = tuple(t for t in ENSEMBLE.inputs if t.name not in OTHER_CLIENTS_INPUTS)
#: ensemble input -> numpy dtype of its [1, 1] tensor (the prompt aside)
SCALAR_TYPES = {t.name: t.numpy for t in _OWN_INPUTS if t.scalar and t.name != PROMPT}
#: ensemble input -> numpy dtype of its [1, n] list (BYTES: strings)
LIST_TYPES = {t.name: t.numpy for t in _OWN_INPUTS if not t.scalar}
WORD_LISTS = tuple(name for name, dtype in LIST_TYPES.items() if dtype is np.object_)
PROTOCOLS = ("grpc", "http")
#: protocol -> the schemes its url may start with (the first: the default)
SCHEMES = {"grpc": ("grpc",), "http": ("http", "https")}
#: How long a gRPC stream whose request had its final response may take to
#: end before the client cancels it (aio.let_triton_end says why it waits).
STREAM_END_TIMEOUT_S = 5.0


class GenerationError(RuntimeError):
    """The server refused or failed a request; str() is the server's message,
    ``status`` gRPC's status code name when the server gave one
    (``INVALID_ARGUMENT``: the request was bad; ``UNAVAILABLE``: try again)."""

    def __init__(self, message: str, status: str = ""):
        super().__init__(message)
        self.status = status


@dataclass
class Chunk:
    """One response: new text, its token ids and logprobs, and on the last
    one the finish reason. ``top_logprobs``: per token its most likely
    (token id, logprob) pairs, most likely first, when the request asked
    for ``num_top_logprobs`` (else empty). With ``prompt_logprobs``, the
    first response also holds the prompt's scores: its ``prompt_ids``,
    ``prompt_logprobs`` and ``prompt_ranks`` (each token's after the first:
    its logprob, and how many tokens were at least as likely there) and
    ``prompt_top_logprobs`` (the pairs at each of those places)."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cum_log_prob: float = 0.0
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    finish_reason: str = ""
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_ranks: list[int] = field(default_factory=list)
    #: vLLM's stop_reason, on the last one: the stop string or stop token id
    #: that ended the request, else None
    stop_reason: str | int | None = None


def _check_names(params: dict) -> None:
    unknown = sorted(set(params) - set(SCALAR_TYPES) - set(LIST_TYPES))
    if unknown:
        raise TypeError(f"unknown generation parameter {unknown[0]!r}; known: "
                        f"{', '.join([*SCALAR_TYPES, *LIST_TYPES])}")


def batches(config: dict) -> bool:
    """Whether a model takes a batch dimension: its configuration's (as
    tritonclient's get_model_config(as_json=True) gives it) max_batch_size
    is above 0 (0, Triton's vLLM backend's, is left out of the JSON)."""
    return int(config.get("max_batch_size", 0)) > 0


def request_arrays(prompt: str | Sequence[int], params: dict, batched: bool = True
                   ) -> dict[str, np.ndarray]:
    """The request's tensors, name -> [1, 1] (lists [1, n]) numpy array, or
    without the batch dimension ([1], lists [n]) for a model that takes none
    (``batched`` False). A prompt given as token ids is sent as
    ``input_ids`` (the ``llm`` model's input: the ensemble takes text)."""
    _check_names(params)
    if isinstance(prompt, str):
        arrays = {PROMPT: np.array([[prompt.encode()]], dtype=object)}
    else:
        arrays = {INPUT_IDS.name: np.array([list(prompt)], dtype=INPUT_IDS.numpy)}
    for name, value in params.items():
        if value is None:
            continue
        if name in WORD_LISTS:
            arrays[name] = np.array([[w.encode() for w in value]], dtype=object)
        elif name in LIST_TYPES:
            arrays[name] = np.array([list(value)], dtype=LIST_TYPES[name])
        else:
            arrays[name] = np.array([[value]], dtype=SCALAR_TYPES[name])
    return arrays if batched else {name: array[0] for name, array in arrays.items()}


def grpc_inputs(infer_input: type, arrays: dict[str, np.ndarray]) -> list:
    """tritonclient InferInputs (grpc or grpc.aio's class) holding `arrays`."""
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, array in arrays.items():
        tensor = infer_input(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def split_url(url: str, protocol: str) -> tuple[str, str]:
    """(scheme, host:port) of a server's `url`: "host:port", or with a
    scheme of its `protocol` (SCHEMES: "http://" or "https://" for http,
    "grpc://" for grpc); a trailing "/" is dropped."""
    scheme, separator, address = url.rpartition("://")
    if not separator:
        scheme = SCHEMES[protocol][0]
    elif scheme.lower() not in SCHEMES[protocol]:
        allowed = " or ".join(f"{s}://" for s in SCHEMES[protocol])
        raise ValueError(f"url: {url!r} starts with {scheme}://; for {protocol} give host:port "
                         f"or a url starting with {allowed}")
    address = address.rstrip("/")
    if not address or "/" in address:
        raise ValueError(f"url: {url!r} is not host:port (no path after the port)")
    return scheme.lower(), address


def http_request(base_url: str, model: str, prompt: str, params: dict) -> tuple[str, bytes]:
    """(address, JSON body) of the generate or generate_stream endpoint of
    the server at `base_url` (scheme://host:port)."""
    _check_names(params)
    body = {PROMPT: prompt, **{k: v for k, v in params.items() if v is not None}}
    endpoint = "generate_stream" if params.get("stream") else "generate"
    return f"{base_url}/v2/models/{model}/{endpoint}", json.dumps(body).encode()


def sse_chunk(line: bytes) -> Chunk | None:
    """The Chunk of one server-sent-event line of generate_stream, None for
    lines that carry no data; an error event raises GenerationError."""
    text = line.decode().strip()
    if not text.startswith("data:"):
        return None
    return payload_chunk(json.loads(text[len("data:"):]))


def payload_chunk(payload: dict) -> Chunk:
    """The Chunk of one JSON response of the generate extension."""
    if "error" in payload:
        raise GenerationError(payload["error"])
    return chunk_from(payload.get)


def http_error(body: bytes) -> GenerationError:
    try:
        return GenerationError(json.loads(body)["error"])
    except (ValueError, KeyError):
        return GenerationError(body.decode(errors="replace"))


def grpc_error(error: Exception) -> GenerationError:
    message, status = getattr(error, "message", None), getattr(error, "status", None)
    status = (status() if callable(status) else status) or ""
    return GenerationError(message() if callable(message) else str(error),
                           str(status).removeprefix("StatusCode."))


def chunk_from(get: Callable[[str], object]) -> Chunk:
    """A Chunk from an accessor name -> array-like (or None)."""
    def values(name):
        array = get(name)
        return [] if array is None else np.asarray(array).reshape(-1).tolist()

    def as_str(value):
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)

    def first(name, default):
        return (values(name) or [default])[0]

    text, reason = values("text_output"), values("finish_reason")
    token_ids = [int(t) for t in values("output_ids")]
    prompt_logprobs = [float(p) for p in values(PROMPT_OUTPUTS[1])]
    return Chunk(as_str(text[0]) if text else "", token_ids,
                 [float(p) for p in values("output_log_probs")], float(first("cum_log_probs", 0.0)),
                 int(first("num_input_tokens", 0)), int(first("num_output_tokens", 0)),
                 as_str(reason[0]) if reason else "", _top_pairs(get, TOP_OUTPUTS, len(token_ids)),
                 [int(t) for t in values(PROMPT_OUTPUTS[0])], prompt_logprobs,
                 _top_pairs(get, PROMPT_OUTPUTS[3:], len(prompt_logprobs)),
                 [int(r) for r in values(PROMPT_OUTPUTS[2])],
                 json.loads(as_str(first("stop_reason", "null"))))


def _top_pairs(get: Callable[[str], object], names: Sequence[str],
               tokens: int) -> list[list[tuple[int, float]]]:
    """Per token, the (id, logprob) pairs of the outputs `names` (ids, then
    logprobs: [tokens, n]; flattened over HTTP), padding (-1) left out."""
    ids, logprobs = (get(name) for name in names)
    if ids is None or logprobs is None or not tokens:
        return []
    ids = np.asarray(ids).reshape(tokens, -1).tolist()
    logprobs = np.asarray(logprobs, np.float64).reshape(tokens, -1).tolist()
    return [[(token, logprob) for token, logprob in zip(row_ids, row_logprobs) if token >= 0]
            for row_ids, row_logprobs in zip(ids, logprobs)]


class ClientBase:
    """Settings and protocol dispatch; subclasses provide ``_grpc(arrays)``
    and ``_http(address, body)`` returning iterators of Chunks."""

    def __init__(self, url: str, protocol: str = "grpc", model: str = "ensemble",
                 timeout_s: float = 600.0, batched: bool | None = None):
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be grpc or http, got {protocol!r}")
        scheme, self.url = split_url(url, protocol)
        self.base_url = f"{scheme}://{self.url}"
        self.protocol, self.model, self.timeout_s = protocol, model, timeout_s
        #: whether the model takes a batch dimension (``batches``); None: read
        #: from its configuration before the first gRPC request
        self.batched = batched

    def _run(self, prompt: str, params: dict):
        if self.protocol == "grpc":
            _check_names(params)  # at the call, not at the first chunk
            return self._grpc(prompt, params)
        return self._http(*http_request(self.base_url, self.model, prompt, params))
