"""The decoder's sequences as persistent columns: a step's SamplingBatch is
gathered with numpy, not rebuilt from Python lists.

In the spirit of vLLM's ``InputBatch`` (vllm/v1/worker/gpu_input_batch.py,
``add_request`` / ``remove_request``): a sequence holds a slot from admission
to release; its sampling parameters, checked once at admission, live in
numpy columns indexed by slot, and its token history (prompt, then output)
in one preallocated ``[slots, max_context]`` int32 array that each step
appends to in place. Building a step's batch is then index arithmetic over
the step's slots; Python touches only the rows that need it: rows with a
logit bias, rows still short of ``min_tokens`` (their stop ids are banned)
and rows with bad words.

Histories are sent only where a penalty reads them: the prompt for a
repetition penalty, the output for any penalty. A row with every penalty off
gets empty lists, which the kernels treat exactly like its full history
(a penalty of 1 or 0 changes no logit), so its token is the same. The
prompt goes as its distinct ids, ascending, kept from admission: the
repetition penalty reads which ids the prompt holds, not how often (vLLM's
prompt mask), and a long prompt's text holds most of its ids several
times, so a step sends and groups that much less.

Given the sampler pool's row arena, the history arrays lie in a region of
it and a step names each penalized row's ids there instead of gathering
them (``SamplingBatch.history_ref``, ``simple_sampler.histories``).
"""
from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

from ..histories import HISTORY_REF_COLUMNS, NO_IDS, HistoryRef, ranges_csr
from ..params import RULES, SamplingBatch, SamplingParams

log = logging.getLogger(__name__)

#: stop ids (end ids and stop_token_ids) a row may have and still be handled
#: in numpy, its bans and its end alike (Llama 3.1 has three end ids); a row
#: with more takes a per-row pass
STOP_COLUMNS = 4

#: (column, dtype, value of a free slot) for the per-row scalars: the
#: parameters' table, and min_tokens (turned into bans when a batch is built).
SCALAR_COLUMNS = (*((p.name, p.dtype, p.neutral) for p in RULES), ("min_tokens", np.int64, 0))


class BatchState:
    """Sampling state of up to ``slots`` sequences of at most ``max_context``
    tokens each (the engine's ``max_batch_size`` and ``max_context``).

    The history array is allocated zeroed and untouched, so only the pages
    the sequences write to take memory; with an `arena`
    (``row_arena.RowArena``), in a region of it, reserved whole, and the
    step's batches name the histories there (module docstring).
    """

    def __init__(self, slots: int, max_context: int, raw_logprobs: bool = False, arena=None):
        self.max_context = max_context
        #: every row's logprobs are its logits' own (SamplingBatch.raw_logprobs)
        self.raw_logprobs = raw_logprobs
        self.free = list(range(slots - 1, -1, -1))  # pop() takes the lowest
        self.columns = {name: np.full(slots, empty, dtype) for name, dtype, empty in SCALAR_COLUMNS}
        self.seed = np.zeros(slots, np.uint64)
        self.want_logprobs = np.zeros(slots, bool)
        self.num_top_logprobs = np.zeros(slots, np.int32)
        self.prompt_length = np.zeros(slots, np.int64)
        self.length = np.zeros(slots, np.int64)  # prompt + output tokens
        #: (the histories' region key, a flat view of them) where they lie in the arena
        self.shared = self._shared_histories(slots, max_context, arena)
        histories = (self.shared[1].reshape(2, slots, max_context) if self.shared is not None
                     else np.zeros((2, slots, max_context), np.int32))
        # each slot's history, and its distinct prompt ids ascending
        # (repetition-penalized slots only)
        self.tokens, self.prompt_seen = histories
        self.prompt_seen_length = np.zeros(slots, np.int64)
        # Per-slot id lists, read only for the rows that have them (found
        # through the boolean columns, so rows without pay no Python).
        self.stop_ids: list[np.ndarray] = [NO_IDS] * slots
        # ... and the usual case as columns (a model's end ids, a few stop
        # ids: STOP_COLUMNS), so that a step's bans need no Python per row
        self.stop_count = np.zeros(slots, np.int64)
        #: each slot's first STOP_COLUMNS stop ids, -1 padded
        self.stop_columns = np.full((slots, STOP_COLUMNS), -1, np.int32)
        self.bias: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.bad_words: dict[int, list[np.ndarray]] = {}
        self.has_bias = np.zeros(slots, bool)
        self.has_bad_words = np.zeros(slots, bool)

    def add(self, params: SamplingParams, prompt_ids: Sequence[int], want_logprobs: bool = False,
            bad_words_ids: Sequence[Sequence[int]] = (), num_top_logprobs: int = 0) -> int:
        """Store a sequence; returns its slot.

        ``params`` must already be validated against the vocabulary and
        seeded (the decoder does both at submission): nothing is checked again.
        """
        if not self.free:
            raise RuntimeError("no free slot in the batch state")
        if not 0 < len(prompt_ids) <= self.max_context:
            raise ValueError(f"prompt_ids must hold 1 to {self.max_context} tokens, "
                             f"got {len(prompt_ids)}")
        slot = self.free.pop()
        for name, _, _ in SCALAR_COLUMNS:
            self.columns[name][slot] = getattr(params, name)
        self.seed[slot] = params.seed
        self.want_logprobs[slot] = want_logprobs
        self.num_top_logprobs[slot] = num_top_logprobs
        self.prompt_length[slot] = self.length[slot] = len(prompt_ids)
        self.tokens[slot, :len(prompt_ids)] = prompt_ids
        seen = (np.unique(np.asarray(prompt_ids, np.int32)) if params.repetition_penalty != 1.0
                else NO_IDS)
        self.prompt_seen[slot, :seen.size] = seen
        self.prompt_seen_length[slot] = seen.size
        self.stop_ids[slot] = np.asarray(list(params.stop_token_ids), np.int32)
        self.stop_count[slot] = self.stop_ids[slot].size
        self.stop_columns[slot] = -1
        self.stop_columns[slot, :self.stop_ids[slot][:STOP_COLUMNS].size] = \
            self.stop_ids[slot][:STOP_COLUMNS]
        self.has_bias[slot] = bool(params.logit_bias)
        if params.logit_bias:
            self.bias[slot] = (np.fromiter(params.logit_bias, np.int32, len(params.logit_bias)),
                               np.fromiter(params.logit_bias.values(), np.float64,
                                           len(params.logit_bias)))
        self.has_bad_words[slot] = bool(bad_words_ids)
        if bad_words_ids:
            self.bad_words[slot] = [np.asarray(word, np.int32) for word in bad_words_ids]
        return slot

    def release(self, slot: int) -> None:
        """Free ``slot``; its columns are overwritten by the next ``add``."""
        self.bias.pop(slot, None)
        self.bad_words.pop(slot, None)
        self.has_bias[slot] = self.has_bad_words[slot] = False
        self.stop_ids[slot] = NO_IDS
        self.stop_count[slot] = 0
        self.free.append(slot)

    def append(self, slots: np.ndarray, tokens: np.ndarray) -> None:
        """Append one token to each of ``slots`` (int [n], distinct)."""
        if np.any(self.length[slots] >= self.max_context):
            raise ValueError(f"a sequence is at max_context={self.max_context} tokens")
        self.tokens[slots, self.length[slots]] = tokens
        self.length[slots] += 1

    def batch(self, slots: np.ndarray) -> SamplingBatch:
        """The SamplingBatch of ``slots`` (int [n]), row r for ``slots[r]``:
        step = tokens generated, bans = stop ids while short of min_tokens
        plus each bad word's last token where the history ends with the
        word's others (TensorRT-LLM's bad-words semantics)."""
        columns = {name: self.columns[name][slots] for name, _, _ in SCALAR_COLUMNS}
        min_tokens = columns.pop("min_tokens")
        prompt_length, length = self.prompt_length[slots], self.length[slots]
        step = length - prompt_length
        repetition = columns["repetition_penalty"] != 1.0
        penalized = (repetition | (columns["presence_penalty"] != 0.0)
                     | (columns["frequency_penalty"] != 0.0))
        prompt_stop = np.where(repetition, self.prompt_seen_length[slots], 0)
        output_stop = np.where(penalized, length, prompt_length)
        history_ref = None
        if self.shared is not None and penalized.any():
            history_ref = self._history_ref(slots, prompt_stop, prompt_length, output_stop)
            prompt_offsets, output_offsets = np.zeros((2, len(slots) + 1), np.int64)
            prompt_ids = output_ids = NO_IDS
        else:
            prompt_offsets, prompt_ids = self._gather(slots, np.zeros_like(prompt_length),
                                                      prompt_stop, self.prompt_seen)
            output_offsets, output_ids = self._gather(slots, prompt_length, output_stop)
        bias_rows = [(row, self.bias[int(slots[row])])
                     for row in np.flatnonzero(self.has_bias[slots]).tolist()]
        bias_offsets, bias_ids = _sparse_ragged(len(slots), [(r, b[0]) for r, b in bias_rows])
        bias_values = (np.concatenate([b[1] for _, b in bias_rows]) if bias_rows
                       else np.zeros(0, np.float64))
        ban_offsets, ban_ids = self._ban_lists(slots, step < min_tokens)
        return SamplingBatch(
            **columns, seed=self.seed[slots], step=step,
            bias_offsets=bias_offsets, bias_ids=bias_ids, bias_values=bias_values,
            ban_offsets=ban_offsets, ban_ids=ban_ids,
            prompt_offsets=prompt_offsets, prompt_ids=prompt_ids,
            output_offsets=output_offsets, output_ids=output_ids,
            want_logprobs=self.want_logprobs[slots],
            num_top_logprobs=self.num_top_logprobs[slots],
            raw_logprobs=self._raw_rows(slots), history_ref=history_ref)

    @staticmethod
    def _shared_histories(slots: int, max_context: int, arena) -> tuple[int, np.ndarray] | None:
        if arena is None:
            return None
        try:
            key, histories = arena.histories(slots, max_context)
        except OSError as error:
            log.warning("token histories stay in this process (sent by value each step): %s",
                        error)
            return None
        return key, histories.reshape(-1)

    def _history_ref(self, slots: np.ndarray, prompt_stop: np.ndarray, prompt_length: np.ndarray,
                     output_stop: np.ndarray) -> HistoryRef:
        """The rows' lists as ranges of the shared histories (HISTORY_REF_COLUMNS)."""
        key, flat = self.shared
        first = slots.astype(np.int64) * self.max_context
        seen = first + self.tokens.size  # prompt_seen follows tokens
        refs = np.empty((len(slots), len(HISTORY_REF_COLUMNS)), np.int64)
        refs[:, 0] = key
        refs[:, 1], refs[:, 2] = seen, seen + prompt_stop
        refs[:, 3], refs[:, 4] = first + prompt_length, first + output_stop
        return HistoryRef(refs, flat)

    def _raw_rows(self, slots: np.ndarray) -> np.ndarray | None:
        """The rows whose logprobs are raw: those that ask for any, with
        ``raw_logprobs`` (None where none: the samplers' usual path)."""
        if not self.raw_logprobs:
            return None
        asking = self.want_logprobs[slots] | (self.num_top_logprobs[slots] > 0)
        return asking if asking.any() else None

    def _gather(self, slots: np.ndarray, start: np.ndarray, stop: np.ndarray,
                source: np.ndarray | None = None):
        """CSR (offsets int64 [n + 1], ids int32) of ``source[slot, start:stop]``
        per row (source: ``tokens``, or any [slots, max_context] array)."""
        source = self.tokens if source is None else source
        first = slots.astype(np.int64) * self.max_context
        return ranges_csr(source.reshape(-1), first + start, first + stop)

    def _ban_lists(self, slots: np.ndarray, short: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """CSR (offsets, ids) of the step's bans (``batch``): in numpy where
        every row short of min_tokens has at most STOP_COLUMNS stop ids and
        no row has bad words, else ``_bans``' pass over the rows that ban
        something."""
        counts = np.where(short, self.stop_count[slots], 0)
        if counts.max(initial=0) > STOP_COLUMNS or self.has_bad_words[slots].any():
            return _sparse_ragged(len(slots), self._bans(slots, short))
        offsets = np.zeros(len(slots) + 1, np.int64)
        np.cumsum(counts, out=offsets[1:])
        if not offsets[-1]:
            return offsets, NO_IDS
        kept = np.arange(STOP_COLUMNS) < counts[:, None]  # row by row: CSR's order
        return offsets, self.stop_columns[slots][kept]

    def _bans(self, slots: np.ndarray, short: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """(row, banned ids) for the rows that ban something this step."""
        rows = [(row, self.stop_ids[slots[row]]) for row in np.flatnonzero(short).tolist()
                if self.stop_ids[slots[row]].size]
        worded = np.flatnonzero(self.has_bad_words[slots]).tolist()
        if not worded:
            return rows
        banned = dict(rows)
        for row in worded:
            slot = int(slots[row])
            words = self.bad_words[slot]
            history = self.tokens[slot, :self.length[slot]]
            last = [word[-1] for word in words
                    if word.size == 1 or (word.size <= history.size + 1 and np.array_equal(
                        history[history.size - word.size + 1:], word[:-1]))]
            if last:
                banned[row] = np.concatenate([banned.get(row, NO_IDS), np.asarray(last, np.int32)])
        return sorted(banned.items())


def _sparse_ragged(rows: int, lists: list[tuple[int, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """CSR (offsets int64 [rows + 1], ids int32) where only the listed
    (row, ids) pairs, in row order, are non-empty."""
    if not lists:
        return np.zeros(rows + 1, np.int64), NO_IDS
    counts = np.zeros(rows, np.int64)
    for row, ids in lists:
        counts[row] = ids.size
    offsets = np.zeros(rows + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    return offsets, np.concatenate([ids for _, ids in lists]).astype(np.int32, copy=False)
