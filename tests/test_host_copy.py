"""host_copy: a GPU's results reach the host while the waiting thread
sleeps. On the CPU both functions leave tensors alone; the CUDA tests (the
copy, and a long kernel waited for with little CPU) skip without a GPU (none
here: that path has not run)."""
import time

import torch

from simple_sampler.host_copy import sleep_until_done, to_host
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
