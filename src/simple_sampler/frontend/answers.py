"""The ``llm`` model's responses (``client.Chunk``) as OpenAI's objects: a
whole answer, a stream's events, logprobs in each endpoint's shape (and
vLLM's ``prompt_logprobs``), usage. The requests' side: ``translate``."""
from __future__ import annotations

import dataclasses
import itertools
import json
import os

from ..client import Chunk
from .tools import HERMES_OPEN, held_back, new_call
from .translate import NUM_TOP, Plan, Served

#: finish reasons the decode loop sends that OpenAI clients know
FINISH_REASONS = {"stop": "stop", "length": "length"}


def usage(plans: list[Plan], finals: list[Chunk]) -> dict:
    """The usage of a request's generations (each one's plan and final
    response): every generation's tokens, each prompt's once (n choices
    share theirs, as vLLM and OpenAI count them)."""
    prompt = sum(final.num_input_tokens for plan, final in zip(plans, finals)
                 if not plan.repeats_prompt)
    completion = sum(final.num_output_tokens for final in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _json_logprob(logprob: float) -> float:
    """A logprob as JSON can carry it: -inf (a banned token among a row's
    top n) as -9999.0, as vLLM writes it (vllm/entrypoints/openai/
    chat_completion/serving.py, ``_create_chat_logprobs``)."""
    return max(logprob, -9999.0)


#: the sampled tokens before a position that can complete a character
#: split over tokens (UTF-8 takes four bytes at most)
PIECE_CONTEXT = 4


def _token_namer(plan: Plan, codec):
    """How the logprobs name a token id at a position, ``name(token,
    context)``: by its text (``token_text``; context: the ids sampled
    before the position), or with vLLM's return_tokens_as_token_ids as
    "token_id:N" (vllm/entrypoints/generate/base/serving.py, ``format_token_id_placeholder``),
    which tells apart tokens whose texts are alike (a piece of a character,
    a special token's "")."""
    if plan.tokens_as_ids:
        return lambda token, context: f"token_id:{token}"
    special = plan.special
    return lambda token, context: token_text(codec, token, context, special)


def token_text(codec, token: int, context: list[int], special: bool) -> str:
    """A token's text as vLLM's logprobs give it (vllm/v1/engine/logprobs.py,
    ``_verify_tokens`` and ``_correct_decoded_token``): its text alone,
    unless that ends in a replacement character (a piece of a character
    split over tokens); then the characters it completes after up to
    PIECE_CONTEXT ids of `context`, those pieces' text included (they were
    ""), or "" where no context completes it (the character goes on)."""
    text = codec.decode([token], special)
    if not text.endswith("\ufffd"):
        return text
    for count in range(1, min(len(context), PIECE_CONTEXT) + 1):
        before = context[-count:]
        joined = codec.decode([*before, token], special)
        if joined.endswith("\ufffd"):
            continue
        clean = len(before)  # the context tokens that are no pieces: their text is their own
        while clean and codec.decode([before[clean - 1]], special).endswith("\ufffd"):
            clean -= 1
        prefix = codec.decode(before[:clean], special) if clean else ""
        return joined[len(os.path.commonprefix([prefix, joined])):]
    return ""


def _logprobs(plan: Plan, chunks: list[Chunk], codec) -> dict | None:
    """``_token_logprobs``, with completions' text_offset: each token's
    offset in the choice's text, as the lengths of the token strings before
    it add up (vLLM's ``_create_completion_logprobs``; a stream's go on from
    its last response's, ``plan.text_offset``)."""
    logprobs = _token_logprobs(plan, chunks, codec)
    plan.recent_ids = [*plan.recent_ids, *(t for c in chunks for t in c.token_ids)][-PIECE_CONTEXT:]
    if logprobs is None or plan.chat:
        return logprobs
    lengths = [len(token) for token in logprobs["tokens"]]
    offsets = list(itertools.accumulate(lengths[:-1], initial=plan.text_offset))
    plan.text_offset += sum(lengths)
    return {**logprobs, "text_offset": offsets if lengths else []}


def _token_logprobs(plan: Plan, chunks: list[Chunk], codec) -> dict | None:
    """OpenAI's logprobs object of these chunks' tokens (None unless asked):
    chat, per token its top_logprobs (the n most likely, most likely
    first); completions, per token a dict of the n most likely tokens'
    texts and the chosen one's (n or n + 1 entries, as vLLM and OpenAI's
    legacy completions give), led with echo by the prompt's tokens (the
    first with null, having no logprob). A special token's string is its
    text with skip_special_tokens false (``plan.special``), else "".
    (vLLM's strings keep it either way: its ``convert_ids_list_to_tokens``,
    vllm/tokenizers/detokenizer_utils.py, decodes each id with the
    tokenizer's default, which keeps special tokens.) With
    ``tokens_as_ids`` every token is named "token_id:N" (``_token_namer``);
    chat's ``bytes`` stay the token's own."""
    if not plan.logprobs:
        return None
    special, name = plan.special, _token_namer(plan, codec)
    scored = _scored(chunks) if plan.echo is not None and not plan.chat else None
    if scored is not None:
        n = plan.params.get(NUM_TOP, 0)  # prompt_logprobs may have asked for more
        steps = [(t, p, top[:n]) for t, p, top in zip(scored.prompt_ids[1:],
                                                      scored.prompt_logprobs, _prompt_tops(scored))]
        # vLLM's context of a prompt token: those scored before it
        prompt = _completion_logprobs(name, steps, _contexts([], [t for t, _, _ in steps]))
        generated = _token_logprobs(dataclasses.replace(plan, echo=None), chunks, codec)
        first = scored.prompt_ids[0]  # decoded alone, as vLLM decodes it
        first = f"token_id:{first}" if plan.tokens_as_ids else codec.decode([first], special)
        return {key: [first if key == "tokens" else None, *prompt[key], *generated[key]]
                for key in ("tokens", "token_logprobs", "top_logprobs")}
    steps = [(t, p, c.top_logprobs[i] if i < len(c.top_logprobs) else [])
             for c in chunks for i, (t, p) in enumerate(zip(c.token_ids, c.logprobs))]
    contexts = _contexts(plan.recent_ids, [t for t, _, _ in steps])
    if plan.chat:
        def entry(text: str, token: int, logprob: float) -> dict:
            return {"token": text, "logprob": _json_logprob(logprob),
                    "bytes": list(codec.token_bytes(token, special))}

        return {"content": [{**entry(name(t, context), t, p), "top_logprobs": [
            entry(name(i, context), i, q) for i, q in top]}
            for context, (t, p, top) in zip(contexts, steps)]}
    return _completion_logprobs(name, steps, contexts)


def logprob_entries(plan: Plan, chunks: list[Chunk], codec) -> list[dict]:
    """Chat's logprobs entries of these chunks' tokens ([] unless asked): the
    Responses API's ``output_text.logprobs`` (frontend/responses.py)."""
    logprobs = _logprobs(plan, chunks, codec)
    return [] if logprobs is None else logprobs["content"]


def _contexts(before: list[int], tokens: list[int]) -> list[list[int]]:
    """Each of `tokens`' context (``token_text``): the PIECE_CONTEXT ids
    sampled before it, `before` leading."""
    out, context = [], list(before)
    for token in tokens:
        out.append(context[-PIECE_CONTEXT:])
        context.append(token)
    return out


def _completion_logprobs(name, steps: list, contexts: list[list[int]]) -> dict:
    """Completions' tokens, token_logprobs and top_logprobs of `steps`
    (token, logprob, top pairs) at their `contexts`, each top a dict of the
    n most likely tokens' names (`name`: ``_token_namer``) and the token's own."""
    tokens = [name(t, context) for context, (t, _, _) in zip(contexts, steps)]
    top_dicts = []
    for text, context, (_, p, top) in zip(tokens, contexts, steps):
        alternatives = {name(i, context): _json_logprob(q) for i, q in top}
        alternatives.setdefault(text, _json_logprob(p))
        top_dicts.append(alternatives)
    return {"tokens": tokens, "token_logprobs": [_json_logprob(p) for _, p, _ in steps],
            "top_logprobs": top_dicts}


def _scored(chunks: list[Chunk]) -> Chunk | None:
    """The response that carries the prompt's scores, if any."""
    return next((c for c in chunks if c.prompt_ids), None)


def _prompt_tops(scored: Chunk) -> list[list[tuple[int, float]]]:
    return scored.prompt_top_logprobs or [[]] * len(scored.prompt_logprobs)


def _vllm_prompt_logprobs(plan: Plan, chunks: list[Chunk], codec) -> list[dict | None]:
    """vLLM's prompt_logprobs: null for the first token (nothing before it),
    then per token a dict, token id (a string: JSON's keys) -> logprob,
    rank and decoded_token: the token's own (its rank: how many tokens were
    at least as likely), then the n most likely (ranks 1 to n; where the
    token is among them, its entry is that one, as in vLLM's dict). -inf is
    written -9999.0, as vLLM's ``clamp_prompt_logprobs`` does. A token is
    decoded as ``token_text`` gives it after the prompt's tokens before it,
    special tokens as their text (vLLM's ``convert_ids_list_to_tokens``)."""
    scored = _scored(chunks)
    # the llm model scores every prompt it is asked to, and ranks each token
    if scored is None or len(scored.prompt_ranks) != len(scored.prompt_logprobs):
        raise RuntimeError("the llm model's answer carries no prompt scores with ranks")

    def entry(token: int, logprob: float, rank: int, context: list[int]) -> dict:
        return {"logprob": _json_logprob(logprob), "rank": rank,
                "decoded_token": token_text(codec, token, context, True)}

    places = [None]
    tokens = scored.prompt_ids[1:]
    for context, token, logprob, rank, top in zip(_contexts([], tokens), tokens,
                                                  scored.prompt_logprobs, scored.prompt_ranks,
                                                  _prompt_tops(scored)):
        place = {str(token): entry(token, logprob, rank, context)}
        for order, (other, other_logprob) in enumerate(top[:plan.prompt_logprobs], 1):
            place[str(other)] = entry(other, other_logprob, order, context)
        places.append(place)
    return places


def _finish(chunk: Chunk) -> str | None:
    return FINISH_REASONS.get(chunk.finish_reason, chunk.finish_reason) or None


def _object(plan: Plan, kind: str, model_id: str) -> dict:
    return {"id": f"{'chatcmpl' if plan.chat else 'cmpl'}-{plan.id}", "object": kind,
            "created": plan.created, "model": model_id}


def response(plan: Plan, chunks: list[Chunk], served: Served) -> dict:
    """The whole answer of a non-streamed request."""
    text = (plan.echo or "") + "".join(c.text for c in chunks)
    choice = {"index": 0, "logprobs": _logprobs(plan, chunks, served.codec),
              "finish_reason": _finish(chunks[-1]), "stop_reason": chunks[-1].stop_reason}
    if plan.tools is not None:  # its text is its calls (frontend/tools.py)
        content, calls = plan.tools.answer(text, chunks[-1].finish_reason)
        choice["message"] = {"role": "assistant", "content": content}
        if calls or plan.tools.parser is None:
            choice["message"]["tool_calls"] = calls
        if calls and plan.tools.name is None:  # auto's or required's calls: their reason
            choice["finish_reason"] = "tool_calls"  # (vLLM's; a named call's stays stop)
    elif plan.chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    kind = "chat.completion" if plan.chat else "text_completion"
    answer = {**_object(plan, kind, served.model_id), "choices": [choice]}
    if plan.prompt_logprobs is not None:  # vLLM's place: the choice's, or chat's answer's
        (answer if plan.chat else choice)["prompt_logprobs"] = _vllm_prompt_logprobs(
            plan, chunks, served.codec)
    if plan.return_token_ids:  # vLLM's places, as prompt_logprobs'
        choice["token_ids"] = _token_ids(chunks)
        (answer if plan.chat else choice)["prompt_token_ids"] = plan.prompt_ids
    if plan.prompt_text is not None:
        answer["prompt_text"] = plan.prompt_text
    return {**answer, "usage": usage([plan], chunks[-1:])}


def _token_ids(chunks: list[Chunk]) -> list[int]:
    """The generated ids these responses carry (an echo's prompt not among
    them, as in vLLM's token_ids)."""
    return [token for chunk in chunks for token in chunk.token_ids]


def response_of_all(plans: list[Plan], answers: list[list[Chunk]], served: Served) -> dict:
    """The whole answer of a non-streamed request: generation i's choice at
    index i (several: n, completions' list of prompts, as vLLM answers
    them), the usage summed."""
    whole = [response(plan, chunks, served) for plan, chunks in zip(plans, answers)]
    choices = [{**one["choices"][0], "index": index} for index, one in enumerate(whole)]
    return {**whole[0], "choices": choices,
            "usage": usage(plans, [chunks[-1] for chunks in answers])}


def stream_events(plan: Plan, chunk: Chunk, served: Served, first: bool,
                  generated: int = 0, index: int = 0, alone: bool = True) -> list[dict]:
    """The stream objects one response of the llm model becomes, for the
    choice at `index`: with chat the first opens the assistant's turn; the
    last carries the finish reason, and then (``include_usage``, the
    request's only generation: `alone`) a chunk of usage with no choices
    (of several: ``usage_event`` once all have ended). With
    ``continuous_usage`` every chunk carries its generation's usage so far
    (`generated`: the tokens of this response and those before it)."""
    kind = "chat.completion.chunk" if plan.chat else "text_completion"
    chunks = [chunk]
    if plan.tools is not None and plan.tools.name is None:  # required, auto: held
        plan.held.append(chunk)
        chunks = plan.held[plan.reported:]  # those whose logprobs have not gone out
    choice = {"index": index, "logprobs": None,
              "finish_reason": _finish(chunk), "stop_reason": chunk.stop_reason}
    if plan.tools is not None:
        delta = (_tool_delta if plan.tools.parser is None else _auto_delta)(plan, chunk, first)
        if delta is None:  # the calls come whole at the end
            return []
        plan.reported = len(plan.held)
        choice["delta"] = delta
        if delta.get("tool_calls") and plan.tools.name is None:
            choice["finish_reason"] = "tool_calls"
    elif plan.chat:
        choice["delta"] = {"role": "assistant", "content": (plan.echo or "") + chunk.text} \
            if first else {"content": chunk.text}
    else:
        choice["text"] = (plan.echo or "") + chunk.text if first else chunk.text
    events = [{**_object(plan, kind, served.model_id), "choices": [choice]}]
    choice["logprobs"] = _logprobs(plan, chunks, served.codec)
    if plan.return_token_ids:
        choice["token_ids"] = _token_ids(chunks)
    if not plan.prompt_ids_sent:  # in each choice's first event, as vLLM's
        plan.prompt_ids_sent = True
        if plan.return_token_ids:
            (events[0] if plan.chat else choice)["prompt_token_ids"] = plan.prompt_ids
        if plan.prompt_text is not None:
            events[0]["prompt_text"] = plan.prompt_text
    if plan.include_usage:
        prompt = len(plan.prompt_ids)
        events[0]["usage"] = {"prompt_tokens": prompt, "completion_tokens": generated,
                              "total_tokens": prompt + generated} if plan.continuous_usage else None
        if chunk.finish_reason and alone:
            events.append(usage_event([plan], [chunk], served))
    return events


def _tool_delta(plan: Plan, chunk: Chunk, first: bool) -> dict | None:
    """A streamed chunk's delta of tool calls (frontend/tools.py): a named
    function's arguments as they come, its first delta with the call's id,
    type and name (index 0: the call's place in its choice, as OpenAI
    numbers them); with ``required``, None until the last chunk, whose
    delta holds every call whole (vLLM parses the growing array as it
    comes; here it is parsed once, complete: ``plan.held``)."""
    if plan.tools.name is not None:
        call = {"index": 0, "function": {"arguments": chunk.text}}
        if first:
            call = {"index": 0, **new_call(plan.tools.name, chunk.text)}
        return {"role": "assistant", "tool_calls": [call]} if first else {"tool_calls": [call]}
    if not chunk.finish_reason:
        return None
    calls = plan.tools.calls("".join(c.text for c in plan.held), chunk.finish_reason)
    return {"role": "assistant", "content": "",
            "tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}


def _auto_delta(plan: Plan, chunk: Chunk, first: bool) -> dict | None:
    """A streamed chunk's delta with ``auto`` (frontend/tools.py): the text
    as content until a call's tag begins (a piece that could begin one
    waits for the next); from there on the text is held, and the last
    chunk's delta holds the calls parsed out of it (or the held text as
    content, where they do not parse). None: nothing to send yet."""
    text = "".join(c.text for c in plan.held)
    if chunk.finish_reason:
        content, calls = plan.tools.answer(text, chunk.finish_reason)
        delta = {"content": (content or "")[plan.sent:]}
        if calls:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
    else:
        start = text.find(HERMES_OPEN)
        upto = start if start >= 0 else len(text) - held_back(text)
        delta = {"content": text[plan.sent:upto] if upto > plan.sent else ""}
        plan.sent = max(plan.sent, upto)
        if not delta["content"] and not first:
            return None
    return {"role": "assistant", **delta} if first else delta


def usage_event(plans: list[Plan], finals: list[Chunk], served: Served) -> dict:
    """A stream's last chunk with ``include_usage``: no choice, the usage of
    every generation (their plans and final responses)."""
    kind = "chat.completion.chunk" if plans[0].chat else "text_completion"
    return {**_object(plans[0], kind, served.model_id), "choices": [],
            "usage": usage(plans, finals)}


def sse(payload: dict | str) -> bytes:
    """One server-sent event (``[DONE]`` ends the stream)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def models_list(served: Served) -> dict:
    """The one model, with the fields of vLLM's ``ModelCard``: ``max_model_len``
    the context, which clients read to size their requests; ``root`` the
    model itself, ``parent`` none (no adapter)."""
    return {"object": "list", "data": [{"id": served.model_id, "object": "model",
                                        "created": 0, "owned_by": "simple-sampler",
                                        "root": served.model_id, "parent": None,
                                        "max_model_len": served.max_context}]}
