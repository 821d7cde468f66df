"""What every streamed or gathered answer of the front door shares: OpenAI's
error responses, the generations' responses merged as they come, a client
gone away noticed, a stream closed however it ends (``app`` and
``event_apis`` answer with them)."""
from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator, Awaitable, Callable, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..client import Chunk, GenerationError
from .protocol import RequestError, error_body

#: the front door's one logger (its records keep app's name)
log = logging.getLogger("simple_sampler.frontend.app")

T = TypeVar("T")
DISCONNECT_POLL_S = 0.1
#: gRPC status of a Triton error -> (HTTP status, OpenAI error type)
STATUSES = {"INVALID_ARGUMENT": (400, "invalid_request_error"),
            "UNAVAILABLE": (503, "service_unavailable"),
            "NOT_FOUND": (503, "service_unavailable")}


def error_response(status: int, message: str, kind: str, param: str | None = None,
           code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, code), status_code=status)


def generation_error(error: GenerationError) -> JSONResponse:
    status, kind = STATUSES.get(error.status, (500, "internal_server_error"))
    if status == 500:
        log.error("generation failed: %s (%s)", error, error.status or "no status")
    return error_response(status, str(error), kind)


def internal_error(error: Exception) -> JSONResponse:
    """A failure of ours: logged with its traceback, answered 500."""
    log.error("request failed", exc_info=error)
    return error_response(500, f"{type(error).__name__}: {error}", "internal_server_error")


def stream_error(error: Exception) -> dict:
    """OpenAI's error object of what ended a begun stream: Triton's refusal
    as it refused it, an answer that is not what was asked (tools), the
    responses ending early, or a failure of ours (logged with its traceback)."""
    if isinstance(error, GenerationError):
        return json.loads(generation_error(error).body)
    if isinstance(error, RequestError):
        return error.body()
    if isinstance(error, (EndedEarly, StopAsyncIteration)):
        return error_body("the server ended the stream early", "internal_server_error")
    log.error("stream failed", exc_info=error)
    return error_body(f"{type(error).__name__}: {error}", "internal_server_error")


class EndedEarly(Exception):
    """A generation's responses ended before its final one."""


async def next_chunk(chunks: AsyncIterator[Chunk]) -> Chunk:
    try:
        return await chunks.__anext__()
    except StopAsyncIteration:
        raise EndedEarly from None


async def merged(streams: list[AsyncIterator[Chunk]]) -> AsyncIterator[tuple[int, Chunk]]:
    """(index, response) of each generation's responses up to its final
    one, each as it comes. One read ahead per generation, so that a slow
    client slows the reads as one generation's stream would (the gRPC
    stream's flow control); the first failure raised, the other reads then
    cancelled."""
    reads = {asyncio.ensure_future(next_chunk(chunks)): index for index, chunks in enumerate(streams)}
    try:
        while reads:
            done, _ = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
            for read in sorted(done, key=reads.get):
                index = reads.pop(read)
                if read.cancelled():  # the generation cancelled itself (not this reader)
                    raise EndedEarly
                chunk = read.result()
                yield index, chunk
                if not chunk.finish_reason:
                    reads[asyncio.ensure_future(next_chunk(streams[index]))] = index
    finally:
        await cancel_all(list(reads))


async def first_of(merged: AsyncIterator[tuple[int, Chunk]]) -> tuple[int, Chunk]:
    """The first response of any generation, so that a refused request is
    answered with its status, not with a stream that starts 200 and then
    fails."""
    try:
        return await merged.__anext__()
    except (StopAsyncIteration, EndedEarly):
        raise GenerationError("the server ended the stream without a response") from None


async def cancel_all(tasks: list[asyncio.Future]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def all_of(work: list[Awaitable[T]]) -> list[T]:
    """Every result, or the first failure with the rest cancelled."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        return await asyncio.gather(*tasks)
    finally:
        await cancel_all(tasks)


class ClosingStreamingResponse(StreamingResponse):
    """A stream whose events' generator is closed however the response
    ends: Starlette leaves it suspended where the client goes away while an
    event is being sent, and its generations would then run on until it is
    garbage collected. `on_close`: what the generator's own ``finally`` would
    close, closed here too, since a generator never started (the client
    gone before the response's start was sent) runs no ``finally``."""

    def __init__(self, content, *args, on_close: Callable[[], Awaitable[None]] | None = None,
                 **kwargs):
        super().__init__(content, *args, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await close(self.body_iterator)
                if self.on_close is not None:
                    await self.on_close()


async def unless_gone(request: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None when the client went away first (`work` is
    then cancelled, and with it the generation)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                log.info("client went away: its generation is cancelled")
                return None
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def collect(chunks: AsyncIterator[Chunk]) -> list[Chunk]:
    return [chunk async for chunk in chunks]


async def close(chunks: AsyncIterator[Chunk]) -> None:
    """Close a generation's responses, unless a cancelled reader is still
    inside them (a handler cancelled twice): the cancellation ends them."""
    if not getattr(chunks, "ag_running", False):
        await chunks.aclose()


async def close_all(streams: list[AsyncIterator[Chunk]]) -> None:
    for chunks in streams:
        await close(chunks)


async def stream(request: Request, streams: list[AsyncIterator[Chunk]],
                 events: Callable[[tuple[int, Chunk], AsyncIterator[tuple[int, Chunk]]],
                                  AsyncIterator[bytes]]) -> Response:
    """A streamed answer, begun once any generation has answered: each
    other's refusal then comes as an error event, as in vLLM's streams.
    events(first, merged): the answer's events, from the first response
    (read already) and the merged rest; they close `merged` and `streams`."""
    merged_responses = merged(streams)
    try:
        first = await unless_gone(request, first_of(merged_responses))
    except BaseException:
        await merged_responses.aclose()
        await close_all(streams)
        raise
    if first is None:  # nobody to answer
        await merged_responses.aclose()
        await close_all(streams)
        return Response(status_code=499)
    async def close_generations() -> None:
        await merged_responses.aclose()
        await close_all(streams)

    return ClosingStreamingResponse(events(first, merged_responses),
                                    media_type="text/event-stream",
                                    headers={"Cache-Control": "no-cache"},
                                    on_close=close_generations)
