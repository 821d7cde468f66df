"""The bridge between TensorRT-LLM's batched logits processor and the
decode loop, across processes.

The processor (:class:`DecisionPlaneProcessor`) runs in TensorRT-LLM's
worker: it copies an iteration's rows into a shared staging block, sends
the requests' ids over a Unix socket to this process's :class:`RowServer`,
and masks each row to the token that comes back. The server hands the rows
to :class:`RowExchange`, where the engine (``serving/trtllm.py``) steps and
answers them. A worker whose owner is gone exits (:class:`OwnerWatch`)."""
from __future__ import annotations

import contextlib
import ctypes
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
from typing import Sequence

import ml_dtypes
import numpy as np
import torch

from ..pids import alive
from ..row_arena import HEADER_BYTES, Region
from ..sampling import logits_tensor
from .device import page_lock

log = logging.getLogger(__name__)

OWNER_POLL_S = 1.0  # how often a worker without pidfd support looks for its owner
ORPHANED_EXIT_STATUS = 70  # a worker's exit status once its owner has gone
#: The sampler's name for a rows dtype -> (numpy dtype, torch dtype): what
#: the staging block may hold (``read_logits_dtype``).
STAGED_DTYPES = {"fp32": (np.float32, torch.float32), "fp16": (np.float16, torch.float16),
                 "bf16": (ml_dtypes.bfloat16, torch.bfloat16)}


class BridgeClosed(RuntimeError):
    """The engine is shutting down: rows are no longer answered."""


@dataclass(eq=False)
class Iteration:
    """The rows of one processor call and their answers (None: leave the
    row as the engine computed it, for requests that are gone)."""

    rows: np.ndarray
    tokens: list
    unanswered: int


@dataclass(eq=False)
class BridgedSequence:
    """A submitted request as the exchange and the engine both see it: where
    its row is, what it was last answered, what failed it."""

    client_id: int
    request: object  # TensorRT-LLM's RequestOutput, kept to abort it
    length: int
    last_token: int | None = None  # the token we appended last: the engine must have it
    row: tuple[Iteration, int] | None = None  # delivered, not yet stepped
    taken: tuple[Iteration, int] | None = None  # stepped, awaiting its token
    error: str | None = None


class RowExchange:
    """The meeting point of the processor's calls (``deliver``, in the
    socket server's thread) and the decode loop (``wait_ready``, ``step``,
    ``append``, ``release``). One lock and condition guard everything."""

    def __init__(self):
        self.condition = threading.Condition()
        self.by_client: dict[int, BridgedSequence] = {}
        self.closed = False
        self.bridge_s = 0.0  # the bridge's own time, summed over iterations

    def add_bridge_time(self, seconds: float) -> None:
        with self.condition:
            self.bridge_s += seconds

    def deliver(self, client_ids: Sequence, last_tokens: Sequence[int], rows: np.ndarray) -> list:
        """One engine iteration: block until every row is answered; return
        the token per row (None for rows of unknown or released requests)."""
        iteration = Iteration(rows, [None] * len(client_ids), 0)
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

    def answer(self, place: tuple[Iteration, int], token: int | None) -> None:
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
        # reserved: the worker's copy into a page /dev/shm cannot back would be its SIGBUS
        self.region = Region(max_rows * vocab_size * array_dtype.itemsize, reserve=True)
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
        """Register the staging block with CUDA (``serving.device.page_lock``), once,
        when the first rows come from a GPU: their device-to-host copy then
        lands by DMA in the block itself. The block stays mapped and
        registered for this process's life. If CUDA refuses, the copy still
        works, pageable (logged once)."""
        buffer = self.shared.buf
        refused = page_lock(ctypes.addressof(ctypes.c_char.from_buffer(buffer)), buffer.nbytes,
                            device)
        self.page_locked = refused is None
        if refused:
            log.warning("the staging block stays pageable: %s", refused)

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
            while alive(self.owner_pid):
                time.sleep(OWNER_POLL_S)
        else:
            select.select([descriptor], [], [])
            os.close(descriptor)
        print(f"simple-sampler: TensorRT-LLM worker {os.getpid()} exits: its owner, process "
              f"{self.owner_pid} (the Triton llm model), has gone", file=sys.stderr, flush=True)
        self.exit(ORPHANED_EXIT_STATUS)


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


def staged_rows(places: list, staging: np.ndarray) -> np.ndarray:
    """The rows at `places` ((iteration, index) each): a view of the staging
    block where they are one iteration's consecutive rows in order (a step
    over every row the engine delivered, the common case), else a copy."""
    if not places:
        return staging[:0]
    iteration, first = places[0]
    if all(it is iteration and index == first + k for k, (it, index) in enumerate(places)):
        return iteration.rows[first:first + len(places)]
    return np.stack([it.rows[index] for it, index in places])
