"""Anthropic's Messages API (``POST /v1/messages`` and
``POST /v1/messages/count_tokens``), as vLLM 0.32 serves it
(vllm/entrypoints/anthropic/: ``AnthropicMessagesRequest``,
``AnthropicServingMessages``, which turns the request into a chat request
and the chat answer back).

A request becomes a chat request (``to_chat``: its system prompt a system
turn, each message a turn, a ``tool_use`` block an assistant's tool call, a
``tool_result`` block a tool's turn, a thinking block none; its tools and
tool_choice chat's),
planned as chat is (``translate.plan_chat``); its answer is a message
object (``message``) or, streamed, its events (``MessageEvents``); every
error is Anthropic's error object (``errors``). ``thinking`` is checked (``Thinking``)
and no thinking comes (no model here reasons).
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import ValidationError, model_validator

from ..client import Chunk
from .chat import chat_prompt_ids
from .event_apis import EventApi
from .protocol import ChatCompletionRequest, RequestError, Strict, parse
from .tools import new_call
from .translate import Plan, Served, check_model, plan_chat

#: chat's names of the fields chat's checks may name, as a message request
#: names them (``RequestError.named_as``): its turns (shifted by the system
#: turn and the tool results made turns: named whole), stop sequences, a
#: tool's and a named tool choice's fields
_CHAT_NAMES = (("messages", "messages"), ("stop", "stop_sequences"),
               ("tool_choice.function.name", "tool_choice.name"),
               ("function.parameters", "input_schema"), ("function.name", "name"),
               ("function.description", "description"))
#: a named tool choice, as a message request writes one (chat's errors show chat's)
_TOOL_CHOICE_USAGE = 'Correct usage: `{"type": "tool", "name": "my_function"}`'
#: OpenAI's error types as Anthropic names them (its errors' ``type``)
ERROR_TYPES = {"internal_server_error": "api_error", "service_unavailable": "overloaded_error"}
#: what a chat answer's end is, as Anthropic says it (vLLM's ``_to_anthropic_stop_reason``)
LENGTH, END_TURN, STOP_SEQUENCE, TOOL_USE = "max_tokens", "end_turn", "stop_sequence", "tool_use"


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    #: a text's sources (Anthropic's): they do not change the text
    citations: list[dict[str, Any]] | None = None


class ThinkingBlock(Strict):
    """An earlier answer's thinking, in an assistant's turn: no model here
    reasons, so no turn is made of it (vLLM's chat turns carry it as
    reasoning, which SmolLM2's and Qwen2.5's templates do not show)."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


class ToolUseBlock(Strict):
    """An assistant's earlier call."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(Strict):
    """What a call returned, in the user's turn."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None


class Message(Strict):
    #: system too: a turn of the system's between the others (vLLM takes it)
    role: Literal["user", "assistant", "system"]
    content: str | list[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock]

    @model_validator(mode="after")
    def _calls_are_the_assistants(self) -> "Message":
        """tool_use blocks in the assistant's turns, tool_result blocks in the
        user's (Anthropic's rule; chat would refuse the first with a null
        content and turn the second into a tool turn of the wrong side)."""
        for index, block in enumerate([] if isinstance(self.content, str) else self.content):
            if isinstance(block, ToolUseBlock) and self.role != "assistant":
                raise ValueError(f"content.{index}: a tool_use block is the assistant's, not the "
                                 f"{self.role}'s (a user turn answers one with a tool_result block)")
            if isinstance(block, ToolResultBlock) and self.role != "user":
                raise ValueError(f"content.{index}: a tool_result block is the user's, not the "
                                 f"{self.role}'s")
        return self


class Tool(Strict):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None
    #: chat's function strict (the arguments held to the schema either way here)
    strict: bool | None = None
    #: Anthropic's tool search: every tool is in the prompt here
    defer_loading: bool | None = None


class Thinking(Strict):
    """Anthropic's extended-thinking setting, checked as Anthropic documents
    it (``enabled`` with a ``budget_tokens`` of at least 1024, the others
    with none); no model here reasons, so no thinking block comes (as vLLM
    answers for a model without a reasoning parser)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    #: how the thinking would be shown (Anthropic's); none comes here
    display: Literal["summarized", "omitted"] | None = None

    @model_validator(mode="after")
    def _budget_where_enabled(self) -> "Thinking":
        if self.type == "enabled" and (self.budget_tokens is None or self.budget_tokens < 1024):
            raise ValueError("thinking of type enabled needs budget_tokens, an integer "
                             f"of at least 1024, got {self.budget_tokens}")
        if self.type != "enabled" and self.budget_tokens is not None:
            raise ValueError(f"budget_tokens goes with thinking of type enabled, not {self.type}")
        return self


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(Strict):
    """vLLM's ``AnthropicMessagesRequest`` (Anthropic's fields, the same
    names); ``max_tokens`` is required, as Anthropic's is."""

    model: str | None = None
    messages: list[Message]
    max_tokens: int
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    # chat's, which vLLM's Messages request ignores as extra fields
    min_tokens: int | None = None
    ignore_eos: bool | None = None


class CountTokensRequest(Strict):
    """vLLM's ``AnthropicCountTokensRequest``: a message request's prompt."""

    model: str | None = None
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


def _text(content, joint: str = "\n") -> str:
    """A content's text, its text blocks' (empty ones left out) joined."""
    if content is None or isinstance(content, str):
        return content or ""
    return joint.join(block.text for block in content if isinstance(block, TextBlock)
                      and block.text)


def to_chat(request: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """The chat request a message request is (RequestError naming the field).
    The system prompt's blocks are joined as vLLM joins them (with nothing
    between); an empty one makes no turn (the template's default stays)."""
    system = _text(request.system, "")
    turns = [{"role": "system", "content": system}] if system else []
    for message in request.messages:
        _add_turns(message, turns)
    fields: dict[str, Any] = {"messages": turns}
    if request.model is not None:
        fields["model"] = request.model
    if isinstance(request, MessagesRequest):
        fields.update({name: value for name, value in (
            ("max_tokens", request.max_tokens), ("temperature", request.temperature),
            ("top_p", request.top_p), ("top_k", request.top_k), ("stop", request.stop_sequences),
            ("stream", request.stream), ("min_tokens", request.min_tokens),
            ("ignore_eos", request.ignore_eos)) if value is not None})
    fields.update(_chat_tools(request.tools, request.tool_choice))
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as error:  # what chat refuses among the shared fields
        first = error.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise RequestError(f"{param}: {first['msg']}", param) from None


def _add_turns(message: Message, turns: list[dict]) -> None:
    """A message's chat turns: its tool results as tool turns, then its text
    and calls as one turn of its role."""
    if isinstance(message.content, str):
        turns.append({"role": message.role, "content": message.content})
        return
    texts = [block.text for block in message.content if isinstance(block, TextBlock) and block.text]
    calls = [{"id": block.id, "type": "function",
              "function": {"name": block.name, "arguments": json.dumps(block.input)}}
             for block in message.content if isinstance(block, ToolUseBlock)]
    results = [block for block in message.content if isinstance(block, ToolResultBlock)]
    turns.extend({"role": "tool", "tool_call_id": result.tool_use_id,
                  "content": _text(result.content)} for result in results)
    if texts or calls or not results:
        turn = {"role": message.role, "content": "\n".join(texts) if texts or not calls else None}
        turns.append({**turn, "tool_calls": calls} if calls else turn)


def _chat_tools(tools: list[Tool] | None, choice: ToolChoice | None) -> dict:
    """Chat's tools and tool_choice: auto as auto, any as required, tool as a
    named function, none as none; disable_parallel_tool_use as
    parallel_tool_calls false."""
    fields: dict[str, Any] = {}
    if tools:
        fields["tools"] = [{"type": "function", "function": {
            "name": tool.name, "parameters": tool.input_schema,
            **({"description": tool.description} if tool.description else {}),
            **({"strict": tool.strict} if tool.strict is not None else {})}} for tool in tools]
    if choice is not None and (tools or choice.type not in ("auto", "none")):
        if choice.type == "tool":
            if choice.name is None:
                raise RequestError("tool_choice of type tool names its tool", "tool_choice.name")
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use and tools:
            fields["parallel_tool_calls"] = False
    return fields


def plan_message(body: bytes, served: Served) -> tuple[MessagesRequest, Plan]:
    """The request (RequestError if bad) and the one generation it asks for."""
    request = parse(MessagesRequest, body)
    choice = request.tool_choice
    if request.tools and (choice is None or choice.type == "auto") and served.tool_parser == "none":
        raise RequestError('tool_choice auto (the default with tools) needs a tool call parser: '
                           'this server runs without one (serve --tool-call-parser hermes); send '
                           'tool_choice {"type": "any"}, {"type": "tool", "name": ...} or '
                           '{"type": "none"}', "tool_choice")
    try:
        return request, plan_chat(to_chat(request), served)[0]
    except RequestError as error:
        raise _named(error) from None


def count_tokens(body: bytes, served: Served) -> dict:
    """``/v1/messages/count_tokens``: the prompt's tokens, as a message
    request of the same fields sends them; nothing is asked of the model."""
    request = parse(CountTokensRequest, body)
    check_model(request.model, served)
    try:
        return {"input_tokens": len(chat_prompt_ids(to_chat(request), served.codec))}
    except RequestError as error:
        raise _named(error) from None


def _named(error: RequestError) -> RequestError:
    """An error of the chat request a message request is (``to_chat``,
    ``plan_chat``), its field named as a message request names it."""
    return error.named_as(_CHAT_NAMES, whole=("messages",), usage=_TOOL_CHOICE_USAGE)


def content_blocks(plan: Plan, chunks: list[Chunk]) -> list[dict]:
    """An answer's content: its text block, and with tools a tool_use block
    per call (chat's, ``tools.ToolUse.answer``), the text only where there
    is text beside them."""
    text = "".join(c.text for c in chunks)
    if plan.tools is None:
        return [{"type": "text", "text": text}]
    finish = chunks[-1].finish_reason
    content, calls = plan.tools.answer(text, finish)
    return ([{"type": "text", "text": content}] if content or not calls else []) + [
        {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
         "input": _call_input(call["function"]["arguments"], finish)} for call in calls]


def _call_input(arguments: str, finish: str) -> dict:
    """A call's input: its arguments' JSON object; RequestError where they
    are not a whole one (cut by max_tokens, or a stop), as chat refuses a
    cut list of calls (``tools.ToolUse.calls``)."""
    try:
        value = json.loads(arguments or "{}")
        if not isinstance(value, dict):
            raise ValueError("not a JSON object")
        return value
    except ValueError as error:
        cut = finish == "length"
        raise RequestError(f"the tool call's input is not a whole JSON object ({error}): "
                           f"{'max_tokens cut it; give more' if cut else 'a stop ended it early'}",
                           "max_tokens" if cut else "stop_sequences") from None


def stop(final: Chunk, blocks: list[dict]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of an answer's final response."""
    if final.finish_reason == "length":
        return LENGTH, None
    if any(block["type"] == "tool_use" for block in blocks):
        return TOOL_USE, None
    if isinstance(final.stop_reason, str):
        return STOP_SEQUENCE, final.stop_reason
    return END_TURN, None


def message(request: MessagesRequest, plan: Plan, chunks: list[Chunk], served: Served) -> dict:
    """The message object of a generation's responses (all of them)."""
    blocks = content_blocks(plan, chunks)
    reason, sequence = stop(chunks[-1], blocks)
    return {**_opened(plan, served), "content": blocks, "stop_reason": reason,
            "stop_sequence": sequence, "usage": {"input_tokens": chunks[-1].num_input_tokens,
                                                 "output_tokens": chunks[-1].num_output_tokens}}


def _opened(plan: Plan, served: Served) -> dict:
    return {"id": f"msg_{plan.id}", "type": "message", "role": "assistant",
            "model": served.model_id, "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": len(plan.prompt_ids), "output_tokens": 0}}


class MessageEvents:
    """A streamed message's events, as Anthropic sends them: message_start,
    the text block's content_block_start, a text_delta per response with
    text, content_block_stop, message_delta (the stop reason and the output
    tokens), message_stop. A named tool's call streams its input as it comes
    (an input_json_delta per response), as chat streams a named call; with
    other tools the blocks come whole at the end (their text is read whole:
    ``tools.ToolUse``), a call's input as one input_json_delta."""

    def __init__(self, request: MessagesRequest, plan: Plan, served: Served):
        self.request, self.plan, self.served = request, plan, served
        self.chunks: list[Chunk] = []
        self.streams_text = plan.tools is None
        #: a named tool's call, streamed as it comes: its block as opened
        self.call = ({"type": "tool_use", "id": new_call(plan.tools.name, "")["id"],
                      "name": plan.tools.name, "input": {}}
                     if plan.tools is not None and plan.tools.name is not None else None)

    def opening(self) -> list[dict]:
        started = [{"type": "message_start", "message": _opened(self.plan, self.served)}]
        if self.streams_text or self.call is not None:
            started.append({"type": "content_block_start", "index": 0,
                            "content_block": self.call or {"type": "text", "text": ""}})
        return started

    def delta(self, chunk: Chunk) -> list[dict]:
        self.chunks.append(chunk)
        events = []
        if chunk.text and (self.streams_text or self.call is not None):
            events.append({"type": "content_block_delta", "index": 0, "delta": (
                {"type": "text_delta", "text": chunk.text} if self.call is None
                else {"type": "input_json_delta", "partial_json": chunk.text})})
        if not chunk.finish_reason:
            return events
        done = message(self.request, self.plan, self.chunks, self.served)
        if self.call is not None:  # the call streamed: its id kept
            done["content"][0]["id"] = self.call["id"]
        if self.streams_text or self.call is not None:
            events.append({"type": "content_block_stop", "index": 0})
        else:
            for index, block in enumerate(done["content"]):
                events += _whole_block(index, block)
        return [*events,
                {"type": "message_delta", "delta": {"stop_reason": done["stop_reason"],
                                                    "stop_sequence": done["stop_sequence"]},
                 "usage": done["usage"]},
                {"type": "message_stop"}]

    def error(self, body: dict) -> dict:
        return errors(body)


def _whole_block(index: int, block: dict) -> list[dict]:
    if block["type"] == "text":
        start, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
    else:
        start = {**block, "input": {}}
        delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
    return [{"type": "content_block_start", "index": index, "content_block": start},
            {"type": "content_block_delta", "index": index, "delta": delta},
            {"type": "content_block_stop", "index": index}]


def errors(body: dict) -> dict:
    """Anthropic's error object of an OpenAI error object (an unknown model
    is Anthropic's not_found_error)."""
    error = body["error"]
    kind = "not_found_error" if error.get("code") == "model_not_found" else \
        ERROR_TYPES.get(error["type"], error["type"])
    return {"type": "error", "error": {"type": kind, "message": error["message"]}}


def sse(event: dict) -> bytes:
    """One server-sent event, its type named, as Anthropic sends them."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()


#: the Messages API as ``event_apis.serve`` answers it
API = EventApi(plan_message, message, MessageEvents, sse, errors)
