"""The front door's Triton side and its server: what the ``llm`` model serves
(read from its own configuration, so the front door and the decode loop
agree on the model, its tokenizer and its context), generation over gRPC
streaming, and the uvicorn server that ``serve`` runs in a thread.

Requests go to ``llm``, not ``ensemble``: Triton 2.51 does not pass a
client's cancellation on to an ensemble step that is already running
(docs/SERVING.md, "Cancellation"), so only a direct call stops the work of a
client that leaves.
"""
from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from pathlib import Path
from typing import AsyncIterator, Callable

from ..client import AsyncGenerateClient, Chunk, GenerationError
from ..models import SMOLLM2_GGUF_NAME
from ..schema import LLM, SHUTTING_DOWN
from ..serving.engines import engine_spec
from ..serving.text import model_directory
from ..settings import FrontendSettings, LlmSettings
from .generation_defaults import sampling_defaults
from .translate import Plan, Served

log = logging.getLogger(__name__)


#: how long the door's /metrics waits for Triton's metrics endpoint
METRICS_TIMEOUT_S = 5.0
#: a GGUF file name's quantization tag before ``.gguf`` (``.Q4_1``, ``.IQ2_XS``, ``.f16``)
GGUF_QUANTIZATION = re.compile(r"\.(I?Q\d\w*|T?Q\d\w*|B?FP?(16|32))$", re.IGNORECASE)


def model_id(settings: LlmSettings) -> str:
    """The name clients pass as ``model``: the model's file or directory name
    (SmolLM2's by default), a GGUF file's without ``.gguf`` and its
    quantization tag, prefixed ``simulated-`` when no model runs (the
    simulated engine: the name is only its tokenizer's)."""
    name = Path(settings.model).name if settings.model else SMOLLM2_GGUF_NAME
    if name.lower().endswith(".gguf"):
        name = GGUF_QUANTIZATION.sub("", name[:-len(".gguf")])
    return name if engine_spec(settings.engine).runs_model else f"simulated-{name}"


async def llm_settings(grpc_url: str) -> LlmSettings:
    """The settings the running ``llm`` model was configured with."""
    import tritonclient.grpc.aio as grpcclient

    client = grpcclient.InferenceServerClient(grpc_url)
    try:
        config = (await client.get_model_config(LLM.name, as_json=True))["config"]
    finally:
        await client.close()
    return LlmSettings.from_config(config)


def served_by(settings: LlmSettings, generation_config: str = FrontendSettings.generation_config,
              tool_parser: str = FrontendSettings.tool_call_parser) -> Served:
    """What the door serves for the llm's settings. generation_config
    (``FrontendSettings``): whose sampling defaults requests take, read from
    the model's directory where a model of --model runs (not a simulated
    engine's, nor a --model-config shape's random weights)."""
    spec = engine_spec(settings.engine)
    codec = spec.codec(settings)  # loads the tokenizer (transformers, torch)
    directory = (model_directory(settings.model or None)
                 if spec.runs_model and not settings.model_config else None)
    return Served(model_id(settings), codec, settings.max_context,
                  spec.vocab_size(settings, codec), streams=settings.decoupled_mode,
                  tool_parser=tool_parser,
                  sampling_defaults=sampling_defaults(directory, generation_config),
                  stream_interval=settings.stream_interval)


async def _answered_once(client: AsyncGenerateClient, prompt_ids: list[int],
                         params: dict) -> AsyncIterator[Chunk]:
    yield await client.generate(prompt_ids, **params)


class TritonBackend:
    """Generation over one gRPC connection to Triton (made on the server's
    event loop, which grpc.aio binds it to). `streams`: the llm model is
    decoupled, and streams every generation; else each is answered once."""

    def __init__(self, grpc_url: str, streams: bool = True, metrics_url: str | None = None):
        self.grpc_url, self.streams, self.metrics_url = grpc_url, streams, metrics_url
        self.client: AsyncGenerateClient | None = None

    def _connection(self) -> AsyncGenerateClient:
        if self.client is None:
            self.client = AsyncGenerateClient(self.grpc_url, "grpc", model=LLM.name)
        return self.client

    async def generate(self, plan: Plan) -> AsyncIterator[Chunk]:
        """The llm model's responses to one request, streamed where it streams
        (a non-streamed request is gathered by the app). A gRPC stream carries
        an error's text without its status: the front door checks the
        client's mistakes itself first, so what comes this way is a shutdown
        (UNAVAILABLE) or ours. The prompt is never in the answer (a
        non-streamed one would start with it): the front door echoes it."""
        params = {**plan.params, "exclude_input_in_output": True}
        stream = (self._connection().stream(plan.prompt_ids, **params) if self.streams
                  else _answered_once(self._connection(), plan.prompt_ids, params))
        try:
            async for chunk in stream:
                yield chunk
        except GenerationError as error:
            if error.status:
                raise
            raise GenerationError(str(error), "UNAVAILABLE" if str(error).startswith(
                SHUTTING_DOWN) else "INTERNAL") from None
        finally:
            await stream.aclose()

    async def ready(self) -> bool:
        import tritonclient.grpc.aio as grpcclient

        client = grpcclient.InferenceServerClient(self.grpc_url)
        try:
            return bool(await client.is_model_ready(LLM.name))
        except Exception:  # noqa: BLE001 - Triton unreachable: not ready
            return False
        finally:
            await client.close()

    async def metrics(self) -> str | None:
        """Triton's Prometheus metrics (its own and the models', ``nv_*`` and
        ``simple_sampler_*``), as its metrics endpoint gives them; None when
        it does not answer."""
        import httpx

        try:
            async with httpx.AsyncClient(timeout=METRICS_TIMEOUT_S) as client:
                answer = await client.get(self.metrics_url)
                answer.raise_for_status()
                return answer.text
        except httpx.HTTPError as error:
            log.warning("Triton's metrics (%s) did not answer: %s", self.metrics_url, error)
            return None

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()


class FrontendServer:
    """The front door on uvicorn in a thread of its own: ``start`` returns
    once it listens. ``close`` stops it listening, open responses get
    ``grace_s`` to finish (``serve`` gives them Triton's drain meanwhile);
    ``stop`` closes and waits for the thread.

    ``prepare`` does the slow part (the web stack's import, the tokenizer's
    load: seconds on a small host) and may run in another thread before
    Triton is ready, so that ``serve``'s main thread never blocks on it and
    a signal can stop the start at any moment."""

    def __init__(self, grpc_url: str, host: str, port: int, grace_s: float = 5.0,
                 tool_call_parser: str = FrontendSettings.tool_call_parser,
                 served: Served | None = None,
                 generation_config: str = FrontendSettings.generation_config,
                 metrics_url: str | None = None):
        self.grpc_url, self.host, self.port, self.served = grpc_url, host, port, served
        self.metrics_url = metrics_url
        self.grace_s, self.tool_call_parser = grace_s, tool_call_parser
        self.generation_config = generation_config
        self.thread: threading.Thread | None = None
        self.server = None

    @classmethod
    def of(cls, frontend: FrontendSettings, grpc_url: str, grace_s: float,
           metrics_url: str | None = None) -> "FrontendServer":
        """The door ``serve``'s settings describe, on Triton's gRPC endpoint
        (and its metrics endpoint, served again at the door's /metrics)."""
        return cls(grpc_url, frontend.openai_host, frontend.openai_port, grace_s,
                   frontend.tool_call_parser, generation_config=frontend.generation_config,
                   metrics_url=metrics_url)

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    def prepare(self, settings: LlmSettings | None = None) -> "FrontendServer":
        """Import the web stack and load what the front door serves: from
        `settings` (the llm model's, as the launcher wrote them), or else
        from the running ``llm`` model's configuration."""
        import uvicorn  # noqa: F401 - imported here, not in start

        from . import app  # noqa: F401

        if self.served is None:
            if settings is None:
                settings = asyncio.run(llm_settings(self.grpc_url))
            self.served = served_by(settings, self.generation_config, self.tool_call_parser)
        return self

    def start(self, timeout_s: float = 120.0,
              stop_requested: Callable[[], bool] | None = None) -> "FrontendServer":
        """Listen (after ``prepare``, which it runs if it has not run);
        returns early, not listening, once `stop_requested()`."""
        import uvicorn

        from .app import build_app

        self.prepare()
        backend = TritonBackend(self.grpc_url, self.served.streams, self.metrics_url)
        app = build_app(self.served, backend.generate, backend.ready,
                        backend.metrics if self.metrics_url else None)
        app.router.add_event_handler("shutdown", backend.close)
        config = uvicorn.Config(app, host=self.host, port=self.port, log_level="warning",
                                timeout_graceful_shutdown=self.grace_s, lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="openai-frontend",
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
            if stop_requested is not None and stop_requested():
                self.stop()
                return self
            time.sleep(0.05)
        if not self.server.started:
            self.stop()
            raise RuntimeError(f"the OpenAI frontend did not start on {self.host}:{self.port} "
                               f"(port in use?)")
        return self

    def close(self) -> None:
        if self.server is not None:
            self.server.should_exit = True

    def stop(self) -> None:
        self.close()
        if self.thread is not None:
            self.thread.join(self.grace_s + 5)
        self.server = self.thread = None

    def __enter__(self) -> "FrontendServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
