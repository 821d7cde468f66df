"""The OpenAI front door against a real tritonserver (the shared llm_server:
SmolLM2 in batch-invariant mode, 2 sampler instances), driven by the official
``openai`` client and by raw HTTP for disconnects."""
import asyncio
import json
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import np_to_triton_dtype

from simple_sampler.frontend.backend import FrontendServer
from simple_sampler.launch.ports import free_port, free_ports
from simple_sampler.launch.server import TRITON_EXIT_TIMEOUT_S
from simple_sampler.launch.processes import SHM_DIRECTORY, list_stubs
from simple_sampler.launch.supervisor import arena_regions
from simple_sampler.triton.counters import wait_for_counter
from fakes import in_flight, wait_until

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Tell me a very long story about a dragon."}]


@pytest.fixture(scope="module")
def frontend(llm_server):
    with FrontendServer(llm_server.grpc_url, "127.0.0.1", free_port(),
                        metrics_url=llm_server.metrics_url) as running:
        yield running


@pytest.fixture(scope="module")
def client(frontend):
    return openai.OpenAI(base_url=f"{frontend.url}/v1", api_key="unused", max_retries=0)


def rows_sampled(server, settled: bool = False) -> float:
    """settled: once every count made until now has arrived (the sampler
    instances send theirs in batches: triton.counters)."""
    return wait_for_counter(server.metrics_url, "simple_sampler_rows_total", lambda _: True,
                            settled_after=time.monotonic() if settled else None)


def assert_finished(finish_reason: str, completion_tokens: int, max_tokens: int) -> None:
    """"length" with every token max_tokens allows, else "stop" with at most
    that many (an end id ends it and is counted, the last allowed too)."""
    if finish_reason == "length":
        assert completion_tokens == max_tokens, (finish_reason, completion_tokens)
    else:
        assert finish_reason == "stop" and 1 <= completion_tokens <= max_tokens, (
            finish_reason, completion_tokens)


def test_models_lists_the_served_model(client, frontend):
    assert [m.id for m in client.models.list().data] == [frontend.served.model_id]


def test_the_doors_metrics_are_tritons(client, frontend):
    """/metrics on the API's port, as vLLM's: Triton's own and the models'."""
    text = httpx.get(f"{frontend.url}/metrics", timeout=30).text
    assert "nv_inference_request_success" in text and "simple_sampler_" in text


def test_chat_and_completion_answer_streamed_and_not(client, frontend):
    model = frontend.served.model_id
    chat = dict(model=model, messages=QUESTION, temperature=0, max_tokens=24)
    completing = dict(model=model, prompt="The capital of France is", temperature=0, max_tokens=8)
    # at once: greedy on llm_server's batch-invariant logits, whatever the company
    with ThreadPoolExecutor(4) as pool:
        answer, streamed, completion, pieces = [request.result() for request in (
            pool.submit(lambda: client.chat.completions.create(**chat)),
            pool.submit(lambda: list(client.chat.completions.create(
                stream=True, stream_options={"include_usage": True}, **chat))),
            pool.submit(lambda: client.completions.create(**completing)),
            pool.submit(lambda: list(client.completions.create(stream=True, **completing))))]
    assert "Paris" in answer.choices[0].message.content
    assert_finished(answer.choices[0].finish_reason, answer.usage.completion_tokens, 24)
    prompt_tokens = len(frontend.served.codec.encode("What is the capital of France?", chat=True))
    assert answer.usage.prompt_tokens == prompt_tokens
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == answer.choices[0].message.content
    assert streamed[-1].usage.completion_tokens == answer.usage.completion_tokens
    assert "Paris" in completion.choices[0].text
    assert_finished(completion.choices[0].finish_reason, completion.usage.completion_tokens, 8)
    assert "".join(p.choices[0].text for p in pieces) == completion.choices[0].text
    assert pieces[-1].choices[0].finish_reason == completion.choices[0].finish_reason


def test_a_response_is_the_chat_answer_streamed_or_not(client, frontend):
    """/v1/responses through Triton, by the openai client's own methods: a
    seeded Response's text is the chat answer's to the same turns."""
    model = frontend.served.model_id
    sampled = dict(model=model, temperature=1.0, top_p=0.95, extra_body={"seed": 11})
    chat = client.chat.completions.create(
        messages=[{"role": "system", "content": "Answer in one sentence."}, *QUESTION],
        max_tokens=24, **sampled).choices[0].message.content
    answer = client.responses.create(instructions="Answer in one sentence.",
                                     input=QUESTION[0]["content"], max_output_tokens=24, **sampled)
    assert answer.output_text == chat and answer.status in ("completed", "incomplete")
    with client.responses.create(instructions="Answer in one sentence.", stream=True,
                                 input=QUESTION[0]["content"], max_output_tokens=24,
                                 **sampled) as stream:
        events = list(stream)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == chat
    assert events[-1].type == "response.completed"
    assert events[-1].response.usage.output_tokens == answer.usage.output_tokens


def test_an_anthropic_message_is_the_greedy_chat_answer_streamed_or_not(client, frontend):
    """/v1/messages through Triton: greedy, its text is chat's to the same
    turns, whole and as its streamed text_deltas."""
    model = frontend.served.model_id
    chat = client.chat.completions.create(
        model=model, temperature=0, max_tokens=24,
        messages=[{"role": "system", "content": "Answer in one sentence."}, *QUESTION])
    asked = {"model": model, "max_tokens": 24, "temperature": 0,
             "system": "Answer in one sentence.", "messages": QUESTION}
    message = httpx.post(f"{frontend.url}/v1/messages", json=asked, timeout=60).json()
    assert message["content"] == [{"type": "text", "text": chat.choices[0].message.content}]
    assert message["usage"]["output_tokens"] == chat.usage.completion_tokens
    streamed = httpx.post(f"{frontend.url}/v1/messages", json={**asked, "stream": True},
                          timeout=60).text
    events = [json.loads(block.split("data: ", 1)[1]) for block in streamed.split("\n\n") if block]
    assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta") == \
        chat.choices[0].message.content
    assert events[-1]["type"] == "message_stop"


def test_a_seed_gives_the_same_text_streamed_or_not(client, frontend):
    model = frontend.served.model_id
    sampled = dict(model=model, messages=STORY, temperature=1.0, top_p=0.95, max_tokens=20)

    def answer(seed: int) -> str:
        return client.chat.completions.create(seed=seed, **sampled).choices[0].message.content

    def streamed(seed: int) -> str:
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            seed=seed, stream=True, **sampled))

    # all at once: llm_server's batch-invariant mode makes the company
    # irrelevant to a seed's text (test_seed_invariance_server)
    with ThreadPoolExecutor(5) as pool:
        first, again, streamed_text, *other = [request.result() for request in (
            pool.submit(answer, 7), pool.submit(answer, 7), pool.submit(streamed, 7),
            pool.submit(answer, 8), pool.submit(answer, 9))]
    assert first == again == streamed_text
    assert any(text != first for text in other)


def test_usage_and_logprobs_count_every_generated_token(client, frontend):
    answer = client.chat.completions.create(
        model=frontend.served.model_id, messages=STORY, max_tokens=12, seed=3, logprobs=True,
        extra_body={"min_tokens": 12})
    tokens = answer.choices[0].logprobs.content
    assert answer.usage.completion_tokens == len(tokens) == 12
    assert answer.choices[0].finish_reason == "length"
    assert all(t.logprob <= 0 and np.isfinite(t.logprob) for t in tokens)
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + 12


def test_top_logprobs_come_back_and_leave_the_tokens_as_they_were(client, frontend):
    """chat top_logprobs through the llm model and the sampler instances:
    each token's n most likely, most likely first, with the chosen one's
    logprob where it is among them; the seeded tokens those of a request
    that asks for none. Completions' logprobs n: a dict per token."""
    ask = dict(model=frontend.served.model_id, messages=STORY, max_tokens=6, seed=4,
               logprobs=True)
    plain = client.chat.completions.create(**ask).choices[0].logprobs.content
    asked = client.chat.completions.create(**ask, top_logprobs=3).choices[0].logprobs.content
    assert [t.token for t in asked] == [t.token for t in plain]
    for token in asked:
        values = [top.logprob for top in token.top_logprobs]
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert token.logprob <= values[0] + 1e-6
    completion = client.completions.create(model=frontend.served.model_id, prompt="Once upon",
                                           max_tokens=4, seed=4, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.top_logprobs) == 4
    assert all(token in top and 2 <= len(top) <= 3
               for token, top in zip(logprobs.tokens, logprobs.top_logprobs))


def test_echo_scores_the_prompt_as_lm_eval_asks_it(client, frontend):
    """lm-evaluation-harness's loglikelihood request (echo, logprobs 1,
    max_tokens 1, temperature 0, the prompt as [[ids]]) through the llm
    model: the text starts with the prompt, every prompt token after the
    first has a logprob and a top-1 dict holding it, and a greedy
    continuation's tokens are their own top-1; max_tokens 0 scores alone."""
    codec = frontend.served.codec
    prompt = codec.encode("The capital of France is Paris")
    ask = dict(model=frontend.served.model_id, prompt=[prompt], echo=True, logprobs=1,
               temperature=0, seed=1234)
    choice = client.completions.create(**ask, max_tokens=1).choices[0]
    logprobs = choice.logprobs
    assert choice.text == codec.decode(prompt) + "".join(logprobs.tokens[len(prompt):])
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(prompt) + 1
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(p < 0 for p in logprobs.token_logprobs[1:])
    for text, p, top in zip(logprobs.tokens[1:], logprobs.token_logprobs[1:],
                            logprobs.top_logprobs[1:]):
        assert top[text] == p and 1 <= len(top) <= 2
    assert max(logprobs.top_logprobs[-1].values()) == logprobs.token_logprobs[-1]  # greedy
    alone = client.completions.create(**ask, max_tokens=0).choices[0]
    assert (alone.text, alone.finish_reason) == (codec.decode(prompt), "length")
    assert alone.logprobs.token_logprobs == logprobs.token_logprobs[:-1]
    # vLLM's prompt_logprobs (beside echo's, which keeps its own n): the same
    # scores, keyed by token id, each with its rank, the top-2 ranked 1 and 2
    both = client.completions.create(**ask, max_tokens=0, extra_body={"prompt_logprobs": 2})
    choice = both.choices[0].model_dump()
    assert choice["logprobs"]["token_logprobs"] == logprobs.token_logprobs[:-1]
    places = choice["prompt_logprobs"]
    assert places[0] is None and len(places) == len(prompt)
    for token, place, p in zip(prompt[1:], places[1:], logprobs.token_logprobs[1:]):
        assert place[str(token)]["logprob"] == p
        assert place[str(token)]["decoded_token"] == codec.decode([token], special=True)
        ranked = sorted(place.values(), key=lambda entry: entry["rank"])
        assert [entry["rank"] for entry in ranked[:2]] == [1, 2]
        assert all(a["logprob"] >= b["logprob"] for a, b in zip(ranked, ranked[1:]))


def test_a_list_of_prompts_and_n_answer_each_as_its_own_request(client, frontend):
    """completions with several prompts (lm-eval's --batch_size, the openai
    client's list): choice i is what prompt i alone gets with the same seed
    (batch-invariant server), streamed or not; the usage is the sum. With
    n, choice j is what seed + j alone gets."""
    prompts = ["Once upon a time", "The capital of France is", "def fibonacci(n):"]
    ask = dict(model=frontend.served.model_id, max_tokens=8, seed=11, temperature=0.8)
    alone = [client.completions.create(prompt=p, **ask) for p in prompts]
    together = client.completions.create(prompt=prompts, **ask)
    assert [c.index for c in together.choices] == [0, 1, 2]
    assert [c.text for c in together.choices] == [a.choices[0].text for a in alone]
    assert together.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert together.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    texts = ["", "", ""]
    for chunk in client.completions.create(prompt=prompts, stream=True, **ask):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in together.choices]
    # n: the j-th choice is what seed + j alone gets
    chat = dict(model=frontend.served.model_id, messages=STORY, max_tokens=8, temperature=1.0)
    both = client.chat.completions.create(n=2, seed=20, **chat)
    assert [c.message.content for c in both.choices] == [
        client.chat.completions.create(seed=seed, **chat).choices[0].message.content
        for seed in (20, 21)]


def test_vllms_prompt_extras_cross_triton(client, frontend):
    """vLLM's prompt extras through the llm model: /tokenize gives the ids a
    completion sends (its usage counts them); truncate_prompt_tokens 3 sends
    the prompt's last 3 tokens (usage 3, the greedy text of those ids);
    skip_special_tokens false keeps a generated special token's text."""
    model, prompt = frontend.served.model_id, "The capital of France is"
    tokenized = httpx.post(f"{frontend.url}/tokenize", json={"model": model, "prompt": prompt},
                           timeout=30).json()
    ask = dict(model=model, max_tokens=4, temperature=0)
    whole = client.completions.create(prompt=prompt, **ask)
    assert whole.usage.prompt_tokens == tokenized["count"] == len(tokenized["tokens"])
    cut = client.completions.create(prompt=prompt, **ask, extra_body={"truncate_prompt_tokens": 3})
    assert cut.usage.prompt_tokens == 3
    assert cut.choices[0].text == client.completions.create(prompt=tokenized["tokens"][-3:],
                                                            **ask).choices[0].text
    forced = dict(ask, max_tokens=2, logit_bias={"1": 100})  # <|im_start|>, a special token
    assert client.completions.create(prompt=prompt, **forced).choices[0].text == ""
    kept = client.completions.create(prompt=prompt, **forced,
                                      extra_body={"skip_special_tokens": False})
    assert kept.choices[0].text == "<|im_start|>" * 2


def test_vllms_bad_words_token_ids_and_stream_interval_cross_triton(client, frontend):
    """vLLM's bad_words through the llm model ban the word in mid-text too:
    the greedy " Paris" is gone for "Paris"; return_token_ids gives the ids
    /tokenize gives and the ids of the text; a request's stream_interval 3
    streams the same ids, the first at once and then three at a time."""
    model, prompt = frontend.served.model_id, "The capital of France is"
    ask = dict(model=model, prompt=prompt, max_tokens=6, temperature=0)
    whole = client.completions.create(**ask, extra_body={"return_token_ids": True}).choices[0]
    assert whole.text.startswith(" Paris"), whole.text
    tokenized = httpx.post(f"{frontend.url}/tokenize", json={"model": model, "prompt": prompt},
                           timeout=30).json()
    assert whole.prompt_token_ids == tokenized["tokens"]
    assert frontend.served.codec.decode(whole.token_ids) == whole.text
    banned = client.completions.create(**ask, extra_body={"bad_words": ["Paris"]}).choices[0]
    assert "Paris" not in banned.text and banned.text, banned.text
    streamed = client.completions.create(**ask, stream=True, extra_body={
        "stream_interval": 3, "return_token_ids": True, "min_tokens": 6})
    assert [chunk.choices[0].token_ids for chunk in streamed] == [  # the first at once
        whole.token_ids[:1], whole.token_ids[1:4], whole.token_ids[4:]]


def test_a_stop_token_id_ends_the_answer_there(client, frontend):
    """vLLM's stop_token_ids through the llm model: the greedy answer's
    third token as a stop id ends it there ("stop", three tokens counted,
    that token's text left out, or kept with include_stop_str_in_output);
    with min_tokens 3 it is banned until then."""
    ask = dict(model=frontend.served.model_id, prompt="The capital of France is",
               max_tokens=8, temperature=0, logprobs=0)
    whole = client.completions.create(**ask).choices[0]
    codec = frontend.served.codec
    third = codec.encode(whole.logprobs.tokens[2])
    assert len(third) == 1, whole.logprobs.tokens  # a token of its own when encoded alone
    stopped = client.completions.create(**ask, extra_body={"stop_token_ids": third})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 3
    # vLLM's stop_reason (an extra field of the openai client's choice)
    assert stopped.choices[0].stop_reason == third[0] and whole.stop_reason is None
    assert stopped.choices[0].text == "".join(whole.logprobs.tokens[:2])
    kept = client.completions.create(**ask, extra_body={"stop_token_ids": third,
                                                        "include_stop_str_in_output": True})
    assert kept.choices[0].text == "".join(whole.logprobs.tokens[:3])
    late = client.completions.create(**ask, extra_body={"stop_token_ids": third,
                                                        "min_tokens": 3})
    assert late.usage.completion_tokens > 3
    assert late.choices[0].text.startswith("".join(whole.logprobs.tokens[:2]))


def test_response_format_holds_the_answer_to_a_json_schema(client, frontend):
    """OpenAI's response_format through the door, Triton and the decode loop:
    the answer parses and fits the schema; a grammar that does not compile
    comes back a 400 naming the guide."""
    schema = {"type": "object", "properties": {"capital": {"type": "string"}},
              "required": ["capital"], "additionalProperties": False}
    answer = client.chat.completions.create(
        model=frontend.served.model_id, messages=QUESTION, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "capital",
                                                                "schema": schema}})
    value = json.loads(answer.choices[0].message.content)
    assert set(value) == {"capital"} and answer.choices[0].finish_reason == "stop", answer
    with pytest.raises(openai.BadRequestError, match="guided_regex is not a regular"):
        client.chat.completions.create(model=frontend.served.model_id, messages=QUESTION,
                                       extra_body={"guided_regex": "(ab"})


def test_a_named_tool_and_required_answer_in_calls_the_openai_client_reads(client, frontend):
    """tool_choice through the door, Triton and the decode loop: the named
    function's call has arguments that fit its parameters; required answers
    a list of calls of the tools; streamed, the named call's arguments come
    in pieces that join into the same text."""
    weather = {"type": "function", "function": {
        "name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
            "additionalProperties": False}}}
    ask = dict(model=frontend.served.model_id, max_tokens=40, temperature=0, tools=[weather],
               messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    named = client.chat.completions.create(
        **ask, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "get_weather", named
    assert set(json.loads(call.function.arguments)) == {"city"}
    pieces = [chunk.choices[0].delta.tool_calls[0].function.arguments
              for chunk in client.chat.completions.create(
                  **ask, stream=True,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
              if chunk.choices and chunk.choices[0].delta.tool_calls]
    assert "".join(pieces) == call.function.arguments
    required = client.chat.completions.create(**{**ask, "max_tokens": 200},
                                              tool_choice="required")
    calls = required.choices[0].message.tool_calls
    assert calls and all(c.function.name == "get_weather" for c in calls), required
    # the Responses API's function tool: the same call, as a function_call item
    answer = client.responses.create(
        model=ask["model"], input=ask["messages"][0]["content"], max_output_tokens=40,
        temperature=0, tools=[{"type": "function", **weather["function"]}],
        tool_choice={"type": "function", "name": "get_weather"})
    [item] = answer.output
    assert (item.type, item.name, item.arguments) == ("function_call", "get_weather",
                                                      call.function.arguments)


def test_a_bad_request_is_a_400_the_client_raises(client, frontend):
    with pytest.raises(openai.BadRequestError, match="temperature must be a finite value >= 0"):
        client.chat.completions.create(model=frontend.served.model_id, messages=QUESTION,
                                       temperature=-1)
    with pytest.raises(openai.BadRequestError, match="n must be an integer in"):
        client.chat.completions.create(model=frontend.served.model_id, messages=QUESTION, n=0)
    with pytest.raises(openai.BadRequestError, match=r"logit_bias keys must be token ids in \[0, 49151\]"):
        client.chat.completions.create(model=frontend.served.model_id, messages=QUESTION,
                                       logit_bias={"999999": 1})


def long_request(frontend, stream: bool) -> dict:
    return {"model": frontend.served.model_id, "messages": STORY, "max_tokens": 400,
            "min_tokens": 400, "stream": stream}


def wait_until_generating(server, timeout_s: float = 60.0) -> None:
    assert wait_until(lambda: in_flight(server) >= 1, timeout_s, interval_s=0.02)
    assert in_flight(server) == 1


def stops_within(server) -> tuple[float, float]:
    """(seconds until no request is in flight, rows sampled in the second
    after); fails if one still is after 30 s."""
    left = time.monotonic()
    assert wait_until(lambda: in_flight(server) == 0, interval_s=0.02), "still generating after 30 s"
    stopped_after = time.monotonic() - left
    rows = rows_sampled(server, settled=True)
    time.sleep(1.0)
    return stopped_after, rows_sampled(server, settled=True) - rows


def test_a_client_leaving_a_stream_stops_its_generation(frontend, llm_server):
    rows_before = rows_sampled(llm_server, settled=True)
    with httpx.Client(base_url=frontend.url, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions",
                         json=long_request(frontend, stream=True)) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            received = 0
            for line in lines:
                received += line.startswith("data: ")
                if received == 5:
                    break
            # the gauge may lag a new request by the llm model's 0.5 s report period
            assert wait_until(lambda: in_flight(llm_server) == 1)
    # the connection is closed here
    stopped_after, rows_after = stops_within(llm_server)
    # how soon is said by the rows sampled, far short of its 400 tokens, not
    # by the seconds it took (a loaded machine stretches the cancel's path)
    assert rows_after == 0, stopped_after
    assert rows_sampled(llm_server) - rows_before < 100  # far from the 400 asked


def test_a_client_aborting_a_non_streamed_request_stops_its_generation(frontend, llm_server):
    rows_before = rows_sampled(llm_server, settled=True)
    body = json.dumps(long_request(frontend, stream=False)).encode()
    with socket.create_connection((frontend.host, frontend.port)) as connection:
        connection.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\n"
                           b"Content-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n" % len(body) + body)
        wait_until_generating(llm_server)
        time.sleep(0.5)
    # the connection is closed here, before any answer
    stopped_after, rows_after = stops_within(llm_server)
    assert rows_after == 0, stopped_after
    assert rows_sampled(llm_server) - rows_before < 200


def test_a_cancelled_ensemble_stream_keeps_generating(llm_server):
    """What the front door avoids by calling llm: Triton 2.51 does not pass a
    gRPC client's cancellation on to the ensemble's running llm step
    (docs/SERVING.md, "Cancellation"). If this starts failing, Triton does."""
    client = grpcclient.InferenceServerClient(llm_server.grpc_url)
    arrivals = []
    client.start_stream(callback=lambda result, error: arrivals.append(error))
    inputs = []
    for name, value in (("text_input", np.array([[b"Tell me a very long story."]], object)),
                        ("max_tokens", np.array([[60]], np.int32)),
                        ("min_length", np.array([[60]], np.int32)),
                        ("stream", np.array([[True]]))):
        inputs.append(grpcclient.InferInput(name, [1, 1], np_to_triton_dtype(value.dtype)))
        inputs[-1].set_data_from_numpy(value)
    rows = rows_sampled(llm_server, settled=True)
    client.async_stream_infer("ensemble", inputs)
    wait_until(lambda: len(arrivals) >= 3, timeout_s=60, interval_s=0.01)
    client.stop_stream(cancel_requests=True)
    client.close()
    # it ends at max_tokens, unseen: every one of its 60 tokens sampled, where
    # a cancellation passed on would have stopped it a step or two after the
    # third (however fast the host: no window to catch it still running)
    assert wait_until(lambda: in_flight(llm_server) == 0, timeout_s=60)
    generated = rows_sampled(llm_server, settled=True) - rows
    assert generated >= 60, generated


def streamed_load(url: str, model: str, requests: int = 16, concurrency: int = 8) -> int:
    """Streamed chats as AIPerf's chat endpoint sends them (`concurrency` at
    a time), every fourth one left after 3 chunks by its client; returns how
    many finished."""
    async def run() -> int:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        slots = asyncio.Semaphore(concurrency)

        async def one(index: int) -> bool:
            async with slots:
                stream = await client.chat.completions.create(
                    model=model, messages=STORY, max_tokens=32, stream=True,
                    extra_body={"min_tokens": 32})
                async with stream:
                    chunks = 0
                    async for _ in stream:
                        chunks += 1
                        if index % 4 == 3 and chunks == 3:
                            return False
                return True

        try:
            return sum(await asyncio.gather(*(one(i) for i in range(requests))))
        finally:
            await client.close()
    return asyncio.run(run())


def test_serve_stops_cleanly_after_a_streamed_load_and_mid_stream(tmp_path):
    """`serve` with --openai-port: the API answers; after a streamed load
    (some clients leaving mid-stream), SIGINT during a long stream ends the
    stream (with the drain's error after the grace) and serve exits 0 within
    the grace and a few seconds, Triton by itself (no model left loaded for
    its exit timeout), and no shared-memory region is left. Without the
    clients' clean end of finished gRPC streams (client/aio.py,
    let_triton_end) Triton waited out its exit timeout with llm loaded."""
    grace = 2
    *ports, openai_port = free_ports(4)
    process = subprocess.Popen(
        [str(Path(sys.executable).parent / "simple-sampler"), "serve", "--instances", "1",
         "--max-context", "1024", "--http-port", str(ports[0]), "--grpc-port", str(ports[1]),
         "--metrics-port", str(ports[2]), "--openai-port", str(openai_port),
         "--openai-host", "127.0.0.1", "--shutdown-grace", str(grace),
         "--log", str(tmp_path / "tritonserver.log")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = []
    try:
        for line in process.stdout:
            output.append(line)
            if "openai frontend ready on" in line:
                break
        else:
            pytest.fail(f"serve exited before the frontend was ready: {''.join(output)}")
        url = f"http://127.0.0.1:{openai_port}"
        assert f"openai frontend ready on {url}/v1" in output[-1]
        server_pid = int(re.search(r"tritonserver started \(pid (\d+)", "".join(output))[1])
        stubs = list_stubs(server_pid)
        assert arena_regions(stub.pid for stub in stubs)  # llm's rows to its sampler
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        answer = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=8,
                                                extra_body={"min_tokens": 8})
        assert answer.usage.completion_tokens == 8
        assert streamed_load(url, model) == 12
        with httpx.Client(base_url=url, timeout=60) as http:
            with http.stream("POST", "/v1/chat/completions", json={
                    "model": model, "messages": STORY, "max_tokens": 900, "min_tokens": 900,
                    "stream": True}) as response:
                lines = response.iter_lines()
                for _ in range(3):
                    next(lines)
                # serve's drain waits on this gauge, which may lag a new
                # request by the llm model's 0.5 s report period
                wait_until_generating(SimpleNamespace(metrics_url=f"http://127.0.0.1:{ports[2]}/metrics"))
                signalled = time.monotonic()
                process.send_signal(signal.SIGINT)
                rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert "shutting down" in rest[-2], rest[-2:]
        stdout, _ = process.communicate(timeout=grace + 30)
        stopped_after = time.monotonic() - signalled
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, "".join(output) + stdout
    assert "simple-sampler serve: stopped" in stdout
    assert (("".join(output) + stdout).count("openai frontend ready on")) == 1
    assert "(status 0)" in stdout  # tritonserver exited by itself, not at its exit timeout
    assert re.search(r"drained in [1-9]", stdout), stdout  # the long stream: for the grace
    assert stopped_after < grace + TRITON_EXIT_TIMEOUT_S, stopped_after
    assert len(stubs) == 4  # preprocessing, llm, the sampler, postprocessing
    assert not arena_regions(stub.pid for stub in stubs)
    assert not [s.shm_region for s in stubs if (SHM_DIRECTORY / s.shm_region).exists()]
