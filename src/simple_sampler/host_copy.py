"""A GPU's results brought to the host by a thread that sleeps while it waits
(:func:`to_host`), and a step's small inputs sent to it without a wait
(:func:`to_device`).

PyTorch never sets the device's scheduling flags, so CUDA runs with
``cudaDeviceScheduleAuto``: with fewer CUDA contexts than logical cores (any
one-GPU host) a thread waiting for the device, in ``cudaStreamSynchronize``
or in the blocking copy behind ``tensor.cpu()``, spins on its core for as
long as the device works. The data-plane thread waits for every forward, so
a spinning wait holds one core busy per GPU whatever the decode loop does,
and competes with the sampler threads and the stubs for the host's cores:
the resource this project exists to save (cores per GPU).

An event created with ``cudaEventBlockingSync`` (``torch.cuda.Event(blocking=
True)``) puts the waiting thread to sleep in the driver until the device
reaches it. vLLM's model runners wait on such events for the same reason
(``gpu_model_runner.py``'s ``prepare_inputs_event``, "Use blocking CUDA
events to avoid busy polling"), and SGLang's overlap scheduler waits on
events rather than spinning. The cost is a wake-up, microseconds, once per
wait.

The other way, a copy from pageable host memory (``tensor.copy_(cpu_tensor)``,
``torch.tensor(values, device=...)``) first waits, spinning, for everything
queued on the stream: on a step's inputs, the previous forward, or another
lane's. :func:`to_device` stages them in pinned memory and queues the copy.

:func:`sleep_until_done` and :func:`to_host` leave CPU tensors alone; torch
is imported inside the functions (this module is in the base layer, whose
users may not have torch).
"""
from __future__ import annotations

import numpy as np


def sleep_until_done(device) -> None:
    """Wait, asleep, for the work queued so far on `device`'s current
    stream (a CUDA ``torch.device``); no-op for any other device."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return
    done = torch.cuda.Event(blocking=True)
    done.record(torch.cuda.current_stream(device))
    done.synchronize()


def to_host(tensor):
    """`tensor` on the host: itself when it is there already; else copied
    into page-locked host memory (torch's caching host allocator: no
    allocation per call once warm) behind the work queued on its device's
    current stream, the caller asleep until the copy is done."""
    if tensor.device.type == "cpu":
        return tensor
    import torch

    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    sleep_until_done(tensor.device)
    return host


def to_device(device, *arrays: np.ndarray) -> list:
    """The host arrays as tensors on `device` (a ``torch.device``), in one
    transfer: a step's small inputs cost one copy, not one each, queued on
    the current stream from pinned memory, the caller not waiting (torch's
    caching host allocator keeps the pinned block until the copy is done).
    Each array keeps its dtype and shape (8-byte dtypes first keep every
    piece aligned). The CPU gets the same packed copy, unpinned: the
    tensors never alias the caller's arrays."""
    import torch

    arrays = [np.ascontiguousarray(array) for array in arrays]
    order = sorted(range(len(arrays)), key=lambda i: -arrays[i].itemsize)
    ends = np.cumsum([arrays[i].nbytes for i in order])
    packed = np.empty(int(ends[-1]) if ends.size else 0, np.uint8)
    for i, end in zip(order, ends):
        packed[end - arrays[i].nbytes:end] = arrays[i].reshape(-1).view(np.uint8)
    moved = torch.from_numpy(packed)
    if device.type != "cpu":
        moved = moved.pin_memory().to(device, non_blocking=True)
    out = [None] * len(arrays)
    for i, end in zip(order, ends):
        dtype = torch.from_numpy(np.empty(0, arrays[i].dtype)).dtype
        if not arrays[i].size:  # an empty piece's stride does not allow the view
            out[i] = torch.empty(arrays[i].shape, dtype=dtype, device=moved.device)
            continue
        out[i] = moved[end - arrays[i].nbytes:end].view(dtype).view(arrays[i].shape)
    return out
