"""vLLM's request fields that shape a generation's envelope, not its
tokens: chat's ``echo``, and the fields accepted with no effect here
(vllm/entrypoints/openai/chat_completion/protocol.py,
``ChatCompletionRequest``). ``request_id`` and ``stream_interval`` go
straight into the plan (``translate._plan``)."""
from __future__ import annotations

from .protocol import ChatCompletionRequest, RequestError, Sampling

#: vLLM's cache_salt: at most this many characters, none of these
#: (vllm/entrypoints/generate/base/protocol.py, ``validate_cache_salt``)
CACHE_SALT_MAX_CHARACTERS = 128
CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")


def check_inert(request: Sampling) -> None:
    """The fields that change nothing here, checked as vLLM checks them:
    ``priority`` 0 only (vLLM refuses another without priority scheduling;
    requests here are served first come, first served), ``cache_salt`` a
    string of 1 to 128 characters without "@", "/", "\\" or NUL (no prefix
    cache here to salt), ``spaces_between_special_tokens`` true only
    (vLLM's default; the decode loop's text has no other form),
    ``session_id`` any string."""
    if request.priority not in (None, 0):
        raise RequestError(f"priority must be 0: this server schedules requests first come, "
                           f"first served, got {request.priority}", "priority")
    salt = request.cache_salt
    if salt is not None and not (0 < len(salt) <= CACHE_SALT_MAX_CHARACTERS
                                 and not CACHE_SALT_FORBIDDEN & set(salt)):
        raise RequestError(f"cache_salt must be a string of 1 to {CACHE_SALT_MAX_CHARACTERS} "
                           "characters without '@', '/', '\\' or NUL", "cache_salt")
    if request.spaces_between_special_tokens is False:
        raise RequestError("spaces_between_special_tokens must be true (vLLM's default): "
                           "false is not supported by this server",
                           "spaces_between_special_tokens", code="unsupported_parameter")


def echoed(request: ChatCompletionRequest, in_calls: bool) -> str | None:
    """Chat's ``echo``: the last message's content where its role is the
    answer's, which the answer's content then starts with; None otherwise.
    As vLLM's serving_chat: the answer's role is the assistant's, or with
    ``add_generation_prompt`` false the last message's own
    (``get_chat_request_role``), so that turn is echoed whatever its role
    (the answer here still says "assistant"). Not where the answer is tool
    calls (`in_calls`)."""
    if not request.echo:
        return None
    if in_calls:
        raise RequestError("echo cannot be given where the answer is tool calls", "echo")
    last = request.messages[-1] if request.messages else None
    if last is None or not (last.role == "assistant" or not request.add_generation_prompt):
        return None
    return last.text or None
