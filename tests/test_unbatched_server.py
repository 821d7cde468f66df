"""A server of generate_max_batch_size 0: the text models take and give
tensors without the batch dimension, as Triton's vLLM backend's models
(max_batch_size 0) do, so that backend's clients run unchanged; this
repository's own clients read the shape from the model's configuration.
A real tritonserver on SmolLM2 (one sampler instance)."""
import asyncio
import json
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio

from simple_sampler.client import AsyncGenerateClient, GenerateClient
from simple_sampler.frontend.backend import FrontendServer
from simple_sampler.launch.ports import free_port
from conftest import small_llm_server

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from small_llm_server(tmp_path_factory, generate_max_batch_size=0)


def vllm_sample_request(prompt: str, stream: bool, request_id: str) -> dict:
    """What vllm_backend's samples/client.py (``LLMClient.create_request``)
    sends, as it sends it: [1] tensors, its sampling parameters as strings,
    in the sampling_parameters input and as request parameters, greedy here."""
    sampling_parameters = {"temperature": "0", "top_p": "0.95", "max_tokens": "12"}
    inputs = []
    for name, dtype, value in (
            ("text_input", "BYTES", np.array([prompt.encode("utf-8")], dtype=np.object_)),
            ("stream", "BOOL", np.array([stream], dtype=bool)),
            ("sampling_parameters", "BYTES",
             np.array([json.dumps(sampling_parameters).encode("utf-8")], dtype=np.object_)),
            ("exclude_input_in_output", "BOOL", np.array([True], dtype=bool))):
        inputs.append(grpcaio.InferInput(name, [1], dtype))
        inputs[-1].set_data_from_numpy(value)
    return {"model_name": "ensemble", "inputs": inputs,
            "outputs": [grpcaio.InferRequestedOutput("text_output")],
            "request_id": request_id, "parameters": sampling_parameters}


def test_the_vllm_backends_sample_client_runs_unchanged(server):
    """Its request stream, two prompts, non-streamed and streamed; its way of
    reading an answer (``as_numpy("text_output")``, each element decoded)."""
    async def run() -> dict[str, list[bytes]]:
        requests = [vllm_sample_request(PROMPT, stream, f"{stream}-{i}")
                    for stream in (False, True) for i in range(2)]

        async def iterate():
            for request in requests:
                yield request

        answers = {request["request_id"]: [] for request in requests}
        client = grpcaio.InferenceServerClient(server.grpc_url)
        try:
            responses = client.stream_infer(inputs_iterator=iterate(), stream_timeout=60)
            async for result, error in responses:
                assert error is None, error
                output = result.as_numpy("text_output")
                assert output.shape == (1,)  # [1], as that backend's: no batch dimension
                answers[result.get_response().id].extend(output)
                if sum(map(len, answers.values())) == 2 + 2 * 12:  # every response came
                    break
        finally:
            await client.close()
        return answers

    answers = asyncio.run(run())
    whole = [b"".join(answers[f"False-{i}"]).decode() for i in range(2)]
    pieces = [answers[f"True-{i}"] for i in range(2)]
    assert whole[0] == whole[1] and "Paris" in whole[0]
    assert [len(p) for p in pieces] == [12, 12]
    assert all(b"".join(p).decode() == whole[0] for p in pieces)


def test_its_additional_outputs_come_as_it_shapes_them(server):
    """vllm_backend's ci/L0_additional_outputs_vllm reads them with [0]
    (``finish_reason_np[0].decode("utf-8")``): [1] outputs."""
    flags = {"stream": True, "return_finish_reason": True, "return_num_output_tokens": True,
             "return_num_input_tokens": True}
    inputs = [grpcclient.InferInput("text_input", [1], "BYTES")]
    inputs[0].set_data_from_numpy(np.array([PROMPT.encode()], dtype=np.object_))
    for name, value in flags.items():
        inputs.append(grpcclient.InferInput(name, [1], "BOOL"))
        inputs[-1].set_data_from_numpy(np.array([value], dtype=bool))
    inputs.append(grpcclient.InferInput("sampling_parameters", [1], "BYTES"))
    inputs[-1].set_data_from_numpy(np.array([json.dumps(
        {"max_tokens": 4, "ignore_eos": True, "seed": 3}).encode()], object))
    answers = []
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: answers.append((result, error)))
    client.async_stream_infer("ensemble", inputs)
    client.stop_stream()  # waits for the stream's responses
    assert all(error is None for _, error in answers) and len(answers) == 4, answers
    reasons = [result.as_numpy("finish_reason")[0].decode("utf-8") for result, _ in answers]
    assert reasons == ["None"] * 3 + ["length"]
    assert [int(result.as_numpy("num_output_tokens")[0]) for result, _ in answers] == [1] * 4
    assert all(result.as_numpy("num_input_tokens").shape == (1,) for result, _ in answers)


def test_http_generate_and_this_repositorys_clients_and_door_take_either_shape(server):
    """The vLLM backend README's generate body; the Python clients, which
    read max_batch_size from the model's configuration; the OpenAI door.
    Each gives the same greedy text."""
    body = {"text_input": PROMPT, "parameters": {"stream": False, "temperature": 0,
                                                 "max_tokens": 12,
                                                 "exclude_input_in_output": True}}
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/ensemble/generate",
                                     json.dumps(body).encode())
    with urllib.request.urlopen(request, timeout=60) as answer:
        text = json.load(answer)["text_output"]
    assert "Paris" in text
    params = dict(temperature=0.0, max_tokens=12, exclude_input_in_output=True)
    client = GenerateClient(server.grpc_url, "grpc")
    assert client.generate(PROMPT, **params).text == text and client.batched is False
    assert "".join(chunk.text for chunk in client.stream(PROMPT, **params)) == text

    async def aio() -> str:
        async with AsyncGenerateClient(server.grpc_url, "grpc") as client:
            return (await client.generate(PROMPT, **params)).text
    assert asyncio.run(aio()) == text

    with FrontendServer(server.grpc_url, "127.0.0.1", free_port()) as door:
        request = urllib.request.Request(
            f"{door.url}/v1/completions", json.dumps({
                "model": door.served.model_id, "prompt": PROMPT, "temperature": 0,
                "max_tokens": 12}).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            assert json.load(answer)["choices"][0]["text"] == text
