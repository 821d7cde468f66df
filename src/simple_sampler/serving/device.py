"""Where the torch engine runs: ``LlmSettings.device`` and ``torch_dtype``
resolved against this machine, with the refusals a user can act on; and
host memory page-locked for a GPU's copies (:func:`page_lock`, undone by
:func:`page_unlock`).

``settings.LlmSettings.check`` refuses what is wrong on any machine (a
dtype other than float32 on the CPU, batch_invariant on CUDA, these settings
on another engine); :func:`resolve` refuses what this machine cannot run: a
torch built without CUDA, no visible GPU, bfloat16 on a GPU without it.
"""
from __future__ import annotations

import threading

import torch

#: cudaHostRegisterPortable (cuda_runtime_api.h): the registration is seen
#: by every CUDA context, not only the current device's
CUDA_HOST_REGISTER_PORTABLE = 1

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve(device: str = "cpu", dtype: str = "float32") -> tuple[torch.device, torch.dtype]:
    """``(torch.device, torch.dtype)`` for the settings' names; RuntimeError
    naming the setting and what to do when this machine cannot run them."""
    if dtype not in DTYPES:
        raise ValueError(f"torch_dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if device == "cpu":
        return torch.device("cpu"), DTYPES[dtype]
    if device != "cuda":
        raise ValueError(f"device must be cpu or cuda, got {device!r}")
    if torch.version.cuda is None:
        raise RuntimeError(f"device cuda: this torch ({torch.__version__}) was built without "
                           f"CUDA; a CUDA build of torch is needed (or device cpu)")
    if not torch.cuda.is_available():
        raise RuntimeError("device cuda: no CUDA GPU is visible to this process (check "
                           "nvidia-smi, CUDA_VISIBLE_DEVICES and, in a container, --gpus)")
    if dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        name = torch.cuda.get_device_name()
        raise RuntimeError(f"torch_dtype bfloat16: {name} has no bfloat16 support; use "
                           f"float16 or float32")
    return torch.device("cuda", torch.cuda.current_device()), DTYPES[dtype]


def page_lock(address: int, nbytes: int, device: torch.device) -> str | None:
    """Register `nbytes` of host memory at `address` with CUDA
    (``cudaHostRegister``, portable: pinned for every device's context,
    whichever GPU the rows come from), so that a device-to-host copy lands
    in it by DMA, with no pass through the driver's pinned bounce buffer
    that pageable memory takes. Returns None when CUDA registered it, else
    why not (the copies still work, pageable). The memory must stay mapped
    while registered, and be unregistered (:func:`page_unlock`) before it is
    unmapped: CUDA keeps a registration by address, so a later mapping at
    the same address would be refused as "already registered" and a copy
    meant for it could land in the old pages.

    The call runs on a short-lived thread of its own. A refused
    ``cudaHostRegister`` also sets the CUDA runtime's last error, which is
    kept per host thread until ``cudaGetLastError`` reads and resets it;
    torch's binding (``torch/csrc/cuda/shared/cudart.cpp``,
    ``initCudartBindings``, ``"cudaHostRegister"``) only returns the code
    (``C10_CUDA_ERROR_HANDLED`` is ``EXPR``, ``c10/cuda/CUDAException.h``)
    and exposes no ``cudaGetLastError``. Left on the caller's thread, its
    next kernel launch (torch checks ``cudaGetLastError`` after each launch,
    ``C10_CUDA_KERNEL_LAUNCH_CHECK``) would raise that stale error and fail
    the step. On a thread of its own the error ends with the thread."""
    outcome = {}

    def register() -> None:
        try:
            # `device`: a new thread's current device is 0, whose context
            # this process (another tensor-parallel rank's GPU) may not hold.
            torch.cuda.set_device(device)
            outcome["error"] = torch.cuda.cudart().cudaHostRegister(
                address, nbytes, CUDA_HOST_REGISTER_PORTABLE)
        except Exception as error:  # noqa: BLE001 - reported to the caller, copies still work
            outcome["error"] = f"{type(error).__name__}: {error}"

    return _on_own_thread("cudaHostRegister", "cuda-host-register", register, outcome)


def page_unlock(address: int, device: torch.device) -> str | None:
    """Undo :func:`page_lock` of the memory at `address` (``cudaHostUnregister``),
    after the last copy into it is done and before it is unmapped; on a
    thread of its own for the same reason. Returns None when CUDA
    unregistered it, else why not."""
    outcome = {}

    def unregister() -> None:
        try:
            torch.cuda.set_device(device)
            outcome["error"] = torch.cuda.cudart().cudaHostUnregister(address)
        except Exception as error:  # noqa: BLE001 - reported to the caller
            outcome["error"] = f"{type(error).__name__}: {error}"

    return _on_own_thread("cudaHostUnregister", "cuda-host-unregister", unregister, outcome)


def _on_own_thread(name: str, thread_name: str, call, outcome: dict) -> str | None:
    """Runs `call` on a short-lived thread (:func:`page_lock`'s docstring: a
    refusal's sticky error ends with the thread); None when the CUDA call
    it made returned success, else what it returned or raised."""
    thread = threading.Thread(target=call, name=thread_name)
    thread.start()
    thread.join()
    error = outcome["error"]  # torch's cudaError (0: success), or what was raised
    if not isinstance(error, str) and int(error) == 0:
        return None
    return f"{name} returned {error}"
