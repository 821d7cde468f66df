"""LlmService, the llm model's logic, without Triton: every request ends with
one final response and leaves the decoder, whether it finishes, is bad, its
client cancels while tokens are flowing, or its client is gone."""
import threading

import numpy as np

from simple_sampler.serving.text import TextCodec
from simple_sampler.triton.llm_service import LlmService, LlmSettings
from test_decoder import FakeEngine, FakeTokenizer

MAX_TOKENS = 60


def inputs(text="a", max_tokens=MAX_TOKENS, stream=True):
    return {"text_input": np.array([[text.encode()]], dtype=object),
            "max_tokens": np.array([[max_tokens]], np.int32),
            "stream": np.array([[stream]])}


class Client:
    """Records responses; cancels (or fails, as a vanished client does) after `after`."""

    def __init__(self, after=None, fail=False):
        self.after, self.fail = after, fail
        self.responses, self.done = [], threading.Event()

    def send(self, outputs, error, final):
        if self.fail and len(self.responses) >= self.after:
            raise RuntimeError("Unable to send response: the client has gone")
        self.responses.append((outputs, error, final))

    def is_cancelled(self):
        return self.after is not None and not self.fail and len(self.responses) >= self.after


def serve(client, request, delay=0.01):
    engine = FakeEngine(max_batch_size=2, max_context=128, delay=delay)
    service = LlmService(LlmSettings(sampling_mode="inline_kernels"), engine=engine,
                         codec=TextCodec(FakeTokenizer()))
    try:
        service.submit(request, client.send, client.is_cancelled,
                       on_done=client.done.set).result(timeout=60)
        assert client.done.is_set()
        assert service.decoder.num_active == 0 and service.decoder.num_queued == 0
    finally:
        service.close()
    return engine


def test_a_finished_stream_sends_every_token_then_one_final_response():
    client = Client()
    engine = serve(client, inputs(max_tokens=5))
    assert [final for _, _, final in client.responses] == [False] * 4 + [True]
    texts = [outputs["text_output"][0].decode() for outputs, _, _ in client.responses]
    assert "".join(texts) == "bcdef" and engine.released == [0]


def test_cancelling_while_tokens_flow_stops_generation():
    client = Client(after=3)  # tokens arrive every 10 ms, faster than the 100 ms poll
    engine = serve(client, inputs())
    assert engine.released == [0]
    assert len(engine.steps) < MAX_TOKENS // 2
    assert len(client.responses) < MAX_TOKENS // 2


def test_a_client_that_is_gone_cancels_its_request():
    client = Client(after=2, fail=True)
    engine = serve(client, inputs())
    assert len(client.responses) == 2 and engine.released == [0]
    assert len(engine.steps) < MAX_TOKENS // 2


def test_a_bad_request_gets_one_error_and_is_done():
    client = Client()
    serve(client, inputs(text=""))
    [(outputs, error, final)] = client.responses
    assert outputs is None and final and isinstance(error, ValueError)
    assert "text_input must be a non-empty string" in str(error)
