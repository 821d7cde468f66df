"""Text for the simulated engine (``simulated.SimulatedEngine``), whose
rows carry ids a real tokenizer may not know: the model's tokenizer for
those it knows, `` t<i>`` for any other id ``i``."""
from __future__ import annotations

from typing import Sequence

from .text import DecodeStream, TextCodec


class SimulatedCodec(TextCodec):
    """Text for a simulated engine: the model's tokenizer (SmolLM2's by
    default) encodes prompts and bad words and decodes the ids it has; an id
    beyond its vocabulary (the synthetic rows are wider: V = 128,256 or
    151,936 against SmolLM2's 49,152) reads `` t<id>``. So the preprocessing
    model, which knows nothing of the engine, encodes prompts exactly as the
    llm model does."""

    def __init__(self, tokenizer, end_ids: Sequence[int] = ()):
        super().__init__(tokenizer, end_ids)
        self.known = len(tokenizer)

    def decode(self, token_ids: Sequence[int], special: bool = False) -> str:
        parts, run = [], []
        for token in map(int, token_ids):
            if token < self.known:
                run.append(token)
                continue
            if run:
                parts.append(self.decode_run(run, special))
                run = []
            parts.append(f" t{token}")
        if run:
            parts.append(self.decode_run(run, special))
        return "".join(parts)

    def decode_run(self, token_ids: Sequence[int], special: bool = False) -> str:
        """The tokenizer's decode of ids it knows."""
        return super().decode(token_ids, special)

    def detokenizer(self, prompt_ids: Sequence[int] = (), special: bool = False):
        if self.backend is None:  # no DecodeStream: the window decoder, on decode() above
            return super().detokenizer(prompt_ids, special)
        return SimulatedDetokenizer(self, special)


class SimulatedDetokenizer:
    """Streaming text of :meth:`SimulatedCodec.decode` at the cost of the
    tokenizer's own streaming: a run of known ids goes through ``tokenizers``'
    ``DecodeStream`` (without context, as ``decode`` decodes each run); an id
    past the vocabulary ends the run, releasing the run's held-back text (an
    incomplete character as U+FFFD, as ``decode`` gives it), and reads
    `` t<id>``. The concatenation of the deltas and ``flush`` is ``decode``
    of the ids."""

    def __init__(self, codec: SimulatedCodec, special: bool = False):
        self.codec = codec
        self.special = special  # special tokens' text kept
        self._start_run()

    def _start_run(self) -> None:
        self.run: list[int] = []
        self.emitted = 0  # characters of the run's text already returned
        self.held = False  # the stream's last step held its text back (None)
        self.stream = DecodeStream(skip_special_tokens=not self.special)

    def push(self, token_ids: Sequence[int]) -> str:
        """``push_token`` of each id in turn, in one loop (the decode loop's
        call for a stream's held tokens)."""
        known, backend = self.codec.known, self.codec.backend
        parts = []
        for token in map(int, token_ids):
            if token >= known:
                if self.run:
                    parts.append(self.flush())
                parts.append(f" t{token}")
                continue
            self.run.append(token)
            delta = self.stream.step(backend, token)
            self.held = delta is None
            if delta:
                self.emitted += len(delta)
                parts.append(delta)
        return "".join(parts)

    def push_token(self, token: int) -> str:
        """``push([token])`` for one int id (the decode loop's call per token)."""
        if token >= self.codec.known:
            # flush() has a run to end: not so for most ids
            return self.flush() + f" t{token}" if self.run else f" t{token}"
        self.run.append(token)
        delta = self.stream.step(self.codec.backend, token)
        self.held = delta is None
        if delta:
            self.emitted += len(delta)
            return delta
        return ""

    def flush(self) -> str:
        if not self.run:  # most ids are past the vocabulary: no run to end
            return ""
        # A stream whose last step gave text holds nothing back: the run's
        # text is what it returned, no decode needed to end it.
        tail = self.codec.decode_run(self.run, self.special)[self.emitted:] if self.held else ""
        self._start_run()
        return tail
