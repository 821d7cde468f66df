"""The OpenAI front door without a server: requests through the real ASGI app
(FastAPI's TestClient) and the model's real tokenizer, generation replaced
by a stand-in that records what would be sent to the llm model."""
import asyncio
import copy
import importlib.metadata
import json
import re
import time

import pytest
from fastapi.testclient import TestClient
from starlette.requests import ClientDisconnect

from fakes import on_loop_recorder
from simple_sampler.client import Chunk, GenerationError
from simple_sampler.frontend import translate
from simple_sampler.frontend.app import build_app
from simple_sampler.frontend.backend import TritonBackend
from simple_sampler.frontend.translate import Plan, Served
from simple_sampler.schema import SHUTTING_DOWN

MODEL = "SmolLM2-135M-Instruct"
CONTEXT = 512


class Recorder:
    """generate(plan): two responses of one token each (or a given error)."""

    def __init__(self):
        self.plans, self.error, self.closed = [], None, 0

    def generate(self, plan):
        self.plans.append(plan)

        async def chunks():
            try:
                if self.error is not None:
                    raise self.error
                n = len(plan.prompt_ids)
                yield Chunk(" Paris", [3], [-0.5], -0.5, n, 1, "")
                yield Chunk(".", [4], [-0.25], -0.75, n, 2, "stop")
            finally:
                self.closed += 1
        return chunks()


@pytest.fixture
def recorder():
    return Recorder()


@pytest.fixture
def client(codec, recorder):
    return TestClient(build_app(Served(MODEL, codec, CONTEXT, len(codec.tokenizer)), recorder.generate))


def test_a_server_that_answers_once_refuses_a_stream_and_answers_the_rest(codec, recorder):
    """The llm model not decoupled (decoupled_mode false): a stream is refused
    before anything is generated; a non-streamed request is answered."""
    client = TestClient(build_app(Served(MODEL, codec, CONTEXT, len(codec.tokenizer),
                                         streams=False), recorder.generate))
    for path, body in (("/v1/chat/completions", chat(stream=True)),
                       ("/v1/completions", completion(stream=True))):
        response = post(client, path, body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "stream" and "decoupled_mode false" in error["message"]
    assert not recorder.plans
    assert post(client, "/v1/completions", completion()).status_code == 200
    assert len(recorder.plans) == 1


def chat(**fields):
    return {"model": MODEL, "messages": [{"role": "user", "content": "Capital of France?"}],
            **fields}


def completion(**fields):
    return {"model": MODEL, "prompt": "The capital of France is", **fields}


def post(client, path, body):
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return client.post(path, content=data, headers={"Content-Type": "application/json"})


# (body or raw JSON text, the field the error must name, text the message must hold)
BAD_CHAT = [
    ('{"model": ', None, "not valid JSON"),
    ("[1, 2]", None, "JSON object"),
    (chat(max_tokens="16"), "max_tokens", "valid integer"),
    ('{"model": "%s", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1e9}' % MODEL,
     "max_tokens", "valid integer"),
    (chat(max_tokens=16.0), "max_tokens", "valid integer"),
    ('{"model": "%s", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1e999}'
     % MODEL, "max_tokens", "valid integer"),
    (chat(max_tokens=4294967297), "max_tokens", "[1, 512]"),
    (chat(max_tokens=0), "max_tokens", "[1, 512]"),
    (chat(max_tokens=True), "max_tokens", "valid integer"),
    (chat(max_completion_tokens=513), "max_completion_tokens", "[1, 512]"),
    (chat(max_tokens=8, max_completion_tokens=9), "max_completion_tokens", "disagree"),
    (chat(temperature="NaN"), "temperature", "valid number"),
    ('{"model": "%s", "messages": [{"role": "user", "content": "x"}], "temperature": 1e999}'
     % MODEL, "temperature", "finite"),
    ('{"model": "%s", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}'
     % MODEL, "temperature", "finite"),
    (chat(temperature=-0.5), "temperature", "a finite value >= 0"),
    (chat(top_p=0), "top_p", "in (0, 1]"),
    (chat(top_p=1.5), "top_p", "in (0, 1]"),
    (chat(top_k=-2), "top_k", ">= -1"),
    (chat(top_k=2**31), "top_k", ">= -1 (0 or -1 disables it) and at most 2147483647"),
    (chat(min_p=2.0), "min_p", "in [0, 1]"),
    (chat(repetition_penalty=0), "repetition_penalty", "in [1e-6, 1e6]"),
    (chat(presence_penalty=2.5), "presence_penalty", "in [-2, 2]"),
    (chat(frequency_penalty=-3), "frequency_penalty", "in [-2, 2]"),
    (chat(seed=-2**63 - 1), "seed", "[-9223372036854775808, 18446744073709551615]"),
    (chat(seed=2**64), "seed", "[-9223372036854775808, 18446744073709551615]"),
    (chat(seed=1.5), "seed", "valid integer"),
    (chat(min_tokens=-1), "min_tokens", "[0, 2147483647]"),
    (chat(min_tokens=20, max_tokens=10), "min_tokens", "at most"),
    (chat(n=0), "n", "n must be an integer in [1, 256], got 0"),
    (chat(temprature=0.5), "temprature", "unknown field"),
    (chat(functions=[{"name": "f"}]), "functions", "not supported"),
    (chat(audio={"voice": "x"}), "audio", "not supported"),
    (chat(response_format={"type": "yaml"}), "response_format", "text, json_object or json_schema"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format.json_schema", "whose schema is a JSON schema"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {},
                                                                  "extra": 1}}),
     "response_format.json_schema.extra", "not a field of it"),
    (chat(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs",
     "exactly one of"),
    (chat(guided_regex="a", guided_choice=["b"]), "guided_regex", "give one of"),
    (chat(guided_regex="(ab"), "guided_regex", "guided_regex is not a regular expression"),
    (chat(guided_regex="a", ignore_eos=True), "ignore_eos", "with a grammar"),
    (chat(allowed_token_ids=[]), "allowed_token_ids", "must not be empty"),
    (chat(allowed_token_ids=[5, 49152]), "allowed_token_ids", "[0, 49151]"),
    (chat(guided_regex="a", guided_decoding_backend="outlines"), "guided_decoding_backend",
     "must be one of auto"),
    (chat(guided_whitespace_pattern=" "), "guided_whitespace_pattern", "not supported"),
    (chat(response_format={"type": "structural_tag", "format": {}}), "response_format",
     "text, json_object or json_schema, got 'structural_tag'"),
    (chat(structured_outputs={"grammar": "root ::= item"}), "structured_outputs",
     "is not an EBNF"),
    (chat(guided_regex="a", response_format={"type": "json_object"}), "guided_regex",
     "each ask for a grammar"),
    (chat(logprobs=True, top_logprobs=21), "top_logprobs", "integer in [0, 20]"),
    (chat(logprobs=True, top_logprobs=-1), "top_logprobs", "integer in [0, 20]"),
    (chat(top_logprobs=1), "top_logprobs", "top_logprobs needs logprobs true"),
    (chat(stop=[""]), "stop", "non-empty"),
    (chat(stop=7), "stop", "str, list[str]"),
    (chat(logit_bias={"abc": 1.0}), "logit_bias", "token ids"),
    (chat(logit_bias={"49152": 1.0}), "logit_bias", "[0, 49151]"),
    (chat(logit_bias={"5": "x"}), "logit_bias.5", "valid number"),
    # a digit that is not ASCII: str.isdigit() says yes, int() refuses or reads another id
    (chat(logit_bias={"\u00b2": 1.0}), "logit_bias", "token ids"),
    (chat(logit_bias={"\u0665": 1.0}), "logit_bias", "token ids"),
    (chat(logit_bias={"5": 1.0, "05": 2.0}), "logit_bias", "token 5 twice"),
    # values the FP32 inputs cannot carry: the decode loop's refusal would come back a 500
    (chat(logit_bias={"5": 1e39}), "logit_bias", "in [-1e6, 1e6] or -inf"),
    (chat(logit_bias={"5": -1e39}), "logit_bias", "in [-1e6, 1e6] or -inf"),
    (chat(temperature=1e39), "temperature", "in [0, 2]"),
    (chat(temperature=2.01), "temperature", "temperature must be in [0, 2] (OpenAI's and vLLM's"),
    (chat(temperature=3), "temperature", "must be in [0, 2]"),
    (chat(repetition_penalty=1e39), "repetition_penalty", "in [1e-6, 1e6]"),
    (chat(repetition_penalty=1e-7), "repetition_penalty", "in [1e-6, 1e6]"),
    (chat(top_p=1e-46), "top_p", "reads as 0.0"),
    (chat(stream_options={"include_usage": True}), "stream_options", "stream true"),
    (chat(stream=True, stream_options={"include_usage": True, "x": 1}), "stream_options.x",
     "unknown field"),
    (chat(messages=[]), "messages", "at least one"),
    (chat(messages=[{"role": "robot", "content": "x"}]), "messages.0.role", "Input should be"),
    (chat(messages=[{"role": "user"}]), "messages.0.content", "required"),
    (chat(messages=["hi"]), "messages.0", "must be a JSON object"),
    # an OpenAI request field inside a message is not a request field there
    (chat(messages=[{"role": "user", "content": "x", "audio": {"id": "1"}}]),
     "messages.0.audio", "unknown field"),
    (chat(stream=True, stream_options={"include_usage": True, "metadata": {}}),
     "stream_options.metadata", "unknown field"),
    (chat(stream="yes"), "stream", "valid boolean"),
]
BAD_COMPLETION = [
    (completion(prompt=""), "prompt", "non-empty"),
    (completion(prompt=["a"] * 257), "prompt", "prompt must hold at most 256 prompts, got 257"),
    (completion(prompt=["a", ""]), "prompt", "prompt[1] must be a non-empty string"),
    (completion(stop_token_ids=[3, -1]), "stop_token_ids", "stop_token_ids must be an integer in [0, "),
    (completion(prompt=["a"] * 100, n=3), "n", "the prompts (100) times n (3) must be at most 256"),
    (completion(prompt=[[1], [2, 10**9]]), "prompt", "prompt[1][1] must be an integer in [0, "),
    (completion(prompt=[2, 10**9]), "prompt", "prompt[1] must be an integer in [0, "),
    (completion(prompt=["Hi", "Hi " * 600], max_tokens=4), "prompt",
     "prompt[1] (601 tokens) leaves no room in the context (512 tokens)"),
    (completion(prompt=[""]), "prompt", "non-empty string"),
    (completion(prompt=[[]]), "prompt", "prompt must be a non-empty string or list of token ids"),
    (completion(prompt=[1, "a"]), "prompt", "str, list[int], list[str], list[list[int]]"),
    (completion(prompt=[1, -1]), "prompt", "[0, 49151]"),
    (completion(prompt=[49152]), "prompt", "[0, 49151]"),
    (completion(echo=True, max_tokens=-1), "max_tokens", "[0, 512]"),
    (completion(max_tokens=0), "max_tokens", "[1, 512]"),
    (completion(logprobs=21), "logprobs", "integer in [0, 20]"),
    (completion(best_of=2), "best_of", "best_of must be 1"),
    (completion(suffix="x"), "suffix", "not supported"),
    (completion(max_tokens=600), "max_tokens", "[1, 512]"),
    (completion(prompt=[1] * 512), "prompt", "leaves no room"),
    (completion(prompt=[1] * 512, max_tokens=4), "prompt", "leaves no room"),
    (completion(prompt=[1] * 513, echo=True, max_tokens=0), "prompt", "leaves no room"),
]


@pytest.mark.parametrize("path,body,param,text", [
    *(("/v1/chat/completions", *case) for case in BAD_CHAT),
    *(("/v1/completions", *case) for case in BAD_COMPLETION)])
def test_a_malformed_request_is_a_400_naming_the_field(client, recorder, path, body, param, text):
    response = post(client, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    if text:
        assert text in error["message"], error
    if param:
        assert param.split(".")[0] in error["message"], error
    assert recorder.plans == []  # nothing reached the model


def test_an_unknown_model_or_path_answers_404_in_openai_shape(client):
    response = post(client, "/v1/chat/completions", chat(model="gpt-4"))
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"
    assert MODEL in response.json()["error"]["message"]
    response = client.get("/v1/nothing")
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"


def test_sampling_fields_reach_the_llm_inputs_the_schema_names(client, recorder, codec):
    response = post(client, "/v1/chat/completions", chat(
        temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1,
        presence_penalty=0.5, frequency_penalty=-0.5, seed=2**64 - 1, stop=["\n", "."],
        min_tokens=2, max_completion_tokens=20, logit_bias={"17": -100, "42": 2.5},
        logprobs=True, top_logprobs=0, user="someone", n=None, stream=None))
    assert response.status_code == 200, response.text
    plan = recorder.plans[0]
    assert plan.prompt_ids == codec.encode("Capital of France?", chat=True)
    assert plan.params == {
        "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
        "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": -0.5,
        # stop as vLLM's parameter: matched in the text (the stop_words input, as tokens)
        "seed": 2**64 - 1, "sampling_parameters": '{"stop": ["\\n", "."]}', "min_length": 2,
        "max_tokens": 20,
        "logit_bias_ids": [17, 42], "logit_bias_values": [-100.0, 2.5],
        "return_log_probs": True}


@pytest.mark.parametrize("fields, inputs", [
    ({"response_format": {"type": "text"}}, {}),
    ({"response_format": {"type": "json_object"}}, {"guided_decoding_guide_type": "json"}),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "answer", "strict": True, "schema": {"type": "object"}}}},
     {"guided_decoding_guide_type": "json_schema",
      "guided_decoding_guide": '{"type": "object"}'}),
    ({"structured_outputs": {"choice": ["a", "b"]}},
     {"guided_decoding_guide_type": "choice", "guided_decoding_guide": '["a", "b"]'}),
    ({"guided_regex": "[0-9]+", "guided_decoding_backend": "xgrammar"},
     {"guided_decoding_guide_type": "regex", "guided_decoding_guide": "[0-9]+"}),
    ({"guided_json": {"type": "array"}},
     {"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": '{"type": "array"}'}),
    ({"allowed_token_ids": [5, 7]}, {"allowed_token_ids": [5, 7]}),
    ({"guided_grammar": 'root ::= "x"'},
     {"guided_decoding_guide_type": "ebnf_grammar", "guided_decoding_guide": 'root ::= "x"'}),
])
def test_a_grammar_asked_any_way_reaches_the_llms_guided_decoding_inputs(client, recorder,
                                                                         fields, inputs):
    response = post(client, "/v1/chat/completions", chat(**fields))
    assert response.status_code == 200, response.text
    assert {k: v for k, v in recorder.plans[0].params.items()
            if k.startswith("guided") or k == "allowed_token_ids"} == inputs


def test_completions_take_a_grammar_as_chat_does(client, recorder):
    response = post(client, "/v1/completions", completion(
        response_format={"type": "json_object"}, allowed_token_ids=[5, 7]))
    assert response.status_code == 200, response.text
    params = recorder.plans[0].params
    assert params["guided_decoding_guide_type"] == "json" and params["allowed_token_ids"] == [5, 7]


def test_chat_without_max_tokens_may_fill_the_context(client, recorder, codec):
    turns = [{"role": "system", "content": "Answer in one word."},
             {"role": "user", "content": "Capital of France?"},
             {"role": "assistant", "content": "Paris."},
             {"role": "user", "content": [{"type": "text", "text": "And"},
                                          {"type": "text", "text": "of Italy?"}]}]
    assert post(client, "/v1/chat/completions", chat(messages=turns)).status_code == 200
    plan = recorder.plans[0]
    expected = codec.encode_chat([*({"role": t["role"], "content": t["content"]}
                                    for t in turns[:3]), {"role": "user", "content": "And\nof Italy?"}])
    assert plan.prompt_ids == expected
    assert plan.params["max_tokens"] == CONTEXT - len(expected)
    assert plan.params["return_log_probs"] is False
    # a completion's default is OpenAI's 16
    assert post(client, "/v1/completions", completion()).status_code == 200
    # and top_p 1, OpenAI's, said (the llm model reads no top_k and no top_p as greedy)
    assert recorder.plans[1].params == {"max_tokens": 16, "return_log_probs": False,
                                        "top_p": 1.0}
    assert recorder.plans[1].prompt_ids == codec.encode("The capital of France is")


def test_a_request_without_a_model_is_the_served_models(client):
    """vLLM's model field is optional: a request naming none is answered by
    the served model, and names it."""
    body = chat()
    del body["model"]
    answer = post(client, "/v1/chat/completions", body)
    assert answer.status_code == 200 and answer.json()["model"] == MODEL
    body = completion()
    del body["model"]
    assert post(client, "/v1/completions", body).json()["model"] == MODEL


def test_a_non_streamed_answer_is_openais_object(client):
    body = post(client, "/v1/chat/completions", chat(logprobs=True)).json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    choice, = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": " Paris."}
    assert choice["finish_reason"] == "stop"
    assert [(c["logprob"]) for c in choice["logprobs"]["content"]] == [-0.5, -0.25]
    assert body["usage"]["completion_tokens"] == 2
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 2
    body = post(client, "/v1/completions", completion(logprobs=0)).json()
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == " Paris."
    assert body["choices"][0]["logprobs"]["token_logprobs"] == [-0.5, -0.25]


def test_logprob_bytes_are_each_tokens_own_and_join_into_the_text(codec):
    """A character split over tokens: as vLLM names them (``token_text``),
    the pieces before the last are "" and the last is the character; each
    token's bytes are its part of the character (OpenAI's purpose for them),
    and the bytes joined are the text's UTF-8."""
    ids = codec.tokenizer("\U0001f642 \u00e9", add_special_tokens=False)["input_ids"]
    assert len(ids) == 3  # the smiley is split over the first two

    def generate(plan):
        async def chunks():
            n = len(plan.prompt_ids)
            yield Chunk(codec.decode(ids), ids, [-0.1] * 3, -0.3, n, 3, "")
            yield Chunk("", [codec.end_id], [-0.2], -0.5, n, 4, "stop")
        return chunks()

    client = TestClient(build_app(Served(MODEL, codec, CONTEXT, len(codec.tokenizer)), generate))
    content = post(client, "/v1/chat/completions", chat(logprobs=True)).json()["choices"][0][
        "logprobs"]["content"]
    assert [c["token"] for c in content[:2]] == ["", "\U0001f642"]
    assert bytes(content[0]["bytes"]) + bytes(content[1]["bytes"]) == "\U0001f642".encode()
    assert b"".join(bytes(c["bytes"]) for c in content).decode() == "\U0001f642 \u00e9"
    assert content[3]["token"] == "" and content[3]["bytes"] == []  # the end token: skipped


def test_a_character_split_over_tokens_and_responses_is_named_as_vllm_names_it(codec):
    """Completions' logprobs tokens of a character split over tokens, the
    stream's responses splitting it too: "" for each piece but the last,
    which is the character (vLLM's ``_correct_decoded_token``, its context
    the tokens sampled before it, whatever response they came in); so the
    tokens join into the text and text_offset counts characters."""
    text = "日本語 🍕!"
    ids = codec.encode(text)
    assert any(codec.decode([t]).endswith("\ufffd") for t in ids)

    def generate(plan):
        async def chunks():
            n = len(plan.prompt_ids)
            for step, token in enumerate(ids, 1):  # one token a response
                yield Chunk(codec.decode(ids[:step]), [token], [-0.1], -0.1 * step, n, step,
                            "stop" if step == len(ids) else "")
        return chunks()

    client = TestClient(build_app(Served(MODEL, codec, CONTEXT, len(codec.tokenizer)), generate))
    whole = post(client, "/v1/completions", completion(logprobs=0)).json()["choices"][0]["logprobs"]
    assert "".join(whole["tokens"]) == text and "" in whole["tokens"]
    assert whole["text_offset"][-1] == len(text) - len(whole["tokens"][-1])
    streamed = [c["choices"][0]["logprobs"] for c in events(post(
        client, "/v1/completions", completion(logprobs=0, stream=True)))]
    assert [t for c in streamed for t in c["tokens"]] == whole["tokens"]
    assert [o for c in streamed for o in c["text_offset"]] == whole["text_offset"]
    chat_tokens = [c["logprobs"]["content"][0]["token"] for c in (
        e["choices"][0] for e in events(post(client, "/v1/chat/completions",
                                             chat(logprobs=True, stream=True))))]
    assert chat_tokens == whole["tokens"]


def test_top_logprobs_reach_the_llm_and_come_back_as_openai_and_vllm_write_them(codec):
    """chat top_logprobs n and completions logprobs n ask the llm model for
    num_top_logprobs n; chat answers each token's n most likely, completions
    a dict of their texts and the chosen token's (n or n + 1 entries); a
    banned token's -inf is written -9999.0 (JSON has no infinity)."""
    plans, paris, dot = [], codec.encode(" Paris")[0], codec.encode(".")[0]
    comma = codec.encode(",")[0]

    def generate(plan):
        plans.append(plan)

        async def chunks():
            n = len(plan.prompt_ids)
            yield Chunk(" Paris", [paris], [-0.5], -0.5, n, 1, "",
                        [[(paris, -0.5), (comma, -1.5)]])
            yield Chunk(".", [dot], [-0.25], -0.75, n, 2, "stop",
                        [[(comma, -0.1), (paris, float("-inf"))]])
        return chunks()

    client = TestClient(build_app(Served(MODEL, codec, CONTEXT, len(codec.tokenizer)), generate))
    body = post(client, "/v1/chat/completions", chat(logprobs=True, top_logprobs=2)).json()
    assert plans[-1].params["num_top_logprobs"] == 2
    first, second = body["choices"][0]["logprobs"]["content"]
    assert [(t["token"], t["logprob"]) for t in first["top_logprobs"]] == [(" Paris", -0.5),
                                                                         (",", -1.5)]
    assert second["top_logprobs"][1]["logprob"] == -9999.0
    assert bytes(second["top_logprobs"][0]["bytes"]) == b","
    response = post(client, "/v1/chat/completions",
                    chat(logprobs=True, top_logprobs=2, stream=True))
    streamed = [c["choices"][0]["logprobs"]["content"] for c in events(response)]
    assert [c[0]["top_logprobs"] for c in streamed] == [first["top_logprobs"],
                                                        second["top_logprobs"]]
    body = post(client, "/v1/completions", completion(logprobs=2)).json()
    assert plans[-1].params["num_top_logprobs"] == 2
    assert body["choices"][0]["logprobs"]["top_logprobs"] == [
        {" Paris": -0.5, ",": -1.5}, {",": -0.1, " Paris": -9999.0, ".": -0.25}]
    post(client, "/v1/completions", completion(logprobs=0))
    assert "num_top_logprobs" not in plans[-1].params


def test_echo_gives_the_prompt_and_its_logprobs_as_lm_eval_reads_them(codec):
    """completions echo starts the answer with the prompt; with logprobs n
    the llm model is asked for prompt_logprobs n, and the prompt's tokens
    lead the logprobs (the first null), as lm-evaluation-harness's
    loglikelihood reads them (token_logprobs[ctxlen:-1], top_logprobs)."""
    plans, prompt = [], codec.encode("The capital of France is")
    paris, comma = codec.encode(" Paris")[0], codec.encode(",")[0]

    def generate(plan):
        plans.append(plan)

        async def chunks():
            n = len(plan.prompt_ids)
            if "prompt_logprobs" in plan.params:
                tops = [[(comma, -0.25), (paris, -1.0)]] * (n - 1) if plan.logprobs else []
                yield Chunk("", [], [], 0.0, n, 0, "", prompt_ids=plan.prompt_ids,
                            prompt_logprobs=[-1.0 - i for i in range(n - 1)],
                            prompt_top_logprobs=tops)
            if plan.params["max_tokens"]:
                yield Chunk(" Paris", [paris], [-0.5], -0.5, n, 1, "length",
                            [[(paris, -0.5), (comma, -1.5)]])
            else:
                yield Chunk("", [], [], 0.0, n, 0, "length")
        return chunks()

    client = TestClient(build_app(Served(MODEL, codec, CONTEXT, len(codec.tokenizer)), generate))
    body = post(client, "/v1/completions", {**completion(echo=True, logprobs=2, max_tokens=1,
                                                         temperature=0), "prompt": [prompt]}).json()
    assert plans[-1].params["prompt_logprobs"] == 2
    choice = body["choices"][0]
    assert choice["text"] == "The capital of France is Paris"
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [codec.decode([t]) for t in prompt] + [" Paris"]
    assert logprobs["token_logprobs"] == [None] + [-1.0 - i for i in range(len(prompt) - 1)] + [-0.5]
    assert logprobs["top_logprobs"][0] is None
    assert logprobs["top_logprobs"][1] == {",": -0.25, " Paris": -1.0, codec.decode([prompt[1]]): -1.0}
    assert logprobs["top_logprobs"][-1] == {" Paris": -0.5, ",": -1.5}
    # each token's offset in the text (vLLM's _create_completion_logprobs)
    lengths = [len(t) for t in logprobs["tokens"]]
    assert logprobs["text_offset"] == [sum(lengths[:i]) for i in range(len(lengths))]
    assert logprobs["text_offset"][-1] == len("The capital of France is")
    assert body["usage"]["prompt_tokens"] == len(prompt)
    streamed = events(post(client, "/v1/completions", completion(echo=True, logprobs=2,
                                                                 stream=True)))
    assert "".join(c["choices"][0]["text"] for c in streamed) == choice["text"]
    assert [t for c in streamed for t in c["choices"][0]["logprobs"]["tokens"]] == logprobs["tokens"]
    assert [o for c in streamed
            for o in c["choices"][0]["logprobs"]["text_offset"]] == logprobs["text_offset"]
    asked = len(plans)
    for stream in (False, True):  # the prompt alone: the model is not asked
        response = post(client, "/v1/completions", completion(echo=True, max_tokens=0,
                                                              stream=stream))
        choice = events(response)[0]["choices"][0] if stream else response.json()["choices"][0]
        assert choice == {"index": 0, "text": "The capital of France is", "logprobs": None,
                          "finish_reason": "length", "stop_reason": None}
    assert len(plans) == asked
    body = post(client, "/v1/completions", completion(echo=True, max_tokens=0, logprobs=0)).json()
    assert plans[-1].params["prompt_logprobs"] == 0 and plans[-1].params["max_tokens"] == 0
    assert body["choices"][0]["logprobs"]["token_logprobs"][1:] == [
        -1.0 - i for i in range(len(prompt) - 1)]
    body = post(client, "/v1/completions", completion(echo=True)).json()
    assert "prompt_logprobs" not in plans[-1].params
    assert body["choices"][0]["text"] == "The capital of France is Paris"


def test_prompt_logprobs_are_answered_as_vllm_gives_them(codec):
    """vLLM's prompt_logprobs n: the llm model is asked for the prompt's
    scores (the larger n where echo asks too); the completion's choice (a
    chat's answer) carries them: null for the first token, then per token
    its own logprob and rank and the n most likely with ranks 1 to n, keyed
    by token id; -inf as -9999.0; max_tokens 0 scores alone. As vLLM, n > 0
    is refused with stream, and -1 (the whole vocabulary) is refused here."""
    plans, prompt = [], codec.encode("The capital of France is")
    paris, comma = codec.encode(" Paris")[0], codec.encode(",")[0]
    count = len(prompt) - 1

    def generate(plan):
        plans.append(plan)

        async def chunks():
            n = len(plan.prompt_ids)
            tops = [[(comma, -0.25), (paris, -1.0)]] * (n - 1)
            yield Chunk("", [], [], 0.0, n, 0, "", prompt_ids=plan.prompt_ids,
                        prompt_logprobs=[-float("inf")] + [-1.0] * (n - 2),
                        prompt_top_logprobs=tops, prompt_ranks=[7] * (n - 1))
            yield Chunk(" Paris", [paris], [-0.5], -0.5, n, 1, "length") if \
                plan.params["max_tokens"] else Chunk("", [], [], 0.0, n, 0, "length")
        return chunks()

    client = TestClient(build_app(Served(MODEL, codec, CONTEXT, len(codec.tokenizer)), generate))
    body = post(client, "/v1/completions", {**completion(prompt_logprobs=1, max_tokens=0),
                                            "prompt": prompt}).json()
    assert plans[-1].params["prompt_logprobs"] == 1 and plans[-1].params["max_tokens"] == 0
    choice = body["choices"][0]
    assert choice["text"] == "" and choice["logprobs"] is None
    places = choice["prompt_logprobs"]
    assert len(places) == len(prompt) and places[0] is None
    assert places[1] == {str(prompt[1]): {"logprob": -9999.0, "rank": 7,
                                          "decoded_token": " capital"},
                         str(comma): {"logprob": -0.25, "rank": 1, "decoded_token": ","}}
    assert all(list(place) == [str(token), str(comma)] and place[str(token)]["logprob"] == -1.0
               for place, token in zip(places[2:], prompt[2:]))

    # special tokens as their text; pieces of a character ("🙂" as two tokens)
    # as "" but the last, the character (vLLM's _verify_tokens)
    start, smile = codec.tokenizer.convert_tokens_to_ids("<|im_start|>"), codec.encode("🙂")
    assert len(smile) == 2 and codec.decode(smile[:1]).endswith("\ufffd")
    ids = codec.encode("字") + [start] + smile
    body = post(client, "/v1/completions", {**completion(prompt_logprobs=0), "prompt": ids}).json()
    assert [place[str(token)]["decoded_token"] for place, token in
            zip(body["choices"][0]["prompt_logprobs"][1:], ids[1:])] == ["<|im_start|>", "", "🙂"]

    body = post(client, "/v1/completions", completion(prompt_logprobs=2, echo=True, logprobs=1,
                                                      max_tokens=1)).json()
    assert plans[-1].params["prompt_logprobs"] == 2 and plans[-1].params["num_top_logprobs"] == 1
    choice = body["choices"][0]
    assert choice["logprobs"]["top_logprobs"][1] == {",": -0.25,
                                                     codec.decode([prompt[1]]): -9999.0}
    assert [len(place) for place in choice["prompt_logprobs"][1:]] == [3] * count

    body = post(client, "/v1/chat/completions", chat(prompt_logprobs=0, max_tokens=1)).json()
    assert plans[-1].params["prompt_logprobs"] == 0
    assert "prompt_logprobs" not in body["choices"][0]
    assert len(body["prompt_logprobs"]) == len(plans[-1].prompt_ids)
    assert all(len(place) == 1 for place in body["prompt_logprobs"][1:])

    asked = len(plans)
    for fields, message in [
            (dict(prompt_logprobs=1, stream=True), "prompt_logprobs are not available when "
                                                   "stream is true"),
            (dict(prompt_logprobs=-1, stream=True), "not available when stream is true"),
            (dict(prompt_logprobs=-1), "prompt_logprobs must be an integer in \\[0, 20\\], got -1"),
            (dict(prompt_logprobs=21), "prompt_logprobs must be an integer in \\[0, 20\\], got 21"),
            (dict(max_tokens=0), "max_tokens must be an integer in \\[1, ")]:
        for path, body in (("/v1/completions", completion(**fields)),
                           ("/v1/chat/completions", chat(**fields))):
            response = post(client, path, body)
            assert response.status_code == 400, (path, fields)
            assert re.search(message, response.json()["error"]["message"]), response.json()
    assert len(plans) == asked
    streamed = events(post(client, "/v1/completions", completion(prompt_logprobs=0, stream=True)))
    assert "prompt_logprobs" not in plans[-1].params
    assert all("prompt_logprobs" not in event["choices"][0] for event in streamed)


def test_prompt_logprobs_decode_a_simulated_engines_wider_ids(codec):
    """The simulated engine's codec (ids past the tokenizer read " t<id>")
    gives prompt_logprobs' decoded tokens too, special tokens as their text."""
    from simple_sampler.serving.simulated_text import SimulatedCodec

    wide = SimulatedCodec(codec.tokenizer)
    vocab = len(codec.tokenizer) + 100

    def generate(plan):
        async def chunks():
            n = len(plan.prompt_ids)
            yield Chunk("", [], [], 0.0, n, 0, "length", prompt_ids=plan.prompt_ids,
                        prompt_logprobs=[-1.0] * (n - 1), prompt_ranks=[1] * (n - 1))
        return chunks()

    client = TestClient(build_app(Served(MODEL, wide, CONTEXT, vocab), generate))
    start = codec.tokenizer.convert_tokens_to_ids("<|im_start|>")
    ids = [5, vocab - 1, start]
    body = post(client, "/v1/completions", {**completion(prompt_logprobs=0, max_tokens=0),
                                            "prompt": ids}).json()
    assert [place[str(token)]["decoded_token"] for place, token in zip(
        body["choices"][0]["prompt_logprobs"][1:], ids[1:])] == [f" t{vocab - 1}", "<|im_start|>"]


def test_a_list_of_prompts_is_a_choice_each_as_vllm_answers_it(codec):
    """completions' prompt as a list of prompts: a generation each, at once;
    choice i is prompt i's, streamed or not, the usage summed (a stream's
    in one last event); one prompt refused fails the request and cancels
    the others' generations."""
    plans, closed, started = [], [], []

    def generate(plan):
        plans.append(plan)
        index = len(plans) - 1

        async def chunks():
            started.append(index)
            try:
                n = len(plan.prompt_ids)
                if plan.prompt_ids == codec.encode("refused"):
                    raise GenerationError("top_p must be in (0, 1]", "INVALID_ARGUMENT")
                yield Chunk(f" {index}", [3], [-0.5], -0.5, n, 1, "")
                if plan.prompt_ids == codec.encode("hangs"):
                    await asyncio.sleep(30)
                await asyncio.sleep(0.2 * (3 - index))  # the last prompt's end first
                yield Chunk(".", [4], [-0.25], -0.75, n, 2, "stop")
            finally:
                closed.append(index)
        return chunks()

    client = TestClient(build_app(Served(MODEL, codec, CONTEXT, len(codec.tokenizer)), generate))
    prompts = ["The capital of France is", "Once upon a time", "Hello"]
    body = post(client, "/v1/completions", completion(prompt=prompts)).json()
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, " 0.", "stop"), (1, " 1.", "stop"), (2, " 2.", "stop")]
    lengths = [len(codec.encode(p)) for p in prompts]
    assert body["usage"] == {"prompt_tokens": sum(lengths), "completion_tokens": 6,
                             "total_tokens": sum(lengths) + 6}
    assert len({plan.id for plan in plans}) == 1 and sorted(closed) == [0, 1, 2]

    plans.clear(), closed.clear(), started.clear()
    streamed = events(post(client, "/v1/completions", completion(
        prompt=prompts, stream=True, stream_options={"include_usage": True})))
    texts = {}
    for event in streamed[:-1]:
        (choice,) = event["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        assert event["usage"] is None
    assert texts == {0: " 0.", 1: " 1.", 2: " 2."}
    finals = [e["choices"][0]["index"] for e in streamed[:-1] if e["choices"][0]["finish_reason"]]
    assert finals[0] == 2 and finals[-1] == 0  # as they come: 400 ms apart
    assert streamed[-1]["choices"] == [] and streamed[-1]["usage"]["completion_tokens"] == 6
    assert sorted(closed) == [0, 1, 2]

    for stream in (False, True):
        plans.clear(), closed.clear(), started.clear()
        response = post(client, "/v1/completions", completion(
            prompt=["hangs", "refused", "Hello"], stream=stream))
        if stream:  # begun once one answered: the refusal is an event, then the end
            streamed = events(response)
            assert streamed[-1]["error"]["message"] == "top_p must be in (0, 1]"
        else:
            assert response.status_code == 400, response.text
            assert "top_p must be in (0, 1]" in response.json()["error"]["message"]
        assert sorted(started) == [0, 1, 2] and sorted(closed) == [0, 1, 2]
    plans.clear(), closed.clear(), started.clear()
    response = post(client, "/v1/completions", completion(prompt=["refused", "hangs"],
                                                          stream=True))
    assert response.status_code == 400  # refused before any answered: its status
    assert sorted(closed) == [0, 1]


def test_n_is_n_generations_each_with_its_own_seed(client, recorder):
    """OpenAI's n: n generations of each prompt, choice i * n + j the j-th
    of prompt i; with a seed, the j-th draws with seed + j (vLLM's)."""
    body = post(client, "/v1/chat/completions", chat(n=3, seed=5)).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [plan.params["seed"] for plan in recorder.plans] == [5, 6, 7]
    prompt = len(recorder.plans[0].prompt_ids)  # counted once, as vLLM and OpenAI count it
    assert body["usage"] == {"prompt_tokens": prompt, "completion_tokens": 6,
                             "total_tokens": prompt + 6}
    streamed = events(post(client, "/v1/chat/completions", chat(
        n=3, stream=True, stream_options={"include_usage": True})))
    assert streamed[-1]["usage"] == body["usage"]
    recorder.plans.clear()
    body = post(client, "/v1/completions", completion(prompt=["a", "b"], n=2,
                                                      seed=2**64 - 1)).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [(plan.prompt_ids, plan.params["seed"]) for plan in recorder.plans] == [
        (recorder.plans[0].prompt_ids, 2**64 - 1), (recorder.plans[0].prompt_ids, 0),
        (recorder.plans[2].prompt_ids, 2**64 - 1), (recorder.plans[2].prompt_ids, 0)]
    assert recorder.plans[0].prompt_ids != recorder.plans[2].prompt_ids
    recorder.plans.clear()
    post(client, "/v1/chat/completions", chat(n=2))
    assert len(recorder.plans) == 2 and not any("seed" in p.params for p in recorder.plans)


def test_a_stream_whose_client_goes_while_an_event_is_sent_is_closed_at_once():
    """Starlette leaves a stream's body suspended where sending an event
    fails (a client gone, ASGI 2.4), and its generations would run on until
    it is garbage collected; ClosingStreamingResponse closes it then."""
    from simple_sampler.frontend.streams import ClosingStreamingResponse

    async def main():
        closed, sent = [], []

        async def body():
            try:
                for _ in range(100):
                    yield b"data: x\n\n"
            finally:
                closed.append(True)

        async def receive():
            await asyncio.sleep(10)
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)
            if len(sent) == 3:
                raise OSError("the client went away")

        with pytest.raises((OSError, ClientDisconnect)):  # Starlette turns the one into the other
            await ClosingStreamingResponse(body())(
                {"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
        return closed  # before the loop's end finalizes what is left

    assert asyncio.run(main()) == [True]


def test_a_stream_whose_client_goes_before_it_starts_closes_its_generations():
    """A client gone before the response's start was sent: the events'
    generator never started, so its own finally never runs; on_close
    closes the generations all the same."""
    from simple_sampler.frontend.streams import ClosingStreamingResponse

    async def main():
        closed = []

        async def body():
            yield b"data: x\n\n"

        async def close_generations():
            closed.append(True)

        async def receive():
            await asyncio.sleep(10)
            return {"type": "http.disconnect"}

        async def send(message):
            raise OSError("the client went away")

        with pytest.raises((OSError, ClientDisconnect)):  # Starlette turns the one into the other
            await ClosingStreamingResponse(body(), on_close=close_generations)(
                {"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
        return closed

    assert asyncio.run(main()) == [True]


def test_a_generation_that_cancels_itself_ends_the_merged_responses():
    """A generation raising CancelledError of its own (grpc.aio's, for a call
    whose channel closed) ends the merged responses with EndedEarly, where a
    reader that waited for it would wait forever."""
    from simple_sampler.frontend.streams import EndedEarly, merged

    async def main():
        async def going():
            yield Chunk(" a", [3], [-0.5], -0.5, 1, 1, "")
            await asyncio.sleep(10)
            yield Chunk(".", [4], [-0.5], -1.0, 1, 2, "stop")

        async def cancelled():
            yield Chunk(" b", [3], [-0.5], -0.5, 1, 1, "")
            raise asyncio.CancelledError

        seen = []
        with pytest.raises(EndedEarly):
            async for index, chunk in merged([going(), cancelled()]):
                seen.append((index, chunk.text))
        return seen

    assert asyncio.run(asyncio.wait_for(main(), 5)) == [(0, " a"), (1, " b")]


def events(response):
    lines = [line for line in response.text.split("\n\n") if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def test_a_stream_is_server_sent_events_ending_with_done(client, recorder):
    response = post(client, "/v1/chat/completions",
                    chat(stream=True, stream_options={"include_usage": True}))
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks = events(response)
    assert [c["object"] for c in chunks] == ["chat.completion.chunk"] * 3
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": " Paris"}
    assert chunks[1]["choices"][0]["delta"] == {"content": "."}
    assert [c["choices"][0]["finish_reason"] for c in chunks[:2]] == [None, "stop"]
    assert chunks[2]["choices"] == [] and chunks[2]["usage"]["completion_tokens"] == 2
    assert recorder.plans[0].stream and recorder.closed == 1
    text = "".join(c["choices"][0]["text"] for c in events(
        post(client, "/v1/completions", completion(stream=True))))
    assert text == " Paris."


@pytest.mark.parametrize("status,http,kind", [
    ("INVALID_ARGUMENT", 400, "invalid_request_error"),
    ("UNAVAILABLE", 503, "service_unavailable"),
    ("INTERNAL", 500, "internal_server_error")])
@pytest.mark.parametrize("stream", [False, True])
def test_triton_errors_keep_their_meaning(client, recorder, status, http, kind, stream):
    recorder.error = GenerationError("end_id must be a token id in [0, 49152), got 99999",
                                     status)
    response = post(client, "/v1/chat/completions", chat(stream=stream))
    assert response.status_code == http
    assert response.json()["error"]["type"] == kind
    assert "end_id must be" in response.json()["error"]["message"]
    assert recorder.closed == 1


def test_models_and_health(client):
    card = client.get("/v1/models").json()["data"][0]
    assert card["id"] == card["root"] == MODEL and card["parent"] is None
    assert card["max_model_len"] == CONTEXT
    assert client.get("/health").status_code == 200
    assert client.get("/ping").status_code == client.post("/ping").status_code == 200
    assert client.get("/version").json() == {"version": importlib.metadata.version("simple-sampler")}


def test_ping_is_health_and_says_when_the_model_is_not_ready(codec, recorder):
    async def not_ready():
        return False

    app = build_app(Served(MODEL, codec, CONTEXT, len(codec.tokenizer)), recorder.generate,
                    ready=not_ready)
    client = TestClient(app)
    assert [client.get("/health").status_code, client.get("/ping").status_code,
            client.post("/ping").status_code] == [503] * 3


def test_metrics_are_tritons_at_the_doors_metrics_where_vllm_serves_its_own(codec, recorder):
    """/metrics on the API's port: Triton's Prometheus text as it comes
    (a 503 when its endpoint does not answer); no route without one."""
    texts = ["# TYPE nv_inference_count counter\nnv_inference_count 3\n", None]

    async def metrics():
        return texts.pop(0)

    served = Served(MODEL, codec, CONTEXT, len(codec.tokenizer))
    client = TestClient(build_app(served, recorder.generate, metrics=metrics))
    answer = client.get("/metrics")
    assert answer.status_code == 200 and answer.text.endswith("nv_inference_count 3\n")
    assert answer.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert client.get("/metrics").status_code == 503
    assert TestClient(build_app(served, recorder.generate)).get("/metrics").status_code == 404


@pytest.mark.parametrize("message, status", [
    (f"{SHUTTING_DOWN}: the request did not finish within the 2 s grace period", "UNAVAILABLE"),
    ("RuntimeError: the sampler failed", "INTERNAL")])
def test_a_stream_error_without_status_is_a_shutdown_or_ours(message, status):
    """gRPC streams carry an error's text only; the backend names its status."""
    class Failing:
        async def stream(self, prompt_ids, **params):
            yield Chunk("a", [1], [], 0.0, 1, 1, "")
            raise GenerationError(message)

    backend = TritonBackend("127.0.0.1:1")
    backend.client = Failing()
    plan = Plan(True, [1], {"max_tokens": 4}, True, False, False)

    async def drain():
        return [chunk async for chunk in backend.generate(plan)]

    with pytest.raises(GenerationError) as raised:
        asyncio.run(drain())
    assert raised.value.status == status and str(raised.value) == message


@pytest.mark.parametrize("model, engine, expected", [
    ("", "torch", "SmolLM2-135M-Instruct"),
    ("/m/SmolLM2-1.7B.gguf", "torch", "SmolLM2-1.7B"),
    ("/m/Qwen2.5-1.5B-Instruct.Q8_0.gguf", "torch", "Qwen2.5-1.5B-Instruct"),
    ("/m/Qwen2.5-0.5B-Instruct-Q8_0.gguf", "torch", "Qwen2.5-0.5B-Instruct-Q8_0"),
    ("/m/llama.IQ2_XS.gguf", "torch", "llama"),
    ("/m/Llama-3.2-1B", "torch", "Llama-3.2-1B"),
    ("", "simulated", "simulated-SmolLM2-135M-Instruct")])
def test_the_model_id_is_the_models_name_whole(model, engine, expected):
    """A dot inside a GGUF file's name (a version, a size) stays in its id;
    only .gguf and a quantization tag before it go."""
    from simple_sampler.frontend.backend import model_id
    from simple_sampler.settings import LlmSettings

    assert model_id(LlmSettings(model=model, engine=engine)) == expected


def test_only_the_frontend_imports_fastapi_and_uvicorn():
    import ast
    from pathlib import Path

    import simple_sampler

    root = Path(simple_sampler.__file__).parent
    importers = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(name.split(".")[0] in ("fastapi", "starlette", "uvicorn") for name in names):
                importers.add(path.relative_to(root).parts[0])
    assert importers == {"frontend"}


def test_what_vllm_and_benchmark_clients_send_is_served(client, recorder, codec):
    """A completions prompt as a list of one (genai-perf sends [text],
    lm-eval [[ids]]); vLLM's ignore_eos and stop_token_ids, best_of 1, a message's name, a
    negative seed (read modulo 2^64, as torch.manual_seed reads vLLM's; -1 none),
    include_usage null; a default max_tokens shortened to the context left,
    and a sent one too, up to the whole context (vLLM 0.32's bound)."""
    for prompt in (["The capital of France is"], [codec.encode("The capital of France is")]):
        assert post(client, "/v1/completions", completion(prompt=prompt, best_of=1,
                                                          ignore_eos=True)).status_code == 200
        assert recorder.plans[-1].prompt_ids == codec.encode("The capital of France is")
        assert recorder.plans[-1].params["ignore_eos"] is True
    response = post(client, "/v1/chat/completions", chat(
        messages=[{"role": "user", "content": "Hi", "name": "ada"}], seed=-2**63,
        stream=True, stream_options={"include_usage": None}))
    assert response.status_code == 200
    assert recorder.plans[-1].params["seed"] == 2**63
    assert "ignore_eos" not in recorder.plans[-1].params
    # vLLM's -1: no seed, a random draw
    assert post(client, "/v1/chat/completions", chat(seed=-1)).status_code == 200
    assert "seed" not in recorder.plans[-1].params
    # top_logprobs 0 asks for nothing: taken without logprobs, as vLLM takes it
    assert post(client, "/v1/chat/completions", chat(top_logprobs=0)).status_code == 200
    assert post(client, "/v1/completions", completion(prompt=[1] * 500)).status_code == 200
    assert recorder.plans[-1].params["max_tokens"] == CONTEXT - 500
    for sent in (100, CONTEXT):
        for body in (completion(prompt=[1] * 500, max_tokens=sent),
                     chat(messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=sent)):
            path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
            assert post(client, path, body).status_code == 200
            plan = recorder.plans[-1]
            assert plan.params["max_tokens"] == min(sent, CONTEXT - len(plan.prompt_ids))
    assert post(client, "/v1/chat/completions", chat(stop_token_ids=[7, 2],
                                                     include_stop_str_in_output=True)).status_code == 200
    assert recorder.plans[-1].params["stop_token_ids"] == [7, 2]
    assert recorder.plans[-1].params["include_stop_str_in_output"] is True


def test_a_developer_turn_is_a_system_turn_where_the_template_names_no_developer(
        client, recorder, codec):
    """As vLLM 0.32 renders it (vllm/renderers/hf.py): SmolLM2's template
    has no developer role, so the turn is a system turn, and the system
    turns are merged into one at the start; a template naming the role
    gets the turns as sent."""
    from simple_sampler.frontend.chat import developer_as_system

    def sent(*turns):
        assert post(client, "/v1/chat/completions", chat(messages=list(turns))).status_code == 200
        return recorder.plans[-1].prompt_ids

    user = {"role": "user", "content": "Hi"}
    assert sent({"role": "developer", "content": "Be brief."}, user) == codec.encode_chat(
        [{"role": "system", "content": "Be brief."}, user])
    assert sent({"role": "system", "content": "A"}, user,
                {"role": "developer", "content": "B"}) == codec.encode_chat(
        [{"role": "system", "content": "A\n\nB"}, user])
    turns = [{"role": "developer", "content": "B"}, user]
    assert developer_as_system(turns, "{% if m.role == 'developer' %}") == turns


def test_continuous_usage_counts_every_chunks_tokens(client):
    response = post(client, "/v1/chat/completions", chat(stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True}))
    chunks = events(response)
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 2]
    assert chunks[0]["usage"]["total_tokens"] == chunks[0]["usage"]["prompt_tokens"] + 1


def test_one_model_is_retrieved_by_its_id(client):
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    response = client.get("/v1/models/other")
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"


def test_a_token_past_the_tokenizer_has_bytes_and_text(codec):
    """Ids a model's rows have beyond its tokenizer (a padded lm_head, the
    simulated engine's wider rows): no bytes of their own, never an error."""
    from simple_sampler.serving.simulated_text import SimulatedCodec

    beyond = len(codec.tokenizer)
    assert codec.token_bytes(beyond) == b""
    assert SimulatedCodec(codec.tokenizer).token_bytes(beyond) == f" t{beyond}".encode()


def test_a_failure_of_ours_mid_stream_still_ends_it_with_an_error_and_done(codec):
    def generate(plan):
        async def chunks():
            yield Chunk(" Paris", [3], [-0.5], -0.5, 1, 1, "")
            raise KeyError("boom")
        return chunks()

    client = TestClient(build_app(Served(MODEL, codec, CONTEXT, len(codec.tokenizer)), generate))
    response = post(client, "/v1/chat/completions", chat(stream=True))
    chunks = events(response)  # ends with [DONE]
    assert "KeyError" in chunks[-1]["error"]["message"]


def test_a_request_is_planned_off_the_event_loop(client, monkeypatch):
    """Tokenizing a long prompt must not hold the other requests' streams."""
    recording, planned_on_loop = on_loop_recorder(translate.plan_chat)
    monkeypatch.setattr(translate, "plan_chat", recording)
    assert post(client, "/v1/chat/completions", chat()).status_code == 200
    assert planned_on_loop == [False]


def test_a_client_gone_before_its_first_token_cancels_its_generation(codec):
    """A streamed request queued behind a full batch: its client leaves
    before any token, and its generation is cancelled then (499), not once
    its first token comes."""
    cancelled = asyncio.Event()

    def generate(plan):
        async def chunks():
            try:
                await asyncio.sleep(60)  # no token yet
                yield Chunk("never", [3], [], 0.0, 1, 1, "stop")
            finally:
                cancelled.set()
        return chunks()

    app = build_app(Served(MODEL, codec, CONTEXT, len(codec.tokenizer)), generate)
    body = json.dumps(chat(stream=True)).encode()
    sent = []

    async def main():
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        gone_at = time.monotonic() + 0.3

        async def receive():  # as uvicorn's: a disconnect is there at once, once it came
            if messages:
                return messages.pop(0)
            if time.monotonic() < gone_at:
                await asyncio.sleep(60)
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/chat/completions",
                 "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "",
                 "headers": [(b"content-type", b"application/json")],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
        await asyncio.wait_for(app(scope, receive, send), 10)
        return cancelled.is_set()

    assert asyncio.run(main())
    assert sent[0]["status"] == 499


def test_a_failure_of_ours_is_a_500_logged_once_with_its_traceback(codec, caplog):
    def generate(plan):
        async def chunks():
            raise KeyError("boom")
            yield  # an async generator
        return chunks()

    client = TestClient(build_app(Served(MODEL, codec, CONTEXT, len(codec.tokenizer)), generate))
    with caplog.at_level("ERROR"):
        response = post(client, "/v1/chat/completions", chat())
    assert response.status_code == 500 and "KeyError" in response.json()["error"]["message"]
    failures = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(failures) == 1 and failures[0].exc_info is not None


@pytest.mark.parametrize("path, body", [("/v1/completions", completion()),
                                        ("/v1/chat/completions", chat())])
def test_the_stop_reason_is_vllms_on_the_last_choice(codec, path, body):
    """vLLM's stop_reason: the stop string or token id the llm model says
    ended the generation (its stop_reason output), null before the end."""
    def generate(plan):
        async def chunks():
            n = len(plan.prompt_ids)
            yield Chunk(" Paris", [3], [-0.5], -0.5, n, 1, "")
            yield Chunk("", [4], [-0.25], -0.75, n, 2, "stop", stop_reason="END")
        return chunks()

    client = TestClient(build_app(Served(MODEL, codec, CONTEXT, len(codec.tokenizer)), generate))
    [choice] = post(client, path, {**body, "stop": "END"}).json()["choices"]
    assert choice["stop_reason"] == "END" and choice["finish_reason"] == "stop"
    streamed = [c["choices"][0] for c in events(post(client, path, {**body, "stream": True}))
                if c["choices"]]
    assert [c["stop_reason"] for c in streamed] == [None] * (len(streamed) - 1) + ["END"]


def test_bad_words_go_as_vllms_parameter_beside_stop(client, recorder):
    """vLLM's bad_words travel in sampling_parameters, where the llm model
    encodes them as vLLM does (each word also after a space: TextCodec.
    words_ids); an empty word is a 400 naming the field, none sends none."""
    assert post(client, "/v1/chat/completions",
                chat(stop=".", bad_words=["Paris", " Lyon"])).status_code == 200
    assert json.loads(recorder.plans[-1].params["sampling_parameters"]) == {
        "stop": ["."], "bad_words": ["Paris", " Lyon"]}
    assert post(client, "/v1/completions", completion(bad_words=[])).status_code == 200
    assert "sampling_parameters" not in recorder.plans[-1].params
    for path, body in (("/v1/chat/completions", chat(bad_words=["x", ""])),
                       ("/v1/completions", completion(bad_words="x")),
                       ("/v1/completions", completion(bad_words=["  "])),  # no token
                       ("/v1/chat/completions", chat(bad_words=[f"w{i}" for i in range(65)]))):
        error = post(client, path, body).json()["error"]
        assert error["param"] == "bad_words", error


def test_return_token_ids_gives_the_prompts_and_the_answers_ids_where_vllm_does(client, recorder):
    """vLLM's return_token_ids: a choice's token_ids (generated, an echo's
    prompt not among them) and prompt_token_ids (chat: the answer's, as
    its prompt_logprobs); a stream's chunks each their tokens, the first
    the prompt's; never present unless asked."""
    body = post(client, "/v1/chat/completions", chat(return_token_ids=True)).json()
    prompt = recorder.plans[-1].prompt_ids
    assert body["prompt_token_ids"] == prompt and body["choices"][0]["token_ids"] == [3, 4]
    body = post(client, "/v1/completions", completion(return_token_ids=True, echo=True,
                                                      n=2)).json()
    prompt = recorder.plans[-1].prompt_ids
    assert [(c["prompt_token_ids"], c["token_ids"]) for c in body["choices"]] == [
        (prompt, [3, 4])] * 2
    assert "prompt_token_ids" not in body
    streamed = events(post(client, "/v1/chat/completions",
                           chat(return_token_ids=True, stream=True)))
    assert [(e.get("prompt_token_ids"), e["choices"][0]["token_ids"]) for e in streamed] == [
        (recorder.plans[-1].prompt_ids, [3]), (None, [4])]
    streamed = events(post(client, "/v1/completions",
                           completion(return_token_ids=True, stream=True, n=2)))
    firsts = {}
    for event in streamed:
        choice = event["choices"][0]
        firsts.setdefault(choice["index"], choice.get("prompt_token_ids"))
        assert choice["token_ids"] in ([3], [4]) and "prompt_token_ids" not in event
    assert firsts == {0: recorder.plans[-1].prompt_ids, 1: recorder.plans[-1].prompt_ids}
    for path, body in (("/v1/chat/completions", chat()), ("/v1/completions", completion())):
        answer = post(client, path, body).json()
        assert "prompt_token_ids" not in answer and "token_ids" not in answer["choices"][0]


def test_return_tokens_as_token_ids_names_each_logprobs_token_by_its_id(codec):
    """vLLM's return_tokens_as_token_ids: "token_id:N" wherever the
    logprobs name a token (chat's token and top_logprobs, completions'
    tokens and top_logprobs' keys, an echoed prompt's); chat's bytes stay
    the token's own."""
    paris, comma = codec.encode(" Paris")[0], codec.encode(",")[0]

    def generate(plan):
        async def chunks():
            n = len(plan.prompt_ids)
            if plan.params.get("prompt_logprobs"):
                yield Chunk("", [], [], 0.0, n, 0, "", [], plan.prompt_ids,
                            [-1.0] * (n - 1), [[(comma, -0.5)]] * (n - 1), [2] * (n - 1))
            yield Chunk(" Paris", [paris], [-0.5], -0.5, n, 1, "stop",
                        [[(paris, -0.5), (comma, -1.5)]])
        return chunks()

    client = TestClient(build_app(Served(MODEL, codec, CONTEXT, len(codec.tokenizer)), generate))
    body = post(client, "/v1/chat/completions", chat(
        logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True)).json()
    (token,) = body["choices"][0]["logprobs"]["content"]
    assert token["token"] == f"token_id:{paris}" and bytes(token["bytes"]) == b" Paris"
    assert [t["token"] for t in token["top_logprobs"]] == [f"token_id:{paris}",
                                                          f"token_id:{comma}"]
    logprobs = post(client, "/v1/completions", completion(
        logprobs=1, echo=True, return_tokens_as_token_ids=True)).json()["choices"][0]["logprobs"]
    prompt = codec.encode("The capital of France is")
    assert logprobs["tokens"] == [f"token_id:{t}" for t in [*prompt, paris]]
    assert logprobs["top_logprobs"][1] == {f"token_id:{comma}": -0.5,
                                           f"token_id:{prompt[1]}": -1.0}
    assert logprobs["top_logprobs"][-1] == {f"token_id:{paris}": -0.5, f"token_id:{comma}": -1.5}
    plain = post(client, "/v1/completions", completion(logprobs=1)).json()
    assert plain["choices"][0]["logprobs"]["tokens"] == [" Paris"]


def test_vllms_envelope_fields_set_the_id_the_chunking_and_echo(client, recorder, codec):
    """vLLM's request_id names the answer (an X-Request-Id header before
    it); stream_interval is raised to the server's and sent only with a
    stream; chat's echo starts the answer with a last assistant turn's
    content; return_prompt_text gives the template's text; documents reach
    the template; priority 0, session_id and cache_salt change nothing."""
    body = post(client, "/v1/chat/completions", chat(request_id="abc", n=2)).json()
    assert body["id"] == "chatcmpl-abc"
    response = client.post("/v1/completions", content=json.dumps(completion(request_id="abc")),
                           headers={"Content-Type": "application/json", "X-Request-Id": "hdr"})
    assert response.json()["id"] == "cmpl-hdr"
    streamed = events(post(client, "/v1/completions", completion(request_id="s", stream=True)))
    assert {e["id"] for e in streamed} == {"cmpl-s"}
    slow = TestClient(build_app(Served(MODEL, codec, CONTEXT, len(codec.tokenizer),
                                       stream_interval=4), recorder.generate))
    for interval, stream, sent in ((2, True, 4), (8, True, 8), (8, False, None)):
        assert post(slow, "/v1/completions", completion(stream_interval=interval,
                                                        stream=stream)).status_code == 200
        assert recorder.plans[-1].params.get("stream_interval") == sent
    turns = [{"role": "user", "content": "Capital of France?"},
             {"role": "assistant", "content": "The capital is"}]
    prefill = dict(messages=turns, add_generation_prompt=False, continue_final_message=True)
    body = post(client, "/v1/chat/completions", chat(**prefill, echo=True)).json()
    assert body["choices"][0]["message"]["content"] == "The capital is Paris."
    streamed = events(post(client, "/v1/chat/completions", chat(**prefill, echo=True,
                                                                stream=True)))
    assert streamed[0]["choices"][0]["delta"]["content"] == "The capital is Paris"
    plain = post(client, "/v1/chat/completions", chat(echo=True)).json()  # a user's turn last
    assert plain["choices"][0]["message"]["content"] == " Paris."
    user = [{"role": "user", "content": "The capital of France is"}]  # continued: vLLM's role
    body = post(client, "/v1/chat/completions", chat(
        messages=user, add_generation_prompt=False, continue_final_message=True, echo=True)).json()
    assert body["choices"][0]["message"]["content"] == "The capital of France is Paris."
    tools = [{"type": "function", "function": {"name": "f"}}]
    body = post(client, "/v1/chat/completions", chat(**prefill, echo=True, tools=tools,
                                                     tool_choice="none")).json()
    assert body["choices"][0]["message"]["content"] == "The capital is Paris."
    body = post(client, "/v1/chat/completions", chat(return_prompt_text=True)).json()
    assert codec.tokenize(body["prompt_text"], False) == recorder.plans[-1].prompt_ids
    assert "<|im_start|>user\nCapital of France?" in body["prompt_text"]
    streamed = events(post(client, "/v1/chat/completions",
                           chat(return_prompt_text=True, stream=True)))
    assert [("prompt_text" in e) for e in streamed] == [True, False]
    rag = copy.copy(codec)
    rag.tokenizer = copy.copy(codec.tokenizer)
    rag.tokenizer.chat_template = "{% for d in documents %}[{{ d.text }}]{% endfor %}{{ messages[0].content }}"
    with_documents = TestClient(build_app(Served(MODEL, rag, CONTEXT, len(codec.tokenizer)),
                                          recorder.generate))
    post(with_documents, "/v1/chat/completions", chat(documents=[{"title": "t", "text": "x"}]))
    assert recorder.plans[-1].prompt_ids == codec.tokenize("[x]Capital of France?", False)
    assert post(client, "/v1/completions", completion(
        priority=0, session_id="s", cache_salt="salt")).status_code == 200


@pytest.mark.parametrize("fields, param", [
    ({"priority": 1}, "priority"), ({"cache_salt": ""}, "cache_salt"),
    ({"cache_salt": "x" * 129}, "cache_salt"), ({"cache_salt": "a/b"}, "cache_salt"),
    ({"stream_interval": 0}, "stream_interval"),
    ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
    ({"echo": True, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": "required"}, "echo")])
def test_vllms_envelope_fields_out_of_range_are_400s_naming_them(client, fields, param):
    response = post(client, "/v1/chat/completions", chat(**fields))
    assert response.status_code == 400 and response.json()["error"]["param"] == param, \
        response.text


def test_truncation_side_right_keeps_the_prompts_first_tokens(client, recorder, codec):
    """vLLM's truncation_side with truncate_prompt_tokens k: "right" sends
    the prompt's first k tokens, "left" its last k (the default's, here
    where the tokenizer adds no special token), text or ids, and a chat's
    templated text likewise."""
    text = "The capital of France is"
    ids = codec.encode(text)
    for side, kept in (("right", ids[:3]), ("left", ids[-3:]), (None, ids[-3:])):
        for prompt in (text, ids):
            post(client, "/v1/completions", completion(prompt=prompt, truncate_prompt_tokens=3,
                                                       truncation_side=side))
            assert recorder.plans[-1].prompt_ids == kept, (side, prompt)
    post(client, "/v1/chat/completions", chat(truncate_prompt_tokens=4, truncation_side="right"))
    assert recorder.plans[-1].prompt_ids == codec.encode("Capital of France?", chat=True)[:4]
    response = post(client, "/v1/completions", completion(truncation_side="middle"))
    assert response.status_code == 400 and response.json()["error"]["param"] == "truncation_side"
