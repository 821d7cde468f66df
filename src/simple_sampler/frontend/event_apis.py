"""The APIs whose answer is one generation's object or a stream of its
events: OpenAI's Responses API (``responses``) and Anthropic's Messages API
(``anthropic``). Each is an ``EventApi``: its request planned as a chat
request, its whole answer, the writer of its events, its error objects;
``serve`` answers a request to it, streamed or not, as ``app`` answers chat."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..client import Chunk, GenerationError
from ..schema import InvalidRequest
from .protocol import RequestError
from .streams import (close, close_all, collect, error_response, generation_error,
                      internal_error, stream, stream_error, unless_gone)
from .translate import Plan, Served


@dataclass(frozen=True)
class EventApi:
    """One such API. plan(body, served) -> (request, plan) (RequestError if
    bad); answer(request, plan, chunks, served) -> its whole answer;
    events(request, plan, served): a writer of its stream's events
    (``opening()``, ``delta(chunk)``, ``error(openai_error_body)``, each a
    list of events or one); sse(event) -> bytes; errors(openai_error_body)
    -> its own error object (the same for OpenAI's)."""

    plan: Callable
    answer: Callable
    events: Callable
    sse: Callable[[dict], bytes]
    errors: Callable[[dict], dict] = lambda body: body


async def serve(request: Request, api: EventApi, served: Served,
                generate: Callable[[Plan], AsyncIterator[Chunk]]) -> Response:
    """A request to `api`: planned in a worker thread, generated, answered;
    every error as `api`'s error object (a failure of ours logged with its
    traceback, a 500)."""
    return await _with_errors(api.errors, _respond(request, api, served, generate))


async def serve_alone(request: Request, answer_of: Callable[[bytes, Served], dict],
                      served: Served, errors: Callable[[dict], dict]) -> Response:
    """A request answered without the model (``answer_of(body, served)``,
    in a worker thread), its errors as `errors` writes them."""
    async def answered() -> Response:
        return JSONResponse(await asyncio.to_thread(answer_of, await request.body(), served))
    return await _with_errors(errors, answered())


async def _with_errors(errors: Callable[[dict], dict], answering) -> Response:
    """`answering`'s response, or its failure as `errors` writes an error."""
    try:
        return await answering
    except RequestError as error:
        failed = JSONResponse(error.body(), status_code=error.status)
    except InvalidRequest as error:
        failed = error_response(400, str(error), "invalid_request_error")
    except GenerationError as error:
        failed = generation_error(error)
    except Exception as error:  # noqa: BLE001 - ours: logged with its traceback, a 500
        failed = internal_error(error)
    return JSONResponse(errors(json.loads(failed.body)), status_code=failed.status_code)


async def _respond(request: Request, api: EventApi, served: Served, generate) -> Response:
    body = await request.body()
    asked, plan = await asyncio.to_thread(api.plan, body, served)
    if (request_id := request.headers.get("x-request-id")) is not None:
        plan.id = request_id
    chunks = generate(plan)
    if plan.stream:
        return await stream(request, [chunks], lambda first, rest: _events(
            api, api.events(asked, plan, served), first, rest, [chunks]))
    try:
        answer = await unless_gone(request, collect(chunks))
    finally:
        await close(chunks)
    if answer is None:  # nobody to answer
        return Response(status_code=499)
    return JSONResponse(api.answer(asked, plan, answer, served))


async def _events(api: EventApi, writer, first: tuple[int, Chunk],
                  merged: AsyncIterator[tuple[int, Chunk]],
                  streams: list[AsyncIterator[Chunk]]) -> AsyncIterator[bytes]:
    """A streamed answer's events (`writer`'s), ended by an error event
    where the generation fails."""
    try:
        for event in writer.opening():
            yield api.sse(event)
        chunk = first[1]
        while True:
            for event in writer.delta(chunk):
                yield api.sse(event)
            if chunk.finish_reason:
                break
            _, chunk = await merged.__anext__()
    except Exception as error:  # noqa: BLE001 - the stream still ends with its error
        yield api.sse(writer.error(stream_error(error)))
    finally:
        await merged.aclose()
        await close_all(streams)
