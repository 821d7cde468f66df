"""SamplerClient.close against a server that still holds a region."""
from __future__ import annotations

import pytest
from tritonclient.utils import InferenceServerException

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
