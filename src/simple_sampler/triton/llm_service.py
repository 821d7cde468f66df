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
import contextlib
import dataclasses
import functools
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Callable, Mapping

import numpy as np

from ..schema import SHUTTING_DOWN, STOP_SIGNAL, InvalidRequest
from ..serving.decoder import Decoder
from ..serving.engine import Closable
from ..serving.engines import engine_spec
from ..serving.generation import GenerationEvent
from ..addresses import LOCAL, parse_endpoints
from ..settings import LlmSettings
from ..shvs.hot_vocab import fingerprint, load_profile
from ..serving.text import TextCodec
from .generate_io import DecodedRequest, decode_generate
from .trtllm_text import add_embedding_bias, add_word_bias
from .prompt_batch import (Generation, check_answered_once, for_each_prompt, generations, of_prompt,
                           split_prompts)
from .vllm_params import as_sent
from .llm_delivery import (Deliveries, Delivery, Send, SendTokens, SharedSends, Unavailable,
                           tokens_as_outputs)
from .hot_first_sampler import hot_first_sampler
from .sampler_setup import build_arena, build_pool
from .sampler_targets import SamplerCall

log = logging.getLogger(__name__)


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


def stop_signal(inputs: Mapping[str, object]) -> bool:
    """Whether a request is TensorRT-LLM's stop signal (its ``stop_signal``
    input true, for every prompt). Raises InvalidRequest for a request of
    several prompts whose rows disagree."""
    stop = inputs.get(STOP_SIGNAL.name)
    if stop is None:
        return False
    rows = np.asarray(stop).reshape(-1).astype(bool)
    if rows.any() and not rows.all():
        raise InvalidRequest(f"{STOP_SIGNAL.name} must be the same for every prompt of a "
                             f"request: a stop signal stops requests by their request id")
    return bool(rows.all())


def build_engine(settings: LlmSettings):
    """The data plane the settings name (``serving.engines``). Raises
    ValueError for settings out of range (``LlmSettings.validate``)."""
    return engine_spec(settings.validate().engine).build(settings)


def hot_first_vocab(settings: LlmSettings, repository: str | None):
    """The hot set the decode loop hands rows over with (docs/HANDOFF.md), or
    None for full rows: handoff "hot-first" and a sampler profile (remote
    endpoints are held to the same hot set: ``remote_hot_set``).
    repository: the model repository's root (a relative profile is the
    sampler model's file there). Logs a warning, naming why, when hot-first
    was asked for and full rows will cross all the same."""
    if settings.handoff != "hot-first":
        return None
    refused = settings.hot_first_unavailable()
    if refused:
        log.warning("handoff hot-first: full rows cross to the sampler instead: %s", refused)
        return None
    path = os.path.join(repository or "", settings.sampler_model, settings.hot_vocab_profile)
    return load_profile(path).hot_vocab()


def remote_hot_set(settings: LlmSettings, repository: str | None) -> int | None:
    """The fingerprint of the hot set sampler servers other than this one
    must hold (``RemoteSampler``): the sampler profile of these settings (0:
    none), as the local instances hold it; None, unchecked, without remote
    endpoints or when the profile cannot be read here (logged)."""
    if parse_endpoints(settings.sampler_endpoints) == [LOCAL]:
        return None
    if not settings.hot_vocab_profile:
        return fingerprint(None)
    path = os.path.join(repository or "", settings.sampler_model, settings.hot_vocab_profile)
    try:
        return fingerprint(load_profile(path).hot_vocab())
    except (OSError, ValueError) as error:
        log.warning("sampler endpoints: the hot set they must share is not checked: %s", error)
        return None


class LlmService:
    """A Decoder on its own event-loop thread (module docstring)."""

    def __init__(self, settings: LlmSettings, sampler_call: SamplerCall | None = None,
                 engine=None, codec: TextCodec | None = None, repository: str | None = None,
                 on_burst: Callable[[], None] = lambda: None,
                 on_finished: Callable[[GenerationEvent], None] = lambda event: None):
        """on_burst: called on the decode loop after each burst of responses
        (the llm model reports its metrics then when they are due);
        on_finished: there too, with each generation's final event."""
        self.settings = settings
        self.codec = codec or engine_spec(settings.engine).codec(settings)
        # a service that fails to start undoes what it built (the arena's
        # regions, the pool's and the send threads, the loop), as close does
        with contextlib.ExitStack() as undo:
            self.engine = engine or build_engine(settings)
            if isinstance(self.engine, Closable):
                undo.callback(self.engine.close)
            simple = settings.sampling_mode == "simple"
            self.arena = build_arena(settings, self.engine) if simple and sampler_call else None
            if self.arena is not None:
                undo.callback(self.arena.close)
            self.pool = sampler = build_pool(
                settings.sampler_endpoints, sampler_call, settings.sampler_shards, self._count_retry,
                self.arena, settings.sampler_shard_min_rows, settings.micro_batches,
                remote_hot_set(settings, repository), self.engine.vocab_size) if simple else None
            if self.pool is not None:
                undo.callback(self.pool.close)
            hot_vocab = hot_first_vocab(settings, repository) if sampler is not None else None
            if hot_vocab is not None:
                sampler = hot_first_sampler(self.engine, sampler, hot_vocab)
                log.info("rows cross to the sampler hot-first: %d hot ids of %d, the rest summarized",
                         hot_vocab.size, hot_vocab.vocab_size)
            self.decoder = Decoder(self.engine, self.codec, settings.sampling_mode, sampler,
                                   settings.micro_batches, launch_ahead=settings.launch_ahead,
                                   logprobs_mode=settings.logprobs_mode)
            self.draining = False
            #: the requests in flight by their client's request id, for a stop signal
            self.by_request_id: dict[str, set[Delivery]] = {}
            self.loop = asyncio.new_event_loop()
            profile_dir = os.environ.get(PROFILE_ENV)
            self.profile = LoopProfile(os.path.join(profile_dir, f"llm-{os.getpid()}.prof")) \
                if profile_dir else None
            run = self.loop.run_forever if self.profile is None else functools.partial(
                self.profile.run, self.loop)
            self.thread = threading.Thread(target=run, name="decode-loop", daemon=True)
            self.thread.start()
            undo.callback(self.thread.join, CLOSE_TIMEOUT_S)
            undo.callback(self.loop.call_soon_threadsafe, self.loop.stop)
            self.deliveries = Deliveries(self.loop, self.codec, self.decoder.stats, on_burst,
                                         answers_once=not settings.decoupled_mode,
                                         on_finished=on_finished, send_threads=settings.send_threads)
            undo.callback(self.deliveries.close, wait=False)
            self.decoder.on_step = self.deliveries.on_step
            self._call(self.decoder.start()).result()
            self.cancel_watch = self._call(self.deliveries.watch_cancellations())
            undo.pop_all()  # started: close() undoes it from here on

    @property
    def data_plane(self) -> str:
        """What computes the logits, for the ready line (the simulated
        engine's label says it is simulated)."""
        return self.engine.label

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def submit(self, inputs: Mapping[str, object], send: Send,
               is_cancelled: Callable[[], bool] = lambda: False,
               on_done: Callable[[], None] = lambda: None,
               on_admitted: Callable[[], None] = lambda: None,
               send_tokens: SendTokens | None = None, parameters: str | None = None,
               request_id: str = ""):
        """Start one request; returns a future done when the request has left
        the decoder (``on_done`` is called then; ``on_admitted``, on the decode
        loop, once the decoder holds it). Bad input (and request `parameters`
        that name no vLLM sampling parameter, ``vllm_params``) is answered with
        one error response. A ``send`` (or ``send_tokens``) that raises (the client went
        away) cancels the request, as ``is_cancelled()`` does. `request_id`:
        the client's (Triton's request id), by which a request with the
        ``stop_signal`` input true stops it (``_stop``)."""
        if send_tokens is None:
            send_tokens = functools.partial(tokens_as_outputs, send)
        return self._call(self._serve(inputs, send, send_tokens, is_cancelled, on_done,
                                      on_admitted, parameters, request_id))

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
                     on_admitted, parameters, request_id: str) -> None:
        try:
            if stop_signal(inputs):
                self._stop(request_id, send, on_done)
                return
            if self.draining:
                raise Unavailable(f"{SHUTTING_DOWN} and admits no new request")
            runs = generations(for_each_prompt(
                split_prompts(inputs), functools.partial(self._decode, parameters=parameters)))
            if not self.settings.decoupled_mode:
                check_answered_once(runs)
            # grammars compiled off the event loop, which every lane shares
            for guide in {run.decoded.request.guide for run in runs} - {None}:
                await asyncio.to_thread(self.decoder.grammars.precompile, guide)
            handles = self._submit_all(runs)
        except (InvalidRequest, Unavailable) as error:
            log.debug("request refused: %s", error)
            self._refuse(error, send, on_done)
            return
        except Exception as error:  # ours, not the client's: the request still gets its answer
            log.exception("request failed before it reached the decoder")
            self._refuse(RuntimeError(f"{type(error).__name__}: {error}"), send, on_done)
            return
        on_admitted()
        if len(runs) > 1:  # each one's responses named by its indices, through send
            shared = SharedSends(send, [run.outputs for run in runs])
            sends = [shared.of(index) for index in range(len(runs))]
            sends_tokens = [functools.partial(tokens_as_outputs, one) for one in sends]
        else:
            sends, sends_tokens = [send], [send_tokens]
        deliveries = [Delivery(handle, run.decoded, one, tokens, is_cancelled,
                               run.decoded.stream_interval or self.settings.stream_interval,
                               self.loop.create_future())
                      for handle, run, one, tokens in zip(handles, runs, sends, sends_tokens)]
        named = self.by_request_id.setdefault(request_id, set()) if request_id else set()
        named.update(deliveries)
        try:
            for delivery in deliveries:
                self.deliveries.live[delivery] = None
                decoded = delivery.decoded
                # The decode loop hands each event to on_event as it makes it,
                # and the tokens that do not end a request to on_step, a step's
                # due at once, a stream's `interval` at a time and a whole
                # answer's with its final event (a request asking for logprobs
                # or the vLLM backend's additional outputs, or answered in
                # TensorRT-LLM's tensorrt_llm model's outputs: events, which
                # carry them): a step's responses go out in one burst after its pass.
                delivery.handle.listen(
                    functools.partial(self.deliveries.on_event, delivery),
                    None if decoded.request.return_log_probs or decoded.extra_outputs
                    or decoded.core else delivery, delivery.interval if decoded.stream else 0)
            await asyncio.gather(*(delivery.finished for delivery in deliveries))
        finally:
            for delivery in deliveries:
                self.deliveries.live.pop(delivery, None)
            named.difference_update(deliveries)
            if request_id and not named and self.by_request_id.get(request_id) is named:
                del self.by_request_id[request_id]
            on_done()

    def _stop(self, request_id: str, send: Send, on_done) -> None:
        """TensorRT-LLM's stop signal (its tensorrt_llm model's
        handle_stop_request): every request in flight with this request id
        ends at its next step, answered as cancelled with what it has
        generated (its client reads that answer), and the signal gets one
        response without outputs (its client counts it: "Got cancellation
        response from server"), whether or not one was found."""
        if not request_id:
            self._refuse(InvalidRequest("a stop signal needs a request id (the client's "
                                        "request_id): it stops the requests in flight with "
                                        "that id"),
                         send, on_done)
            return
        stopped = self.by_request_id.get(request_id, set())
        for delivery in stopped:
            delivery.handle.cancel()
        log.debug("stop signal for request id %r: %d generations stopped", request_id,
                  len(stopped))
        self._answer_once(send, {}, None, on_done)

    def _decode(self, inputs, parameters) -> DecodedRequest:
        """One prompt's inputs decoded, TensorRT-LLM's embedding bias (its words
        tokenized, or its dense vector) added to the logit bias."""
        decoded = decode_generate(inputs, parameters, self.settings.exclude_input_in_output)
        request = decoded.request
        if decoded.word_bias:
            request = add_word_bias(request, decoded.word_bias, self.codec.tokenize)
        if decoded.embedding_bias is not None:
            request = add_embedding_bias(request, decoded.embedding_bias, self.engine.vocab_size)
        return dataclasses.replace(decoded, request=request)

    def _submit_all(self, runs: list[Generation]) -> list:
        """The generations' requests in the decoder, all or none: each is
        prepared (validated) before any is admitted, so a refused one (a
        range: named as the client sent it, and by its prompt's batch_index)
        leaves nothing behind."""
        sequences = []
        for run in runs:
            try:
                sequences.append(self.decoder.prepare(run.decoded.request))
            except InvalidRequest as error:
                raise of_prompt(as_sent(error, run.decoded.sent_as), run.prompt,
                                runs[-1].prompt + 1) from None
        handles = []
        try:
            for sequence in sequences:
                handles.append(self.decoder.admit(sequence))
        except Exception:  # ours (admit refuses nothing): none of the request goes on
            for handle in handles:
                handle.cancel()
            raise
        return handles

    @classmethod
    def _refuse(cls, error: Exception, send: Send, on_done) -> None:
        cls._answer_once(send, None, error, on_done)

    @staticmethod
    def _answer_once(send: Send, outputs: dict | None, error: Exception | None,
                     on_done) -> None:
        """A request's one response, with the final flag, then ``on_done``."""
        try:
            transmit = send(outputs, error, True)
            if transmit is not None:
                transmit()
        except Exception:  # noqa: BLE001 - its client has gone
            log.debug("a request's one response was refused", exc_info=True)
        finally:
            on_done()

    def stats(self):
        return self.decoder.stats

    @property
    def bridge_s(self) -> float:
        """The data plane's bridge time (``Engine.bridge_s``)."""
        return self.engine.bridge_s

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
        # the loop returns from a burst once its sends are out: none is in
        # flight on the send threads unless the loop itself is still stuck in one
        self.deliveries.close(wait=not self.thread.is_alive())
        if self.pool is not None:
            self.pool.close()
        log.info("decode loop closed in %.1f s", time.monotonic() - started)
        # TrtLlmEngine's workers and bridge; the torch engines' hold on the
        # arena's ring (page-locked on a GPU), released before the ring is
        if isinstance(self.engine, Closable):
            self.engine.close()
        if self.arena is not None:
            self.arena.close()

