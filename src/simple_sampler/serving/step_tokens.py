"""What one step's tokens become (``StepTokens``, the decode loop's pass
after each step): events, final events, tokens handed to ``on_step``, and
the tokens a stepped request holds until then, found with per-slot columns
read for every row of the step in numpy.

A request listened to with a sink (``RequestHandle.listen``) has its tokens
that do not end it handed to ``Decoder.on_step`` `interval` at a time, and
the rest with its final event. Until then they are only in its history (the
decoder's ``BatchState``), and a *quiet* request's are not even detokenized:
its held ids go through its detokenizer when they are handed out. So a
quiet row whose token neither ends its request nor is due costs the step no
Python. Quiet: stepped, no stop strings or words (matched token by
token), no logprobs (events carry them), at most STOP_COLUMNS stop ids
(compared in numpy).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from .batch_state import STOP_COLUMNS
from .generation import (FINISH_CANCELLED, FINISH_LENGTH, FINISH_STOP, DecodeSequence,
                         RequestHandle)
from .samplers import TopLogprobs

#: due_at of a request that is never due (interval 0): no request generates that many tokens
NEVER = np.iinfo(np.int64).max


def _top_of(sequence: DecodeSequence, top: TopLogprobs, row: int
            ) -> list[tuple[int, float]] | None:
    """`row`'s own top logprobs, (token id, logprob) most likely first, for
    a request that asked (None for one that did not): its first n columns,
    fewer where the vocabulary is smaller (padding -1)."""
    wanted = sequence.request.num_top_logprobs
    if not wanted:
        return None
    ids, logprobs = top[0][row, :wanted].tolist(), top[1][row, :wanted].tolist()
    return [(token, logprob) for token, logprob in zip(ids, logprobs) if token >= 0]


class StepTokens:
    """A decoder's step pass (module docstring). Per batch-state slot:
    `quiet`, `stepped`, `end_ids` (its stop ids, -1 padded),
    `max_tokens`, `interval` and `due_at` (the generated count at which the
    request's next tokens are handed out); and each stepped sequence's held
    tokens. `decoder`: the ``Decoder`` whose state, engine, events and
    ``on_step`` it serves (unannotated: decoder.py imports this module)."""

    def __init__(self, decoder):
        self.decoder, self.state = decoder, decoder.state
        slots = len(self.state.length)
        self.quiet = np.zeros(slots, bool)
        self.stepped = np.zeros(slots, bool)
        self.end_ids = np.full((slots, STOP_COLUMNS), -1, np.int64)
        self.max_tokens = np.zeros(slots, np.int64)
        self.due_at = np.zeros(slots, np.int64)
        self.interval = np.zeros(slots, np.int64)
        #: the generated count handed out so far (``DecodeSequence.delivered``, as a column)
        self.handed = np.zeros(slots, np.int64)
        #: whether the slot's request has stop strings or words (found token by token)
        self.stop_words = np.zeros(slots, bool)
        #: whether it has more stop ids than `end_ids` holds (found by a set lookup)
        self.more_stop_ids = np.zeros(slots, bool)

    def listen(self, sequence: DecodeSequence, interval: int) -> None:
        """``RequestHandle.listen`` with a sink: `sequence`'s tokens that do
        not end it go to ``on_step``, the first at once and then `interval`
        at a time (0: none, all of them with the final event): the first
        token is never held, as vLLM's, SGLang's and TensorRT-LLM's streams
        send it (vllm/v1/engine/output_processor.py, ``make_request_output``)."""
        sequence.stepped, sequence.interval = True, interval
        if sequence.slot >= 0 and not sequence.done:  # admitted: else at admission
            self.admit(sequence)

    def admit(self, sequence: DecodeSequence) -> None:
        """`sequence`'s row of the columns (at admission, or at listen once admitted)."""
        slot = sequence.slot
        self.stepped[slot] = sequence.stepped
        stop_ids = sorted(sequence.stop_ids)
        self.quiet[slot] = (sequence.stepped and not sequence.stop.active
                            and not sequence.request.return_log_probs
                            and len(stop_ids) <= STOP_COLUMNS)
        self.end_ids[slot] = -1
        self.end_ids[slot, :len(stop_ids[:STOP_COLUMNS])] = stop_ids[:STOP_COLUMNS]
        self.stop_words[slot] = sequence.stop.active
        self.more_stop_ids[slot] = len(stop_ids) > STOP_COLUMNS
        self.max_tokens[slot] = sequence.max_tokens
        self.interval[slot] = sequence.interval
        self.handed[slot] = sequence.delivered
        self.due_at[slot] = (sequence.delivered + (sequence.interval if sequence.delivered else 1)
                             if sequence.interval else NEVER)

    def release(self, slot: int) -> None:
        self.quiet[slot] = self.stepped[slot] = False

    def deliver(self, sequences: list[DecodeSequence], ids: list[int], tokens: np.ndarray,
                logprobs: np.ndarray,
                then: Callable[[set[int]], None] | None = None,
                top: TopLogprobs | None = None) -> None:
        """Turn one step's tokens into deliveries; feed the survivors back
        (`ids`: the rows' request ids; `top`: the rows' top logprobs, where
        a row asked for them).

        What every row needs is found in numpy first (the columns): a quiet
        row whose token neither ends its request nor is due to ``on_step``
        costs no Python at all, its token only appended to its history
        (module docstring). The other rows take one pass: a row whose
        token ends its request (an end or stop id, a stop string,
        max_tokens) makes the request's final event, with the tokens it
        held; a row of a stepped request with stop strings (or logprobs)
        pushes its token through the detokenizer and holds its text; a row
        of any other request makes an event. Then the rows due to
        ``on_step`` go to it at once: each its text (the held ids pushed
        through its detokenizer now) and its ids since its last. The rows
        that go on are appended to the batch state and the engine by index
        arrays, not one by one.

        `then` (the decoder's next step, launched early): when no row's
        request has stop strings, which rows go on is known before the
        per-row pass (:meth:`_going_on`), so they are fed back first and
        `then` is called with the request ids of the rows that end here (no
        longer stepped) before the per-row pass and ``on_step``: their Python runs
        while the next forward does."""
        rows = len(sequences)
        slots = np.array([s.slot for s in sequences], np.int64)
        generated = self.state.length[slots] - self.state.prompt_length[slots] + 1
        ending = ((tokens[:, None] == self.end_ids[slots]).any(axis=1)
                  | (generated >= self.max_tokens[slots]))
        interrupted = self.decoder.interrupted
        if interrupted:
            ending |= np.fromiter((s.request_id in interrupted for s in sequences), bool, rows)
        each = ending | ~self.quiet[slots]
        python_rows = np.flatnonzero(each).tolist()
        early = then is not None and not self.stop_words[slots[each]].any()
        if early:
            going_on = self._going_on(sequences, tokens, slots, ending)
            kept = self._feed_back(slots, ids, tokens, going_on)
            then({ids[row] for row in np.flatnonzero(~going_on).tolist()})
        else:
            going_on = np.ones(rows, bool)
        # launched early, going_on holds what _going_on found already
        if top is None:  # no row asked (the usual step): nothing more per row
            if self.state.num_top_logprobs[slots].any():  # Decoder.submit refuses such requests
                raise RuntimeError("the sampler answered no top logprobs for rows that asked")
            for row in python_rows:
                going_on[row] &= self._deliver_row(sequences[row], int(tokens[row]),
                                                   float(logprobs[row]), int(generated[row]))
        else:
            for row in python_rows:
                going_on[row] &= self._deliver_row(sequences[row], int(tokens[row]),
                                                   float(logprobs[row]), int(generated[row]),
                                                   _top_of(sequences[row], top, row))
        if not early:
            kept = self._feed_back(slots, ids, tokens, going_on)
        if self.decoder.on_step is not None:
            due = kept[self.stepped[slots[kept]]
                       & (generated[kept] >= self.due_at[slots[kept]])]
            if due.size:
                self.decoder.on_step(*self.hand_over([sequences[r] for r in due.tolist()],
                                                     slots[due], generated[due]))

    def _feed_back(self, slots: np.ndarray, ids: list[int], tokens: np.ndarray,
                   going_on: np.ndarray) -> np.ndarray:
        """Append the tokens of the rows that go on to the batch state and
        the engine; their row indices."""
        kept = np.flatnonzero(going_on)
        if kept.size == len(ids):
            self.state.append(slots, tokens.astype(np.int32))
            self.decoder.engine.append(ids, tokens.tolist())
        elif kept.size:
            self.state.append(slots[kept], tokens[kept].astype(np.int32))
            self.decoder.engine.append([ids[r] for r in kept.tolist()], tokens[kept].tolist())
        return kept

    def _going_on(self, sequences: list[DecodeSequence], tokens: np.ndarray,
                  slots: np.ndarray, ending: np.ndarray) -> np.ndarray:
        """Which rows of requests without stop strings go on: what
        :meth:`_deliver_row` will answer for each, known before it runs.
        `ending`: the rows ended by their end id or length, or interrupted
        (a cancelled or finished request is in ``Decoder.interrupted``); a
        request with more stop ids looks its token up."""
        going_on = ~ending
        for row in np.flatnonzero(going_on & self.more_stop_ids[slots]).tolist():
            going_on[row] = int(tokens[row]) not in sequences[row].stop_ids
        return going_on

    def _deliver_row(self, sequence: DecodeSequence, token: int, logprob: float,
                     generated: int, top_row: list | None = None) -> bool:
        """``deliver``'s pass for one row that needs Python; whether it goes on."""
        if sequence.done:
            return False
        if sequence.cancelled:
            self.decoder.finish(sequence, FINISH_CANCELLED)
            return False
        sequence.cum_log_prob += logprob
        ended = token in sequence.stop_ids  # the end id, unless ignore_end
        text, stopped = "", False
        if sequence.stepped:  # a quiet row's held ids come before this token
            self.catch_up(sequence, generated - 1)
        if not ended or sequence.request.include_stop:  # a stop id's text: only if asked
            text = sequence.detokenizer.push_token(token)
            if sequence.stop.stop_words:  # without any, feed() returns the text as it is
                text, stopped = sequence.stop.feed(text, generated > sequence.params.min_tokens)
        word = None if ended or stopped or not sequence.stop.sequences else \
            sequence.stop.feed_token(token)
        if ended or stopped or word is not None or generated >= sequence.max_tokens:
            sequence.generated = generated
            self._last(sequence, token, logprob, text, ended or stopped or word is not None,
                       stopped, top_row, word)
            return False
        if sequence.stepped:
            sequence.held_text += text
            sequence.pushed += 1
        else:
            sequence.generated = sequence.delivered = sequence.pushed = generated
            sequence.handle.put(sequence.event(text, [token], [logprob],
                                               top_logprobs=None if top_row is None
                                               else [top_row]))
        return True

    def _last(self, sequence: DecodeSequence, token: int, logprob: float, text: str,
              stop: bool, stopped: bool, top_row: list | None = None,
              word: str | None = None) -> None:
        """The final event of a sequence whose `token` ended it: `stop` (an
        end or stop id, a stop string: `stopped`, or the tokens of a stop
        `word`, kept) or its length. The held-back text is released unless a
        stop string cut it."""
        if not stopped:
            tail, stopped = sequence.stop.feed(sequence.detokenizer.flush(),
                                               sequence.generated > sequence.params.min_tokens)
            text += tail + sequence.stop.flush()
        if stopped or word is not None:
            sequence.stop_reason = word or sequence.stop.matched
        elif stop:
            # vLLM's check_stop: the end of sequence (the tokenizer's, or the
            # request's end_id) is no reason unless ignored; any other stop id
            # is, generation_config's other end ids too (vLLM's
            # update_from_generation_config makes them stop ids)
            request = sequence.request
            eos = (self.decoder.codec.tokenizer.eos_token_id if request.end_id is None
                   else request.end_id)
            sequence.stop_reason = None if token == eos and not request.ignore_end else token
        self.decoder.finish(sequence, FINISH_STOP if stop or stopped else FINISH_LENGTH,
                            text=text, token_ids=[token], logprobs=[logprob],
                            top_logprobs=None if top_row is None else [top_row])

    def catch_up(self, sequence: DecodeSequence, upto: int | None = None) -> None:
        """Push a stepped sequence's tokens in its history that the
        detokenizer has not had yet, of its first `upto` generated (default
        all: a step's token fed back early is in the history before its row's
        pass); their text joins `held_text`."""
        state, slot = self.state, sequence.slot
        start = int(state.prompt_length[slot])
        length = int(state.length[slot]) if upto is None else start + upto
        if start + sequence.pushed < length:
            sequence.held_text += sequence.detokenizer.push(
                state.tokens[slot, start + sequence.pushed:length].tolist())
            sequence.pushed = length - start

    def take(self, sequence: DecodeSequence) -> tuple[str, list[int]]:
        """The text and ids of a stepped sequence's tokens not handed out yet
        (tokens that went on: in its history), now counted as handed out."""
        if not sequence.stepped or sequence.slot < 0 or sequence.done:
            return "", []
        self.catch_up(sequence)
        state, slot = self.state, sequence.slot
        start, length = int(state.prompt_length[slot]), int(state.length[slot])
        text, ids = sequence.held_text, state.tokens[slot, start + sequence.delivered:length].tolist()
        sequence.held_text, sequence.delivered = "", length - start
        # a final token (not in the history) is counted already
        sequence.generated = max(sequence.generated, sequence.delivered)
        return text, ids

    def hand_over(self, sequences: list[DecodeSequence], slots: np.ndarray,
                  generated: np.ndarray
                  ) -> tuple[list[RequestHandle], list[str], list[np.ndarray]]:
        """``on_step``'s arguments for the rows due: each sequence's tokens
        since it last handed any out (its first alone, then `interval`; all
        in its history now), their text and ids (int32 [1, n], ready for
        Triton). A quiet
        row's ids are pushed through its detokenizer now (one id alone:
        ``push_token``, as at stream_interval 1); any other row's text is
        held already."""
        state = self.state
        counts = generated - self.handed[slots]
        ends = state.length[slots]
        self.handed[slots] = generated
        self.due_at[slots] = generated + self.interval[slots]
        if np.all(counts == counts[0]):  # every row holds as many: one gather
            block = state.tokens[slots[:, None], ends[:, None] - counts[0] + np.arange(counts[0])]
            ids, id_lists = list(block[:, None, :]), block.tolist()
        else:
            ids = [state.tokens[slot, end - count:end][None].copy()
                   for slot, end, count in zip(slots.tolist(), ends.tolist(), counts.tolist())]
            id_lists = [row[0].tolist() for row in ids]
        single = bool(counts.max() == 1)  # stream_interval 1: one id each
        texts = [""] * len(sequences)
        for row, (sequence, held, quiet, count) in enumerate(zip(
                sequences, id_lists, self.quiet[slots].tolist(), generated.tolist())):
            if quiet:
                texts[row] = (sequence.detokenizer.push_token(held[0]) if single
                              else sequence.detokenizer.push(held))
                sequence.pushed = count
            else:
                texts[row], sequence.held_text = sequence.held_text, ""
            sequence.generated = sequence.delivered = count
        return [s.handle for s in sequences], texts, ids
