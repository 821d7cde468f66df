"""Text generation through a real tritonserver running the whole repository
(ensemble -> preprocessing -> llm decode loop -> simple_sampler instances),
over HTTP generate / generate_stream and gRPC streaming."""
import json
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import np_to_triton_dtype

from simple_sampler.client import GenerateClient, GenerationError
from simple_sampler.serving.decoder import Decoder
from simple_sampler.serving.samplers import threaded
from simple_sampler.serving.generation import GenerationRequest
from simple_sampler.serving.torch_engine import TorchEngine
from simple_sampler.serving.text import TextCodec
from simple_sampler.params import SamplingParams
from conftest import LLM_CONTEXT
from fakes import in_flight, llm_metric, wait_until

pytestmark = pytest.mark.slow
QUESTION = "What is the capital of France?"
SAMPLED = dict(temperature=0.8, top_p=0.95, top_k=50, apply_chat_template=True)


@pytest.fixture
def server(llm_server):
    return llm_server


def grpc(server):
    return GenerateClient(server.grpc_url, "grpc")


def http(server):
    return GenerateClient(server.http_url, "http")


def test_every_model_process_froze_its_heap_once_ready(server):
    """Each stub ends its initialize by freezing its heap (``heap.freeze``),
    so that no full collection of the garbage collector walks the model,
    the tokenizer and torch while requests are served."""
    frozen = dict(re.findall(r" simple_sampler\.heap: (\S+): (\d+) objects frozen",
                             server.log_path.read_text()))
    kinds = {name.rsplit("_", 2)[0] for name in frozen}
    assert kinds == {"llm", "preprocessing", "postprocessing", "simple_sampler"}, frozen
    assert sum(name.startswith("simple_sampler") for name in frozen) == 2, frozen
    # torch and a tokenizer imported: a large heap a full collection would walk
    assert int(frozen[next(n for n in frozen if n.startswith("llm"))]) > 100_000, frozen


def test_tensorrt_llms_request_and_iteration_gauges_are_reported_under_its_names(server):
    """For dashboards made for TensorRT-LLM's backend: its
    nv_trt_llm_request_metrics (max: engine_max_batch_size; active and
    scheduled: 0 once idle), its iteration counter (the decode steps), and
    its histograms of each generation's prompt and answer lengths."""
    GenerateClient(server.http_url, "http").generate("Hi", max_tokens=4)

    def gauge(family, label):
        text = urllib.request.urlopen(server.metrics_url).read().decode()
        found = re.search(rf'^nv_trt_llm_{family}_metrics\{{[^}}]*"{label}"[^}}]*\}} (\S+)',
                          text, re.M)
        return float(found.group(1)) if found else None

    assert gauge("request", "max") == 32  # conftest's llm_server_settings
    wait_until(lambda: gauge("general", "iteration_counter") == llm_metric(server, "steps_total")
               and not gauge("request", "active"))
    assert gauge("general", "iteration_counter") == llm_metric(server, "steps_total") >= 4
    assert gauge("request", "active") == gauge("request", "scheduled") == 0

    def lengths(kind):  # (count, sum) of its histogram
        text = urllib.request.urlopen(server.metrics_url).read().decode()
        return tuple(float(re.search(rf"^nv_llm_{kind}_token_len_{part}\{{[^}}]*\}} (\S+)",
                                     text, re.M).group(1)) for part in ("count", "sum"))

    (inputs, prompt), (outputs, answer) = lengths("input"), lengths("output")
    GenerateClient(server.http_url, "http").generate("Hi", max_tokens=3, min_length=3)
    wait_until(lambda: lengths("output")[0] != outputs)  # observed right after its responses go out
    assert lengths("output") == (outputs + 1, answer + 3)  # each generation as it ends
    assert lengths("input")[0] == inputs + 1 and lengths("input")[1] > prompt


def test_greedy_answer_names_paris(server):
    answer = http(server).generate(QUESTION, max_tokens=24, temperature=0.0,
                                   apply_chat_template=True, exclude_input_in_output=True)
    assert "Paris" in answer.text
    # the decode loop's own time is exported (the llm model reports right after
    # sending the final response, so it may lag the answer by a moment)
    wait_until(lambda: llm_metric(server, "loop_us_total"))
    assert 0 < llm_metric(server, "loop_us_total") < llm_metric(server, "data_plane_us_total")
    assert llm_metric(server, "bridge_us_total") == 0  # exported; only TensorRT-LLM has a bridge
    assert llm_metric(server, "gc_pause_us_total") >= 0  # exported (a regex miss raises)
    assert answer.finish_reason == "stop"
    assert answer.num_output_tokens == len(answer.token_ids) > 0


def test_streaming_and_not_give_the_same_text_over_every_protocol(server):
    params = dict(SAMPLED, max_tokens=24, seed=11, exclude_input_in_output=True)
    # all at once: the batch-invariant mode makes the company irrelevant to the seed's tokens
    with ThreadPoolExecutor(4) as pool:
        whole, *others = [request.result() for request in (
            pool.submit(lambda: grpc(server).generate(QUESTION, **params).text),
            *(pool.submit(lambda c: "".join(chunk.text for chunk in c.stream(QUESTION, **params)),
                          client) for client in (grpc(server), http(server))),
            pool.submit(lambda: http(server).generate(QUESTION, **params).text))]
    assert others == [whole] * 3  # gRPC streamed, HTTP streamed, HTTP whole


def test_stream_interval_sends_every_kth_token_and_the_same_generation(server):
    """Through the ensemble (whose llm step sends two outputs before the last
    response and seven with it) over gRPC and HTTP."""
    params = dict(SAMPLED, max_tokens=18, min_length=18, seed=12, exclude_input_in_output=True)
    # all at once: the batch-invariant mode makes the company irrelevant to the seed's tokens
    with ThreadPoolExecutor(4) as pool:
        whole, one, *fours = [request.result() for request in (
            pool.submit(grpc(server).generate, QUESTION, **params),
            pool.submit(lambda: list(grpc(server).stream(QUESTION, **params))),
            *(pool.submit(lambda c: list(c.stream(QUESTION, stream_interval=4, **params)), client)
              for client in (grpc(server), http(server))))]
    for four in fours:
        assert [len(c.token_ids) for c in four] == [1] + [4] * 4 + [1]  # the first at once
        assert [c.finish_reason for c in four] == [""] * 5 + ["length"]
        assert four[-1].num_output_tokens == 18 and four[-1].num_input_tokens > 0
        for chunks in (one, four):
            assert "".join(c.text for c in chunks) == whole.text
            assert [t for c in chunks for t in c.token_ids] == whole.token_ids


def test_top_logprobs_come_with_every_token_over_every_protocol(server):
    """num_top_logprobs through the ensemble: per token its n most likely
    tokens, most likely first, the same streamed or not, over gRPC and HTTP
    (flattened there), the chosen token's logprob among them where it is;
    and the tokens of a request that does not ask."""
    params = dict(SAMPLED, max_tokens=8, seed=13, exclude_input_in_output=True,
                  return_log_probs=True)
    with ThreadPoolExecutor(4) as pool:
        plain, whole, *streams = [request.result() for request in (
            pool.submit(grpc(server).generate, QUESTION, **params),
            pool.submit(http(server).generate, QUESTION, num_top_logprobs=4, **params),
            *(pool.submit(lambda c: list(c.stream(QUESTION, num_top_logprobs=4, stream_interval=3,
                                                  **params)), client)
              for client in (grpc(server), http(server))))]
    assert whole.token_ids == plain.token_ids and not plain.top_logprobs
    assert len(whole.top_logprobs) == 8
    for token, logprob, top in zip(whole.token_ids, whole.logprobs, whole.top_logprobs):
        values = [p for _, p in top]
        assert len(top) == 4 and values == sorted(values, reverse=True) and values[0] <= 0
        assert logprob <= values[0] + 1e-6
        if token in dict(top):
            assert dict(top)[token] == pytest.approx(logprob, abs=1e-6)
    for chunks in streams:
        assert [pairs for c in chunks for pairs in c.top_logprobs] == whole.top_logprobs


def test_prompt_logprobs_come_first_over_every_protocol_as_the_model_scores_them(server):
    """prompt_logprobs through the ensemble: a stream's first response (no
    token) and a non-streamed answer hold the prompt's ids and scores, the
    same over gRPC and HTTP (flattened there) and as the model's own forward
    in float64 scores them; the tokens are those of a request that does not
    ask; max_tokens 0 scores the prompt and generates nothing."""
    import torch

    from simple_sampler.models import load_model

    params = dict(SAMPLED, max_tokens=6, seed=3, exclude_input_in_output=True)
    with ThreadPoolExecutor(4) as pool:
        plain, whole, only, *streams = [request.result() for request in (
            pool.submit(grpc(server).generate, QUESTION, **params),
            pool.submit(http(server).generate, QUESTION, prompt_logprobs=3, **params),
            pool.submit(grpc(server).generate, QUESTION, prompt_logprobs=0,
                        **dict(params, max_tokens=0)),
            *(pool.submit(lambda c: list(c.stream(QUESTION, prompt_logprobs=3, **params)), client)
              for client in (grpc(server), http(server))))]
    assert whole.token_ids == plain.token_ids and not plain.prompt_ids
    ids = whole.prompt_ids
    assert len(ids) == whole.num_input_tokens > 10 and len(whole.prompt_logprobs) == len(ids) - 1
    for chunks in streams:
        first = chunks[0]
        assert first.token_ids == [] and first.text == ""
        assert (first.prompt_ids, first.prompt_logprobs, first.prompt_top_logprobs,
                first.prompt_ranks) == (ids, whole.prompt_logprobs, whole.prompt_top_logprobs,
                                        whole.prompt_ranks)
        assert [t for c in chunks for t in c.token_ids] == plain.token_ids
        assert not any(c.prompt_ids for c in chunks[1:])
    assert (only.token_ids, only.finish_reason, only.num_output_tokens) == ([], "length", 0)
    assert only.prompt_logprobs == whole.prompt_logprobs and only.prompt_top_logprobs == []
    assert only.prompt_ranks == whole.prompt_ranks and len(whole.prompt_ranks) == len(ids) - 1
    model, _ = load_model()
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].double()
    reference = torch.log_softmax(logits, dim=-1)
    expected = reference.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    np.testing.assert_allclose(whole.prompt_logprobs, expected.numpy(), atol=1e-4)
    # each token's rank: 1 + how many are more likely, ties (within float32's
    # rounding) counted against it
    above = (reference > expected[:, None] + 1e-4).sum(dim=-1)
    at_least = (reference >= expected[:, None] - 1e-4).sum(dim=-1)
    ranks = torch.tensor(whole.prompt_ranks)
    assert bool(((above + 1 <= ranks) & (ranks <= at_least)).all()), whole.prompt_ranks
    values, order = reference.topk(3, dim=-1)
    assert [[t for t, _ in top] for top in whole.prompt_top_logprobs] == order.tolist()
    np.testing.assert_allclose([[p for _, p in top] for top in whole.prompt_top_logprobs],
                               values.numpy(), atol=1e-4)


def test_a_request_that_bans_every_token_mid_generation_ends_alone_at_once(server):
    """Its first token is allowed (so it is admitted), its second is not (a
    -inf bias on every other token, and the bad word " the the"): the
    sampler instances refuse its row, and the decode loop samples the step
    again around it. Through Triton's BLS a refusal's INVALID_ARG arrives as
    INTERNAL (triton-inference-server/server issue 7804): taken for a
    transport failure, it was retried for 30 s, stalling the other requests,
    and then failed them all. Now no call is retried and the other request
    is served in full."""
    vocab = 49_152
    others = [t for t in range(vocab) if t != 260]  # 260: " the"
    retries = llm_metric(server, "sampler_retries_total")
    with ThreadPoolExecutor(1) as pool:
        served = pool.submit(grpc(server).generate, QUESTION, max_tokens=24, min_length=24,
                             seed=3, exclude_input_in_output=True, **SAMPLED)
        with pytest.raises(GenerationError, match="every token is banned"):
            grpc(server).generate(QUESTION, max_tokens=8, logit_bias_ids=others,
                                  logit_bias_values=[float("-inf")] * len(others),
                                  bad_words=[" the the"])
        assert served.result().num_output_tokens == 24
    assert llm_metric(server, "sampler_retries_total") == retries


def test_non_streamed_answer_repeats_the_prompt_unless_excluded(server):
    answer = grpc(server).generate("The capital of France is", max_tokens=4, temperature=0.0)
    assert answer.text.startswith("The capital of France is")


def test_a_seed_gives_the_same_text_whatever_the_concurrency(server):
    params = dict(SAMPLED, max_tokens=20, exclude_input_in_output=True)
    alone = grpc(server).generate(QUESTION, seed=5, **params).text
    with ThreadPoolExecutor(8) as pool:
        crowd = list(pool.map(lambda s: grpc(server).generate(QUESTION, seed=s, **params).text,
                              [5, 6, 7, 5, 8, 9, 5, 10]))
    assert crowd[0] == crowd[3] == crowd[6] == alone
    assert len(set(crowd)) > 1  # the other seeds are really sampled


def test_a_seed_gives_the_same_text_as_the_sampler_in_process(server):
    """No Triton, no sampler instances: the decode loop with the kernels in a thread."""
    import asyncio

    async def run():
        codec = TextCodec.from_source()
        # batch-invariant like the served engine: the same logits bit for bit
        engine = TorchEngine.from_source(max_batch_size=2, max_context=LLM_CONTEXT,
                                         batch_invariant=True)
        decoder = Decoder(engine, codec,
                          "simple", threaded(), micro_batches=1)
        await decoder.start()
        handle = decoder.submit(GenerationRequest(
            text=QUESTION, chat=True, max_tokens=20,
            sampling=SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=5)))
        text = "".join([event.text async for event in handle])
        await decoder.close()
        return text

    served = grpc(server).generate(QUESTION, seed=5, max_tokens=20, exclude_input_in_output=True,
                                   **SAMPLED).text
    assert asyncio.run(run()) == served


def test_stop_words_and_max_tokens_set_the_finish_reason(server):
    capped = grpc(server).generate(QUESTION, max_tokens=3, temperature=0.0,
                                   apply_chat_template=True, exclude_input_in_output=True)
    assert capped.finish_reason == "length" and capped.num_output_tokens == 3
    assert capped.stop_reason is None
    # the stop_words input is TensorRT-LLM's: the word's tokens end it, and stay
    stopped = grpc(server).generate(QUESTION, max_tokens=24, temperature=0.0,
                                    apply_chat_template=True, exclude_input_in_output=True,
                                    stop_words=[" Paris", "Par"])
    assert stopped.finish_reason == "stop" and stopped.stop_reason == " Paris"
    assert stopped.text.startswith("The capital of France is Paris")
    assert stopped.text.endswith(" Paris")


def test_a_cancelled_stream_frees_its_slot(server):
    """Against `llm` itself: Triton does not pass a cancellation on to an
    ensemble step that is already running (docs/SERVING.md, "Cancellation")."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    arrivals = []
    client.start_stream(callback=lambda result, error: arrivals.append((time.monotonic(), error)))
    inputs = []
    for name, value in (("text_input", np.array([[b"Tell me a very long story."]], object)),
                        ("max_tokens", np.array([[500]], np.int32)),
                        ("stream", np.array([[True]])),
                        ("min_length", np.array([[500]], np.int32))):  # no early end id
        inputs.append(grpcclient.InferInput(name, [1, 1], np_to_triton_dtype(value.dtype)))
        inputs[-1].set_data_from_numpy(value)
    client.async_stream_infer("llm", inputs)
    wait_until(lambda: len(arrivals) >= 5, timeout_s=60, interval_s=0.01)
    # While streaming, the llm model reports its metrics at most every 0.5 s
    # (docs/SERVED_COST.md), so the gauge may lag the first tokens by that much.
    wait_until(lambda: in_flight(server) == 1)
    assert len(arrivals) >= 5 and in_flight(server) == 1, [str(e) for _, e in arrivals]
    seconds_per_token = (arrivals[4][0] - arrivals[1][0]) / 3
    cancelled_at = time.monotonic()
    client.stop_stream(cancel_requests=True)
    client.close()
    assert wait_until(lambda: in_flight(server) == 0)
    freed_after = time.monotonic() - cancelled_at
    # finishing the 500 tokens would have taken far longer than that
    assert freed_after < 0.25 * (500 - len(arrivals)) * seconds_per_token, \
        (freed_after, seconds_per_token)


BAD = [
    ({"max_tokens": 0}, r"max_tokens must be an integer in \[1, 2147483647\], got 0"),
    ({"temperature": -0.5}, r"temperature must be a finite value >= 0, got -0.5"),
    ({"top_p": 1.5}, r"top_p must be in \[0, 1\] \(0 is no top-p, as TensorRT-LLM reads it\), got 1.5"),
    ({"top_k": -3}, r"top_k must be >= -1"),
    ({"repetition_penalty": 0.0}, r"repetition_penalty must be in \[1e-6, 1e6\], got 0.0"),
]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_bad_requests_get_clear_errors_while_others_are_served(server, protocol):
    client = grpc(server) if protocol == "grpc" else http(server)
    with ThreadPoolExecutor(2) as pool:
        good = pool.submit(lambda: grpc(server).generate(QUESTION, max_tokens=8, temperature=0.0,
                                                         apply_chat_template=True))
        for params, message in BAD:
            with pytest.raises(GenerationError, match=message):
                client.generate(QUESTION, **params)
        with pytest.raises(GenerationError, match="text_input must be a non-empty string"):
            client.generate("", max_tokens=4)
        with pytest.raises(GenerationError, match=r"the prompt \(\d+ tokens\) leaves no room in "
                           r"the context \(512 tokens\)"):
            client.generate("word " * 600, max_tokens=4)
        # past the context's room: shortened to it, as TensorRT-LLM shortens it
        shortened = client.generate("word " * 505, max_tokens=10_000, temperature=0.0,
                                    ignore_eos=True)
        assert shortened.num_input_tokens + shortened.num_output_tokens == 512
        assert shortened.finish_reason == "length"
        assert good.result().finish_reason in ("stop", "length")
    assert server.ready()


@pytest.mark.parametrize("model", ["ensemble", "llm"])
def test_a_key_or_parameter_that_names_no_input_is_refused_by_name(server, model):
    """Over HTTP generate a JSON key that names no input reaches the models
    as a request parameter, and so does a gRPC client's ``parameters=``:
    refused naming it (before, a misspelt temprature kept the default
    unsaid); tritonclient's own triton_* parameter is Triton's."""
    body = json.dumps({"text_input": QUESTION, "max_tokens": 4, "temprature": 0.5}).encode()
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/{model}/generate", body)
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request)
    assert refused.value.code == 400 and "temprature" in json.load(refused.value)["error"]
    client = grpcclient.InferenceServerClient(server.grpc_url)
    text = grpcclient.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[QUESTION.encode()]], dtype=object))
    answers = []
    client.start_stream(callback=lambda result, error: answers.append((result, error)))
    client.async_stream_infer(model, [text], parameters={"beam_width": 2},
                              enable_empty_final_response=True)
    wait_until(lambda: answers)
    client.stop_stream()
    assert answers and "beam_width is an input of this model" in str(answers[0][1])
    assert grpc(server).generate(QUESTION, max_tokens=2, min_length=2).num_output_tokens == 2


def generate_json(server, model: str, body: dict) -> dict:
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/{model}/generate",
                                     json.dumps(body).encode())
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.load(answer)


@pytest.mark.parametrize("model", ["ensemble", "llm"])
def test_a_vllm_backend_clients_requests_run_as_they_are(server, model):
    """Triton's vLLM backend's requests, unchanged: its README's generate body
    (sampling parameters nested in "parameters"), vLLM's names that no input
    has (min_tokens, stop, logprobs) as request parameters, and the
    sampling_parameters input over gRPC (tritonclient's, genai-perf's
    --backend vllm) each give what the same request in this server's own
    inputs gives; a vLLM name it does not implement is refused by name."""
    PLAIN = "The capital of France is"

    def text(answer):
        return answer["text_output"]

    readme = generate_json(server, model, {"text_input": PLAIN, "parameters": {
        "stream": False, "temperature": 0, "max_tokens": 12, "exclude_input_in_output": True}})
    own = generate_json(server, model, {"text_input": PLAIN, "temperature": 0,
                                        "max_tokens": 12, "exclude_input_in_output": True})
    assert text(readme) == text(own) and readme["num_output_tokens"] == 12
    words = text(own).split()
    renamed = generate_json(server, model, {
        "text_input": PLAIN, "temperature": 0, "max_tokens": 12, "exclude_input_in_output": True,
        "parameters": {"stop": words[1], "logprobs": 2, "min_tokens": 1}})
    same = generate_json(server, model, {  # stop in vLLM's JSON: the stop_words input is
        # TensorRT-LLM's, matched as tokens (test_stop_words_and_max_tokens_...)
        "text_input": PLAIN, "temperature": 0, "max_tokens": 12, "exclude_input_in_output": True,
        "sampling_parameters": json.dumps({"stop": [words[1]]}), "return_log_probs": True,
        "num_top_logprobs": 2, "min_length": 1})
    assert renamed == {**same, "model_name": model} and renamed["finish_reason"] == "stop"
    assert len(renamed["top_logprobs_ids"]) == 2 * renamed["num_output_tokens"]

    client = grpcclient.InferenceServerClient(server.grpc_url)
    inputs = []
    # as vllm_backend's samples/client.py sends them: strings, both ways (its [1] shapes
    # are [1, 1] here: this repository's models batch)
    sent = {"temperature": "0", "max_tokens": "12", "top_k": "-1"}
    for name, value in (("text_input", PLAIN), ("sampling_parameters", json.dumps(
            {**sent, "n": 1, "logprobs": None}))):
        tensor = grpcclient.InferInput(name, [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[value.encode()]], dtype=object))
        inputs.append(tensor)
    flag = grpcclient.InferInput("exclude_input_in_output", [1, 1], "BOOL")
    flag.set_data_from_numpy(np.array([[True]]))
    answers = []
    client.start_stream(callback=lambda result, error: answers.append((result, error)))
    client.async_stream_infer(model, [*inputs, flag], parameters=sent)
    wait_until(lambda: answers, timeout_s=60)
    client.stop_stream()
    assert answers and answers[0][1] is None, answers
    assert answers[0][0].as_numpy("text_output").reshape(-1)[0].decode() == text(own)

    with pytest.raises(urllib.error.HTTPError) as refused:
        generate_json(server, model, {"text_input": PLAIN,
                                      "parameters": {"truncate_prompt_tokens": 4}})
    assert refused.value.code == 400
    assert "truncate_prompt_tokens is not supported" in json.load(refused.value)["error"]
    with pytest.raises(urllib.error.HTTPError) as refused:  # a range: named as it was sent
        generate_json(server, model, {"text_input": PLAIN, "parameters": {"min_tokens": -1}})
    assert refused.value.code == 400
    assert "min_tokens (min_length here) must be >= 0" in json.load(refused.value)["error"]


def stream_answers(server, model: str, inputs: dict) -> list:
    """(result, error) of each response of one gRPC stream of `inputs`
    (name -> [1, 1] numpy array), to the end of the stream."""
    tensors = []
    for name, value in inputs.items():
        tensor = grpcclient.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
        tensor.set_data_from_numpy(value)
        tensors.append(tensor)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    answers = []
    client.start_stream(callback=lambda result, error: answers.append((result, error)))
    client.async_stream_infer(model, tensors, enable_empty_final_response=True)
    wait_until(lambda: answers and (answers[-1][1] is not None or answers[-1][0].get_response()
                                    .parameters["triton_final_response"].bool_param), timeout_s=60)
    client.stop_stream()
    return answers


@pytest.mark.parametrize("stream, interval, cumulative", [
    (True, 1, True), (True, 1, False), (True, 4, False), (False, 1, True)])
def test_the_vllm_backends_additional_outputs_come_in_every_response(server, stream, interval,
                                                                    cumulative):
    """Its return_* inputs, as its ci/L0_additional_outputs_vllm test sends
    and reads them: finish_reason "None" until the last response, each
    response's own token count, the prompt's, and a cumulative logprob that
    sums the tokens' logprobs; without them, a stream's earlier responses
    carry none of these; its JSON logprobs are refused by name."""
    flag = lambda value: np.array([[value]])
    plain = {"text_input": np.array([[QUESTION.encode()]], object), "stream": flag(stream),
             "max_tokens": np.array([[8]], np.int32), "ignore_eos": flag(True),
             "stream_interval": np.array([[interval]], np.int32),
             "random_seed": np.array([[7]], np.uint64)}
    asked = {**plain, "return_finish_reason": flag(True), "return_num_input_tokens": flag(True),
             "return_num_output_tokens": flag(True)}
    if cumulative:
        asked["return_cumulative_logprob"] = flag(True)

    def responses(inputs):
        return [result for result, error in stream_answers(server, "ensemble", inputs)
                if result is not None and result.as_numpy("text_output") is not None]

    def value(result, name):
        return result.as_numpy(name).reshape(-1)[0]

    answers = responses(asked)
    # a stream's first token at once, then interval at a time
    rest = [interval] * (7 // interval) + ([7 % interval] if 7 % interval else [])
    expected = [1] + rest if stream else [8]
    assert len(answers) == len(expected)
    assert [value(r, "finish_reason") for r in answers] == \
        [b"None"] * (len(answers) - 1) + [b"length"]
    assert [int(value(r, "num_output_tokens")) for r in answers] == expected
    prompt = {int(value(r, "num_input_tokens")) for r in answers}
    assert len(prompt) == 1 and prompt.pop() > 3
    if cumulative:  # the same seeded request with its logprobs, which it sums
        logprobs = np.concatenate([r.as_numpy("output_log_probs").reshape(-1) for r in
                                   responses({**asked, "return_log_probs": flag(True)})])
        sums = [float(value(r, "cumulative_logprob")) for r in answers]
        assert np.all(logprobs <= 0) and logprobs.sum() < 0
        assert np.allclose(sums, np.cumsum(logprobs)[np.cumsum(expected) - 1], atol=1e-4)
    else:
        assert all(r.as_numpy("cumulative_logprob") is None for r in answers)
    if stream:  # not asked: a stream's earlier responses carry none of them
        unasked = responses(plain)
        assert [r.as_numpy("output_ids").size for r in unasked] == expected
        assert all(r.as_numpy(name) is None for r in unasked[:-1] for name in
                   ("finish_reason", "num_output_tokens", "num_input_tokens"))

    [(result, error)] = stream_answers(server, "ensemble", {**asked,
                                                            "return_logprobs": flag(True)})
    assert result is None and "return_logprobs must be false" in str(error)


@pytest.mark.parametrize("streaming", [False, True])
def test_tensorrt_llms_end_to_end_client_runs_as_it_is(server, streaming):
    """TensorRT-LLM's inflight_batcher_llm/client/end_to_end_grpc_client.py:
    its prepare_inputs' tensors at its defaults (beam_width 1 and
    exclude_input_in_output false always sent, its prompt a str object), its
    one requested output, and its reading of each response
    (``output[0].decode("utf-8")``, text_output flattened over the batch and
    beams as its postprocessing model writes it). min_tokens is its ensemble's
    name for min_length."""
    prompt = "The capital of France is"
    inputs = trtllm_client_inputs(prompt, streaming, 3)
    answers = trtllm_client_answers(server, "ensemble", inputs)
    assert all(result.as_numpy("batch_index") is None for result, _ in answers)  # `0 if None`
    texts = [result.as_numpy("text_output")[0].decode("utf-8") for result, _ in answers]
    assert len(texts) == (8 if streaming else 1)
    assert "".join(texts) == alone(server, prompt, 3, streaming)

    [(_, error)] = stream_answers(server, "ensemble", {**inputs, "beam_width":
                                                      np.array([[2]], dtype=np.int32)})
    assert "beam_width must be 1: beam search is not implemented here" in str(error)


def trtllm_client_inputs(prompt: str, streaming: bool, seed: int) -> dict:
    """end_to_end_grpc_client.py's prepare_inputs at its defaults, with a seed
    and its --top-p 1 (at its defaults it is greedy, as there)."""
    return {"text_input": np.array([[prompt]]).astype(object),
            "max_tokens": np.ones_like([[prompt]]).astype(np.int32) * 8,
            "stream": np.array([[streaming]], dtype=bool),
            "beam_width": np.array([[1]], dtype=np.int32),
            "temperature": np.array([[1.0]], dtype=np.float32),
            "top_p": np.array([[1.0]], dtype=np.float32),
            "exclude_input_in_output": np.array([[False]], dtype=bool),
            "min_tokens": np.array([[8]], dtype=np.int32),
            "seed": np.array([[seed]], dtype=np.uint64)}


def trtllm_client_answers(server, model: str, inputs: dict,
                          outputs=("text_output", "batch_index")) -> list:
    """(result, error) of each response, as end_to_end_grpc_client.py's
    run_inference sends the request and waits for them; `outputs`: those it
    asks for (batch_index with --batch-inputs, sequence_index with -n)."""
    tensors = []
    for name, value in inputs.items():
        tensors.append(grpcclient.InferInput(name, value.shape, np_to_triton_dtype(value.dtype)))
        tensors[-1].set_data_from_numpy(value)
    answers = []
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: answers.append((result, error)))
    client.async_stream_infer(model, tensors, outputs=[
        grpcclient.InferRequestedOutput(name) for name in outputs])
    client.stop_stream()  # waits for the stream's responses, as that client does
    assert answers and all(error is None for _, error in answers), answers
    return answers


def alone(server, prompt: str, seed: int, streaming: bool) -> str:
    """What end_to_end_grpc_client.py's request of `prompt` reads, asked over
    HTTP generate on its own: the streamed text, or the prompt and the text."""
    whole = generate_json(server, "ensemble", {
        "text_input": prompt, "max_tokens": 8, "min_length": 8, "seed": seed, "top_p": 1.0,
        "exclude_input_in_output": True})["text_output"]
    return whole if streaming else prompt + whole


@pytest.mark.parametrize("model, streaming", [("ensemble", True), ("ensemble", False),
                                              ("llm", True), ("tensorrt_llm_bls", False)])
def test_tensorrt_llms_client_with_batch_inputs_reads_each_prompt_by_its_batch_index(
        server, model, streaming):
    """Its --batch-inputs: every input stacked [B, ...] (run_inference's
    np.concatenate); each response read into its batch_index's text, as
    that client reads it. Each prompt's text is what it gets alone; through
    the ensemble its ids reach llm padded, with their lengths."""
    prompts = ["The capital of France is", "Once upon a time", "2 + 2 ="]
    rows = [trtllm_client_inputs(prompt, streaming, seed) for seed, prompt in enumerate(prompts)]
    answers = trtllm_client_answers(server, model, {
        name: np.concatenate([row[name] for row in rows]) for name in rows[0]})
    texts = [""] * len(prompts)
    for result, _ in answers:
        [[index]] = result.as_numpy("batch_index")
        texts[index] += result.as_numpy("text_output")[0].decode("utf-8")
    assert len(answers) == len(prompts) * (8 if streaming else 1)
    assert texts == [alone(server, prompt, seed, streaming) for seed, prompt in enumerate(prompts)]


@pytest.mark.parametrize("streaming", [False, True])
def test_tensorrt_llms_client_with_several_sequences_reads_each_by_its_sequence_index(
        server, streaming):
    """Its -n 3: num_return_sequences, and sequence_index asked for; each
    sequence is the prompt alone with the seed + its index."""
    prompt = "Once upon a time"
    answers = trtllm_client_answers(server, "ensemble", {
        **trtllm_client_inputs(prompt, streaming, 5),
        "num_return_sequences": np.array([[3]], np.int32)}, ("text_output", "sequence_index"))
    texts = [""] * 3
    for result, _ in answers:
        [[index]] = result.as_numpy("sequence_index")
        texts[index] += result.as_numpy("text_output")[0].decode("utf-8")
    assert len(answers) == 3 * (8 if streaming else 1)
    assert texts == [alone(server, prompt, 5 + index, streaming) for index in range(3)]
    assert len(set(texts)) == 3


def core_client_inputs(prompts: list[list[int]], streaming: bool, **more) -> dict:
    """inflight_batcher_llm_client.py's prepare_inputs at its defaults
    (beam_width 1, temperature 1, top_k 1 with top_p 0: greedy there; end_id
    and pad_id the tokenizer's), request_output_len 8, min_length 8 (no end
    comes early), each input [B, ...] for B prompts, their ids padded."""
    width, rows = max(map(len, prompts)), len(prompts)
    column = lambda value, dtype: np.full((rows, 1), value, dtype)
    return {"input_ids": np.array([ids + [2] * (width - len(ids)) for ids in prompts], np.int32),
            "input_lengths": np.array([[len(ids)] for ids in prompts], np.int32),
            "request_output_len": column(8, np.int32), "beam_width": column(1, np.int32),
            "temperature": column(1.0, np.float32), "streaming": column(streaming, bool),
            "end_id": column(2, np.int32), "pad_id": column(2, np.int32),
            "runtime_top_k": column(1, np.int32), "runtime_top_p": column(0.0, np.float32),
            "min_length": column(8, np.int32),
            **{name: column(value, np.asarray(value).dtype) for name, value in more.items()}}


def greedy_ids(server, prompt: list[int]) -> list[int]:
    """The llm model's greedy tokens after `prompt`, asked in its own names."""
    return generate_json(server, "llm", {"input_ids": prompt, "max_tokens": 8, "min_length": 8,
                                         "temperature": 0})["output_ids"]


@pytest.mark.parametrize("streaming", [False, True])
def test_tensorrt_llms_core_model_client_reads_its_answer_from_tensorrt_llm(server, streaming):
    """Its inflight_batcher_llm_client.py against the tensorrt_llm model (with
    --streaming; without, it calls ModelInfer, which Triton refuses for a
    decoupled model, as TensorRT-LLM's with decoupled_mode true): each
    response read as that client reads it (``output_ids[0][0]``, its
    ``sequence_length[0][0]``), a non-streamed answer starting with the
    prompt; the tokens are the llm model's greedy ones. Its --batch-inputs'
    prompts are each read by batch_index; logprobs come [1, 1, tokens] and
    [1, 1] when asked, as its client reads them (``[0]``)."""
    codec = TextCodec.from_source(None)
    prompts = [codec.tokenize(text) for text in ("The capital of France is", "Once upon a time")]
    answers = trtllm_client_answers(server, "tensorrt_llm", core_client_inputs(
        prompts, streaming, return_log_probs=True), outputs=(
        "output_ids", "sequence_length", "batch_index", "output_log_probs", "cum_log_probs"))
    tokens, logprobs = [[], []], [[], []]
    for result, _ in answers:
        [[index]] = result.as_numpy("batch_index")
        output_ids, [[length]] = result.as_numpy("output_ids"), result.as_numpy("sequence_length")
        assert output_ids.shape == (1, 1, length)
        tokens[index] += list(output_ids[0][0])
        logprobs[index] += list(result.as_numpy("output_log_probs")[0][0])
        assert result.as_numpy("cum_log_probs").shape == (1, 1)
    assert len(answers) == 2 * (8 if streaming else 1)
    for prompt, ids, values in zip(prompts, tokens, logprobs):
        assert ids == ([] if streaming else prompt) + greedy_ids(server, prompt)
        assert len(values) == 8 and all(value <= 0 for value in values)


def test_tensorrt_llms_core_model_takes_its_guided_decoding_inputs(server):
    """The tensorrt_llm model (token ids in and out) holds its answer to
    guided_decoding_guide, as TensorRT-LLM's takes the same inputs."""
    codec = TextCodec.from_source(None)
    prompt = codec.tokenize("The year after 2024 is")
    [(result, _)] = trtllm_client_answers(server, "tensorrt_llm", core_client_inputs(
        [prompt], False, guided_decoding_guide_type=b"regex",
        guided_decoding_guide=b"[0-9]+"), outputs=("output_ids", "sequence_length"))
    ids = list(result.as_numpy("output_ids")[0][0])
    assert ids[:len(prompt)] == prompt
    assert re.fullmatch("[0-9]{8}", codec.decode(ids[len(prompt):])), codec.decode(ids)


def test_tensorrt_llm_refuses_what_it_cannot_do_by_the_name_sent(server):
    """A range names the core model's input as the client sent it, a
    malformed word list names its input; that model's inputs with no meaning
    here are refused by Triton, by name. A request_output_len past the
    context's room is shortened to it, as TensorRT-LLM's LlmRequest shortens it."""
    # a prompt that leaves 6 tokens of the context: the shortened answer is quick to make
    long_prompt = core_client_inputs([[504, 3575] * ((LLM_CONTEXT - 6) // 2)], True)
    [(result, error)] = stream_answers(server, "tensorrt_llm", {
        **long_prompt, "request_output_len": np.array([[100_000]], np.int32),
        "min_length": np.array([[6]], np.int32), "streaming": np.array([[False]])})
    assert error is None and result.as_numpy("output_ids").shape == (1, 1, LLM_CONTEXT)
    inputs = core_client_inputs([[504, 3575]], True)
    [(_, error)] = stream_answers(server, "tensorrt_llm", {
        **inputs, "request_output_len": np.array([[0]], np.int32)})
    assert "request_output_len must be at least 1, got 0" in str(error)
    [(_, error)] = stream_answers(server, "tensorrt_llm", {
        **inputs, "stop_words_list": np.array([[[13], [2]]], np.int32)})
    assert "stop_words_list's offsets (its second row) must strictly increase" in str(error)
    [(_, error)] = stream_answers(server, "tensorrt_llm", {
        **inputs, "beam_search_diversity_rate": np.array([[0.5]], np.float32)})
    assert "beam_search_diversity_rate" in str(error)
    [(result, error)] = stream_answers(server, "tensorrt_llm", {
        **inputs, "streaming": np.array([[False]])})  # the service serves on
    assert error is None and result.as_numpy("output_ids").shape == (1, 1, 10)


def test_tensorrt_llms_stop_signal_reaches_the_decode_loop_through_tensorrt_llm(server):
    """Its client's --stop-after-ms with a --request-id: a second request on
    the stream, stop true with the first's id and placeholders
    (prepare_stop_signals), and its Streaming parameter, unread. The first
    ends early (its slot freed: the in-flight gauge falls to 0), the
    signal's answer has no outputs, as that client counts it."""
    def tensors(inputs):
        made = []
        for name, value in inputs.items():
            made.append(grpcclient.InferInput(name, list(value.shape),
                                              np_to_triton_dtype(value.dtype)))
            made[-1].set_data_from_numpy(value)
        return made

    answers = []
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: answers.append((result, error)))
    client.async_stream_infer("tensorrt_llm", tensors({
        **core_client_inputs([[504, 3575, 282]], True), "min_length": np.array([[500]], np.int32),
        "request_output_len": np.array([[500]], np.int32)}), request_id="stop-me")
    wait_until(lambda: len(answers) >= 3)
    client.async_stream_infer("tensorrt_llm", tensors({
        "input_ids": np.empty([1, 1], np.int32), "input_lengths": np.zeros([1, 1], np.int32),
        "request_output_len": np.zeros([1, 1], np.int32), "stop": np.ones([1, 1], bool)}),
        request_id="stop-me", parameters={"Streaming": True})
    assert wait_until(lambda: in_flight(server) == 0)
    client.stop_stream()
    assert all(error is None for _, error in answers), answers
    signal = [result for result, _ in answers if result.get_output("output_ids") is None]
    tokens = sum(int(result.as_numpy("sequence_length")[0][0]) for result, _ in answers
                 if result.get_output("output_ids") is not None)
    assert len(signal) == 1 and 3 <= tokens < 500


def test_tensorrt_llms_embedding_bias_is_a_bias_on_each_words_tokens(server):
    """Its embedding_bias_words / _weights: each word's tokens get its weight,
    as the same logit_bias would give them (greedy, so the answer moves off
    the word)."""
    from simple_sampler.serving.text import TextCodec

    ids = TextCodec.from_source(None).tokenize(" Paris")  # SmolLM2's: no special token added
    body = {"text_input": "The capital of France is", "max_tokens": 6, "temperature": 0,
            "exclude_input_in_output": True}
    assert generate_json(server, "ensemble", body)["text_output"].startswith(" Paris")
    words = generate_json(server, "ensemble", {**body, "embedding_bias_words": [" Paris"],
                                               "embedding_bias_weights": [-100.0]})
    bias = generate_json(server, "ensemble", {**body, "logit_bias_ids": ids,
                                              "logit_bias_values": [-100.0] * len(ids)})
    assert words["text_output"] == bias["text_output"]
    assert not words["text_output"].startswith(" Paris")


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_tensorrt_llms_guided_decoding_requests_hold_the_answer_to_the_grammar(server, model):
    """TensorRT-LLM's guided decoding examples (tensorrtllm_backend's
    docs/guided_decoding.md, its generate request and client's guide types):
    greedy, the answer is a whole output of the grammar; vLLM's
    structured_outputs asks the same; a guide that does not compile is a 400
    naming the input, and the server serves on."""
    body = {"text_input": "What is the year after 2024? Answer:", "max_tokens": 40,
            "temperature": 0, "exclude_input_in_output": True}
    schema = {"properties": {"answer": {"title": "Answer", "type": "integer"}},
              "required": ["answer"], "title": "Answer", "type": "object"}
    held = generate_json(server, model, {**body, "guided_decoding_guide_type": "json_schema",
                                         "guided_decoding_guide": json.dumps(schema)})
    assert isinstance(json.loads(held["text_output"])["answer"], int), held
    vllm = generate_json(server, model, {**body, "sampling_parameters": json.dumps(
        {"structured_outputs": {"json": schema}})})
    assert vllm["text_output"] == held["text_output"]
    digits = generate_json(server, model, {**body, "guided_decoding_guide_type": "regex",
                                           "guided_decoding_guide": "[0-9]+"})["text_output"]
    assert re.fullmatch("[0-9]+", digits), digits
    any_json = generate_json(server, model, {**body, "guided_decoding_guide_type": "json"})
    assert isinstance(json.loads(any_json["text_output"]), dict), any_json
    with pytest.raises(urllib.error.HTTPError) as refused:
        generate_json(server, model, {**body, "guided_decoding_guide_type": "regex",
                                      "guided_decoding_guide": "(ab"})
    assert refused.value.code == 400
    assert "guided_decoding_guide is not a regular expression" in refused.value.read().decode()
    assert generate_json(server, model, body)["text_output"] != held["text_output"]


def test_allowed_token_ids_hold_the_answer_to_them(server):
    """vLLM's allowed_token_ids through the ensemble: greedy, every token is
    one of them (none of which the free answer holds)."""
    body = {"text_input": "The capital of France is", "max_tokens": 6, "temperature": 0,
            "exclude_input_in_output": True}
    free = generate_json(server, "ensemble", {**body, "return_log_probs": True})
    allowed = [t for t in range(100, 200) if t not in free["output_ids"]]
    held = generate_json(server, "ensemble", {**body, "allowed_token_ids": allowed})
    assert held["output_ids"] and set(held["output_ids"]) <= set(allowed), held


def test_unknown_stop_word_type_is_refused(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    text = grpcclient.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[b"Hi"]], dtype=object))
    stop = grpcclient.InferInput("stop_words", [1, 1], "INT32")
    stop.set_data_from_numpy(np.array([[7]], np.int32))
    errors = []
    client.start_stream(callback=lambda result, error: errors.append(error))
    client.async_stream_infer("ensemble", [text, stop])
    wait_until(lambda: errors)
    client.stop_stream()
    assert errors and "stop_words" in str(errors[0]) and "BYTES" in str(errors[0])


@pytest.mark.parametrize("path", ["generate", "generate_stream"])
def test_a_request_without_text_input_is_a_client_error_over_http(server, path):
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/ensemble/{path}",
                                     data=json.dumps({"max_tokens": 4}).encode())
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 400
    assert "text_input (or input_ids) is required" in refused.value.read().decode()


def test_a_request_without_text_input_ends_its_grpc_stream_with_the_error(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    max_tokens = grpcclient.InferInput("max_tokens", [1, 1], "INT32")
    max_tokens.set_data_from_numpy(np.array([[4]], np.int32))
    results = []
    client.start_stream(callback=lambda result, error: results.append((result, error)))
    client.async_stream_infer("ensemble", [max_tokens], enable_empty_final_response=True)
    wait_until(lambda: results)
    client.stop_stream()
    [(result, error)] = results
    assert result is None and "text_input (or input_ids) is required" in str(error)


def test_32_concurrent_streams_deliver_every_token_exactly_once(server):
    def one(seed):
        chunks = list(grpc(server).stream(QUESTION, max_tokens=16, seed=seed,
                                          exclude_input_in_output=True, **SAMPLED))
        return chunks

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(100, 132)))
    codec = TextCodec.from_source()
    for chunks in results:
        # one token per response, none lost; the count comes with the last response only
        assert [len(c.token_ids) for c in chunks] == [1] * len(chunks)
        assert [c.num_output_tokens for c in chunks] == [0] * (len(chunks) - 1) + [len(chunks)]
        ids = [t for c in chunks for t in c.token_ids]
        assert chunks[-1].finish_reason in ("stop", "length")
        text = "".join(c.text for c in chunks)
        assert codec.decode(ids).startswith(text)
