"""OpenAI's Responses API (``POST /v1/responses``), as vLLM 0.32 serves it
without reasoning or a store (vllm/entrypoints/openai/responses/:
``ResponsesRequest``, ``OpenAIServingResponses``,
``SimpleStreamingEventProcessor``).

A request becomes a chat request (``to_chat``: its instructions a system
turn, each input message a turn, its function calls and their outputs
chat's tool turns, its function tools chat's: ``response_tools``, the
sampling fields as chat's), planned as chat is (``translate.plan_chat``);
its answer is a Response object (``response``) or, streamed, that object's
events (``ResponseEvents``). What it cannot do (a stored response to
continue, a background response, a prompt template, other tools than
functions) is refused by name; ``store`` is accepted and nothing is stored
(vLLM's default, ``VLLM_ENABLE_RESPONSES_API_STORE`` off), which the answer
says (``store`` false); ``reasoning`` and ``max_tool_calls`` are accepted
and answered as sent (no model here reasons; function tools are the
client's to call).
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, ValidationError

from ..client import Chunk
from . import answers
from .event_apis import EventApi
from .protocol import ChatCompletionRequest, RequestError, Strict, parse
from .response_tools import (FunctionCallItem, FunctionCallOutputItem, FunctionChoice,
                             FunctionTool, chat_tools, chat_turn, function_call)
from .tools import new_call
from .translate import PARAM_INPUTS, Plan, Served, plan_chat

#: (field, the value it must have here, why another is refused)
_REFUSED = (
    ("previous_response_id", None, "this server stores no response to continue (store is "
                                   "accepted and nothing is stored, as vLLM's default)"),
    ("background", False, "background responses are not supported by this server"),
    ("prompt", None, "prompt templates are not supported by this server"),
)
#: chat's names of this request's fields that chat's checks may name
#: (``RequestError.named_as``): max_tokens, messages (the turns the input and
#: instructions make), response_format (with its json_schema's fields), a
#: tool's and a named tool choice's fields
_CHAT_NAMES = (("max_tokens", "max_output_tokens"), ("messages", "input"),
               ("truncate_prompt_tokens", "truncation"),
               ("response_format.json_schema", "text.format"),
               ("response_format", "text.format"),
               ("tool_choice.function.name", "tool_choice.name"),
               ("function.parameters", "parameters"), ("function.name", "name"))
#: a named tool choice, as this request writes one (chat's errors show chat's)
_TOOL_CHOICE_USAGE = 'Correct usage: `{"type": "function", "name": "my_function"}`'
#: what ``include`` may name (vLLM's ``ResponsesRequest``): this server has
#: only the output's logprobs to include; the others name what it never
#: makes (image inputs' urls, tool outputs, reasoning), so they add nothing
INCLUDABLE = Literal["code_interpreter_call.outputs", "computer_call_output.output.image_url",
                     "file_search_call.results", "message.input_image.image_url",
                     "message.output_text.logprobs", "reasoning.encrypted_content"]
#: the sampling fields a Responses request shares with chat, by the same name
_SAMPLING = ("model", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
             "frequency_penalty", "repetition_penalty", "min_tokens", "seed", "stop", "stop_token_ids",
             "ignore_eos", "logit_bias", "skip_special_tokens", "include_stop_str_in_output",
             "user", "request_id", "stream")


class InputText(Strict):
    """A message's text part: the client's own (input_text) or an earlier
    answer's (output_text, as the openai client dumps it)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list | None = None
    logprobs: list | None = None


class InputMessage(Strict):
    """One turn of ``input`` (OpenAI's EasyInputMessage, or an earlier
    answer's output message as the openai client dumps it)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class UsageOptions(Strict):
    """stream_options, as AIPerf sends it to count tokens by the server's
    usage: a streamed Response's usage is always in its response.completed
    event, so include_usage asks for nothing more."""

    include_usage: bool | None = None


class TextFormat(Strict):
    """OpenAI's text.format: text, json_object, or json_schema (its fields
    beside the type, where chat's response_format nests them)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    def response_format(self) -> dict | None:
        """Chat's response_format of it (None: plain text)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        schema = {name: value for name, value in (
            ("name", self.name), ("schema", self.schema_), ("strict", self.strict),
            ("description", self.description)) if value is not None}
        return {"type": "json_schema", "json_schema": schema}


class TextConfig(Strict):
    format: TextFormat | None = None


class ResponsesRequest(Strict):
    """vLLM's ``ResponsesRequest``: the fields it takes for a text answer,
    the same names and defaults; what this server cannot do, ``_REFUSED``."""

    model: str | None = None
    input: str | list[InputMessage | FunctionCallItem | FunctionCallOutputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    stream: bool | None = False
    stream_options: UsageOptions | None = None
    store: bool | None = True
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool | None = True
    tool_choice: Literal["auto", "none", "required"] | FunctionChoice | None = "auto"
    tools: list[FunctionTool] | None = None
    text: TextConfig | None = None
    #: auto: the input's last tokens that fit (chat's truncate_prompt_tokens -1, as vLLM's)
    truncation: Literal["auto", "disabled"] | None = "disabled"
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] = "auto"
    background: bool | None = False
    previous_response_id: str | None = None
    #: what the answer includes beyond its text (``INCLUDABLE``)
    include: list[INCLUDABLE] | None = None
    #: accepted and answered as sent, as vLLM does for a model that does not
    #: reason (no reasoning item comes) and for function tools, which the
    #: client calls (vLLM's max_tool_calls bounds its own built-in tools)
    reasoning: dict[str, Any] | None = None
    top_logprobs: int | None = 0
    max_tool_calls: int | None = None
    prompt: dict[str, Any] | None = None
    user: str | None = None
    request_id: str | None = None
    # vLLM's sampling extras
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    #: chat's (vLLM's Responses request has none, and ignores it as any extra field)
    min_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False


def plan_response(body: bytes, served: Served) -> tuple[ResponsesRequest, Plan]:
    """The request (RequestError if bad) and the one generation it asks for."""
    request = parse(ResponsesRequest, body)
    for name, allowed, why in _REFUSED:
        if getattr(request, name) not in (None, allowed):
            raise RequestError(why, name)
    if request.stream_options is not None and not request.stream:
        raise RequestError("stream_options is only allowed with stream true", "stream_options")
    try:
        plans = plan_chat(to_chat(request, served.tool_parser != "none"), served)
    except RequestError as error:  # named as this request names the field
        raise error.named_as(_CHAT_NAMES, whole=("messages",), usage=_TOOL_CHOICE_USAGE) from None
    return request, plans[0]


def to_chat(request: ResponsesRequest, parsed: bool = True) -> ChatCompletionRequest:
    """The chat request a Responses request is: its instructions a system
    turn first, then its input (a string: one user turn). Without a tool
    call parser (`parsed` false) ``auto`` answers in text, the tools in the
    template, as vLLM 0.32's Responses API answers it (its renderer asks
    for no parser there, its output items are then the text: vllm/
    entrypoints/openai/responses/serving.py, ``_make_response_output_items``);
    chat refuses it."""
    turns = [{"role": "user", "content": request.input}] if isinstance(request.input, str) else []
    for item in [] if isinstance(request.input, str) else request.input:
        if isinstance(item, InputMessage):
            turns.append({"role": item.role, "content": item.text})
        else:
            chat_turn(item, turns)
    if request.instructions is not None:
        turns.insert(0, {"role": "system", "content": request.instructions})
    fields = {name: getattr(request, name) for name in _SAMPLING if getattr(request, name) is not None}
    if request.max_output_tokens is not None:
        fields["max_tokens"] = request.max_output_tokens
    if request.truncation == "auto":
        fields["truncate_prompt_tokens"] = -1
    choice = request.tool_choice
    if not parsed and choice in (None, "auto"):
        choice = "none"
    fields.update(chat_tools(request.tools, choice, request.parallel_tool_calls))
    if request.text is not None and request.text.format is not None:
        fields["response_format"] = request.text.format.response_format()
    if logprobs_included(request):
        fields.update(logprobs=True, top_logprobs=request.top_logprobs or 0)
    elif request.top_logprobs:
        raise RequestError("top_logprobs needs include [\"message.output_text.logprobs\"]",
                           "top_logprobs")
    try:
        return ChatCompletionRequest.model_validate({**fields, "messages": turns})
    except ValidationError as error:  # what chat refuses among the shared fields
        first = error.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise RequestError(f"{param}: {first['msg']}", param) from None


def logprobs_included(request: ResponsesRequest) -> bool:
    return bool(request.include) and "message.output_text.logprobs" in request.include


def response(request: ResponsesRequest, plan: Plan, chunks: list[Chunk], served: Served,
             status: str = "completed", logprobs: list | None = None) -> dict:
    """The Response object of a generation's responses (`chunks`, all of
    them for ``completed``: an answer cut at max_output_tokens is
    ``incomplete``, as vLLM's ``ResponsesResponse.from_request`` says it),
    or, with none, its opening state (``in_progress``). logprobs: its
    tokens' (chat's entries), where the request includes them (None:
    taken from `chunks`)."""
    if chunks and chunks[-1].finish_reason == "length":
        status = "incomplete"
    if logprobs is None:
        logprobs = answers.logprob_entries(plan, chunks, served.codec)
    final = chunks[-1] if chunks and chunks[-1].finish_reason else None
    output = [] if final is None else output_items(plan, chunks, status, logprobs)
    params = plan.params
    return {
        "id": response_id(request, plan), "object": "response", "created_at": plan.created,
        "status": status, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request.instructions, "max_output_tokens": params["max_tokens"],
        "metadata": request.metadata or {}, "model": served.model_id, "output": output,
        "parallel_tool_calls": request.parallel_tool_calls, "previous_response_id": None,
        "reasoning": request.reasoning, "max_tool_calls": request.max_tool_calls,
        "service_tier": request.service_tier, "store": False,
        "temperature": params.get(PARAM_INPUTS["temperature"], 1.0),
        "text": {"format": text_format(request)},
        "tool_choice": (request.tool_choice.model_dump() if isinstance(request.tool_choice, FunctionChoice)
                        else request.tool_choice or "auto"),
        "tools": [tool.model_dump(exclude_none=True) for tool in request.tools or []],
        "top_logprobs": request.top_logprobs or 0,
        "top_p": params.get(PARAM_INPUTS["top_p"], 1.0),
        "truncation": request.truncation or "disabled", "user": request.user,
        "usage": None if final is None else usage(final),
    }


def output_items(plan: Plan, chunks: list[Chunk], status: str, logprobs: list) -> list[dict]:
    """An answer's output items: the assistant's message, and with tools the
    calls it made (``tools.ToolUse.answer``: chat's; the message only where
    it has text beside them)."""
    text = "".join(c.text for c in chunks)
    if plan.tools is None:
        return [message(plan, text, status, logprobs)]
    content, calls = plan.tools.answer(text, chunks[-1].finish_reason)
    return ([message(plan, content, status, logprobs)] if content else []) + [
        function_call(call) for call in calls]


def text_format(request: ResponsesRequest) -> dict:
    """The answer's text.format: the request's, as it came (text by default)."""
    if request.text is None or request.text.format is None:
        return {"type": "text"}
    return request.text.format.model_dump(by_alias=True, exclude_none=True)


def usage(final: Chunk) -> dict:
    """The Responses API's usage of a generation (its final response)."""
    prompt, generated = final.num_input_tokens, final.num_output_tokens
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + generated}


def response_id(request: ResponsesRequest, plan: Plan) -> str:
    """The answer's id: the request's request_id as it came (vLLM's), else resp_ and a new one."""
    return request.request_id or f"resp_{plan.id}"


def message(plan: Plan, text: str, status: str, logprobs: list = ()) -> dict:
    """The answer's one output item: the assistant's message."""
    return {"id": f"msg_{plan.id}", "type": "message", "status": status, "role": "assistant",
            "content": [output_text(text, logprobs)] if status != "in_progress" else []}


def output_text(text: str, logprobs: list = ()) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs)}


class ResponseEvents:
    """A streamed Response's events, in vLLM's order for a text answer
    (``responses_stream_generator`` with ``SimpleStreamingEventProcessor``):
    response.created and response.in_progress, the message's
    output_item.added and content_part.added, an output_text.delta per
    response with text, then output_text.done, content_part.done,
    output_item.done and response.completed; each numbered
    (``sequence_number``). A named function's call streams its arguments as
    they come (its output_item.added first, a function_call_arguments.delta
    per response), as chat streams a named call; with other tools the
    answer's items (its calls, and its text beside them) come whole at its
    end, as chat's calls do (their text is read whole: ``tools.ToolUse``):
    each item's added, delta, done."""

    def __init__(self, request: ResponsesRequest, plan: Plan, served: Served):
        self.request, self.plan, self.served = request, plan, served
        self.chunks: list[Chunk] = []
        self.logprobs: list[dict] = []  # the tokens' so far, where included
        self.sequence = 0
        self.streams_text = plan.tools is None
        #: a named function's call, streamed as it comes: its item as opened
        self.call = (function_call(new_call(plan.tools.name, ""), "in_progress")
                     if plan.tools is not None and plan.tools.name is not None else None)

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def opening(self) -> list[dict]:
        opened = response(self.request, self.plan, [], self.served, "in_progress")
        events = [self._event("response.created", response=opened),
                  self._event("response.in_progress", response=opened)]
        if self.call is not None:
            return [*events, self._event("response.output_item.added", output_index=0,
                                         item=self.call)]
        return events + (self._message_opening(0) if self.streams_text else [])

    def _message_opening(self, index: int) -> list[dict]:
        return [self._event("response.output_item.added", output_index=index,
                            item=message(self.plan, "", "in_progress")),
                self._event("response.content_part.added", part=output_text(""),
                            **self._place(index))]

    def _place(self, index: int) -> dict:
        return {"item_id": f"msg_{self.plan.id}", "output_index": index, "content_index": 0}

    def delta(self, chunk: Chunk) -> list[dict]:
        """A response's text as a delta (none without text or with tools),
        and, after the final one, the events that close the answer."""
        self.chunks.append(chunk)
        logprobs = answers.logprob_entries(self.plan, [chunk], self.served.codec)
        self.logprobs += logprobs
        events = [self._event("response.output_text.delta", delta=chunk.text, logprobs=logprobs,
                              **self._place(0))] if self.streams_text and (
            chunk.text or logprobs) else []
        if self.call is not None and chunk.text:
            events.append(self._event("response.function_call_arguments.delta", delta=chunk.text,
                                      item_id=self.call["id"], output_index=0))
        if not chunk.finish_reason:
            return events
        done = response(self.request, self.plan, self.chunks, self.served,
                        logprobs=self.logprobs)
        for index, item in enumerate(done["output"]):
            if item["type"] == "message":
                events += self._message_closing(index, item)
            elif self.call is not None:  # the call streamed: the same ids, closed
                item.update(id=self.call["id"], call_id=self.call["call_id"])
                events += self._call_events(index, item, streamed=True)
            else:
                events += self._call_events(index, item)
        return [*events, self._event("response.completed", response=done)]

    def _message_closing(self, index: int, item: dict) -> list[dict]:
        """The message's closing events (and, unless streamed, its opening and text)."""
        part = item["content"][0]
        events = [] if self.streams_text else [
            *self._message_opening(index),
            self._event("response.output_text.delta", delta=part["text"],
                        logprobs=part["logprobs"], **self._place(index))]
        return [*events,
                self._event("response.output_text.done", text=part["text"],
                            logprobs=part["logprobs"], **self._place(index)),
                self._event("response.content_part.done", part=part, **self._place(index)),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _call_events(self, index: int, item: dict, streamed: bool = False) -> list[dict]:
        """A function call's events (vLLM's function_call_arguments): whole,
        or, `streamed` already, its closing ones."""
        place = {"item_id": item["id"], "output_index": index}
        events = [] if streamed else [
            self._event("response.output_item.added", output_index=index,
                        item={**item, "arguments": "", "status": "in_progress"}),
            self._event("response.function_call_arguments.delta", delta=item["arguments"],
                        **place)]
        return [*events,
                self._event("response.function_call_arguments.done", name=item["name"],
                            arguments=item["arguments"], **place),
                self._event("response.output_item.done", output_index=index, item=item)]

    def error(self, body: dict) -> dict:
        """OpenAI's stream error event of an error object's body."""
        error = body["error"]
        return self._event("error", code=error.get("code") or error["type"],
                           message=error["message"], param=error.get("param"))


def sse(event: dict) -> bytes:
    """One server-sent event of the Responses API: its type named (vLLM's
    ``_convert_stream_to_sse_events``); no ``[DONE]`` ends the stream."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()


#: the Responses API as ``event_apis.serve`` answers it
API = EventApi(plan_response, response, ResponseEvents, sse)
