"""A request made ready for the decode loop (``Decoder.prepare``): checked
against the engine, its prompt encoded, its seed drawn, its stop and end
ids, bad words and stop matcher resolved, and its grammar's matcher and
allowed tokens' mask made (``structured``), so that a bad request is refused (InvalidRequest naming
the field) before it takes a place in the queue."""
from __future__ import annotations

import dataclasses
import secrets

from ..schema import InvalidRequest
from .engine import ScoresPrompts
from .generation import DecodeSequence, GenerationRequest, RequestHandle
from .structured import bitmask_of
from .text import StopMatcher


def prepare(decoder, request: GenerationRequest) -> DecodeSequence:
    """`request` validated and encoded for `decoder`, not yet queued
    (``Decoder.prepare``; unannotated: decoder.py imports this module);
    raises InvalidRequest naming the bad field."""
    engine = decoder.engine
    request.validate(engine.vocab_size)
    if request.num_top_logprobs and not decoder.data_plane.gives_top_logprobs:
        raise InvalidRequest(f"num_top_logprobs must be 0 here: this decode loop's "
                             f"sampler ({decoder.mode}) returns no top logprobs")
    if request.prompt_logprobs is not None and not isinstance(engine, ScoresPrompts):
        raise InvalidRequest(f"prompt_logprobs cannot be given here: this server's engine "
                             f"({engine.label}) does not score prompts")
    codec = decoder.codec
    prompt_ids = (list(request.prompt_ids) if request.prompt_ids is not None
                  else codec.encode(request.text, request.chat))
    max_tokens = request.fitted_max_tokens(len(prompt_ids), engine.max_context)
    end_ids = {None: decoder.end_ids, -1: []}.get(request.end_id, [request.end_id])
    params = request.sampling
    stop_ids = frozenset([*params.stop_token_ids, *([] if request.ignore_end else end_ids)])
    # min_tokens bans every stop and end id, even with ignore_eos (as vLLM's
    # _all_stop_token_ids): stop_token_ids is what the samplers ban
    params = dataclasses.replace(
        params,
        seed=secrets.randbits(64) if params.seed is None else params.seed,
        stop_token_ids=list(dict.fromkeys([*params.stop_token_ids, *end_ids])))
    bad_words_ids = [*codec.words_ids(request.bad_words, spaced=request.bad_words_spaced),
                     *map(list, request.bad_words_list)]
    try:  # with the end id and the bad words, which validate did not see
        params.check_a_token_is_allowed(
            engine.vocab_size, (ids[0] for ids in bad_words_ids if len(ids) == 1))
    except ValueError as error:
        raise InvalidRequest(str(error)) from None
    matcher = None
    if request.guide is not None:  # its grammar ends it at the model's end ids that end it
        ending = [] if request.ignore_end else end_ids
        matcher = decoder.grammars.matcher(request.guide, ending)
        bad_words_ids += [[i] for i in decoder.end_ids if i not in ending]
    allowed = None
    if request.allowed_token_ids is not None:
        banned = params.banned_at_first_step(ids[0] for ids in bad_words_ids if len(ids) == 1)
        if not set(map(int, request.allowed_token_ids)) - banned:
            raise InvalidRequest("allowed_token_ids leaves no token to generate at the first "
                                 "step: every one is banned (a bad word, a -inf logit_bias, a "
                                 "stop or end id held back by min_tokens, or an end id a "
                                 "grammar does not end at)")
        allowed = bitmask_of(request.allowed_token_ids, engine.vocab_size)
    request_id = next(decoder.ids)
    stops = StopMatcher.of(codec, request.stop_words, request.include_stop,
                           request.stop_words_as_tokens, prompt_ids, request.stop_words_list)
    return DecodeSequence(request_id, request, RequestHandle(decoder, request_id), prompt_ids,
                          params, codec.detokenizer(prompt_ids, not request.skip_special),
                          stops, bad_words_ids, num_input_tokens=len(prompt_ids),
                          max_tokens=max_tokens, stop_ids=stop_ids, matcher=matcher,
                          allowed=allowed)
