"""A client for the `ensemble` model: prompt in, text out, streamed or not,
over gRPC (bidirectional stream) or HTTP (the generate extension).

    from simple_sampler.client import GenerateClient
    client = GenerateClient("127.0.0.1:8001", protocol="grpc")
    for chunk in client.stream("What is the capital of France?", max_tokens=32,
                               temperature=0.0, apply_chat_template=True):
        print(chunk.text, end="", flush=True)

Every keyword is an ensemble input (see ``simple_sampler.triton.generate_io``).
A server error raises :class:`GenerationError` carrying the server's message.
"""
from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

#: ensemble input -> numpy dtype of its [1, 1] tensor
SCALAR_TYPES = {
    "max_tokens": np.int32, "stream": bool, "temperature": np.float32, "top_k": np.int32,
    "top_p": np.float32, "min_p": np.float32, "repetition_penalty": np.float32,
    "presence_penalty": np.float32, "frequency_penalty": np.float32, "random_seed": np.uint64,
    "seed": np.uint64, "end_id": np.int32, "min_length": np.int32, "return_log_probs": bool,
    "exclude_input_in_output": bool, "apply_chat_template": bool,
}
WORD_LISTS = ("stop_words", "bad_words")


class GenerationError(RuntimeError):
    """The server refused or failed a request; str() is the server's message."""


@dataclass
class Chunk:
    """One response: new text, its token ids and logprobs, and on the last
    one the finish reason."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cum_log_prob: float = 0.0
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    finish_reason: str = ""


def _scalar_arrays(params: dict) -> dict[str, np.ndarray]:
    arrays = {}
    for name, value in params.items():
        if value is None:
            continue
        if name in WORD_LISTS:
            arrays[name] = np.array([[w.encode() for w in value]], dtype=object)
        elif name in SCALAR_TYPES:
            arrays[name] = np.array([[value]], dtype=SCALAR_TYPES[name])
        else:
            raise TypeError(f"unknown generation parameter {name!r}; known: "
                            f"{', '.join([*SCALAR_TYPES, *WORD_LISTS])}")
    return arrays


def _chunk(get) -> Chunk:
    """A Chunk from an accessor name -> numpy array (or None)."""
    def values(name):
        array = get(name)
        return [] if array is None else np.asarray(array).reshape(-1).tolist()

    text = values("text_output")
    reason = values("finish_reason")
    as_str = lambda v: v.decode("utf-8") if isinstance(v, bytes) else str(v)
    first = lambda name, default: (values(name) or [default])[0]
    return Chunk(as_str(text[0]) if text else "", [int(t) for t in values("output_ids")],
                 [float(p) for p in values("output_log_probs")], float(first("cum_log_probs", 0.0)),
                 int(first("num_input_tokens", 0)), int(first("num_output_tokens", 0)),
                 as_str(reason[0]) if reason else "")


class GenerateClient:
    """protocol "grpc" (url host:8001) or "http" (url host:8000)."""

    def __init__(self, url: str, protocol: str = "grpc", model: str = "ensemble",
                 timeout_s: float = 600.0):
        if protocol not in ("grpc", "http"):
            raise ValueError(f"protocol must be grpc or http, got {protocol!r}")
        self.url, self.protocol, self.model, self.timeout_s = url, protocol, model, timeout_s

    def generate(self, prompt: str, **params) -> Chunk:
        """The whole answer in one Chunk (stream=false on the server)."""
        chunks = list(self._run(prompt, {**params, "stream": False}))
        if len(chunks) != 1:
            raise GenerationError(f"expected one response, got {len(chunks)}")
        return chunks[0]

    def stream(self, prompt: str, **params) -> Iterator[Chunk]:
        """Chunks as the server sends them (stream=true)."""
        return self._run(prompt, {**params, "stream": True})

    def _run(self, prompt: str, params: dict) -> Iterator[Chunk]:
        if self.protocol == "grpc":
            return self._grpc(prompt, params)
        return self._http(prompt, params)

    def _grpc(self, prompt: str, params: dict) -> Iterator[Chunk]:
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException, np_to_triton_dtype

        arrays = {"text_input": np.array([[prompt.encode()]], dtype=object), **_scalar_arrays(params)}
        inputs = []
        for name, array in arrays.items():
            tensor = grpcclient.InferInput(name, list(array.shape),
                                           "BYTES" if array.dtype == object
                                           else np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        responses: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(self.url)
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        try:
            client.async_stream_infer(self.model, inputs, request_id=uuid.uuid4().hex,
                                      enable_empty_final_response=True)
            while True:
                result, error = responses.get(timeout=self.timeout_s)
                if error is not None:
                    raise GenerationError(error.message() if isinstance(
                        error, InferenceServerException) else str(error))
                response = result.get_response()
                final = response.parameters["triton_final_response"].bool_param
                if response.outputs:
                    yield _chunk(result.as_numpy)
                if final:
                    return
        finally:
            client.stop_stream(cancel_requests=True)
            client.close()

    def _http(self, prompt: str, params: dict) -> Iterator[Chunk]:
        body = {"text_input": prompt, **{k: v for k, v in params.items() if v is not None}}
        endpoint = "generate_stream" if params.get("stream") else "generate"
        request = urllib.request.Request(
            f"http://{self.url}/v2/models/{self.model}/{endpoint}", json.dumps(body).encode(),
            headers={"Content-Type": "application/json"})
        try:
            response = urllib.request.urlopen(request, timeout=self.timeout_s)
        except urllib.error.HTTPError as error:
            raise GenerationError(_http_error(error.read())) from None
        with response:
            if endpoint == "generate":
                yield _chunk(json.loads(response.read()).get)
                return
            for line in response:
                line = line.decode().strip()
                if not line.startswith("data:"):
                    continue
                payload = json.loads(line[len("data:"):])
                if "error" in payload:
                    raise GenerationError(payload["error"])
                yield _chunk(payload.get)


def _http_error(body: bytes) -> str:
    try:
        return json.loads(body)["error"]
    except (ValueError, KeyError):
        return body.decode(errors="replace")
