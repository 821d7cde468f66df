"""How the clients end a gRPC stream, against fake calls: a request
whose final response (or error) came is left for Triton to end, never
cancelled (a cancel racing Triton 2.51's end of the call leaks the request,
and the model never unloads: docs/RELIABILITY.md, "Stopping after a load"); a caller
leaving early cancels it (that stops the generation)."""
import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import tritonclient.grpc

from simple_sampler.client import AsyncGenerateClient, GenerateClient, GenerationError
from simple_sampler.client import aio


class Result:
    def __init__(self, text: str, finish_reason: str = ""):
        self.arrays = {"text_output": np.array([text.encode()], dtype=object)}
        if finish_reason:
            self.arrays["finish_reason"] = np.array([finish_reason.encode()], dtype=object)

    def as_numpy(self, name):
        return self.arrays.get(name)


class Error(Exception):
    def message(self):
        return "shutting down"


class FakeCall:
    """tritonclient.grpc.aio's stream: (result, error) pairs, then the end
    of the call (Triton's OK status) unless `hangs`, or once `end` is set."""

    def __init__(self, responses, hangs: bool = False, end: asyncio.Event | None = None):
        self.responses, self.hangs, self.end = list(responses), hangs, end
        self.cancelled = self.ended = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.responses:
            return self.responses.pop(0)
        if self.hangs:
            await asyncio.sleep(3600)
        if self.end is not None:
            await self.end.wait()
        self.ended = True
        raise StopAsyncIteration

    def cancel(self):
        self.cancelled = True


#: get_model_config(as_json=True) of a model that batches (the clients read it once)
BATCHING_CONFIG = {"config": {"name": "llm", "max_batch_size": 64}}


class FakeConnection:
    def __init__(self, call: FakeCall):
        self.call = call

    async def get_model_config(self, model, as_json=False, client_timeout=None):
        return BATCHING_CONFIG

    def stream_infer(self, requests, stream_timeout=None):
        return self.call

    async def close(self):
        pass


def client_of(call: FakeCall) -> AsyncGenerateClient:
    client = AsyncGenerateClient("127.0.0.1:1", "grpc", model="llm")
    client._connection = FakeConnection(call)
    return client


async def first_chunks(client, count: int):
    stream = client.stream("hi", max_tokens=4)
    chunks = []
    async for chunk in stream:
        chunks.append(chunk)
        if len(chunks) == count:
            break
    await stream.aclose()
    return chunks


def test_a_finished_stream_is_left_for_triton_to_end_not_cancelled():
    call = FakeCall([(Result("a"), None), (Result("b", "length"), None)])
    chunks = asyncio.run(first_chunks(client_of(call), 2))
    assert [c.text for c in chunks] == ["a", "b"] and chunks[-1].finish_reason == "length"
    assert call.ended and not call.cancelled


def test_an_error_ends_the_request_and_is_left_for_triton_to_end():
    call = FakeCall([(Result("a"), None), (None, Error())])
    with pytest.raises(GenerationError, match="shutting down"):
        asyncio.run(first_chunks(client_of(call), 3))
    assert call.ended and not call.cancelled


def test_a_caller_leaving_mid_stream_cancels_it():
    call = FakeCall([(Result("a"), None), (Result("b"), None), (Result("c", "length"), None)])
    assert [c.text for c in asyncio.run(first_chunks(client_of(call), 1))] == ["a"]
    assert call.cancelled and not call.ended


def test_a_caller_cancelled_while_its_finished_call_ends_leaves_it_to_end():
    async def run():
        end = asyncio.Event()
        call = FakeCall([(Result("a", "stop"), None)], end=end)
        reader = asyncio.ensure_future(first_chunks(client_of(call), 1))
        await asyncio.sleep(0.01)  # the final response came: the call is ending
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        end.set()
        await asyncio.sleep(0.01)
        return call
    call = asyncio.run(run())
    assert call.ended and not call.cancelled


def test_a_stream_that_does_not_end_after_its_final_response_is_cancelled(monkeypatch):
    monkeypatch.setattr(aio, "STREAM_END_TIMEOUT_S", 0.05)
    call = FakeCall([(Result("a", "stop"), None)], hangs=True)
    assert [c.finish_reason for c in asyncio.run(first_chunks(client_of(call), 1))] == ["stop"]
    assert call.cancelled


class SyncResult(Result):
    def __init__(self, text: str, finish_reason: str = "", final: bool = False):
        super().__init__(text, finish_reason)
        flag = SimpleNamespace(bool_param=final)
        self.response = SimpleNamespace(outputs=[text] if text else [],
                                        parameters={"triton_final_response": flag})

    def get_response(self):
        return self.response


class FakeSyncClient:
    """tritonclient.grpc's client: the stream's callback gets `responses`;
    records how the stream was stopped."""
    responses: list = []
    stops: list = []

    def __init__(self, url):
        pass

    def get_model_config(self, model, as_json=False, client_timeout=None):
        return BATCHING_CONFIG

    def start_stream(self, callback, stream_timeout=None):
        self.callback = callback

    def async_stream_infer(self, model, inputs, **kwargs):
        for result, error in self.responses:
            self.callback(result, error)

    def stop_stream(self, cancel_requests=False):
        if not FakeSyncClient.stops:
            FakeSyncClient.stops.append(cancel_requests)

    def close(self):
        pass


@pytest.mark.parametrize("responses, count, cancelled", [
    ([(SyncResult("a"), None), (SyncResult("b", "length"), None), (SyncResult("", final=True), None)],
     3, False),
    ([(SyncResult("a"), None), (None, Error())], 3, False),
    ([(SyncResult("a"), None), (SyncResult("b"), None)], 1, True),
], ids=["final-flag", "error", "caller-leaves"])
def test_the_sync_client_cancels_only_a_stream_its_caller_left(monkeypatch, responses, count,
                                                              cancelled):
    monkeypatch.setattr(tritonclient.grpc, "InferenceServerClient", FakeSyncClient)
    monkeypatch.setattr(FakeSyncClient, "responses", responses)
    monkeypatch.setattr(FakeSyncClient, "stops", [])
    stream = GenerateClient("127.0.0.1:1", "grpc", model="llm").stream("hi", max_tokens=4)
    try:
        for index, _ in enumerate(stream, 1):
            if index == count:
                break
    except GenerationError:
        pass
    stream.close()
    assert FakeSyncClient.stops == [cancelled]
