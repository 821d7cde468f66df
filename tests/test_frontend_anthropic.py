"""Anthropic's Messages API at the front door (``frontend/anthropic.py``),
without a server: the real ASGI app, the model's real tokenizer and chat
template, a stand-in generation; requests and answers as Anthropic's API
documents them (the anthropic client is not a dependency here)."""
import json

import pytest
from fastapi.testclient import TestClient

from simple_sampler.client import Chunk, GenerationError
from simple_sampler.frontend.app import build_app
from simple_sampler.frontend.translate import Served
from test_frontend import CONTEXT, MODEL, Recorder

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}


@pytest.fixture
def recorder():
    return Recorder()


@pytest.fixture
def client(codec, recorder):
    return TestClient(build_app(Served(MODEL, codec, CONTEXT, len(codec.tokenizer)),
                                recorder.generate))


def ask(**fields):
    return {"model": MODEL, "max_tokens": 40,
            "messages": [{"role": "user", "content": "Capital of France?"}], **fields}


def scripted(codec, pieces: list[str], plans: list, finish: str = "stop", stop_reason=None):
    def generate(plan):
        plans.append(plan)

        async def chunks():
            for i, text in enumerate(pieces):
                last = i == len(pieces) - 1
                yield Chunk(text, [5 + i], [-0.5], 0.0, len(plan.prompt_ids), i + 1,
                            finish if last else "", stop_reason=stop_reason if last else None)
        return chunks()
    return TestClient(build_app(Served(MODEL, codec, CONTEXT, len(codec.tokenizer)), generate))


def events(text: str) -> list[dict]:
    blocks = [b for b in text.split("\n\n") if b]
    parsed = [json.loads(b.split("data: ", 1)[1]) for b in blocks]
    assert all(b.startswith(f"event: {p['type']}\ndata: ") for b, p in zip(blocks, parsed))
    return parsed


def test_a_message_is_the_chat_answer_of_its_system_prompt_and_turns(client, recorder, codec):
    body = client.post("/v1/messages", json=ask(
        system=[{"type": "text", "text": "Answer briefly."}], top_k=5, temperature=0.5,
        stop_sequences=["\n\n"], metadata={"user_id": "u1"})).json()
    assert body["type"] == "message" and body["role"] == "assistant" and body["model"] == MODEL
    assert body["id"].startswith("msg_") and body["content"] == [{"type": "text", "text": " Paris."}]
    assert (body["stop_reason"], body["stop_sequence"]) == ("end_turn", None)
    plan, = recorder.plans
    expected = codec.encode_chat([{"role": "system", "content": "Answer briefly."},
                                  {"role": "user", "content": "Capital of France?"}])
    assert plan.prompt_ids == expected
    assert body["usage"] == {"input_tokens": len(expected), "output_tokens": 2}
    assert plan.params["max_tokens"] == 40 and plan.params["top_k"] == 5
    assert plan.params["temperature"] == 0.5
    counted = client.post("/v1/messages/count_tokens", json={
        "model": MODEL, "system": "Answer briefly.", "thinking": {"type": "disabled"},
        "messages": [{"role": "user", "content": "Capital of France?"}]}).json()
    assert counted == {"input_tokens": len(expected)}
    other = client.post("/v1/messages/count_tokens", json={
        "model": "other", "messages": [{"role": "user", "content": "x"}]})
    assert other.status_code == 404 and other.json()["error"]["type"] == "not_found_error"


def test_what_claude_clients_send_is_taken(client, recorder, codec):
    """System blocks joined as vLLM joins them, an empty system prompt no
    turn (the template's default stays), a system turn between the others,
    thinking asked (none comes) and earlier thinking blocks (no turn), a
    tool's strict and defer_loading, citations; chat's min_tokens."""
    body = client.post("/v1/messages", json=ask(
        system=[{"type": "text", "text": "Be brief. "}, {"type": "text", "text": ""},
                {"type": "text", "text": "Be kind."}],
        thinking={"type": "enabled", "budget_tokens": 1024, "display": "summarized"}, min_tokens=2,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi", "citations": []}]},
                  {"role": "assistant", "content": [
                      {"type": "thinking", "thinking": "hm", "signature": "s"},
                      {"type": "text", "text": "Hello."}]},
                  {"role": "system", "content": "Answer in French."},
                  {"role": "user", "content": "Capital of France?"}],
        tools=[{**WEATHER, "strict": True, "defer_loading": False}],
        tool_choice={"type": "none"}))
    assert body.status_code == 200, body.text
    assert all(block["type"] != "thinking" for block in body.json()["content"])
    plan = recorder.plans[-1]
    assert plan.params["min_length"] == 2
    assert plan.prompt_ids == codec.encode_chat(
        [{"role": "system", "content": "Be brief. Be kind."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello."},
         {"role": "system", "content": "Answer in French."},
         {"role": "user", "content": "Capital of France?"}],
        tools=[{"type": "function", "function": {"name": "get_weather",
                                                 "description": WEATHER["description"],
                                                 "parameters": WEATHER["input_schema"],
                                                 "strict": True}}])
    assert client.post("/v1/messages", json=ask(tools=[], tool_choice={"type": "auto"})
                       ).status_code == 200  # no tools: nothing to choose, as vLLM takes it
    client.post("/v1/messages", json=ask(system=""))
    assert recorder.plans[-1].prompt_ids == codec.encode_chat(
        [{"role": "user", "content": "Capital of France?"}])


@pytest.mark.parametrize("finish, stop_reason, expected", [
    ("length", None, ("max_tokens", None)),
    ("stop", "\n\n", ("stop_sequence", "\n\n")),
    ("stop", 2, ("end_turn", None)),  # a stop token id is no stop sequence
])
def test_the_stop_reason_is_anthropics(codec, finish, stop_reason, expected):
    body = scripted(codec, ["Paris"], [], finish, stop_reason).post("/v1/messages", json=ask()).json()
    assert (body["stop_reason"], body["stop_sequence"]) == expected


def test_a_streamed_message_is_anthropics_events(client):
    streamed = events(client.post("/v1/messages", json=ask(stream=True)).text)
    assert [e["type"] for e in streamed] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop"]
    start = streamed[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert "".join(e["delta"]["text"] for e in streamed if e["type"] == "content_block_delta") == " Paris."
    assert streamed[2]["delta"]["type"] == "text_delta" and streamed[2]["index"] == 0
    assert streamed[5]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert streamed[5]["usage"] == {"input_tokens": start["usage"]["input_tokens"],
                                    "output_tokens": 2}


def test_tools_are_chats_and_a_call_is_a_tool_use_block(codec):
    plans = []
    client = scripted(codec, ['{"city": ', '"Paris"}'], plans)
    asked = ask(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
    body = client.post("/v1/messages", json=asked).json()
    block, = body["content"]
    assert (block["type"], block["name"], block["input"]) == ("tool_use", "get_weather",
                                                             {"city": "Paris"})
    assert body["stop_reason"] == "tool_use"
    assert json.loads(plans[-1].params["guided_decoding_guide"]) == WEATHER["input_schema"]
    streamed = events(client.post("/v1/messages", json={**asked, "stream": True}).text)
    assert [e["type"] for e in streamed] == [  # a named call's input as it comes
        "message_start", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop"]
    assert streamed[1]["content_block"] == {**block, "id": streamed[1]["content_block"]["id"],
                                            "input": {}}
    assert json.loads("".join(e["delta"]["partial_json"] for e in streamed[2:4])) == {
        "city": "Paris"}
    assert streamed[5]["delta"]["stop_reason"] == "tool_use"
    # any (chat's required): the calls whole at the end, each block's start, input, stop
    calls = scripted(codec, ['[{"name": "get_weather", ', '"parameters": {"city": "Paris"}}]'],
                     plans)
    whole = events(calls.post("/v1/messages", json={**ask(tools=[WEATHER], stream=True),
                                                   "tool_choice": {"type": "any"}}).text)
    assert [e["type"] for e in whole] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    assert whole[1]["content_block"]["name"] == "get_weather"
    assert json.loads(whole[2]["delta"]["partial_json"]) == {"city": "Paris"}
    # a conversation with the call and its result: chat's tool turns
    turns = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                                "name": "get_weather", "input": {"city": "Paris"}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                           "content": "sunny"}]}]
    client.post("/v1/messages", json={**ask(tools=[WEATHER], tool_choice={"type": "none"}),
                                      "messages": turns})
    chat = scripted(codec, ["Sunny."], plans)
    chat.post("/v1/chat/completions", json={
        "model": MODEL, "tool_choice": "none",
        "tools": [{"type": "function", "function": {"name": "get_weather",
                                                    "description": WEATHER["description"],
                                                    "parameters": WEATHER["input_schema"]}}],
        "messages": [turns[0], {"role": "assistant", "content": None, "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}]})
    assert plans[-2].prompt_ids == plans[-1].prompt_ids
    # a call cut by max_tokens is no call: a 400 naming it, as chat's (an error event streamed)
    cut = scripted(codec, ['{"city": ', '"Par'], plans, finish="length")
    answer = cut.post("/v1/messages", json=asked)
    assert answer.status_code == 400 and "max_tokens cut it" in answer.json()["error"]["message"]
    last = events(cut.post("/v1/messages", json={**asked, "stream": True}).text)[-1]
    assert last["type"] == "error" and "max_tokens cut it" in last["error"]["message"]


@pytest.mark.parametrize("fields, status, text", [
    ({"max_tokens": None}, 400, "max_tokens"),
    ({"model": "other"}, 404, "does not exist"),
    ({"max_tokens": CONTEXT + 1}, 400, "max_tokens must be"),
    ({"tool_choice": {"type": "tool"}, "tools": [WEATHER]}, 400, "names its tool"),
    ({"tools": [WEATHER]}, 400, 'send tool_choice {"type": "any"}'),
    ({"tool_choice": {"type": "any"}}, 400, "tools` must be set"),
    ({"frobnicate": 1}, 400, "unknown field"),
    ({"thinking": {"type": "on"}}, 400, "thinking.type"),
    ({"thinking": {"type": "enabled"}}, 400, "budget_tokens, an integer of at least 1024, got None"),
    ({"thinking": {"type": "enabled", "budget_tokens": 10}}, 400,
     "thinking: thinking of type enabled needs budget_tokens, an integer of at least 1024, got 10"),
    ({"thinking": {"type": "disabled", "budget_tokens": 2048}}, 400, "not disabled"),
    # chat's checks, named as a message request names the field
    ({"stop_sequences": ["a", ""]}, 400, "stop_sequences must be a non-empty string"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]}, 400,
     'Correct usage: `{"type": "tool", "name": "my_function"}`'),
    ({"tool_choice": {"type": "any"}, "tools": [{**WEATHER, "input_schema": {"type": "nonsense"}}]},
     400, "tools (a tool's parameters) is not a JSON schema"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "ok"},
                   {"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                 "input": {}}]}]}, 400,
     "messages.2: content.0: a tool_use block is the assistant's, not the user's"),
    ({"messages": [{"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                      "content": "sunny"}]}]}, 400,
     "messages.1: content.0: a tool_result block is the user's, not the assistant's"),
])
def test_errors_are_anthropics_error_objects(client, recorder, fields, status, text):
    body = {k: v for k, v in {**ask(), **fields}.items() if v is not None}
    answer = client.post("/v1/messages", json=body)
    assert answer.status_code == status
    error = answer.json()
    assert error["type"] == "error" and error["error"]["type"] == (
        "not_found_error" if status == 404 else "invalid_request_error"), error
    assert text in error["error"]["message"], error
    assert not recorder.plans


def test_a_failed_generation_is_anthropics_error_whole_or_streamed(client, recorder, codec):
    recorder.error = GenerationError("the llm model is stopping", "UNAVAILABLE")
    for stream in (False, True):  # before the first response: a status, streamed or not
        answer = client.post("/v1/messages", json=ask(stream=stream))
        assert answer.status_code == 503
        assert answer.json()["error"] == {"type": "overloaded_error",
                                          "message": "the llm model is stopping"}

    def failing(plan):
        async def chunks():
            yield Chunk(" Paris", [3], [], 0.0, 4, 1, "")
            raise GenerationError("the sampler failed", "INTERNAL")
        return chunks()

    late = TestClient(build_app(Served(MODEL, codec, CONTEXT, len(codec.tokenizer)), failing))
    streamed = events(late.post("/v1/messages", json=ask(stream=True)).text)
    assert streamed[-1] == {"type": "error", "error": {"type": "api_error",
                                                       "message": "the sampler failed"}}
