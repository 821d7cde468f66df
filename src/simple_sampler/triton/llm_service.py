"""The decode loop as a Triton model's engine room, testable without Triton.

``LlmService`` runs a :class:`~simple_sampler.serving.decoder.Decoder` on an
asyncio loop in its own thread. Triton's ``execute`` hands each request's
tensors to :meth:`LlmService.submit` with a ``send`` callback; the service
streams the request's events through it and sends exactly one final
response (or one error). A request whose client went away
(``is_cancelled()``) is cancelled at its next step.

In ``simple`` mode the sampler is remote: :func:`remote_sampler` splits each
micro-batch's rows into up to ``shards`` requests to the ``simple_sampler``
model and sends them at once, so the rows of one step are sampled on several
instances in parallel while the data plane computes the next micro-batch.
"""
from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np
import torch

from ..params import SamplingBatch
from ..serving.decoder import Decoder, GenerationEvent
from ..serving.batch_invariant import NEEDS_TORCH
from ..serving.engine import DEFAULT_MAX_CONTEXT, ENGINES, TorchEngine
from ..serving.text import TextCodec
from .generate_io import decode_generate, encode_event, merge_events
from .sampler_client import batch_arrays

#: send(outputs, error, final): one response; outputs None with an error
#: (ValueError: the request was bad; RuntimeError: generation failed).
Send = Callable[[dict | None, Exception | None, bool], None]
#: call(inputs) -> outputs: one synchronous request to the sampler model.
SamplerCall = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]
CANCEL_POLL_S = 0.1


@dataclass
class LlmSettings:
    """The llm model's parameters (config.pbtxt): see README.md."""

    model: str = ""
    engine: str = "torch"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    sampling_mode: str = "simple"
    max_batch_size: int = 32
    max_context: int = DEFAULT_MAX_CONTEXT
    micro_batches: int = 2
    sampler_shards: int = 2
    batch_invariant: bool = False

    @classmethod
    def from_parameters(cls, parameters: Mapping[str, str]) -> "LlmSettings":
        fields = cls.__dataclass_fields__
        unknown = sorted(set(parameters) - set(fields))
        if unknown:
            raise ValueError(f"unknown llm parameter {unknown[0]}; known: {', '.join(fields)}")
        return cls(**{k: _parameter(getattr(cls, k), v) for k, v in parameters.items()})


def _parameter(default, text: str):
    """A config.pbtxt string as the type of the field's default (bool("false") is True)."""
    if isinstance(default, bool):
        if text.lower() not in ("true", "false"):
            raise ValueError(f"expected true or false, got {text!r}")
        return text.lower() == "true"
    return type(default)(text)


def remote_sampler(call: SamplerCall, shards: int):
    """An async sampler for the Decoder that asks the sampler model."""

    async def sampler(logits: torch.Tensor, batch: SamplingBatch):
        rows = logits.numpy()
        arrays = batch_arrays(batch)
        wanted = batch.want_logprobs
        arrays["return_log_probs"] = (np.ones(len(batch), bool) if wanted is None
                                      else np.asarray(wanted, bool))[:, None]
        bounds = np.linspace(0, len(batch), min(shards, len(batch)) + 1).astype(int)
        parts = await asyncio.gather(*(
            asyncio.to_thread(call, {"logits": rows[a:b], **{k: v[a:b] for k, v in arrays.items()}})
            for a, b in zip(bounds[:-1], bounds[1:])))
        tokens = np.concatenate([p["output_ids"][:, 0] for p in parts]).astype(np.int64)
        nan = np.full((len(batch), 1), np.nan, np.float32)  # no row of a shard asked
        logprobs = np.concatenate([p.get("output_log_probs", nan[:len(p["output_ids"])])[:, 0]
                                   for p in parts])
        return tokens, logprobs

    return sampler


def build_engine(settings: LlmSettings):
    """The data plane the settings name: ``torch`` (TorchEngine, on the CPU)
    or ``tensorrt_llm`` (TrtLlmEngine; imports TensorRT-LLM only then)."""
    source = settings.model or None
    if settings.engine == "torch":
        return TorchEngine.from_source(source, max_batch_size=settings.max_batch_size,
                                       max_context=settings.max_context,
                                       batch_invariant=settings.batch_invariant)
    if settings.engine == "tensorrt_llm":
        if not settings.model:
            raise ValueError("engine tensorrt_llm needs model: a Hugging Face checkpoint or "
                             "TensorRT-LLM engine directory (with the tokenizer's files)")
        if settings.batch_invariant:
            raise ValueError(NEEDS_TORCH)
        from ..serving.trtllm import TrtLlmEngine

        return TrtLlmEngine.from_source(
            settings.model, max_batch_size=settings.max_batch_size,
            max_context=settings.max_context, tensor_parallel_size=settings.tensor_parallel_size,
            pipeline_parallel_size=settings.pipeline_parallel_size)
    raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {settings.engine!r}")


class LlmService:
    """A Decoder on its own event-loop thread (module docstring)."""

    def __init__(self, settings: LlmSettings, sampler_call: SamplerCall | None = None,
                 engine=None, codec: TextCodec | None = None):
        self.settings = settings
        source = settings.model or None
        self.codec = codec or TextCodec.from_source(source)
        self.engine = engine or build_engine(settings)
        sampler = remote_sampler(sampler_call, settings.sampler_shards) if sampler_call else None
        self.decoder = Decoder(self.engine, self.codec, settings.sampling_mode, sampler,
                               settings.micro_batches)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="decode-loop",
                                       daemon=True)
        self.thread.start()
        self._call(self.decoder.start()).result()

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def submit(self, inputs: Mapping[str, object], send: Send,
               is_cancelled: Callable[[], bool] = lambda: False,
               on_done: Callable[[], None] = lambda: None):
        """Start one request; returns a future done when the request has left
        the decoder (``on_done`` is called then). Bad input is answered with
        one error response. A ``send`` that raises (the client went away)
        cancels the request, as ``is_cancelled()`` does."""
        return self._call(self._serve(inputs, send, is_cancelled, on_done))

    async def _serve(self, inputs, send: Send, is_cancelled, on_done) -> None:
        try:
            decoded = decode_generate(inputs)
            handle = self.decoder.submit(decoded.request)
        except ValueError as error:
            try:
                send(None, error, True)
            finally:
                on_done()
            return
        try:
            await self._deliver(decoded, handle, send, is_cancelled)
        finally:
            on_done()

    async def _deliver(self, decoded, handle, send: Send, is_cancelled) -> None:
        """Send the request's events until its final one. Cancellation is
        polled at most every CANCEL_POLL_S, whether or not events arrive,
        because asking Triton costs a round trip to the server process."""
        events: list[GenerationEvent] = []
        delivering, next_poll = True, 0.0
        while True:
            try:  # Queue.get is cancellation-safe: a timeout loses no event
                event = await asyncio.wait_for(handle.events.get(), CANCEL_POLL_S)
            except asyncio.TimeoutError:
                event = None
            if delivering and self.loop.time() >= next_poll:
                next_poll = self.loop.time() + CANCEL_POLL_S
                if is_cancelled():
                    handle.cancel()
                    delivering = False
            if event is None:
                continue
            if delivering:
                try:
                    self._send_event(decoded, event, events, send)
                except Exception:  # nobody to answer: stop generating for them
                    handle.cancel()
                    delivering = False
            if event.final:
                return

    def _send_event(self, decoded, event: GenerationEvent, events: list, send: Send) -> None:
        if event.error:
            send(None, RuntimeError(event.error), True)
        elif decoded.stream:
            send(encode_event(event), None, event.final)
        else:
            events.append(event)
            if event.final:
                prefix = "" if decoded.exclude_input_in_output else \
                    self.codec.decode(self._prompt_ids(decoded))
                send(encode_event(merge_events(events), prefix), None, True)

    def _prompt_ids(self, decoded) -> list[int]:
        request = decoded.request
        if request.prompt_ids is not None:
            return list(request.prompt_ids)
        return self.codec.encode(request.text, request.chat)

    def stats(self):
        return self.decoder.stats

    def close(self) -> None:
        self._call(self.decoder.close()).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        close_engine = getattr(self.engine, "close", None)  # TrtLlmEngine's workers and bridge
        if close_engine is not None:
            close_engine()

