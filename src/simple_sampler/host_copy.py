"""A GPU's results brought to the host by a thread that sleeps while it waits.

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

Both functions leave CPU tensors alone; torch is imported where a tensor is
on a GPU (this module is in the base layer, whose users may not have torch).
"""
from __future__ import annotations


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
