"""The blocking client: gRPC through tritonclient's stream, HTTP through
the generate extension (which tritonclient does not cover)."""
from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request
import uuid
from typing import Iterator

from .common import (Chunk, ClientBase, GenerationError, batches, chunk_from, grpc_error,
                     grpc_inputs, http_error, payload_chunk, request_arrays, sse_chunk)

class GenerateClient(ClientBase):
    """protocol "grpc" (url host:8001) or "http" (url host:8000,
    or http(s)://host:8000)."""

    def generate(self, prompt: str, **params) -> Chunk:
        """The whole answer in one Chunk (stream=false on the server)."""
        chunks = list(self._run(prompt, {**params, "stream": False}))
        if len(chunks) != 1:
            raise GenerationError(f"expected one response, got {len(chunks)}")
        return chunks[0]

    def stream(self, prompt: str, **params) -> Iterator[Chunk]:
        """Chunks as the server sends them (stream=true)."""
        return self._run(prompt, {**params, "stream": True})

    def _grpc(self, prompt, params) -> Iterator[Chunk]:
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        responses: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(self.url)
        if self.batched is None:
            try:
                self.batched = batches(client.get_model_config(
                    self.model, as_json=True, client_timeout=self.timeout_s)["config"])
            except InferenceServerException as error:  # no server, or no such model
                client.close()
                raise grpc_error(error) from None
        inputs = grpc_inputs(grpcclient.InferInput, request_arrays(prompt, params, self.batched))
        client.start_stream(callback=lambda result, error: responses.put((result, error)),
                            stream_timeout=self.timeout_s)
        ended = False
        try:
            try:
                client.async_stream_infer(self.model, inputs, request_id=uuid.uuid4().hex,
                                          enable_empty_final_response=True)
            except InferenceServerException as error:  # the stream failed first: no server
                raise grpc_error(error) from None
            while True:
                try:
                    result, error = responses.get(timeout=self.timeout_s)
                except queue.Empty:
                    raise GenerationError(f"no response from {self.url} within "
                                          f"{self.timeout_s:.0f} s", "DEADLINE_EXCEEDED") from None
                # The request's end: its final flag, or an error (the decode
                # loop sends every error final). Triton ends the call then;
                # cancelling it instead races Triton 2.51 (aio.let_triton_end).
                ended = error is not None or \
                    result.get_response().parameters["triton_final_response"].bool_param
                if ended:
                    client.stop_stream(cancel_requests=False)
                if error is not None:
                    raise grpc_error(error)
                if result.get_response().outputs:
                    yield chunk_from(result.as_numpy)
                if ended:
                    return
        finally:
            client.stop_stream(cancel_requests=not ended)  # a caller leaving early: stop it
            client.close()

    def _http(self, address: str, body: bytes) -> Iterator[Chunk]:
        request = urllib.request.Request(address, body, headers={"Content-Type": "application/json"})
        try:
            response = urllib.request.urlopen(request, timeout=self.timeout_s)
        except urllib.error.HTTPError as error:
            raise http_error(error.read()) from None
        except urllib.error.URLError as error:  # no server there: as gRPC's UNAVAILABLE
            raise GenerationError(f"cannot reach {address}: {error.reason}", "UNAVAILABLE") \
                from None
        with response:
            if address.endswith("/generate"):
                yield payload_chunk(json.loads(response.read()))
                return
            for line in response:
                chunk = sse_chunk(line)
                if chunk is not None:
                    yield chunk
