"""vLLM's request fields that shape a generation's envelope, not its
tokens: the answer's id (``request_id``, or an ``X-Request-Id`` header, as
vLLM's ``_base_request_id`` reads them), a stream's tokens per chunk
(``stream_interval``), chat's ``echo`` and ``return_prompt_text``, and the
fields accepted with no effect here (vllm/entrypoints/openai/
chat_completion/protocol.py, ``ChatCompletionRequest``)."""
from __future__ import annotations

from .protocol import ChatCompletionRequest, RequestError, Sampling

#: vLLM's bounds on cache_salt's length
CACHE_SALT_CHARACTERS = (1, 1024)
#: the stream_interval input's type, INT32
MAX_STREAM_INTERVAL = 2**31 - 1


def check_inert(request: Sampling) -> None:
    """The fields that change nothing here, checked as vLLM checks them:
    ``priority`` 0 only (vLLM refuses another without priority scheduling;
    requests here are served first come, first served), ``cache_salt`` a
    string of 1 to 1,024 characters (no prefix cache here to salt),
    ``spaces_between_special_tokens`` true only (vLLM's default; the
    decode loop's text has no other form), ``session_id`` any string."""
    if request.priority not in (None, 0):
        raise RequestError(f"priority must be 0: this server schedules requests first come, "
                           f"first served, got {request.priority}", "priority")
    low, high = CACHE_SALT_CHARACTERS
    if request.cache_salt is not None and not low <= len(request.cache_salt) <= high:
        raise RequestError(f"cache_salt must be a string of {low} to {high} characters, got "
                           f"{len(request.cache_salt)}", "cache_salt")
    if request.spaces_between_special_tokens is False:
        raise RequestError("spaces_between_special_tokens must be true (vLLM's default): "
                           "false is not supported by this server",
                           "spaces_between_special_tokens", code="unsupported_parameter")


def stream_interval(request: Sampling, server_interval: int) -> int | None:
    """The ``stream_interval`` input for a request (None: the server's):
    vLLM's, the request's k raised to the server's setting; not sent for a
    request that is not streamed (vLLM ignores it there)."""
    k = request.stream_interval
    if k is None:
        return None
    if isinstance(k, bool) or not 1 <= k <= MAX_STREAM_INTERVAL:
        raise RequestError(f"stream_interval must be an integer in [1, {MAX_STREAM_INTERVAL}], "
                           f"got {k}", "stream_interval")
    return max(k, server_interval) if request.stream else None


def echoed(request: ChatCompletionRequest) -> str | None:
    """Chat's ``echo``: the last message's content where it is the
    assistant's, which the answer's content then starts with (vLLM's
    serving_chat: the last turn's role equal to the answer's; its parts
    joined with newlines); None otherwise. Not with tools: their answer is
    its calls."""
    if not request.echo:
        return None
    if request.tools and request.tool_choice != "none":
        raise RequestError("echo cannot be given with tools: their answer is its calls", "echo")
    last = request.messages[-1] if request.messages else None
    if last is None or last.role != "assistant" or not last.content:
        return None
    if isinstance(last.content, str):
        return last.content
    return "\n".join(part.text for part in last.content)
