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
watched every ``streams.DISCONNECT_POLL_S``; either way the gRPC stream to ``llm``
is cancelled, which the decode loop sees at its next cancellation poll.

A request is parsed and tokenized in a worker thread (the tokenizer
releases the GIL), so a long prompt does not hold up the other requests'
streams on the event loop.
"""
from __future__ import annotations

import asyncio
import importlib.metadata
from typing import AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from ..client import Chunk, GenerationError
from ..schema import InvalidRequest
from . import anthropic, answers, event_apis, responses, tokens, translate
from .protocol import ChatCompletionRequest, CompletionRequest, RequestError, parse
from .streams import (all_of, close_all, collect, error_response, generation_error,
                      internal_error, stream, stream_error, unless_gone)
from .translate import Plan, Served

Generate = Callable[[Plan], AsyncIterator[Chunk]]
#: Prometheus' text exposition format, as Triton's metrics endpoint gives it
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


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
    except Exception as error:  # noqa: BLE001 - the stream still ends with its error
        yield answers.sse(stream_error(error))
    finally:
        await merged.aclose()
        await close_all(streams)
    yield answers.sse("[DONE]")


async def _prompt_alone(plan: Plan) -> AsyncIterator[Chunk]:
    """The answer of a request whose prompt is its whole answer
    (``Plan.asks_the_model``): nothing generated."""
    yield Chunk("", [], [], 0.0, len(plan.prompt_ids), 0, "length")


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
        return internal_error(error)


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
        return await stream(request, streams, lambda first, rest: _events(
            plans, first, rest, streams, served))
    try:
        answer = await unless_gone(request, all_of([collect(chunks) for chunks in streams]))
    except BaseException:
        await close_all(streams)
        raise
    await close_all(streams)
    if answer is None:  # nobody to answer
        return Response(status_code=499)
    return JSONResponse(answers.response_of_all(plans, answer, served))


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
            return error_response(404, f"the model {model_id!r} does not exist; this server serves "
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
        return await event_apis.serve(request, responses.API, served, generate)

    @app.post("/v1/messages")  # Anthropic's, as vLLM serves it
    async def create_message(request: Request):
        return await event_apis.serve(request, anthropic.API, served, generate)

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(request: Request):
        return await event_apis.serve_alone(request, anthropic.count_tokens, served,
                                            anthropic.errors)

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
        return error_response(400, str(error), "invalid_request_error")

    @app.exception_handler(GenerationError)
    async def refused(_request, error: GenerationError):
        return generation_error(error)

    @app.exception_handler(RequestValidationError)  # FastAPI's 422 is OpenAI's 400
    async def invalid(_request, error: RequestValidationError):
        first = error.errors()[0]
        param = ".".join(str(p) for p in first["loc"][1:]) or None
        return error_response(400, f"{param}: {first['msg']}", "invalid_request_error", param)

    @app.exception_handler(HTTPException)
    async def http_error(_request, error: HTTPException):
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return error_response(error.status_code, str(error.detail), kind)

    @app.exception_handler(Exception)
    async def internal(_request, error: Exception):
        return internal_error(error)


def _serve_probes(app: FastAPI, ready, metrics) -> None:
    """The routes that ask nothing of the model: health, version, metrics
    (``build_app``'s arguments)."""
    @app.get("/health")
    @app.get("/ping")  # vLLM's (SageMaker's probe), GET or POST
    @app.post("/ping")
    async def health():
        if ready is not None and not await ready():
            return error_response(503, "the model is not ready", "service_unavailable")
        return Response(status_code=200)

    if metrics is not None:
        @app.get("/metrics")
        async def prometheus():
            text = await metrics()
            if text is None:
                return error_response(503, "Triton's metrics endpoint did not answer",
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
        return internal_error(error)
