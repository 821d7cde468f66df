"""vLLM's tokenizer endpoints, ``POST /tokenize`` and ``POST /detokenize``
(vllm/entrypoints/serve/tokenize/api_router.py serves them at these paths,
without ``/v1``; the requests and answers are its ``TokenizeCompletionRequest``,
``TokenizeChatRequest``, ``TokenizeResponse``, ``DetokenizeRequest`` and
``DetokenizeResponse``). They use the door's codec, the tokenizer and chat
template the door tokenizes prompts with, so ``/tokenize`` gives exactly the
ids a completion or chat request of the same fields sends to the model.
No model is asked: nothing here crosses Triton.
"""
from __future__ import annotations

import json

from ..schema import INPUT_IDS
from .protocol import (DetokenizeRequest, RequestError, TokenizeChatRequest,
                       TokenizeCompletionRequest, parse)
from .chat import chat_prompt_ids
from .translate import Served, check_model, checked_integer


def tokenize_kind(body: bytes) -> type:
    """The request a /tokenize body is: chat when it has ``messages`` (vLLM's
    ``TokenizeRequest`` union tells them apart by their fields), else a prompt."""
    try:
        data = json.loads(body)
    except ValueError:
        data = None  # parse() names the JSON's fault
    if isinstance(data, dict) and {"messages", "prompt"} <= data.keys():
        raise RequestError("give one of prompt and messages, not both", "messages")
    return TokenizeChatRequest if isinstance(data, dict) and "messages" in data else \
        TokenizeCompletionRequest


def tokenize(body: bytes, served: Served) -> dict:
    """vLLM's TokenizeResponse of a /tokenize body: the ids, their count, the
    model's context (``max_model_len``) and, with ``return_token_strs``, each
    id's token string (the tokenizer's piece, ``convert_ids_to_tokens``, as
    vLLM gives it), else null."""
    request = parse(tokenize_kind(body), body)
    check_model(request.model, served)
    if isinstance(request, TokenizeChatRequest):
        ids = chat_prompt_ids(request, served.codec)
    else:
        ids = served.codec.tokenize(request.prompt, request.add_special_tokens)
    strings = None
    if request.return_token_strs:
        strings = list(served.codec.tokenizer.convert_ids_to_tokens(ids))
    return {"count": len(ids), "max_model_len": served.max_context, "tokens": ids,
            "token_strs": strings}


def detokenize(body: bytes, served: Served) -> dict:
    """vLLM's DetokenizeResponse: the ids' text, special tokens kept (vLLM
    decodes with the tokenizer's default, which keeps them). Each id must
    lie in [0, V) (a 400 naming ``tokens`` and its place)."""
    request = parse(DetokenizeRequest, body)
    check_model(request.model, served)
    ids = [checked_integer(f"tokens[{place}]", token, INPUT_IDS.name, 0, served.vocab_size - 1,
                    "tokens") for place, token in enumerate(request.tokens)]
    return {"prompt": served.codec.decode(ids, special=True)}
