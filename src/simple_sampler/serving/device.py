"""Where the torch engine runs: ``LlmSettings.device`` and ``torch_dtype``
resolved against this machine, with the refusals a user can act on.

``settings.LlmSettings.check`` refuses what is wrong on any machine (a
dtype other than float32 on the CPU, batch_invariant on CUDA, these settings
on another engine); :func:`resolve` refuses what this machine cannot run: a
torch built without CUDA, no visible GPU, bfloat16 on a GPU without it.
"""
from __future__ import annotations

import torch

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
