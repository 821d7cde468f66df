"""The asyncio client: gRPC through tritonclient.grpc.aio's stream, HTTP
through aiohttp (what tritonclient.http.aio is built on) for the generate
extension."""
from __future__ import annotations

import asyncio
import uuid
from typing import AsyncIterator

from .common import (STREAM_END_TIMEOUT_S, Chunk, ClientBase, GenerationError, batches,
                     chunk_from, grpc_error, grpc_inputs, http_error, payload_chunk,
                     request_arrays, sse_chunk)


class AsyncGenerateClient(ClientBase):
    """protocol "grpc" (url host:8001) or "http" (url host:8000, or
    http(s)://host:8000). Use as an async context manager, or call
    ``close()``; one client serves many concurrent requests over one
    connection."""

    _connection = None

    async def __aenter__(self) -> "AsyncGenerateClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._connection is not None:
            await self._connection.close()
            self._connection = None

    async def generate(self, prompt: str, **params) -> Chunk:
        """The whole answer in one Chunk (stream=false on the server)."""
        chunks = [chunk async for chunk in self._run(prompt, {**params, "stream": False})]
        if len(chunks) != 1:
            raise GenerationError(f"expected one response, got {len(chunks)}")
        return chunks[0]

    def stream(self, prompt: str, **params) -> AsyncIterator[Chunk]:
        """Chunks as the server sends them (stream=true)."""
        return self._run(prompt, {**params, "stream": True})

    def _connect(self):
        if self._connection is None:
            if self.protocol == "grpc":
                import tritonclient.grpc.aio as grpcclient
                self._connection = grpcclient.InferenceServerClient(self.url)
            else:
                import aiohttp
                self._connection = aiohttp.ClientSession(
                    timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self._connection

    async def _grpc(self, prompt, params) -> AsyncIterator[Chunk]:
        import tritonclient.grpc.aio as grpcclient
        from tritonclient.utils import InferenceServerException

        if self.batched is None:
            try:
                self.batched = batches((await self._connect().get_model_config(
                    self.model, as_json=True, client_timeout=self.timeout_s))["config"])
            except InferenceServerException as error:  # no server, or no such model
                raise grpc_error(error) from None
        request = {"model_name": self.model, "request_id": uuid.uuid4().hex,
                   "inputs": grpc_inputs(grpcclient.InferInput,
                                         request_arrays(prompt, params, self.batched))}

        async def one_request():
            yield request

        # grpc.aio cannot ask for Triton's empty final response, so the end is
        # the response that carries a finish_reason (the decode loop's last
        # one) or an error (the decode loop sends it final).
        responses = self._connect().stream_infer(one_request(), stream_timeout=self.timeout_s)
        ending = None
        try:
            async for result, error in responses:
                chunk = None if error is not None else chunk_from(result.as_numpy)
                if error is not None or chunk.finish_reason:
                    ending = _end_call(responses)
                    # a caller cancelled meanwhile leaves the call to end by itself
                    await asyncio.shield(ending)
                if error is not None:
                    raise grpc_error(error)
                yield chunk
                if ending is not None:
                    return
            raise GenerationError("the stream ended before the final response")
        finally:
            if ending is None:  # a caller leaving early: cancelling stops the generation
                responses.cancel()

    async def _http(self, address: str, body: bytes) -> AsyncIterator[Chunk]:
        async with self._connect().post(
                address, data=body, headers={"Content-Type": "application/json"}) as response:
            if response.status != 200:
                raise http_error(await response.read())
            if address.endswith("/generate"):
                yield payload_chunk(await response.json(content_type=None))
                return
            async for line in response.content:
                chunk = sse_chunk(line)
                if chunk is not None:
                    yield chunk


#: The calls being left for Triton to end: a strong reference to their tasks
#: (the event loop keeps only weak ones, and grpc.aio cancels a call that is
#: collected unfinished).
_ENDING: set[asyncio.Task] = set()


def _end_call(responses) -> asyncio.Task:
    task = asyncio.ensure_future(let_triton_end(responses))
    _ENDING.add(task)
    task.add_done_callback(_ENDING.discard)
    return task


async def let_triton_end(responses) -> None:
    """Wait for Triton to end a call whose request had its final response
    (or an error); cancel it only if it has not ended within
    STREAM_END_TIMEOUT_S. Cancelling such a call at once races Triton 2.51's
    gRPC stream handler (server r24.10, src/grpc/infer_handler.h,
    InferHandlerState::Context::IssueRequestCancellation and
    HandleCancellation): a cancellation that reaches a state whose Finish is
    already issued (PARTIAL_COMPLETION) marks it CANCELLATION_ISSUED and waits
    for a response callback that never comes (seen in its verbose log:
    "Waiting for the callback to retrieve cancellation", never released). The
    state keeps its InferenceRequest and so the model, which never unloads:
    Triton's stop waits out its exit timeout (docs/RELIABILITY.md, "Stopping
    after a load")."""
    async def drain() -> None:
        async for _ in responses:
            pass

    try:  # wait_for, not asyncio.timeout: NGC's Triton images run Python 3.10
        await asyncio.wait_for(drain(), STREAM_END_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - the call failed or hung: cancelling ends it here
        responses.cancel()
