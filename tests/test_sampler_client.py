"""SamplerClient.close against a server that still holds a region;
SharedLogits' pages allocated before the copy."""
from __future__ import annotations

import os

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from simple_sampler import row_arena
from simple_sampler.triton import sampler_client
from simple_sampler.triton.sampler_client import SamplerClient


class _Region:
    destroyed = False

    def destroy(self) -> None:
        self.destroyed = True


class _Server:
    """A client whose unregister fails `busy` times with `message` first."""

    def __init__(self, busy: int, message: str):
        self.busy, self.message = busy, message
        self.unregistered, self.closed = [], False

    def unregister_system_shared_memory(self, name: str) -> None:
        if self.busy:
            self.busy -= 1
            raise InferenceServerException(self.message)
        self.unregistered.append(name)

    def close(self) -> None:
        self.closed = True


def _client(server: _Server) -> tuple[SamplerClient, _Region]:
    client = SamplerClient.__new__(SamplerClient)
    client.client, region = server, _Region()
    client._regions = [("rows", region)]
    return client, region


def test_close_waits_while_the_server_still_holds_the_region():
    server = _Server(3, "Cannot unregister shared memory region 'rows', it is currently in use.")
    client, region = _client(server)
    client.close()
    assert server.unregistered == ["rows"] and region.destroyed and server.closed


def test_close_raises_other_errors_at_once_and_still_closes():
    server = _Server(1, "Unable to find system shared memory region: 'rows'")
    client, region = _client(server)
    with pytest.raises(InferenceServerException, match="Unable to find"):
        client.close()
    assert server.unregistered == [] and not region.destroyed and server.closed


def test_close_gives_up_after_its_deadline(monkeypatch):
    monkeypatch.setattr(sampler_client, "UNREGISTER_WAIT_S", 0.05)
    server = _Server(10**9, "... it is currently in use.")
    client, _ = _client(server)
    with pytest.raises(InferenceServerException, match="currently in use"):
        client.close()
    assert server.closed


def test_logits_shared_where_dev_shm_has_room_for_them_or_refused_with_nothing_left(monkeypatch):
    """``SharedLogits`` allocates its region's pages before copying into
    them (a copy into pages a full /dev/shm cannot back is a SIGBUS): no
    room is an OSError and no region is left."""
    logits = np.arange(2 * 1000, dtype=np.float32).reshape(2, 1000)
    shared = sampler_client.SharedLogits(logits)
    try:
        path = os.path.join(row_arena.SHM_DIR, shared.name)
        assert os.stat(path).st_blocks * 512 >= logits.nbytes
        np.testing.assert_array_equal(np.fromfile(path, np.float32).reshape(2, 1000), logits)
    finally:
        shared.destroy()
    before = set(os.listdir(row_arena.SHM_DIR))

    def no_room(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(row_arena.os, "posix_fallocate", no_room)
    with pytest.raises(OSError, match="has no room for 8000 bytes"):
        sampler_client.SharedLogits(logits)
    assert set(os.listdir(row_arena.SHM_DIR)) == before
