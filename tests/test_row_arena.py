"""The shared-memory row arena: rows written once by the owner, read in
place by other processes, slots given back only when asked, nothing left
in /dev/shm."""
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from simple_sampler import row_arena
from simple_sampler.row_arena import (PREFIX, SHM_DIR, RowArena, StaleRows, pid_namespace, region_name,
                                      remove_orphans)
from simple_sampler.row_reader import RowReader


def regions() -> set[str]:
    """This process's arena regions (other tests' servers may run beside it)."""
    mine = f"-{os.getpid()}-"
    return {name for name in os.listdir(SHM_DIR) if name.startswith(PREFIX) and mine in name}


@pytest.fixture
def arena():
    before = regions()
    arena = RowArena(slots=3, slot_bytes=8 * 1000 * 4)
    yield arena
    arena.close()
    assert regions() == before, "the arena left a region in /dev/shm"


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_a_reader_sees_the_rows_in_place_in_their_own_dtype(arena, dtype):
    rows = np.random.default_rng(0).standard_normal((8, 1000)).astype(dtype)
    lease = arena.lease(rows)
    reader = RowReader()
    got = reader.rows(lease.refs(2, 6))
    assert got.dtype == np.dtype(dtype) and got.shape == (4, 1000)
    assert not got.flags.writeable
    np.testing.assert_array_equal(got.view(np.uint8), rows[2:6].view(np.uint8))
    # The reader's array is a view of the mapping, not a copy of it.
    mapped = reader.maps[lease.region.key][0]
    start = np.frombuffer(mapped, np.uint8).ctypes.data
    assert start <= got.ctypes.data < start + len(mapped)


def test_slots_are_reused_only_after_release_and_stale_refs_are_caught(arena):
    rows = np.ones((2, 1000), np.float32)
    leases = [arena.lease(rows) for _ in range(3)]
    assert len({lease.slot for lease in leases}) == 3
    assert arena.lease(rows) is None, "a full ring must refuse, not overwrite"
    refs = leases[0].refs()
    reader = RowReader()
    reader.rows(refs)
    leases[0].release()
    with pytest.raises(StaleRows):
        reader.check(refs)
    with pytest.raises(StaleRows):
        reader.rows(refs)
    again = arena.lease(rows * 2)
    assert again is not None and again.generation > leases[2].generation
    assert reader.rows(again.refs())[0, 0] == 2.0


def test_rows_too_big_for_a_slot_are_refused(arena):
    assert arena.lease(np.zeros((9, 1000), np.float32)) is None


def test_shared_rows_are_referenced_where_they_lie(arena):
    bank = arena.share(np.arange(20 * 1000, dtype=np.float32).reshape(20, 1000))
    free = len(arena.free)
    lease = arena.lease(bank[5:9])
    assert lease.slot == -1 and len(arena.free) == free, "no slot, no copy"
    got = RowReader().rows(lease.refs(1, 3))
    np.testing.assert_array_equal(got, bank[6:8])
    lease.release()


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_a_taken_slot_filled_in_place_is_claimed_once_with_no_copy(arena, dtype):
    view = arena.take((4, 1000), dtype)
    assert view.dtype == np.dtype(dtype) and view.flags.writeable
    view[...] = np.arange(4000, dtype=np.float32).reshape(4, 1000).astype(dtype)
    free = len(arena.free)
    rows = view.view(np.int16).view(dtype)  # another array over the same memory, as torch's
    lease = arena.reference(rows)
    assert lease.slot >= 0 and len(arena.free) == free, "the taken slot, no other"
    assert arena.ring.contains(view) == lease.offset
    got = RowReader().rows(lease.refs(1, 3))
    np.testing.assert_array_equal(got.view(np.uint8), view[1:3].view(np.uint8))
    assert arena.reference(rows) is None, "claimed once: a second claim finds no taken slot"
    again = arena.lease(view)
    assert again.slot not in (-1, lease.slot), "not claimed again: copied like any rows"
    again.release()
    lease.release()
    del view, rows
    assert sorted(arena.free) == [0, 1, 2], "each slot given back once, by its lease"


def test_a_taken_slot_nobody_claims_comes_back_when_its_rows_die(arena):
    view = arena.take((2, 1000), np.float32)
    slot = arena.ring.contains(view) // arena.slot_bytes
    rows = view[:]  # the last array over the slot keeps it
    del view
    assert slot not in arena.free
    del rows
    assert sorted(arena.free) == [0, 1, 2] and not arena.taken
    assert int(arena.ring.header[3 + slot]) == 0, "its generation cleared"


def test_only_exactly_the_taken_view_is_claimed(arena):
    view = arena.take((4, 1000), np.float32)
    view[...] = 1.0
    for other in (view[1:], view[:2], view[:, :500], view.astype(np.float16)):
        lease = arena.reference(other)
        assert lease is None or lease.slot == -1
    lease = arena.lease(view[:2])  # copied into another slot
    assert lease.slot != arena.ring.contains(view) // arena.slot_bytes
    lease.release()
    assert arena.reference(view) is not None


def test_a_reader_of_a_recycled_taken_slot_fails_loudly(arena):
    view = arena.take((2, 1000), np.float32)
    view[...] = 1.0
    lease = arena.lease(view)
    refs, reader = lease.refs(), RowReader()
    reader.rows(refs)
    lease.release()
    del view
    recycled = [arena.take((2, 1000), np.float32) for _ in range(3)]
    assert all(v is not None for v in recycled) and arena.take((2, 1000), np.float32) is None
    with pytest.raises(StaleRows):
        reader.rows(refs)
    with pytest.raises(StaleRows):
        reader.check(refs)


def test_take_refuses_rows_that_do_not_fit_a_slot(arena):
    assert arena.take((9, 1000), np.float32) is None
    assert arena.take((16, 1000), ml_dtypes.bfloat16) is not None, "half the bytes fit"
    assert arena.take((2, 1000), np.int32) is None


def test_bad_references_are_refused_with_the_reason(arena):
    lease = arena.lease(np.zeros((4, 1000), np.float32))
    reader = RowReader()
    refs = lease.refs()
    with pytest.raises(ValueError, match=r"shape \[B, 6\]"):
        reader.rows(refs[:, :4])
    bad = refs[:1].copy()
    bad[:, 4] = 100_000  # V past the slot
    with pytest.raises(ValueError, match="outside their slot"):
        reader.rows(bad)
    bad = refs.copy()
    bad[:, 0] += 1
    with pytest.raises(ValueError, match="does not exist"):
        reader.rows(bad)
    bad = refs.copy()
    bad[1, 3] += 2
    with pytest.raises(ValueError, match="evenly spaced"):
        reader.rows(bad)
    bad = refs.copy()
    bad[-1, 2] += 1  # another generation on one row
    with pytest.raises(ValueError, match="one region, slot, generation"):
        reader.rows(bad)
    bad = refs.copy()
    bad[:, 3] = bad[0, 3] + np.arange(len(bad))  # rows a byte apart
    with pytest.raises(ValueError, match="do not overlap"):
        reader.rows(bad)


READER = """
import sys, numpy as np
from simple_sampler.row_reader import RowReader
refs = np.array(eval(sys.argv[1]), np.int64)
rows = RowReader().rows(refs)
print(float(rows.astype(np.float64).sum()), rows.flags.writeable)
"""


def test_another_process_maps_the_arena_by_name_read_only(arena):
    rows = np.random.default_rng(1).standard_normal((4, 1000)).astype(np.float32)
    lease = arena.lease(rows)
    out = subprocess.run([sys.executable, "-c", READER, repr(lease.refs().tolist())],
                         capture_output=True, text=True, check=True).stdout.split()
    assert float(out[0]) == pytest.approx(float(rows.astype(np.float64).sum()), rel=1e-6)
    assert out[1] == "False"


def test_a_dead_owners_regions_are_removed_by_the_next_arena(tmp_path, monkeypatch):
    """In a directory of its own (row_arena.SHM_DIR, here and in the dead
    owner), so that no other test's arena (pytest -n) removes the orphan first."""
    monkeypatch.setattr(row_arena, "SHM_DIR", str(tmp_path))
    script = ("import os, sys; from simple_sampler import row_arena; "
              "row_arena.SHM_DIR = sys.argv[1]; "
              "a = row_arena.RowArena(1, 4096); print(a.ring.name, flush=True); os._exit(0)")

    def orphan() -> str:
        name = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True,
                              text=True, check=True).stdout.strip()
        assert (tmp_path / name).exists(), "os._exit skips atexit: the region is an orphan"
        return name

    name = orphan()
    assert remove_orphans() == [name]
    assert not (tmp_path / name).exists()
    name = orphan()
    arena = RowArena(1, 4096)          # the next arena removes it, keeps its own
    try:
        assert not (tmp_path / name).exists()
        assert sorted(os.listdir(tmp_path)) == sorted(arena.names)
        assert remove_orphans() == []  # a living owner's regions are no orphans
    finally:
        arena.close()
    assert os.listdir(tmp_path) == []


def test_region_names_follow_from_the_key_and_the_pid_namespace():
    assert region_name((1234 << 32) | 0xAB, 77) == f"{PREFIX}77-1234-000000ab"
    assert region_name((1234 << 32) | 0xAB) == f"{PREFIX}{pid_namespace()}-1234-000000ab"


def test_regions_of_another_pid_namespace_are_never_orphans():
    """Another container sharing /dev/shm: its owner's pid means nothing here."""
    path = os.path.join(SHM_DIR, region_name((2 ** 22 + 1) << 32, pid_namespace() + 1))
    open(path, "wb").close()
    try:
        assert os.path.basename(path) not in remove_orphans()
        assert os.path.exists(path)
    finally:
        os.unlink(path)


def no_room(fd, offset, length):
    raise OSError(28, "No space left on device")


@pytest.mark.parametrize("make", [lambda arena: arena.histories(4, 16),
                                  lambda arena: arena.share(np.ones((4, 1000), np.float32))],
                         ids=["histories", "share"])
def test_a_region_that_cannot_be_made_leaves_no_file(arena, monkeypatch, make):
    """A histories or shared region /dev/shm has no room for (its pages
    refused) raises OSError saying what to do, and its file is gone:
    ``close`` could not find it."""
    before = set(os.listdir(SHM_DIR))
    monkeypatch.setattr(row_arena.os, "posix_fallocate", no_room)
    with pytest.raises(OSError, match=r"has no room for .*No space left.*--shm-size"):
        make(arena)
    assert set(os.listdir(SHM_DIR)) - before == set()


def allocated_bytes(region) -> int:
    return os.stat(region.path).st_blocks * 512


def test_a_slots_pages_are_allocated_as_far_as_its_rows_reach(arena):
    """A ring slot's pages come from /dev/shm when rows first need them (a
    write into a page tmpfs cannot back is a SIGBUS, not an error), and no
    further than the rows reach: the rest of the ring stays unallocated."""
    before = allocated_bytes(arena.ring)
    view = arena.take((2, 1000), np.float32)  # not written yet: allocated all the same
    grown = allocated_bytes(arena.ring) - before
    assert 2 * 1000 * 4 <= grown < arena.slot_bytes, grown
    slot = arena.ring.contains(view) // arena.slot_bytes
    assert arena.allocated[slot] == 2 * 1000 * 4
    del view  # its slot comes back
    lease = arena.lease(np.ones((1, 1000), np.float32))  # within what the slot has
    assert lease.slot == slot and allocated_bytes(arena.ring) - before == grown
    lease.release()


def no_free_space(fd):
    return os.statvfs_result((4096, 4096, 1000, 0, 0, 1000, 0, 0, 0, 255))


@pytest.mark.parametrize("refusal", ["fallocate", "statvfs"])
def test_no_room_for_a_slots_pages_sends_rows_another_way(arena, monkeypatch, caplog, refusal):
    """/dev/shm full: ``lease`` and ``take`` answer None (the pool sends the
    rows inside the request) and every slot stays free. Where the free space
    says so, no fallocate is tried (a refused one takes every free page of
    tmpfs for a while). One warning says why; "room again" only once rows as
    large fit, not for smaller ones."""
    if refusal == "statvfs":
        monkeypatch.setattr(row_arena.os, "fstatvfs", no_free_space)
        monkeypatch.setattr(row_arena.os, "posix_fallocate", lambda *args: pytest.fail("tried"))
    else:
        monkeypatch.setattr(row_arena.os, "posix_fallocate", no_room)
    with caplog.at_level("WARNING", logger=row_arena.__name__):
        assert arena.lease(np.ones((2, 1000), np.float32)) is None
        assert arena.take((2, 1000), np.float32) is None
        assert sorted(arena.free) == [0, 1, 2] and arena.taken == {}
        monkeypatch.undo()
        small = arena.lease(np.full((1, 1000), 2.0, np.float32))
        small.release()
        assert len(caplog.records) == 1, "rows smaller than those refused prove no room"
        lease = arena.lease(np.full((2, 1000), 3.0, np.float32))
    assert lease is not None
    np.testing.assert_array_equal(RowReader().rows(lease.refs()), 3.0)
    lease.release()
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 2, messages
    assert "has no room for 8000 bytes" in messages[0] and "room again" in messages[1]


def test_a_slot_grown_allocates_only_the_pages_past_what_it_had(arena, monkeypatch):
    calls = []
    monkeypatch.setattr(row_arena.os, "posix_fallocate",
                        lambda fd, offset, length: calls.append((offset, length)))
    arena.lease(np.ones((1, 1000), np.float32)).release()
    arena.lease(np.ones((3, 1000), np.float32)).release()
    base = row_arena.HEADER_BYTES + arena.ring.contains(arena.take((1, 1000), np.float32))
    assert calls == [(base, 4000), (base + 4000, 8000)]


def test_the_trtllm_staging_block_is_reserved_when_made(monkeypatch):
    """The TensorRT-LLM worker writes the staging block from another
    process: a page /dev/shm cannot back would be its SIGBUS, so the whole
    block (and its header) is allocated when the server makes it, or refused
    then."""
    from simple_sampler.serving.trtllm_bridge import RowExchange, RowServer

    before = set(os.listdir(SHM_DIR))
    monkeypatch.setattr(row_arena.os, "posix_fallocate", no_room)
    with pytest.raises(OSError, match=r"has no room for 20096 bytes .*--shm-size"):
        RowServer(RowExchange(), 4, 1000)
    assert set(os.listdir(SHM_DIR)) - before == set()


def test_a_reader_lets_go_of_regions_unlinked_since(arena):
    """Mapping a new region drops the mappings of regions whose files are
    gone (a reloaded llm model's), which would stay charged while mapped."""
    reader = RowReader()
    old = RowArena(1, 64)
    try:
        reader.histories(old.histories(2, 4)[0])
    finally:
        old.close()
    key, _ = arena.histories(2, 4)
    reader.histories(key)
    assert list(reader.maps) == [key]


def test_a_reader_never_blocks_on_nor_follows_what_another_user_put_in_dev_shm(tmp_path):
    """/dev/shm is anyone's: a FIFO named as a region (whose open would block
    the sampler instance until a writer came), a link to another file, and a
    histories header saying zero slots are each refused at once, by name."""
    reader = RowReader()
    key = (os.getpid() << 32) | 0x5EED0001
    path = os.path.join(SHM_DIR, row_arena.region_name(key))
    try:
        os.mkfifo(path)
        with pytest.raises(ValueError, match="history_ref names .*, which is not a region"):
            reader.histories(key)
        os.unlink(path)
        target = tmp_path / "elsewhere"
        target.write_bytes(row_arena.HISTORY_MAGIC.tobytes() + bytes(8192))
        os.symlink(target, path)
        with pytest.raises(ValueError, match="which is not a region"):
            reader.histories(key)
        os.unlink(path)
        with open(path, "wb") as empty_header:  # SSHIST01, slots 0, max_context 0
            empty_header.write(row_arena.HISTORY_MAGIC.tobytes() + bytes(8192))
        with pytest.raises(ValueError, match="not the histories it says"):
            reader.histories(key)
    finally:
        if os.path.lexists(path):
            os.unlink(path)
