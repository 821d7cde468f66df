"""The llm model's responses: each request's events turned into Triton
responses and sent (``Deliveries``), a step's back to back; the requests
their clients cancelled, found by polling (``Deliveries.watch_cancellations``).
The service that admits the requests: ``llm_service.LlmService``."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..serving.decoder_stats import DecoderStats
from ..serving.generation import GenerationEvent, RequestHandle
from ..serving.text import TextCodec
from .generate_io import DecodedRequest
from .generate_outputs import encode_event, merge_events
from .send_lanes import SendLanes
from .trtllm_core import core_outputs

log = logging.getLogger(__name__)


class Unavailable(RuntimeError):
    """The server cannot serve the request now (it is shutting down); the
    same request may succeed later or elsewhere (UNAVAILABLE, HTTP 503)."""


class Cancelled(RuntimeError):
    """The request's client cancelled it or went away (CANCELLED): the one
    response of a request to a model that is not decoupled, which may not
    end a request with the final flag alone."""


#: send(outputs, error, final): one response; outputs None with an error
#: (schema.InvalidRequest: the request was bad, INVALID_ARG; Unavailable: UNAVAILABLE;
#: Cancelled: CANCELLED; any other error: generation failed, INTERNAL); outputs and
#: error None: the final flag alone, for a request whose client cancelled or went away.
#: It sends the response, or builds it and returns a Transmit that sends it
#: (raising as send would): the service then sends a step's built responses
#: back to back.
Transmit = Callable[[], None]
Send = Callable[[dict | None, Exception | None, bool], Transmit | None]
#: send_tokens(text_output, output_ids): a stream's response of tokens
#: that do not end it, built (a Transmit returned) or sent: text_output an
#: object array [1, 1] holding a str, output_ids int32 [1, n], both ready
#: for Triton (views of arrays made once for the step). The llm model builds the response
#: from them directly; without one, they go through ``Send`` as outputs.
SendTokens = Callable[[np.ndarray, np.ndarray], Transmit | None]
CANCEL_POLL_S = 0.1
#: The most requests asked whether they were cancelled per poll.
CANCEL_CHECKS_PER_POLL = 16


@dataclass(eq=False)
class Delivery:
    """A request whose events are being sent. ``delivering`` is False once
    its client cancelled or went away (its events are then dropped until
    the decoder's final one). ``held`` are the events not sent yet: a
    stream's last ones until ``interval`` tokens are due, a non-streamed
    request's all until its end (a request whose tokens come by step,
    ``Deliveries._answer_step``, has them held by the decoder instead,
    ``interval`` at a time, the rest with its final event)."""

    handle: RequestHandle
    decoded: DecodedRequest
    send: Send
    send_tokens: SendTokens
    is_cancelled: Callable[[], bool]
    interval: int
    finished: asyncio.Future
    delivering: bool = True
    held: list[GenerationEvent] = field(default_factory=list)
    held_tokens: int = 0
    #: a response carrying tokens went out (a stream's first token is never held)
    opened: bool = False

    @property
    def request(self) -> int:
        """Its Triton request's key: a request's generations share its
        is_cancelled (``LlmService._serve``), as they share its sender."""
        return id(self.is_cancelled)

    def stop(self) -> None:
        if self.delivering:
            self.delivering = False
            self.handle.cancel()


class SharedSends:
    """One Triton request's generations (``prompt_batch.generations``: its
    prompts, or a prompt's sequences), each run on its own, answered
    through the request's one ``Send``, as TensorRT-LLM's tensorrt_llm
    model answers a batch (its ``convert_response`` and ``execute``): every
    response of a generation carries the outputs that name it (``names``:
    batch_index, sequence_index), and the request's final flag comes with
    the last generation to end; the others' last responses go without it."""

    def __init__(self, send: Send, names: list[dict[str, np.ndarray]]):
        self.send, self.names = send, names
        self.ended: set[int] = set()
        self.final_by: int | None = None  # the generation whose response carries the final flag

    def of(self, index: int) -> Send:
        """The ``Send`` of generation ``index``."""
        names = self.names[index]
        # an error response carries no outputs: its message names the generation
        named = ", ".join(f"{name} {int(value[0])}" for name, value in names.items())

        def send(outputs: dict | None, error: Exception | None, final: bool) -> Transmit | None:
            if final:
                # A generation's final flag comes again, alone, after its final
                # response failed to go: the request's is sent again only by
                # the generation that carried it (the single generation's rule).
                self.ended.add(index)
                if self.final_by is None and len(self.ended) == len(self.names):
                    self.final_by = index
                final = self.final_by == index
                if outputs is None and error is None and not final:
                    return None  # the final flag alone, of a generation not the last
            if outputs is not None:
                outputs = {**outputs, **names}
            elif error is not None:
                error = type(error)(f"{named}: {error}")
            return self.send(outputs, error, final)
        return send


def tokens_as_outputs(send: Send, text: np.ndarray, ids: np.ndarray) -> Transmit | None:
    """``SendTokens`` through a ``Send`` (a caller that gave none): the two
    outputs, without the batch dimension the llm model adds."""
    return send({"text_output": text[0], "output_ids": ids[0]}, None, False)


class Deliveries:
    """The requests being delivered, and their responses, on the decode
    loop's event loop: events (``on_event``) and a step's tokens
    (``on_step``) are queued during the loop's pass over a step and sent
    in one burst after it. ``stats``: the decoder's (the sends' CPU counts
    as the loop's own); ``on_burst``: called after each burst;
    ``on_finished``: with each generation's final event, once it is
    answered. ``answers_once``: the model is not decoupled (decoupled_mode
    false), so a cancelled request ends with a Cancelled error, its one
    response. ``send_threads``: the threads a burst's sends go out on
    (``send_lanes.SendLanes``; 1: the loop's alone); ``close`` stops them."""

    def __init__(self, loop: asyncio.AbstractEventLoop, codec: TextCodec, stats: DecoderStats,
                 on_burst: Callable[[], None], *, send_threads: int, answers_once: bool = False,
                 on_finished: Callable[[GenerationEvent], None] = lambda event: None):
        self.loop, self.codec, self.stats, self.on_burst = loop, codec, stats, on_burst
        self.senders = SendLanes(send_threads, lambda delivery: delivery.request)
        self.answers_once, self.on_finished = answers_once, on_finished
        self.live: dict[Delivery, None] = {}  # in order, for turns
        #: a step's events and tokens (delivery None: a step's, on_step's
        #: arguments), answered in one burst once the step's pass is over
        self.outbox: list[tuple[Delivery | None, GenerationEvent | tuple]] = []
        #: the responses built from them, to send back to back
        self.transmits: list[tuple[Delivery, Transmit, bool]] = []

    def on_event(self, delivery: Delivery, event: GenerationEvent) -> None:
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

    def on_step(self, handles: list[RequestHandle], texts: list[str],
                ids: list[np.ndarray]) -> None:
        """``Decoder.on_step``: a step's tokens that end no request, queued
        as ``on_event`` queues an event."""
        if not self.outbox:
            self.loop.call_soon(self._send_outbox)
        self.outbox.append((None, (handles, texts, ids)))

    def _send_outbox(self) -> None:
        """The queued responses, in order; their CPU counts as the decode
        loop's own (``DecoderStats.loop_s``), as when they went out inside
        the pass."""
        started = time.thread_time()
        outbox, self.outbox = self.outbox, []
        finished = []  # the generations' final events, reported once their responses are out
        for delivery, event in outbox:  # what each event makes of its answer; never raises
            if delivery is None:
                try:
                    self._answer_step(*event)
                except Exception:  # ours: the step's requests end, cancelled, not hung
                    log.exception("answering a step's tokens failed: their requests are cancelled")
                    for handle in event[0]:
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
                finished.append(event)
        transmits, self.transmits = self.transmits, []
        failed, senders_cpu_s = self.senders.send(transmits)
        for delivery, final in failed:  # the client has gone
            self._gone(delivery)
            if final:
                self._final_flag(delivery)
        for event in finished:
            try:
                self.on_finished(event)
            except Exception:  # ours, a metric's: the requests are answered all the same
                log.exception("reporting a finished generation failed")
        self.stats.loop_s += time.thread_time() - started + senders_cpu_s
        self.on_burst()

    def _answer_step(self, handles: list[RequestHandle], texts: list[str],
                     ids: list[np.ndarray]) -> None:
        """A step's tokens that end no request, the ones due of each
        request (``Decoder.on_step``): each request's response built from
        its text, in a row of one array made for the step, and its ids (no
        event, no outputs dict)."""
        text_rows = np.empty((len(texts), 1, 1), object)
        text_rows[:, 0, 0] = texts
        transmits = self.transmits
        for handle, text, id_row in zip(handles, text_rows, ids):
            delivery = handle.sink
            if not delivery.delivering:
                continue
            try:
                transmit = delivery.send_tokens(text, id_row)
            except Exception:  # noqa: BLE001 - the client has gone
                self._gone(delivery)
                continue
            if transmit is not None:
                transmits.append((delivery, transmit, False))

    def close(self, wait: bool = True) -> None:
        self.senders.close(wait)

    @staticmethod
    def _gone(delivery: Delivery) -> None:
        """In the handler of a response that could not be built or sent:
        nobody to answer, so stop generating for them."""
        log.debug("sending a response failed: the request is cancelled", exc_info=True)
        delivery.stop()

    def _send(self, delivery: Delivery, outputs: dict | None, error: Exception | None,
              final: bool) -> None:
        """One response of `delivery`: sent, or built and queued to be sent."""
        transmit = delivery.send(outputs, error, final)
        if transmit is not None:
            self.transmits.append((delivery, transmit, final))

    def _final_flag(self, delivery: Delivery) -> None:
        """A cancelled request still ends with the final flag: until it
        does, Triton holds the request, and the model cannot unload
        (serve's stop after a load whose clients left timed out on it).
        A model that is not decoupled may not send the flag alone before
        any response (python_backend's ``ResponseSender``): there it comes
        with a Cancelled error, the request's one response."""
        try:
            transmit = delivery.send(None, Cancelled("the request was cancelled") if
                                     self.answers_once else None, True)
            if transmit is not None:
                transmit()
        except Exception:  # noqa: BLE001 - Triton may refuse a gone request's response
            log.debug("the final flag of a cancelled request was refused", exc_info=True)

    def _end(self, delivery: Delivery, answered: bool) -> None:
        """After the request's final event: the final flag unless its final
        response was sent (``answered``), and the request leaves."""
        if not answered:
            self._final_flag(delivery)
        # Never ask Triton about a request after its final response: its
        # response factory is gone (Triton 2.51 crashes in
        # TRITONBACKEND_ResponseFactoryIsCancelled), and _serve's wake-up
        # may come after the next cancellation pass.
        delivery.delivering = False
        self.live.pop(delivery, None)
        if not delivery.finished.done():
            delivery.finished.set_result(None)

    async def watch_cancellations(self) -> None:
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
            # a request's generations (``SharedSends``) share one question, its
            # one is_cancelled
            requests: dict[int, tuple[Callable[[], bool], list[Delivery]]] = {}
            for delivery in self.live:
                if delivery.delivering:
                    requests.setdefault(delivery.request,
                                        (delivery.is_cancelled, []))[1].append(delivery)
            asked = list(requests.values())
            if len(asked) > CANCEL_CHECKS_PER_POLL:
                turn %= len(asked)
                asked = (asked[turn:] + asked[:turn])[:CANCEL_CHECKS_PER_POLL]
                turn += CANCEL_CHECKS_PER_POLL
            for is_cancelled, deliveries in asked:
                try:
                    cancelled = is_cancelled()
                except Exception:  # noqa: BLE001 - the request is gone on Triton's side
                    log.debug("is_cancelled failed: the request is treated as cancelled",
                              exc_info=True)
                    cancelled = True
                if cancelled:
                    for delivery in deliveries:
                        delivery.stop()

    def _send_event(self, delivery: Delivery, event: GenerationEvent, final: bool) -> None:
        """A stream's first token at once, then one response per `interval`
        tokens (and always the last), as vLLM's, SGLang's and TensorRT-LLM's
        streams; or one at the end; an error ends the request at once.
        ``final``: ``event.final``."""
        decoded = delivery.decoded
        if event.error:
            if decoded.stream and event.token_ids:  # the tokens the decoder held for it
                delivery.held.append(dataclasses.replace(event, error=None))
                delivery.held_tokens += len(event.token_ids)
            if decoded.stream and delivery.held_tokens:  # the tokens made before it
                self._flush(delivery, final=False)
            self._send(delivery, None,
                       (Unavailable if event.retryable else RuntimeError)(event.error), True)
            return
        if decoded.stream and delivery.interval == 1:
            self._send(delivery, self._encode(decoded, event, final), None, final)
            return
        delivery.held.append(event)
        delivery.held_tokens += len(event.token_ids)
        # a stream's prompt scores go at once, before any token, and its first token
        if final or (decoded.stream and (delivery.held_tokens >= delivery.interval
                                         or event.prompt_scores is not None
                                         or (delivery.held_tokens and not delivery.opened))):
            self._flush(delivery, final)

    def _flush(self, delivery: Delivery, final: bool) -> None:
        """Send the held events as one response."""
        events = delivery.held
        event = merge_events(events) if len(events) > 1 else events[0]
        delivery.opened = delivery.opened or delivery.held_tokens > 0
        delivery.held, delivery.held_tokens = [], 0
        self._send(delivery, self._encode(delivery.decoded, event, final), None, final)

    def _encode(self, decoded: DecodedRequest, event: GenerationEvent,
                final: bool) -> dict[str, np.ndarray]:
        """One response's outputs: the generation models' (``encode_event``),
        or TensorRT-LLM's tensorrt_llm model's for a request in its dialect
        (``core_outputs``). A non-streamed answer starts with the prompt
        unless exclude_input_in_output: its text, or its ids there."""
        whole = final and not (decoded.stream or decoded.exclude_input_in_output)
        if decoded.core:
            return core_outputs(event, self._prompt_ids(decoded) if whole else None,
                                decoded.logprobs)
        return encode_event(event, self.codec.decode(self._prompt_ids(decoded)) if whole else "",
                            full=final or not decoded.stream, logprobs=decoded.logprobs,
                            top=decoded.request.num_top_logprobs, extra=decoded.extra_outputs)

    def _prompt_ids(self, decoded) -> list[int]:
        request = decoded.request
        if request.prompt_ids is not None:
            return list(request.prompt_ids)
        return self.codec.encode(request.text, request.chat)
