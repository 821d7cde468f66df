"""TensorRT-LLM as the data plane, with every token chosen by the decision plane.

The stock engine runs unmodified through TensorRT-LLM's Python LLM API. Each
iteration calls one *batched logits processor* with the scheduled requests' rows;
ours hands them to the decode loop, waits for the chosen tokens, then sets every
other logit to -inf so that the engine's own greedy sampler (top_k 1) takes exactly
that token. :class:`TrtLlmEngine` bridges this inverted control to the
:class:`~.engine.Engine` calls:

* ``add`` submits a request (no end id, no stop words, ``max_tokens`` from
  :func:`engine_max_tokens`: the decode loop decides when a sequence ends);
  ``release`` aborts it;
* ``wait_ready(seq_ids)`` says which sequences have a row from the current
  iteration, ``step`` hands those rows out, ``append`` answers them; sequences
  are stepped in lockstep (the next rows come once all of an iteration's are
  answered);
* an error after submission ends that sequence (``step`` raises
  :class:`~.engine.SequenceFailed`), since every result is consumed
  (``_ResultWatcher``);
* the processor's worker reaches this process through a Unix socket and a
  shared-memory block (``serving/trtllm_bridge.py``), reports its time
  (``TrtLlmEngine.bridge_s``), and exits when its owner dies (``OwnerWatch``).

Loading TensorRT-LLM and reading a model's config: ``serving/trtllm_api.py``.

Not verified here (no GPU, no TensorRT-LLM): the calls follow TensorRT-LLM's source
(``tests/trtllm_api.json``) and are tested against ``tests/fake_tensorrt_llm.py``.
Why this route, the processes and ranks, and what is unverified: docs/GPU.md.
"""
from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Hashable, Sequence

import torch

from ..sampling import logits_tensor
from .engine import SequenceFailed, SequenceTable
from .trtllm_api import (TrtLlmApi, engine_limits, load_tensorrt_llm, read_logits_dtype,
                         read_vocab_size)
from .trtllm_bridge import BridgeClosed, BridgedSequence, RowExchange, RowServer, staged_rows

READY_POLL_S = 0.05  # longest wait_ready blocks, so the decode loop sees cancellations
STEP_TIMEOUT_S = 600.0  # a step waiting longer means the engine stopped producing rows


def engine_max_tokens(prompt_length: int, max_context: int, max_tokens: int | None) -> int:
    """The ``SamplingParams.max_tokens`` a request is submitted with.

    TensorRT-LLM counts generated tokens (the first one comes from the context
    phase) and ends a request itself after the ``max_tokens``-th; every one
    follows a call of the batched processor, so the decode loop's N tokens are
    N calls. One more than the request's own ``max_tokens`` keeps that end
    strictly after the decode loop's last token: a request always ends by the
    loop's ``release`` (abort), never by the engine while a caller that
    appended its last token still holds it (which ``_request_done`` would
    report as a failure); where the context leaves no room for the extra
    token the two ends coincide, and the loop's release still comes first:
    it is what answers the last row. The capacity scheduler stays TensorRT-LLM's default,
    ``GUARANTEED_NO_EVICT`` (``llmapi/llm_args.py`` ``SchedulerConfig``): it
    reserves KV-cache blocks for prompt + ``max_tokens`` at admission and
    never pauses a started request, so with the request's own limit instead of
    the whole context it no longer caps concurrency at full-context
    reservations, and no request is evicted and recomputed mid-generation
    (what ``MAX_UTILIZATION`` may do when the cache fills).

    Capped at the context: ``BaseLLM._check_arguments`` (``llmapi/llm.py``,
    TensorRT backend) raises ValueError when prompt + ``max_tokens`` exceeds
    ``max_seq_len``. Without a limit (None), the whole context, as before."""
    room = max_context - prompt_length
    if max_tokens is None:
        return room
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    return min(max_tokens + 1, room)


def _awaits_step(sequence: BridgedSequence) -> bool:
    """Whether the sequence's next token is one the model has not consumed:
    not stepped since its last append (or its prompt)."""
    return sequence.taken is None


class _ResultWatcher:
    """Reads the result of every submitted request, on an event loop of its
    own.

    Why: TensorRT-LLM hands a request's responses, errors included, only to
    whoever reads its result: ``executor/result.py`` ``GenerationResult.
    aresult()`` -> ``_aresult_step`` -> ``_handle_response``, which passes an
    error response to ``executor/executor.py`` ``_handle_background_error``,
    which raises it (``RequestError``) in the reader. A result nobody reads
    keeps its error in a queue. Requests are submitted on this loop because
    ``GenerationResult.__init__`` binds its queue to the event loop running
    where it is created (``has_event_loop()``), and ``aresult`` needs that
    loop. ``done(request, error)`` runs in a worker thread, never on this
    loop, so it may take the engine's lock while ``add`` (holding it) waits
    here for a submission."""

    def __init__(self, done):
        self.done = done
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="trtllm-results",
                                       daemon=True)
        self.thread.start()

    def submit(self, generate):
        """``generate()`` run on this loop; its request is watched from then on."""
        async def submit():
            request = generate()
            self.loop.create_task(self._watch(request))
            return request
        return asyncio.run_coroutine_threadsafe(submit(), self.loop).result()

    async def _watch(self, request) -> None:
        error = None
        try:
            await request.aresult()
        except Exception as failure:  # noqa: BLE001 - any failure ends only this request
            error = f"{type(failure).__name__}: {failure}"
        await self.loop.run_in_executor(None, self.done, request, error)

    def close(self) -> None:
        """Stop watching (the engine is shut down: no result is coming)."""
        if self.loop.is_closed():
            return

        async def cancel():
            for task in asyncio.all_tasks(self.loop) - {asyncio.current_task()}:
                task.cancel()
        asyncio.run_coroutine_threadsafe(cancel(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()


class TrtLlmEngine:
    """The :class:`~.engine.Engine` over TensorRT-LLM (module docstring).

    ``api`` is ``(LLM, SamplingParams)``, by default :func:`load_tensorrt_llm`'s;
    ``model`` a Hugging Face checkpoint or TensorRT-LLM engine directory.
    Thread safety: every call may come from any thread.
    """

    label = "TrtLlmEngine"

    def __init__(self, model: str | os.PathLike, vocab_size: int, max_batch_size: int,
                 max_context: int, tensor_parallel_size: int = 1,
                 pipeline_parallel_size: int = 1, api=None,
                 step_timeout_s: float = STEP_TIMEOUT_S,
                 build_cache_dir: str | os.PathLike | None = None, logits_dtype: str = "fp32"):
        for name, value in (("max_batch_size", max_batch_size), ("vocab_size", vocab_size),
                            ("tensor_parallel_size", tensor_parallel_size),
                            ("pipeline_parallel_size", pipeline_parallel_size)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if max_context < 2:
            raise ValueError(f"max_context must be >= 2, got {max_context}")
        api = TrtLlmApi(*(api or load_tensorrt_llm()))
        self.sampling_params = api.SamplingParams
        self.vocab_size, self.max_batch_size, self.max_context = vocab_size, max_batch_size, max_context
        self.step_timeout_s = step_timeout_s
        limits = engine_limits(api, model, max_batch_size, max_context, build_cache_dir)
        self.exchange = RowExchange()
        self.server = RowServer(self.exchange, max_batch_size, vocab_size, logits_dtype)
        self.sequences: SequenceTable[BridgedSequence] = SequenceTable(vocab_size, max_batch_size,
                                                                         max_context)
        self.watcher = _ResultWatcher(self._request_done)
        try:
            self.llm = api.LLM(model=str(model), tensor_parallel_size=tensor_parallel_size,
                               pipeline_parallel_size=pipeline_parallel_size,
                               batched_logits_processor=self.server.processor(),
                               skip_tokenizer_init=True, **limits)
        except BaseException:
            self.watcher.close()
            self.server.close()
            raise

    @classmethod
    def from_source(cls, model: str | os.PathLike, api=None, **kwargs) -> "TrtLlmEngine":
        """An engine over ``model``, its vocabulary and logits dtype read from
        its config.json (TensorRT-LLM is imported first: its absence is the
        error to report)."""
        api = api or load_tensorrt_llm()
        return cls(model, read_vocab_size(model), api=api,
                   **{"logits_dtype": read_logits_dtype(model) or "fp32", **kwargs})

    @property
    def condition(self) -> threading.Condition:
        return self.exchange.condition

    @property
    def bridge_s(self) -> float:
        """Seconds the bridge itself took, summed over iterations (the
        processor's staging and masking, ``DecisionPlaneProcessor``; this
        side reads the staged rows in place): the
        ``simple_llm_bridge_us_total`` metric."""
        with self.condition:
            return self.exchange.bridge_s

    def add(self, seq_id: Hashable, prompt_ids: Sequence[int],
            max_tokens: int | None = None) -> None:
        """Submit the sequence; ``max_tokens`` is the request's own limit
        (the KV cache is reserved for it, :func:`engine_max_tokens`)."""
        # Held while submitting, so the first row (delivered under the same
        # lock) always finds its sequence: an unknown id means a released one.
        with self.condition:
            sequence = self.sequences.add(seq_id, prompt_ids,
                                          lambda prompt: self._submit(prompt, max_tokens))
            self.exchange.by_client[sequence.client_id] = sequence

    def _submit(self, prompt: list[int], max_tokens: int | None) -> BridgedSequence:
        """Submit a checked prompt to TensorRT-LLM (under ``condition``)."""
        params = self.sampling_params(
            max_tokens=engine_max_tokens(len(prompt), self.max_context, max_tokens),
            top_k=1, ignore_eos=True,
            # An end id is required without a tokenizer; ignore_eos makes the
            # engine use -1 instead, so it never ends a sequence by itself.
            end_id=0, pad_id=0, detokenize=False, apply_batched_logits_processor=True)
        request = self.watcher.submit(lambda: self.llm.generate_async(
            prompt, sampling_params=params, streaming=False))
        # request_id is the client id (executor/result.py GenerationResult.request_id),
        # the one the processor gets as client_ids; req_ids are the engine's own.
        return BridgedSequence(request.request_id, request, len(prompt))

    def wait_ready(self, seq_ids: Sequence[Hashable], timeout: float = READY_POLL_S) -> list:
        """The ids among ``seq_ids`` with a row to step, waiting up to
        ``timeout`` seconds while no active sequence has one."""
        with self.condition:
            # A failed sequence counts as ready: stepping it reports its error.
            self.condition.wait_for(
                lambda: self.exchange.closed or any(s.row or s.error
                                                    for s in self.sequences.values()),
                timeout)
            return [i for i in seq_ids if i in self.sequences
                    and (self.sequences[i].row or self.sequences[i].error)]

    def step(self, seq_ids: Sequence[Hashable]) -> torch.Tensor:
        """The rows of ``seq_ids`` from the engine's iterations, waiting for
        them up to ``step_timeout_s``. Errors as ``TorchEngine.step``."""
        deadline = time.monotonic() + self.step_timeout_s
        with self.condition:
            # At max_context the engine ends the sequence: no row comes.
            self.sequences.for_step(seq_ids, _awaits_step, lambda sequence: sequence.length)
            while True:
                sequences = [self.sequences[seq_id] for seq_id in seq_ids]  # KeyError if released
                failed = {i: s.error for i, s in zip(seq_ids, sequences) if s.error}
                if failed:  # nothing consumed: the others are stepped again
                    raise SequenceFailed(failed)
                if self.exchange.closed:
                    raise BridgeClosed("the TensorRT-LLM engine is shut down")
                if all(s.row for s in sequences):
                    break
                if not self.condition.wait(deadline - time.monotonic()):
                    raise RuntimeError(f"TensorRT-LLM delivered no row within "
                                       f"{self.step_timeout_s} s")
            rows = staged_rows([s.row for s in sequences], self.server.staging)
            for sequence in sequences:
                sequence.taken, sequence.row = sequence.row, None
        return logits_tensor(rows)

    def share_rows(self, arena) -> None:
        """Let `arena` (``row_arena.RowArena``) reference the rows where the
        processor stages them (``RowArena.adopt``): the sampler instances
        then read each row where the device-to-host copy put it."""
        arena.adopt(self.server.region)

    def append(self, seq_ids: Sequence[Hashable], token_ids: Sequence[int]) -> None:
        with self.condition:
            sequences, tokens = self.sequences.for_append(seq_ids, token_ids, _awaits_step)
            for sequence, token in zip(sequences, tokens):
                self.exchange.answer(sequence.taken, token)
                sequence.taken, sequence.last_token = None, token
                sequence.length += 1

    def release(self, seq_id: Hashable) -> None:
        """Abort the request; its undelivered rows are answered with no
        token. Unknown ids are ignored, as in ``TorchEngine``."""
        with self.condition:
            sequence = self.sequences.release(seq_id)
            if sequence is None:
                return
            del self.exchange.by_client[sequence.client_id]
            for place in (sequence.row, sequence.taken):
                if place:
                    self.exchange.answer(place, None)
        sequence.request.abort()

    def length(self, seq_id: Hashable) -> int:
        with self.condition:
            return self.sequences[seq_id].length

    def close(self) -> None:
        """Abort every live request (TensorRT-LLM's shutdown waits for active
        requests, which would otherwise run to their token limit), answer
        what is pending, shut the engine down, free the bridge. Idempotent."""
        with self.condition:
            if self.exchange.closed:
                return
            live = list(self.sequences)
        for seq_id in live:
            self.release(seq_id)
        self.exchange.close()
        try:
            self.llm.shutdown()
        finally:
            self.watcher.close()
            self.server.close()

    def _request_done(self, request, error: str | None) -> None:
        """A request's result came (in the watcher's worker thread). For a
        live sequence that is always a failure: the decode loop ends requests
        itself (release), and the engine has no end id or stop word of its own."""
        with self.condition:
            sequence = self.exchange.by_client.get(request.request_id)
            if sequence is None or sequence.request is not request:
                return  # released: aborted by us
            sequence.error = (f"TensorRT-LLM failed the request: {error}" if error else
                              "TensorRT-LLM ended the request before the decode loop did")
            self.condition.notify_all()
