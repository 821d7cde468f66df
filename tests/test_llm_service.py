"""LlmService, the llm model's logic, without Triton: every request ends with
one final response and leaves the decoder, whether it finishes, is bad, its
client cancels while tokens are flowing, its client is gone, the sampler
fails for a while, or the service drains for a shutdown."""
import asyncio
import functools
import os
import threading
import time

import numpy as np
import pytest

from simple_sampler.row_reader import RowReader
from simple_sampler.schema import InvalidRequest
from simple_sampler.serving.text import TextCodec
from simple_sampler.settings import LlmSettings
from simple_sampler.triton.llm_delivery import Cancelled, Unavailable
from simple_sampler.triton.llm_service import LlmService
from simple_sampler.triton.sampler_targets import SamplerCallError
from fakes import MAX_TOKENS, Client, FakeEngine, FakeTokenizer, inputs, wait_until


class BuildingClient(Client):
    """As the llm model's sender: send builds the response and returns what
    sends it (``llm_delivery.Transmit``), which raises when the client is gone."""

    def send(self, outputs, error, final):
        return lambda: Client.send(self, outputs, error, final)


def text_of(outputs):
    """A response's text_output: a str from a step's tokens (SendTokens),
    bytes otherwise (encode_event); Triton sends both as the same bytes."""
    text = outputs["text_output"][0]
    return text if isinstance(text, str) else text.decode()


CLIENTS = pytest.mark.parametrize("client_type", [Client, BuildingClient])


def serve(client, request, delay=0.01, on_admitted=lambda service: None, **settings):
    engine = FakeEngine(max_batch_size=2, max_context=128, delay=delay)
    service = LlmService(LlmSettings(sampling_mode="inline_kernels", **settings), engine=engine,
                         codec=TextCodec(FakeTokenizer()))
    try:
        service.submit(request, client.send, client.is_cancelled, on_done=client.done.set,
                       on_admitted=lambda: on_admitted(service)).result(timeout=60)
        assert client.done.is_set()
        assert service.decoder.num_active == 0 and service.decoder.num_queued == 0
    finally:
        service.close()
    return engine


@CLIENTS
def test_a_finished_stream_sends_every_token_then_one_final_response(client_type):
    client = client_type()
    # greedy: at temperature 1 the fake's runner-up letter (e^-5 as likely) came now and then
    engine = serve(client, {**inputs(max_tokens=5), "temperature": np.array([[0.0]], np.float32)})
    assert [final for _, _, final in client.responses] == [False] * 4 + [True]
    texts = [text_of(outputs) for outputs, _, _ in client.responses]
    assert "".join(texts) == "bcdef" and engine.released == [0]


@CLIENTS
def test_cancelling_while_tokens_flow_stops_generation(client_type):
    client = client_type(after=3)  # tokens arrive every 10 ms, faster than the 100 ms poll
    engine = serve(client, inputs())
    assert engine.released == [0]
    assert len(engine.steps) < MAX_TOKENS // 2
    assert len(client.responses) < MAX_TOKENS // 2


@CLIENTS
def test_a_client_that_is_gone_cancels_its_request(client_type):
    client = client_type(after=2, fail=True)
    engine = serve(client, inputs())
    assert len(client.responses) == 2 and engine.released == [0]
    assert len(engine.steps) < MAX_TOKENS // 2


@CLIENTS
def test_a_cancelled_request_still_ends_with_the_final_flag_alone(client_type):
    """python_backend deletes a decoupled request's response factory only on
    its final flag (python_be.cc, ResponseSendDecoupled)."""
    client = client_type(after=3)
    serve(client, inputs())
    *tokens, last = client.responses
    assert len(tokens) >= 3 and all(not final for _, _, final in tokens)
    assert last == (None, None, True)


@CLIENTS
def test_not_decoupled_a_cancelled_request_ends_with_a_cancelled_error_its_one_response(
        client_type):
    """python_backend refuses the final flag alone from a model that is not
    decoupled and has sent nothing (ResponseSender::UpdateStateAndCounters):
    the request would never end, and the model never unload."""
    client = client_type(after=0)  # cancelled at once: the first poll finds it
    engine = serve(client, inputs(stream=False), decoupled_mode=False)
    [(outputs, error, final)] = client.responses
    assert outputs is None and final and isinstance(error, Cancelled)
    assert len(engine.steps) < MAX_TOKENS and engine.released == [0]


class SlowFinalClient(BuildingClient):
    """Its final response takes 20 ms to go out (a round trip under load)."""

    def send(self, outputs, error, final):
        transmit = super().send(outputs, error, final)
        if not final:
            return transmit

        def slow():
            time.sleep(0.02)
            transmit()
        return slow


def test_a_request_is_done_only_once_its_final_response_went_out():
    """The decode loop hands built responses to its send threads
    (send_lanes); ``on_done`` (the llm model's in-flight gauge, which a drain
    waits on) must not run while a final response is still being sent
    there: four requests at once, so that their bursts go over the threads."""
    engine = FakeEngine(max_batch_size=4, max_context=128, delay=0.001)
    service = LlmService(LlmSettings(sampling_mode="inline_kernels", send_threads=4),
                         engine=engine, codec=TextCodec(FakeTokenizer()))
    final_sent_when_done = []

    def on_done(client):
        final_sent_when_done.append(bool(client.responses) and client.responses[-1][2])
        client.done.set()

    try:
        for _ in range(3):
            clients = [SlowFinalClient() for _ in range(4)]
            futures = [service.submit(inputs(max_tokens=8), client.send, client.is_cancelled,
                                      on_done=functools.partial(on_done, client))
                       for client in clients]
            for future in futures:
                future.result(timeout=60)
    finally:
        service.close()
    assert final_sent_when_done == [True] * 12


def test_each_generation_is_reported_finished_once_its_final_response_went_out(caplog):
    """on_finished (TensorRT-LLM's length histograms) gets each generation's
    final event once, after its final response was sent; one that fails is
    logged and the service answers the next request all the same."""
    client = BuildingClient()
    reported = []

    def on_finished(event):
        reported.append((event.num_input_tokens, event.num_output_tokens,
                         bool(client.responses) and client.responses[-1][2]))
        if len(reported) == 1:
            raise RuntimeError("a metric failed")

    service = LlmService(LlmSettings(sampling_mode="inline_kernels"),
                         engine=FakeEngine(max_batch_size=2, max_context=128, delay=0.001),
                         codec=TextCodec(FakeTokenizer()), on_finished=on_finished)
    try:
        for max_tokens in (4, 6):
            client.responses.clear()
            client.done.clear()
            service.submit({**inputs(max_tokens=max_tokens),
                            "min_length": np.array([[max_tokens]], np.int32)},
                           client.send, client.is_cancelled, on_done=client.done.set
                           ).result(timeout=60)
            assert client.responses[-1][2] and client.responses[-1][1] is None
    finally:
        service.close()
    prompt = reported[0][0]
    assert prompt > 0 and reported == [(prompt, 4, True), (prompt, 6, True)]
    assert "reporting a finished generation failed" in caplog.text


def test_admission_is_announced_once_the_decoder_holds_the_request():
    """The llm model reports its in-flight gauge then: `serve` stops Triton
    once the gauge reads 0, so it must not read 0 while a request is held."""
    held = []
    serve(Client(), inputs(max_tokens=3), on_admitted=lambda s: held.append(s.decoder.num_in_flight))
    assert held == [1]
    refused = []
    serve(Client(), inputs(text=""), on_admitted=lambda s: refused.append(1))
    assert refused == []


@CLIENTS
def test_a_bad_request_gets_one_error_and_is_done(client_type):
    client = client_type()
    serve(client, inputs(text=""))
    [(outputs, error, final)] = client.responses
    assert outputs is None and final and isinstance(error, ValueError)
    assert "text_input must be a non-empty string" in str(error)


def test_a_draining_service_finishes_within_the_grace_then_errors_the_rest():
    # the quick one's 3 steps take 60 ms, the slow one's 120 at least 2.4 s:
    # a grace of 1 s separates them with room for a loaded machine's stalls
    engine = FakeEngine(max_batch_size=2, max_context=128, delay=0.02)
    service = LlmService(LlmSettings(sampling_mode="inline_kernels"), engine=engine,
                         codec=TextCodec(FakeTokenizer()))
    try:
        quick, slow, late = Client(), Client(), Client()
        admitted = threading.Semaphore(0)
        service.submit(inputs(max_tokens=3), quick.send, on_done=quick.done.set,
                       on_admitted=admitted.release)
        service.submit(inputs(max_tokens=120), slow.send, on_done=slow.done.set,
                       on_admitted=admitted.release)
        assert admitted.acquire(timeout=30) and admitted.acquire(timeout=30)
        draining = service.drain(grace_s=1.0)
        service.submit(inputs(max_tokens=3), late.send, on_done=late.done.set).result(timeout=10)
        assert draining.result(timeout=10) == 1  # the slow one, at the grace's end
        assert quick.done.wait(10) and slow.done.wait(10)
        assert quick.responses[-1][1] is None and quick.responses[-1][2]
        [(_, late_error, late_final)] = late.responses
        assert isinstance(late_error, Unavailable) and late_final
        assert "admits no new request" in str(late_error)
        _, slow_error, slow_final = slow.responses[-1]
        assert isinstance(slow_error, Unavailable) and slow_final
        assert "1 s grace period" in str(slow_error)
        assert all(error is None for _, error, _ in slow.responses[:-1])
        assert service.decoder.num_in_flight == 0
    finally:
        service.close()
    assert sorted(engine.released) == [0, 1]  # the aborted slot is freed too


class FlakySampler:
    """A sampler model whose first `failures` calls fail as `error` does; it
    reads rows inline or from the service's row arena (the default)."""

    def __init__(self, failures, retryable=True):
        self.failures, self.retryable, self.calls = failures, retryable, []
        self.reader, self.by_reference = RowReader(), 0

    def __call__(self, arrays):
        if "logits_ref" in arrays:
            self.by_reference += 1
            rows = self.reader.rows(arrays["logits_ref"])
        else:
            rows = arrays["logits"]
        self.calls.append(np.array(rows))
        if len(self.calls) <= self.failures:
            raise SamplerCallError("simple_sampler: Stub process 'simple_sampler_0_1' is not "
                                   "healthy.", self.retryable)
        return {"output_ids": np.argmax(rows, axis=1)[:, None].astype(np.int32)}


def test_a_service_whose_sampler_fails_twice_serves_every_token():
    """The decode loop through remote_sampler: two failed calls cost no
    request and change no token."""
    def run(failures, transport="arena"):
        sampler = FlakySampler(failures)
        service = LlmService(LlmSettings(sampling_mode="simple", micro_batches=1,
                                         sampler_shards=2, row_transport=transport),
                             sampler_call=sampler, engine=FakeEngine(max_batch_size=4),
                             codec=TextCodec(FakeTokenizer()))
        try:
            clients = [Client() for _ in range(3)]
            for client in clients:
                service.submit(inputs(max_tokens=6), client.send, on_done=client.done.set)
            assert all(client.done.wait(30) for client in clients)
            retries = service.stats().sampler_retries
        finally:
            service.close()
        assert (sampler.by_reference > 0) == (transport == "arena")
        assert all(error is None for c in clients for _, error, _ in c.responses)
        return [[o["output_ids"].tolist() for o, _, _ in c.responses] for c in clients], retries

    clean, no_retries = run(0)
    faulted, retries = run(2)
    assert faulted == clean and no_retries == 0 and retries == 2
    # The rows came from the arena, and the retried shards read the same slots.
    bls_clean, _ = run(0, "bls")
    assert bls_clean == clean


def test_a_service_that_fails_to_start_leaves_nothing_behind(monkeypatch):
    """A start that raises after the arena, the sampler pool, the decode
    loop and the send threads were made (here the decoder's start) closes
    them: no region left in /dev/shm, no thread of its own running."""
    from simple_sampler.row_arena import SHM_DIR
    from simple_sampler.serving.decoder import Decoder

    async def fails():
        raise RuntimeError("the decoder could not start")

    monkeypatch.setattr(Decoder, "start", lambda self: fails())
    regions = set(os.listdir(SHM_DIR))
    threads = set(threading.enumerate())
    with pytest.raises(RuntimeError, match="the decoder could not start"):
        LlmService(LlmSettings(sampling_mode="simple", micro_batches=1, send_threads=3),
                   sampler_call=FlakySampler(0), engine=FakeEngine(max_batch_size=4),
                   codec=TextCodec(FakeTokenizer()))
    assert set(os.listdir(SHM_DIR)) == regions
    assert wait_until(lambda: {t for t in threading.enumerate() if t.is_alive()} <= threads), \
        [t.name for t in set(threading.enumerate()) - threads]


class WarmingEngine(FakeEngine):
    """A fake with windows (``engine.SplitsSlots``) and ``warm_up``
    (``engine.WarmsUp``) that records the order they were called in."""

    label = "WarmingEngine"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls = []

    def split_slots(self, lanes):
        self.calls.append(f"split_slots({lanes})")

    def free_in_lane(self, lane):
        return self.max_batch_size - len(self.ids)

    def add(self, seq_id, prompt_ids, max_tokens=None, lane=None):
        super().add(seq_id, prompt_ids, max_tokens)

    def warm_up(self):
        self.calls.append("warm_up")
        return 3


def test_the_service_warms_the_engine_up_after_splitting_its_slots(caplog):
    """Warm-up prepares the lanes' own steps: it comes after split_slots,
    before any request, and is logged; the service then serves."""
    engine = WarmingEngine(max_batch_size=4)
    with caplog.at_level("INFO", logger="simple_sampler.serving.decoder"):
        service = LlmService(LlmSettings(sampling_mode="simple", micro_batches=2),
                             sampler_call=FlakySampler(0), engine=engine,
                             codec=TextCodec(FakeTokenizer()))
    try:
        assert engine.calls == ["split_slots(2)", "warm_up"]
        assert "warmed up: 3 decode steps prepared" in caplog.text
        client = Client()
        service.submit(inputs(max_tokens=3), client.send, on_done=client.done.set)
        assert client.done.wait(30)
        assert [error for _, error, _ in client.responses] == [None] * 3
    finally:
        service.close()


@pytest.mark.parametrize("bug", [KeyError, ValueError])
def test_a_request_failing_on_our_side_is_answered_and_logged_with_its_traceback(
        monkeypatch, caplog, bug):
    """Not a client mistake (INVALID_ARG: schema.InvalidRequest alone, not any
    ValueError) but ours: one INTERNAL answer, one ERROR line with the
    traceback, and the service serves the next request."""
    from simple_sampler.triton import llm_service

    decode = llm_service.decode_generate

    def broken_once(request_inputs, *parameters):
        patch.undo()  # the next request decodes normally
        raise bug("a bug")

    service = LlmService(LlmSettings(sampling_mode="inline_kernels"),
                         engine=FakeEngine(max_batch_size=2, max_context=128),
                         codec=TextCodec(FakeTokenizer()))
    try:
        with monkeypatch.context() as patch:
            patch.setattr(llm_service, "decode_generate", broken_once)
            failed = Client()
            with caplog.at_level("ERROR", logger=llm_service.__name__):
                service.submit(inputs(), failed.send, on_done=failed.done.set).result(60)
        assert llm_service.decode_generate is decode
        served = Client()
        service.submit(inputs(max_tokens=2), served.send, on_done=served.done.set).result(60)
    finally:
        service.close()
    [(outputs, error, final)] = failed.responses
    assert outputs is None and final and type(error) is RuntimeError
    assert str(error) == f"{bug.__name__}: {bug('a bug')}"
    [record] = [r for r in caplog.records  # ours, not a GC'd loop's asyncio lines
                if r.levelname == "ERROR" and r.name == llm_service.__name__]
    assert record.exc_info and record.exc_info[0] is bug
    assert [final for _, _, final in served.responses] == [False, True]


def run_requests(requests, settings=None):
    """Each request's responses, served one after another by one service."""
    service = LlmService(settings or LlmSettings(sampling_mode="inline_kernels"),
                         engine=FakeEngine(max_batch_size=2, max_context=128),
                         codec=TextCodec(FakeTokenizer()))
    try:
        clients = []
        for request in requests:
            clients.append(Client())
            service.submit(request, clients[-1].send, on_done=clients[-1].done.set).result(60)
    finally:
        service.close()
    return [client.responses for client in clients]


def seeded(stream, interval=None, logprobs=False):
    request = {**inputs(max_tokens=23, stream=stream),
               "random_seed": np.array([[7]], np.uint64),
               "temperature": np.array([[4.0]], np.float32),  # the second letter is drawn too
               "top_p": np.array([[1.0]], np.float32),  # sampled (no top_p or top_k: greedy)
               "min_length": np.array([[23]], np.int32),  # no early end
               "exclude_input_in_output": np.array([[True]]),
               "return_log_probs": np.array([[logprobs]])}
    if interval is not None:
        request["stream_interval"] = np.array([[interval]], np.int32)
    return request


def joined(responses):
    assert all(error is None for _, error, _ in responses)
    return ("".join(text_of(o) for o, _, _ in responses),
            [t for o, _, _ in responses for t in o["output_ids"].tolist()])


def test_stream_interval_sends_every_kth_token_and_the_same_generation():
    one, four, whole, four_logprobs = run_requests(
        [seeded(True), seeded(True, 4), seeded(False), seeded(True, 4, logprobs=True)])
    text, ids = joined(whole)
    assert len(ids) == 23 and len(set(ids)) > 2  # sampled, not one letter repeated
    assert joined(one) == joined(four) == joined(four_logprobs) == (text, ids)
    # the first token at once (vLLM's, SGLang's and TensorRT-LLM's rule), then four at a time
    assert [len(o["output_ids"]) for o, _, _ in four] == [1] + [4] * 5 + [2]
    assert [final for _, _, final in four] == [False] * 6 + [True]
    # before the last response only the text and the ids (and logprobs when asked)
    assert {frozenset(o) for o, _, _ in four[:-1]} == {frozenset({"text_output", "output_ids"})}
    assert set(four_logprobs[0][0]) == {"text_output", "output_ids", "output_log_probs",
                                        "cum_log_probs"}
    assert len(four[-1][0]) == 8 and four[-1][0]["finish_reason"][0] == b"length"
    assert four[-1][0]["stop_reason"].tolist() == [b"null"]
    assert [p for o, _, _ in four_logprobs for p in o["output_log_probs"].reshape(-1)] == \
        pytest.approx(run_requests([seeded(False, logprobs=True)])[0][0][0]["output_log_probs"]
                      .reshape(-1))


def test_the_servers_stream_interval_is_the_default_and_a_request_overrides_it():
    default, own = run_requests([seeded(True), seeded(True, 1)],
                                LlmSettings(sampling_mode="inline_kernels", stream_interval=16))
    assert [len(o["output_ids"]) for o, _, _ in default] == [1, 16, 6]
    assert len(own) == 23 and joined(own) == joined(default)


def test_a_stream_interval_below_one_is_refused():
    [[(outputs, error, final)]] = run_requests([seeded(True, 0)])
    assert outputs is None and final and isinstance(error, ValueError)
    assert "stream_interval must be an integer >= 1, got 0" in str(error)


def test_a_range_refusal_names_the_vllm_parameter_the_client_sent():
    """The decoder's range check names min_length; the refusal names what the
    client sent, vLLM's min_tokens as a request parameter."""
    service = LlmService(LlmSettings(sampling_mode="inline_kernels"),
                         engine=FakeEngine(max_batch_size=2, max_context=128),
                         codec=TextCodec(FakeTokenizer()))
    client = Client()
    try:
        service.submit(inputs(), client.send, on_done=client.done.set,
                       parameters='{"min_tokens": -1}').result(60)
    finally:
        service.close()
    [(outputs, error, final)] = client.responses
    assert outputs is None and final
    assert str(error).startswith("min_tokens (min_length here) must be >= 0")


def test_close_is_bounded_and_says_what_the_loop_waits_on(monkeypatch, caplog):
    """Triton gives every model 8 s to unload at exit: a decode loop that
    does not stop must not hold the model past it (docs/RELIABILITY.md)."""
    from simple_sampler.triton import llm_service

    monkeypatch.setattr(llm_service, "CLOSE_TIMEOUT_S", 0.5)
    service = LlmService(LlmSettings(sampling_mode="inline_kernels"),
                         engine=FakeEngine(max_batch_size=2, max_context=128),
                         codec=TextCodec(FakeTokenizer()))
    stuck = threading.Event()

    async def never_closes():
        stuck.set()
        await asyncio.sleep(3600)

    monkeypatch.setattr(service.decoder, "close", never_closes)
    started = time.monotonic()
    with caplog.at_level("ERROR", logger=llm_service.__name__):
        service.close()
    assert stuck.is_set() and time.monotonic() - started < 3
    assert "did not stop within 0.5 s" in caplog.text
    assert "thread decode-loop" in caplog.text


def test_a_stop_word_cuts_a_stream_as_it_cuts_the_whole_answer():
    """Rows with stop words take the step path too (the decoder matches them):
    the streamed text stops before the word (vLLM's stop, matched in the
    text), as the non-streamed answer does."""
    def stopped(stream, interval=None):
        request = {**seeded(stream, interval),
                   "sampling_parameters": np.array([[b'{"stop": ["fgh"]}']], object),
                   "ignore_eos": np.array([[True]])}  # min_length would hold the word back
        del request["min_length"]
        return request

    one, four, whole = run_requests([stopped(True), stopped(True, 4), stopped(False)])
    text, ids = joined(whole)
    assert "fgh" not in text and 0 < len(ids) < 23
    assert joined(one) == joined(four) == (text, ids)
    assert [final for _, _, final in one] == [False] * (len(ids) - 1) + [True]
    assert one[-1][0]["finish_reason"][0] == b"stop"


def test_tensorrt_llms_stop_words_end_where_the_tokens_end_with_a_words_and_keep_it():
    """The stop_words input is TensorRT-LLM's: each word encoded alone, the
    generation ends once its tokens end with the word's, the word kept in the
    text; vLLM's stop matches the text and cuts it. Streamed or not, alike."""
    def stopped(stream, words):
        request = {**seeded(stream), **words, "ignore_eos": np.array([[True]])}
        del request["min_length"]
        return request

    as_tokens = {"stop_words": np.array([[b"zz", b"fgh"]], object)}
    as_text = {"sampling_parameters": np.array([[b'{"stop": ["zz", "fgh"]}']], object)}
    stream, whole, cut = run_requests([stopped(True, as_tokens), stopped(False, as_tokens),
                                       stopped(False, as_text)])
    text, ids = joined(whole)
    assert joined(stream) == (text, ids) and text.endswith("fgh") and 3 < len(ids) < 23
    assert joined(cut) == (text[:-3], ids)  # the same tokens, the word cut from the text
    for responses in (stream, whole, cut):
        assert responses[-1][0]["finish_reason"][0] == b"stop"
        assert responses[-1][0]["stop_reason"][0] == b'"fgh"'


def test_a_step_whose_answer_fails_ends_its_requests_and_the_service_serves_on(caplog):
    """A bug of ours answering a step's tokens (Deliveries._answer_step):
    logged with its traceback, its requests end (cancelled: the final flag),
    none hangs, and the next request is served."""
    from simple_sampler.triton import llm_delivery

    service = LlmService(LlmSettings(sampling_mode="inline_kernels"),
                         engine=FakeEngine(max_batch_size=2, max_context=128),
                         codec=TextCodec(FakeTokenizer()))
    answer = service.deliveries._answer_step

    def broken_once(*step):
        service.deliveries._answer_step = answer
        raise KeyError("a bug")

    service.deliveries._answer_step = broken_once
    try:
        failed, served = Client(), Client()
        with caplog.at_level("ERROR", logger=llm_delivery.__name__):
            service.submit(inputs(), failed.send, on_done=failed.done.set).result(60)
        service.submit(inputs(max_tokens=3), served.send, on_done=served.done.set).result(60)
    finally:
        service.close()
    assert failed.responses[-1] == (None, None, True) and len(failed.responses) < MAX_TOKENS
    [record] = [r for r in caplog.records  # ours, not a GC'd loop's asyncio lines
                if r.levelname == "ERROR" and r.name == llm_delivery.__name__]
    assert record.exc_info[0] is KeyError and "their requests are cancelled" in record.message
    assert [final for _, _, final in served.responses] == [False, False, True]


def test_hot_first_that_cannot_apply_says_why_and_sends_full_rows(caplog):
    from simple_sampler.triton.llm_service import hot_first_vocab

    with caplog.at_level("WARNING", logger="simple_sampler.triton.llm_service"):
        assert hot_first_vocab(LlmSettings(handoff="hot-first"), repository=None) is None
    assert ("handoff hot-first: full rows cross to the sampler instead: the sampler has no "
            "hot-vocab profile") in caplog.text
    caplog.clear()
    assert hot_first_vocab(LlmSettings(), repository=None) is None  # full asked: nothing to say
    assert not caplog.text


@pytest.mark.parametrize("stream, interval", [(False, None), (True, 4)])
def test_the_stop_reason_survives_responses_that_merge_events(stream, interval):
    """A non-streamed answer or a stream of k tokens a response, asking for
    logprobs (an event per token, merged into each response), keeps the
    stop string that ended it."""
    request = {**inputs(max_tokens=20, stream=stream), "temperature": np.array([[0.0]], np.float32),
               "stop_words": np.array([[b"fgh"]], object), "return_log_probs": np.array([[True]])}
    if interval:
        request["stream_interval"] = np.array([[interval]], np.int32)
    [responses] = run_requests([request])
    assert responses[-1][0]["stop_reason"].tolist() == [b'"fgh"']
    assert responses[-1][0]["finish_reason"].tolist() == [b"stop"]


def core(stream, exclude=False, logprobs=False, prompts=((5, 6, 7),)):
    """A request in TensorRT-LLM's tensorrt_llm model's dialect (its client's
    prepare_inputs: ids, their lengths, request_output_len, streaming; top_k
    1 and top_p 0, greedy there), of one prompt or several."""
    width = max(len(ids) for ids in prompts)
    rows = len(prompts)
    return {"input_ids": np.array([list(ids) + [-1] * (width - len(ids)) for ids in prompts],
                                  np.int32),
            "input_lengths": np.array([[len(ids)] for ids in prompts], np.int32),
            "request_output_len": np.full((rows, 1), 6, np.int32),
            "streaming": np.full((rows, 1), stream),
            "runtime_top_k": np.ones((rows, 1), np.int32),
            "runtime_top_p": np.zeros((rows, 1), np.float32),
            "exclude_input_in_output": np.full((rows, 1), exclude),
            "return_log_probs": np.full((rows, 1), logprobs)}


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_in_tensorrt_llms_core_dialect_is_answered_in_its_outputs(stream):
    """Its tensorrt_llm model's answer: beam_output_ids [beams, tokens] and
    sequence_length, a non-streamed answer's starting with the prompt's ids
    unless exclude_input_in_output, the logprobs only when asked (then the
    llm model's own, summed), and none of the llm model's other outputs;
    the tokens are the greedy request's in the llm model's names."""
    greedy = {**inputs(max_tokens=6, stream=stream), "temperature": np.array([[0.0]], np.float32),
              "exclude_input_in_output": np.array([[True]]), "return_log_probs": np.array([[True]])}
    greedy.pop("text_input")
    greedy["input_ids"] = np.array([[5, 6, 7]], np.int32)
    plain, whole, excluded, logprobs = run_requests(
        [greedy, core(stream), core(stream, exclude=True), core(stream, logprobs=True)])
    _, tokens = joined(plain)
    prompt = [] if stream else [5, 6, 7]
    for responses, log in ((whole, False), (excluded, False), (logprobs, True)):
        assert all(error is None for _, error, _ in responses)
        assert [final for _, _, final in responses][-1]
        ids = [t for o, _, _ in responses for t in o["beam_output_ids"].reshape(-1).tolist()]
        for outputs, _, _ in responses:
            assert outputs["beam_output_ids"].shape == (1, outputs["sequence_length"][0])
            assert set(outputs) == {"beam_output_ids", "sequence_length"} | (
                {"beam_output_log_probs", "beam_cum_log_probs"} if log else set())
        assert ids == (tokens if responses is excluded else prompt + tokens)
    assert len(whole) == (len(tokens) if stream else 1)
    values = [v for o, _, _ in logprobs for v in o["beam_output_log_probs"].reshape(-1).tolist()]
    expected = [v for o, _, _ in plain for v in o["output_log_probs"].reshape(-1).tolist()]
    assert values == pytest.approx(expected)
    assert logprobs[-1][0]["beam_cum_log_probs"][0] == pytest.approx(sum(expected), abs=1e-4)


def test_a_core_request_of_several_prompts_names_each_by_its_batch_index():
    """Its client's --batch-inputs, in its core dialect: each prompt's ids
    cut to its input_lengths, its responses named by batch_index."""
    [responses] = run_requests([core(False, prompts=((5, 6, 7), (9, 10)))])
    answers = {int(o["batch_index"][0]): o["beam_output_ids"].reshape(-1).tolist()
               for o, _, _ in responses}
    alone = [run_requests([core(False, prompts=(ids,))])[0][0][0]["beam_output_ids"]
             .reshape(-1).tolist() for ids in ((5, 6, 7), (9, 10))]
    assert answers == {0: alone[0], 1: alone[1]} and answers[1][:2] == [9, 10]


def test_a_stop_signal_ends_the_requests_of_its_request_id_with_what_they_made():
    """TensorRT-LLM's stop signal (a request with stop true and the first's
    request id; its client's placeholders in the other inputs): the request
    of that id ends as cancelled, its non-streamed answer holding what it
    made; another id's request runs on; the signal gets one response
    without outputs; a signal without an id is refused."""
    service = LlmService(LlmSettings(sampling_mode="inline_kernels"),
                         engine=FakeEngine(max_batch_size=2, max_context=512, delay=0.02),
                         codec=TextCodec(FakeTokenizer()))
    signal = {"input_ids": np.empty((1, 1), np.int32), "input_lengths": np.zeros((1, 1), np.int32),
              "request_output_len": np.zeros((1, 1), np.int32),
              "stop_signal": np.ones((1, 1), bool)}
    try:
        stopped, other, stop, nameless = Client(), Client(), Client(), Client()
        for client, request_id in ((stopped, "7"), (other, "8")):
            service.submit({**core(False), "request_output_len": np.array([[300]], np.int32)},
                           client.send, on_done=client.done.set, request_id=request_id)
        assert wait_until(lambda: service.stats().steps >= 3)  # each has made a token or two
        service.submit(signal, stop.send, on_done=stop.done.set, request_id="7").result(60)
        service.submit(signal, nameless.send, on_done=nameless.done.set).result(60)
        assert stopped.done.wait(10) and not other.done.is_set()
        [(outputs, error, final)] = stopped.responses
        assert error is None and final and 3 < outputs["sequence_length"][0] < 3 + 300
        assert stop.responses == [({}, None, True)]
        [(_, error, _)] = nameless.responses
        assert isinstance(error, InvalidRequest) and "stop signal needs a request id" in str(error)
        service.submit(signal, stop.send, request_id="8")
        assert other.done.wait(10) and other.responses[-1][0]["sequence_length"][0] < 3 + 300
    finally:
        service.close()
    assert service.by_request_id == {}


def test_a_grammar_is_compiled_off_the_event_loop(monkeypatch):
    """A guided request's grammar is compiled in a worker thread before the
    request reaches the decode loop, whose event loop every lane shares;
    here the fake tokenizer cannot be compiled over, and the request is
    refused with the reason (by the decode loop's own check)."""
    from fakes import on_loop_recorder
    from simple_sampler.serving.structured import Grammars

    recording, on_loop = on_loop_recorder(Grammars.precompile)
    monkeypatch.setattr(Grammars, "precompile", recording)
    client = Client()
    request = {**inputs(), "guided_decoding_guide_type": np.array([[b"json"]], dtype=object)}
    serve(client, request)
    assert on_loop == [False]
    [(_, error, final)] = client.responses
    assert final and "guided decoding is not available for this model's tokenizer" in str(error)
