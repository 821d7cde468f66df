"""Logits rows in shared memory: written once by the llm process, read in
place by the local sampler instances (docs/COPIES.md says why this and not a
BLS tensor).

A *region* is a file in /dev/shm: a 4 KiB header (magic, slot count, slot
size, one generation number per slot) and the data after it. The llm
process owns its regions (``RowArena``); the sampler instances map them
read-only by name (``row_reader.RowReader``), lazily on the first request
that names one, so a restarted instance simply maps them again.

* The *ring* (``RowArena.lease``): ``slots`` equal slots. A step's rows are
  copied into a free slot once (its pages allocated first, as far as the
  rows reach: no room in /dev/shm sends them another way, where a write
  into a page it cannot back would be a SIGBUS); the slot's generation is
  bumped when it is taken and cleared when it is given back
  (``RowLease.release``, after every shard of the step has answered). A
  reader checks the generation before and after it samples: a slot
  recycled under it is an error, never a silent read of another step's
  rows.
  A producer can also take a slot before its rows exist (``RowArena.take``:
  the torch engine's device-to-host copy lands in it) and hand the filled
  view on; ``lease`` / ``reference`` of exactly that view claim the slot
  with no copy. A taken slot nobody claims comes back by itself when the
  last array over it dies.
* *Shared* regions (``RowArena.share``): an array the engine keeps for the
  process's lifetime (the simulated engine's bank of rows) copied once
  into a region of its own, and regions adopted from their owner
  (``RowArena.adopt``: the TensorRT-LLM bridge's staging block, which the
  device-to-host copy lands in); rows handed to ``lease`` that already lie
  in such a region are referenced where they are, with no copy at all.

A request names rows with ``logits_ref`` INT64 [B, 6], one row per logits
row: (region key, slot or -1, slot generation, byte offset of the row in
the region's data, V, kernel dtype code). The key is the owner's pid and 32
random bits; the region's name follows from it and the pid namespace, which
the owner and the readers (stubs of one server) share (``region_name``).

Lifetime: the owner unlinks its regions on ``close`` (the llm model's
``finalize``) and at interpreter exit; a new arena also removes regions
left by owners of its pid namespace that died without closing (a SIGKILLed
stub).
"""
from __future__ import annotations

import atexit
import contextlib
import errno
import logging
import mmap
import os
import secrets
import threading
import weakref
from dataclasses import dataclass, replace

import ml_dtypes
import numpy as np

from ._sampling import Dtype
from .pids import alive

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "simple-sampler-rows-"
HEADER_BYTES = 4096
MAGIC = np.frombuffer(b"SSROWS01", np.uint64)[0]
#: a region of token histories (``RowArena.histories``): header words magic,
#: sequence slots, max_context; then int32 [2, slots, max_context]
HISTORY_MAGIC = np.frombuffer(b"SSHIST01", np.uint64)[0]
#: header words: magic, slots, slot_bytes, then one generation per slot
HEADER_WORDS = 3
MAX_SLOTS = HEADER_BYTES // 8 - HEADER_WORDS
REF_COLUMNS = ("region", "slot", "generation", "offset", "vocab", "dtype")
DTYPE_CODES = {np.dtype(np.float32): int(Dtype.DTYPE_FLOAT32),
               np.dtype(np.float16): int(Dtype.DTYPE_FLOAT16),
               np.dtype(ml_dtypes.bfloat16): int(Dtype.DTYPE_BFLOAT16)}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


class StaleRows(RuntimeError):
    """The slot a reference names was given back (or reused) before the
    reader finished: a lifetime bug on the owner's side, never a client's."""


def pid_namespace() -> int:
    """This process's pid namespace (the inode of /proc/self/ns/pid; 0 where
    it cannot be read): owner pids are compared only within it, so a region
    of a server in another container that shares /dev/shm is never taken
    for an orphan."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def region_name(key: int, namespace: int | None = None) -> str:
    """The file of a region: the owner's pid namespace (the reader's own: a
    server's stubs share one), the owner's pid and 32 random bits."""
    namespace = pid_namespace() if namespace is None else namespace
    return f"{PREFIX}{namespace}-{key >> 32}-{key & 0xFFFFFFFF:08x}"


def remove_orphans() -> list[str]:
    """Unlink the regions of this pid namespace whose owner process is gone;
    returns their names."""
    removed = []
    mine = f"{PREFIX}{pid_namespace()}-"
    for name in os.listdir(SHM_DIR):
        if not name.startswith(mine):
            continue
        pid = name[len(mine):].split("-")[0]
        if pid.isdigit() and not alive(int(pid)):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed


class Region:
    """One owned region, mapped read-write: the arena's ring and shared
    arrays, and the TensorRT-LLM bridge's staging block (whose owner, the
    bridge, hands it to an arena with ``RowArena.adopt``). Another process
    writes into the data by opening ``name`` in /dev/shm (shm_open's
    namespace) at ``HEADER_BYTES``."""

    def __init__(self, data_bytes: int, slots: int = 0, slot_bytes: int = 0,
                 reserve: bool = False, magic=MAGIC):
        if slots > MAX_SLOTS and magic == MAGIC:
            raise ValueError(f"a region holds at most {MAX_SLOTS} slots, got {slots}")
        self.key = (os.getpid() << 32) | secrets.randbits(32)
        self.name = region_name(self.key)
        self.path = os.path.join(SHM_DIR, self.name)
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, HEADER_BYTES + data_bytes)
            allocate_pages(fd, 0, HEADER_BYTES + (data_bytes if reserve else 0), self.name)
            self.map = mmap.mmap(fd, HEADER_BYTES + data_bytes)
        except BaseException:
            self.unlink()
            os.close(fd)
            raise
        # kept for ``reserve`` while this object lives (never closed under a
        # caller, whose number another open could take): no reopening by name
        self.fd = fd
        weakref.finalize(self, os.close, fd)
        self.header = np.ndarray(HEADER_WORDS + (max(slots, 1) if magic == MAGIC else 0),
                                 np.uint64, self.map)
        self.header[:HEADER_WORDS] = (magic, slots, slot_bytes)
        self.data_bytes = data_bytes

    def array(self, shape, dtype, offset: int = 0) -> np.ndarray:
        return np.ndarray(shape, dtype, self.map, HEADER_BYTES + offset)

    def reserve(self, offset: int, nbytes: int) -> None:
        """Allocate the pages of data bytes [offset, offset + nbytes) now
        (``allocate_pages``)."""
        allocate_pages(self.fd, HEADER_BYTES + offset, nbytes, self.name)

    @property
    def data_address(self) -> int:
        """The address of the data's first byte in this process (what
        ``cudaHostRegister`` page-locks)."""
        return np.ndarray(0, np.uint8, self.map, HEADER_BYTES).ctypes.data

    def contains(self, array: np.ndarray) -> int | None:
        """The byte offset of `array`'s first element in the data, or None
        when it is not inside this region."""
        start = self.data_address
        address = array.__array_interface__["data"][0]
        if start <= address and address + array.nbytes <= start + self.data_bytes:
            return address - start
        return None

    def unlink(self) -> None:
        # The mapping itself goes with its last view (numpy arrays over it
        # may still be alive in the caller).
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def allocate_pages(fd: int, offset: int, nbytes: int, name: str) -> None:
    """Allocate a region's pages [offset, offset + nbytes) now, or raise
    OSError (ENOSPC: /dev/shm has no room, said so): a write into a page of
    a full /dev/shm is a SIGBUS that kills the writer (the llm process, the
    TensorRT-LLM worker), never an error it could handle. The free space is
    asked first: tmpfs refuses a fallocate only after taking every free
    page, which other users of /dev/shm (Triton's pools) would then miss."""
    try:
        room = os.fstatvfs(fd)
        if room.f_bavail * room.f_frsize < nbytes:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        os.posix_fallocate(fd, offset, nbytes)
    except OSError as error:
        if error.errno != errno.ENOSPC:
            raise
        raise OSError(error.errno, f"{SHM_DIR} has no room for {nbytes} bytes of {name} "
                      f"({error.strerror}): give the server more shared memory "
                      f"(docker run --shm-size)") from error


@dataclass
class RowLease:
    """Rows [B, V] placed in a region: ``refs(a, b)`` names rows a..b for a
    request; ``release()`` gives the slot back (no-op for shared rows)."""

    arena: "RowArena"
    region: Region
    slot: int
    generation: int
    offset: int
    row_stride: int
    vocab: int
    dtype: int
    rows: int
    #: the slot holds the caller's own rows (a ``take`` view it claimed), not a copy
    claimed: bool = False

    def refs(self, start: int = 0, end: int | None = None) -> np.ndarray:
        end = self.rows if end is None else end
        refs = np.empty((end - start, len(REF_COLUMNS)), np.int64)
        refs[:] = (self.region.key, self.slot, self.generation, 0, self.vocab, self.dtype)
        refs[:, 3] = self.offset + self.row_stride * np.arange(start, end)
        return refs

    def release(self) -> None:
        if self.slot >= 0:
            self.arena._release(self.slot, self.generation)
            self.slot = -1

    def release_after(self, owner) -> None:
        """``release``, but where the slot holds the caller's own rows, only
        once `owner` (the caller's object over them) is collected: a caller
        that reads its rows again (sampling a refused step around its bad
        rows) must not find them overwritten by the next lease."""
        if self.slot >= 0 and self.claimed:
            weakref.finalize(owner, self.arena._release, self.slot, self.generation)
            self.slot = -1
        self.release()


@dataclass
class _Taken:
    """A slot ``RowArena.take`` handed out, not claimed yet."""

    generation: int
    shape: tuple[int, ...]
    dtype: np.dtype
    finalizer: weakref.finalize


def _check_rows(rows: np.ndarray) -> None:
    if rows.ndim != 2 or rows.dtype not in DTYPE_CODES:
        raise ValueError(f"rows must be [B, V] float32, float16 or bfloat16, got "
                         f"{rows.dtype} {list(rows.shape)}")


class RowArena:
    """The llm process's regions (module docstring): a ring of `slots` slots
    of `slot_bytes` each, and the arrays it was asked to share."""

    def __init__(self, slots: int, slot_bytes: int):
        if slots < 1 or slot_bytes < 1:
            raise ValueError(f"a row arena needs slots >= 1 and slot_bytes >= 1, got "
                             f"{slots}, {slot_bytes}")
        remove_orphans()
        self.slots, self.slot_bytes = slots, slot_bytes
        self.ring = Region(slots * slot_bytes, slots, slot_bytes)
        self.shared: list[Region] = []
        self.adopted: list[Region] = []  # referenced like shared ones; their owners unlink them
        self.free = list(range(slots))
        #: bytes at the start of each slot whose pages are allocated: a slot's
        #: pages are taken from /dev/shm as its rows first need them
        #: (``_take_slot``), not all at load, where most would stay unused
        self.allocated = [0] * slots
        #: the largest allocation refused since the last that got as much (0: none)
        self.refused_bytes = 0
        #: slots handed out by ``take`` and not claimed yet: slot -> _Taken
        self.taken: dict[int, _Taken] = {}
        # Reentrant: a taken view's finalizer gives its slot back under it,
        # and the cyclic garbage collector may run that finalizer inside any
        # allocation, a locked section of this thread's included.
        self.lock = threading.RLock()
        self.generation = 0
        self.closed = False
        atexit.register(self.close)

    @property
    def names(self) -> list[str]:
        return [self.ring.name] + [region.name for region in (*self.shared, *self.adopted)]

    def share(self, array: np.ndarray) -> np.ndarray:
        """`array` copied once into a region of its own; returns the copy
        (rows of it handed to ``lease`` are not copied again). OSError
        where /dev/shm has no room for it."""
        array = np.ascontiguousarray(array)
        region = Region(max(array.nbytes, 1), reserve=True)
        self.shared.append(region)
        view = region.array(array.shape, array.dtype)
        view[...] = array
        return view

    def histories(self, slots: int, max_context: int) -> tuple[int, np.ndarray]:
        """(region key, a zeroed int32 [2, slots, max_context] array) in a
        region of its own marked as histories, its pages reserved (OSError
        where /dev/shm has no room): the decode loop's token histories, which
        the sampler instances read by ``history_ref`` (``histories``)."""
        region = Region(2 * slots * max_context * 4, slots, max_context, reserve=True,
                        magic=HISTORY_MAGIC)
        self.shared.append(region)
        return region.key, region.array((2, slots, max_context), np.int32)

    def allocate_ring(self) -> None:
        """Every slot's pages allocated now, or OSError where /dev/shm has no
        room for them: what page-locking the ring takes anyway, refused as
        an error rather than a fault inside the page-lock."""
        self.ring.reserve(0, self.ring.data_bytes)
        self.allocated = [self.slot_bytes] * self.slots

    def adopt(self, region: Region) -> None:
        """Rows that lie in `region`, a region owned elsewhere in this
        process that outlives the arena (the TensorRT-LLM bridge's staging
        block, which the device-to-host copy lands in), are referenced
        where they are, as rows of ``share``'s regions; ``close`` leaves
        it to its owner."""
        self.adopted.append(region)

    def reference(self, rows: np.ndarray, claim: bool = True) -> RowLease | None:
        """A lease of rows [B, V] where they already lie: in a shared region
        (no slot, no copy), or, with `claim`, exactly filling a view
        ``take`` handed out, whose slot the lease then holds (claimed once:
        the caller releases it); None for any other rows."""
        _check_rows(rows)
        size, vocab = rows.shape
        if rows.strides[1] == rows.itemsize and (size < 2 or rows.strides[0] >= vocab * rows.itemsize):
            for region in (*self.shared, *self.adopted):
                offset = region.contains(rows)
                if offset is not None:
                    return RowLease(self, region, -1, 0, offset, rows.strides[0], vocab,
                                    DTYPE_CODES[rows.dtype], size)
        return self._claim(rows) if claim else None

    def take(self, shape: tuple[int, int], dtype) -> np.ndarray | None:
        """A free slot's writable view of rows `shape` [B, V] in `dtype`, for
        the producer to fill before handing it on (the torch engine's
        device-to-host copy lands in it); None when no slot is free, the
        rows do not fit one or /dev/shm has no room for their pages (the
        producer puts them elsewhere). ``lease`` or
        ``reference`` of exactly this view claims the slot; unclaimed, the
        slot comes back by itself once the last array over the view is gone
        (the rows went another way, or the step failed)."""
        if np.dtype(dtype) not in DTYPE_CODES:
            return None
        taken = self._take_slot(shape, dtype)
        if taken is None:
            return None
        view, slot, generation = taken
        with self.lock:
            self.taken[slot] = _Taken(generation, view.shape, view.dtype, weakref.finalize(
                view, self._give_back_unclaimed, slot, generation))
        return view

    def lease(self, rows: np.ndarray) -> RowLease | None:
        """Rows [B, V] (float32 / float16 / bfloat16 numpy) in a region:
        where they are when they already lie in a shared region or fill a
        view ``take`` handed out, else copied into a free slot. None when no
        slot is free, the rows do not fit one or /dev/shm has no room for
        their pages (the caller sends them another way)."""
        found = self.reference(rows)
        if found is not None:
            return found
        taken = self._take_slot(rows.shape, rows.dtype)
        if taken is None:
            return None
        view, slot, generation = taken
        view[...] = rows  # the one copy on our side
        return self._slot_lease(rows, slot, generation)

    def _take_slot(self, shape: tuple[int, int], dtype) -> tuple[np.ndarray, int, int] | None:
        """A free slot, now taken (its generation bumped): (a view of rows
        `shape` in `dtype` over it, slot, generation); None when the rows do
        not fit a slot, none is free, /dev/shm has no room for their pages
        or the arena is closed."""
        dtype = np.dtype(dtype)
        nbytes = shape[0] * shape[1] * dtype.itemsize
        if nbytes > self.slot_bytes:
            return None
        with self.lock:
            if not self.free or self.closed:
                return None
            slot = self.free.pop()
        # outside the lock: allocating a large slot's pages takes a while, once
        if nbytes > self.allocated[slot] and not self._allocate_slot(slot, nbytes):
            with self.lock:
                self.free.append(slot)
            return None
        with self.lock:
            if self.closed:  # while the pages were allocated
                self.free.append(slot)
                return None
            self.generation += 1
            generation = self.generation
            self.ring.header[HEADER_WORDS + slot] = generation
        return self.ring.array(shape, dtype, slot * self.slot_bytes), slot, generation

    def _allocate_slot(self, slot: int, nbytes: int) -> bool:
        """The pages of `slot`'s first `nbytes` allocated (those past what it
        had); False where they cannot be (/dev/shm has no room): the rows
        then go another way (the BLS request), with no SIGBUS. Logged once,
        and once more when an allocation as large succeeds again."""
        had = self.allocated[slot]
        try:
            self.ring.reserve(slot * self.slot_bytes + had, nbytes - had)
        except OSError as error:
            if not self.refused_bytes:
                log.warning("row arena: %s; rows go inside the requests until there is room", error)
            self.refused_bytes = max(self.refused_bytes, nbytes)
            return False
        if self.refused_bytes and nbytes >= self.refused_bytes:
            log.warning("row arena: %s has room again for %d bytes; rows go through the arena",
                        SHM_DIR, nbytes)
            self.refused_bytes = 0
        self.allocated[slot] = nbytes
        return True

    def _slot_lease(self, rows: np.ndarray, slot: int, generation: int) -> RowLease:
        size, vocab = rows.shape
        return RowLease(self, self.ring, slot, generation, slot * self.slot_bytes,
                        vocab * rows.itemsize, vocab, DTYPE_CODES[rows.dtype], size)

    def _claim(self, rows: np.ndarray) -> RowLease | None:
        """The lease of the taken slot `rows` fill exactly, claimed (its
        finalizer dropped); None for any other rows."""
        offset = self.ring.contains(rows)
        if offset is None or offset % self.slot_bytes or not rows.flags.c_contiguous:
            return None
        slot = offset // self.slot_bytes
        with self.lock:
            taken = self.taken.get(slot)
            if taken is None or taken.shape != rows.shape or taken.dtype != rows.dtype:
                return None
            del self.taken[slot]
        taken.finalizer.detach()
        return replace(self._slot_lease(rows, slot, taken.generation), claimed=True)

    def _give_back_unclaimed(self, slot: int, generation: int) -> None:
        """A taken view's finalizer: its slot back, unless it was claimed."""
        with self.lock:
            taken = self.taken.get(slot)
            if taken is not None and taken.generation == generation:
                del self.taken[slot]
                self._release(slot, generation)

    def _release(self, slot: int, generation: int) -> None:
        with self.lock:
            if self.ring.header[HEADER_WORDS + slot] == generation:
                self.ring.header[HEADER_WORDS + slot] = 0
            self.free.append(slot)

    def close(self) -> None:
        """Unlink every region (idempotent)."""
        if self.closed:
            return
        self.closed = True
        for region in [self.ring, *self.shared]:
            region.unlink()
        atexit.unregister(self.close)
