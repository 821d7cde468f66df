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
import functools
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from ..schema import SHUTTING_DOWN
from ..serving.decoder import Decoder
from ..serving.generation import GenerationEvent, RequestHandle
from ..serving.engine import Closable
from ..serving.engines import engine_spec
from ..settings import LOCAL, LlmSettings, parse_endpoints
from ..shvs.hot_vocab import load_profile
from ..serving.text import TextCodec
from .generate_io import DecodedRequest, decode_generate, encode_event, merge_events
from .hot_first_sampler import hot_first_sampler
from .sampler_pool import SamplerCall, build_arena, build_pool

log = logging.getLogger(__name__)


class Unavailable(RuntimeError):
    """The server cannot serve the request now (it is shutting down); the
    same request may succeed later or elsewhere (UNAVAILABLE, HTTP 503)."""


#: send(outputs, error, final): one response; outputs None with an error
#: (ValueError: the request was bad, INVALID_ARG; Unavailable: UNAVAILABLE;
#: any other error: generation failed, INTERNAL); outputs and error None:
#: the final flag alone, for a request whose client cancelled or went away.
#: It sends the response, or builds it and returns a Transmit that sends it
#: (raising as send would): the service then sends a step's built responses
#: back to back.
Transmit = Callable[[], None]
Send = Callable[[dict | None, Exception | None, bool], Transmit | None]
#: send_tokens(text_output, output_ids): a stream's response of one token
#: that does not end it, built (a Transmit returned) or sent: text_output an
#: object array [1, 1] holding a str, output_ids int32 [1, 1], both ready
#: for Triton (views of the step's arrays). The llm model builds the response
#: from them directly; without one, they go through ``Send`` as outputs.
SendTokens = Callable[[np.ndarray, np.ndarray], Transmit | None]
CANCEL_POLL_S = 0.1
#: The most requests asked whether they were cancelled per poll.
CANCEL_CHECKS_PER_POLL = 16
#: How long a drain waits for aborted sequences to leave a step in progress.
RELEASE_WAIT_S = 5.0
#: How long close() waits for the decode loop to stop (well within Triton's
#: exit timeout for every model's unload, launch/server.py).
CLOSE_TIMEOUT_S = 4.0


#: A directory: the decode-loop thread runs under cProfile and writes
#: llm-<pid>.prof there when the service starts draining (SIGTERM, what the
#: server's stop sends first) or closes (`bench serve-cost --profile`).
PROFILE_ENV = "SIMPLE_SAMPLER_PROFILE_DIR"


class LoopProfile:
    """cProfile of the decode-loop thread, timed in the thread's CPU time,
    not wall time: what the stub spends, not how long a send waited for the
    server. Written by the loop thread itself (a profiler is per thread) at
    the drain's start: Triton's stop may time out unloading the model
    before ``close`` runs, and the profile must not be lost with it."""

    def __init__(self, path: str):
        import cProfile

        self.path = path
        self.profile = cProfile.Profile(time.thread_time)
        self.written = False

    def run(self, loop: asyncio.AbstractEventLoop) -> None:
        self.profile.enable()
        try:
            loop.run_forever()
        finally:
            self.write()

    def write(self) -> None:
        """On the loop thread; once."""
        if not self.written:
            self.written = True
            self.profile.dump_stats(self.path)  # disables it first
            log.info("decode-loop profile written to %s", self.path)


def build_engine(settings: LlmSettings):
    """The data plane the settings name (``serving.engines``). Raises
    ValueError for settings out of range (``LlmSettings.validate``)."""
    return engine_spec(settings.validate().engine).build(settings)


def hot_first_vocab(settings: LlmSettings, repository: str | None):
    """The hot set the decode loop hands rows over with (docs/HANDOFF.md), or
    None for full rows: handoff "hot-first", a sampler profile, and only
    local endpoints (a remote server's sampler may hold another hot set).
    repository: the model repository's root (a relative profile is the
    sampler model's file there). Logs a warning, naming why, when hot-first
    was asked for and full rows will cross all the same."""
    if settings.handoff != "hot-first":
        return None
    refused = None
    if not settings.hot_vocab_profile:
        refused = ("the sampler has no hot-vocab profile (serve --hot-vocab PROFILE.npz: the "
                   "shipped one is SmolLM2's, `simple-sampler calibrate` makes one)")
    elif parse_endpoints(settings.sampler_endpoints) != [LOCAL]:
        refused = "a sampler endpoint is remote, and its hot set may not be this one"
    if refused:
        log.warning("handoff hot-first: full rows cross to the sampler instead: %s", refused)
        return None
    path = os.path.join(repository or "", settings.sampler_model, settings.hot_vocab_profile)
    return load_profile(path).hot_vocab()


@dataclass(eq=False)
class _Delivery:
    """A request whose events are being sent. ``delivering`` is False once
    its client cancelled or went away (its events are then dropped until
    the decoder's final one). ``held`` are the events not sent yet: a
    stream's last ones until ``interval`` tokens are due, a non-streamed
    request's all until its end; ``tokens`` the (text, id) of the tokens
    held that came by step (``LlmService._answer_step``), before ``held``."""

    handle: RequestHandle
    decoded: DecodedRequest
    send: Send
    send_tokens: SendTokens
    is_cancelled: Callable[[], bool]
    interval: int
    finished: asyncio.Future
    delivering: bool = True
    held: list[GenerationEvent] = field(default_factory=list)
    tokens: list[tuple[str, int]] = field(default_factory=list)
    held_tokens: int = 0
    #: a response per token: a stream at stream_interval 1 (read per token)
    each_token: bool = field(init=False)

    def __post_init__(self) -> None:
        self.each_token = self.decoded.stream and self.interval == 1

    def stop(self) -> None:
        if self.delivering:
            self.delivering = False
            self.handle.cancel()


def _tokens_as_outputs(send: Send, text: np.ndarray, ids: np.ndarray) -> Transmit | None:
    """``SendTokens`` through a ``Send`` (a caller that gave none): the two
    outputs, without the batch dimension the llm model adds."""
    return send({"text_output": text[0], "output_ids": ids[0]}, None, False)


class LlmService:
    """A Decoder on its own event-loop thread (module docstring)."""

    def __init__(self, settings: LlmSettings, sampler_call: SamplerCall | None = None,
                 engine=None, codec: TextCodec | None = None, repository: str | None = None,
                 on_burst: Callable[[], None] = lambda: None):
        """on_burst: called on the decode loop after each burst of responses
        (the llm model reports its metrics then when they are due)."""
        self.settings = settings
        self.on_burst = on_burst
        self.codec = codec or engine_spec(settings.engine).codec(settings)
        self.engine = engine or build_engine(settings)
        simple = settings.sampling_mode == "simple"
        self.arena = build_arena(settings, self.engine) if simple and sampler_call else None
        sampler = build_pool(settings.sampler_endpoints, sampler_call, settings.sampler_shards,
                             self._count_retry, self.arena,
                             settings.sampler_shard_min_rows) if simple else None
        hot_vocab = hot_first_vocab(settings, repository) if sampler is not None else None
        if hot_vocab is not None:
            sampler = hot_first_sampler(self.engine, sampler, hot_vocab)
            log.info("rows cross to the sampler hot-first: %d hot ids of %d, the rest summarized",
                     hot_vocab.size, hot_vocab.vocab_size)
        self.decoder = Decoder(self.engine, self.codec, settings.sampling_mode, sampler,
                               settings.micro_batches)
        self.decoder.on_step = self._on_step
        self.draining = False
        self.loop = asyncio.new_event_loop()
        profile_dir = os.environ.get(PROFILE_ENV)
        self.profile = LoopProfile(os.path.join(profile_dir, f"llm-{os.getpid()}.prof")) \
            if profile_dir else None
        run = self.loop.run_forever if self.profile is None else functools.partial(
            self.profile.run, self.loop)
        self.thread = threading.Thread(target=run, name="decode-loop", daemon=True)
        self.thread.start()
        self._call(self.decoder.start()).result()
        self.deliveries: dict[_Delivery, None] = {}  # in order, for turns
        #: a step's events and tokens (delivery None: a step's, _on_step's
        #: arguments), answered in one burst once the step's pass is over
        self.outbox: list[tuple[_Delivery | None, GenerationEvent | tuple]] = []
        #: the responses built from them, to send back to back
        self.transmits: list[tuple[_Delivery, Transmit, bool]] = []
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
               on_done: Callable[[], None] = lambda: None,
               on_admitted: Callable[[], None] = lambda: None,
               send_tokens: SendTokens | None = None):
        """Start one request; returns a future done when the request has left
        the decoder (``on_done`` is called then; ``on_admitted``, on the decode
        loop, once the decoder holds it). Bad input is answered with one error
        response. A ``send`` (or ``send_tokens``) that raises (the client went
        away) cancels the request, as ``is_cancelled()`` does."""
        if send_tokens is None:
            send_tokens = functools.partial(_tokens_as_outputs, send)
        return self._call(self._serve(inputs, send, send_tokens, is_cancelled, on_done,
                                      on_admitted))

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
        if self.profile is not None:
            self.profile.write()
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

    async def _serve(self, inputs, send: Send, send_tokens: SendTokens, is_cancelled, on_done,
                     on_admitted) -> None:
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
        on_admitted()
        delivery = _Delivery(handle, decoded, send, send_tokens, is_cancelled,
                             decoded.stream_interval or self.settings.stream_interval,
                             self.loop.create_future())
        self.deliveries[delivery] = None
        try:
            # The decode loop hands each event to _on_event as it makes it,
            # and the tokens that do not end a request to _on_step, a step's
            # at once (a request asking for logprobs: events, which carry
            # them): a step's responses go out in one burst after its pass.
            handle.listen(functools.partial(self._on_event, delivery),
                          None if decoded.request.return_log_probs else delivery)
            await delivery.finished
        finally:
            self.deliveries.pop(delivery, None)
            on_done()

    @staticmethod
    def _refuse(error: Exception, send: Send, on_done) -> None:
        try:
            transmit = send(None, error, True)
            if transmit is not None:
                transmit()
        finally:
            on_done()

    def _on_event(self, delivery: _Delivery, event: GenerationEvent) -> None:
        """On the decode loop, for every event of the request, inside the
        loop's pass over a step's rows: queued, and the step's responses
        sent back to back once the pass is over (``_send_outbox``). Each
        send is a round trip to the server process (the stub waits until
        Triton has taken the response: python_backend's
        ``ResponseSender::Send``); sends spaced out by the pass's own work
        each find Triton's threads asleep and pay their wake-ups, where a
        burst finds them awake. The responses are built first and then
        sent (a ``Send`` may return a ``Transmit``), so that nothing but
        the sends themselves runs between them."""
        if not self.outbox:
            self.loop.call_soon(self._send_outbox)
        self.outbox.append((delivery, event))

    def _on_step(self, handles: list[RequestHandle], texts: list[str | None],
                 tokens: np.ndarray) -> None:
        """``Decoder.on_step``: a step's tokens that end no request, queued
        as ``_on_event`` queues an event."""
        if not self.outbox:
            self.loop.call_soon(self._send_outbox)
        self.outbox.append((None, (handles, texts, tokens)))

    def _send_outbox(self) -> None:
        """The queued responses, in order; their CPU counts as the decode
        loop's own (``DecoderStats.loop_s``), as when they went out inside
        the pass."""
        started = time.thread_time()
        outbox, self.outbox = self.outbox, []
        for delivery, event in outbox:  # what each event makes of its answer; never raises
            if delivery is None:
                try:
                    self._answer_step(*event)
                except Exception:  # ours: the step's requests end, cancelled, not hung
                    log.exception("answering a step's tokens failed: their requests are cancelled")
                    for handle, text in zip(event[0], event[1]):
                        if text is not None:
                            handle.sink.stop()
                continue
            final = event.final  # a property: read once per event
            answered = False
            if delivery.delivering:
                try:
                    self._send_event(delivery, event, final)
                    answered = final
                except Exception:  # noqa: BLE001 - the client has gone
                    self._gone(delivery)
            if final:
                self._end(delivery, answered)
        transmits, self.transmits = self.transmits, []
        for delivery, transmit, final in transmits:
            try:
                transmit()
            except Exception:  # noqa: BLE001 - the client has gone
                self._gone(delivery)
                if final:
                    self._final_flag(delivery)
        self.decoder.stats.loop_s += time.thread_time() - started
        self.on_burst()

    def _answer_step(self, handles: list[RequestHandle], texts: list[str | None],
                     tokens: np.ndarray) -> None:
        """A step's tokens that end no request (row r: ``texts[r]`` not
        None), each request's in one pass: a stream at stream_interval 1
        gets its response built from row r of two arrays made once for the
        step (no event, no outputs dict, no array per token); any other
        holds the token until its ``interval`` is due (a stream) or its end."""
        rows = len(texts)
        text_rows = np.empty((rows, 1, 1), object)
        text_rows[:, 0, 0] = texts
        id_rows = tokens.astype(np.int32).reshape(rows, 1, 1)
        token_list = tokens.tolist()
        transmits = self.transmits
        for row, text in enumerate(texts):
            if text is None:
                continue
            delivery = handles[row].sink
            if not delivery.delivering:
                continue
            if delivery.each_token:
                try:
                    transmit = delivery.send_tokens(text_rows[row], id_rows[row])
                except Exception:  # noqa: BLE001 - the client has gone
                    self._gone(delivery)
                    continue
                if transmit is not None:
                    transmits.append((delivery, transmit, False))
                continue
            delivery.tokens.append((text, token_list[row]))
            delivery.held_tokens += 1
            if delivery.decoded.stream and delivery.held_tokens >= delivery.interval:
                try:
                    self._flush(delivery, final=False)
                except Exception:  # noqa: BLE001 - the client has gone
                    self._gone(delivery)

    @staticmethod
    def _gone(delivery: _Delivery) -> None:
        """In the handler of a response that could not be built or sent:
        nobody to answer, so stop generating for them."""
        log.debug("sending a response failed: the request is cancelled", exc_info=True)
        delivery.stop()

    def _send(self, delivery: _Delivery, outputs: dict | None, error: Exception | None,
              final: bool) -> None:
        """One response of `delivery`: sent, or built and queued to be sent."""
        transmit = delivery.send(outputs, error, final)
        if transmit is not None:
            self.transmits.append((delivery, transmit, final))

    @staticmethod
    def _final_flag(delivery: _Delivery) -> None:
        """A cancelled request still ends with the final flag: until it
        does, Triton holds the request, and the model cannot unload
        (serve's stop after a load whose clients left timed out on it)."""
        try:
            transmit = delivery.send(None, None, True)
            if transmit is not None:
                transmit()
        except Exception:  # noqa: BLE001 - Triton may refuse a gone request's response
            log.debug("the final flag of a cancelled request was refused", exc_info=True)

    def _end(self, delivery: _Delivery, answered: bool) -> None:
        """After the request's final event: the final flag unless its final
        response was sent (``answered``), and the request leaves."""
        if not answered:
            self._final_flag(delivery)
        # Never ask Triton about a request after its final response: its
        # response factory is gone (Triton 2.51 crashes in
        # TRITONBACKEND_ResponseFactoryIsCancelled), and _serve's wake-up
        # may come after the next cancellation pass.
        delivery.delivering = False
        self.deliveries.pop(delivery, None)
        if not delivery.finished.done():
            delivery.finished.set_result(None)

    async def _watch_cancellations(self) -> None:
        """Every CANCEL_POLL_S, ask Triton whether requests still being
        delivered were cancelled by their clients, and cancel those. Asking
        costs a round trip to the server process (both processes' CPU), so
        at most CANCEL_CHECKS_PER_POLL requests are asked per pass, in turn:
        with many requests in flight each is asked less often, but the cost
        per second stays bounded. Not asked per token either: a timeout
        around each event would cost a task and a timer per token."""
        turn = 0
        while True:
            await asyncio.sleep(CANCEL_POLL_S)
            live = [d for d in self.deliveries if d.delivering]
            if len(live) > CANCEL_CHECKS_PER_POLL:
                turn %= len(live)
                live = (live[turn:] + live[:turn])[:CANCEL_CHECKS_PER_POLL]
                turn += CANCEL_CHECKS_PER_POLL
            for delivery in live:
                try:
                    cancelled = delivery.is_cancelled()
                except Exception:  # noqa: BLE001 - the request is gone on Triton's side
                    log.debug("is_cancelled failed: the request is treated as cancelled",
                              exc_info=True)
                    cancelled = True
                if cancelled:
                    delivery.stop()

    def _send_event(self, delivery: _Delivery, event: GenerationEvent, final: bool) -> None:
        """One response per `interval` tokens of a stream (and always the
        last), or one at the end; an error ends the request at once.
        ``final``: ``event.final``."""
        decoded = delivery.decoded
        if event.error:
            if decoded.stream and delivery.held_tokens:  # the tokens made before it
                self._flush(delivery, final=False)
            self._send(delivery, None,
                       (Unavailable if event.retryable else RuntimeError)(event.error), True)
            return
        if decoded.stream and delivery.interval == 1:
            self._send(delivery, encode_event(event, full=final,
                                              logprobs=decoded.request.return_log_probs),
                       None, final)
            return
        delivery.held.append(event)
        delivery.held_tokens += len(event.token_ids)
        if final or (decoded.stream and delivery.held_tokens >= delivery.interval):
            self._flush(delivery, final)

    def _flush(self, delivery: _Delivery, final: bool) -> None:
        """Send the held events as one response."""
        decoded = delivery.decoded
        prefix = "" if decoded.stream or decoded.exclude_input_in_output or not final else \
            self.codec.decode(self._prompt_ids(decoded))
        events = delivery.held
        if delivery.tokens:  # the tokens that came by step come first, as one event
            texts, ids = zip(*delivery.tokens)
            events.insert(0, GenerationEvent(delivery.handle.request_id, "".join(texts),
                                             list(ids), [], 0, 0, float("nan")))
            delivery.tokens = []
        event = merge_events(events) if len(events) > 1 else events[0]
        delivery.held, delivery.held_tokens = [], 0
        self._send(delivery, encode_event(event, prefix, full=final or not decoded.stream,
                                          logprobs=decoded.request.return_log_probs),
                   None, final)

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
        # No sampler request may still wait when finalize returns: the stub
        # stops reading the server's answers right after it (python_backend
        # pb_stub.cc), so a BLS call then in flight waits forever, and its
        # thread (the loop's executor's, not a daemon) keeps the stub from
        # exiting: Triton never finishes unloading llm and exits with status
        # 1 at its exit timeout. Seen once under load: the stub lived on
        # after its finalize, a shard's retry of "Server not ready" (Triton
        # stopping) due about 40 ms before the unload.
        try:
            self._call(self.loop.shutdown_default_executor()).result(CLOSE_TIMEOUT_S)
        except TimeoutError:
            log.error("a sampler request was still in flight %.1f s after the decode loop "
                      "stopped: this process may not exit", CLOSE_TIMEOUT_S)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(CLOSE_TIMEOUT_S)
        log.info("decode loop closed in %.1f s", time.monotonic() - started)
        if isinstance(self.engine, Closable):  # TrtLlmEngine's workers and bridge
            self.engine.close()
        if self.arena is not None:
            self.arena.close()

