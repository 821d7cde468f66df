"""The torch and static engines' device-to-host copy into a slot of the row
arena (``TorchEngine.share_rows``, ``torch_engine.stage_rows``): the rows
land in a slot the sampler pool claims with no copy of its own, a slot
nobody claims comes back, no free slot falls back to a fresh tensor, and
the ring is page-locked once for a GPU, a refusal leaving no CUDA error
behind. The staging itself runs here on CPU tensors; the page-lock and the
stream's synchronize are the GPU's alone (the last test, on a GPU)."""
import types

import pytest
import torch

from fakes import PerThreadCudart
from simple_sampler import row_arena
from simple_sampler.row_arena import RowArena
from simple_sampler.sampling import logits_array
from simple_sampler.serving.device import CUDA_HOST_REGISTER_PORTABLE, DTYPES as TORCH_DTYPES
from simple_sampler.serving.static_decode import StaticEngine
from simple_sampler.serving.torch_engine import TorchEngine, stage_rows
from simple_sampler.settings import LlmSettings
from simple_sampler.triton.sampler_setup import build_arena
from test_model_dtype_rows import SEEDED, full_row_pool
from test_torch_hot_first import VOCAB, generate, tiny_model

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture
def arena():
    arena = RowArena(slots=2, slot_bytes=8 * VOCAB * 4)  # float32 rows of 8 sequences
    yield arena
    arena.close()


def slot_of(arena: RowArena, rows: torch.Tensor) -> int | None:
    offset = arena.ring.contains(logits_array(rows))
    return None if offset is None else offset // arena.slot_bytes


@pytest.mark.parametrize("torch_dtype, itemsize", [("float32", 4), ("bfloat16", 2)])
def test_a_slot_holds_the_largest_step_in_the_models_dtype(torch_dtype, itemsize):
    """``build_arena`` sizes the slots for the engine's rows as they come
    (``EngineSpec.logits_dtype``): bfloat16 rows are not widened to fit."""
    settings = LlmSettings(engine="torch", device="cuda", torch_dtype=torch_dtype)
    engine = types.SimpleNamespace(max_batch_size=8, vocab_size=VOCAB)
    arena = build_arena(settings, engine)
    try:
        assert arena.slot_bytes == 8 * VOCAB * itemsize
        rows = torch.randn(8, VOCAB).to(TORCH_DTYPES[torch_dtype])
        assert slot_of(arena, stage_rows(rows, arena)) is not None
    finally:
        arena.close()


def test_an_engine_whose_rows_cannot_be_shared_keeps_the_arena(caplog):
    """``share_rows`` refused for want of room in /dev/shm (the simulated
    engine's bank): a warning, and the ring still carries the rows."""
    def share_rows(arena):
        raise OSError(28, "/dev/shm has no room for 1 bytes")

    engine = types.SimpleNamespace(max_batch_size=8, vocab_size=VOCAB, share_rows=share_rows)
    with caplog.at_level("WARNING"):
        arena = build_arena(LlmSettings(engine="simulated"), engine)
    try:
        assert arena is not None and "stay where they are" in caplog.text
    finally:
        arena.close()


@pytest.mark.parametrize("dtype", DTYPES)
def test_staged_rows_land_in_a_slot_the_pool_claims_without_a_copy(arena, dtype):
    rows = torch.randn(8, VOCAB).to(dtype)  # the largest step, in the model's dtype
    host = stage_rows(rows, arena)
    assert host.dtype == dtype and torch.equal(host, rows)
    slot = slot_of(arena, host)
    assert slot is not None and slot not in arena.free
    lease = arena.reference(logits_array(host))  # what SamplerPool.__call__ does first
    assert lease.slot == slot and lease.rows == 8
    lease.release()
    assert sorted(arena.free) == [0, 1]
    del host
    assert sorted(arena.free) == [0, 1], "a claimed slot is given back once, by its lease"


def test_unclaimed_staged_rows_give_their_slot_back_when_they_die(arena):
    host = stage_rows(torch.randn(3, VOCAB), arena)
    assert slot_of(arena, host) not in arena.free
    del host  # the rows went another way (no local target, an exception)
    assert sorted(arena.free) == [0, 1] and not arena.taken


def test_with_no_free_slot_or_no_arena_the_rows_go_to_a_fresh_tensor(arena):
    rows = torch.randn(4, VOCAB)
    held = [stage_rows(rows, arena) for _ in range(2)]
    assert {slot_of(arena, host) for host in held} == {0, 1}
    for host in (stage_rows(rows, arena), stage_rows(rows)):
        assert slot_of(arena, host) is None and torch.equal(host, rows)


@pytest.mark.parametrize("engine_class", [TorchEngine, StaticEngine])
def test_on_the_cpu_share_rows_changes_nothing(arena, engine_class, monkeypatch):
    """The CPU's rows are the forward's own output: no page-lock, no slot
    taken (the pool copies them once, off the event loop)."""
    cudart = PerThreadCudart(0)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    engine = engine_class(tiny_model("cpu"), max_batch_size=8, max_context=32)
    engine.share_rows(arena)
    engine.add("a", [1, 2, 3])
    rows = engine.step(["a"])
    assert engine.arena is None and not cudart.registered
    assert slot_of(arena, rows) is None and sorted(arena.free) == [0, 1]


@pytest.mark.parametrize("result", [0, 801])  # success, cudaErrorNotSupported
def test_the_ring_is_page_locked_once_for_the_engines_gpu(arena, monkeypatch, caplog, result):
    """``share_rows`` on a GPU engine registers the whole ring, portable, on
    the engine's device, from a thread of its own: a refusal leaves no CUDA
    error on the caller's thread (its next launch would raise it) and the
    copies still land in the arena, pageable (logged)."""
    cudart = PerThreadCudart(result)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.cuda, "set_device", cudart.set_device)
    engine = TorchEngine(tiny_model("cpu"), max_batch_size=8, max_context=32)
    engine.device = torch.device("cuda", 1)  # as far as share_rows looks
    with caplog.at_level("WARNING", logger="simple_sampler.serving.torch_engine"):
        engine.share_rows(arena)
    cudart.launch_check()
    [(thread, device, size, flags)] = cudart.registered
    assert thread.name == "cuda-host-register" and device == engine.device
    assert size == arena.ring.data_bytes == 2 * arena.slot_bytes
    assert flags == CUDA_HOST_REGISTER_PORTABLE
    assert arena.allocated == [arena.slot_bytes] * 2, "allocated before the page-lock took them"
    assert engine.arena is arena
    assert ("ring stays pageable: cudaHostRegister returned 801" in caplog.text) is bool(result)


def test_a_ring_dev_shm_has_no_room_for_is_not_page_locked(arena, monkeypatch, caplog):
    """Page-locking the ring takes all its pages: where /dev/shm has no
    room for them, the ring is not registered (no fault inside the
    page-lock), stays pageable (logged) and its slots are allocated as
    steps need them."""
    cudart = PerThreadCudart(0)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.cuda, "set_device", cudart.set_device)
    def no_room(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(row_arena.os, "posix_fallocate", no_room)
    engine = TorchEngine(tiny_model("cpu"), max_batch_size=8, max_context=32)
    engine.device = torch.device("cuda", 1)  # as far as share_rows looks
    with caplog.at_level("WARNING", logger="simple_sampler.serving.torch_engine"):
        engine.share_rows(arena)
    assert not cudart.registered and engine.arena is arena and engine.page_locked is None
    assert "ring stays pageable: [Errno 28] /dev/shm has no room for" in caplog.text
    assert arena.allocated == [0, 0]


@pytest.mark.parametrize("result", [0, 801])  # success, cudaErrorNotSupported
def test_closing_the_engine_unregisters_the_ring_it_page_locked(arena, monkeypatch, result):
    """CUDA keeps a registration by address after the memory is unmapped: a
    ring mapped later at the same address (the next arena of that size)
    would be refused and its copies could land in the old pages. So the
    engine's ``close`` (the llm model's finalize calls it before the arena's)
    unregisters what it registered, once, on a thread of its own, and
    nothing when CUDA refused the registration."""
    cudart = PerThreadCudart(result)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.cuda, "set_device", cudart.set_device)
    engine = TorchEngine(tiny_model("cpu"), max_batch_size=8, max_context=32)
    engine.device = torch.device("cuda", 1)  # as far as share_rows and close look
    engine.share_rows(arena)
    engine.close()
    engine.close()
    if result:
        assert cudart.unregistered == []
    else:
        [(thread, device, address)] = cudart.unregistered
        assert thread.name == "cuda-host-unregister" and device == engine.device
        assert address == arena.ring.data_address == cudart.addresses[0]
    assert engine.arena is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the device-to-host "
                    "copy into the page-locked ring (run where there is one: docs/GPU.md)")
@pytest.mark.parametrize("engine_class", [TorchEngine, StaticEngine])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_each_steps_rows_lie_in_the_arena_and_draw_the_same_tokens(
        arena, engine_class, dtype):
    def engine():
        return engine_class(tiny_model("cuda").to(dtype), max_batch_size=8, max_context=32)

    claimed, copied = [], []
    reference, lease = arena.reference, arena.lease
    arena.reference = lambda rows: claimed.append(
        arena.ring.contains(rows) is not None) or reference(rows)
    arena.lease = lambda rows: copied.append(rows.shape) or lease(rows)
    shared = engine()
    shared.share_rows(arena)
    assert shared.page_locked == arena.ring.data_address
    try:
        tokens = generate(shared, full_row_pool(arena), SEEDED)
    finally:
        shared.close()  # unregistered before the fixture unmaps the ring
    assert claimed and all(claimed), "every step's rows in a slot of the ring"
    assert not copied, "no step's rows copied into a slot by the pool"
    assert sorted(arena.free) == [0, 1] and not arena.taken
    separate = RowArena(slots=2, slot_bytes=arena.slot_bytes)
    try:
        assert generate(engine(), full_row_pool(separate), SEEDED) == tokens
    finally:
        separate.close()
    assert len({tuple(ids) for ids in tokens[:3]}) == 3  # different seeds, different draws
