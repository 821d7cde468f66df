"""A server of decoupled_mode false: the llm model, and so the ensembles over
it, answer each request once, as TensorRT-LLM's models deployed with
decoupled_mode false do, so that unary clients (tritonclient's ``infer``,
perf_analyzer without --streaming, TensorRT-LLM's end_to_end_test.py) run
unchanged; a streamed request is refused naming its input. The decode loop
still batches requests in flight: execute returns at once and each answer
goes through its request's response sender (Python backend 24.06 on).
A real tritonserver on SmolLM2 (one sampler instance)."""
import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from simple_sampler.client import GenerateClient, GenerationError
from simple_sampler.frontend.backend import FrontendServer
from simple_sampler.launch.ports import free_port
from simple_sampler.serving.text import TextCodec
from conftest import small_llm_server
from fakes import in_flight, llm_metric, wait_until

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from small_llm_server(tmp_path_factory, decoupled_mode=False)


def unary_inputs(module, **arrays):
    inputs = []
    for name, value in arrays.items():
        dtype = "BYTES" if value.dtype == object else "BOOL" if value.dtype == bool else \
            "INT32" if value.dtype == np.int32 else "FP32"
        inputs.append(module.InferInput(name, list(value.shape), dtype))
        inputs[-1].set_data_from_numpy(value)
    return inputs


def greedy(max_tokens: int = 12, **more) -> dict:
    return {"text_input": np.array([[PROMPT.encode()]], dtype=object),
            "max_tokens": np.array([[max_tokens]], np.int32),
            "temperature": np.array([[0.0]], np.float32),
            "exclude_input_in_output": np.array([[True]]), **more}


def test_unary_infer_calls_are_answered_with_what_generate_answers(server):
    """tritonclient's ModelInfer over HTTP and gRPC, which Triton refuses for
    a decoupled model, on both ensembles and llm; TensorRT-LLM's core model's
    interface (token ids in and out) as its benchmark_core_model.py sends it
    without --decoupled."""
    expected = GenerateClient(server.http_url, "http").generate(
        PROMPT, max_tokens=12, temperature=0.0, exclude_input_in_output=True).text
    assert expected
    http = httpclient.InferenceServerClient(server.http_url)
    for model in ("ensemble", "tensorrt_llm_bls", "llm"):
        answer = http.infer(model, unary_inputs(httpclient, **greedy()))
        assert answer.as_numpy("text_output")[0].decode() == expected, model
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    answer = grpc.infer("ensemble", unary_inputs(grpcclient, **greedy()))
    assert answer.as_numpy("text_output")[0].decode() == expected
    prompt_ids = np.array([TextCodec.from_source(None).tokenize(PROMPT)], np.int32)
    core = grpc.infer("tensorrt_llm", unary_inputs(
        grpcclient, input_ids=prompt_ids, input_lengths=np.array([[prompt_ids.size]], np.int32),
        request_output_len=np.array([[12]], np.int32),  # greedy: its default in that dialect
        min_length=np.array([[12]], np.int32)))  # no end before 12 tokens
    generated = core.as_numpy("output_ids")[0, 0, prompt_ids.size:].tolist()
    assert core.as_numpy("sequence_length").tolist() == [[prompt_ids.size + 12]]
    assert generated == GenerateClient(server.http_url, "http").generate(
        PROMPT, max_tokens=12, temperature=0.0, min_length=12).token_ids


def test_unary_requests_are_decoded_together(server):
    """Eight unary calls at once take fewer steps than their tokens: the
    execute that took one returned before its answer, so the next ones
    joined the batch."""
    before = llm_metric(server, "steps_total")
    http = httpclient.InferenceServerClient(server.http_url,
                                            concurrency=8)

    def one(_):
        answer = http.infer("ensemble", unary_inputs(httpclient, **greedy(
            24, ignore_eos=np.array([[True]]))))
        return answer.as_numpy("text_output")[0].decode()

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(8)))
    assert len(set(answers)) == 1 and answers[0]  # greedy: one text
    assert llm_metric(server, "steps_total") - before < 8 * 24 / 2


def test_a_streamed_request_is_refused_naming_its_input(server):
    with pytest.raises(GenerationError, match="stream is true, but this server's llm model is "
                                              "not decoupled") as refused:
        list(GenerateClient(server.grpc_url, "grpc").stream(PROMPT, max_tokens=4))
    assert "decoupled_mode" in str(refused.value)
    body = json.dumps({"text_input": PROMPT, "max_tokens": 4, "stream": True}).encode()
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"http://{server.http_url}/v2/models/ensemble/generate_stream", body)
    assert refused.value.code == 400 and b"stream is true" in refused.value.read()
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException, match="streaming is true, but"):
        grpc.infer("tensorrt_llm", unary_inputs(
            grpcclient, input_ids=np.array([[1, 2, 3]], np.int32),
            input_lengths=np.array([[3]], np.int32), request_output_len=np.array([[4]], np.int32),
            streaming=np.array([[True]])))
    # and the server goes on answering
    assert GenerateClient(server.http_url, "http").generate(PROMPT, max_tokens=2).text


def test_the_openai_door_answers_unstreamed_and_refuses_a_stream(server):
    """It reads decoupled_mode from the llm model's configuration."""
    expected = GenerateClient(server.http_url, "http").generate(
        PROMPT, max_tokens=12, temperature=0.0, exclude_input_in_output=True).text
    with FrontendServer(server.grpc_url, "127.0.0.1", free_port()) as door:
        assert not door.served.streams

        def post(**body):
            return urllib.request.urlopen(urllib.request.Request(
                f"{door.url}/v1/completions", json.dumps({
                    "model": door.served.model_id, "prompt": PROMPT, "temperature": 0,
                    "max_tokens": 12, **body}).encode(),
                headers={"Content-Type": "application/json"}), timeout=60)

        with post() as answer:
            assert json.load(answer)["choices"][0]["text"] == expected
        with pytest.raises(urllib.error.HTTPError) as refused:
            post(stream=True)
        assert refused.value.code == 400
        error = json.load(refused.value)["error"]
        assert error["param"] == "stream" and "decoupled_mode false" in error["message"]


def chained(grpc, prompt: str, max_tokens: int, **words) -> np.ndarray:
    """TensorRT-LLM's end_to_end_test.py's manual chain (tools/
    inflight_batcher_llm): preprocessing's outputs to tensorrt_llm by its
    names, its output ids to postprocessing; with `words` (its
    preprocessing's *_DICT and EMBEDDING_BIAS_* inputs), their ids too, as
    its ensemble maps them."""
    pre = grpc.infer("preprocessing", unary_inputs(grpcclient, **{
        "QUERY": np.array([[prompt.encode()]], object),
        "REQUEST_OUTPUT_LEN": np.array([[max_tokens]], np.int32),
        # what end_to_end_test.py sends for none
        "BAD_WORDS_DICT": np.array([[b""]], object), "STOP_WORDS_DICT": np.array([[b""]], object),
        **words}))
    core = grpc.infer("tensorrt_llm", unary_inputs(grpcclient, **{
        name: pre.as_numpy(output) for name, output in (
            ("input_ids", "INPUT_ID"), ("decoder_input_ids", "DECODER_INPUT_ID"),
            ("decoder_input_lengths", "REQUEST_DECODER_INPUT_LEN"),
            ("input_lengths", "REQUEST_INPUT_LEN"), ("request_output_len", "REQUEST_OUTPUT_LEN"),
            ("end_id", "OUT_END_ID"), ("pad_id", "OUT_PAD_ID"),
            ("stop_words_list", "STOP_WORDS_IDS"), ("bad_words_list", "BAD_WORDS_IDS"),
            ("embedding_bias", "EMBEDDING_BIAS"))}))
    post = grpc.infer("postprocessing", unary_inputs(
        grpcclient, TOKENS_BATCH=core.as_numpy("output_ids"),
        SEQUENCE_LENGTH=core.as_numpy("sequence_length")))
    return post.as_numpy("OUTPUT")


@pytest.mark.parametrize("words, ensemble_words", [
    ({}, {}),
    ({"STOP_WORDS_DICT": [b" Paris"]}, {"stop_words": [b" Paris"]}),
    ({"BAD_WORDS_DICT": [b" Paris"]}, {"bad_words": [b" Paris"]}),
    ({"EMBEDDING_BIAS_WORDS": [b" Paris"], "EMBEDDING_BIAS_WEIGHTS": [-100.0]},
     {"embedding_bias_words": [b" Paris"], "embedding_bias_weights": [-100.0]}),
])
def test_tensorrt_llms_chain_of_its_three_models_gives_the_ensembles_text(server, words,
                                                                          ensemble_words):
    """end_to_end_test.py compares preprocessing -> tensorrt_llm ->
    postprocessing with the ensemble (greedy, its default there); so here,
    the words given to preprocessing reaching tensorrt_llm as ids (a stop
    word kept and ending it, a bad word banned, a bias on a word's tokens)
    as the ensemble's word inputs do."""
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    arrays = {name: np.array([value], object if isinstance(value[0], bytes) else np.float32)
              for name, value in words.items()}
    text = chained(grpc, PROMPT, 12, **arrays)
    assert text.shape == (1,)  # flat over the batch and beams, as TensorRT-LLM's
    ensemble = grpc.infer("ensemble", unary_inputs(grpcclient, **{
        "text_input": np.array([[PROMPT.encode()]], object),
        "max_tokens": np.array([[12]], np.int32),
        **{name: np.array([value], object if isinstance(value[0], bytes) else np.float32)
           for name, value in ensemble_words.items()}}))
    expected = ensemble.as_numpy("text_output")[0].decode()
    assert text[0].decode() == expected and expected.startswith(PROMPT)
    answer = expected[len(PROMPT):]
    if "STOP_WORDS_DICT" in words:
        assert answer == " Paris"
    elif words:  # banned, or biased off
        assert " Paris" not in answer and answer
    else:
        assert answer.startswith(" Paris") and len(answer) > len(" Paris")


def test_preprocessing_refuses_a_request_in_both_interfaces(server):
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException, match="not both"):
        grpc.infer("preprocessing", unary_inputs(
            grpcclient, QUERY=np.array([[b"Hi"]], object),
            text_input=np.array([[b"Hi"]], object)))
    with pytest.raises(InferenceServerException, match="REQUEST_OUTPUT_LEN is required"):
        grpc.infer("preprocessing", unary_inputs(grpcclient, QUERY=np.array([[b"Hi"]], object)))


def test_a_cancelled_unary_call_stops_its_generation_and_lets_llm_unload(server):
    """A deadline cancels the call; llm stops generating and ends the request
    with a CANCELLED error, where the final flag alone is refused from a
    model that is not decoupled: the request would never end, and llm would
    never unload (nor Triton stop within its exit timeout). Last: it
    unloads llm."""
    before = llm_metric(server, "steps_total")
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException, match="Deadline"):
        grpc.infer("llm", unary_inputs(grpcclient, **greedy(200, ignore_eos=np.array([[True]]))),
                   client_timeout=1.0)
    assert wait_until(lambda: in_flight(server) == 0)
    assert llm_metric(server, "steps_total") - before < 150  # stopped, not run to 200
    http = httpclient.InferenceServerClient(server.http_url)
    http.unload_model("llm")
    deadline = time.monotonic() + 30
    while http.is_model_ready("llm") or any(
            entry["name"] == "llm" and entry.get("state") == "UNLOADING"
            for entry in http.get_model_repository_index()):
        assert time.monotonic() < deadline, "llm still holds the cancelled request"
        time.sleep(0.2)

