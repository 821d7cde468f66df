"""host_copy: a GPU's results reach the host while the waiting thread
sleeps, and a step's small inputs reach the GPU in one queued copy. On the
CPU the waits leave tensors alone and ``to_device`` copies; the CUDA tests
(the copies, a long kernel waited for with little CPU, inputs queued behind
it without a wait) skip without a GPU (none here: that path has not run)."""
import time

import numpy as np
import torch

from simple_sampler.host_copy import sleep_until_done, to_device, to_host
from test_static_decode import CUDA


def test_a_host_tensor_stays_as_it_is():
    rows = torch.randn(3, 5, dtype=torch.bfloat16)
    assert to_host(rows) is rows
    sleep_until_done("cpu")  # nothing to wait for


@CUDA
def test_cuda_rows_reach_pinned_host_memory_in_their_dtype():
    rows = torch.randn(4, 1000, device="cuda").to(torch.bfloat16)
    host = to_host(rows * 2)
    assert host.device.type == "cpu" and host.is_pinned() and host.dtype == torch.bfloat16
    assert torch.equal(host, (rows * 2).cpu())


@CUDA
def test_cuda_the_waiting_thread_sleeps_through_a_long_kernel():
    """A kernel of a few hundred milliseconds waited for: the thread's CPU
    time is a small part of the wait's (a spinning wait's is all of it)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(500_000_000)  # cycles: ~0.25-0.35 s at an H100/H200's clocks
    wall, cpu = time.perf_counter(), time.thread_time()
    sleep_until_done(torch.device("cuda"))
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    assert wall > 0.05, wall
    assert cpu < 0.25 * wall, (cpu, wall)


def test_inputs_arrive_in_their_own_dtypes_and_shapes_as_copies():
    """One packed transfer, cut back into each array's dtype and shape (the
    static engine's [2, b] tokens and positions among them), the CPU's
    through the same packing: copies, never views of the caller's arrays."""
    flags = np.array([1, 0, 1], np.int32)
    table = np.arange(8, dtype=np.int64).reshape(2, 4)
    scale = np.array([0.5, 2.0], np.float32)
    moved = to_device(torch.device("cpu"), flags, table, scale)
    assert [t.dtype for t in moved] == [torch.int32, torch.int64, torch.float32]
    assert [tuple(t.shape) for t in moved] == [(3,), (2, 4), (2,)]
    assert [t.tolist() for t in moved] == [flags.tolist(), table.tolist(), scale.tolist()]
    table[0, 0] = 99
    assert moved[1][0, 0] == 0
    # a step with nothing of a kind (no history, no bans): empty pieces
    empty, scale = to_device(torch.device("cpu"), np.array([], np.int64), scale)
    assert empty.dtype == torch.int64 and tuple(empty.shape) == (0,)
    assert scale.tolist() == [0.5, 2.0]


@CUDA
def test_cuda_inputs_are_queued_behind_a_long_kernel_without_a_wait():
    """Mixed dtypes packed into one pinned transfer arrive intact, and the
    call returns while a kernel of a few hundred milliseconds still runs (a
    copy from pageable memory would wait for it first)."""
    keys = np.arange(8, dtype=np.int64).reshape(2, 4)
    flags = np.array([1, 0, 1], np.int32)
    scale = np.array([0.25, 4.0], np.float64)
    torch.cuda.synchronize()
    torch.cuda._sleep(500_000_000)
    wall = time.perf_counter()
    moved = to_device(torch.device("cuda"), flags, keys, scale)
    wall = time.perf_counter() - wall
    assert wall < 0.05, wall
    assert [t.device.type for t in moved] == ["cuda"] * 3
    assert [t.dtype for t in moved] == [torch.int32, torch.int64, torch.float64]
    assert tuple(moved[1].shape) == (2, 4)
    assert [t.cpu().tolist() for t in moved] == [flags.tolist(), keys.tolist(), scale.tolist()]
