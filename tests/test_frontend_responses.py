"""OpenAI's Responses API at the front door (``frontend/responses.py``),
without a server: the real ASGI app, the model's real tokenizer and chat
template, the openai client's own ``responses`` methods and types, and a
stand-in generation (test_frontend's Recorder)."""
import json

import openai
import pytest
from fastapi.testclient import TestClient

from simple_sampler.client import Chunk, GenerationError
from simple_sampler.frontend.app import build_app
from simple_sampler.frontend.translate import Served
from test_frontend import CONTEXT, MODEL, Recorder, post


@pytest.fixture
def recorder():
    return Recorder()


@pytest.fixture
def app(codec, recorder):
    return build_app(Served(MODEL, codec, CONTEXT, len(codec.tokenizer)), recorder.generate)


@pytest.fixture
def sdk(app):
    """The openai client, its HTTP through the app."""
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0,
                         http_client=TestClient(app))


def test_a_response_is_the_chat_answer_of_its_instructions_and_input(sdk, recorder, codec):
    answer = sdk.responses.create(model=MODEL, instructions="Answer briefly.",
                                  input="Capital of France?", max_output_tokens=40,
                                  extra_body={"top_k": 5, "seed": 3, "min_tokens": 2})
    assert answer.output_text == " Paris." and answer.status == "completed"
    assert answer.object == "response" and answer.id.startswith("resp_")
    assert answer.model == MODEL and answer.incomplete_details is None
    assert answer.output[0].type == "message" and answer.output[0].role == "assistant"
    plan, = recorder.plans
    expected = codec.encode_chat([{"role": "system", "content": "Answer briefly."},
                                  {"role": "user", "content": "Capital of France?"}])
    assert plan.prompt_ids == expected and plan.chat
    assert plan.params["max_tokens"] == 40 and plan.params["top_k"] == 5
    assert plan.params["seed"] == 3 and plan.params["min_length"] == 2
    assert answer.max_output_tokens == 40 and answer.store is False
    assert (answer.usage.input_tokens, answer.usage.output_tokens,
            answer.usage.total_tokens) == (len(expected), 2, len(expected) + 2)


def test_input_messages_are_the_turns_an_earlier_answers_output_among_them(sdk, recorder, codec):
    """A conversation carried by the client: its earlier answer's output
    message, as the openai client dumps it, is the assistant's turn."""
    first = sdk.responses.create(model=MODEL, input="Capital of France?")
    turns = [{"role": "user", "content": "Capital of France?"},
             first.output[0].model_dump(exclude_none=True),
             {"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
             {"role": "user", "content": "And of Italy?"}]
    sdk.responses.create(model=MODEL, input=turns)
    # SmolLM2's template names no developer role: vLLM's system turn, at the start
    assert recorder.plans[-1].prompt_ids == codec.encode_chat([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": " Paris."}, {"role": "user", "content": "And of Italy?"}])


@pytest.mark.parametrize("text_format, inputs", [
    ({"type": "text"}, {}),
    ({"type": "json_object"}, {"guided_decoding_guide_type": "json"}),
    ({"type": "json_schema", "name": "answer", "strict": True, "schema": {"type": "object"}},
     {"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": '{"type": "object"}'}),
])
def test_text_format_is_chats_response_format(app, recorder, text_format, inputs):
    """text.format holds the answer to JSON, or to a schema, as chat's
    response_format does; the answer names it as it came."""
    body = post(TestClient(app), "/v1/responses",
                {"input": "x", "text": {"format": text_format}}).json()
    params = recorder.plans[-1].params
    assert {k: params[k] for k in inputs} == inputs and ("guided_decoding_guide_type" in params
                                                         ) == bool(inputs)
    assert body["text"] == {"format": text_format}


def test_logprobs_included_are_chats_entries_whole_and_in_the_deltas(sdk, codec):
    """include message.output_text.logprobs (with top_logprobs n): each
    token's logprob, bytes and n most likely, as chat's logprobs give them;
    a stream's deltas carry their tokens' and output_text.done all of them."""
    sdk_chat = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                           logprobs=True, top_logprobs=0)
    asked = dict(model=MODEL, input="x", include=["message.output_text.logprobs"])
    answer = sdk.responses.create(**asked)
    entries = [e.model_dump() for e in answer.output[0].content[0].logprobs]
    expected = [e.model_dump() for e in sdk_chat.choices[0].logprobs.content]
    assert entries == expected and [e["logprob"] for e in entries] == [-0.5, -0.25]
    with sdk.responses.create(stream=True, **asked) as stream:
        events = list(stream)
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert [[lp.model_dump() for lp in d.logprobs] for d in deltas] == [[e] for e in expected]
    done, = [e for e in events if e.type == "response.output_text.done"]
    assert [lp.logprob for lp in done.logprobs] == [-0.5, -0.25]
    assert [lp.model_dump() for lp in events[-1].response.output[0].content[0].logprobs] == expected
    plain = sdk.responses.create(model=MODEL, input="x")
    assert plain.output[0].content[0].logprobs == []


def test_request_id_is_the_answers_id_and_includes_without_their_kind_add_nothing(app):
    """vLLM's request_id is the Response's id as it came; include may name
    what vLLM's does (reasoning.encrypted_content, which agent clients send
    with store false), none of which this server makes."""
    body = post(TestClient(app), "/v1/responses", {
        "input": "x", "request_id": "resp_mine", "store": False,
        "include": ["reasoning.encrypted_content"]}).json()
    assert body["id"] == "resp_mine" and body["store"] is False
    assert [item["type"] for item in body["output"]] == ["message"]


def test_an_answer_cut_at_max_output_tokens_is_incomplete(codec):
    async_chunks = [Chunk(" Par", [3], [], 0.0, 9, 1, ""), Chunk("is", [4], [], 0.0, 9, 2, "length")]

    def generate(plan):
        async def chunks():
            for chunk in async_chunks:
                yield chunk
        return chunks()

    client = TestClient(build_app(Served(MODEL, codec, CONTEXT, len(codec.tokenizer)), generate))
    body = post(client, "/v1/responses", {"model": MODEL, "input": "x", "max_output_tokens": 2}).json()
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["content"][0]["text"] == " Paris"


def test_a_streamed_response_is_vllms_events_in_order(sdk, app):
    with sdk.responses.create(model=MODEL, input="Capital of France?", stream=True) as stream:
        events = list(stream)
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == " Paris."
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    done = events[-1].response
    assert done.status == "completed" and done.output_text == " Paris." and done.usage.output_tokens == 2
    assert events[-4].text == " Paris."
    raw = TestClient(app).post("/v1/responses", json={
        "input": "x", "stream": True, "stream_options": {"include_usage": True}}).text
    blocks = [b for b in raw.split("\n\n") if b]
    assert all(b.startswith(f"event: {json.loads(b.split('data: ', 1)[1])['type']}\ndata: ")
               for b in blocks)
    assert "[DONE]" not in raw
    assert json.loads(blocks[-1].split("data: ", 1)[1])["response"]["usage"]["output_tokens"] == 2


def test_a_failed_generation_is_an_error_status_or_the_streams_error_event(app, recorder, codec):
    client = TestClient(app)
    recorder.error = GenerationError("the llm model refused it", "INVALID_ARGUMENT")
    answer = post(client, "/v1/responses", {"input": "x"})
    assert answer.status_code == 400 and "refused" in answer.json()["error"]["message"]

    class Late(Recorder):  # fails after its first response: the stream has begun
        def generate(self, plan):
            async def chunks():
                yield Chunk(" Paris", [3], [], 0.0, 4, 1, "")
                raise GenerationError("the sampler failed", "INTERNAL")
            return chunks()

    late = TestClient(build_app(Served(MODEL, codec, CONTEXT, len(codec.tokenizer)),
                                Late().generate))
    text = post(late, "/v1/responses", {"input": "x", "stream": True}).text
    last = json.loads(text.strip().split("\n\n")[-1].split("data: ", 1)[1])
    assert last["type"] == "error" and "sampler failed" in last["message"]


@pytest.mark.parametrize("fields, param, text", [
    ({"tools": [{"type": "web_search"}]}, "tools.0.type", "Input should be 'function'"),
    ({"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "stores no response"),
    ({"background": True}, "background", "background"),
    ({"top_logprobs": 2}, "top_logprobs", "top_logprobs needs include"),
    ({"include": ["message.output_text.bytes"]}, "include.0", "Input should be"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format",
     "text.format"),
    ({"include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type", "Input should be 'text'"),
    ({"text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "nope"}}}},
     "text.format", "text.format"),
    ({"truncation": "none"}, "truncation", "Input should be 'auto' or 'disabled'"),
    ({"truncation": "auto", "input": "hi " * 600}, "input", "leaves no room"),
    ({"max_output_tokens": CONTEXT + 1}, "max_output_tokens", "max_output_tokens must be"),
    ({"temperature": -1.0}, "temperature", "temperature"),
    ({"model": "other"}, "model", "does not exist"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input", "input must be one of"),
    ({"frobnicate": 1}, "frobnicate", "unknown field"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed with stream"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats", "unknown field"),
    # chat's checks, named as a Responses request names the field
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}],
      "tool_choice": {"type": "function", "name": "g"}}, "tool_choice",
     'Correct usage: `{"type": "function", "name": "my_function"}`'),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "nonsense"}}],
      "tool_choice": "required"}, "tools", "tools (a tool's parameters) is not a JSON schema"),
    ({"input": [{"role": "user", "content": "hi"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
     "input", "input (arguments) must be a JSON object, got '[1]'"),
])
def test_what_a_response_cannot_do_is_refused_by_name(app, recorder, fields, param, text):
    answer = post(TestClient(app), "/v1/responses", {"input": "Capital of France?", **fields})
    error = answer.json()["error"]
    assert answer.status_code in (400, 404) and error["param"] == param, error
    assert text in error["message"], error
    assert not recorder.plans


def test_truncation_auto_keeps_the_inputs_last_tokens_and_reasoning_is_answered_as_sent(
        app, recorder):
    """vLLM's truncation auto is chat's truncate_prompt_tokens -1: the last
    tokens that leave one for the answer; reasoning and max_tool_calls are
    taken and answered as sent (no model here reasons)."""
    answer = post(TestClient(app), "/v1/responses", {
        "input": "hi " * 600, "truncation": "auto", "max_output_tokens": 8,
        "reasoning": {"effort": "low"}, "max_tool_calls": 2}).json()
    assert len(recorder.plans[-1].prompt_ids) == CONTEXT - 1
    assert (answer["truncation"], answer["reasoning"], answer["max_tool_calls"]) == (
        "auto", {"effort": "low"}, 2)
    assert answer["usage"]["input_tokens"] == CONTEXT - 1


def test_auto_without_a_parser_answers_in_text_with_the_tools_in_the_template(app, recorder):
    """As vLLM 0.32's Responses API answers it (chat refuses it): the
    model's text as the message, no call parsed out of it."""
    answer = post(TestClient(app), "/v1/responses", {"input": "Weather in Paris?",
                                                    "tools": [WEATHER]})
    assert answer.status_code == 200, answer.text
    plan = recorder.plans[-1]
    assert plan.tools is None and "guided_decoding_guide" not in plan.params
    assert [item["type"] for item in answer.json()["output"]] == ["message"]
    assert answer.json()["tool_choice"] == "auto"


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}


def scripted_app(codec, pieces: list[str], plans: list):
    """The app over a generation that answers `pieces`, one response each."""
    def generate(plan):
        plans.append(plan)

        async def chunks():
            for i, text in enumerate(pieces):
                yield Chunk(text, [5 + i], [-0.5], 0.0, len(plan.prompt_ids), i + 1,
                            "stop" if i == len(pieces) - 1 else "")
        return chunks()
    return build_app(Served(MODEL, codec, CONTEXT, len(codec.tokenizer)), generate)


def test_a_named_function_answers_a_function_call_item_streamed_or_not(codec):
    """tools and a named tool_choice: chat's grammar of the function's
    parameters; the answer a function_call output item, streamed whole at
    its end (added, arguments delta and done, item done)."""
    plans = []
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0,
                        http_client=TestClient(scripted_app(codec, ['{"city": ', '"Paris"}'],
                                                            plans)))
    asked = dict(model=MODEL, input="Weather in Paris?", tools=[WEATHER],
                 tool_choice={"type": "function", "name": "get_weather"})
    answer = sdk.responses.create(**asked)
    call, = answer.output
    assert (call.type, call.name, call.arguments, call.status) == (
        "function_call", "get_weather", '{"city": "Paris"}', "completed")
    assert call.call_id and call.id.startswith("fc_")
    assert plans[-1].params["guided_decoding_guide_type"] == "json_schema"
    assert json.loads(plans[-1].params["guided_decoding_guide"]) == WEATHER["parameters"]
    assert answer.tools[0].name == "get_weather" and answer.tool_choice.name == "get_weather"
    with sdk.responses.create(stream=True, **asked) as stream:
        events = list(stream)
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]  # a named call's arguments as they come, as chat streams them
    assert [e.delta for e in events[3:5]] == ['{"city": ', '"Paris"}']
    assert events[5].arguments == '{"city": "Paris"}' and events[6].item.name == "get_weather"
    assert events[2].item.id == events[3].item_id == events[6].item.id == \
        events[-1].response.output[0].id
    assert events[2].item.call_id == events[-1].response.output[0].call_id
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # required: the calls whole at the end
    sdk_required = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0,
                                 http_client=TestClient(scripted_app(codec, [
                                     '[{"name": "get_weather", ',
                                     '"parameters": {"city": "Paris"}}]'], plans)))
    with sdk_required.responses.create(**{**asked, "tool_choice": "required"},
                                       stream=True) as stream:
        whole = list(stream)
    assert [e.type for e in whole] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert json.loads(whole[4].arguments) == {"city": "Paris"}


def test_calls_and_their_outputs_in_input_are_the_chat_turns_of_a_tool_conversation(codec):
    """An earlier call (function_call) and what it returned
    (function_call_output) are an assistant's turn with tool_calls and a
    tool's turn, through the chat template as chat's are."""
    plans = []
    client = TestClient(scripted_app(codec, ["Sunny."], plans))
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
            "arguments": '{"city": "Paris"}'}
    output = {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 24 C"}
    body = post(client, "/v1/responses", {"input": [
        {"role": "user", "content": "Weather in Paris?"}, call, output],
        "tools": [WEATHER], "tool_choice": "none"}).json()
    assert body["output"][0]["content"][0]["text"] == "Sunny."
    turns = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "call_1", "type": "function", "function": {
                     "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"}]
    chat_client = TestClient(scripted_app(codec, ["Sunny."], plans))
    post(chat_client, "/v1/chat/completions", {"model": MODEL, "messages": turns,
                                               "tools": [{"type": "function", "function": {
                                                   k: v for k, v in WEATHER.items()
                                                   if k != "type"}}], "tool_choice": "none"})
    assert plans[0].prompt_ids == plans[1].prompt_ids


def test_chats_field_names_become_the_requests_own():
    """``RequestError.named_as``: a prefix renamed (the rest of the path
    kept), a part in the middle of a path renamed, a field named whole (its
    last part kept in the message), the first rule that applies only."""
    from simple_sampler.frontend.protocol import RequestError

    names = (("messages", "input"), ("stop", "stop_sequences"), ("function.parameters", "parameters"))
    cases = [("stop.1", "stop.1 must not be empty", "stop_sequences.1", "stop_sequences.1 must not be empty"),
             ("tools.2.function.parameters", "tools.2.function.parameters: not a dict",
              "tools.2.parameters", "tools.2.parameters: not a dict"),
             ("messages.3.content", "messages.3.content may be null only ...", "input",
              "input (content) may be null only ..."),
             ("messages.3", "messages.3 is bad", "input", "input is bad"),
             ("temperature", "temperature must be >= 0", "temperature", "temperature must be >= 0"),
             # a name inside a longer one is not renamed, nor a rule's word as a path's last part
             ("messages.1", "messages.1 differs from messages.10", "input", "input differs from messages.10"),
             ("stop", "stop and stop_token_ids disagree", "stop_sequences",
              "stop_sequences and stop_token_ids disagree"),
             ("tools.0.function.parameters.properties.stop", "tools.0.function.parameters.properties.stop: bad",
              "tools.0.parameters.properties.stop", "tools.0.parameters.properties.stop: bad")]
    for param, message, renamed, text in cases:
        error = RequestError(message, param, 404, "code", "kind").named_as(names, whole=("messages",))
        assert (error.param, str(error), error.status, error.code, error.kind) == (
            renamed, text, 404, "code", "kind")
