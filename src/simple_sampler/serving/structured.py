"""Structured outputs: a generation held to a grammar (any JSON object, a
JSON schema, a regular expression, a choice of strings, an EBNF or Lark
grammar) by ruling out, before each sampling, every token the grammar
cannot take next.

A request's :class:`Guide` (TensorRT-LLM's ``guided_decoding_guide_type``
and ``guided_decoding_guide``; vLLM's ``structured_outputs`` and the OpenAI
``response_format`` come to it) is compiled by llguidance, the grammar
library behind vLLM's ``guidance`` backend and TensorRT-LLM's ``llguidance``
one (:meth:`Grammars.compiled`: in a worker thread before the request
reaches the decode loop, :meth:`Grammars.precompile`), and each request
gets a matcher of its own (:meth:`Grammars.matcher`, at admission, so a
bad guide is refused by name before it queues). vLLM's
``allowed_token_ids`` is a fixed mask on the same path (:func:`bitmask_of`).

Per step, the decode loop has the next-token bitmask of every row that
has a matcher filled (:meth:`Grammars.masks`, on llguidance's threads,
while the step's forward runs: a mask depends on the tokens taken, not on
the step's logits) and the data-plane thread sets each ruled-out token's
logit to -inf in a copy of the step's rows (:meth:`StepMasks.applied`),
right behind the forward and before any sampler reads them: where vLLM
applies its grammar bitmask (between the model runner's forward and its
sampler). So every path (full rows, hot-first rows, in-line) samples the
model's distribution renormalized over the tokens the grammar allows, and
a seeded row's token still depends only on its own seed, step, parameters
and (masked) logits. Once sampled, each matcher takes its row's token
(:meth:`Grammars.consume`).

The grammar ends a generation through an end id: a matcher whose grammar
is complete allows only the model's end ids (its tokenizer's end of
sequence, :meth:`Grammars.tokenizer`), so a guided request must be ended
by some of them (no ``ignore_eos``, no ``end_id`` -1 or outside them), and
the model's others are banned for it. ``max_tokens`` and stop strings may
still cut it short, as in vLLM.
"""
from __future__ import annotations

import collections
import json
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..schema import GUIDE_TYPES, InvalidRequest

if TYPE_CHECKING:  # requests carry a Guide where torch is not imported
    import torch

#: llguidance's threads filling a step's masks (its own default, 80% of the
#: host's cores, would take the sampler instances' cores on a GPU host)
MASK_THREADS = min(4, os.cpu_count() or 1)
#: compiled grammars kept for requests that send the same guide again
CACHED_GRAMMARS = 64


#: vLLM's structured-output fields (``StructuredOutputsParams``, and the
#: older ``GuidedDecodingParams``) that name a grammar -> its guide type
VLLM_GUIDES = {"json": "json_schema", "regex": "regex", "choice": "choice",
               "grammar": "ebnf_grammar", "json_object": "json"}
#: vLLM's structured-output backends whose grammars llguidance compiles the
#: same (its "auto" picks one of them)
VLLM_BACKENDS = ("auto", "xgrammar", "guidance", "llguidance")
#: llguidance's JSON options in a schema (its docs/json_schema.md): vLLM's
#: disable_any_whitespace is whitespace_flexible false there
JSON_OPTIONS = "x-guidance"
#: the guide's text as the llm model takes it (a refusal names it so by default)
GUIDE_TEXT = "guided_decoding_guide"


@dataclass(frozen=True)
class Guide:
    """A request's grammar: its `type` (a key of :data:`GUIDE_TYPES`) and
    `text` (what ``GUIDE_TYPES`` says it holds)."""

    type: str
    text: str = ""

    @classmethod
    def of_vllm(cls, fields, place: str) -> Guide:
        """The guide of vLLM's ``structured_outputs`` (or ``guided_decoding``)
        object `fields` (or its JSON text, as Triton's vLLM backend takes
        it), sent as `place`: exactly one grammar field, and
        ``disable_any_whitespace``, which for a JSON grammar keeps
        whitespace out of it, as in vLLM; ``backend`` names one whose
        grammars are llguidance's (:data:`VLLM_BACKENDS`); any other field
        is refused by name unless null or false (its default)."""
        if isinstance(fields, str):
            try:
                fields = json.loads(fields)
            except ValueError as error:
                raise InvalidRequest(f"{place} is not JSON: {error}") from None
        if not isinstance(fields, dict):
            raise InvalidRequest(f"{place} must be an object")
        given = {name: value for name, value in fields.items()
                 if value is not None and value is not False}
        if given.get("backend", "auto") not in VLLM_BACKENDS:
            raise InvalidRequest(f"{place}.backend must be one of {', '.join(VLLM_BACKENDS)} "
                                 f"(grammars are llguidance's here), got {given['backend']!r}")
        unknown = sorted(set(given) - set(VLLM_GUIDES) - {"disable_any_whitespace", "backend"})
        if unknown:
            raise InvalidRequest(f"{place}.{unknown[0]} is not supported by this server "
                                 f"(it takes {', '.join(VLLM_GUIDES)}, disable_any_whitespace "
                                 f"and backend)")
        if given.get("disable_any_whitespace", True) is not True:
            raise InvalidRequest(f"{place}.disable_any_whitespace must be true or false, got "
                                 f"{given['disable_any_whitespace']!r}")
        named = [name for name in VLLM_GUIDES if name in given]
        if len(named) != 1:
            raise InvalidRequest(f"{place} must name exactly one of {', '.join(VLLM_GUIDES)}")
        name, value = named[0], given[named[0]]
        kind = VLLM_GUIDES[name]
        if name == "json_object":
            if value is not True:
                raise InvalidRequest(f"{place}.json_object must be true")
            value = {"type": "object"}
            kind = "json_schema" if given.get("disable_any_whitespace") else "json"
        if kind == "json_schema" and isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as error:
                raise InvalidRequest(f"{place}.{name} is not JSON: {error}") from None
        if given.get("disable_any_whitespace"):
            options = value.get(JSON_OPTIONS, {}) if isinstance(value, dict) else None
            if kind != "json_schema" or not isinstance(options, dict):
                raise InvalidRequest(f"{place}.disable_any_whitespace applies to a JSON schema "
                                     f"(whose {JSON_OPTIONS}, if any, is an object) or "
                                     f"json_object only")
            value = {**value, JSON_OPTIONS: {**options, "whitespace_flexible": False}}
        if kind == "json":
            return cls(kind)
        if kind in ("json_schema", "choice"):
            return cls(kind, json.dumps(value))
        if not isinstance(value, str):
            raise InvalidRequest(f"{place}.{name} must be a string")
        return cls(kind, value)

    def validate(self, place: str = GUIDE_TEXT) -> None:
        """Raise InvalidRequest naming the input (the text's: `place`) and
        what it may hold."""
        if self.type not in GUIDE_TYPES:
            raise InvalidRequest(f"guided_decoding_guide_type must be one of "
                                 f"{', '.join(GUIDE_TYPES)}, got {self.type!r}")
        if (self.type == "json") == bool(self.text):
            typed = f" with guided_decoding_guide_type {self.type}" if place == GUIDE_TEXT else ""
            raise InvalidRequest(f"{place} must hold {GUIDE_TYPES[self.type]}{typed}")

    def check(self, place: str = GUIDE_TEXT) -> None:
        """``validate``, and the grammar checked without a tokenizer: where a
        request arrives with no status to carry a refusal later (the
        OpenAI door, whose gRPC stream to the llm model carries an error's
        text alone). Without llguidance there, the llm model refuses it.
        `place`: the text's name in a refusal (the field the client sent)."""
        self.validate(place)
        try:
            import llguidance
        except ImportError:
            return
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(self.grammar(place))
        if failed:
            raise InvalidRequest(f"{place} is not {GUIDE_TYPES[self.type]}: {messages[0]}")

    def grammar(self, place: str = GUIDE_TEXT) -> str:
        """llguidance's grammar of this guide; raises InvalidRequest, naming
        the text as `place`, where the text is not of its type."""
        import llguidance

        try:
            if self.type in ("json", "json_schema"):
                schema = self.text or '{"type": "object"}'
                return llguidance.LLMatcher.grammar_from_json_schema(schema)
            if self.type == "choice":
                choices = json.loads(self.text)
                if not isinstance(choices, list) or not choices or \
                        not all(isinstance(c, str) for c in choices):
                    raise ValueError("not a non-empty JSON list of strings")
                return llguidance.grammar_from("choice", choices)
            return llguidance.grammar_from({"regex": "regex"}.get(self.type, "grammar"), self.text)
        except ValueError as error:
            raise InvalidRequest(f"{place} is not {GUIDE_TYPES[self.type]}: {error}") from None


class Grammars:
    """A decoder's grammars: llguidance's tokenizer over the model's
    vocabulary, its end of sequence the model's `end_ids` (built at the
    first guided request), the guides compiled, and the per-step masks
    and token consumption of the rows that have a matcher (module
    docstring). `tokenizer`: the codec's Hugging Face tokenizer (a fast
    one)."""

    def __init__(self, tokenizer, vocab_size: int, end_ids: Sequence[int]):
        self.hf_tokenizer, self.vocab_size = tokenizer, vocab_size
        self.end_ids = list(end_ids)
        self.ll_tokenizer = None
        self.executor = None  # llguidance's threads for a step's masks, made at first use
        self.templates: collections.OrderedDict[Guide, object] = collections.OrderedDict()
        self.lock = threading.Lock()  # the templates: compiled on worker threads too
        self.tokenizer_lock = threading.Lock()

    def tokenizer(self):
        """llguidance's tokenizer (module docstring), built once."""
        with self.tokenizer_lock:
            if self.ll_tokenizer is None:
                try:
                    import llguidance.hf
                except ImportError:
                    raise InvalidRequest("guided decoding is not available on this server: the "
                                         "llguidance package is not installed (pip install "
                                         "llguidance)") from None
                try:
                    self.ll_tokenizer = llguidance.hf.from_tokenizer(
                        self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.end_ids)
                except ValueError as error:  # a slow tokenizer
                    raise InvalidRequest(f"guided decoding is not available for this model's "
                                         f"tokenizer: {error}") from None
            return self.ll_tokenizer

    def compiled(self, guide: Guide):
        """`guide`'s matcher as compiled (kept: :data:`CACHED_GRAMMARS`), not
        to be used itself (``matcher`` copies it); raises InvalidRequest
        where it does not compile. Thread-safe: the compiling, which lets
        the GIL go, holds no lock."""
        with self.lock:
            template = self.templates.get(guide)
            if template is not None:
                self.templates.move_to_end(guide)
                return template
        tokenizer = self.tokenizer()  # first: it says if llguidance is missing
        import llguidance

        template = llguidance.LLMatcher(tokenizer, guide.grammar(), log_level=0)
        if template.is_error():
            raise InvalidRequest(f"guided_decoding_guide is not {GUIDE_TYPES[guide.type]}: "
                                 f"{template.get_error()}")
        with self.lock:
            self.templates[guide] = template
            while len(self.templates) > CACHED_GRAMMARS:
                self.templates.popitem(last=False)
        return template

    def precompile(self, guide: Guide) -> None:
        """``compiled``, in a worker thread before the request reaches the
        decode loop (``LlmService``), so that its event loop does not stall
        on a grammar; a guide that does not compile is left to ``matcher``
        to refuse, as for any request."""
        try:
            guide.validate()
            self.compiled(guide)
        except InvalidRequest:
            pass

    def matcher(self, guide: Guide, end_ids: Sequence[int]):
        """A fresh matcher of `guide` for a request ended by `end_ids`,
        which must be some of the model's (its grammar ends it at them: the
        model's others are the request's to ban, ``admission.prepare``);
        raises InvalidRequest where the guide does not compile (or
        llguidance is not installed)."""
        guide.validate()
        if not end_ids or not set(end_ids) <= set(self.end_ids):
            raise InvalidRequest(f"a guided generation ends at the model's end ids "
                                 f"({', '.join(map(str, self.end_ids)) or 'none'}): ignore_eos, "
                                 f"end_id -1 and another end_id cannot be given with "
                                 f"guided_decoding_guide_type")
        return self.compiled(guide).deep_copy()

    def masks(self, matchers: Sequence, allowed: Sequence) -> StepMasks | None:
        """The next-token bitmasks of a step's rows (`matchers`: each row's
        matcher or None; `allowed`: each row's allowed_token_ids bitmask or
        None), the two and-ed where a row has both; None where no row has
        either."""
        rows = [row for row, (matcher, mask) in enumerate(zip(matchers, allowed))
                if matcher is not None or mask is not None]
        if not rows:
            return None
        bitmask = np.full((len(rows), (self.vocab_size + 31) // 32), -1, np.int32)
        guided = [(matchers[row], index) for index, row in enumerate(rows)
                  if matchers[row] is not None]
        if guided:
            if self.executor is None:
                import llguidance

                self.executor = llguidance.LLExecutor(num_threads=MASK_THREADS)
            # the rows' masks at once, on llguidance's threads, the GIL let go
            self.executor.unsafe_compute_mask_ptr(guided, bitmask.ctypes.data,
                                                  bitmask.shape[1] * 4, len(rows))
        for index, row in enumerate(rows):
            if allowed[row] is not None:
                bitmask[index] &= allowed[row]
        return StepMasks(np.asarray(rows, np.int64), bitmask, self.vocab_size)

    @staticmethod
    def consume(matchers: Sequence, tokens: np.ndarray, skipped: Sequence[int] = ()
                ) -> dict[int, str]:
        """Each row's matcher takes its row's token (rows in `skipped`, and
        rows without one, left out); the rows whose grammar refused its
        token, each with the reason (a sampler that ignored the mask)."""
        broken = {}
        for row, matcher in enumerate(matchers):
            if matcher is not None and row not in skipped \
                    and not matcher.consume_token(int(tokens[row])):
                broken[row] = (f"the sampled token {int(tokens[row])} is not one its grammar "
                               f"allows: {matcher.get_error()}")
        return broken


def complete_and_banned(matcher, error: str) -> str | None:
    """The error a guided row the sampler refused (`error`, its reason) ends
    with where its grammar is complete, so that only an end id may follow
    and none could be taken; None where the row has no grammar or it is not
    complete (the sampler's error stands alone)."""
    if matcher is None or not matcher.is_stopped() or matcher.is_error():
        return None
    return (f"guided_decoding_guide's output is complete, so only an end id may follow, and "
            f"none can be taken here (min_tokens, bad_words, logit_bias or allowed_token_ids "
            f"ban them, or the model's logits do): {error}")


def bitmask_of(token_ids: Sequence[int], vocab_size: int) -> np.ndarray:
    """int32 [ceil(V / 32)]: the bitmask (llguidance's layout, ``StepMasks``)
    allowing `token_ids` alone (vLLM's allowed_token_ids)."""
    bits = np.zeros(32 * ((vocab_size + 31) // 32), np.uint8)
    bits[np.asarray(token_ids, np.int64)] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


@dataclass(frozen=True)
class StepMasks:
    """The bitmasks of a step's guided rows: `rows` (int64 [n], their
    places in the step), `bitmask` (int32 [n, ceil(V / 32)], bit j of word
    i set where token 32 i + j is allowed, llguidance's layout)."""

    rows: np.ndarray
    bitmask: np.ndarray
    vocab_size: int

    def allowed(self) -> np.ndarray:
        """bool [n, V]: each guided row's allowed tokens."""
        return np.unpackbits(self.bitmask.view(np.uint8), axis=1, count=self.vocab_size,
                             bitorder="little").view(bool)

    def allowed_on(self, device) -> torch.Tensor:
        """``allowed`` as a torch tensor on `device`: unpacked on the host
        for the CPU; elsewhere the bitmask (a 32nd of it) is copied and
        unpacked there."""
        import torch

        device = torch.device(device)
        if device.type == "cpu":
            return torch.from_numpy(self.allowed())
        return unpacked(torch.from_numpy(self.bitmask).to(device), self.vocab_size)

    def applied(self, logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """A copy of the step's `logits` ([B, V], float32, float16 or
        bfloat16, any device) with every token its row's grammar rules out
        at -inf; the engine's own rows are left as they are (they may be its
        buffers). On the CPU, one read and one write of each row
        (``_sampling.masked_rows``, on :data:`MASK_THREADS` threads), into
        `out` where given (contiguous, `logits`' shape and dtype); on a
        device, there."""
        import torch

        if logits.shape[1] != self.vocab_size:
            raise ValueError(f"the step's rows are {logits.shape[1]} wide, its grammars' "
                             f"vocabulary {self.vocab_size}")
        if logits.device.type == "cpu":
            from .. import _sampling
            from ..sampling import kernel_rows

            rows, dtype = kernel_rows(logits)
            masked = torch.empty(logits.shape, dtype=logits.dtype) if out is None else out
            if masked.shape != logits.shape or masked.dtype != logits.dtype \
                    or not masked.is_contiguous():
                raise ValueError(f"out must be contiguous {logits.dtype} {list(logits.shape)}, "
                                 f"got {masked.dtype} {list(masked.shape)}")
            _sampling.masked_rows(rows, dtype, np.ascontiguousarray(self.rows, np.int64),
                                  np.ascontiguousarray(self.bitmask, np.int32),
                                  kernel_rows(masked)[0], MASK_THREADS)
            return masked
        rows = torch.from_numpy(self.rows).to(logits.device)
        ruled_out = ~self.allowed_on(logits.device)
        masked = logits.clone()
        masked[rows] = logits[rows].masked_fill(ruled_out, float("-inf"))
        return masked


def unpacked(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [n, vocab_size] of int32 bitmask words [n, ceil(V / 32)] (bit j
    of word i: token 32 i + j), on the words' device."""
    import torch

    bits = torch.arange(32, device=words.device, dtype=torch.int32)
    return ((words.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab_size]
