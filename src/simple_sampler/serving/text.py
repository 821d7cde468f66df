"""Text in and out: the model's own tokenizer, streaming detokenization and
stop-word matching.

* :class:`TextCodec` wraps the tokenizer (loaded once per instance): prompts
  to ids, with the chat template when asked, and bad words to id lists.
* :class:`Detokenizer` turns one sequence's generated ids into text deltas
  while streaming. Their concatenation equals the one-shot decode of the ids
  in the prompt's context: no UTF-8 character is split (a token ending inside
  a multi-byte character is held back, its text shows as a trailing U+FFFD)
  and no leading space is lost (each delta is decoded with the tokens before
  it, because SentencePiece-style tokenizers drop the space of a word that
  starts a decode).
* :class:`StopMatcher` finds stop strings in the text stream, across token
  boundaries, and holds back any tail that may still grow into a stop string,
  so no text after (or partly inside) a stop string is ever emitted. The stop
  string itself is not part of the output (OpenAI's convention) unless asked
  for (vLLM's include_stop_str_in_output). Or, for TensorRT-LLM's stop
  words, it finds where the sequence's ids end with a word's (``feed_token``),
  the word kept.
"""
from __future__ import annotations

import functools
import json
import os
from typing import Mapping, Sequence

from .. import models
from ..schema import InvalidRequest

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21: the detokenizer decodes its window instead
    DecodeStream = None

#: Decode replaces an incomplete UTF-8 sequence by this character.
REPLACEMENT_CHARACTER = "\ufffd"

#: Names transformers' chat template renderer sets itself besides
#: ``apply_chat_template``'s arguments (transformers/utils/
#: chat_template_utils.py: ``render_jinja_template`` renders with
#: ``messages=``, and the template's environment has the functions
#: ``raise_exception`` and ``strftime_now``): not template variables.
TEMPLATE_OWN_NAMES = frozenset({"messages", "raise_exception", "strftime_now"})

#: Prompt tokens decoded with the first generated tokens, so their leading
#: space (and any merge with the prompt's last bytes) comes out as in a full decode.
PROMPT_CONTEXT_TOKENS = 4

#: vLLM's bad words: at most this many id sequences once encoded (its
#: default ``VLLM_MAX_NUM_BAD_WORDS``).
MAX_SPACED_WORDS = 128


def model_directory(source: str | os.PathLike | None = None) -> str:
    """The Hugging Face directory of a model source (see
    ``models.load_model``): SmolLM2's cached copy, a GGUF file's converted
    copy, or the directory given."""
    if source is None or str(source) == models.SMOLLM2:
        return str(models.cache_dir() / models.SMOLLM2_CACHE_NAME)
    if str(source).endswith(".gguf"):
        return str(models.gguf_cache_path(source))
    return str(source)


def load_tokenizer(source: str | os.PathLike | None = None):
    """The tokenizer of a model source (see ``models.load_model``), without
    loading the weights when the model directory (or its converted copy)
    already exists."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoTokenizer

    directory = model_directory(source)
    if not os.path.isfile(os.path.join(directory, "config.json")):
        return models.load_model(source)[1]  # converts the GGUF once
    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def generation_end_ids(directory: str | os.PathLike) -> list[int]:
    """The end-of-sequence ids a model's generation_config.json names
    (``eos_token_id``: one or a list; none without the file). Chat models
    list more than their tokenizer's one (Llama 3.1: ``<|eot_id|>``,
    ``<|eom_id|>`` and ``<|end_of_text|>``; Qwen2.5: ``<|im_end|>`` and
    ``<|endoftext|>``), and vLLM stops on each of them. (A GGUF file's
    converted copy names the one end id its metadata gives.)"""
    try:
        with open(os.path.join(directory, "generation_config.json")) as file:
            eos = json.load(file).get("eos_token_id")
    except FileNotFoundError:
        return []
    return [int(i) for i in (eos if isinstance(eos, list) else [eos])
            if isinstance(i, int) and not isinstance(i, bool)]


class TextCodec:
    """Prompt encoding and per-sequence decoding with one tokenizer."""

    def __init__(self, tokenizer, end_ids: Sequence[int] = ()):
        """end_ids: ids that end a generation besides the tokenizer's end of
        sequence (``generation_end_ids``)."""
        self.tokenizer = tokenizer
        #: what ends a generation unless a request names its own end_id:
        #: the tokenizer's end of sequence first (where it has one)
        eos = tokenizer.eos_token_id
        self.end_ids = tuple(dict.fromkeys([*([int(eos)] if eos is not None else []),
                                            *end_ids]))
        # transformers' decode() wraps the Rust tokenizer's own decode
        # (tokenization_utils_tokenizers.py, `_decode`) in argument
        # conversion and an optional clean-up of spaces; the decode loop
        # calls it per row, so it is called directly where that clean-up is
        # off, which gives the same text.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        direct = backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True)
        self._backend_decode = backend.decode if direct else None
        #: the Rust tokenizer where the detokenizer may stream with DecodeStream
        self.backend = backend if direct and DecodeStream is not None else None
        #: byte-level BPE's character -> byte (token_bytes), made at first use
        self._byte_of: dict[str, int] | None = None

    @classmethod
    def from_source(cls, source: str | os.PathLike | None = None) -> "TextCodec":
        tokenizer = load_tokenizer(source)
        return cls(tokenizer, generation_end_ids(model_directory(source)))

    @property
    def end_id(self) -> int:
        """The end-of-sequence id (for chat models, the end of a turn)."""
        return int(self.tokenizer.eos_token_id)

    def encode(self, prompt: str, chat: bool = False, add_special_tokens: bool = True,
               keep: int | None = None, side: str | None = None) -> list[int]:
        """Token ids of ``prompt``; with ``chat`` it is sent as one user turn
        through the model's chat template, with the assistant's turn opened.
        `add_special_tokens`: the tokenizer's own (a BOS, where it adds one;
        a plain prompt's default, vLLM's too); `keep`, `side`: at most that
        many (``tokenize``). Raises InvalidRequest for an empty prompt or
        ``chat`` on a model without a chat template."""
        if not isinstance(prompt, str) or not prompt:
            raise InvalidRequest("text_input must be a non-empty string")
        if not chat:
            return self.tokenize(prompt, add_special_tokens, keep, side)
        return self.encode_chat([{"role": "user", "content": prompt}], keep=keep, side=side)

    def tokenize(self, text: str, add_special_tokens: bool = True,
                 keep: int | None = None, side: str | None = None) -> list[int]:
        """Token ids of any text, the empty one included (no check).

        `keep` (>= 1): at most that many, truncated from the left as
        transformers does (``truncation=True, max_length=keep`` with
        ``truncation_side="left"``): the special tokens the tokenizer added
        (a BOS) stay, the text's first tokens go. vLLM truncates a prompt so
        (vllm/renderers/params.py, ``TokenizeParams.get_encode_kwargs``;
        its tokenizers are loaded with truncation_side left,
        vllm/tokenizers/registry.py). Where keep is less than the added
        tokens, the last keep ids. A `side` ("left", "right") given, as
        vLLM's truncation_side, cuts the whole sequence there instead,
        special tokens and all: the last keep ids, or the first
        (``TokenizeParams._truncation_slice``)."""
        if keep is None or side is not None:
            ids = list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
            return ids if keep is None or keep >= len(ids) else \
                ids[:keep] if side == "right" else ids[-keep:]
        encoded = self.tokenizer(text, add_special_tokens=add_special_tokens,
                                 return_special_tokens_mask=True)
        ids, added = list(encoded["input_ids"]), encoded["special_tokens_mask"]
        text_places = [place for place, special in enumerate(added) if not special]
        drop = len(ids) - keep
        if drop <= 0:
            return ids
        if drop > len(text_places):
            return ids[-keep:]
        dropped = set(text_places[:drop])
        return [token for place, token in enumerate(ids) if place not in dropped]

    @functools.cached_property
    def template_arguments(self) -> frozenset[str]:
        """Names a request may not hand the template as variables
        (``encode_chat``'s `variables`): ``apply_chat_template``'s own
        arguments (read once per codec), the names transformers' renderer
        passes the template itself (``render_jinja_template``:
        ``messages``, a second one of which is a TypeError) and the
        functions it gives the template (``raise_exception``,
        ``strftime_now``: a value there breaks the template's call)."""
        import inspect

        return frozenset(
            name for name, p in inspect.signature(self.tokenizer.apply_chat_template).parameters.items()
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)) | TEMPLATE_OWN_NAMES

    def encode_chat(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, variables: Mapping | None = None,
                    add_special_tokens: bool = False, keep: int | None = None,
                    tools: Sequence[Mapping] | None = None, side: str | None = None) -> list[int]:
        """Token ids of a conversation (``{"role", "content"}`` turns) through
        the model's chat template, with the assistant's turn opened unless not
        `add_generation_prompt`; `continue_final_message`: the last turn left
        open, to be continued (vLLM's request fields of these names);
        `variables`: more for the template to read (vLLM's
        ``chat_template_kwargs``); `tools`: the functions the model may
        call (OpenAI's ``tools``, for a template that lists them); `add_special_tokens`: the tokenizer's
        own on top of the template's (which already holds what the model
        wants: off by default); `keep`, `side`: at most that many of the
        templated text's tokens (``tokenize``). Raises InvalidRequest on a model without a chat
        template or a conversation the template refuses (its message, led
        by the field at fault: ``messages``, or ``chat_template_kwargs``
        where variables were given and the template failed on a value's
        type)."""
        return self.tokenize(self.render_chat(messages, add_generation_prompt,
                                              continue_final_message, variables, tools),
                             add_special_tokens, keep, side)

    def render_chat(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, variables: Mapping | None = None,
                    tools: Sequence[Mapping] | None = None,
                    documents: Sequence[Mapping] | None = None) -> str:
        """The text ``encode_chat`` tokenizes (its arguments and errors);
        `documents`: texts for a retrieval-augmented template (vLLM's
        ``documents``; a template without them ignores them)."""
        if not self.tokenizer.chat_template:
            raise InvalidRequest("chat was requested but the model has no chat template")
        from jinja2.exceptions import TemplateError

        try:
            return self.tokenizer.apply_chat_template(
                [dict(m) for m in messages], tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **({"tools": list(tools)} if tools else {}),
                **({"documents": list(documents)} if documents else {}), **(variables or {}))
        except TemplateError as error:  # a template's raise_exception(): the client's turns
            raise InvalidRequest(f"messages: the chat template refused them: {error}") from None
        except ValueError as error:  # continue_final_message: the last turn not in the text
            raise InvalidRequest(f"messages: {error}") from None
        except (TypeError, RuntimeError) as error:
            # a variable of a type the template cannot use ("'int' object is
            # not iterable"): the client's, as vLLM answers it (400: its
            # serving_chat catches ValueError, TypeError, RuntimeError and
            # jinja2.TemplateError around rendering)
            field = "chat_template_kwargs" if variables else "messages"
            raise InvalidRequest(f"{field}: the chat template failed on them: "
                                 f"{type(error).__name__}: {error}") from None

    def decode(self, token_ids: Sequence[int], special: bool = False) -> str:
        """One-shot decode, special tokens skipped (as the detokenizer does)
        unless `special`."""
        if self._backend_decode is not None:
            return self._backend_decode(list(token_ids), skip_special_tokens=not special)
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=not special)

    def token_bytes(self, token_id: int, special: bool = False) -> bytes:
        """The token's own bytes (OpenAI's logprobs ``bytes``, which lets a
        client join the pieces of a character split over tokens): a byte-level
        BPE vocabulary's token (SmolLM2, Llama 3, Qwen2) maps back to its raw
        bytes, where its text alone would be a replacement character; any
        other token (added and special ones, other tokenizers, ids past the
        tokenizer) is its text's UTF-8. b"" for a special token, whose text
        is skipped, unless `special` (``decode``'s)."""
        piece = self.tokenizer.convert_ids_to_tokens(int(token_id))
        if piece is None:  # past the tokenizer (a padded lm_head): its text's, if any
            return self.decode([token_id], special).encode()
        if self._byte_of is None:
            self._byte_of = byte_level_alphabet(self.tokenizer)
        byte_of = self._byte_of
        if byte_of and token_id not in self.tokenizer.added_tokens_decoder and \
                all(char in byte_of for char in piece):
            return bytes(byte_of[char] for char in piece)
        return self.decode([token_id], special).encode()

    def words_ids(self, words: Sequence[str], name: str = "bad_words",
                  spaced: bool = False) -> list[list[int]]:
        """Each word as the id sequence the model would generate for it
        (encoded alone, without special tokens, as TensorRT-LLM's
        preprocessing encodes its bad and stop words). `spaced`: vLLM's bad
        words (vllm/sampling_params.py, ``SamplingParams.update_from_tokenizer``):
        each word once, its leading spaces stripped, encoded alone and also
        after one space, that form kept where it is as many tokens and starts
        with another one (the word in mid-text: " Paris" where "Paris" began
        the text), at most ``MAX_SPACED_WORDS`` forms in all. Raises
        InvalidRequest naming `name` for a non-string or empty word, a word
        with no token, or too many forms."""
        lists, seen = [], set()
        for word in words:
            if not isinstance(word, str) or not word:
                raise InvalidRequest(f"{name} must be non-empty strings, got {word!r}")
            if not spaced:
                lists.append(self.tokenize(word, False))
            elif word not in seen:
                seen.add(word)
                alone, after_space = (self.tokenize(space + word.lstrip(), False)
                                      for space in ("", " "))
                if not alone:
                    raise InvalidRequest(f"{name} must each be at least one token, got {word!r}")
                new_word = len(after_space) == len(alone) and after_space[0] != alone[0]
                lists += [alone, after_space] if new_word else [alone]
                if len(lists) > MAX_SPACED_WORDS:
                    raise InvalidRequest(f"{name} must make at most {MAX_SPACED_WORDS} words "
                                         f"once encoded (each alone and after a space)")
        return lists

    def detokenizer(self, prompt_ids: Sequence[int] = (), special: bool = False) -> "Detokenizer":
        """A generation's streaming text; special tokens' text kept with
        `special` (vLLM's skip_special_tokens false)."""
        return Detokenizer(self, prompt_ids, special)


def byte_level_alphabet(tokenizer) -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte, where the tokenizer
    decodes with it (its Rust decoder is ``ByteLevel``); else empty."""
    from tokenizers.decoders import ByteLevel

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not isinstance(backend.decoder, ByteLevel):
        return {}
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


class Detokenizer:
    """Streaming decode of one sequence's generated ids (module docstring).

    Holds a window of ids: ``[window_start, emitted_end)`` is text already
    emitted (kept as decoding context), ``[emitted_end, len)`` is not emitted
    yet. Each call decodes only the window, so the cost per token stays flat.

    With a Rust tokenizer the per-token work is ``tokenizers``'
    ``DecodeStream`` (the same rule in one native call, about a fifth of the
    two decodes), and the window is only tracked for ``flush``.
    """

    def __init__(self, codec: TextCodec, prompt_ids: Sequence[int] = (), special: bool = False):
        self.codec = codec
        self.special = special  # special tokens' text kept
        self.ids = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self.window_start = 0
        self.emitted_end = len(self.ids)
        self.backend = codec.backend
        self.stream = (DecodeStream(ids=list(self.ids), skip_special_tokens=not special)
                       if codec.backend is not None else None)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add generated ids; return the text that became stable (may be '').
        With ``DecodeStream``, the same text as ``push_token`` of each id in
        turn (one native step per id, the window's bookkeeping once): the
        decode loop's call for a stream's tokens held until its response."""
        if self.stream is None:
            self.ids.extend(int(t) for t in token_ids)
            return self._advance(final=False)
        ids = list(map(int, token_ids))
        step, backend = self.stream.step, self.backend
        deltas = [step(backend, token) for token in ids]
        base = len(self.ids)
        self.ids += ids
        # The window as push_token leaves it: from the second-last emission's
        # end (or the emitted end before these ids) to the last emission's.
        last = len(deltas) - 1
        while last >= 0 and deltas[last] is None:
            last -= 1
        if last < 0:
            return ""
        before = last - 1
        while before >= 0 and deltas[before] is None:
            before -= 1
        self.window_start = base + before + 1 if before >= 0 else self.emitted_end
        self.emitted_end = base + last + 1
        return "".join(filter(None, deltas))

    def push_token(self, token: int) -> str:
        """``push([token])`` for one int id, the decode loop's call per
        token: with ``DecodeStream``, its one native step and the window's
        bookkeeping, nothing else."""
        if self.stream is None:
            return self.push((token,))
        self.ids.append(token)
        delta = self.stream.step(self.backend, token)
        if delta is None:
            return ""
        self.window_start, self.emitted_end = self.emitted_end, len(self.ids)
        return delta

    def flush(self) -> str:
        """The rest of the text at the end of the sequence, held-back
        incomplete characters included (as U+FFFD, like a one-shot decode)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.emitted_end == len(self.ids):
            return ""
        done = self.codec.decode(self.ids[self.window_start:self.emitted_end], self.special)
        text = self.codec.decode(self.ids[self.window_start:], self.special)
        if not final and (text.endswith(REPLACEMENT_CHARACTER) or len(text) <= len(done)):
            return ""
        self.window_start, self.emitted_end = self.emitted_end, len(self.ids)
        return text[len(done):]


class StopMatcher:
    """Cuts a text stream at the first stop string (module docstring): before
    it, or after it with `include` (vLLM's include_stop_str_in_output); or
    ends it where its ids end with a word's (`sequences`, ``feed_token``).

    ``feed`` returns the text that is safe to emit and whether a stop string
    was found; after a stop nothing more is emitted. Text fed unarmed (the
    tokens of a generation short of its min_tokens) ends no match: a stop
    string ends the stream only where it ends in text fed armed, as vLLM's
    detokenizer checks its stop strings only past min_tokens
    (vllm/v1/engine/detokenizer.py, ``BaseIncrementalDetokenizer.update``).
    """

    def __init__(self, stop_words: Sequence[str] = (), include: bool = False,
                 sequences: Mapping[tuple[int, ...], str] | None = None):
        for word in stop_words:
            if not isinstance(word, str) or not word:
                raise InvalidRequest(f"stop_words must be non-empty strings, got {word!r}")
        self.stop_words = list(stop_words)
        #: TensorRT-LLM's stop words: token ids -> the word, matched where the
        #: generated tokens end with them (``feed_token``), kept in the text
        self.sequences = {ids: word for ids, word in (sequences or {}).items() if ids}
        self.tail: list[int] = []
        self.longest = max(map(len, self.sequences), default=0)
        self.include = include
        self.held = ""
        self.stopped = False
        #: the stop string that ended the stream (vLLM's stop_reason), once one has
        self.matched: str | None = None
        #: the length of `held`'s start no match may end in (text fed unarmed)
        self.unarmed = 0

    def feed(self, text: str, armed: bool = True) -> tuple[str, bool]:
        """``(text to emit, stopped)`` after appending ``text`` to the stream;
        unless `armed`, ``text`` ends no stop string."""
        if self.stopped:
            return "", True
        if not self.stop_words:  # the common case: nothing to hold back
            return text, False
        self.held += text
        if not armed:
            self.unarmed = len(self.held)
        found = [(*match, word) for word in (self.stop_words if armed else ())
                 if (match := self._match(word)) is not None]
        if found:
            # the first to end, then the first to begin: the word a stream fed
            # a character at a time meets first, however its tokens split it
            # (vLLM takes the first of its list found in a token's text: the
            # two differ only where one token's text completes two words)
            end, start, self.matched = min(found)
            self.stopped = True
            emit, self.held = self.held[:end if self.include else start], ""
            return emit, True
        keep = max((k for w in self.stop_words for k in range(1, len(w))
                    if self.held.endswith(w[:k])), default=0)
        emit, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        self.unarmed = max(0, self.unarmed - len(emit))
        return emit, False

    @classmethod
    def of(cls, codec: TextCodec, words: Sequence[str], include: bool = False,
           as_tokens: bool = False, prompt_ids: Sequence[int] = (),
           id_words: Sequence[Sequence[int]] = ()) -> "StopMatcher":
        """`words` matched in the text (vLLM's stop strings), or as their
        tokens (TensorRT-LLM's stop words: `as_tokens`), and `id_words` (its
        stop words as token ids, each named by its text) as tokens. A word
        matched as tokens may begin in the prompt's last ids: TensorRT-LLM's
        stop criterion reads the sequence's ids, prompt included
        (stopCriteriaKernels.cu)."""
        sequences = {tuple(ids): codec.decode(list(ids), True) for ids in id_words}
        if as_tokens:
            sequences.update((tuple(ids), word)
                             for ids, word in zip(codec.words_ids(words, "stop_words"), words))
        matcher = cls(() if as_tokens else words, include, sequences)
        matcher.tail = list(prompt_ids)[-(matcher.longest - 1):] if matcher.longest > 1 else []
        return matcher

    @property
    def active(self) -> bool:
        """Whether anything can stop the stream: each token must be looked at."""
        return bool(self.stop_words or self.sequences)

    def feed_token(self, token: int) -> str | None:
        """The stop word whose tokens the sequence's ids end with, now that
        `token` came (TensorRT-LLM's rule, which min_tokens does not hold
        back there), or None."""
        self.tail.append(token)
        del self.tail[:max(0, len(self.tail) - self.longest)]
        for ids, word in self.sequences.items():
            if len(self.tail) >= len(ids) and tuple(self.tail[-len(ids):]) == ids:
                return word
        return None

    def _match(self, word: str) -> tuple[int, int] | None:
        """(end, start) in `held` of `word`'s first occurrence that ends past
        the unarmed text, or None."""
        start = self.held.find(word, max(0, self.unarmed - len(word) + 1))
        return None if start < 0 else (start + len(word), start)

    def flush(self) -> str:
        """The held-back tail, at the end of a stream that did not stop."""
        emit, self.held = ("" if self.stopped else self.held), ""
        return emit
