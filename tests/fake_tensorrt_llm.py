"""A fake of exactly the TensorRT-LLM API surface ``serving/trtllm*.py`` uses.

``tests/trtllm_api.json`` records each name and signature with the source
file it was checked against (NVIDIA/TensorRT-LLM); ``test_trtllm_api.py``
holds this fake to it. What each piece mirrors:

* ``LLM(model, tensor_parallel_size, pipeline_parallel_size,
  batched_logits_processor, skip_tokenizer_init, max_batch_size,
  max_input_len, max_seq_len, max_num_tokens, enable_build_cache)``:
  ``llmapi/llm.py`` ``_TrtLLM.__init__`` (what 1.0's ``_tensorrt_engine.LLM``
  is; later releases moved it to ``_tensorrt_engine/llm.py``; named parameters, the rest
  keyword arguments checked against the fields of ``llmapi/llm_args.py``;
  unknown ones are refused, as by its strict pydantic model). The engine is
  built in the constructor (``llmapi/llm.py`` ``_TrtLLM._build_model``)
  unless the model is a prebuilt engine (config.json with ``build_config``)
  or the build cache has it (``llmapi/build_cache.py`` ``CachedStage``,
  keyed by the build settings and the model path): ``build_s`` models the
  build time. Without ``max_input_len`` the limit is 1024 (``llm_args.py``
  ``BuildConfig`` default).
* ``LLM.generate_async`` refuses (ValueError, in the caller) a prompt whose
  length plus ``max_tokens`` exceeds ``max_seq_len``: ``llmapi/llm.py``
  ``BaseLLM._check_arguments``, TensorRT backend, chunked prefill off.
* The capacity scheduler's default policy, ``GUARANTEED_NO_EVICT``
  (``cpp/tensorrt_llm/batch_manager/capacityScheduler.cpp``
  ``GuaranteedNoEvictScheduler``): with ``kv_cache_tokens`` set, a request
  is scheduled only when the KV cache can hold its prompt plus its
  ``max_tokens`` next to those already scheduled, in arrival order (token
  granularity; the real cache counts blocks).
* ``LLM.generate_async(inputs, sampling_params, streaming)`` returns a
  ``RequestOutput`` (``llmapi/llm.py``, a ``GenerationResult`` of
  ``executor/result.py``) whose
  ``request_id`` is the *client* id (``GenerationResult.request_id``); the
  engine gives the request its own id, different (``executor/worker.py``
  keeps ``_client_id_to_request_id``), and the processor gets both
  (``req_ids``: the engine's, ``client_ids``: ours).
* Per-request errors come *after* submission (a prompt longer than
  ``max_input_len``: ``cpp/tensorrt_llm/batch_manager/llmRequest.cpp``
  ``LlmRequest::validate``; any failure: ``LLM.fail``) as an error response
  in the request's queue; only a reader sees it: ``result()`` / ``aresult()``
  raise it (``GenerationResult._handle_response`` ->
  ``executor/executor.py`` ``_handle_background_error`` raises
  ``RequestError``). Like the real one, ``aresult`` needs the event loop that
  was running when the request was created (``GenerationResultBase.__init__``
  picks an asyncio queue only under ``has_event_loop()``).
* ``RequestOutput.abort()`` (``GenerationResult.abort`` ->
  ``executor/worker.py`` ``abort_request`` -> the C++ executor's
  ``cancelRequest``) is asynchronous: the executor acts on cancelled ids at
  iteration boundaries (``cpp/tensorrt_llm/executor/executorImpl.cpp``, its
  execution loop), so a request aborted between iterations still takes part
  in the next one (its row comes once more), and one aborted during an
  iteration ends after it; either way it ends with a final (cancelled)
  response and holds its slot until then.
* ``RequestOutput.outputs[0].token_ids``: the generated ids
  (``executor/result.py`` ``GenerationResultBase.outputs``, ``CompletionOutput``).
* ``LLM.shutdown()`` waits until the active requests have finished
  (``executor/worker.py`` ``shutdown`` -> the C++ ``Executor::shutdown``):
  a live request runs to its ``max_tokens`` first.
* ``SamplingParams``: keyword-only fields of ``tensorrt_llm/sampling_params.py``
  (``ignore_eos`` makes the end id -1, ``executor/worker.py``).
* ``BatchedLogitsProcessor.__call__(req_ids, logits, token_ids, stream_ptr,
  client_ids)`` (``sampling_params.py``), modifying the logits in place;
  called once per iteration with the requests that set
  ``apply_batched_logits_processor`` (``cpp/tensorrt_llm/batch_manager/
  logitsPostProcessor.cpp``), each row ``[beam, 1, padded vocab]`` as in
  ``examples/llm-api/llm_logits_processor.py``; the greedy sampler then takes
  the argmax.
* ``BuildCacheConfig(cache_root, max_records, max_cache_storage_gb)``:
  ``llmapi/build_cache.py``.

Also modelled: in-flight batching in which every scheduled request (at
most ``max_batch_size``, in arrival order) is in every iteration, or with
``pipeline_parallel_size`` p, p micro-batches that take turns; logits that
are a deterministic function of a request's tokens; a padded vocabulary
whose padding would win an unmasked argmax. Not modelled:
CUDA (tensors are on the CPU and ``stream_ptr`` is None), separate worker
processes (the processor runs in a thread of this process, after a pickle
round trip), KV-cache limits, iteration timing beyond ``iteration_s``.
"""
from __future__ import annotations

import asyncio
import json
import pickle
import queue
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import numpy as np
import torch

PADDING = 3  # vocabulary padding columns (tensor-parallel padding in the real engine)
ENGINE_ID_OFFSET = 1000  # engine request ids start here, client ids at 1
DEFAULT_MAX_INPUT_LEN = 1024
__version__ = "1.0.0"  # the NGC 25.10 image's release (tensorrt_llm/version.py)


class RequestError(RuntimeError):
    """``executor/utils.py`` ``RequestError``: a per-request failure."""


@dataclass(kw_only=True)
class SamplingParams:
    end_id: Optional[int] = None
    pad_id: Optional[int] = None
    max_tokens: int = 32
    top_k: Optional[int] = None
    ignore_eos: bool = False
    detokenize: bool = True
    apply_batched_logits_processor: bool = False


class BuildCacheConfig:
    def __init__(self, cache_root: Optional[Path] = None, max_records: int = 10,
                 max_cache_storage_gb: float = 256):
        self.cache_root, self.max_records = cache_root, max_records
        self.max_cache_storage_gb = max_cache_storage_gb


def model_row(tokens: List[int], vocab_size: int) -> torch.Tensor:
    """The fake model: next-token logits as a function of the tokens alone."""
    generator = torch.Generator().manual_seed(zlib.crc32(np.asarray(tokens, np.int64).tobytes()))
    row = torch.randn(vocab_size + PADDING, generator=generator) * 3
    row[vocab_size:] = 100.0  # an unmasked greedy pick would land here
    return row


@dataclass
class CompletionOutput:
    """``executor/result.py`` ``CompletionOutput``: one beam's generated ids."""

    token_ids: List[int]


class RequestOutput:
    """``GenerationResult``: responses arrive in a queue; reading them is what
    surfaces an error. ``outputs`` holds the beam's ids once it has finished."""

    def __init__(self, llm: "LLM", request_id: int):
        self._llm, self.request_id = llm, request_id
        self.outputs: List[CompletionOutput] = []
        self._done = False
        self._error: Optional[str] = None
        self.finish_reason: Optional[str] = None
        try:
            self._loop = asyncio.get_running_loop()
            self._aqueue: Optional[asyncio.Queue] = asyncio.Queue()
        except RuntimeError:
            self._loop, self._aqueue = None, None
        self._queue: queue.Queue = queue.Queue()

    def _respond(self, finish_reason: Optional[str], error: Optional[str]) -> None:
        """The engine's final response (any thread)."""
        if self._aqueue is not None:
            self._loop.call_soon_threadsafe(self._aqueue.put_nowait, (finish_reason, error))
        else:
            self._queue.put((finish_reason, error))

    def _handle(self, response) -> None:
        self.finish_reason, error = response
        self._done = True
        if error is not None:
            raise RequestError(error)

    def result(self, timeout: Optional[float] = None) -> "RequestOutput":
        while not self._done:
            self._handle(self._queue.get(timeout=timeout))
        return self

    async def aresult(self) -> "RequestOutput":
        assert self._aqueue is not None, ("The asyncio event loop was not present during "
                                          "initialization, so async operations are not available.")
        while not self._done:
            self._handle(await self._aqueue.get())
        return self

    def abort(self) -> None:
        self._llm._abort(self.request_id)


@dataclass(eq=False)
class _Request:
    client_id: int
    engine_id: int
    tokens: List[int]
    params: SamplingParams
    prompt_length: int
    micro_batch: int
    output: RequestOutput
    generated: int = 0
    cancelled_at: Optional[int] = None  # the last iteration it takes part in


class LLM:
    """Runs iterations in a thread while requests are active. ``model`` is a
    directory whose ``config.json`` gives ``vocab_size`` (a checkpoint's) or
    ``pretrained_config.vocab_size`` and ``build_config`` (a prebuilt engine)."""

    build_s = 0.0  # engine build time (tests raise it)
    iteration_s = 0.0  # time one iteration takes besides the processor
    paused = False  # no iteration starts while set (tests: let requests arrive together)
    kv_cache_tokens: Optional[int] = None  # KV-cache capacity in tokens (None: unlimited)

    def __init__(self, model: str, *, tensor_parallel_size: int = 1,
                 pipeline_parallel_size: int = 1, batched_logits_processor=None,
                 skip_tokenizer_init: bool = False, max_batch_size: Optional[int] = None,
                 max_input_len: Optional[int] = None, max_seq_len: Optional[int] = None,
                 max_num_tokens: Optional[int] = None, enable_build_cache=False):
        self.model, self.max_batch_size = model, max_batch_size
        config = json.loads((Path(model) / "config.json").read_text())
        self.max_seq_len = max_seq_len or config.get("build_config", {}).get("max_seq_len")
        self.vocab_size = config.get("vocab_size") or config["pretrained_config"]["vocab_size"]
        self.max_input_len = max_input_len or config.get("build_config", {}).get(
            "max_input_len", DEFAULT_MAX_INPUT_LEN)
        self.max_num_tokens = max_num_tokens
        self.tensor_parallel_size, self.pipeline_parallel_size = (tensor_parallel_size,
                                                                  pipeline_parallel_size)
        self.enable_build_cache = enable_build_cache
        self.built = self._build(config)
        self.processor = pickle.loads(pickle.dumps(batched_logits_processor))
        self.requests: list[_Request] = []
        self.finished: dict[int, List[int]] = {}  # client id -> tokens, ended by the engine
        self.aborted: set[int] = set()  # client ids
        self.failures: dict[int, str] = {}  # client id -> error to report at the next iteration
        self.errors: list[BaseException] = []
        self.iterations: list[list[int]] = []  # client ids per iteration
        self.engine_ids: list[list[int]] = []  # engine ids per iteration
        self.choose = lambda row: int(row.argmax())  # the greedy sampler (tests may override)
        self.next_id, self.arrivals, self.count = 1, 0, 0
        self.in_iteration = False
        self.condition = threading.Condition()
        self.running = True
        self.thread = threading.Thread(target=self._run, name="fake-trtllm", daemon=True)
        self.thread.start()

    def _build(self, config: dict) -> bool:
        """Build the engine unless it is prebuilt or cached; True if built."""
        if "build_config" in config:
            return False
        cache = self.enable_build_cache
        entry = None
        if cache:
            root = Path(cache.cache_root)
            key = zlib.crc32(json.dumps([str(Path(self.model).resolve()), self.max_batch_size,
                                         self.max_input_len, self.max_seq_len]).encode())
            entry = root / f"engine-{key:08x}"
            if entry.is_dir():
                return False
        time.sleep(self.build_s)
        if entry is not None:
            entry.mkdir(parents=True)
        return True

    def generate_async(self, inputs: List[int], sampling_params: SamplingParams,
                       streaming: bool = False) -> RequestOutput:
        assert sampling_params.top_k == 1  # greedy: the only sampling this fake models
        if self.max_seq_len and len(inputs) + sampling_params.max_tokens > self.max_seq_len:
            raise ValueError(f"The sum of prompt length ({len(inputs)}) and query length (0) "
                             f"max_tokens ({sampling_params.max_tokens}) should not exceed "
                             f"max_seq_len ({self.max_seq_len})")
        with self.condition:
            output = RequestOutput(self, self.next_id)
            request = _Request(self.next_id, ENGINE_ID_OFFSET + self.next_id, list(inputs),
                               sampling_params, len(inputs),
                               self.arrivals % self.pipeline_parallel_size,
                               output)
            self.next_id += 1
            self.arrivals += 1
            if len(inputs) > self.max_input_len:
                self.failures[request.client_id] = (
                    f"Prompt length ({len(inputs)}) exceeds maximum input length "
                    f"({self.max_input_len}).")
            self.requests.append(request)
            self.condition.notify_all()
        return output

    def resume(self) -> None:
        with self.condition:
            self.paused = False
            self.condition.notify_all()

    def fail(self, client_id: int, message: str) -> None:
        """Make the engine fail a request at its next iteration (tests)."""
        with self.condition:
            self.failures[client_id] = message

    def _abort(self, client_id: int) -> None:
        with self.condition:
            self.aborted.add(client_id)
            for request in self.requests:
                if request.client_id == client_id and request.cancelled_at is None:
                    # during an iteration: that one is its last; between: the next one
                    request.cancelled_at = self.count if self.in_iteration else self.count + 1

    def shutdown(self) -> None:
        """Waits for the active requests to finish, then stops."""
        with self.condition:
            # (an engine whose loop is gone cannot finish them: InertLLM in tests)
            self.condition.wait_for(lambda: not self.requests or not self.thread.is_alive(),
                                    timeout=120)
            self.running = False
            self.condition.notify_all()
        self.thread.join(timeout=10)

    def _end(self, request: _Request, finish_reason: Optional[str],
             error: Optional[str] = None) -> None:
        """Lock held: the request's final response."""
        self.requests.remove(request)
        if error is None and finish_reason != "cancelled":
            self.finished[request.client_id] = request.tokens
        request.output.outputs = [CompletionOutput(request.tokens[request.prompt_length:])]
        request.output._respond(finish_reason, error)
        self.condition.notify_all()

    def _run(self) -> None:
        turn = 0
        while True:
            with self.condition:
                self.condition.wait_for(lambda: not self.running or
                                        (self.requests and not self.paused))
                if not self.running:
                    return
                for request in list(self.requests):
                    message = self.failures.pop(request.client_id, None)
                    if message is not None:
                        self._end(request, None, message)
                    elif request.cancelled_at is not None and request.cancelled_at <= self.count:
                        self._end(request, "cancelled")
                # The capacity scheduler (cpp/tensorrt_llm/batch_manager/
                # capacityScheduler.cpp) schedules at most max_batch_size requests,
                # in arrival order; the others wait (an aborted one holds its
                # slot until it has ended).
                scheduled = self._schedule()
                batch = [r for r in scheduled
                         if r.micro_batch == turn % self.pipeline_parallel_size]
                turn += 1
                self.count += 1  # this iteration's number
                self.in_iteration = True
            if batch:
                self._iterate(batch)
            with self.condition:
                self.in_iteration = False
            time.sleep(self.iteration_s)

    def _schedule(self) -> list[_Request]:
        """Lock held: the requests that fit, in arrival order (module docstring)."""
        scheduled, reserved = [], 0
        for request in self.requests[:self.max_batch_size or len(self.requests)]:
            need = request.prompt_length + request.params.max_tokens
            if self.kv_cache_tokens is not None and reserved + need > self.kv_cache_tokens:
                break
            scheduled.append(request)
            reserved += need
        return scheduled

    def _iterate(self, batch: list[_Request]) -> None:
        self.iterations.append([r.client_id for r in batch])
        self.engine_ids.append([r.engine_id for r in batch])
        logits = [model_row(r.tokens, self.vocab_size).reshape(1, 1, -1) for r in batch]
        # Only the requests that opted in (logitsPostProcessor.cpp), and only
        # when an LLM has a processor (a reference run has none).
        opted = [(r, row) for r, row in zip(batch, logits)
                 if r.params.apply_batched_logits_processor and self.processor is not None]
        try:
            if opted:
                self.processor([r.engine_id for r, _ in opted], [row for _, row in opted],
                               [[r.tokens] for r, _ in opted], None,
                               [r.client_id for r, _ in opted])
        except Exception as error:  # the real executor fails the iteration's requests
            self.errors.append(error)
            with self.condition:
                for request in batch:
                    self._end(request, None, f"{type(error).__name__}: {error}")
            return
        with self.condition:
            for request, row in zip(batch, logits):
                token = self.choose(row.reshape(-1))
                request.tokens.append(token)
                request.generated += 1
                end_id = -1 if request.params.ignore_eos else request.params.end_id
                if token == end_id:
                    self._end(request, "stop")
                elif request.generated >= request.params.max_tokens:
                    self._end(request, "length")


API = (LLM, SamplingParams, BuildCacheConfig, __version__)
"""What ``load_tensorrt_llm`` returns, faked (``trtllm_api.TrtLlmApi``'s fields)."""
