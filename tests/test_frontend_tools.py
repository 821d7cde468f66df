"""Tool calls at the OpenAI door (frontend/tools.py), over a scripted
generation: tool_choice none, a named function and required, their
grammars, their answers streamed and not, their refusals in vLLM's words,
and conversations with calls through the chat template."""
import json

import pytest
from fastapi.testclient import TestClient

from simple_sampler.client import Chunk
from simple_sampler.frontend.app import build_app
from simple_sampler.frontend.tools import template_messages
from simple_sampler.frontend.protocol import ChatMessage
from simple_sampler.frontend.translate import Served

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
CALLS = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", ' \
        '"parameters": {}}]'


class Scripted:
    """generate(plan): the script's pieces, one response each, the last
    ending with `finish`; every plan kept."""

    def __init__(self):
        self.plans, self.script, self.finish = [], ['{"city": ', '"Paris"}'], "stop"

    def generate(self, plan):
        self.plans.append(plan)

        async def chunks():
            for i, text in enumerate(self.script):
                last = i == len(self.script) - 1
                yield Chunk(text, [5 + i], [-0.5], -0.5 * (i + 1), len(plan.prompt_ids), i + 1,
                            self.finish if last else "")
        return chunks()


@pytest.fixture
def scripted():
    return Scripted()


@pytest.fixture
def client(codec, scripted):
    return TestClient(build_app(Served(MODEL, codec, 512, len(codec.tokenizer)),
                                scripted.generate))


def chat(**fields):
    return {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}],
            **fields}


def post(client, body):
    return client.post("/v1/chat/completions", content=json.dumps(body),
                       headers={"Content-Type": "application/json"})


def events(response) -> list[dict]:
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_a_named_function_is_its_parameters_schema_and_answers_one_call(client, scripted):
    answer = post(client, chat(tools=[WEATHER, CLOCK], tool_choice=NAMED))
    assert answer.status_code == 200, answer.text
    params = scripted.plans[0].params
    assert params["guided_decoding_guide_type"] == "json_schema"
    assert json.loads(params["guided_decoding_guide"]) == WEATHER["function"]["parameters"]
    choice = answer.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == ""
    [call] = choice["message"]["tool_calls"]
    assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_a_named_function_streams_its_arguments_as_they_come(client):
    """Two choices (n 2): each choice's call is its first (index 0, as
    OpenAI numbers a call within its choice), its id, type and name in its
    first delta alone; the openai client's own accumulator joins them."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    answer = client.post("/v1/chat/completions", content=json.dumps(
        chat(tools=[WEATHER], tool_choice=NAMED, stream=True, n=2)),
        headers={"Content-Type": "application/json"})
    chunks = events(answer)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        deltas = [choice["delta"]["tool_calls"][0] for choice in mine]
        assert deltas[0]["id"].startswith("chatcmpl-tool-") and deltas[0]["type"] == "function"
        assert {d["index"] for d in deltas} == {0} and mine[0]["delta"]["role"] == "assistant"
        assert deltas[0]["function"]["name"] == "get_weather"
        assert all("id" not in d and "name" not in d["function"] for d in deltas[1:])
        assert "".join(d["function"]["arguments"] for d in deltas) == '{"city": "Paris"}'
        assert mine[-1]["finish_reason"] == "stop"
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    calls = [c.message.tool_calls[0].function for c in state.get_final_completion().choices]
    assert [(f.name, f.arguments) for f in calls] == [("get_weather", '{"city": "Paris"}')] * 2


@pytest.mark.parametrize("parallel", [None, False])
def test_required_is_an_array_of_the_tools_calls(client, scripted, parallel):
    scripted.script = [CALLS[:30], CALLS[30:]]
    answer = post(client, chat(tools=[WEATHER, CLOCK], tool_choice="required",
                               **({} if parallel is None else {"parallel_tool_calls": parallel})))
    assert answer.status_code == 200, answer.text
    schema = json.loads(scripted.plans[0].params["guided_decoding_guide"])
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert schema.get("maxItems") == (1 if parallel is False else None)
    names = [c["properties"]["name"]["enum"] for c in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object",
                                                                       "properties": {}}
    assert answer.json()["choices"][0]["finish_reason"] == "tool_calls"  # vLLM's, as auto's
    calls = answer.json()["choices"][0]["message"]["tool_calls"]
    expected = [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        expected[:1 if parallel is False else 2]


def test_required_streamed_gives_its_calls_whole_at_the_end(client, scripted):
    """With the logprobs of every token of the answer, as unstreamed."""
    scripted.script = [CALLS[:30], CALLS[30:]]
    body = chat(tools=[WEATHER, CLOCK], tool_choice="required", logprobs=True)
    answer = client.post("/v1/chat/completions", content=json.dumps({**body, "stream": True}),
                         headers={"Content-Type": "application/json"})
    [last] = events(answer)
    calls = last["choices"][0]["delta"]["tool_calls"]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather"),
                                                                    (1, "get_time")]
    assert last["choices"][0]["finish_reason"] == "tool_calls"
    whole = post(client, body).json()["choices"][0]
    assert len(last["choices"][0]["logprobs"]["content"]) == len(whole["logprobs"]["content"]) == 2


@pytest.mark.parametrize("finish, param", [("length", "max_tokens"), ("stop", "stop")])
def test_required_cut_short_is_a_400_naming_what_cut_it(client, scripted, finish, param):
    scripted.script, scripted.finish = [CALLS[:30]], finish
    answer = post(client, chat(tools=[WEATHER], tool_choice="required", max_tokens=8))
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param
    streamed = client.post("/v1/chat/completions", content=json.dumps(
        chat(tools=[WEATHER], tool_choice="required", max_tokens=8, stream=True)),
        headers={"Content-Type": "application/json"})
    [error] = events(streamed)
    assert error["error"]["param"] == param, error


def test_none_answers_in_text_with_the_tools_in_the_template(client, scripted, codec):
    answer = post(client, chat(tools=[WEATHER], tool_choice="none"))
    assert answer.json()["choices"][0]["message"]["content"] == '{"city": "Paris"}'
    assert "guided_decoding_guide_type" not in scripted.plans[0].params
    assert scripted.plans[0].prompt_ids == codec.encode_chat(
        [{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER])


def test_a_conversation_with_calls_and_their_answers_reaches_the_template(client, scripted,
                                                                          codec):
    turns = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "call-1", "type": "function",
                  "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
             {"role": "tool", "content": "sunny", "tool_call_id": "call-1"}]
    answer = post(client, {"model": MODEL, "messages": turns, "tools": [WEATHER],
                           "tool_choice": "none"})
    assert answer.status_code == 200, answer.text
    messages = template_messages([ChatMessage(**turn) for turn in turns])
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[1]["content"] == "" and messages[2]["tool_call_id"] == "call-1"
    assert scripted.plans[0].prompt_ids == codec.encode_chat(messages, tools=[WEATHER])


def test_the_openai_clients_own_assistant_message_replays(client, scripted):
    """A message as ChatCompletionMessage.model_dump() writes it: its null
    refusal, annotations, audio and function_call are taken."""
    replayed = {"role": "assistant", "content": None, "refusal": None, "annotations": None,
                "audio": None, "function_call": None, "tool_calls": [
                    {"id": "call-1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    turns = [{"role": "user", "content": "Weather in Paris?"}, replayed,
             {"role": "tool", "content": "sunny", "tool_call_id": "call-1"}]
    answer = post(client, {"model": MODEL, "messages": turns, "tools": [WEATHER],
                           "tool_choice": "none"})
    assert answer.status_code == 200, answer.text


@pytest.mark.parametrize("turn, param, text", [
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
      "function": {"name": "get_weather", "arguments": "{city"}}]},
     "messages.1.tool_calls.0.function.arguments", "must be a JSON object"),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
      "function": {"name": "get_weather", "arguments": "[1]"}}]},
     "messages.1.tool_calls.0.function.arguments", "must be a JSON object, got '[1]'"),
    ({"role": "user", "content": None}, "messages.1.content", "may be null only"),
    ({"role": "assistant", "content": "x", "refusal": "no"}, "messages.1.refusal",
     "unknown field"),
])
def test_a_turn_that_cannot_reach_the_template_is_a_400_naming_it(client, scripted, turn,
                                                                 param, text):
    turns = [{"role": "user", "content": "Weather in Paris?"}, turn]
    answer = post(client, {"model": MODEL, "messages": turns, "tools": [WEATHER],
                           "tool_choice": "none"})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and text in error["message"], error
    assert scripted.plans == []


@pytest.mark.parametrize("fields, param, text", [
    ({"tools": []}, "tools", "must not be an empty array"),
    ({"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
    ({"tools": [WEATHER]}, "tool_choice", '"auto" tool choice needs a tool call parser'),
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "needs a tool call parser"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice", "does not match any of the specified `tools`"),
    ({"tools": [WEATHER], "tool_choice": NAMED, "response_format": {"type": "json_object"}},
     "tool_choice", "cannot be given with response_format"),
    ({"tools": [WEATHER], "tool_choice": "required", "ignore_eos": True}, "ignore_eos",
     "its grammar ends the answer"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "$defs": {"a": {"type": "string"}}}}}, {"type": "function", "function": {
            "name": "g", "parameters": {"$defs": {"a": {"type": "integer"}}}}}],
      "tool_choice": "required"}, "tools", "has multiple schemas"),
    ({"tools": [{"type": "function"}]}, "tools.0.function", "is required"),
])
def test_a_tool_request_that_cannot_be_served_is_a_400_naming_the_field(client, scripted,
                                                                        fields, param, text):
    answer = post(client, chat(**fields))
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and text in error["message"], error
    assert scripted.plans == []


# tool_choice auto, over `serve --tool-call-parser hermes`

HERMES = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
          '</tool_call>')


@pytest.fixture
def hermes(codec, scripted):
    return TestClient(build_app(Served(MODEL, codec, 512, len(codec.tokenizer),
                                       tool_parser="hermes"), scripted.generate))


@pytest.mark.parametrize("choice", [{"tool_choice": "auto"}, {}])
def test_auto_parses_hermes_calls_out_of_the_free_answer(hermes, scripted, choice):
    scripted.script = [HERMES[:20], HERMES[20:]]
    answer = post(hermes, chat(tools=[WEATHER], **choice))
    assert answer.status_code == 200, answer.text
    assert not any(k.startswith("guided") for k in scripted.plans[0].params)
    choice = answer.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check."
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


@pytest.mark.parametrize("fields, sent", [({"tool_choice": "auto"}, False), ({}, False),
                                           ({"skip_special_tokens": True}, None),
                                           ({"skip_special_tokens": False}, False),
                                           ({"tool_choice": "none"}, None)])
def test_auto_keeps_special_tokens_in_the_text_unless_the_client_says(hermes, scripted, fields,
                                                                       sent):
    """With the Hermes parser, auto asks for special tokens' text (a
    tokenizer may make <tool_call> one), as vLLM's parser does, but not over
    the client's own skip_special_tokens; none leaves the default."""
    scripted.script = [HERMES]
    assert post(hermes, chat(tools=[WEATHER], **fields)).status_code == 200
    assert scripted.plans[0].params.get("skip_special_tokens") is sent


@pytest.mark.parametrize("text", ["Sunny, I think.", '<tool_call>{"name": "get_weather", oops'])
def test_auto_without_a_call_that_parses_is_the_text(hermes, scripted, text):
    scripted.script = [text]
    message = post(hermes, chat(tools=[WEATHER], tool_choice="auto")).json()["choices"][0]
    assert message["finish_reason"] == "stop" and message["message"]["content"] == text
    assert "tool_calls" not in message["message"]


def test_auto_streams_the_text_before_a_call_and_the_calls_at_the_end(hermes, scripted):
    """The tag split across pieces: a piece that may begin it waits; the
    openai client's accumulator gets the content and the call."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    scripted.script = ["Let me", " check.<tool", '_call>{"name": "get_weather", ',
                       '"arguments": {"city": "Paris"}}</tool_call>']
    answer = hermes.post("/v1/chat/completions", content=json.dumps(
        chat(tools=[WEATHER], tool_choice="auto", stream=True, logprobs=True)),
        headers={"Content-Type": "application/json"})
    chunks = events(answer)
    contents = [c["choices"][0]["delta"].get("content", "") for c in chunks]
    assert "".join(contents) == "Let me check." and "<" not in "".join(contents)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert sum(len(c["choices"][0]["logprobs"]["content"]) for c in chunks) == 4
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    message = state.get_final_completion().choices[0].message
    assert message.content == "Let me check."
    assert message.tool_calls[0].function.arguments == '{"city": "Paris"}'


def test_auto_streams_a_text_with_a_lone_angle_bracket_whole(hermes, scripted):
    scripted.script = ["a <", "b and <tool", " c"]
    answer = hermes.post("/v1/chat/completions", content=json.dumps(
        chat(tools=[WEATHER], stream=True)), headers={"Content-Type": "application/json"})
    chunks = events(answer)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == \
        "a <b and <tool c"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_auto_keeps_one_call_without_parallel_tool_calls(hermes, scripted):
    one = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    scripted.script = [one + one.replace("Paris", "Rome")]
    both = post(hermes, chat(tools=[WEATHER])).json()["choices"][0]["message"]["tool_calls"]
    first = post(hermes, chat(tools=[WEATHER], parallel_tool_calls=False)).json()
    assert len(both) == 2 and len(first["choices"][0]["message"]["tool_calls"]) == 1
    assert both[0]["id"] != both[1]["id"]


def test_hermes_reads_a_last_block_cut_off_before_its_closing_tag():
    from simple_sampler.frontend.tools import hermes_calls

    content, [call] = hermes_calls('<tool_call>{"name": "f", "arguments": {"x": 1}}')
    assert content is None and call["function"] == {"name": "f", "arguments": '{"x": 1}'}


def test_serves_tool_call_parser_reaches_what_the_door_serves():
    from simple_sampler.frontend.backend import FrontendServer
    from simple_sampler.settings import LlmSettings

    door = FrontendServer("127.0.0.1:1", "127.0.0.1", 0, tool_call_parser="hermes")
    assert door.prepare(LlmSettings()).served.tool_parser == "hermes"
    assert FrontendServer("127.0.0.1:1", "127.0.0.1", 0).prepare(
        LlmSettings()).served.tool_parser == "none"
