"""The ASGI application: OpenAI's routes over a ``generate`` callable.

``build_app(served, generate)``: ``generate(plan)`` is an async iterator of
the ``llm`` model's responses (``client.Chunk``) for one request
(``backend.py`` streams them from Triton over gRPC; tests pass a fake). Every
error is OpenAI's error object: a client's mistake 400 (or 404 for an
unknown model or path), Triton's refusal of a request as it refuses it
(INVALID_ARGUMENT 400, UNAVAILABLE 503), anything else 500 with the
traceback in the log.

A client that leaves stops its generation: a streamed response is cancelled
by Starlette when the connection closes; until its first token (a request
queued behind a full batch) and for a non-streamed one the connection is
watched every ``DISCONNECT_POLL_S``; either way the gRPC stream to ``llm``
is cancelled, which the decode loop sees at its next cancellation poll.

A request is parsed and tokenized in a worker thread (the tokenizer
releases the GIL), so a long prompt does not hold up the other requests'
streams on the event loop.
"""
from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
from typing import AsyncIterator, Awaitable, Callable, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ..client import Chunk, GenerationError
from ..schema import InvalidRequest
from . import answers, responses, tokens, translate
from .protocol import ChatCompletionRequest, CompletionRequest, RequestError, error_body, parse
from .translate import Plan, Served

log = logging.getLogger(__name__)

Generate = Callable[[Plan], AsyncIterator[Chunk]]
T = TypeVar("T")
DISCONNECT_POLL_S = 0.1
#: Prometheus' text exposition format, as Triton's metrics endpoint gives it
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
#: gRPC status of a Triton error -> (HTTP status, OpenAI error type)
STATUSES = {"INVALID_ARGUMENT": (400, "invalid_request_error"),
            "UNAVAILABLE": (503, "service_unavailable"),
            "NOT_FOUND": (503, "service_unavailable")}


def _error(status: int, message: str, kind: str, param: str | None = None,
           code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, code), status_code=status)


def generation_error(error: GenerationError) -> JSONResponse:
    status, kind = STATUSES.get(error.status, (500, "internal_server_error"))
    if status == 500:
        log.error("generation failed: %s (%s)", error, error.status or "no status")
    return _error(status, str(error), kind)


def _internal(error: Exception) -> JSONResponse:
    """A failure of ours: logged with its traceback, answered 500."""
    log.error("request failed", exc_info=error)
    return _error(500, f"{type(error).__name__}: {error}", "internal_server_error")


class EndedEarly(Exception):
    """A generation's responses ended before its final one."""


async def _next(chunks: AsyncIterator[Chunk]) -> Chunk:
    try:
        return await chunks.__anext__()
    except StopAsyncIteration:
        raise EndedEarly from None


async def _merged(streams: list[AsyncIterator[Chunk]]) -> AsyncIterator[tuple[int, Chunk]]:
    """(index, response) of each generation's responses up to its final
    one, each as it comes. One read ahead per generation, so that a slow
    client slows the reads as one generation's stream would (the gRPC
    stream's flow control); the first failure raised, the other reads then
    cancelled."""
    reads = {asyncio.ensure_future(_next(chunks)): index for index, chunks in enumerate(streams)}
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
                    reads[asyncio.ensure_future(_next(streams[index]))] = index
    finally:
        await _cancel(list(reads))


async def _first_of(merged: AsyncIterator[tuple[int, Chunk]]) -> tuple[int, Chunk]:
    """The first response of any generation, so that a refused request is
    answered with its status, not with a stream that starts 200 and then
    fails."""
    try:
        return await merged.__anext__()
    except (StopAsyncIteration, EndedEarly):
        raise GenerationError("the server ended the stream without a response") from None


async def _cancel(tasks: list[asyncio.Future]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _all(work: list[Awaitable[T]]) -> list[T]:
    """Every result, or the first failure with the rest cancelled."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        return await asyncio.gather(*tasks)
    finally:
        await _cancel(tasks)


async def _events(plans: list[Plan], first: tuple[int, Chunk],
                  merged: AsyncIterator[tuple[int, Chunk]], streams: list[AsyncIterator[Chunk]],
                  served: Served) -> AsyncIterator[bytes]:
    """A streamed answer: each generation's responses as events of the
    choice at its index, as they come (`first`: the first of them, read
    already); with several (n, completions' list of prompts) one usage
    event at the end for all."""
    alone = len(plans) == 1
    opening, generated, finals = [True] * len(plans), [0] * len(plans), {}
    try:
        index, chunk = first
        while True:
            generated[index] += len(chunk.token_ids)
            for event in answers.stream_events(plans[index], chunk, served, opening[index],
                                               generated[index], index, alone):
                yield answers.sse(event)
            opening[index] = False
            if chunk.finish_reason:
                finals[index] = chunk
            try:
                index, chunk = await merged.__anext__()
            except StopAsyncIteration:
                break
        if not alone and plans[0].include_usage:
            yield answers.sse(answers.usage_event(plans, [finals[i] for i in range(len(plans))],
                                                  served))
    except GenerationError as error:
        yield answers.sse(generation_error(error).body.decode())
    except RequestError as error:  # an answer that is not what was asked (tools)
        yield answers.sse(error.body())
    except EndedEarly:
        yield answers.sse(error_body("the server ended the stream early",
                                       "internal_server_error"))
    except Exception as error:  # noqa: BLE001 - ours: the stream still ends with its error
        log.exception("stream failed")
        yield answers.sse(error_body(f"{type(error).__name__}: {error}",
                                       "internal_server_error"))
    finally:
        await merged.aclose()
        await _close_all(streams)
    yield answers.sse("[DONE]")


async def _respond(request: Request, served: Served, generate: Generate) -> Response:
    """A /v1/responses request (``responses``): planned as chat is, its
    generation answered as a Response object or streamed as its events."""
    body = await request.body()
    asked, plan = await asyncio.to_thread(responses.plan_response, body, served)
    if (request_id := request.headers.get("x-request-id")) is not None:
        plan.id = request_id
    chunks = generate(plan)
    if plan.stream:
        return await _stream(request, [plan], [chunks], served, lambda *stream: _response_events(
            responses.ResponseEvents(asked, plan, served), *stream[1:4]))
    try:
        answer = await _unless_gone(request, _collect(chunks))
    finally:
        await _close(chunks)
    if answer is None:  # nobody to answer
        return Response(status_code=499)
    return JSONResponse(responses.response(asked, plan, answer, served))


async def _response_events(writer: responses.ResponseEvents, first: tuple[int, Chunk],
                           merged: AsyncIterator[tuple[int, Chunk]],
                           streams: list[AsyncIterator[Chunk]]) -> AsyncIterator[bytes]:
    """A streamed Response's events (``responses.ResponseEvents``), ended
    by an error event where the generation fails."""
    try:
        for event in writer.opening():
            yield responses.sse(event)
        chunk = first[1]
        while True:
            for event in writer.delta(chunk):
                yield responses.sse(event)
            if chunk.finish_reason:
                break
            _, chunk = await merged.__anext__()
    except GenerationError as error:
        yield responses.sse(writer.error(json.loads(generation_error(error).body)))
    except RequestError as error:  # an answer that is not what was asked (tools)
        yield responses.sse(writer.error(error.body()))
    except (EndedEarly, StopAsyncIteration):
        yield responses.sse(writer.error(error_body("the server ended the stream early",
                                                      "internal_server_error")))
    except Exception as error:  # noqa: BLE001 - ours: the stream still ends with its error
        log.exception("stream failed")
        yield responses.sse(writer.error(error_body(f"{type(error).__name__}: {error}",
                                                      "internal_server_error")))
    finally:
        await merged.aclose()
        await _close_all(streams)


class ClosingStreamingResponse(StreamingResponse):
    """A stream whose events' generator is closed however the response
    ends: Starlette leaves it suspended where the client goes away while an
    event is being sent, and its generations would then run on until it is
    garbage collected."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await _close(self.body_iterator)


async def _unless_gone(request: Request, work: Awaitable[T]) -> T | None:
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


async def _prompt_alone(plan: Plan) -> AsyncIterator[Chunk]:
    """The answer of a request whose prompt is its whole answer
    (``Plan.asks_the_model``): nothing generated."""
    yield Chunk("", [], [], 0.0, len(plan.prompt_ids), 0, "length")


async def _collect(chunks: AsyncIterator[Chunk]) -> list[Chunk]:
    return [chunk async for chunk in chunks]


async def _close(chunks: AsyncIterator[Chunk]) -> None:
    """Close a generation's responses, unless a cancelled reader is still
    inside them (a handler cancelled twice): the cancellation ends them."""
    if not getattr(chunks, "ag_running", False):
        await chunks.aclose()


async def _close_all(streams: list[AsyncIterator[Chunk]]) -> None:
    for chunks in streams:
        await _close(chunks)


async def _serve(request: Request, model, plan_for, served: Served,
                 generate: Generate) -> Response:
    """One request to an endpoint: parsed and planned (``plan_for``) in a
    worker thread, generated, answered. A failure of ours is answered here:
    raised, Starlette's error middleware would answer it but also re-raise
    it, logged twice."""
    try:
        return await _answer(request, model, plan_for, served, generate)
    except (InvalidRequest, GenerationError):
        raise
    except Exception as error:  # noqa: BLE001 - ours: logged with its traceback, a 500
        return _internal(error)


async def _answer(request: Request, model, plan_for, served: Served,
                  generate: Generate) -> Response:
    body = await request.body()
    # a generation per choice: n per prompt (completions may hold several)
    plans = await asyncio.to_thread(lambda: plan_for(parse(model, body), served))
    if (request_id := request.headers.get("x-request-id")) is not None:
        for plan in plans:  # the answer's id, before the body's (vLLM's _base_request_id)
            plan.id = request_id
    streams = [generate(plan) if plan.asks_the_model else _prompt_alone(plan) for plan in plans]
    if plans[0].stream:
        return await _stream(request, plans, streams, served)
    try:
        answer = await _unless_gone(request, _all([_collect(chunks) for chunks in streams]))
    except BaseException:
        await _close_all(streams)
        raise
    await _close_all(streams)
    if answer is None:  # nobody to answer
        return Response(status_code=499)
    return JSONResponse(answers.response_of_all(plans, answer, served))


async def _stream(request: Request, plans: list[Plan], streams: list[AsyncIterator[Chunk]],
                  served: Served, events=None) -> Response:
    """A streamed answer, begun once any generation has answered: each
    other's refusal then comes as an error event, as in vLLM's streams.
    events(plans, first, merged, streams, served): the answer's events
    (``_events``, chat's and completions')."""
    merged = _merged(streams)
    try:
        first = await _unless_gone(request, _first_of(merged))
    except BaseException:
        await merged.aclose()
        await _close_all(streams)
        raise
    if first is None:  # nobody to answer
        await merged.aclose()
        await _close_all(streams)
        return Response(status_code=499)
    return ClosingStreamingResponse((events or _events)(plans, first, merged, streams, served),
                                    media_type="text/event-stream",
                                    headers={"Cache-Control": "no-cache"})


def build_app(served: Served, generate: Generate,
              ready: Callable[[], Awaitable[bool]] | None = None,
              metrics: Callable[[], Awaitable[str | None]] | None = None) -> FastAPI:
    """The front door (module docstring). ``ready()``: whether the model
    behind it serves (``/health``). ``metrics()``: Triton's Prometheus
    metrics text (None: they did not come), served at ``/metrics`` where
    vLLM serves its own, on the API's port (None: no such route)."""
    app = FastAPI(title="SIMPLE for Triton: OpenAI-compatible API", docs_url=None,
                  redoc_url=None, openapi_url=None)
    _answer_errors(app)
    _serve_probes(app, ready, metrics)

    @app.get("/v1/models")
    async def models():
        return answers.models_list(served)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != served.model_id:
            return _error(404, f"the model {model_id!r} does not exist; this server serves "
                               f"{served.model_id!r}", "not_found_error", "model",
                          "model_not_found")
        return answers.models_list(served)["data"][0]

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, CompletionRequest, translate.plan_completion, served,
                            generate)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, ChatCompletionRequest, translate.plan_chat, served,
                            generate)

    @app.post("/v1/responses")
    async def create_response(request: Request):
        try:
            return await _respond(request, served, generate)
        except (InvalidRequest, GenerationError):
            raise
        except Exception as error:  # noqa: BLE001 - ours: logged with its traceback, a 500
            return _internal(error)

    @app.post("/tokenize")  # vLLM's paths: no /v1
    async def tokenize(request: Request):
        return await _tokens(request, tokens.tokenize, served)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await _tokens(request, tokens.detokenize, served)

    return app


def _answer_errors(app: FastAPI) -> None:
    """Every error as OpenAI's error object (module docstring)."""
    @app.exception_handler(InvalidRequest)  # the client's mistake, RequestError or not
    async def request_error(_request, error: InvalidRequest):
        if isinstance(error, RequestError):
            return JSONResponse(error.body(), status_code=error.status)
        return _error(400, str(error), "invalid_request_error")

    @app.exception_handler(GenerationError)
    async def refused(_request, error: GenerationError):
        return generation_error(error)

    @app.exception_handler(RequestValidationError)  # FastAPI's 422 is OpenAI's 400
    async def invalid(_request, error: RequestValidationError):
        first = error.errors()[0]
        param = ".".join(str(p) for p in first["loc"][1:]) or None
        return _error(400, f"{param}: {first['msg']}", "invalid_request_error", param)

    @app.exception_handler(HTTPException)
    async def http_error(_request, error: HTTPException):
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return _error(error.status_code, str(error.detail), kind)

    @app.exception_handler(Exception)
    async def internal(_request, error: Exception):
        return _internal(error)


def _serve_probes(app: FastAPI, ready, metrics) -> None:
    """The routes that ask nothing of the model: health, version, metrics
    (``build_app``'s arguments)."""
    @app.get("/health")
    @app.get("/ping")  # vLLM's (SageMaker's probe), GET or POST
    @app.post("/ping")
    async def health():
        if ready is not None and not await ready():
            return _error(503, "the model is not ready", "service_unavailable")
        return Response(status_code=200)

    if metrics is not None:
        @app.get("/metrics")
        async def prometheus():
            text = await metrics()
            if text is None:
                return _error(503, "Triton's metrics endpoint did not answer",
                              "service_unavailable")
            return Response(text, media_type=PROMETHEUS_TEXT)

    @app.get("/version")  # vLLM's: the server's version (here this package's)
    async def version():
        return {"version": importlib.metadata.version("simple-sampler")}


async def _tokens(request: Request, answer_of, served: Served) -> Response:
    """vLLM's /tokenize or /detokenize (``tokens``), in a worker thread as a
    prompt is tokenized (a long one does not stall the streams)."""
    body = await request.body()
    try:
        return JSONResponse(await asyncio.to_thread(answer_of, body, served))
    except InvalidRequest:
        raise
    except Exception as error:  # noqa: BLE001 - ours: logged with its traceback, a 500
        return _internal(error)
