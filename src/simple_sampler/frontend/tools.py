"""Tool calls at the OpenAI door: ``tools`` go to the chat template;
``tool_choice`` ``none`` answers in text, a named function or ``required``
holds the answer to a JSON schema (``serving.structured``) whose output is
the call(s), answered as ``tool_calls`` (vLLM 0.32 refuses these two
without a tool call parser; a grammar needs none). ``auto`` needs a
model-specific parser of free text (vLLM's ``--tool-call-parser``; here
``serve --tool-call-parser hermes``, :func:`hermes_calls`), and is refused
as vLLM refuses it without one.

The calls' shape follows vLLM 0.32 (vllm/tool_parsers/utils.py,
``get_json_schema_from_tools``; vllm/entrypoints/openai/chat_completion/
serving.py, the full and streaming generators): the named function's
``parameters`` is the schema (no parameters: an empty object); ``required``
is an array of ``{"name", "parameters"}`` objects, one of the tools each,
at least one (at most one with ``parallel_tool_calls`` false), each tool's
``$defs`` lifted to the top. The calls' ids are ``chatcmpl-tool-<hex>``,
the message's content "".
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from ..serving.structured import Guide
from .protocol import (CHAT_TOOL_CHOICE_USAGE, ChatCompletionRequest, ChatMessage, NamedToolChoice,
                       RequestError)

#: the Hermes format's tags (Qwen2.5's and Hermes' chat templates):
#: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolUse:
    """A request's forced tool calls: the named function (`name`), or
    ``required`` (`name` None: any of the tools, `parallel` false: one)."""

    name: str | None
    parallel: bool = True
    #: ``auto``: the parser of the free text's calls (``FrontendSettings.tool_call_parser``)
    parser: str | None = None

    def answer(self, text: str, finish_reason: str = "stop") -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of an answer's text: ``auto``'s parsed out
        of free text (content before the first call; the whole text and no
        call where they do not parse); a forced call's "" and its calls."""
        if self.parser is None:
            return "", self.calls(text, finish_reason)
        content, calls = hermes_calls(text)
        return content, calls if self.parallel else calls[:1]

    def calls(self, text: str, finish_reason: str = "stop") -> list[dict]:
        """The answer's ``tool_calls`` from its text (its grammar's output)
        and how it ended; RequestError where the text is not a whole list
        of calls (cut by max_tokens, or a stop string): a client's limit
        that cut the calls is named (vLLM 0.32 answers no calls, 200)."""
        if self.name is not None:
            return [new_call(self.name, text)]
        try:
            calls = json.loads(text)
            if not isinstance(calls, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
                raise ValueError("not a list of {name, parameters} objects")
        except ValueError as error:
            cut = finish_reason == "length"
            raise RequestError(
                f"the answer is not a whole list of tool calls ({error}): "
                f"{'max_tokens cut it; give more' if cut else 'a stop ended it early'}",
                "max_tokens" if cut else "stop") from None
        calls = calls if self.parallel else calls[:1]
        return [new_call(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False))
                for c in calls]


def new_call(name: str, arguments: str) -> dict:
    """A ``tool_calls`` item: a call of `name` with `arguments` (JSON text),
    its id new."""
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def tool_use(request: ChatCompletionRequest, parser: str = "none"
             ) -> tuple[ToolUse | None, Guide | None]:
    """The request's tool calls and the grammar that forces them (None,
    None: an answer in text; a ToolUse and None: ``auto``, parsed out of
    the text by `parser`); RequestError naming the field, in vLLM's
    words."""
    tools, choice = request.tools, request.tool_choice
    if tools is not None and not tools:
        raise RequestError("tools must not be an empty array: give at least one tool or omit "
                           "the field", "tools")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None, None
    if not tools:
        raise RequestError("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice == "auto":
        if parser == "none":
            raise RequestError('"auto" tool choice needs a tool call parser: this server runs '
                               'without one (serve --tool-call-parser hermes; vLLM: '
                               '--enable-auto-tool-choice and --tool-call-parser): send '
                               'tool_choice "required", a named function or "none"',
                               "tool_choice")
        return ToolUse(None, request.parallel_tool_calls is not False, parser), None
    if isinstance(choice, NamedToolChoice):
        chosen = [tool.function for tool in tools if tool.function.name == choice.function.name]
        if not chosen:
            raise RequestError(f"The tool specified in `tool_choice` "
                               f"({choice.function.name}) does not match any of the specified "
                               f"`tools`. {CHAT_TOOL_CHOICE_USAGE}", "tool_choice")
        schema = chosen[0].parameters or {"type": "object", "properties": {}}
        return ToolUse(choice.function.name), Guide("json_schema", json.dumps(schema))
    parallel = request.parallel_tool_calls is not False
    return ToolUse(None, parallel), Guide("json_schema", json.dumps(_required_schema(request,
                                                                                     parallel)))


def _required_schema(request: ChatCompletionRequest, parallel: bool) -> dict:
    """``required``'s schema: an array of calls of the tools (module docstring)."""
    choices, definitions = [], {}
    for tool in request.tools:
        parameters = dict(tool.function.parameters or {"type": "object", "properties": {}})
        for name, definition in parameters.pop("$defs", {}).items():
            if definitions.setdefault(name, definition) != definition:
                raise RequestError(f"Tool definition '{name}' has multiple schemas, which is "
                                   f"not supported.", "tools")
        choices.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                       "parameters": parameters},
                        "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": choices}}
    if not parallel:
        schema["maxItems"] = 1
    if definitions:
        schema["$defs"] = definitions
    return schema


def hermes_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a free answer in the Hermes format, as
    vLLM's hermes parser reads it (vllm/tool_parsers/hermes_tool_parser.py):
    each ``<tool_call>`` block (its closing tag may
    be cut off) a JSON object of ``name`` and ``arguments``; the content
    the text before the first (None where empty). Where a block does not
    parse, the whole text is the content and there is no call."""
    start = text.find(HERMES_OPEN)
    if start < 0:
        return text, []
    try:
        blocks = [json.loads(block) for block in _HERMES_CALL.findall(text, start)]
        calls = [new_call(block["name"], json.dumps(block.get("arguments", {}),
                                                    ensure_ascii=False))
                 for block in blocks]
    except (ValueError, KeyError, TypeError, AttributeError):
        return text, []
    if not all(isinstance(block.get("name"), str) for block in blocks):
        return text, []
    return text[:start] or None, calls


def held_back(text: str) -> int:
    """How many characters at the end of `text` could begin a Hermes call's
    tag, and so wait for the next piece before they are content."""
    return next((n for n in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1)
                 if HERMES_OPEN.startswith(text[-n:])), 0)


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the chat template reads them, as vLLM hands them
    (vllm/renderers/chat_utils.py, ``_postprocess_messages``): a call's
    arguments as their JSON object, a tool's answer with the id of the
    call it answers; null content only in an assistant's turn that calls."""
    turns = []
    for i, message in enumerate(messages):
        if message.content is None and not (message.role == "assistant" and message.tool_calls):
            raise RequestError(f"messages.{i}.content may be null only in an assistant's turn "
                               f"with tool_calls", f"messages.{i}.content")
        turn = {"role": message.role, "content": message.text,
                **({"name": message.name} if message.name else {})}
        if message.tool_calls:
            turn["tool_calls"] = [{"id": call.id, "type": call.type, "function": {
                "name": call.function.name,
                "arguments": _arguments(call.function.arguments,
                                        f"messages.{i}.tool_calls.{j}.function.arguments")}}
                for j, call in enumerate(message.tool_calls)]
        if message.tool_call_id is not None:
            turn["tool_call_id"] = message.tool_call_id
        turns.append(turn)
    return turns


def _arguments(text: str, place: str) -> dict:
    """A call's arguments as the template reads them: their JSON object ({}
    for none), as vLLM parses them; RequestError naming `place` where they
    are not a JSON object (vLLM 0.32 hands the template {} instead, with a
    warning in its log: a call cut short would be replayed as a call of no
    arguments)."""
    try:
        arguments = json.loads(text) if text else {}
    except ValueError as error:
        raise RequestError(f"{place} must be a JSON object: {error}", place) from None
    if not isinstance(arguments, dict):
        raise RequestError(f"{place} must be a JSON object, got {text!r}", place)
    return arguments
