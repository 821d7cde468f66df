"""The OpenAI request bodies this front door accepts, as pydantic models, and
OpenAI's error shape.

Types are strict where the OpenAI API is (an integer field refuses ``16.0``,
``1e9`` and ``"16"``; a number field refuses strings and non-finite values,
so ``1e999`` and ``NaN`` are errors, not infinities), and every model forbids
fields it does not know, so a misspelt ``temprature`` is a 400 naming it
instead of a default silently applied. Standard OpenAI fields this server
does not implement are refused by name as "not supported" unless they are
null (or ``user``, an end-user label with no effect on the answer). Ranges
that depend on the served model (``max_tokens`` against its context) and
the sampling parameters' ranges (``params.RULES``) are checked when the
request is translated (``translate.py``), not here.

Follows OpenAI's API reference for ``/v1/completions`` and
``/v1/chat/completions``; the extensions ``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``include_stop_str_in_output``, ``prompt_logprobs``, ``truncate_prompt_tokens``,
``skip_special_tokens``, ``add_special_tokens``,
chat's ``add_generation_prompt``, ``continue_final_message`` and
``chat_template_kwargs``, ``allowed_token_ids``, ``bad_words``,
``return_token_ids``, ``return_tokens_as_token_ids``, ``request_id``,
``session_id``, ``cache_salt``, ``priority``, ``spaces_between_special_tokens``,
``stream_interval``, chat's ``echo``, ``documents`` and ``return_prompt_text``,
``structured_outputs`` and
the ``guided_*`` fields, and ``stream_options.continuous_usage_stats`` are
vLLM's (vllm-project/vllm 0.32, ``vllm/entrypoints/openai/completion/
protocol.py`` ``CompletionRequest``, ``.../chat_completion/protocol.py``
``ChatCompletionRequest``), as are the bodies of its ``/tokenize`` and
``/detokenize`` (``vllm/entrypoints/serve/tokenize/protocol.py``:
``TokenizeCompletionRequest``, ``TokenizeChatRequest``, ``DetokenizeRequest``).
"""
from __future__ import annotations

import re
from typing import Any, Literal, Sequence

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from ..schema import InvalidRequest

#: OpenAI's request fields this server does not implement (refused by name
#: unless null); everything else not declared below is an unknown field.
UNSUPPORTED = frozenset({
    "suffix", "functions", "function_call", "audio", "modalities", "prediction",
    "reasoning_effort", "web_search_options", "service_tier", "store", "metadata",
})


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class Request(Strict):
    """A request body: OpenAI's request fields this server does not
    implement are refused by name (inside a message or ``stream_options``
    they are unknown fields, named by their path)."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data):
        if isinstance(data, dict):
            for name in sorted(UNSUPPORTED & data.keys()):
                if data[name] is not None:
                    raise UnsupportedField(name)
            data = {k: v for k, v in data.items() if k not in UNSUPPORTED}
        return data


class UnsupportedField(ValueError):
    """A standard OpenAI field this server does not implement."""

    def __init__(self, name: str):
        super().__init__(f"{name} is not supported by this server")
        self.field = name


class StreamOptions(Strict):
    include_usage: bool | None = False
    #: vLLM's: with include_usage, every chunk carries the usage so far
    continuous_usage_stats: bool | None = False


class Sampling(Request):
    """The fields both endpoints share."""

    #: None: the served model (vLLM's field is optional too)
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    #: the only tokens the answer may hold
    allowed_token_ids: list[int] | None = None
    #: words never generated, at the text's start or after a space
    bad_words: list[str] | None = None
    #: the prompt's and the answer's token ids beside the text
    return_token_ids: bool | None = None
    #: logprobs name their tokens "token_id:N" instead of by their text
    return_tokens_as_token_ids: bool | None = None
    #: the answer's id (else a random one; an X-Request-Id header wins)
    request_id: str | None = None
    #: accepted, with no effect here (frontend/envelope.py)
    session_id: str | None = None
    cache_salt: str | None = None
    priority: int | None = None
    spaces_between_special_tokens: bool | None = None
    #: a stream's tokens per chunk, at least the server's
    stream_interval: int | None = None
    include_stop_str_in_output: bool | None = False
    #: the prompt's logprobs and the n most likely at each of its places
    prompt_logprobs: int | None = None
    #: the prompt's last k tokens are sent (-1: the context's worth)
    truncate_prompt_tokens: int | None = None
    #: with it, "left" (the last k, special tokens and all) or "right" (the first k)
    truncation_side: Literal["left", "right"] | None = None
    #: false: special tokens' text (<|im_end|>) is kept in the answer
    skip_special_tokens: bool = True
    #: the output held to a grammar (frontend/response_format.py): OpenAI's
    #: response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None


class CompletionRequest(Sampling):
    #: one prompt: text or token ids, alone or as a list of one (what
    #: genai-perf and lm-eval send)
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = False
    best_of: int | None = None
    #: vLLM's: the tokenizer's special tokens (a BOS) added to a text prompt
    add_special_tokens: bool = True
    #: OpenAI: how many most likely tokens to return per position (0-5; vLLM
    #: and here: up to sampling.MAX_TOP_LOGPROBS, 20), with the chosen one's
    logprobs: int | None = None


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str
    #: the arguments as JSON text, as the model wrote them
    arguments: str


class ToolCall(Strict):
    """A call an assistant's turn made (OpenAI's ``tool_calls`` item)."""

    id: str
    type: Literal["function"]
    function: FunctionCall


#: fields of an assistant's message as the openai client dumps it
#: (``ChatCompletionMessage.model_dump()``), taken when null (vLLM ignores them)
MESSAGE_UNSUPPORTED = frozenset({"refusal", "annotations", "audio", "function_call"})


class ChatMessage(Strict):
    """One turn; the openai client's own assistant message, dumped, is one
    too (its fields this server does not implement taken when null)."""

    @model_validator(mode="before")
    @classmethod
    def _null_client_fields(cls, data):
        """The dumped client message's null fields dropped; one that is not
        null stays, an unknown field named by its path."""
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if k not in MESSAGE_UNSUPPORTED or v is not None}
        return data

    role: Literal["system", "developer", "user", "assistant", "tool"]
    #: null only in an assistant's turn that calls tools
    content: str | list[TextPart] | None
    #: OpenAI's participant name: passed to the chat template, which may use it
    name: str | None = None
    #: an assistant's calls; a tool's answer names the call it answers
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @property
    def text(self) -> str:
        """The turn's text; text parts joined with newlines, as vLLM does
        (vllm/renderers/chat_utils.py, ``_parse_chat_message_content_parts``);
        "" for an assistant's null content."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class Function(Strict):
    name: str
    description: str | None = None
    #: a JSON schema of the arguments (none: no arguments)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: Function


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatTemplate(Request):
    """vLLM's chat template controls (vllm/entrypoints/openai/chat_completion/protocol.py,
    ``ChatCompletionRequest`` and ``TokenizeChatRequest``: the same names
    and defaults); both true is refused there as here (``translate``)."""

    messages: list[ChatMessage]
    #: the assistant's turn opened after the messages
    add_generation_prompt: bool = True
    #: the last message (the assistant's) left open, to be continued
    continue_final_message: bool = False
    #: the tokenizer's special tokens on top of the template's
    add_special_tokens: bool = False
    #: more variables for the template (Qwen3's enable_thinking)
    chat_template_kwargs: dict[str, Any] | None = None
    #: functions the model may call, handed to the template (frontend/tools.py)
    tools: list[Tool] | None = None
    #: texts for a retrieval-augmented template
    documents: list[dict[str, str]] | None = None


class ChatCompletionRequest(ChatTemplate, Sampling):
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    #: none, auto (refused: no tool parser here), required, or a named function
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    #: false: at most one call (tool_choice required)
    parallel_tool_calls: bool | None = None
    #: vLLM's: the answer starts with the last message's content where it
    #: is the assistant's (a continued turn)
    echo: bool | None = False
    #: vLLM's: the chat template's text beside the answer (``prompt_text``)
    return_prompt_text: bool | None = None


class TokenizeCompletionRequest(Request):
    """vLLM's ``/tokenize`` of a prompt (``TokenizeCompletionRequest``)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(ChatTemplate):
    """vLLM's ``/tokenize`` of chat messages (``TokenizeChatRequest``)."""

    model: str | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(Request):
    """vLLM's ``/detokenize`` (``DetokenizeRequest``)."""

    model: str | None = None
    tokens: list[int]


#: vLLM's words for a named tool choice's errors: chat's shape of one
CHAT_TOOL_CHOICE_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


class RequestError(InvalidRequest):
    """A client mistake (``schema.InvalidRequest``), in OpenAI's error shape:
    its status (400 unless said), field, code and type.

    param: the request field it concerns (dotted path), or None."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.status, self.code, self.kind = param, status, code, kind

    def body(self) -> dict:
        return error_body(str(self), self.kind, self.param, self.code)

    def named_as(self, names: Sequence[tuple[str, str]], whole: Sequence[str] = (),
                 usage: str | None = None) -> "RequestError":
        """This error of a chat request made from another API's request
        (Responses, Anthropic's Messages), its field named as that request
        names it: by the first of `names` (chat's dotted path, that API's)
        that starts the field's path, else by the first that names a
        function's field (``function.X``) inside it; those in `whole`
        rename the field whole, the last part kept in the message (a
        turn's field is the messages' or the input's: a system turn and
        tool results made turns shift chat's indices); and chat's example of
        a named tool choice as that API writes one (`usage`)."""
        param = name = self.param or ""
        prefixed = next(((chat, ours) for chat, ours in names
                         if param == chat or param.startswith(chat + ".")), None)
        inside = next(((chat, ours) for chat, ours in names
                       if chat.startswith("function.") and f".{chat}." in f"{param}."), None)
        if prefixed:
            chat, ours = prefixed
            last = param.rsplit(".", 1)[-1]
            name = ours + param[len(chat):] if chat not in whole else ours
            shown = name if chat not in whole or param == chat or last.isdigit() else f"{ours} ({last})"
        elif inside:
            chat, ours = inside
            name = shown = f"{param}.".replace(f".{chat}.", f".{ours}.", 1)[:-1]
        message = str(self)
        if name != param:  # the field where it stands as a name, not inside a longer one
            message = re.sub(rf"(?<![\w.]){re.escape(param)}(?![\w.]*\w)", lambda _: shown, message)
        if usage is not None:
            message = message.replace(CHAT_TOOL_CHOICE_USAGE, usage)
        return RequestError(message, name or self.param, self.status, self.code, self.kind)


def error_body(message: str, kind: str, param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


_TYPE_TAGS = ("str", "int", "float", "bool")


def _is_tag(part) -> bool:
    """A union member's tag in an error location ("str", "list[int]"), not a field."""
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part)


def _location(loc) -> str:
    return ".".join(str(part) for part in loc if not _is_tag(part))


def parse(model: type[Strict], body: bytes) -> Strict:
    """The request ``body`` (JSON) as ``model``; raises RequestError naming
    the first field that is missing, unknown, unsupported or of the wrong
    type."""
    try:
        return model.model_validate_json(body)
    except ValidationError as error:
        first = error.errors(include_url=False)[0]
        if first["type"] == "json_invalid":
            raise RequestError(f"the body is not valid JSON: {first['msg']}") from None
        if first["type"] == "value_error" and isinstance(first.get("ctx", {}).get("error"),
                                                         UnsupportedField):
            unsupported = first["ctx"]["error"]
            raise RequestError(str(unsupported), unsupported.field,
                               code="unsupported_parameter") from None
        param = _location(first["loc"])
        if first["type"] == "value_error":  # a validator's own sentence, whole
            raise RequestError(f"{param}: {first['ctx']['error']}", param or None) from None
        if first["type"] == "model_type":
            raise RequestError(f"{param or 'the body'} must be a JSON object", param or None) from None
        if first["type"] == "extra_forbidden":
            raise RequestError(f"unknown field {param}", param,
                               code="unknown_parameter") from None
        if first["type"] == "missing":
            raise RequestError(f"{param} is required", param) from None
        tags = [part for e in error.errors(include_url=False) if (_location(e["loc"]) + ".").startswith(param + ".")
                for part in e["loc"] if _is_tag(part)]
        if tags:  # a union: name its members rather than the first one's complaint
            raise RequestError(f"{param} must be one of: {', '.join(dict.fromkeys(tags))}; got "
                               f"{first['input']!r}", param) from None
        raise RequestError(f"{param}: {first['msg']}, got {first['input']!r}", param) from None
