"""The asyncio client: gRPC through tritonclient.grpc.aio's stream, HTTP
through aiohttp (what tritonclient.http.aio is built on) for the generate
extension."""
from __future__ import annotations

import uuid
from typing import AsyncIterator

from .common import (Chunk, ClientBase, GenerationError, chunk_from, grpc_error, grpc_inputs,
                     http_error, payload_chunk, sse_chunk)


class AsyncGenerateClient(ClientBase):
    """protocol "grpc" (url host:8001) or "http" (url host:8000). Use as an
    async context manager, or call ``close()``; one client serves many
    concurrent requests over one connection."""

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

    async def _grpc(self, arrays) -> AsyncIterator[Chunk]:
        import tritonclient.grpc.aio as grpcclient

        request = {"model_name": self.model, "request_id": uuid.uuid4().hex,
                   "inputs": grpc_inputs(grpcclient.InferInput, arrays)}

        async def one_request():
            yield request

        # grpc.aio cannot ask for Triton's empty final response, so the end is
        # the response that carries a finish_reason: the decode loop's last one.
        responses = self._connect().stream_infer(one_request(), stream_timeout=self.timeout_s)
        try:
            async for result, error in responses:
                if error is not None:
                    raise grpc_error(error)
                chunk = chunk_from(result.as_numpy)
                yield chunk
                if chunk.finish_reason:
                    return
            raise GenerationError("the stream ended before the final response")
        finally:
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
