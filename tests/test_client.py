"""The client library and `simple-sampler generate` against a real server:
sync and asyncio, gRPC and HTTP, streamed and not; server errors surface
with the server's message."""
import asyncio
import itertools
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from simple_sampler.cli import main
from simple_sampler.client import AsyncGenerateClient, GenerateClient, GenerationError

pytestmark = pytest.mark.slow
QUESTION = "What is the capital of France?"
GREEDY = dict(max_tokens=16, temperature=0.0, apply_chat_template=True,
              exclude_input_in_output=True)
SAMPLED = dict(max_tokens=12, temperature=0.9, top_p=0.9, apply_chat_template=True,
               exclude_input_in_output=True)
PROTOCOLS = ("grpc", "http")


def url(server, protocol):
    return server.grpc_url if protocol == "grpc" else server.http_url


@pytest.fixture(scope="module")
def greedy_answer(llm_server):
    answer = GenerateClient(llm_server.grpc_url).generate(QUESTION, **GREEDY)
    assert "Paris" in answer.text and answer.finish_reason in ("stop", "length")
    return answer


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_sync_client_streamed_and_not(llm_server, greedy_answer, protocol):
    def client():
        return GenerateClient(url(llm_server, protocol), protocol)

    with ThreadPoolExecutor(2) as pool:  # at once: greedy on batch-invariant logits either way
        whole = pool.submit(lambda: client().generate(QUESTION, **GREEDY))
        chunks = pool.submit(lambda: list(client().stream(QUESTION, **GREEDY)))
        whole, chunks = whole.result(), chunks.result()
    assert whole.text == "".join(c.text for c in chunks) == greedy_answer.text
    assert whole.token_ids == [t for c in chunks for t in c.token_ids]
    assert [bool(c.finish_reason) for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].num_output_tokens == whole.num_output_tokens == len(whole.token_ids)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_async_client_streamed_and_not(llm_server, greedy_answer, protocol):
    async def run():
        async with AsyncGenerateClient(url(llm_server, protocol), protocol) as client:
            async def streamed():
                return [chunk async for chunk in client.stream(QUESTION, **GREEDY)]

            return await asyncio.gather(client.generate(QUESTION, **GREEDY), streamed())

    whole, chunks = asyncio.run(run())
    assert whole.text == "".join(c.text for c in chunks) == greedy_answer.text
    assert whole.token_ids == greedy_answer.token_ids
    assert chunks[-1].finish_reason == greedy_answer.finish_reason


SEEDS = [3, 4, 5, 6]


@pytest.fixture(scope="module")
def sequential_answers(llm_server):
    """SEEDS' sampled answers, one request at a time (sync, gRPC)."""
    answers = [GenerateClient(llm_server.grpc_url).generate(QUESTION, seed=s, **SAMPLED).text
               for s in SEEDS]
    assert len(set(answers)) > 1  # the seeds matter, so equality means something
    return answers


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_async_client_runs_concurrent_requests_like_sequential_ones(llm_server, protocol,
                                                                    sequential_answers):
    async def run():
        async with AsyncGenerateClient(url(llm_server, protocol), protocol) as client:
            return await asyncio.gather(*(client.generate(QUESTION, seed=s, **SAMPLED)
                                          for s in SEEDS))

    assert [answer.text for answer in asyncio.run(run())] == sequential_answers


@pytest.mark.parametrize("protocol,streamed", list(itertools.product(PROTOCOLS, (False, True))))
def test_server_errors_carry_the_server_message(llm_server, protocol, streamed):
    message = r"top_p must be in \[0, 1\] \(0 is no top-p, as TensorRT-LLM reads it\), got 1.5"
    client = GenerateClient(url(llm_server, protocol), protocol)
    with pytest.raises(GenerationError, match=message):
        list(client.stream(QUESTION, top_p=1.5)) if streamed else client.generate(QUESTION,
                                                                                    top_p=1.5)

    async def run():
        async with AsyncGenerateClient(url(llm_server, protocol), protocol) as aio:
            if streamed:
                return [chunk async for chunk in aio.stream(QUESTION, top_p=1.5)]
            return await aio.generate(QUESTION, top_p=1.5)

    with pytest.raises(GenerationError, match=message):
        asyncio.run(run())


def test_unknown_parameter_is_refused_before_sending():
    with pytest.raises(TypeError, match="unknown generation parameter 'top_q'"):
        GenerateClient("127.0.0.1:1").generate(QUESTION, top_q=0.5)
    with pytest.raises(TypeError, match="unknown generation parameter 'top_q'"):
        asyncio.run(AsyncGenerateClient("127.0.0.1:1", "http").generate(QUESTION, top_q=0.5))
    # the vLLM backend's return_* inputs change outputs a Chunk reads (finish_reason
    # "None" before the last response would end a stream at its first)
    with pytest.raises(TypeError, match="unknown generation parameter 'return_finish_reason'"):
        GenerateClient("127.0.0.1:1").generate(QUESTION, return_finish_reason=True)


def test_request_arrays_drop_the_batch_dimension_for_a_model_without_one():
    """A model of max_batch_size 0 (get_model_config leaves the field out)
    takes [1] scalars and [n] lists, as Triton's vLLM backend's do."""
    from simple_sampler.client.common import batches, request_arrays

    params = {"max_tokens": 4, "stop_words": ["a", "b"], "stream": True}
    batched, unbatched = request_arrays("hi", params), request_arrays("hi", params, False)
    assert {name: a.shape for name, a in batched.items()} == {
        "text_input": (1, 1), "max_tokens": (1, 1), "stop_words": (1, 2), "stream": (1, 1)}
    assert {name: a.shape for name, a in unbatched.items()} == {
        "text_input": (1,), "max_tokens": (1,), "stop_words": (2,), "stream": (1,)}
    assert request_arrays([5, 6], {}, False)["input_ids"].tolist() == [5, 6]
    assert batches({"max_batch_size": 64}) and not batches({"name": "vllm_model"})


@pytest.mark.parametrize("protocol,stream", [("grpc", True), ("http", False), ("http://", True)])
def test_cli_prints_the_greedy_answer(llm_server, greedy_answer, capsys, protocol, stream):
    """("http://": the url's scheme names the protocol, --protocol not given.)"""
    address = (["--url", f"http://{llm_server.http_url}/"] if protocol == "http://" else
               ["--url", url(llm_server, protocol), "--protocol", protocol])
    argv = ["generate", QUESTION, *address, "--temperature", "0", "--max-tokens", "16",
            *(["--stream"] if stream else [])]
    assert main(argv) == 0
    assert capsys.readouterr().out == greedy_answer.text + "\n"


def test_a_url_takes_its_protocols_scheme_and_nothing_else(capsys):
    for address, protocol, base in [("h:1", "grpc", "grpc://h:1"), ("grpc://h:1", "grpc",
                                    "grpc://h:1"), ("h:1", "http", "http://h:1"),
                                    ("HTTPS://h:1/", "http", "https://h:1")]:
        client = GenerateClient(address, protocol)
        assert (client.url, client.base_url) == ("h:1", base)
    for address, protocol, message in [
            ("http://h:1", "grpc", "starts with http://; for grpc give host:port or a url "
                                   "starting with grpc://"),
            ("grpc://h:1", "http", "for http give host:port or a url starting with http:// or "
                                   "https://"),
            ("http://h:1/v2", "http", "is not host:port")]:
        with pytest.raises(ValueError, match=f"^url: .*{message}"):
            GenerateClient(address, protocol)
    assert main(["generate", QUESTION, "--url", "grpc://h:1", "--protocol", "http"]) == 2
    assert capsys.readouterr().err.startswith("simple-sampler generate: url: 'grpc://h:1'")


def test_cli_reports_a_server_error_in_one_line(llm_server, capsys):
    argv = ["generate", QUESTION, "--url", llm_server.grpc_url, "--top-p", "1.5"]
    assert main(argv) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1
    assert "top_p must be in [0, 1] (0 is no top-p, as TensorRT-LLM reads it), got 1.5" in error


def test_cli_holds_the_answer_to_a_guide(llm_server, capsys):
    argv = ["generate", QUESTION, "--url", llm_server.grpc_url, "--temperature", "0",
            "--max-tokens", "40", "--guide-type", "regex", "--guide", "[A-Z][a-z]+"]
    assert main(argv) == 0
    assert re.fullmatch("[A-Z][a-z]+\n", capsys.readouterr().out)
