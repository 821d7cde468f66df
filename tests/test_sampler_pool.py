"""SamplerPool without a server: rows shared by capacity, a failed shard sent
again elsewhere with the same rows (so the same tokens), a failed target left
out and tried again later, refused rows never sent again."""
import asyncio
import os
import gc
import threading
import time

import numpy as np
import pytest
import torch

from simple_sampler import SamplingParams
from simple_sampler.params import History, SamplingBatch
from simple_sampler.row_arena import Region, RowArena
from simple_sampler.row_reader import RowReader
from simple_sampler.schema import InvalidRequest
from simple_sampler.serving.batch_state import BatchState
from simple_sampler.triton.sampler_codec import batch_arrays
from simple_sampler.sampling import sample
from simple_sampler.triton.sampler_decode import decode_request
from simple_sampler.triton.sampler_serve import sample_request
from simple_sampler.addresses import parse_endpoints
from simple_sampler.settings import LlmSettings
from simple_sampler.triton.sampler_pool import ONE_LANE_ROWS_PER_REQUEST, SamplerPool
from simple_sampler.triton.sampler_setup import build_pool
from simple_sampler.triton.sampler_targets import (LATE_FIRST_S, LATE_FLOOR_S, SamplerCallError,
                                                   SamplerTarget)

VOCAB = 64


class Sampler:
    """A sampler model in-process (the real request decoding and kernels)
    that fails while `failing` is true, recording the rows it was sent."""

    def __init__(self, failing=False, retryable=True):
        self.failing, self.retryable, self.rows, self.attempts = failing, retryable, [], 0
        self.reader, self.by_reference = RowReader(), 0

    def __call__(self, inputs):
        self.attempts += 1
        if self.failing:
            raise SamplerCallError("Stub process 'simple_sampler_0_1' is not healthy.",
                                   self.retryable)
        self.by_reference += "logits_ref" in inputs
        decoded = decode_request(inputs, VOCAB, reader=self.reader)
        self.rows.append(len(decoded))
        outputs, _ = sample_request(decoded)
        return outputs


def step(pool, rows=12, seed=0):
    rng = np.random.default_rng(seed)
    logits = torch.from_numpy(rng.standard_normal((rows, VOCAB)).astype(np.float32))
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=100 + row) for row in range(rows)]
    batch = SamplingBatch.from_params(params, [History([1, 2], [3])] * rows, [5] * rows)
    tokens, _ = asyncio.run(pool(logits, batch))
    return tokens, sample(logits.numpy(), batch, return_logprobs=False).token_ids


def test_rows_are_shared_by_capacity_and_give_the_kernels_tokens():
    small, big = Sampler(), Sampler()
    pool = SamplerPool([SamplerTarget("a", small, 1), SamplerTarget("b", big, 3)], min_rows=1)
    tokens, expected = step(pool, rows=12)
    assert tokens.tolist() == expected.tolist()
    assert small.rows == [3] and sorted(big.rows) == [3, 3, 3]
    assert pool.rows_sent == {"a": 3, "b": 9}


def test_most_shards_caps_the_requests_on_the_largest_targets():
    small, big = Sampler(), Sampler()
    pool = SamplerPool([SamplerTarget("small", small, 1), SamplerTarget("big", big, 3)],
                       min_rows=1)
    assert [(t.name, a, b) for t, a, b in pool.shards(12, most=1)] == [("big", 0, 12)]
    assert [(t.name, a, b) for t, a, b in pool.shards(12, most=2)] == [("big", 0, 6),
                                                                       ("big", 6, 12)]
    assert len(pool.shards(12)) == 4


def named(shards):
    return [(target.name, first, end) for target, first, end in shards]


def test_a_step_of_few_rows_is_one_shard_on_the_slots_in_turn():
    pool = SamplerPool([SamplerTarget("a", Sampler(), 1), SamplerTarget("b", Sampler(), 2)],
                       min_rows=8)
    # fewer than twice the minimum: one request, each call on the next slot
    assert [named(pool.shards(15)) for _ in range(4)] == [
        [("a", 0, 15)], [("b", 0, 15)], [("b", 0, 15)], [("a", 0, 15)]]
    # twice the minimum: two shards, the turn going on from there
    assert named(pool.shards(16)) == [("b", 0, 8), ("b", 8, 16)]
    assert named(pool.shards(16)) == [("a", 0, 8), ("b", 8, 16)]


def test_many_rows_are_one_shard_per_slot_as_before():
    pool = SamplerPool([SamplerTarget("a", Sampler(), 1), SamplerTarget("b", Sampler(), 2)],
                       min_rows=8)
    pool.shards(8)  # a turn taken does not move a full split
    assert named(pool.shards(24)) == [("a", 0, 8), ("b", 8, 16), ("b", 16, 24)]
    assert named(pool.shards(200)) == [("a", 0, 66), ("b", 66, 133), ("b", 133, 200)]


def test_one_lane_spreads_a_step_over_the_instances_and_two_keep_the_minimum():
    """With one lane a step's full rows are on its critical path: every
    instance takes a shard of ONE_LANE_ROWS_PER_REQUEST rows at least,
    whatever min_rows; with two, min_rows holds (a lane step of 64 rows is
    one request); a minimum below ONE_LANE_ROWS_PER_REQUEST stays as asked."""
    targets = [SamplerTarget("a", Sampler(), 8)]
    one_lane = SamplerPool(targets, min_rows=64)
    assert one_lane.lanes == LlmSettings.micro_batches == 1
    assert one_lane.least_rows() == ONE_LANE_ROWS_PER_REQUEST == 8
    assert [b - a for _, a, b in one_lane.shards(64)] == [8] * 8
    assert [b - a for _, a, b in one_lane.shards(20)] == [10, 10]
    assert len(one_lane.shards(7)) == 1
    assert [b - a for _, a, b in SamplerPool(targets, min_rows=64, lanes=2).shards(64)] == [64]
    assert len(SamplerPool(targets, min_rows=64, lanes=2).shards(128)) == 2
    assert len(SamplerPool(targets, min_rows=1).shards(6)) == 6
    tokens, expected = step(one_lane, rows=12)
    assert tokens.tolist() == expected.tolist()


def test_the_turn_skips_a_target_that_is_down():
    pool = SamplerPool([SamplerTarget("a", Sampler(), 1), SamplerTarget("b", Sampler(), 1),
                        SamplerTarget("c", Sampler(), 1)], min_rows=64, lanes=2)
    pool.targets[1].down_until = time.monotonic() + 60
    assert [named(pool.shards(10))[0][0] for _ in range(4)] == ["a", "c", "a", "c"]
    assert named(pool.shards(128)) == [("a", 0, 64), ("c", 64, 128)]


def test_the_default_minimum_is_the_settings_and_the_tokens_do_not_depend_on_it():
    assert SamplerPool([SamplerTarget("a", Sampler(), 2)]).min_rows == \
        LlmSettings.sampler_shard_min_rows
    results = []
    for min_rows in (1, 5, 64):
        samplers = [Sampler(), Sampler()]
        pool = SamplerPool([SamplerTarget("a", samplers[0], 2), SamplerTarget("b", samplers[1], 1)],
                           min_rows=min_rows)
        tokens, expected = step(pool, rows=12)
        assert tokens.tolist() == expected.tolist()
        results.append((tokens.tolist(), len(samplers[0].rows) + len(samplers[1].rows)))
    assert [shards for _, shards in results] == [3, 2, 1]
    assert results[0][0] == results[1][0] == results[2][0]


def test_a_failing_target_hands_its_rows_to_another_and_is_probed_back():
    broken, healthy, retries = Sampler(failing=True), Sampler(), []
    pool = SamplerPool([SamplerTarget("broken", broken, 2), SamplerTarget("healthy", healthy, 2)],
                       on_retry=lambda: retries.append(1), probe_after_s=60, min_rows=1)
    tokens, expected = step(pool)
    assert tokens.tolist() == expected.tolist() and len(retries) == 2
    assert sum(healthy.rows) == 12 and pool.targets[0].failures == 2
    assert pool.targets[0].down_until > time.monotonic() + 50  # left out for probe_after_s
    healthy.rows.clear()
    step(pool)  # while it is down, nothing is sent to it
    assert not retries[2:] and sum(healthy.rows) == 12
    broken.failing = False
    pool.targets[0].down_until = 0.0  # its time out over
    tokens, expected = step(pool)
    assert tokens.tolist() == expected.tolist() and sum(broken.rows) == 6
    assert pool.targets[0].failures == 0


def test_a_target_with_a_probe_takes_rows_again_only_once_it_answers():
    """A remote endpoint that failed (a hung host) is asked its readiness
    in the background once its time out is over, and takes no rows until
    it answers: rows are not spent on it at a request's whole timeout."""
    hung, healthy, asked = Sampler(failing=True), Sampler(), []

    def probe():
        asked.append(1)
        return not hung.failing

    pool = SamplerPool([SamplerTarget("remote", hung, 2, probe=probe),
                        SamplerTarget("local", healthy, 2)], probe_after_s=0.1, min_rows=1)
    step(pool)
    assert hung.attempts == 2 and not pool.targets[0].answered
    time.sleep(0.15)
    for _ in range(3):  # its probe does not answer: no rows for it, however often asked
        step(pool)
        time.sleep(0.1)
    assert hung.attempts == 2 and len(asked) >= 2
    hung.failing = False
    deadline = time.monotonic() + 5
    while not pool.targets[0].answered and time.monotonic() < deadline:
        pool.targets[0].is_up(time.monotonic())
        time.sleep(0.02)
    tokens, expected = step(pool)
    assert tokens.tolist() == expected.tolist() and sum(hung.rows) == 6
    assert pool.targets[0].failures == 0


def test_a_probe_answer_older_than_a_failure_does_not_take_the_target_back():
    """A call in flight when its target's probe was asked fails before the
    probe answers: the answer, older than that failure, leaves it out (even
    where a serve since has reset its count of failures), and the next probe
    (asked once its time out is over) decides."""
    release, answers = threading.Event(), []

    def probe():
        answers.append(release.wait(5))
        return True

    target = SamplerTarget("remote", Sampler(), 2, probe=probe, answered=False)
    assert not target.is_up(time.monotonic())  # the probe asked, in its own thread
    target.failed(probe_after_s=0.0)  # the call in flight fails meanwhile (SamplerPool._mark_down)
    target.failures = 0  # and another serves once (SamplerPool._served): the count is back
    release.set()
    deadline = time.monotonic() + 5
    while target.probing and time.monotonic() < deadline:
        time.sleep(0.01)
    assert answers == [True] and not target.answered
    assert not target.is_up(time.monotonic())  # asked again
    deadline = time.monotonic() + 5
    while not target.answered and time.monotonic() < deadline:
        time.sleep(0.01)
    assert answers == [True, True] and target.is_up(time.monotonic())


class Hanging(Sampler):
    """A remote host's sampler that answers at once but hangs every call
    while `hanging` is set: until `answer()` lets one call through (then it
    answers, late, or fails if `fail`), or 5 s (a request's timeout: it
    fails)."""

    def __init__(self):
        super().__init__()
        self.hanging, self.fail, self.hung, self.ended = False, False, 0, threading.Event()
        self.gate = threading.Semaphore(0)

    def answer(self, calls=1):
        for _ in range(calls):
            self.gate.release()

    def __call__(self, inputs):
        if self.hanging:
            self.hung += 1
            try:
                if not self.gate.acquire(timeout=5) or self.fail:
                    raise SamplerCallError("Deadline Exceeded")
            finally:
                self.ended.set()
        return super().__call__(inputs)


#: a request of one row: its late limit is its kind's, unscaled
ONE_ROW = {"logits": np.zeros((1, VOCAB), np.float32)}


def hanging_pool(capacity=1):
    hanging, healthy, retries = Hanging(), Sampler(), []
    remote = SamplerTarget("remote", hanging, capacity, probe=lambda: True)
    remote.times[True].observe(0.005, ONE_ROW["logits"].nbytes)  # its usual answers: fast
    pool = SamplerPool([remote, SamplerTarget("local", healthy, 2)],
                       on_retry=lambda: retries.append(1), probe_after_s=60, min_rows=1)
    step(pool)
    assert remote.late_after(ONE_ROW) == LATE_FLOOR_S and hanging.rows
    hanging.hanging = True
    return pool, hanging, healthy, retries


def timed_step(pool, seed):
    started = time.monotonic()
    tokens, expected = step(pool, seed=seed)
    took = time.monotonic() - started
    assert tokens.tolist() == expected.tolist()  # the late shard sampled elsewhere: the same
    assert took < 2.5, f"{took:.2f} s: the shard waited for the hung call's timeout"


def wait_for(condition):
    deadline = time.monotonic() + 5
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert condition()


def test_a_late_shard_goes_elsewhere_and_a_second_late_episode_marks_its_target_down():
    """A shard a remote target has not answered within its ``late_after`` is
    sent to another target that is up (the same rows: the same tokens), its
    call left running; the target takes no shard until that call ends, its
    limit backed off; one late episode leaves it up, a second in a row marks
    it down as a failed one."""
    pool, hanging, _, retries = hanging_pool()
    remote = pool.targets[0]
    try:
        timed_step(pool, seed=7)
        assert hanging.hung == 1 and len(retries) == 1 and remote.lates == 1
        assert not remote.is_up(time.monotonic())  # its late call still runs
        timed_step(pool, seed=8)
        assert hanging.hung == 1  # nothing more sent to it meanwhile
        hanging.answer()  # the late call answers: up again, its limit backed off
        wait_for(lambda: remote.abandoned == 0)
        assert remote.is_up(time.monotonic()) and remote.late_after(ONE_ROW) == 2 * LATE_FLOOR_S
        timed_step(pool, seed=9)
        assert hanging.hung == 2 and remote.down_until > time.monotonic() + 50
    finally:
        hanging.answer(5)
        pool.close()


def test_a_late_episode_ends_with_an_answer_in_time():
    """Late, then answered in time, then late: one late in a row each time,
    never marked down; the answer in time resets the backed-off limit."""
    pool, hanging, _, _ = hanging_pool()
    remote = pool.targets[0]
    try:
        for seed in (7, 8):
            hanging.hanging = True
            timed_step(pool, seed=seed)
            hanging.hanging = False
            hanging.answer()
            wait_for(lambda: remote.abandoned == 0)
            step(pool, seed=seed + 10)  # answered in time
            assert remote.lates == 0 and remote.late_after(ONE_ROW) == LATE_FLOOR_S
        assert remote.down_until == 0.0 and hanging.hung == 2
    finally:
        pool.close()


def test_the_shards_of_one_step_late_together_are_one_episode():
    """A host of two instances stalls once: both of the step's shards are
    late, which is one late episode, not two in a row."""
    pool, hanging, _, retries = hanging_pool(capacity=2)
    try:
        timed_step(pool, seed=7)
        assert hanging.hung == 2 and len(retries) == 2
        assert pool.targets[0].lates == 1 and pool.targets[0].down_until == 0.0
        assert pool.targets[0].late_after(ONE_ROW) == 2 * LATE_FLOOR_S  # backed off once
    finally:
        hanging.answer(2)
        pool.close()


def test_a_late_calls_own_failure_marks_its_target_down():
    pool, hanging, _, _ = hanging_pool()
    hanging.fail = True
    try:
        timed_step(pool, seed=7)
        assert pool.targets[0].down_until == 0.0
        hanging.answer()  # the late call fails now: its target is marked down
        wait_for(lambda: pool.targets[0].down_until > time.monotonic() + 50)
    finally:
        pool.close()


def test_a_late_calls_failure_after_an_answer_in_time_marks_nothing():
    """A host that answered in time since a late call was sent is back: that
    call's failure, long after, does not mark it down."""
    pool, hanging, _, _ = hanging_pool()
    remote = pool.targets[0]
    hanging.fail = True
    try:
        timed_step(pool, seed=7)
        with remote._late_lock:
            remote.answered_at = time.monotonic()  # it answered another call in time meanwhile
        hanging.answer()
        wait_for(lambda: remote.abandoned == 0)
        assert remote.down_until == 0.0
    finally:
        pool.close()


def test_a_late_answer_is_not_counted_into_the_answer_times():
    """Karn's rule: an answer nobody waited for says nothing of the next one's
    time (counted, a host that answered its hung calls late would hold every
    later shard about as long); the limit stays backed off until an answer
    comes in time."""
    pool, hanging, _, _ = hanging_pool()
    try:
        timed_step(pool, seed=7)
        time.sleep(0.5)
        hanging.answer()  # the late call answers, 0.5 s late
        wait_for(lambda: pool.targets[0].abandoned == 0)
        assert pool.targets[0].late_after(ONE_ROW) == 2 * LATE_FLOOR_S
    finally:
        pool.close()


def test_a_host_grown_slower_for_good_is_learnt():
    """RFC 6298's backoff: a host whose answers now take 0.3 s (past its
    0.2 s limit) is late once, then given twice the time, answers in time,
    and its new time is learnt: it keeps sampling its share."""
    slow, healthy = Sampler(), Sampler()

    def call(inputs):
        time.sleep(0.3)
        return slow(inputs)

    remote = SamplerTarget("remote", call, 1, probe=lambda: True)
    remote.times[True].observe(0.005, ONE_ROW["logits"].nbytes)
    pool = SamplerPool([remote, SamplerTarget("local", healthy, 1)], probe_after_s=60, min_rows=1)
    try:
        step(pool, seed=1)  # late: sampled by local
        wait_for(lambda: remote.abandoned == 0)
        for seed in range(2, 5):
            step(pool, seed=seed)
        assert slow.rows and remote.down_until == 0.0 and remote.lates == 0
        assert remote.late_after(ONE_ROW) > 0.3
    finally:
        pool.close()


def test_close_ends_a_late_call_and_marks_nothing(caplog):
    class Closable(Hanging):
        def close(self):
            self.answer()

    hanging, retries = Closable(), []
    remote = SamplerTarget("remote", hanging, 1, probe=lambda: True)
    remote.times[True].observe(0.005, ONE_ROW["logits"].nbytes)
    pool = SamplerPool([remote, SamplerTarget("local", Sampler(), 2)], probe_after_s=60,
                       min_rows=1, on_retry=lambda: retries.append(1))
    hanging.hanging = hanging.fail = True
    timed_step(pool, seed=7)
    pool.close()  # the remote's client closed: its late call fails at once
    assert hanging.ended.wait(2)
    wait_for(lambda: remote.abandoned == 0)
    assert remote.down_until == 0.0 and "failed" not in caplog.text


def test_the_synchronous_path_gives_up_on_a_late_remote_shard_and_the_loop_sends_it_again():
    """``send_now`` (the data-plane thread's path) waits for a remote shard
    only until its ``late_after`` when another target is up: None (the
    target takes no shard while its late calls run), and the event loop's
    ``send`` samples the rows elsewhere."""
    pool, hanging, _, retries = hanging_pool(capacity=2)
    rows = torch.randn(12, VOCAB)
    batch = SamplingBatch.from_params([SamplingParams(seed=row) for row in range(12)])
    try:
        started = time.monotonic()
        assert pool.send_now({"logits": rows.numpy()}, batch) is None
        assert time.monotonic() - started < 2.5 and hanging.hung == 2 and len(retries) == 2
        assert not pool.targets[0].is_up(time.monotonic())
        tokens, _ = asyncio.run(pool(rows, batch))
        assert tokens.tolist() == sample(rows.numpy(), batch, return_logprobs=False).token_ids.tolist()
        assert hanging.hung == 2  # nothing more sent to it
    finally:
        hanging.answer(2)
        pool.close()


def test_the_synchronous_path_gives_up_on_two_stalled_remotes_at_once():
    """Two remote targets stall together: ``send_now`` gives up on both at
    their limit (the targets up are taken before it gives up on any), not on
    the first and then waits out the second."""
    first, second = Hanging(), Hanging()
    targets = [SamplerTarget(name, sampler, 1, probe=lambda: True)
               for name, sampler in (("a", first), ("b", second))]
    for target in targets:
        target.times[True].observe(0.005, ONE_ROW["logits"].nbytes)
    pool = SamplerPool(targets, min_rows=1)
    rows = torch.randn(4, VOCAB)
    batch = SamplingBatch.from_params([SamplingParams(seed=row) for row in range(4)])
    first.hanging = second.hanging = True
    try:
        started = time.monotonic()
        assert pool.send_now({"logits": rows.numpy()}, batch) is None
        assert time.monotonic() - started < 2.0 and first.hung == second.hung == 1
    finally:
        first.answer(), second.answer()
        pool.close()


def test_with_no_target_up_a_shard_waits_for_a_late_call_rather_than_a_failed_target():
    """A remote's late call runs while the only other target fails: the shard
    goes back to the late one (back soonest: it is not down), not round and
    round the failed one until the late call ends (helper-61's case)."""
    late, failing = Hanging(), Sampler(failing=True)

    def fail_slowly(inputs):  # still up when the other is given up on
        time.sleep(0.6)
        return failing(inputs)

    targets = [SamplerTarget("late", late, 1, probe=lambda: True),
               SamplerTarget("failing", fail_slowly, 1, probe=lambda: True)]
    for target in targets:
        target.times[True].observe(0.005, ONE_ROW["logits"].nbytes)
    pool = SamplerPool(targets, min_rows=1, probe_after_s=60)
    late.hanging = True
    threading.Timer(1.5, late.answer, args=(5,)).start()  # its calls end, answered, in 1.5 s
    try:
        timed_step(pool, seed=3)
        assert late.hung >= 2 and failing.attempts <= 2  # its own shard, and the late one's
    finally:
        late.answer(5)
        pool.close()


@pytest.mark.parametrize("path", ["send", "send_now"])
def test_a_lone_remote_target_late_is_waited_for_rather_than_dropped(path):
    """With no other target up, a late call is still the shard's best hope:
    its answer is awaited, on either path, not abandoned."""
    slow = Sampler()

    def call(inputs):
        time.sleep(0.4)
        return slow(inputs)

    target = SamplerTarget("remote", call, 1, probe=lambda: True)
    target.times[True].observe(0.01, ONE_ROW["logits"].nbytes)  # its usual answers: fast
    pool = SamplerPool([target], min_rows=1)
    rows = torch.randn(4, VOCAB)
    batch = SamplingBatch.from_params([SamplingParams(seed=row) for row in range(4)])
    if path == "send":
        tokens = asyncio.run(pool(rows, batch))[0]
    else:
        tokens = pool.send_now({"logits": rows.numpy()}, batch)["output_ids"]
    assert tokens.tolist() == sample(rows.numpy(), batch, return_logprobs=False).token_ids.tolist()
    assert target.failures == 0 and target.lates == 0
    assert target.late_after(ONE_ROW) > LATE_FLOOR_S  # the slow answer counted in
    pool.close()


def test_late_after_follows_each_kinds_answer_times():
    """RFC 6298's estimator over the answers' times, full rows and compact
    ones apart, a larger request than usual given time in proportion; none
    for this server's own instances (their calls may read the arena's slot:
    never abandoned)."""
    local = SamplerTarget("local", Sampler(), 1)
    shared = SamplerTarget("shared", Sampler(), 1, probe=lambda: True, shares_memory=True)
    remote = SamplerTarget("remote", lambda inputs: {}, 1, probe=lambda: True)
    compact = {"hot_logits": np.zeros(4, np.float32)}
    assert local.late_after(ONE_ROW) is None and shared.late_after(ONE_ROW) is None
    assert remote.late_after(ONE_ROW) == LATE_FIRST_S == remote.late_after(compact)
    remote.timed_call(compact)
    assert remote.late_after(compact) == LATE_FLOOR_S  # a fast first answer: the floor
    assert remote.late_after(ONE_ROW) == LATE_FIRST_S  # full rows: none answered yet
    times = remote.times[True]
    times.answer_s, times.spread_s, times.request_bytes = 0.5, 0.1, 1000.0
    small, large = {"logits": np.zeros(250, np.float32)}, {"logits": np.zeros(750, np.float32)}
    assert remote.late_after(small) == pytest.approx(0.9)  # never less than its usual
    assert remote.late_after(large) == pytest.approx(2.7)  # three times its usual bytes


def test_a_remote_client_reaches_a_host_back_from_a_restart_within_about_a_second():
    """A sampler host down for 6 s, its client asking every 0.1 s meanwhile
    (as a pool's probe and shards do): once the host listens again the
    client reaches it within about a second (its reconnect backoff capped at
    RECONNECT_BACKOFF_MS); gRPC's default backoff, grown to about 4 s by
    then, took 2-4 s more."""
    from concurrent import futures

    import grpc

    from simple_sampler.launch.ports import free_port
    from simple_sampler.triton.sampler_client import SamplerClient

    port = free_port()
    client = SamplerClient(f"127.0.0.1:{port}", "grpc").client
    started = time.monotonic()
    server = None
    try:
        while True:
            if server is None and time.monotonic() - started > 6.0:
                server = grpc.server(futures.ThreadPoolExecutor(1))
                server.add_insecure_port(f"127.0.0.1:{port}")
                server.start()
                listening = time.monotonic()
            try:
                client.is_server_live(client_timeout=0.5)
                reached = True
            except Exception as error:  # noqa: BLE001 - tritonclient's, any
                # the host's own answer: a bare gRPC server implements nothing
                reached = "UNIMPLEMENTED" in str(getattr(error, "status", lambda: "")())
            if reached and server is not None:
                break
            assert time.monotonic() - started < 20, "never reached"
            time.sleep(0.1)
        assert time.monotonic() - listening < 2.0
    finally:
        client.close()
        if server is not None:
            server.stop(0)


def test_a_lone_target_is_retried_with_backoff_until_it_serves():
    flaky, retries = Sampler(failing=True), []
    pool = SamplerPool([SamplerTarget("local", flaky, 2)], on_retry=lambda: retries.append(1))

    async def recover():
        await asyncio.sleep(0.3)
        flaky.failing = False

    async def main():
        logits = torch.zeros((4, VOCAB))
        batch = SamplingBatch.from_params([SamplingParams(temperature=0.0)] * 4,
                                          [History()] * 4)
        result, _ = await asyncio.gather(pool(logits, batch), recover())
        return result

    tokens, _ = asyncio.run(main())
    assert tokens.tolist() == [0] * 4 and 2 <= len(retries) <= 12


def test_refused_rows_are_not_sent_again():
    refusing = Sampler(failing=True, retryable=False)
    other = Sampler()
    pool = SamplerPool([SamplerTarget("a", refusing, 1), SamplerTarget("b", other, 1)],
                       min_rows=1)
    with pytest.raises(SamplerCallError, match="not healthy"):
        step(pool)
    assert refusing.attempts == 1 and pool.targets[0].failures == 0
    assert other.attempts <= 1  # at most its own shard, never the refused one


def test_retries_stop_at_the_deadline():
    pool = SamplerPool([SamplerTarget("local", Sampler(failing=True), 1)], deadline_s=0.5)
    started = time.monotonic()
    with pytest.raises(SamplerCallError):
        step(pool)
    assert time.monotonic() - started < 1.5


@pytest.mark.parametrize("text, names", [
    ("", ["local"]), ("local", ["local"]), ("local, h1:8001,h2:9001", ["local", "h1:8001", "h2:9001"]),
])
def test_endpoint_lists(text, names):
    assert parse_endpoints(text) == names


@pytest.mark.parametrize("text, message", [
    ("h1", "host:port"), ("h1:x", "host:port"), ("local,local", "twice"),
])
def test_bad_endpoint_lists_name_the_setting(text, message):
    with pytest.raises(ValueError, match=f"sampler_endpoints.*{message}"):
        parse_endpoints(text)


def test_local_needs_a_local_call():
    with pytest.raises(ValueError, match="includes 'local'"):
        build_pool("local", None, 2)


def test_targets_get_views_of_the_engine_logits_not_copies():
    """docs/COPIES.md: the pool adds no copy of the rows; the one into the
    BLS request (or the gRPC message) is the python backend's (tritonclient's)."""
    seen = []

    def target(inputs):
        seen.append(inputs["logits"])
        return Sampler()(inputs)

    logits = torch.randn(8, VOCAB)
    batch = SamplingBatch.from_params([SamplingParams(seed=row) for row in range(8)])
    asyncio.run(SamplerPool([SamplerTarget("a", target, 2)], min_rows=1)(logits, batch))
    assert len(seen) == 2 and all(np.shares_memory(part, logits.numpy()) for part in seen)


@pytest.fixture
def arena():
    arena = RowArena(2, 16 * VOCAB * 4)
    yield arena
    arena.close()


def test_local_targets_read_the_rows_from_the_arena_and_give_the_same_tokens(arena):
    local, remote = Sampler(), Sampler()
    pool = SamplerPool([SamplerTarget("local", local, 2, shares_memory=True),
                        SamplerTarget("remote", remote, 1)], arena=arena, min_rows=1)
    tokens, expected = step(pool)
    assert tokens.tolist() == expected.tolist()
    assert local.by_reference == 2 and remote.by_reference == 0, "remote gets rows inline"
    assert sorted(arena.free) == [0, 1], "the slot is given back once every shard answered"


def test_rows_in_a_slot_the_engine_took_are_claimed_there_and_given_back_once(arena):
    """``torch_engine.stage_rows``' rows: the pool sends references to the
    slot they lie in (no copy into another) and gives it back after the
    answers; ``reference`` (the hot-first sampler's, never given back) does
    not claim it."""
    local = Sampler()
    pool = SamplerPool([SamplerTarget("local", local, 2, shares_memory=True)], arena=arena,
                       min_rows=1)
    logits = torch.randn(12, VOCAB)
    staged = torch.from_numpy(arena.take((12, VOCAB), np.float32))
    staged.copy_(logits)
    copies = []
    lease = arena.lease
    arena.lease = lambda rows: copies.append(rows) or lease(rows)
    assert pool.reference(staged) is None and arena.taken, "not claimed for hot-first"
    batch = SamplingBatch.from_params([SamplingParams(seed=row) for row in range(12)])
    tokens, _ = asyncio.run(pool(staged, batch))
    assert not copies and local.by_reference == 2 and not arena.taken
    assert sorted(arena.free) == [0, 1]
    assert tokens.tolist() == asyncio.run(SamplerPool([SamplerTarget("a", Sampler())])(
        logits, batch))[0].tolist()
    del staged
    assert sorted(arena.free) == [0, 1], "given back once, by the pool"


def test_failover_reads_the_same_slot(arena):
    dead, alive = Sampler(failing=True), Sampler()
    pool = SamplerPool([SamplerTarget("dead", dead, 2, shares_memory=True),
                        SamplerTarget("alive", alive, 2, shares_memory=True)], arena=arena,
                       min_rows=1)
    tokens, expected = step(pool)
    assert tokens.tolist() == expected.tolist()
    assert alive.by_reference == 4 and sum(alive.rows) == 12
    assert sorted(arena.free) == [0, 1]


def test_a_full_arena_sends_the_rows_inline(arena):
    held = [arena.lease(np.zeros((1, VOCAB), np.float32)) for _ in range(2)]
    local = Sampler()
    pool = SamplerPool([SamplerTarget("local", local, 2, shares_memory=True)], arena=arena)
    tokens, expected = step(pool)
    assert tokens.tolist() == expected.tolist() and local.by_reference == 0
    for lease in held:
        lease.release()


def test_a_shard_that_fails_for_good_still_waits_for_the_others_before_the_slot_goes(arena):
    class Slow(Sampler):
        def __call__(self, inputs):
            time.sleep(0.2)
            self.reader.check(inputs["logits_ref"])  # the slot is still ours
            return super().__call__(inputs)

    refusing, slow = Sampler(failing=True, retryable=False), Slow()
    pool = SamplerPool([SamplerTarget("refusing", refusing, 1, shares_memory=True),
                        SamplerTarget("slow", slow, 1, shares_memory=True)], arena=arena,
                       min_rows=1)
    with pytest.raises(SamplerCallError):
        step(pool)
    assert slow.rows == [6] and sorted(arena.free) == [0, 1]


def test_rows_of_a_refused_step_stay_in_their_slot_while_it_is_sampled_around_them(arena):
    """A step the sampler refuses (NaN in one row) is sampled again in halves
    (``samplers.sample_around_refusals``) from the same rows: the slot they
    lie in (``stage_rows``' ``take``) is not given back when the first call
    fails, where the halves' copies would land on them, but once the rows
    are gone."""
    from simple_sampler.serving.samplers import sample_around_refusals

    pool = SamplerPool([SamplerTarget("local", Sampler(), 1, shares_memory=True)], arena=arena,
                       min_rows=1)
    rows = np.random.default_rng(0).standard_normal((5, VOCAB)).astype(np.float32)
    staged = torch.from_numpy(arena.take((5, VOCAB), np.float32))
    staged.copy_(torch.from_numpy(rows))
    staged[4, 3] = float("nan")
    batch = SamplingBatch.from_params([SamplingParams(seed=row) for row in range(5)])

    async def around(logits):
        try:
            await pool(logits, batch)
        except ValueError as refusal:
            return await sample_around_refusals(pool, logits, batch, refusal)
    (tokens, _), refused = asyncio.run(around(staged))
    assert sorted(refused) == [4] and "found at column 3" in refused[4]
    expected = sample(rows[:4], batch.take(np.arange(4)), return_logprobs=False).token_ids
    assert tokens[:4].tolist() == expected.tolist()
    assert len(arena.free) == 1, "the refused step's slot is held while its rows live"
    del staged
    gc.collect()
    assert sorted(arena.free) == [0, 1]


def test_a_remote_endpoint_of_another_vocabulary_or_hot_set_is_refused_at_start(monkeypatch):
    """RemoteSampler.check, as the llm model loads: a row_scalars record of
    another version's size, a declared V other than the decode loop's, or a probe row refused for another hot set, raise
    naming them; the probe is one row of the endpoint's V in the dtype it
    declares; any other failure of the probe leaves the check to the requests."""
    import ml_dtypes

    from simple_sampler.triton.sampler_targets import RemoteSampler

    config = {"parameters": {"vocab_size": {"string_value": "64"}},
              "input": [{"name": "logits", "data_type": "TYPE_BF16"}]}
    with pytest.raises(ValueError, match="h:1 samples rows of V=64, this decode loop's have V=32"):
        RemoteSampler("h:1", hot_set=5, vocab_size=32).check(config)
    from simple_sampler.schema import ROW_SCALARS_RECORD

    older = {**config, "input": [*config["input"], {"name": "row_scalars", "data_type": "TYPE_UINT8",
                                                     "dims": ["64"]}]}
    with pytest.raises(ValueError, match=f"h:1 reads row_scalars records of 64 bytes, this server "
                                         f"sends {ROW_SCALARS_RECORD.itemsize}: it runs another"):
        RemoteSampler("h:1", vocab_size=64).check(older)
    remote = RemoteSampler("h:1", hot_set=5, vocab_size=64)
    sent, answers = [], []

    def answer(self, inputs):
        sent.append(inputs["logits"])
        raise answers.pop(0)

    monkeypatch.setattr(RemoteSampler, "__call__", answer)
    answers.append(SamplerCallError("h:1: hot_vocab_fingerprint: the request's other samplers "
                                    "hold hot set 0x5, this one no hot set", retryable=False))
    with pytest.raises(ValueError, match="sampler endpoint h:1: hot_vocab_fingerprint"):
        remote.check(config)
    assert sent[0].shape == (1, 64) and sent[0].dtype == ml_dtypes.bfloat16
    answers.append(SamplerCallError("h:1: connection refused"))
    RemoteSampler("h:1", hot_set=5).check(config)  # the endpoint's own V; not this
    # check's failure: no raise
    assert sent[1].shape == (1, 64)


def test_strided_rows_are_sent_contiguous_and_read_in_place_by_reference():
    """Rows that are a strided view (every other row of a step: ``hot_first.
    rows_in_place``) reach a target that takes them in the request as one
    contiguous array (a BLS tensor must be), and a target that maps the
    arena's shared region by reference, no slot taken; both give the
    kernels' tokens for those rows."""
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((12, VOCAB)).astype(np.float32)
    params = [SamplingParams(seed=200 + row) for row in range(6)]
    batch = SamplingBatch.from_params(params, [History([1], [])] * 6, [0] * 6)
    expected = sample(logits[::2], batch, return_logprobs=False).token_ids
    sent = []
    by_value = Sampler()
    pool = SamplerPool([SamplerTarget("b", lambda inputs: sent.append(inputs["logits"]) or by_value(inputs),
                                      1)])
    tokens, _ = asyncio.run(pool(torch.from_numpy(logits)[::2], batch))
    assert tokens.tolist() == expected.tolist()
    assert sent[0].flags.c_contiguous and np.array_equal(sent[0], logits[::2])
    arena = RowArena(1, logits.nbytes)
    try:
        mapped = Sampler()
        pool = SamplerPool([SamplerTarget("a", mapped, 1, shares_memory=True)], arena=arena)
        tokens, _ = asyncio.run(pool(torch.from_numpy(arena.share(logits))[::2], batch))
        assert tokens.tolist() == expected.tolist()
        assert mapped.by_reference == 1 and arena.generation == 0
    finally:
        arena.close()


def penalized_state(arena, rows=6):
    """A BatchState over `arena` whose rows are penalized every other way."""
    state = BatchState(rows, 16, arena=arena)
    for row in range(rows):
        state.add(SamplingParams(seed=300 + row, repetition_penalty=1.5 if row % 2 else 1.0,
                                 frequency_penalty=0.0 if row % 3 else 0.7), [1 + row, 2, 2])
    state.append(np.arange(rows), np.arange(rows) + 10)
    return state


def test_histories_go_by_reference_to_instances_that_map_the_arena_and_as_lists_to_others():
    """A batch naming its histories in the arena (``history_ref``) reaches a
    target that maps the arena as that reference (no id list in the
    request), and a target on another host as the lists; both give the
    kernels' tokens of the gathered batch, through ``send`` and ``send_now``."""
    arena = RowArena(1, 6 * VOCAB * 4)
    try:
        batch = penalized_state(arena).batch(np.arange(6))
        assert batch.history_ref is not None
        logits = np.random.default_rng(6).standard_normal((6, VOCAB)).astype(np.float32) * 3
        expected = sample(logits, batch.with_histories(), return_logprobs=False).token_ids
        sent = {"local": [], "remote": []}

        def target(name, shares_memory):
            sampler = Sampler()
            return SamplerTarget(name, lambda inputs: sent[name].append(set(inputs))
                                 or sampler(inputs), 1, shares_memory=shares_memory)
        for targets in ([target("local", True)], [target("remote", False)],
                        [target("local", True), target("remote", False)]):
            pool = SamplerPool(targets, arena=arena, min_rows=1)
            assert pool.history_arena is (arena if targets[0].name == "local" else None)
            tokens, _ = asyncio.run(pool(torch.from_numpy(logits), batch))
            assert tokens.tolist() == expected.tolist()
            now = pool.send_now({"logits": logits}, batch)
            assert now["output_ids"].tolist() == expected.tolist()
        assert sent["local"] and all("history_ref" in names and "generated_ids" not in names
                                     for names in sent["local"])
        assert sent["remote"] and all("history_ref" not in names and "generated_ids" in names
                                      for names in sent["remote"])
    finally:
        arena.close()


@pytest.mark.parametrize("change, message", [
    ("no reader", "history_ref needs a sampler on the llm model's host"),
    ("with lists", "send history_ref or prompt_ids / generated_ids, not both"),
    ("past the region", r"history_ref's output ranges must each lie within one row of \[0, 96\)"
                        r".*; row 0's is \[\d+, 1099511627776\)"),
    ("reversed", r"history_ref's prompt ranges must each lie within one row of \[96, 192\)"),
    ("narrow", r"history_ref must be INT64 \[6, 5\] .*, got int64 \[6, 4\]"),
    ("int32", r"history_ref must be INT64 \[6, 5\] .*, got int32 \[6, 5\]"),
    ("two regions", "history_ref rows must name one region"),
    ("no region", "history_ref names region .*, which does not exist"),
    ("rows region", "history_ref names region .*, which holds no token histories"),
    ("not a region", "history_ref names .*, which is not a region"),
    ("across rows", r"history_ref's output ranges must each lie within one row of \[0, 96\)"),
    ("other half", r"history_ref's prompt ranges must each lie within one row of \[96, 192\)"),
    ("bad ids", r"history_ref: the output ids it names must be token ids in \[0, 64\), got"),
    ("negative ids", r"history_ref: the output ids it names must be token ids in \[0, 64\), "
                     r"got -5$"),
])
def test_a_history_ref_the_sampler_cannot_read_is_refused_by_name(change, message):
    """Every malformed ``history_ref`` is a clear InvalidRequest naming it;
    a region that holds no histories (a logits region's floats) is refused
    by the ids' range, never read as ids out of range."""
    arena, garbage = RowArena(1, 64), None
    try:
        state = penalized_state(arena)
        batch = state.batch(np.arange(6))
        logits = np.zeros((6, VOCAB), np.float32)
        inputs = {"logits": logits, **batch_arrays(batch, packed=True)}
        reader = RowReader()
        decode_request(inputs, VOCAB, reader=reader)  # as sent: read
        refs, used = inputs["history_ref"].copy(), reader
        sent = {**inputs, "history_ref": refs}
        if change == "no reader":
            used = None
        elif change == "with lists":
            sent["generated_ids"] = np.full((6, 1), 3, np.int32)
        elif change == "past the region":
            refs[0, 4] = 1 << 40
        elif change == "reversed":
            refs[1, 2] = refs[1, 1] - 1
        elif change == "narrow":
            sent["history_ref"] = refs[:, :4]
        elif change == "int32":
            sent["history_ref"] = refs.astype(np.int32)
        elif change == "two regions":
            refs[2, 0] += 1
        elif change == "no region":
            refs[:, 0] += 1
        elif change == "rows region":  # the ring of logits rows
            refs[:, 0] = arena.ring.key
        elif change == "not a region":  # a file of the regions' name, too short for a header
            garbage = Region(1)
            os.truncate(garbage.path, 16)
            refs[:, 0] = garbage.key
        elif change == "across rows":  # past its row's end into the next slot's
            refs[0, 4] = refs[0, 3] + 17
        elif change == "other half":  # prompt ids from the output half
            refs[0, 1:3] = refs[0, 3:5]
        else:  # ids no token: written into the region behind the state's back
            state.tokens[0, 3] = 1000 if change == "bad ids" else -5
        with pytest.raises(InvalidRequest, match=message):
            decode_request(sent, VOCAB, reader=used)
    finally:
        arena.close()
        if garbage is not None:
            garbage.unlink()


def test_rows_whose_penalties_were_turned_off_name_no_history():
    """A batch by reference whose rows' penalties were turned off after it
    was built (hot-first's second round: ``handoff.fallback_batch``) names
    no range for them: nothing to gather or send for ids no penalty reads."""
    arena = RowArena(1, 64)
    try:
        batch = penalized_state(arena).batch(np.arange(6))
        gathered = batch.with_histories()
        prompt, output = np.diff(gathered.prompt_offsets), np.diff(gathered.output_offsets)
        assert prompt[1] and output[1] and prompt[3] and output[3]  # what the state named
        batch.repetition_penalty = batch.repetition_penalty.copy()
        batch.repetition_penalty[[1, 3]] = 1.0  # row 1 keeps no penalty, row 3 its frequency one
        refs = batch_arrays(batch, packed=True)["history_ref"]
        named = refs[:, [2, 4]] - refs[:, [1, 3]]
        assert named[1].tolist() == [0, 0] and named[3].tolist() == [0, output[3]]
        assert named[5].tolist() == [prompt[5], output[5]]  # unchanged rows as the state named
    finally:
        arena.close()
