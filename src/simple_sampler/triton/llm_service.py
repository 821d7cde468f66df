"""The decode loop as a Triton model's engine room, testable without Triton.

``LlmService`` runs a :class:`~simple_sampler.serving.decoder.Decoder` on an
asyncio loop in its own thread. Triton's ``execute`` hands each request's
tensors to :meth:`LlmService.submit` with a ``send`` callback; the service
streams the request's events through it and sends exactly one final
response (or one error). A request whose client went away
(``is_cancelled()``) is cancelled at its next step.

In ``simple`` mode the sampler is remote: a
:class:`~simple_sampler.triton.sampler_pool.SamplerPool` splits each
micro-batch's rows into shards for the ``simple_sampler`` model's instances,
here (``sampler_shards`` BLS requests) and/or on the servers named in
``sampler_endpoints``, and sends them at once, so the rows of one step are
sampled on several instances in parallel while the data plane computes the
next micro-batch; a shard that fails is sent again elsewhere.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Mapping

from ..schema import SHUTTING_DOWN
from ..serving.decoder import Decoder, GenerationEvent, RequestHandle
from ..serving.engine import Closable
from ..serving.engines import engine_spec
from ..settings import LOCAL, LlmSettings, parse_endpoints
from ..shvs.hot_vocab import load_profile
from ..serving.text import TextCodec
from .generate_io import decode_generate, encode_event, merge_events
from .hot_first_sampler import HotFirstSampler
from .sampler_pool import SamplerCall, build_pool

log = logging.getLogger(__name__)


class Unavailable(RuntimeError):
    """The server cannot serve the request now (it is shutting down); the
    same request may succeed later or elsewhere (UNAVAILABLE, HTTP 503)."""


#: send(outputs, error, final): one response; outputs None with an error
#: (ValueError: the request was bad, INVALID_ARG; Unavailable: UNAVAILABLE;
#: any other error: generation failed, INTERNAL).
Send = Callable[[dict | None, Exception | None, bool], None]
CANCEL_POLL_S = 0.1
#: How long a drain waits for aborted sequences to leave a step in progress.
RELEASE_WAIT_S = 5.0
#: How long close() waits for the decode loop to stop (Triton's exit
#: timeout, launch/server.py, is 8 s for every model's unload).
CLOSE_TIMEOUT_S = 4.0


def build_engine(settings: LlmSettings):
    """The data plane the settings name (``serving.engines``). Raises
    ValueError for settings out of range (``LlmSettings.validate``)."""
    return engine_spec(settings.validate().engine).build(settings)


def hot_first_vocab(settings: LlmSettings, repository: str | None):
    """The hot set the decode loop hands rows over with (docs/HANDOFF.md), or
    None for full rows: handoff "hot-first", a sampler profile, and only
    local endpoints (a remote server's sampler may hold another hot set).
    repository: the model repository's root (a relative profile is the
    sampler model's file there)."""
    if (settings.handoff != "hot-first" or not settings.hot_vocab_profile
            or parse_endpoints(settings.sampler_endpoints) != [LOCAL]):
        return None
    path = os.path.join(repository or "", settings.sampler_model, settings.hot_vocab_profile)
    return load_profile(path).hot_vocab()


@dataclass(eq=False)
class _Delivery:
    """A request whose events are being sent; ``delivering`` is False once
    its client cancelled or went away (its events are then dropped until
    the decoder's final one)."""

    handle: RequestHandle
    is_cancelled: Callable[[], bool]
    delivering: bool = True

    def stop(self) -> None:
        if self.delivering:
            self.delivering = False
            self.handle.cancel()


class LlmService:
    """A Decoder on its own event-loop thread (module docstring)."""

    def __init__(self, settings: LlmSettings, sampler_call: SamplerCall | None = None,
                 engine=None, codec: TextCodec | None = None, repository: str | None = None):
        self.settings = settings
        self.codec = codec or engine_spec(settings.engine).codec(settings)
        self.engine = engine or build_engine(settings)
        sampler = build_pool(settings.sampler_endpoints, sampler_call, settings.sampler_shards,
                             self._count_retry) if settings.sampling_mode == "simple" else None
        hot_vocab = hot_first_vocab(settings, repository) if sampler is not None else None
        if hot_vocab is not None:
            sampler = HotFirstSampler(sampler, hot_vocab)
            log.info("rows cross to the sampler hot-first: %d hot ids of %d, the rest summarized",
                     hot_vocab.size, hot_vocab.vocab_size)
        self.decoder = Decoder(self.engine, self.codec, settings.sampling_mode, sampler,
                               settings.micro_batches)
        self.draining = False
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="decode-loop",
                                       daemon=True)
        self.thread.start()
        self._call(self.decoder.start()).result()
        self.deliveries: set[_Delivery] = set()
        self.cancel_watch = self._call(self._watch_cancellations())

    @property
    def data_plane(self) -> str:
        """What computes the logits, for the ready line (the simulated
        engine's label says it is simulated)."""
        return getattr(self.engine, "label", type(self.engine).__name__)

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

    def _count_retry(self) -> None:
        self.decoder.stats.sampler_retries += 1

    def drain(self, grace_s: float | None = None):
        """Stop admitting (new requests get Unavailable), let the requests in
        flight finish for `grace_s` (default: the settings'), then end the
        rest with a retryable error. Thread-safe; returns a future."""
        grace_s = self.settings.shutdown_grace_s if grace_s is None else grace_s
        return self._call(self._drain(grace_s))

    async def _drain(self, grace_s: float) -> int:
        if self.draining:
            return 0
        self.draining = True
        deadline = self.loop.time() + grace_s
        log.warning("draining: %d requests in flight get %.0f s to finish",
                    self.decoder.num_in_flight, grace_s)
        while self.decoder.num_in_flight and self.loop.time() < deadline:
            await asyncio.sleep(0.05)
        aborted = self.decoder.abort_all(
            f"{SHUTTING_DOWN}: the request did not finish within the "
            f"{grace_s:.0f} s grace period; send it again")
        if aborted:
            log.warning("drained: %d requests ended with an error after the grace period", aborted)
        # Their slots are freed at their lanes' next step boundary.
        deadline = self.loop.time() + RELEASE_WAIT_S
        while self.decoder.num_active and self.loop.time() < deadline:
            await asyncio.sleep(0.01)
        return aborted

    def drain_on_sigterm(self) -> bool:
        """Start :meth:`drain` when this process gets SIGTERM (what
        ``TritonServer.stop`` sends every stub first). Python runs signal
        handlers only in the main thread, which the backend stub keeps in
        its own loop, so the signal's arrival is read from a wakeup socket by
        a thread of ours. Must be called from the main thread (a model's
        ``initialize``); returns False where it cannot be."""
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        try:
            signal.signal(signal.SIGTERM, lambda *_: None)
            signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        except ValueError:  # not the main thread
            reader.close(), writer.close()
            return False
        self._wakeup = (reader, writer)  # the fd must stay open

        def wait():
            while reader.recv(1)[0] != signal.SIGTERM:
                pass
            self.drain()

        threading.Thread(target=wait, name="drain-on-sigterm", daemon=True).start()
        return True

    async def _serve(self, inputs, send: Send, is_cancelled, on_done) -> None:
        try:
            if self.draining:
                raise Unavailable(f"{SHUTTING_DOWN} and admits no new request")
            decoded = decode_generate(inputs)
            handle = self.decoder.submit(decoded.request)
        except (ValueError, Unavailable) as error:
            log.debug("request refused: %s", error)
            self._refuse(error, send, on_done)
            return
        except Exception as error:  # ours, not the client's: the request still gets its answer
            log.exception("request failed before it reached the decoder")
            self._refuse(RuntimeError(f"{type(error).__name__}: {error}"), send, on_done)
            return
        try:
            await self._deliver(decoded, handle, send, is_cancelled)
        finally:
            on_done()

    @staticmethod
    def _refuse(error: Exception, send: Send, on_done) -> None:
        try:
            send(None, error, True)
        finally:
            on_done()

    async def _deliver(self, decoded, handle, send: Send, is_cancelled) -> None:
        """Send the request's events until its final one; whether its client
        cancelled is asked by ``_watch_cancellations``."""
        events: list[GenerationEvent] = []
        delivery = _Delivery(handle, is_cancelled)
        self.deliveries.add(delivery)
        try:
            async for event in handle:
                if delivery.delivering:
                    try:
                        self._send_event(decoded, event, events, send)
                    except Exception:  # nobody to answer: stop generating for them
                        delivery.stop()
        finally:
            self.deliveries.discard(delivery)

    async def _watch_cancellations(self) -> None:
        """Every CANCEL_POLL_S, ask Triton whether each request still being
        delivered was cancelled by its client, and cancel those. One pass for
        all requests: a timeout around each event's wait would cost a task
        and a timer per token per request, and asking Triton costs a round
        trip to the server process, so it is not asked per token either."""
        while True:
            await asyncio.sleep(CANCEL_POLL_S)
            for delivery in [d for d in self.deliveries if d.delivering]:
                try:
                    cancelled = delivery.is_cancelled()
                except Exception:  # noqa: BLE001 - the request is gone on Triton's side
                    log.debug("is_cancelled failed: the request is treated as cancelled",
                              exc_info=True)
                    cancelled = True
                if cancelled:
                    delivery.stop()

    def _send_event(self, decoded, event: GenerationEvent, events: list, send: Send) -> None:
        if event.error:
            send(None, (Unavailable if event.retryable else RuntimeError)(event.error), True)
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

    @property
    def bridge_s(self) -> float:
        """The data plane's bridge time (``TrtLlmEngine.bridge_s``; 0 for
        engines without a bridge)."""
        return getattr(self.engine, "bridge_s", 0.0)

    def close(self) -> None:
        """Stop the decode loop; at most CLOSE_TIMEOUT_S, so that Triton can
        unload the model within its exit timeout. A loop that does not stop
        in time is logged with every thread's stack (what it waits on) and
        left to the process's exit."""
        self.cancel_watch.cancel()
        started = time.monotonic()
        try:
            self._call(self.decoder.close()).result(CLOSE_TIMEOUT_S)
        except TimeoutError:
            stacks = "\n".join(f"thread {thread.name}:\n" + "".join(traceback.format_stack(
                sys._current_frames()[thread.ident])) for thread in threading.enumerate()
                if thread.ident in sys._current_frames())
            log.error("the decode loop did not stop within %.1f s (%d sequences active); "
                      "threads:\n%s", CLOSE_TIMEOUT_S, self.decoder.num_active, stacks)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(CLOSE_TIMEOUT_S)
        log.info("decode loop closed in %.1f s", time.monotonic() - started)
        if isinstance(self.engine, Closable):  # TrtLlmEngine's workers and bridge
            self.engine.close()

