"""Function tools in OpenAI's Responses API (``frontend/responses.py``), as
chat's tools (``frontend/tools.py``): a Responses function tool is chat's
``{"type": "function", "function": {...}}``, its tool_choice chat's, an
input's ``function_call`` item an assistant's turn with ``tool_calls``, a
``function_call_output`` item a tool's turn; an answer's calls become
``function_call`` output items (vLLM 0.32's ``ResponsesRequest`` and
``_make_response_output_items``, vllm/entrypoints/openai/responses/)."""
from __future__ import annotations

from typing import Any, Literal

from .protocol import Strict


class FunctionTool(Strict):
    """A function the model may call (OpenAI's FunctionTool)."""

    type: Literal["function"]
    name: str
    description: str | None = None
    #: a JSON schema of the arguments (none: no arguments)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(Strict):
    """tool_choice naming one function (OpenAI's ToolChoiceFunction)."""

    type: Literal["function"]
    name: str


class FunctionCallItem(Strict):
    """An earlier answer's call, in ``input``."""

    type: Literal["function_call"]
    call_id: str
    name: str
    #: the arguments as JSON text, as the model wrote them
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Strict):
    """What a call returned, in ``input``: the tool's turn."""

    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


def chat_tools(tools: list[FunctionTool] | None, choice, parallel: bool | None) -> dict:
    """Chat's tools, tool_choice and parallel_tool_calls of a Responses
    request's (none where it has no tools and chooses auto or none, chat's
    own default then)."""
    fields = {}
    if tools:
        fields["tools"] = [{"type": "function", "function": tool.model_dump(
            exclude={"type"}, exclude_none=True)} for tool in tools]
        fields["parallel_tool_calls"] = parallel is not False
    if isinstance(choice, FunctionChoice):
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif tools or choice not in (None, "auto", "none"):
        fields["tool_choice"] = choice
    return fields


def chat_turn(item, turns: list[dict]) -> None:
    """Append a call or its output as chat turns: consecutive calls are one
    assistant's turn."""
    if isinstance(item, FunctionCallOutputItem):
        turns.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        return
    call = {"id": item.call_id, "type": "function",
            "function": {"name": item.name, "arguments": item.arguments}}
    if turns and turns[-1]["role"] == "assistant" and turns[-1].get("tool_calls"):
        turns[-1]["tool_calls"].append(call)
    else:
        turns.append({"role": "assistant", "content": None, "tool_calls": [call]})


def function_call(call: dict, status: str = "completed") -> dict:
    """The output item of one of an answer's ``tool_calls`` (chat's form)."""
    return {"type": "function_call", "id": f"fc_{call['id'].rsplit('-', 1)[-1]}",
            "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}
