"""The decision plane across servers: the decode loop samples on two
sampler-only Triton servers over gRPC (no local instance), gives the tokens a
single server gives, and loses no request when one of them stops mid-load."""
import pytest

from simple_sampler.settings import LlmSettings, SamplerSettings
from simple_sampler.launch.serve import assemble_repository
from simple_sampler.launch.server import TritonServer
from simple_sampler.triton.counters import read_counter, wait_for_counter
from test_reliability import SAMPLED, Streams

pytestmark = pytest.mark.slow

SEEDS = range(16)


def sampler_server(tmp_path_factory, name):
    repository = assemble_repository(
        tmp_path_factory.mktemp(name),
        SamplerSettings(sampler_instances=1, sampler_max_batch_size=64, vocab_size=49_152))
    return TritonServer(repository, log_path=tmp_path_factory.mktemp(f"{name}-log") / "log").start()


@pytest.fixture(scope="module")
def remote(tmp_path_factory):
    """Two sampler-only servers and a serving server that uses only them."""
    samplers = [sampler_server(tmp_path_factory, name) for name in ("sampler-a", "sampler-b")]
    try:
        repository = assemble_repository(
            tmp_path_factory.mktemp("serving"),
            SamplerSettings(sampler_instances=1, sampler_max_batch_size=64, vocab_size=49_152),
            LlmSettings(engine_max_batch_size=32, max_context=512, batch_invariant=True,
                      sampler_endpoints=",".join(s.grpc_url for s in samplers)))
        log = tmp_path_factory.mktemp("serving-log") / "tritonserver.log"
        with TritonServer(repository, log_path=log) as serving:
            yield serving, samplers
    finally:
        for server in samplers:
            server.stop()


def test_two_sampler_servers_give_the_tokens_of_one_server(remote, llm_server):
    serving, samplers = remote
    alone = Streams(llm_server.grpc_url, SEEDS, max_tokens=24, **SAMPLED).join()
    spread = Streams(serving.grpc_url, SEEDS, max_tokens=24, **SAMPLED).join()
    assert not alone.errors and not spread.errors
    assert spread.tokens == alone.tokens
    # both endpoints sampled (their counts come in batches: triton.counters)
    rows = [wait_for_counter(server.metrics_url, "simple_sampler_rows_total", lambda n: n > 0)
            for server in samplers]
    print(f"rows sampled per endpoint: {rows}")


def test_a_sampler_server_stopped_mid_load_costs_no_request(remote, llm_server):
    serving, samplers = remote
    expected = Streams(llm_server.grpc_url, SEEDS, max_tokens=32, **SAMPLED).join()
    streams = Streams(serving.grpc_url, SEEDS, max_tokens=32, **SAMPLED)
    streams.wait_started()
    samplers[1].stop()
    streams.join()
    assert not streams.errors
    assert streams.tokens == expected.tokens
    assert samplers[1].process.poll() is not None
    assert read_counter(serving.metrics_url, "simple_llm_sampler_retries_total") >= 1  # rows met the stop
