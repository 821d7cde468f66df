"""The sampler behind a real tritonserver (free loopback ports), over HTTP
and gRPC: same tokens as the kernels called directly, spread over every
instance, and bad requests refused while good ones keep being served."""
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from simple_sampler.params import SamplingParams
from simple_sampler.rows import real_rows
from simple_sampler.sampling import sample_requests
from simple_sampler.triton.counters import wait_for_counter
from simple_sampler.triton.sampler_client import SamplerClient
from simple_sampler.settings import SamplerSettings
from simple_sampler.launch.server import MiB, TritonServer
from simple_sampler.launch.templates import write_model

pytestmark = pytest.mark.slow
INSTANCES = 2
MAX_BATCH = 64
SHM_BYTES = 16 * MiB


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repository = tmp_path_factory.mktemp("repository")
    write_model(repository, "simple_sampler", "simple_sampler",
                SamplerSettings(sampler_instances=INSTANCES,
                                sampler_max_batch_size=MAX_BATCH).template_values())
    write_model(repository, "simple_sampler_bf16", "simple_sampler",
                SamplerSettings(sampler_instances=1, sampler_max_batch_size=MAX_BATCH,
                                logits_dtype="bf16", vocab_size=49_152).template_values())
    write_model(repository, "simple_sampler_shvs", "simple_sampler",
                SamplerSettings(sampler_instances=1, sampler_max_batch_size=MAX_BATCH,
                                vocab_size=49_152,
                                hot_vocab_profile="hot_vocab.npz").template_values())
    log = tmp_path_factory.mktemp("logs") / "tritonserver.log"
    with TritonServer(repository, shm_bytes=SHM_BYTES, log_path=log) as running:
        yield running


@pytest.fixture(scope="module")
def rows():
    return real_rows(8)


def column(values, dtype):
    return np.asarray(values, dtype=dtype)[:, None]


def params_for(rows: int, offset: int = 0) -> tuple[dict, list[SamplingParams]]:
    temperature = [0.0, 0.6, 1.0, 1.4] * (rows // 4)
    top_p = [1.0, 0.9, 0.95, 1.0] * (rows // 4)
    seeds = list(range(offset, offset + rows))
    arrays = {"temperature": column(temperature, np.float32),
              "runtime_top_p": column(top_p, np.float32),
              "random_seed": column(seeds, np.uint64),
              "return_log_probs": column([True] * rows, bool)}
    params = [SamplingParams(temperature=t, top_p=p, seed=s)
              for t, p, s in zip(temperature, top_p, seeds)]
    return arrays, params


def url(server, protocol):
    return server.http_url if protocol == "http" else server.grpc_url


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_tokens_match_the_kernels(server, rows, protocol):
    arrays, params = params_for(len(rows))
    client = SamplerClient(url(server, protocol), protocol)
    out = client.sample(rows, **arrays)
    expected = sample_requests(rows, params)
    np.testing.assert_array_equal(out["output_ids"][:, 0], expected.token_ids)
    np.testing.assert_array_equal(out["output_log_probs"][:, 0], expected.logprobs)
    client.close()


def test_bfloat16_logits(server, rows):
    arrays, params = params_for(len(rows))
    halves = rows.astype(ml_dtypes.bfloat16)
    out = SamplerClient(server.grpc_url, "grpc", model="simple_sampler_bf16").sample(halves, **arrays)
    np.testing.assert_array_equal(out["output_ids"][:, 0], sample_requests(halves, params).token_ids)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_logits_in_system_shared_memory(server, rows, protocol):
    arrays, params = params_for(len(rows))
    client = SamplerClient(url(server, protocol), protocol)
    try:
        out = client.sample(shm_logits=client.share(rows), **arrays)
    finally:
        client.close()
    np.testing.assert_array_equal(out["output_ids"][:, 0], sample_requests(rows, params).token_ids)


def instance_rows(server) -> dict[str, float]:
    text = urllib.request.urlopen(server.metrics_url).read().decode()
    found = re.findall(r'simple_sampler_rows_total\{[^}]*instance="([^"]+)"[^}]*model="simple_sampler"'
                       r'[^}]*\} (\S+)', text)
    return {instance: float(value) for instance, value in found}


def settled_rows(server, at_least: float = 0.0) -> float:
    """simple_sampler_rows_total over the instances once every count made
    so far has arrived (they send theirs in batches: triton.counters)."""
    return wait_for_counter(server.metrics_url, "simple_sampler_rows_total",
                            lambda total: total >= at_least, labels='model="simple_sampler"',
                            settled_after=time.monotonic())


def test_concurrent_clients_spread_over_every_instance(server, rows):
    settled_rows(server)  # the tests before this one counted, too
    before = instance_rows(server)

    def one_client(index: int):
        client = SamplerClient(server.grpc_url if index % 2 else server.http_url,
                               "grpc" if index % 2 else "http")
        results = []
        for round_ in range(6):
            arrays, params = params_for(len(rows), offset=1000 * index + 10 * round_)
            results.append((client.sample(rows, **arrays)["output_ids"][:, 0],
                            sample_requests(rows, params).token_ids))
        client.close()
        return results

    with ThreadPoolExecutor(8) as pool:
        for results in pool.map(one_client, range(8)):
            for got, expected in results:
                np.testing.assert_array_equal(got, expected)
    settled_rows(server, sum(before.values()) + 8 * 6 * len(rows))
    after = instance_rows(server)
    assert len(after) == INSTANCES
    served = {name: after[name] - before.get(name, 0.0) for name in after}
    assert sum(served.values()) == 8 * 6 * len(rows)
    assert all(count > 0 for count in served.values()), served


BAD_REQUESTS = [
    ("wrong dtype", lambda rows: {"logits": rows.astype(np.float16)}, r"logits.*(FP16|FP32)"),
    ("wrong shape", lambda rows: {"logits": rows, "temperature": np.ones((len(rows), 2), np.float32)},
     "temperature"),
    ("NaN logits", lambda rows: {"logits": np.where(np.arange(rows.shape[1]) == 7, np.nan, rows)
                                 .astype(np.float32)}, "row 0: logits must not contain NaN; found at column 7"),
    ("missing logits", lambda rows: {"temperature": np.ones((len(rows), 1), np.float32)}, "logits"),
    ("top_p out of range", lambda rows: {"logits": rows, "runtime_top_p": np.full((len(rows), 1), 1.5,
                                                                                   np.float32)},
     r"row 0: runtime_top_p must be in \(0, 1\], got 1.5"),
    ("history id >= V", lambda rows: {"logits": rows, "generated_ids": np.full((len(rows), 2), 49_152,
                                                                               np.int32)},
     r"row 0: generated_ids must be token ids in \[0, 49152\)"),
    ("more rows than max_batch_size", lambda rows: {"logits": np.repeat(rows, MAX_BATCH, axis=0)},
     "batch"),
]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_bad_requests_are_refused_while_others_are_served(server, rows, protocol):
    good_arrays, good_params = params_for(len(rows))
    expected = sample_requests(rows, good_params).token_ids

    def good_request(_):
        client = SamplerClient(url(server, protocol), protocol)
        tokens = client.sample(rows, **good_arrays)["output_ids"][:, 0]
        client.close()
        return tokens

    with ThreadPoolExecutor(4) as pool:
        good = pool.map(good_request, range(16))
        client = SamplerClient(url(server, protocol), protocol)
        for label, build, message in BAD_REQUESTS:
            arrays = build(rows)
            logits = arrays.pop("logits", None)
            with pytest.raises(InferenceServerException, match=message) as error:
                client.sample(logits, **arrays)
            if label not in ("wrong dtype", "wrong shape", "missing logits",
                             "more rows than max_batch_size"):  # refused by Triton itself
                assert "400" in str(error.value) or "INVALID_ARG" in str(error.value), label
        for tokens in good:
            np.testing.assert_array_equal(tokens, expected)
    assert server.ready()


def test_a_request_larger_than_the_shared_memory_pool(server):
    """The Python backend's pool grows for a request 8x its initial size;
    the other requests are unaffected."""
    rows = np.zeros((64, 2 * SHM_BYTES // 4 // 64 * 4), np.float32)  # 128 MiB
    rows[:, 5] = 50.0
    client = SamplerClient(server.grpc_url, "grpc")
    out = client.sample(rows, temperature=np.zeros((64, 1), np.float32))
    assert (out["output_ids"] == 5).all()
    client.close()
    assert server.ready()


def test_unknown_vocabulary_width_is_refused(server, rows):
    client = SamplerClient(server.http_url, "http", model="simple_sampler_bf16")
    with pytest.raises(InferenceServerException, match="logits must have 49152 columns"):
        client.sample(rows[:, :1000].astype(ml_dtypes.bfloat16))
    client.close()


def test_hot_vocabulary_sampling_behind_the_server(server, rows):
    """The shipped SmolLM2 profile: the same tokens as sample(hot_vocab=...)
    in-process, and the acceptance counters on the metrics port."""
    from simple_sampler.shvs.hot_vocab import load_profile
    from simple_sampler.launch.install import project_file

    hot_vocab = load_profile(project_file("model_repository/simple_sampler/hot_vocab.npz")).hot_vocab()
    seeds = np.arange(len(rows), dtype=np.uint64)
    top_p = np.where(np.arange(len(rows)) % 2, 0.9, 1.0).astype(np.float32)
    out = SamplerClient(server.grpc_url, "grpc", model="simple_sampler_shvs").sample(
        rows, random_seed=seeds[:, None], runtime_top_p=top_p[:, None])
    params = [SamplingParams(seed=int(s), top_p=float(p)) for s, p in zip(seeds, top_p)]
    expected = sample_requests(rows, params, hot_vocab=hot_vocab, return_logprobs=False)
    np.testing.assert_array_equal(out["output_ids"][:, 0], expected.token_ids)
    accepted = int((expected.hot_accepted == 1).sum())
    assert accepted > 0
    for name, count in (("simple_sampler_hot_tried_rows_total", len(rows)),
                        ("simple_sampler_hot_accepted_rows_total", accepted)):
        # sent in batches (triton.counters): polled until every count arrived
        assert wait_for_counter(server.metrics_url, name, lambda value: value >= count,
                                labels='model="simple_sampler_shvs"',
                                settled_after=time.monotonic()) == count


def test_hot_vocab_drift_is_logged_once_with_the_recommended_size(server):
    """Rows whose mass lies mostly outside the hot set (flat logits: 1536 of
    49,152 ids hold 3% of it, where the profile predicts about 0.7) drift the
    SHVS monitor of the instance; the server log gets one warning naming the
    recommended |H|, and no line per request."""
    def our_lines():
        return [line for line in server.log_path.read_text().splitlines()
                if " simple_sampler." in line]

    before = our_lines()
    client = SamplerClient(server.grpc_url, "grpc", model="simple_sampler_shvs")
    try:
        flat = client.share(np.zeros((MAX_BATCH, 49_152), np.float32))
        for request in range(4096 // MAX_BATCH + 2):  # a full monitor window, and more
            client.sample(shm_logits=flat, random_seed=column(
                range(request * MAX_BATCH, (request + 1) * MAX_BATCH), np.uint64))
    finally:
        client.close()
    new = our_lines()[len(before):]
    assert len(new) == 1 and " WARNING simple_sampler.backend: " in new[0], new
    acceptance, recommended = re.search(r"SHVS acceptance (\S+) over the last 4096 untruncated "
                                        r"rows, .* recommended \|H\| = (\d+)", new[0]).groups()
    assert float(acceptance) < 0.1 and int(recommended) > 0
