"""A chat request's prompt: its messages through the model's chat template
(``TextCodec.render_chat``, the path preprocessing uses), as text and as
the token ids sent to ``llm``; for the chat endpoint and vLLM's /tokenize."""
from __future__ import annotations

from ..schema import InvalidRequest
from .protocol import ChatTemplate, RequestError
from .tools import template_messages


def chat_prompt_ids(request: ChatTemplate, codec, keep: int | None = None) -> list[int]:
    """``chat_prompt``'s token ids."""
    return chat_prompt(request, codec, keep)[1]


def chat_prompt(request: ChatTemplate, codec, keep: int | None = None) -> tuple[str, list[int]]:
    """The messages through the model's chat template: its text, and its
    token ids (the last `keep`: ``truncation``), as vLLM's chat
    template fields ask (vllm/entrypoints/openai/protocol.py,
    ``ChatCompletionRequest.check_generation_prompt``: continue_final_message
    and add_generation_prompt not both true; transformers refuses the pair
    too); the last message is continued whatever its role, as transformers
    and vLLM do. chat_template_kwargs may not name apply_chat_template's own
    arguments nor what transformers hands the template itself (``messages``,
    ``raise_exception``: ``TextCodec.template_arguments``): vLLM refuses
    ``chat_template`` and ``tokenize`` and answers the others' failures 400;
    they would set what the request's fields set, or the answer's shape.
    A template failing on a variable's value is a 400 naming
    chat_template_kwargs."""
    if not request.messages:
        raise RequestError("messages must hold at least one message", "messages")
    if request.continue_final_message and request.add_generation_prompt:
        raise RequestError("continue_final_message and add_generation_prompt cannot both be "
                           "true (add_generation_prompt is true unless sent false)",
                           "continue_final_message")
    variables = request.chat_template_kwargs or {}
    reserved = sorted(codec.template_arguments & variables.keys())
    if reserved:
        raise RequestError(f"chat_template_kwargs may not set {', '.join(reserved)} (the chat "
                           "template's own arguments and functions, not its variables)",
                           "chat_template_kwargs")
    messages = template_messages(request.messages)
    try:
        text = codec.render_chat(
            messages, request.add_generation_prompt, request.continue_final_message, variables,
            [tool.model_dump(exclude_none=True) for tool in request.tools or ()],
            request.documents)
    except InvalidRequest as error:
        field = "chat_template_kwargs" if str(error).startswith("chat_template_kwargs") else \
            "messages"
        raise RequestError(str(error), field) from None
    return text, codec.tokenize(text, request.add_special_tokens, keep,
                                getattr(request, "truncation_side", None))
