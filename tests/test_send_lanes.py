"""SendLanes (the llm model's send_threads): a burst of built responses sent
on several threads at once, each request's on one thread and in order, the
failed ones handed back to the caller; and the llm service streaming through
it."""
import threading

import numpy as np
import pytest

from simple_sampler.serving.text import TextCodec
from simple_sampler.settings import LlmSettings
from simple_sampler.triton.llm_service import LlmService
from simple_sampler.triton.send_lanes import SendLanes
from fakes import FakeEngine, FakeTokenizer, inputs
from test_llm_service import BuildingClient, text_of
from test_prompt_batch import prompt, stacked


def recording(sent, request, index, fail=False, barrier=None):
    def transmit():
        if barrier is not None:
            barrier.wait(timeout=10)  # BrokenBarrierError unless every thread is in at once
        sent.append((request, index, threading.current_thread().name))
        if fail:
            raise RuntimeError("Unable to send response: the client has gone")
    return transmit


def test_each_request_keeps_its_order_on_one_thread_and_requests_spread_over_the_threads():
    lanes = SendLanes(3, request_of=lambda owner: owner[0])
    sent = []
    # six requests, three responses each, interleaved as a step's burst is
    burst = [((request, index), recording(sent, request, index), index == 2)
             for index in range(3) for request in range(6)]
    try:
        failed, cpu_s = lanes.send(burst)
        assert len(sent) == len(burst)  # all out when send returns, not only once joined
    finally:
        lanes.close()
    assert failed == [] and cpu_s >= 0.0
    assert sorted((request, index) for request, index, _ in sent) == \
        sorted(owner for owner, _, _ in burst)
    threads = {}
    for request in range(6):
        mine = [(index, thread) for r, index, thread in sent if r == request]
        assert [index for index, _ in mine] == [0, 1, 2]  # in the burst's order
        assert len({thread for _, thread in mine}) == 1   # on one thread
        threads[request] = mine[0][1]
    assert len(set(threads.values())) == 3  # dealt in turn: two requests a thread
    assert threads[0] == threading.current_thread().name  # the caller's own is the first


def test_the_threads_send_at_the_same_time():
    """Each send waits for the server process with the GIL released: the
    point is that the waits overlap. Three transmits that each wait until
    all three are inside one pass only if three threads send them at once."""
    lanes = SendLanes(3, request_of=lambda owner: owner)
    barrier, sent = threading.Barrier(3), []
    try:
        failed, _ = lanes.send([(request, recording(sent, request, 0, barrier=barrier), True)
                                for request in range(3)])
    finally:
        lanes.close()
    assert failed == [] and len(sent) == 3 and not barrier.broken


def test_send_returns_only_once_every_thread_has_sent():
    """The decode loop takes the step's rows, and a request may end, only
    once its responses are out: a slow lane holds send until it is done."""
    lanes = SendLanes(2, request_of=lambda owner: owner)
    released, sent = threading.Event(), []

    def slow():
        assert released.wait(timeout=10)
        sent.append("slow")
    threading.Timer(0.2, released.set).start()
    try:
        failed, _ = lanes.send([("fast", lambda: sent.append("fast"), True), ("slow", slow, True)])
        assert failed == [] and released.is_set() and sorted(sent) == ["fast", "slow"]
    finally:
        lanes.close()


def test_a_lane_that_raises_anything_is_answered_and_its_thread_sends_the_next_burst(caplog):
    """Not only Exception: a lane whose send raises SystemExit is answered
    (its requests handed back as failed) and the thread goes on, so the
    caller never waits for an answer that cannot come."""
    lanes = SendLanes(2, request_of=lambda owner: owner)

    def exits():
        raise SystemExit(1)
    try:
        failed, _ = lanes.send([("a", lambda: None, False), ("b", exits, True)])
        assert failed == [("b", True)] and "its requests are ended" in caplog.text
        sent = []
        failed, _ = lanes.send([(request, recording(sent, request, 0), False) for request in "ab"])
        assert failed == [] and {thread for _, _, thread in sent} == \
            {threading.current_thread().name, "llm-send-1"}
    finally:
        lanes.close()


def test_after_close_a_burst_goes_out_on_the_callers_thread():
    lanes = SendLanes(3, request_of=lambda owner: owner)
    lanes.close(wait=False)
    sent = []
    failed, cpu_s = lanes.send([(request, recording(sent, request, 0), False)
                                for request in range(4)])
    assert failed == [] and cpu_s == 0.0 and len(sent) == 4
    assert {thread for _, _, thread in sent} == {threading.current_thread().name}


def test_one_thread_sends_on_the_callers_thread_alone():
    lanes = SendLanes(1, request_of=lambda owner: owner)
    assert lanes.workers == []
    sent = []
    failed, cpu_s = lanes.send([(request, recording(sent, request, 0), False)
                                for request in range(4)])
    assert failed == [] and cpu_s == 0.0
    assert {thread for _, _, thread in sent} == {threading.current_thread().name}
    lanes.close()


def test_failed_sends_come_back_with_their_final_flag_and_the_rest_still_go():
    lanes = SendLanes(2, request_of=lambda owner: owner[0])
    sent = []
    burst = [(("a", 0), recording(sent, "a", 0, fail=True), False),
             (("b", 0), recording(sent, "b", 0), False),
             (("a", 1), recording(sent, "a", 1), False),
             (("b", 1), recording(sent, "b", 1, fail=True), True)]
    try:
        failed, _ = lanes.send(burst)
    finally:
        lanes.close()
    assert sorted(failed) == [(("a", 0), False), (("b", 1), True)]
    assert len(sent) == 4  # a failed send does not stop its request's next one


@pytest.mark.parametrize("threads", [0, 33])
def test_send_threads_out_of_range_is_refused_naming_it(threads):
    with pytest.raises(ValueError, match="send_threads"):
        LlmSettings(send_threads=threads).validate()
    if threads < 1:
        with pytest.raises(ValueError, match="send_threads"):
            SendLanes(threads, request_of=id)


class ThreadRecordingClient(BuildingClient):
    """Records, with each response, the thread that sent it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.threads = []

    def send(self, outputs, error, final):
        transmit = super().send(outputs, error, final)

        def recorded():
            transmit()
            self.threads.append(threading.current_thread().name)
        return recorded


def stream_all(clients, send_threads, max_tokens, delay, request=None):
    """Every client's stream at once (greedy, max_tokens; or `request`),
    through an llm service with `send_threads`; returns the engine and the
    send threads once all have ended and the service is closed."""
    engine = FakeEngine(max_batch_size=len(clients) * 3, max_context=128, delay=delay)
    service = LlmService(LlmSettings(sampling_mode="inline_kernels", send_threads=send_threads),
                         engine=engine, codec=TextCodec(FakeTokenizer()))
    greedy = {**inputs(max_tokens=max_tokens), "temperature": np.array([[0.0]], np.float32)}
    try:
        futures = [service.submit(request or greedy, client.send, client.is_cancelled,
                                  on_done=client.done.set) for client in clients]
        for future in futures:
            future.result(timeout=60)
    finally:
        service.close()
    return engine, service.deliveries.senders.workers


def test_concurrent_streams_through_four_send_threads_arrive_whole_and_in_order():
    """The llm service with send_threads 4: eight concurrent streams, each
    response built by the decode loop and sent by one of the threads; every
    stream gets its tokens in order and its final response last, and the
    threads are gone after close."""
    clients = [ThreadRecordingClient() for _ in range(8)]
    _, workers = stream_all(clients, send_threads=4, max_tokens=12, delay=0.002)
    for client in clients:
        assert client.done.is_set()
        assert [final for _, _, final in client.responses] == [False] * 11 + [True]
        assert "".join(text_of(outputs) for outputs, _, _ in client.responses) == "bcdefghijklm"
    senders = {thread for client in clients for thread in client.threads}
    assert {"decode-loop", "llm-send-1", "llm-send-2", "llm-send-3"} <= senders
    assert len(workers) == 3 and not any(worker.is_alive() for worker in workers)


def test_a_requests_generations_share_one_thread():
    """A request of several prompts answers through its one Triton response
    sender (SharedSends): every generation's responses go on one thread, in
    order, its final flag last. Alone, its bursts hold its responses only, so
    they all stay on the decode loop's own thread (generations taken for
    requests of their own would be dealt to three)."""
    client = ThreadRecordingClient()
    request = stacked(prompt("ab", 7, 9, True), prompt("c", 8, 5, True), prompt("de", 9, 7, True))
    stream_all([client], send_threads=4, max_tokens=9, delay=0.002, request=request)
    assert [final for _, _, final in client.responses] == [False] * (9 + 5 + 7 - 1) + [True]
    assert {outputs["batch_index"].tolist()[0] for outputs, _, _ in client.responses} == {0, 1, 2}
    assert set(client.threads) == {"decode-loop"}


def test_a_client_gone_under_send_threads_ends_its_request_and_the_others_finish():
    gone, staying = BuildingClient(after=2, fail=True), BuildingClient()
    engine, _ = stream_all([gone, staying], send_threads=2, max_tokens=40, delay=0.005)
    assert len(gone.responses) == 2 and gone.done.is_set()  # nothing after it failed
    assert [final for _, _, final in staying.responses] == [False] * 39 + [True]
    assert len("".join(text_of(outputs) for outputs, _, _ in staying.responses)) == 40
    assert sorted(engine.released) == [0, 1]
