"""The decision plane across servers: the decode loop samples on two
sampler endpoints over gRPC (no local instance), gives the tokens a single
server gives, and loses no request when one of them stops mid-load. The
endpoints: the shared llm_server's own sampler model (never stopped) and a
sampler-only server (stopped by the stop test). A failed endpoint is taken
back only once it samples again (its own server, last)."""
import os
import signal
import time

import pytest
from tritonclient.utils import InferenceServerException

from conftest import SAMPLED_SEEDS
from fakes import SAMPLED, Streams, wait_until
from simple_sampler.settings import LlmSettings, SamplerSettings
from simple_sampler.launch.processes import SHM_DIRECTORY, list_stubs
from simple_sampler.launch.serve import assemble_repository
from simple_sampler.launch.server import TritonServer
from simple_sampler.triton.counters import read_counter, wait_for_counter
from simple_sampler.triton.sampler_pool import SamplerPool
from simple_sampler.triton.sampler_targets import SamplerTarget

pytestmark = pytest.mark.slow

TOKENS = 32
ROWS = "simple_sampler_rows_total"


@pytest.fixture(scope="module")
def remote(tmp_path_factory, llm_server):
    """A sampler-only server, and a serving server that samples only on it
    and on llm_server's sampler model."""
    sampler = SamplerSettings(sampler_instances=1, sampler_max_batch_size=64, vocab_size=49_152)
    alone = TritonServer(assemble_repository(tmp_path_factory.mktemp("sampler"), sampler),
                         log_path=tmp_path_factory.mktemp("sampler-log") / "log").start()
    samplers = [llm_server, alone]
    try:
        repository = assemble_repository(
            tmp_path_factory.mktemp("serving"), sampler,
            LlmSettings(engine_max_batch_size=32, max_context=512, batch_invariant=True,
                        sampler_endpoints=",".join(s.grpc_url for s in samplers)))
        log = tmp_path_factory.mktemp("serving-log") / "tritonserver.log"
        with TritonServer(repository, log_path=log) as serving:
            yield serving, samplers
    finally:
        alone.stop()


def test_two_sampler_servers_give_the_tokens_of_one_server(remote, llm_server, sampled_tokens):
    serving, samplers = remote
    # llm_server samples for itself too: its count once every earlier one has
    # arrived (the counts come in batches: triton.counters)
    before = wait_for_counter(llm_server.metrics_url, ROWS, lambda _: True,
                              settled_after=time.monotonic())
    spread = Streams(serving.grpc_url, SAMPLED_SEEDS, max_tokens=24, **SAMPLED).join()
    assert not spread.errors
    assert spread.tokens == {seed: tokens[:24] for seed, tokens in sampled_tokens.items()}
    # both endpoints sampled
    rows = [wait_for_counter(llm_server.metrics_url, ROWS, lambda n: n > before) - before,
            wait_for_counter(samplers[1].metrics_url, ROWS, lambda n: n > 0)]
    print(f"rows sampled per endpoint: {rows}")


def test_a_sampler_server_refuses_rows_meant_for_another_hot_set(remote):
    """Through Triton (the input is declared in config.pbtxt): the sampler-only
    server holds no hot set, so rows sent for one are refused as the client's
    mistake (INVALID_ARG: the pool sends them nowhere else), rows for none
    are sampled."""
    import numpy as np
    from tritonclient.utils import InferenceServerException

    from simple_sampler.triton.sampler_client import SamplerClient

    _, samplers = remote
    client = SamplerClient(samplers[1].grpc_url, "grpc")
    logits = np.zeros((2, 49_152), np.float32)
    seeds = np.array([[1], [2]], np.uint64)
    answer = client.sample(logits, random_seed=seeds,
                           hot_vocab_fingerprint=np.zeros((2, 1), np.int64))
    assert answer["output_ids"].shape == (2, 1)
    with pytest.raises(InferenceServerException, match="hold hot set 0x3039, this one no hot set")\
            as refused:
        client.sample(logits, random_seed=seeds,
                      hot_vocab_fingerprint=np.full((2, 1), 12345, np.int64))
    assert "INVALID_ARG" in str(refused.value.status())


def test_a_sampler_server_of_another_hot_set_is_refused_at_start(remote, tmp_path):
    """A decode loop with a hot set pointed at the sampler-only server, which
    holds none: its llm model does not load, naming both (before, the server
    reported ready and then every request failed)."""
    _, samplers = remote
    repository = assemble_repository(
        tmp_path / "repository", SamplerSettings(sampler_instances=1, vocab_size=49_152),
        LlmSettings(engine="simulated", sim_vocab=49_152, hot_vocab_profile="hot_vocab.npz",
                    sampler_endpoints=samplers[1].grpc_url))
    server = TritonServer(repository, log_path=tmp_path / "log")
    with pytest.raises(RuntimeError, match="tritonserver exited"):
        server.start()
    server.stop()
    log = (tmp_path / "log").read_text()
    assert f"failed to load 'llm' version 1: Internal: ValueError: sampler endpoint " \
           f"{samplers[1].grpc_url}: hot_vocab_fingerprint" in log
    assert "this one no hot set" in log


def test_a_sampler_server_stopped_mid_load_costs_no_request(remote, sampled_tokens):
    serving, samplers = remote
    streams = Streams(serving.grpc_url, SAMPLED_SEEDS, max_tokens=TOKENS, **SAMPLED)
    streams.wait_started()
    samplers[1].stop()
    streams.join()
    assert not streams.errors
    assert streams.tokens == {seed: tokens[:TOKENS] for seed, tokens in sampled_tokens.items()}
    assert samplers[1].process.poll() is not None
    assert read_counter(serving.metrics_url, "simple_llm_sampler_retries_total") >= 1  # rows met the stop


def test_a_sampler_server_whose_sampler_hangs_is_not_taken_back(tmp_path):
    """A failed endpoint's probe (``RemoteSampler.ready``) samples a row: a
    server whose sampler stub is stopped (a livelock, a debugger) still
    answers Triton's model readiness, but fails the probe within about its
    1 s limit, so the pool sends it no rows (each shard there would wait for
    the stub's failure, or the request's whole timeout on a hung host). A
    hung host (its tritonserver stopped) costs a shard sent there only its
    target's ``late_after``, not the request's 10 s timeout: the shard is
    sampled elsewhere, and the host takes no shard until that call ends.
    The server's stop then removes the dead stub's region too."""
    from simple_sampler.triton.sampler_client import SamplerClient
    from simple_sampler.triton.sampler_targets import PROBE_TIMEOUT_S, REMOTE_TIMEOUT_S, RemoteSampler

    settings = SamplerSettings(sampler_instances=1, vocab_size=4096)
    server = TritonServer(assemble_repository(tmp_path / "repository", settings),
                          log_path=tmp_path / "log").start()
    pool = None
    try:
        remote = RemoteSampler(server.grpc_url)
        assert remote.ready()  # its configuration read by the probe itself: V from it
        pool = SamplerPool([SamplerTarget("remote", remote, 1, probe=remote.ready),
                            SamplerTarget("local", in_process(4096), 1)], min_rows=1)
        for seed in range(4):  # its answers' time learnt
            assert pool_step(pool, 4096, seed) == ([4, 4], True)
        os.kill(server.process.pid, signal.SIGSTOP)  # the host hangs (a stopped stub fails fast)
        try:
            wait_stopped(server.process.pid)
            sent = time.monotonic()  # its shard waits for it only until it is late
            assert pool_step(pool, 4096, seed=9) == ([0, 8], True)
            late_s, sent = time.monotonic() - sent, time.monotonic()
            left_out = not pool.targets[0].is_up(time.monotonic())  # its late call runs
            assert pool_step(pool, 4096, seed=10) == ([0, 8], True)
            next_s = time.monotonic() - sent
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        # one late episode: a shard of the second step sent there would have made two
        assert left_out and pool.targets[0].lates == 1
        wait_until(lambda: not pool.targets[0].abandoned, timeout_s=10)  # the host is back
        assert pool.targets[0].is_up(time.monotonic())
        # the bounds: well short of the request's whole timeout, however loaded the machine
        assert next_s < REMOTE_TIMEOUT_S / 2, f"{next_s:.1f} s: a shard waited for the late host"
        stub = [s for s in list_stubs(server.process.pid) if s.model == "simple_sampler"][0]
        os.kill(stub.pid, signal.SIGSTOP)
        try:
            asked = time.monotonic()
            with pytest.raises(InferenceServerException):
                remote.ready()
            failed_s = time.monotonic() - asked
            readiness = SamplerClient(server.grpc_url, "grpc").client.is_model_ready(
                "simple_sampler", client_timeout=PROBE_TIMEOUT_S)
        finally:
            os.kill(stub.pid, signal.SIGKILL)  # a stopped stub resumed crashed Triton 2.51
        assert failed_s < PROBE_TIMEOUT_S + 4.0
        assert late_s < REMOTE_TIMEOUT_S / 2, f"{late_s:.1f} s: the hung host's shard waited its whole timeout"
        assert readiness, "Triton's readiness alone now sees a stopped stub: the probe's " \
                          "row is no longer needed for this"
    finally:
        if pool is not None:
            pool.close()
        server.stop()
    # the dead stub's region, which only Triton still held, is removed with it
    assert not (SHM_DIRECTORY / stub.shm_region).exists()


def in_process(vocab_size):
    """A sampler target in this process: the real request decoding and kernels."""
    from simple_sampler.triton.sampler_decode import decode_request
    from simple_sampler.triton.sampler_serve import sample_request

    return lambda inputs: sample_request(decode_request(inputs, vocab_size))[0]


def pool_step(pool, vocab_size, seed):
    """A step of 8 seeded rows through `pool`: (rows each target sampled,
    whether the tokens are the kernels' own)."""
    import asyncio

    import numpy as np
    import torch

    from simple_sampler import SamplingParams
    from simple_sampler.params import SamplingBatch
    from simple_sampler.sampling import sample

    logits = torch.from_numpy(np.random.default_rng(seed).standard_normal((8, vocab_size),
                                                                           np.float32))
    batch = SamplingBatch.from_params([SamplingParams(top_p=0.9, seed=row) for row in range(8)])
    before = dict(pool.rows_sent)
    tokens, _ = asyncio.run(pool(logits, batch))
    rows = [pool.rows_sent.get(t.name, 0) - before.get(t.name, 0) for t in pool.targets]
    return rows, tokens.tolist() == sample(logits.numpy(), batch).token_ids.tolist()


def wait_stopped(pid):
    """Until every thread of `pid` is stopped: a thread running on another
    core when SIGSTOP came may still answer a request on a loaded machine."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as stat:
                    states.append(stat.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # a thread that ended meanwhile
                continue
        if states and all(state in "Tt" for state in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop")
