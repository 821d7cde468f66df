"""Calling the `simple_sampler` model from outside the server, over HTTP or
gRPC, with the logits inline or in system shared memory (as a serious
client does: the rows are written once into a region the server maps, and
only the small parameter tensors travel in the request).
"""
from __future__ import annotations

import uuid
from typing import Mapping

import ml_dtypes
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as system_shm
from tritonclient.utils import np_to_triton_dtype

from ..params import SamplingBatch
from ..schema import SAMPLER
from .sampler_io import PADDING, SCALAR_INPUTS

PROTOCOLS = {"http": httpclient, "grpc": grpcclient}


def triton_dtype(array: np.ndarray) -> str:
    if array.dtype == ml_dtypes.bfloat16:
        return "BF16"
    return np_to_triton_dtype(array.dtype)


def padded(offsets: np.ndarray, values: np.ndarray, dtype=np.int32, fill=PADDING) -> np.ndarray:
    """CSR lists as a [B, L] array right-padded with `fill` (L >= 1)."""
    lengths = np.diff(offsets)
    out = np.full((len(lengths), max(1, int(lengths.max(initial=0)))), fill, dtype=dtype)
    out[np.arange(out.shape[1])[None, :] < lengths[:, None]] = values
    return out


def batch_arrays(batch: SamplingBatch) -> dict[str, np.ndarray]:
    """The sampler inputs that carry `batch` (the inverse of decode_request).

    Banned ids travel as a logit bias of -inf, which the kernels treat
    exactly as a ban (a ban overrides any bias the same id had), so a batch
    from the decode loop (stop ids before min_tokens, bad words) needs no
    tensor of its own.
    """
    arrays = {}
    for name, (field, _) in SCALAR_INPUTS.items():
        arrays[name] = np.asarray(getattr(batch, field), dtype=SAMPLER.input(name).numpy)[:, None]
    arrays["random_seed"] = np.asarray(batch.seed, np.uint64)[:, None]
    arrays["step"] = np.asarray(batch.step, np.int64)[:, None]
    arrays["prompt_ids"] = padded(batch.prompt_offsets, batch.prompt_ids)
    arrays["generated_ids"] = padded(batch.output_offsets, batch.output_ids)
    bias_offsets, bias_ids, bias_values = _bias_with_bans(batch)
    if bias_ids.size:
        arrays["logit_bias_ids"] = padded(bias_offsets, bias_ids)
        arrays["logit_bias_values"] = padded(bias_offsets, bias_values, np.float32, 0.0)
    return arrays


def _bias_with_bans(batch: SamplingBatch):
    """CSR bias lists where every banned id is -inf (once per row), built
    with numpy (no loop over rows: this runs for every step's batch)."""
    bans = np.diff(batch.ban_offsets)
    if not bans.any():
        return batch.bias_offsets, batch.bias_ids, np.asarray(batch.bias_values, np.float64)
    rows = np.arange(len(batch))
    row = np.concatenate([np.repeat(rows, np.diff(batch.bias_offsets)), np.repeat(rows, bans)])
    ids = np.concatenate([batch.bias_ids, batch.ban_ids]).astype(np.int64)
    values = np.concatenate([batch.bias_values, np.full(batch.ban_ids.size, -np.inf)])
    is_ban = np.concatenate([np.zeros(batch.bias_ids.size, bool), np.ones(batch.ban_ids.size, bool)])
    order = np.lexsort((~is_ban, ids, row))  # by row, then id, a ban before a bias
    row, ids, values = row[order], ids[order], values[order]
    first = np.ones(row.size, bool)  # the first entry of each (row, id): the ban if any
    first[1:] = (row[1:] != row[:-1]) | (ids[1:] != ids[:-1])
    offsets = np.zeros(len(batch) + 1, np.int64)
    np.cumsum(np.bincount(row[first], minlength=len(batch)), out=offsets[1:])
    return offsets, ids[first], values[first]


class SamplerClient:
    """One connection to a server's sampler model.

    protocol: "http" or "grpc"; url: host:port of that protocol.
    """

    def __init__(self, url: str, protocol: str = "http", model: str = "simple_sampler"):
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
        self.module = PROTOCOLS[protocol]
        self.client = self.module.InferenceServerClient(url)
        self.model = model
        self._regions: list[tuple[str, object]] = []

    def inputs(self, arrays: Mapping[str, np.ndarray]) -> list:
        tensors = []
        for name, array in arrays.items():
            tensor = self.module.InferInput(name, list(array.shape), triton_dtype(array))
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        return tensors

    def sample(self, logits: np.ndarray | None = None, *, shm_logits: "SharedLogits | None" = None,
               timeout_s: float | None = None, **arrays: np.ndarray) -> dict[str, np.ndarray]:
        """Sample rows: `logits` inline, or `shm_logits` from a registered
        region; `arrays` are the other inputs by name; `timeout_s` limits a
        gRPC request. Returns output name -> array. Server errors raise
        tritonclient's InferenceServerException."""
        tensors = self.inputs(arrays)
        if shm_logits is not None:
            tensor = self.module.InferInput("logits", list(shm_logits.shape), shm_logits.datatype)
            tensor.set_shared_memory(shm_logits.name, shm_logits.nbytes)
            tensors.append(tensor)
        elif logits is not None:
            tensors += self.inputs({"logits": logits})
        limit = {"client_timeout": timeout_s} if timeout_s and self.module is grpcclient else {}
        result = self.client.infer(self.model, tensors, **limit)
        response = result.get_response()
        names = [o["name"] if isinstance(o, dict) else o.name for o in
                 (response["outputs"] if isinstance(response, dict) else response.outputs)]
        return {name: result.as_numpy(name) for name in names}

    def share(self, logits: np.ndarray) -> "SharedLogits":
        """Copy `logits` into a new system shared-memory region registered
        with the server; released by close()."""
        shared = SharedLogits(logits)
        self.client.register_system_shared_memory(shared.name, shared.key, shared.nbytes)
        self._regions.append((shared.name, shared))
        return shared

    def close(self) -> None:
        for name, shared in self._regions:
            self.client.unregister_system_shared_memory(name)
            shared.destroy()
        self._regions.clear()
        self.client.close()


class SharedLogits:
    """A system shared-memory region holding one [B, V] logits array."""

    def __init__(self, logits: np.ndarray):
        self.name = f"simple-sampler-{uuid.uuid4().hex[:12]}"
        self.key = f"/{self.name}"
        self.shape = list(logits.shape)
        self.datatype = triton_dtype(logits)
        self.nbytes = logits.nbytes
        self.handle = system_shm.create_shared_memory_region(self.name, self.key, self.nbytes)
        system_shm.set_shared_memory_region(self.handle, [np.ascontiguousarray(logits)])

    def destroy(self) -> None:
        system_shm.destroy_shared_memory_region(self.handle)
