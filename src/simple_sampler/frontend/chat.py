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
    template fields ask (vllm/entrypoints/openai/chat_completion/protocol.py,
    ``ChatCompletionRequest.check_generation_prompt``: continue_final_message
    and add_generation_prompt not both true; transformers refuses the pair
    too); the last message is continued whatever its role, as transformers
    and vLLM do. chat_template_kwargs may not name apply_chat_template's own
    arguments nor what transformers hands the template itself (``messages``,
    ``raise_exception``: ``TextCodec.template_arguments``): they would set
    what the request's fields set, or the answer's shape. vLLM 0.32 refuses
    ``chat_template`` and ``tokenize`` and lets the request's fields win
    over the others (vllm/renderers/params.py, ``merge_kwargs``), or drops
    them: refused here, so nothing sent is silently left out.
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
    messages = developer_as_system(template_messages(request.messages),
                                   codec.tokenizer.chat_template)
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


def developer_as_system(messages: list[dict], template) -> list[dict]:
    """OpenAI's ``developer`` turns as ``system`` turns where the chat
    template does not name the role (SmolLM2's would open a
    "developer" turn of its own, under its default system prompt), every
    system turn then merged into one at the start (joined by a blank line),
    as vLLM 0.32 renders them (vllm/renderers/hf.py,
    ``_detect_developer_role_support``, ``_convert_developer_to_system``,
    ``_consolidate_system_messages``)."""
    templates = template.values() if isinstance(template, dict) else [template or ""]
    if not any(turn["role"] == "developer" for turn in messages) or any(
            '"developer"' in text or "'developer'" in text for text in templates):
        return messages
    turns = [{**turn, "role": "system"} if turn["role"] == "developer" else turn
             for turn in messages]
    systems = [i for i, turn in enumerate(turns) if turn["role"] == "system"]
    if systems == [0]:
        return turns
    merged = "\n\n".join(turns[i]["content"] for i in systems if turns[i]["content"])
    return [{"role": "system", "content": merged},
            *(turn for turn in turns if turn["role"] != "system")]
