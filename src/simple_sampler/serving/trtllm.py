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
  shared-memory block, reports its time (``TrtLlmEngine.bridge_s``), and exits
  when its owner dies (:class:`OwnerWatch`).

Not verified here (no GPU, no TensorRT-LLM): the calls follow TensorRT-LLM's source
(``tests/trtllm_api.json``) and are tested against ``tests/fake_tensorrt_llm.py``.
Why this route, the processes and ranks, and what is unverified: docs/GPU.md.
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import secrets
import select
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.connection import Client, Listener
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import Hashable, NamedTuple, Sequence

import ml_dtypes
import numpy as np
import torch

from ..row_arena import HEADER_BYTES, Region
from ..sampling import logits_tensor
from .engine import SequenceFailed, SequenceTable

log = logging.getLogger(__name__)

#: cudaHostRegisterPortable (cuda_runtime_api.h): the registration is seen
#: by every CUDA context, not only the current device's
CUDA_HOST_REGISTER_PORTABLE = 1

READY_POLL_S = 0.05  # longest wait_ready blocks, so the decode loop sees cancellations
STEP_TIMEOUT_S = 600.0  # a step waiting longer means the engine stopped producing rows


ENGINE_CACHE_ENV = "SIMPLE_SAMPLER_ENGINE_CACHE"
"""Where TensorRT-LLM's build cache keeps engines built from checkpoints
(default ``~/.cache/simple-sampler/tensorrt_llm``): a restart with the same
checkpoint and limits loads the engine instead of building it again."""
DEFAULT_MAX_NUM_TOKENS = 8192  # TensorRT-LLM's BuildConfig default (llmapi/llm_args.py)
OWNER_POLL_S = 1.0  # how often a worker without pidfd support looks for its owner
ORPHANED_EXIT_STATUS = 70  # a worker's exit status once its owner has gone
#: The sampler's name for a rows dtype -> (numpy dtype, torch dtype): what
#: the staging block may hold (``read_logits_dtype``).
STAGED_DTYPES = {"fp32": (np.float32, torch.float32), "fp16": (np.float16, torch.float16),
                 "bf16": (ml_dtypes.bfloat16, torch.bfloat16)}


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


class TrtLlmApi(NamedTuple):
    """The TensorRT-LLM names the adapter uses (``tests/trtllm_api.json``)."""

    LLM: type
    SamplingParams: type
    BuildCacheConfig: type | None = None  # None: no build cache (engines are rebuilt)
    version: str = "unknown"


def load_tensorrt_llm() -> TrtLlmApi:
    """TensorRT-LLM's TensorRT backend: the only one that calls a batched
    logits processor.

    1.x: ``tensorrt_llm._tensorrt_engine.LLM`` (``_tensorrt_engine/__init__.py``);
    there ``tensorrt_llm.LLM`` is the PyTorch backend, which accepts the
    processor and never calls it, so every request would hang: a 1.x or later
    release without ``_tensorrt_engine`` is refused, naming its version. 0.x:
    ``tensorrt_llm.LLM`` is the TensorRT backend. Raises ImportError when
    TensorRT-LLM is not installed; nothing else in this project imports it."""
    import tensorrt_llm

    version = str(getattr(tensorrt_llm, "__version__", "unknown"))
    try:
        from tensorrt_llm._tensorrt_engine import LLM
    except ImportError as missing:
        if not version.startswith("0."):
            raise ImportError(
                f"TensorRT-LLM {version} has no tensorrt_llm._tensorrt_engine.LLM (the TensorRT "
                f"backend), and its tensorrt_llm.LLM is the PyTorch backend, which never calls "
                f"batched logits processors: every request would hang. Use a release with the "
                f"TensorRT backend (0.x, or 1.x with _tensorrt_engine; docs/GPU.md)") from missing
        from tensorrt_llm import LLM
    from tensorrt_llm import SamplingParams
    try:  # llmapi/build_cache.py, exported by tensorrt_llm.llmapi
        from tensorrt_llm.llmapi import BuildCacheConfig
    except ImportError:
        BuildCacheConfig = None
    return TrtLlmApi(LLM, SamplingParams, BuildCacheConfig, version)


def engine_build_config(model: str | os.PathLike) -> dict | None:
    """A prebuilt TensorRT-LLM engine directory's ``build_config`` (its
    config.json, written by ``tensorrt_llm/builder.py`` ``EngineConfig``), or
    None for a Hugging Face checkpoint (built at start)."""
    config = json.loads((Path(model) / "config.json").read_text())
    build = config.get("build_config")
    return build if isinstance(build, dict) else None


def check_engine_limits(model: str | os.PathLike, build: dict, max_batch_size: int,
                        max_context: int) -> None:
    """ValueError naming the field when a prebuilt engine's limits are below
    what the flags ask: TensorRT-LLM would reject (or hang) requests the
    decode loop admits."""
    for field, need, flag in (("max_batch_size", max_batch_size, "--engine-max-batch-size"),
                              ("max_input_len", max_context - 1, "--max-context - 1"),
                              ("max_seq_len", max_context, "--max-context")):
        have = build.get(field)
        if have is not None and int(have) < need:
            raise ValueError(f"the prebuilt engine {model} has {field}={have}, below the {need} "
                             f"that {flag} needs: lower the flag or rebuild the engine")


def read_logits_dtype(model: str | os.PathLike) -> str | None:
    """The sampler's name (fp32, fp16, bf16) for the dtype a prebuilt
    engine's rows come in (``config.json``: ``pretrained_config.logits_dtype``,
    TensorRT-LLM's ``PretrainedConfig``): the dtype the processor stages
    them in and the sampler is configured for (``engines.ENGINES``). None
    for a Hugging Face checkpoint or a config that says nothing: float32,
    TensorRT-LLM's default logits dtype."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    dtype = (config.get("pretrained_config") or {}).get("logits_dtype")
    return {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}.get(dtype)


def read_vocab_size(model: str | os.PathLike) -> int:
    """The vocabulary of a Hugging Face checkpoint (``config.json``:
    ``vocab_size``) or a TensorRT-LLM engine directory (``config.json``:
    ``pretrained_config.vocab_size``)."""
    config = json.loads((Path(model) / "config.json").read_text())
    size = config.get("vocab_size") or config.get("pretrained_config", {}).get("vocab_size")
    if not size:
        raise ValueError(f"{model}/config.json names no vocab_size")
    return int(size)


def engine_limits(api: TrtLlmApi, model: str | os.PathLike, max_batch_size: int,
                  max_context: int, build_cache_dir: str | os.PathLike | None = None) -> dict:
    """The ``LLM`` keywords that fix the engine's limits: a prebuilt engine's
    are checked against ours (``check_engine_limits``), a checkpoint is
    built with them through the build cache. The same for the served engine
    and ``launch.gpu_check``'s reference run, so the second loads the first's
    cached engine."""
    limits = dict(max_batch_size=max_batch_size, max_seq_len=max_context)
    build = engine_build_config(model)
    if build is not None:  # prebuilt: its limits are fixed, check them against ours
        check_engine_limits(model, build, max_batch_size, max_context)
        return limits
    # Built at start: without max_input_len TensorRT-LLM's default (1024)
    # applies and longer prompts fail; max_num_tokens must cover one prompt.
    limits.update(max_input_len=max_context - 1,
                  max_num_tokens=max(DEFAULT_MAX_NUM_TOKENS, max_context))
    if api.BuildCacheConfig is not None:
        cache = Path(build_cache_dir or os.environ.get(ENGINE_CACHE_ENV) or
                     Path.home() / ".cache" / "simple-sampler" / "tensorrt_llm")
        limits["enable_build_cache"] = api.BuildCacheConfig(cache_root=cache)
    return limits


def greedy_reference(model: str | os.PathLike, prompt_ids: Sequence[int], max_tokens: int,
                     max_batch_size: int, max_context: int, api=None,
                     build_cache_dir: str | os.PathLike | None = None) -> list[int]:
    """TensorRT-LLM's own greedy tokens for ``prompt_ids`` (the TensorRT
    backend, no processor of ours, the same limits as the served engine):
    ``max_tokens`` ids, the end id ignored so that any prefix compares. The
    reference ``launch.gpu_check`` holds the served tokens to."""
    api = TrtLlmApi(*(api or load_tensorrt_llm()))
    llm = api.LLM(model=str(model), skip_tokenizer_init=True,
                  **engine_limits(api, model, max_batch_size, max_context, build_cache_dir))
    try:
        params = api.SamplingParams(max_tokens=max_tokens, top_k=1, ignore_eos=True, end_id=0,
                                    pad_id=0, detokenize=False)
        output = llm.generate_async(list(prompt_ids), sampling_params=params,
                                    streaming=False).result()
        # RequestOutput.outputs[0]: executor/result.py CompletionOutput, the beam's new ids.
        return [int(t) for t in output.outputs[0].token_ids]
    finally:
        llm.shutdown()


class BridgeClosed(RuntimeError):
    """The engine is shutting down: rows are no longer answered."""


@dataclass(eq=False)
class _Iteration:
    """The rows of one processor call and their answers (None: leave the
    row as the engine computed it, for requests that are gone)."""

    rows: np.ndarray
    tokens: list
    unanswered: int


@dataclass(eq=False)
class _TrtLlmSequence:
    client_id: int
    request: object  # TensorRT-LLM's RequestOutput, kept to abort it
    length: int
    last_token: int | None = None  # the token we appended last: the engine must have it
    row: tuple[_Iteration, int] | None = None  # delivered, not yet stepped
    taken: tuple[_Iteration, int] | None = None  # stepped, awaiting its token
    error: str | None = None


def _awaits_step(sequence: _TrtLlmSequence) -> bool:
    """Whether the sequence's next token is one the model has not consumed:
    not stepped since its last append (or its prompt)."""
    return sequence.taken is None


class RowExchange:
    """The meeting point of the processor's calls (``deliver``, in the
    socket server's thread) and the decode loop (``wait_ready``, ``step``,
    ``append``, ``release``). One lock and condition guard everything."""

    def __init__(self):
        self.condition = threading.Condition()
        self.by_client: dict[int, _TrtLlmSequence] = {}
        self.closed = False
        self.bridge_s = 0.0  # the bridge's own time, summed over iterations

    def add_bridge_time(self, seconds: float) -> None:
        with self.condition:
            self.bridge_s += seconds

    def deliver(self, client_ids: Sequence, last_tokens: Sequence[int], rows: np.ndarray) -> list:
        """One engine iteration: block until every row is answered; return
        the token per row (None for rows of unknown or released requests)."""
        iteration = _Iteration(rows, [None] * len(client_ids), 0)
        with self.condition:
            for index, (client_id, last) in enumerate(zip(client_ids, last_tokens)):
                sequence = self.by_client.get(client_id)
                if sequence is None:
                    continue  # aborted or foreign: its output is discarded anyway
                if sequence.last_token is not None and last != sequence.last_token:
                    sequence.error = (f"TensorRT-LLM continued with token {last} where the "
                                      f"decision plane chose {sequence.last_token}: is its "
                                      f"sampling greedy (top_k 1)?")
                sequence.row = (iteration, index)
                iteration.unanswered += 1
            self.condition.notify_all()
            while iteration.unanswered and not self.closed:
                self.condition.wait()
        return iteration.tokens

    def answer(self, place: tuple[_Iteration, int], token: int | None) -> None:
        """Record a row's token (lock held)."""
        iteration, index = place
        iteration.tokens[index] = token
        iteration.unanswered -= 1
        if not iteration.unanswered:
            self.condition.notify_all()

    def close(self) -> None:
        with self.condition:
            self.closed = True
            self.condition.notify_all()


class RowServer:
    """This process's end of the processor's connection: a Unix socket for
    ids and tokens, and the staging block the processor copies an
    iteration's rows into, ``max_rows`` rows of ``dtype`` (``STAGED_DTYPES``,
    the engine's logits dtype) in a row-arena region (``row_arena.Region``),
    so an arena that adopts it (``TrtLlmEngine.share_rows``) sends the
    sampler instances references to the rows where they landed."""

    def __init__(self, exchange: RowExchange, max_rows: int, vocab_size: int,
                 dtype: str = "fp32"):
        self.exchange, self.max_rows, self.vocab_size = exchange, max_rows, vocab_size
        self.dtype = dtype
        array_dtype = np.dtype(STAGED_DTYPES[dtype][0])
        self.region = Region(max_rows * vocab_size * array_dtype.itemsize)
        self.staging = self.region.array((max_rows, vocab_size), array_dtype)
        self.directory = tempfile.mkdtemp(prefix="simple-sampler-trtllm-")
        self.authkey = secrets.token_bytes(32)
        self.listener = Listener(os.path.join(self.directory, "rows.sock"), "AF_UNIX",
                                 authkey=self.authkey)
        threading.Thread(target=self._accept, name="trtllm-rows", daemon=True).start()

    def processor(self) -> "DecisionPlaneProcessor":
        return DecisionPlaneProcessor(self.listener.address, self.authkey, self.region.name,
                                      self.max_rows, self.vocab_size, self.dtype)

    def _accept(self) -> None:
        while True:
            try:
                connection = self.listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _serve(self, connection) -> None:
        with connection:
            while True:
                try:
                    client_ids, last_tokens, processor_s = connection.recv()
                except (EOFError, OSError):
                    return
                # A view, no copy: the processor writes the next iteration's
                # rows only after deliver returns, once every row of this one
                # is answered, and a row is read (stepped, sampled, resent on
                # failover) only before its answer.
                self.exchange.add_bridge_time(processor_s)
                connection.send(self.exchange.deliver(client_ids, last_tokens,
                                                      self.staging[:len(client_ids)]))

    def close(self) -> None:
        self.listener.close()
        self.region.unlink()  # the mapping goes with its last view
        shutil.rmtree(self.directory, ignore_errors=True)


class DecisionPlaneProcessor:
    """TensorRT-LLM's batched logits processor (``BatchedLogitsProcessor``'s
    ``__call__`` signature): send the rows to the decode loop, keep only the
    token it chose. Pickled into the engine's worker; connects on first use.

    Unpickled in another process (TensorRT-LLM's executor worker, every rank
    of it: the worker arguments carry the processor), it starts an
    :class:`OwnerWatch` on the process that made it.

    Each call measures its own work, everything but the wait for the tokens
    (gathering the rows and the device-to-host copy, which also waits for the
    engine's stream to finish the logits; launching the mask), and sends it
    with the next call's rows (the mask's time is known only after a send).
    Not measured: TensorRT-LLM's building of ``token_ids``, every request's
    whole token history as Python lists, before the call
    (``cpp/tensorrt_llm/batch_manager/logitsPostProcessor.cpp``)."""

    def __init__(self, address: str, authkey: bytes, shared_name: str, max_rows: int,
                 vocab_size: int, dtype: str = "fp32"):
        self.address, self.authkey, self.shared_name = address, authkey, shared_name
        self.max_rows, self.vocab_size, self.dtype = max_rows, vocab_size, dtype
        self.owner_pid = os.getpid()
        self.connection = self.shared = self.watch = None
        self.unreported_s = 0.0
        #: whether CUDA page-locked the staging block (``_page_lock``); None: not tried
        self.page_locked = None
        self.warned_cast = False

    def __getstate__(self):
        return {**self.__dict__, "connection": None, "shared": None, "watch": None,
                "unreported_s": 0.0, "page_locked": None, "warned_cast": False}

    def _page_lock(self, device: torch.device) -> None:
        """Register the staging block with CUDA (``cudaHostRegister``), once,
        when the first rows come from a GPU: their device-to-host copy then
        lands by DMA in the block itself, with no pass through the driver's
        pinned bounce buffer that pageable memory takes. The block stays
        mapped and registered for this process's life. If CUDA refuses, the
        copy still works, pageable (logged once).

        The call runs on a short-lived thread of its own. A refused
        ``cudaHostRegister`` also sets the CUDA runtime's last error, which is
        kept per host thread until ``cudaGetLastError`` reads and resets it;
        torch's binding (``torch/csrc/cuda/shared/cudart.cpp``,
        ``initCudartBindings``, ``"cudaHostRegister"``) only returns the code
        (``C10_CUDA_ERROR_HANDLED`` is ``EXPR``, ``c10/cuda/CUDAException.h``)
        and exposes no ``cudaGetLastError``. Left on the engine's thread, the
        next kernel launch there (the gather below: torch checks
        ``cudaGetLastError`` after each launch, ``C10_CUDA_KERNEL_LAUNCH_CHECK``)
        would raise that stale error and fail the iteration's requests. On a
        thread of its own the error ends with the thread."""
        buffer = self.shared.buf
        address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
        outcome = {}

        def register() -> None:
            try:
                # The rows' GPU: a new thread's current device is 0, whose
                # context this process (another TP rank's GPU) may not hold.
                torch.cuda.set_device(device)
                # portable: pinned for every device's context, whichever GPU the rows are on
                outcome["error"] = torch.cuda.cudart().cudaHostRegister(
                    address, buffer.nbytes, CUDA_HOST_REGISTER_PORTABLE)
            except Exception as error:  # noqa: BLE001 - reported below, the copy still works
                outcome["error"] = f"{type(error).__name__}: {error}"

        thread = threading.Thread(target=register, name="trtllm-host-register")
        thread.start()
        thread.join()
        error = outcome["error"]  # torch's cudaError (0: success), or what was raised
        self.page_locked = not isinstance(error, str) and int(error) == 0
        if not self.page_locked:
            log.warning("the staging block stays pageable: cudaHostRegister returned %s", error)

    def __setstate__(self, state):
        self.__dict__.update(state)
        if os.getpid() != self.owner_pid:
            self.watch = OwnerWatch(self.owner_pid).start()

    def __call__(self, req_ids, logits, token_ids, stream_ptr, client_ids) -> None:
        started = time.perf_counter()
        if len(logits) > self.max_rows:
            raise RuntimeError(f"{len(logits)} rows in one iteration, more than the "
                               f"max_batch_size={self.max_rows} the engine was set up for")
        if self.connection is None:
            self.shared = _attach(self.shared_name)
            self.connection = Client(self.address, "AF_UNIX", authkey=self.authkey)
        if logits[0].is_cuda and self.page_locked is None:
            self._page_lock(logits[0].device)
        stream = None
        if logits[0].is_cuda and stream_ptr:  # the stream the engine computed the logits on
            # device=: the stream belongs to the logits' GPU, which need not be
            # the current device of this thread.
            stream = torch.cuda.ExternalStream(stream_ptr, device=logits[0].device)
        with _on(stream):
            # Rows are [beam 1, 1, vocab padded to the tensor-parallel size]:
            # one gather, one device-to-host copy into the block, in the
            # block's dtype (the engine's logits dtype, read_logits_dtype:
            # no cast unless the rows disagree with the engine's config).
            array_dtype, tensor_dtype = STAGED_DTYPES[self.dtype]
            rows = torch.stack([row.reshape(-1, row.shape[-1])[0, :self.vocab_size]
                                for row in logits])
            if rows.dtype != tensor_dtype:
                if not self.warned_cast:
                    log.warning("the engine's rows are %s, its config.json says %s: cast on "
                                "the device", rows.dtype, self.dtype)
                    self.warned_cast = True
                rows = rows.to(tensor_dtype)
            block = logits_tensor(np.ndarray((self.max_rows, self.vocab_size), array_dtype,
                                             buffer=self.shared.buf, offset=HEADER_BYTES))
            block[:len(logits)].copy_(rows)
        last_tokens = [beams[0][-1] for beams in token_ids]
        staged = time.perf_counter()
        self.connection.send((list(client_ids), last_tokens,
                              self.unreported_s + staged - started))
        tokens = self.connection.recv()
        answered = time.perf_counter()
        with _on(stream):
            for row, token in zip(logits, tokens):
                if token is not None:
                    row.fill_(float("-inf"))
                    row[..., token] = 0.0
        self.unreported_s = time.perf_counter() - answered


class OwnerWatch:
    """Ends this process when the process ``owner_pid`` has gone.

    Why: TensorRT-LLM runs the engine in worker processes that MPI spawns
    (``executor/executor.py`` ``GenerationExecutor.create`` -> ``_create_ipc_executor``
    / ``llmapi/mpi_session.py`` ``MpiPoolSession``, mpi4py's
    ``MPIPoolExecutor``), children of the MPI runtime rather than of the
    Triton ``llm`` process that owns them; they end through ``LLM.shutdown()``
    only. When that process is killed (the supervisor restarts the server
    with SIGKILL when ``llm`` loses its stub, ``launch/supervisor.py``) no
    shutdown runs, and a worker would keep the GPU's memory (the KV cache
    holds most of it) while the new ``llm`` builds its own. A worker whose
    owner is gone has nobody to serve, so it exits.

    A pidfd (``os.pidfd_open``, Linux 5.3) is readable once the process
    exits, whatever reuses its pid later; without one the pid is polled
    every ``OWNER_POLL_S``."""

    def __init__(self, owner_pid: int, exit=os._exit):
        self.owner_pid, self.exit = owner_pid, exit

    def start(self) -> "OwnerWatch":
        threading.Thread(target=self._watch, name="trtllm-owner-watch", daemon=True).start()
        return self

    def _watch(self) -> None:
        try:
            descriptor = os.pidfd_open(self.owner_pid)
        except (AttributeError, OSError):  # no pidfd here (or the owner is already gone)
            while _alive(self.owner_pid):
                time.sleep(OWNER_POLL_S)
        else:
            select.select([descriptor], [], [])
            os.close(descriptor)
        print(f"simple-sampler: TensorRT-LLM worker {os.getpid()} exits: its owner, process "
              f"{self.owner_pid} (the Triton llm model), has gone", file=sys.stderr, flush=True)
        self.exit(ORPHANED_EXIT_STATUS)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _attach(name: str) -> SharedMemory:
    """The engine's staging block (a ``row_arena.Region``), seen from the
    processor. Before Python 3.13 attaching registers the block with this
    process's resource tracker, which would unlink it when this process
    exits (CPython issue 82300); its owner, the ``RowServer``, unlinks it."""
    shared = SharedMemory(name=name)
    resource_tracker.unregister(shared._name, "shared_memory")
    return shared


def _on(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


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


def _rows_of(places: list, staging: np.ndarray) -> np.ndarray:
    """The rows at `places` ((iteration, index) each): a view of the staging
    block where they are one iteration's consecutive rows in order (a step
    over every row the engine delivered, the common case), else a copy."""
    if not places:
        return staging[:0]
    iteration, first = places[0]
    if all(it is iteration and index == first + k for k, (it, index) in enumerate(places)):
        return iteration.rows[first:first + len(places)]
    return np.stack([it.rows[index] for it, index in places])


class TrtLlmEngine:
    """The :class:`~.engine.Engine` over TensorRT-LLM (module docstring).

    ``api`` is ``(LLM, SamplingParams)``, by default :func:`load_tensorrt_llm`'s;
    ``model`` a Hugging Face checkpoint or TensorRT-LLM engine directory.
    Thread safety: every call may come from any thread.
    """

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
        self.sequences: SequenceTable[_TrtLlmSequence] = SequenceTable(vocab_size, max_batch_size,
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

    def _submit(self, prompt: list[int], max_tokens: int | None) -> _TrtLlmSequence:
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
        return _TrtLlmSequence(request.request_id, request, len(prompt))

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
            rows = _rows_of([s.row for s in sequences], self.server.staging)
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
