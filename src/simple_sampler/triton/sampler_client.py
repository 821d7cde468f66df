"""Calling the `simple_sampler` model from outside the server, over HTTP or
gRPC, with the logits inline or in system shared memory (as a serious
client does: the rows are written once into a region the server maps, and
only the small parameter tensors travel in the request). The tensors are
``sampler_codec``'s (``batch_arrays``, ``compact_arrays``).
"""
from __future__ import annotations

import os
import time
import uuid
from typing import Mapping

import ml_dtypes
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as system_shm
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from ..row_arena import SHM_DIR, allocate_pages

PROTOCOLS = {"http": httpclient, "grpc": grpcclient}
#: how long ``close`` waits for the server to let go of a region
UNREGISTER_WAIT_S = 10.0


def triton_dtype(array: np.ndarray) -> str:
    if array.dtype == ml_dtypes.bfloat16:
        return "BF16"
    return np_to_triton_dtype(array.dtype)


#: gRPC's reconnect backoff, first and most: its default grows to 120 s, so
#: a sampler host back from a restart waited out a backoff of seconds before
#: its clients' channels tried it again (test_sampler_pool's reconnect test). Not its minimum
#: (``grpc.min_reconnect_backoff_ms``), which is also the least time a
#: connection may take to open (gRPC core, subchannel.cc,
#: ``ParseArgsForBackoffValues``: 20 s by default): a far or busy host
#: could then never be reached.
RECONNECT_BACKOFF_MS = (250, 1000)


def grpc_channel_args() -> list[tuple[str, int]]:
    """tritonclient's own channel options (unlimited messages, its keepalive
    defaults: ``InferenceServerClient.__init__`` uses them unless given
    others) and a reconnect backoff of RECONNECT_BACKOFF_MS."""
    keepalive = grpcclient.KeepAliveOptions()
    first, most = RECONNECT_BACKOFF_MS
    return [("grpc.max_send_message_length", grpcclient.MAX_GRPC_MESSAGE_SIZE),
            ("grpc.max_receive_message_length", grpcclient.MAX_GRPC_MESSAGE_SIZE),
            ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", keepalive.keepalive_permit_without_calls),
            ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
            ("grpc.initial_reconnect_backoff_ms", first),
            ("grpc.max_reconnect_backoff_ms", most)]


class SamplerClient:
    """One connection to a server's sampler model.

    protocol: "http" or "grpc"; url: host:port of that protocol.
    """

    def __init__(self, url: str, protocol: str = "http", model: str = "simple_sampler"):
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
        self.module = PROTOCOLS[protocol]
        self.client = self.module.InferenceServerClient(
            url, **({"channel_args": grpc_channel_args()} if protocol == "grpc" else {}))
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
        try:
            for name, shared in self._regions:
                self._unregister(name)
                shared.destroy()
        finally:
            self._regions.clear()
            self.client.close()

    def _unregister(self, name: str) -> None:
        """Unregister region `name`, waiting while the server still holds it.
        Triton counts the in-flight requests that reference a region and
        refuses to unregister it until they are released ("... it is
        currently in use"); a request may be released only after its
        response has reached the client, so a close right after the last
        answer can come first (seen with the machine under load)."""
        deadline = time.monotonic() + UNREGISTER_WAIT_S
        while True:
            try:
                self.client.unregister_system_shared_memory(name)
                return
            except InferenceServerException as error:
                if "currently in use" not in str(error) or time.monotonic() > deadline:
                    raise
            time.sleep(0.02)


class SharedLogits:
    """A system shared-memory region holding one [B, V] logits array."""

    def __init__(self, logits: np.ndarray):
        self.name = f"simple-sampler-{uuid.uuid4().hex[:12]}"
        self.key = f"/{self.name}"
        self.shape = list(logits.shape)
        self.datatype = triton_dtype(logits)
        self.nbytes = logits.nbytes
        self.handle = system_shm.create_shared_memory_region(self.name, self.key, self.nbytes)
        try:  # its pages now, or OSError: a copy into pages /dev/shm cannot back is a SIGBUS
            fd = os.open(os.path.join(SHM_DIR, self.name), os.O_RDWR | os.O_NOFOLLOW)
            try:
                allocate_pages(fd, 0, self.nbytes, self.name)
            finally:
                os.close(fd)
        except BaseException:
            self.destroy()
            raise
        system_shm.set_shared_memory_region(self.handle, [np.ascontiguousarray(logits)])

    def destroy(self) -> None:
        system_shm.destroy_shared_memory_region(self.handle)
