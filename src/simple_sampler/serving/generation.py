"""A generation as the decode loop's callers see it: the request, its events
and the handle it is followed by; and its state inside the loop
(:class:`DecodeSequence`; the loop itself: ``serving/decoder.py``).

Events (:class:`GenerationEvent`) carry one generated token each; the last
one has ``finish_reason`` (TensorRT-LLM / OpenAI naming): ``"stop"`` (end id
or a stop word), ``"length"`` (max_tokens reached) or ``"cancelled"``; or
``error`` when the step or sampler failed. Every submitted request gets
exactly one final event; a request rejected by validation raises InvalidRequest
from ``Decoder.submit`` instead. An end or stop id and the tokens of a stop
word count as generated tokens and are in ``token_ids``; their text is not
in ``text`` unless the request asks for it (``include_stop``), but for a
word matched as tokens (``stop_words_as_tokens``), which stays. A consumer
that streams many requests (the llm model) takes their other tokens a step
at a time instead (``Decoder.on_step``, :meth:`RequestHandle.listen` with a
sink): no event per token, one call per step for the requests due, each
request's tokens ``interval`` at a time.
"""
from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Callable, Sequence

import numpy as np

from ..params import SamplingParams
from ..sampling import MAX_TOP_LOGPROBS
from ..schema import InvalidRequest
from .structured import Guide
from .text import Detokenizer, StopMatcher

#: the largest max_tokens (the llm model's INT32 input): a larger limit than
#: the context leaves is shortened to that room (``fitted_max_tokens``)
MAX_TOKENS_LIMIT = int(np.iinfo(np.int32).max)

if TYPE_CHECKING:  # prompt_scores imports this module
    from .prompt_scores import PromptScores

FINISH_STOP, FINISH_LENGTH, FINISH_CANCELLED = "stop", "length", "cancelled"
#: SamplingParams' fields whose generate input has another name, as their
#: checks' messages begin: a message names the input the client sent
INPUT_NAMES = (("logit_bias value", "logit_bias_values"), ("logit_bias token id", "logit_bias_ids"),
               ("logit_bias", "logit_bias_ids"), ("min_tokens", "min_length"),
               ("seed", "random_seed"))


def named_as_sent(message: str) -> str:
    """A SamplingParams check's message with its field named as the
    generate input the client sent (``min_tokens`` is ``min_length``)."""
    for field_name, input_name in INPUT_NAMES:
        if message.startswith(field_name + " "):
            return input_name + message[len(field_name):]
    return message


def _string_list(name: str, value) -> None:
    if isinstance(value, str) or not all(isinstance(w, str) and w for w in value):
        raise InvalidRequest(f"{name} must be a list of non-empty strings, got {value!r}")


def _count(name: str, value, high: int):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
            or not 0 <= value <= high:
        raise InvalidRequest(f"{name} must be an integer in [0, {high}], got {value!r}")
    return value


@dataclass
class GenerationRequest:
    """One generation. Give ``text`` (encoded with the model's tokenizer,
    through the chat template when ``chat``) or ``prompt_ids``.

    ``end_id`` defaults to the model's end ids (``TextCodec.end_ids``; -1:
    none, TensorRT-LLM's, nothing banned for them); they
    stop the generation unless ``ignore_end``, and ``sampling.min_tokens``
    bans them (with ``ignore_end`` too, as vLLM) until that many tokens
    exist. ``stop_words`` end the generation (text cut before the word, or
    after it with ``include_stop``, which also keeps the text of the stop or
    end id that ended it: vLLM's ``include_stop_str_in_output``), or with
    ``stop_words_as_tokens`` where the generated tokens end with a word's
    (encoded alone), the word kept (TensorRT-LLM's stop words); the text
    leaves special tokens' text out unless not ``skip_special`` (vLLM's
    ``skip_special_tokens``);
    ``bad_words`` are never generated (each word's last token is banned
    whenever the sequence ends with the word's other tokens), each encoded
    alone (TensorRT-LLM's), or with ``bad_words_spaced`` also after a space
    where that is a word of its own (vLLM's: ``TextCodec.words_ids``).
    ``stop_words_list`` and ``bad_words_list`` are such words as token ids
    (TensorRT-LLM's tensorrt_llm model's inputs), stop words matched as
    ``stop_words_as_tokens`` matches.
    ``num_top_logprobs`` (with ``return_log_probs``): each token's event
    also carries the n most likely tokens and their logprobs.
    ``prompt_logprobs`` n (None: not asked): the prompt is scored first
    (``prompt_scores``), each prompt token's logprob and the n most likely
    at its place coming in an event of their own before any token; with it,
    ``max_tokens`` may be 0 (the prompt scored, nothing generated).
    ``guide``: the grammar the generation is held to (``structured``);
    ``allowed_token_ids`` (vLLM's): the only tokens it may generate.
    """

    text: str | None = None
    prompt_ids: Sequence[int] | None = None
    chat: bool = False
    max_tokens: int = 16
    sampling: SamplingParams = field(default_factory=SamplingParams)
    end_id: int | None = None
    ignore_end: bool = False
    stop_words: Sequence[str] = ()
    stop_words_as_tokens: bool = False
    include_stop: bool = False
    skip_special: bool = True
    bad_words: Sequence[str] = ()
    bad_words_spaced: bool = False
    stop_words_list: Sequence[Sequence[int]] = ()
    bad_words_list: Sequence[Sequence[int]] = ()
    return_log_probs: bool = False
    num_top_logprobs: int = 0
    prompt_logprobs: int | None = None
    guide: Guide | None = None
    allowed_token_ids: Sequence[int] | None = None

    def fitted_max_tokens(self, prompt_length: int, max_context: int) -> int:
        """max_tokens within the room a prompt of `prompt_length` tokens leaves
        in the context: a larger limit is shortened to that room, as
        TensorRT-LLM (batch_manager/llmRequest.h, ``LlmRequest::validate``)
        and vLLM's engine (which ends such a request by length at the
        context) treat it; the answer ends by length there. InvalidRequest
        where the prompt leaves no room for a token (for max_tokens 0, the
        prompt's scores alone: where it is longer than the context)."""
        if prompt_length + min(self.max_tokens, 1) > max_context:
            raise InvalidRequest(f"the prompt ({prompt_length} tokens) leaves no room in the "
                                 f"context ({max_context} tokens)")
        return min(self.max_tokens, max_context - prompt_length)

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidRequest naming the field and its allowed range (the
        room the prompt leaves for max_tokens is ``fitted_max_tokens``')."""
        if (self.text is None) == (self.prompt_ids is None):
            raise InvalidRequest("give exactly one of text_input and prompt_ids")
        if self.text is not None and (not isinstance(self.text, str) or not self.text):
            raise InvalidRequest("text_input must be a non-empty string")
        if self.prompt_ids is not None:
            ids = list(self.prompt_ids)
            if not ids or not all(isinstance(t, (int, np.integer)) and 0 <= t < vocab_size
                                  for t in ids):
                raise InvalidRequest(f"input_ids (prompt_ids) must be a non-empty list of token "
                                     f"ids in [0, {vocab_size})")
        scored = self.prompt_logprobs is not None
        if scored:
            _count("prompt_logprobs", self.prompt_logprobs, MAX_TOP_LOGPROBS)
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, (int, np.integer)) \
                or not 1 - scored <= self.max_tokens <= MAX_TOKENS_LIMIT:
            hint = " (0 only with prompt_logprobs)" if self.max_tokens == 0 else ""
            raise InvalidRequest(f"max_tokens must be an integer in [{1 - scored}, {MAX_TOKENS_LIMIT}], "
                                 f"got {self.max_tokens!r}{hint}")
        try:
            self.sampling.validate(vocab_size)
        except ValueError as error:  # params' checks are not the request's alone
            raise InvalidRequest(named_as_sent(str(error))) from None
        if self.end_id is not None and not -1 <= self.end_id < vocab_size:
            raise InvalidRequest(f"end_id must be a token id in [0, {vocab_size}) or -1 (none), "
                                 f"got {self.end_id!r}")
        _string_list("stop_words", self.stop_words)
        _string_list("bad_words", self.bad_words)
        for name in ("stop_words_list", "bad_words_list"):
            if not all(word and all(isinstance(t, (int, np.integer)) and 0 <= t < vocab_size
                                    for t in word) for word in getattr(self, name)):
                raise InvalidRequest(f"{name} must hold words of token ids in [0, "
                                     f"{vocab_size})")
        n_top = _count("num_top_logprobs", self.num_top_logprobs, MAX_TOP_LOGPROBS)
        if n_top and not self.return_log_probs:
            raise InvalidRequest("num_top_logprobs needs return_log_probs true")
        if self.guide is not None:
            self.guide.validate()
        if self.allowed_token_ids is not None and not (
                len(self.allowed_token_ids) and all(
                    isinstance(t, (int, np.integer)) and not isinstance(t, bool)
                    and 0 <= t < vocab_size for t in self.allowed_token_ids)):
            raise InvalidRequest(f"allowed_token_ids must be a non-empty list of token ids in "
                                 f"[0, {vocab_size})")


@dataclass
class GenerationEvent:
    """One step of a request's stream. ``text`` is the new stable text (may
    be ''); ``token_ids`` and ``logprobs`` the tokens generated this step
    (logprobs empty unless ``return_log_probs``); ``cum_log_prob`` their
    running sum (NaN unless asked); ``top_logprobs`` per token its
    ``num_top_logprobs`` most likely (token id, logprob), most likely first
    (empty unless asked). The final event has ``finish_reason`` or
    ``error`` set."""

    request_id: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    num_input_tokens: int
    num_output_tokens: int
    cum_log_prob: float
    finish_reason: str | None = None
    error: str | None = None
    #: with ``error``: the server could not serve it now (it is shutting
    #: down); the same request sent again may succeed (UNAVAILABLE, 503)
    retryable: bool = False
    #: () when not asked: shared, so an event costs no list for it
    top_logprobs: Sequence[list[tuple[int, float]]] = ()
    #: the prompt's scores (``prompt_scores.PromptScores``), in the one
    #: event that carries them: a request's first, with no token
    prompt_scores: PromptScores | None = None
    #: vLLM's stop_reason, in the final event: the stop string or the stop
    #: token id that ended the request (not the end of sequence, unless
    #: ignore_eos: ``StepTokens._last``); None when anything else did
    stop_reason: str | int | None = None

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class RequestHandle:
    """A submitted request: iterate it for its events, ``cancel()`` to stop it."""

    def __init__(self, decoder, request_id: int):
        # decoder: the Decoder that made it (unannotated: decoder.py imports this module)
        self.decoder, self.request_id = decoder, request_id
        # A deque and one waiter, not an asyncio.Queue: the decode loop puts
        # one event per request per step (B at a time), and the queue's
        # bookkeeping (getters, unfinished-task count, its join Event) is
        # work nobody here uses: one reader, no join.
        self.pending: collections.deque[GenerationEvent] = collections.deque()
        self.waiter: asyncio.Future | None = None
        self.sink: object = None  # listen()

    def listen(self, listener: Callable[[GenerationEvent], None], sink: object = None,
               interval: int = 1) -> None:
        """Hand every event to ``listener`` as the decode loop makes it,
        instead of iterating: a step's events are then delivered in the
        loop's one pass over the step's rows, with no reader coroutine to
        wake per event. Events already made go first. Call on the decoder's
        event loop; the handle is then no longer iterable.

        With a ``sink`` (anything the consumer finds its request by) and the
        decoder's ``on_step`` set, a token that does not end the request
        makes no event: the request's tokens go to ``on_step`` ``interval``
        at a time (0: never), with those of the other requests due in the
        same step (``StepTokens.deliver``); the final event still comes to
        ``listener``, holding every token not handed to ``on_step``."""
        # The listener replaces put() on this handle: the decode loop's
        # put(event) is then the listener's call itself, no call in between.
        self.put = listener
        self.sink = sink
        sequence = self.decoder.by_id.get(self.request_id)
        if sequence is not None and sink is not None and self.decoder.on_step is not None:
            self.decoder.step_tokens.listen(sequence, interval)
        while self.pending:
            listener(self.pending.popleft())

    def put(self, event: GenerationEvent) -> None:
        """Queue an event (on the decoder's event loop) and wake the reader
        (``listen`` replaces it)."""
        self.pending.append(event)
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():  # done: its reader was cancelled
            waiter.set_result(None)

    def cancel(self) -> None:
        """Ask to stop; the final event (``"cancelled"``) follows at the
        request's next step, or at once while it is still queued."""
        self.decoder.cancel(self.request_id)

    async def __aiter__(self) -> AsyncIterator[GenerationEvent]:
        while True:
            while not self.pending:
                self.waiter = asyncio.get_running_loop().create_future()
                await self.waiter
            event = self.pending.popleft()
            yield event
            if event.final:
                return


@dataclass(eq=False)
class DecodeSequence:
    """A request's state inside the decoder."""

    request_id: int
    request: GenerationRequest
    handle: RequestHandle
    prompt_ids: list[int]
    params: SamplingParams  # seeded, end id among the stop ids
    detokenizer: Detokenizer
    stop: StopMatcher
    bad_words_ids: list[list[int]]
    num_input_tokens: int = 0  # len(prompt_ids), kept for every event
    #: tokens generated as of its last event or ``on_step`` (a stepped
    #: request's count per step is its BatchState length, ``StepTokens.deliver``);
    #: the ids themselves are in the decoder's BatchState (``Decoder.output_ids``)
    generated: int = 0
    max_tokens: int = 0  # request.max_tokens, read per token
    stop_ids: frozenset = frozenset()  # params.stop_token_ids, tested per token
    cum_log_prob: float = 0.0
    cancelled: bool = False
    done: bool = False
    #: its tokens that do not end it go to Decoder.on_step, `interval` at a
    #: time (0: with the final event alone; RequestHandle.listen)
    stepped: bool = False
    interval: int = 1
    #: tokens handed out (events, on_step) and tokens pushed through the
    #: detokenizer: a stepped request without stop words pushes its tokens
    #: only when they are handed out; with stop words, each as it comes,
    #: its text held in `held_text` until then
    delivered: int = 0
    pushed: int = 0
    held_text: str = ""
    stop_reason: str | int | None = None  # GenerationEvent's, set by the token that ends it
    slot: int = -1  # in the decoder's BatchState while in a lane
    #: the request's grammar's matcher (llguidance's, ``structured``), or None
    matcher: object = None
    #: its allowed_token_ids as a bitmask (``structured.bitmask_of``), or None
    allowed: np.ndarray | None = None

    def event(self, text: str, token_ids: list[int], logprobs: list[float],
              reason: str | None = None, error: str | None = None,
              top_logprobs: list | None = None) -> GenerationEvent:
        """An event of this request's stream; it owns ``token_ids``,
        ``logprobs`` and ``top_logprobs`` (fresh lists: one event per token,
        so no copy)."""
        asked = self.request.return_log_probs
        event = GenerationEvent(self.request_id, text, token_ids, logprobs if asked else [],
                                self.num_input_tokens, self.generated,
                                self.cum_log_prob if asked else float("nan"), reason, error,
                                top_logprobs=() if top_logprobs is None else top_logprobs)
        if reason is not None:
            event.stop_reason = self.stop_reason
        return event
