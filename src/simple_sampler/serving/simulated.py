"""A SIMULATED data plane paced like a GPU: no model runs, every output says so.

:class:`SimulatedEngine` implements the engine protocol of ``engine`` (add,
step, append, release, length) for the regime the decision plane is built
for: a GPU decode step of 10-40 ms with the host's CPU cores idle.

* ``step(seq_ids)`` *sleeps* (releasing the GIL) t(B) = a + b * B ms,
  B = ``len(seq_ids)`` (``LlmSettings.sim_step_a_ms``, ``sim_step_b_ms``),
  and returns logits ``[B, V]`` (float32 or bfloat16) from a bank of
  :func:`simple_sampler.rows.synthetic_hot_rows`; the rows change from step
  to step and differ across a step's sequences.
* The returned tensor is a *view* of the shared bank (no B x V gather, as a
  device-to-host DMA costs no core): callers must not write into it.
* ``simulated_text.SimulatedCodec`` is the model's tokenizer for the ids it
  knows and writes any other id ``i`` as `` t<i>``; used only with this engine.
* Prompt logprobs (``score_prompt``) come from the bank's rows too: they
  say nothing about the prompt's text.
* Everything it produces is labelled "simulated data plane"
  (:attr:`SimulatedEngine.label`).

The step model's sources (a measured, b derived), the bank and why its rows
keep real token ids: docs/SIMULATED.md.
"""
from __future__ import annotations

import dataclasses
import operator
import threading
import time
from dataclasses import dataclass
from typing import Hashable, Sequence

import numpy as np
import torch

from ..handoff import CompactRows, inverse_temperatures
from ..rows import (HOT_ROWS_SOURCE, SYNTHETIC_SOURCE_ROWS, map_hot_ids, real_rows,
                    synthetic_hot_rows)
from .. import _sampling
from ..sampling import kernel_rows, logits_array
from ..settings import SIMULATED_LABEL, LlmSettings
from .engine import SequenceTable
from .hot_first import hot_first_summary
from .prompt_scores import PromptScores, score_prompt_rows

LABEL = SIMULATED_LABEL
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_MAX_BATCH_SIZE = 256
DEFAULT_MAX_CONTEXT = 4096
#: Distinct step offsets into the bank (rows beyond max_batch_size).
BANK_OFFSETS = 64
#: Offset advance per step; odd and coprime with BANK_OFFSETS + 1 = 65, so
#: consecutive steps do not return shifted copies of each other's rows.
OFFSET_STRIDE = 23
#: The hot-first summary's modelled device time: it reads each row
#: SUMMARY_READS times (mask and max, the exp-sum, the cold top-k, and one
#: kept from when the cold draw summed the whole row: it now uses the
#: exp-sum's block masses, so the charge errs high) at the HBM bandwidth of
#: b's source (H100 SXM, 3.35 TB/s); docs/SIMULATED.md.
SUMMARY_READS = 4
HBM_BYTES_PER_S = 3.35e12
SUMMARY_CHUNK = 32
#: Ids per block of the prepared cold weights: a cold draw finds its block
#: in the bank row's block masses, then walks that block alone.
COLD_BLOCK = 256


@dataclass(frozen=True)
class SimulatedSpec:
    """What a simulated engine simulates: V, the logits dtype and t(B) = a + b * B.
    Defaults and allowed values are ``LlmSettings``' ``sim_*`` settings (the
    serve options and llm parameters of the same names)."""

    vocab: int = LlmSettings.sim_vocab
    dtype: str = LlmSettings.sim_dtype
    step_a_ms: float = LlmSettings.sim_step_a_ms
    step_b_ms: float = LlmSettings.sim_step_b_ms

    def __post_init__(self):
        LlmSettings(engine="simulated", sim_vocab=self.vocab, sim_dtype=self.dtype,
                    sim_step_a_ms=self.step_a_ms, sim_step_b_ms=self.step_b_ms).validate()

    @classmethod
    def from_settings(cls, settings: LlmSettings) -> "SimulatedSpec":
        return cls(settings.sim_vocab, settings.sim_dtype, settings.sim_step_a_ms,
                   settings.sim_step_b_ms)

    def step_ms(self, batch: int) -> float:
        """The modelled forward time of a step of ``batch`` rows: a + b * batch."""
        return self.step_a_ms + self.step_b_ms * batch

    def describe(self) -> str:
        """The label every output of a run on this spec carries."""
        return (f"{LABEL}: t(B) = {self.step_a_ms:g} + {self.step_b_ms:g} * B ms slept, "
                f"V={self.vocab:,} {self.dtype}, rows {HOT_ROWS_SOURCE}")


def simulated_profile(profile, vocab: int, seed: int = 0):
    """A SmolLM2 ``HotProfile`` with its order in the ids of the simulated
    rows of `vocab` (``rows.map_hot_ids``, the engine's id map for `seed`):
    the hot set the sampler and the hot-first handoff use on those rows."""
    mapped = map_hot_ids(profile.order, vocab, seed).astype(np.int32)
    return dataclasses.replace(profile, order=mapped, vocab_size=vocab,
                               meta={**profile.meta, "mapped_to_simulated_vocab": vocab})


class SimulatedEngine:
    """The GPU-paced simulated engine (module docstring).

    vocab_size, max_batch_size, max_context: as ``engine.Engine``;
    ``step`` returns ``spec.dtype`` logits ``[len(seq_ids), vocab]``, a view
    of the bank (read-only by contract). ``seed`` picks the bank's id map
    and added-id orders: map a SmolLM2 hot set with
    ``rows.map_hot_ids(ids, spec.vocab, seed)``. Thread safety as TorchEngine: one
    step at a time; add/append/release/length from other threads for
    sequences the running step does not include.
    """

    bridge_s = 0.0  # in process: no bridge
    #: ``engine.ComputesOffHost``: its forward is modelled device time
    off_host = True

    def __init__(self, spec: SimulatedSpec = SimulatedSpec(),
                 max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
                 max_context: int = DEFAULT_MAX_CONTEXT, seed: int = 0):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_context < 2:
            raise ValueError(f"max_context must be >= 2, got {max_context}")
        self.spec = spec
        self.vocab_size = spec.vocab
        self.max_batch_size = max_batch_size
        self.max_context = max_context
        rows = synthetic_hot_rows(real_rows(SYNTHETIC_SOURCE_ROWS), spec.vocab, seed,
                                  n=max_batch_size + BANK_OFFSETS)
        self.bank = torch.from_numpy(rows).to(DTYPES[spec.dtype])
        self.label = spec.describe()
        self.steps = 0
        self.sequences: SequenceTable[_SimulatedSequence] = SequenceTable(
            spec.vocab, max_batch_size, max_context)
        self.state_lock = threading.Lock()
        self.step_lock = threading.Lock()
        #: ``device_s``: the device time queued behind the forward
        #: ``step_then`` is modelling in this thread (None: no such step)
        self.queued = threading.local()

    def share_rows(self, arena) -> None:
        """Move the bank into `arena` (``row_arena.RowArena.share``): the
        rows ``step`` returns then already lie in shared memory, where the
        sampler instances read them, as a GPU host's device-to-host copy
        lands in the arena (a DMA no core performs)."""
        shared = arena.share(logits_array(self.bank))
        self.bank = (torch.from_numpy(shared.view(np.int16)).view(torch.bfloat16)
                     if self.bank.dtype == torch.bfloat16 else torch.from_numpy(shared))

    def prepare_hot_first(self, hot_ids, cold_top: int) -> None:
        """Summarize every bank row once (``handoff.hot_first_summary`` at
        temperature 1, no touched ids), with no cold ids handed over and
        with `cold_top` of them (``hot_first.row_cold_tops`` gives a row one
        or the other): the summaries ``hot_first_summary`` hands out for
        rows that need no adjustment, and the cold draw's block masses over
        the first. Done at load, like the bank itself; costs about twice the
        bank's size in torch time."""
        summaries = {}
        for top in dict.fromkeys((0, cold_top)):
            chunks = []
            for start in range(0, self.bank.shape[0], SUMMARY_CHUNK):  # bounds the temporaries
                rows = self.bank[start:start + SUMMARY_CHUNK]
                chunks.append(hot_first_summary(rows, hot_ids, np.zeros(len(rows) + 1, np.int64),
                                                np.zeros(0, np.int64), np.ones(len(rows)),
                                                top).cpu())
            summaries[top] = _gather_compact([(chunk, row) for chunk in chunks
                                              for row in range(len(chunk.cold_max))])
        self.hot_first = (np.asarray(hot_ids), summaries)
        # Only rows without cold ids draw (row_cold_tops): blocks for those.
        self.cold_blocks = _ColdBlocks(self.bank, np.asarray(hot_ids), summaries[0])

    def hot_first_summary(self, logits: torch.Tensor, hot_ids, touched_offsets, touched_ids,
                          temperature, cold_top, draws=None):
        """``handoff.hot_first_summary`` of `logits` (``CompactRows.cpu()``
        form) as the modelled GPU computes it next to the logits. Bank rows
        at temperature 1 with a prepared cold_top start from the summary
        ``prepare_hot_first`` made: as they are without touched ids, else
        adjusted (``_touch``: the touched ids' raw logits handed over and
        their terms taken out of the cold mass), and those without cold ids
        draw their cold tokens from its block masses (``_ColdBlocks``). Rows
        at another temperature or cold_top, rows with cold ids and a draw,
        rows whose touched ids hold the cold argmax and rows not from the
        bank are summarized here in torch on this CPU. Takes the summary's
        modelled device time (SUMMARY_READS reads of the rows at
        HBM_BYTES_PER_S): sleeps what the computing here did not already
        take, or, called by ``step_then``, adds it to that step's."""
        started = time.perf_counter()
        size = logits.shape[0]
        offsets = np.asarray(touched_offsets, np.int64)
        ids = np.asarray(touched_ids, np.int64)
        tops = np.broadcast_to(np.asarray(cold_top, np.int64), (size,))
        first = self._bank_row(logits)
        prepared = getattr(self, "hot_first", None)
        own = np.ones(size, bool)
        if (prepared is not None and first is not None
                and np.array_equal(prepared[0], np.asarray(hot_ids))):
            summaries = prepared[1]
            own = (inverse_temperatures(temperature) != 1.0) | ~np.isin(tops, list(summaries))
            if draws is not None:  # only the cold-id-free rows have block masses
                own |= np.isfinite(draws) & (tops != 0)
            kept = np.unique(tops[~own])
            if kept.size <= 1:  # one prepared summary (own rows are replaced below)
                out = summaries[int(kept[0]) if kept.size else 0].rows(first, first + size)
            else:
                out = _gather_compact([(summaries[int(tops[r]) if not own[r] else 0], first + r)
                                       for r in range(size)])
            added = (np.zeros(0, np.int64),) * 2 + (np.zeros(0),)
            if ids.size:
                out, added = _touch(out, logits_array(logits), offsets, ids, own)
            if draws is not None:
                out = self.cold_blocks.draw(out, logits, first, np.where(own, np.nan, draws),
                                            *added)
        if own.any():
            rows = np.flatnonzero(own)
            lengths = np.diff(offsets)[rows]
            picked = np.concatenate([ids[offsets[r]:offsets[r + 1]] for r in rows])
            computed = hot_first_summary(logits[torch.as_tensor(rows)], hot_ids,
                                         np.r_[0, np.cumsum(lengths)], picked,
                                         np.asarray(temperature)[rows], tops[rows],
                                         None if draws is None else np.asarray(draws)[rows]).cpu()
            out = computed if own.all() else _gather_compact(
                [(computed, int(np.searchsorted(rows, r))) if own[r] else (out, r)
                 for r in range(size)])
        device_s = SUMMARY_READS * logits.numel() * logits.element_size() / HBM_BYTES_PER_S
        queued = getattr(self.queued, "device_s", None)
        if queued is not None:  # inside step_then: charged behind the forward
            self.queued.device_s = queued + device_s
        else:
            time.sleep(max(0.0, device_s - (time.perf_counter() - started)))
        return out

    def _bank_row(self, logits: torch.Tensor) -> int | None:
        """The bank row `logits` starts at when it is a run of bank rows."""
        row_bytes = self.bank.stride(0) * self.bank.element_size()
        delta = logits.data_ptr() - self.bank.data_ptr()
        if (logits.dtype != self.bank.dtype or logits.stride() != self.bank.stride()
                or delta % row_bytes or not 0 <= delta // row_bytes < self.bank.shape[0]):
            return None
        return delta // row_bytes

    def add(self, seq_id: Hashable, prompt_ids: Sequence[int],
            max_tokens: int | None = None) -> None:
        """As TorchEngine.add (SequenceTable's checks and errors)."""
        with self.state_lock:
            self.sequences.add(seq_id, prompt_ids, lambda prompt: _SimulatedSequence(len(prompt)))

    def step(self, seq_ids: Sequence[Hashable]) -> torch.Tensor:
        """Sleep t(len(seq_ids)), return the rows (module docstring). Errors
        as TorchEngine.step (SequenceTable.for_step)."""
        return self.step_then(seq_ids, None)[0]

    def step_then(self, seq_ids: Sequence[Hashable], then):
        """``engine.StepsThen``: the step's rows and ``then(rows)`` (None
        without `then`), at t(len(seq_ids)) plus the device time `then`
        charged (``hot_first_summary``). The rows are the bank's, known
        before the modelled forward ends, so `then`'s emulation runs on this
        CPU while the forward is modelled (inside its sleep), as the GPU
        would queue it behind the forward: the step takes t(B) plus `then`'s
        device time, or the emulation's own time if that is longer, not
        their sum."""
        deadline = time.perf_counter() + self.spec.step_ms(len(seq_ids)) / 1e3
        with self.step_lock:
            with self.state_lock:
                for state in self.sequences.for_step(seq_ids, _has_pending):
                    state.pending = False
            offset = self.steps * OFFSET_STRIDE % (BANK_OFFSETS + 1)
            self.steps += 1
            rows = self.bank[offset:offset + len(seq_ids)]
            result = None
            if then is not None:
                self.queued.device_s = 0.0
                try:
                    result = then(rows)
                    deadline += self.queued.device_s
                finally:
                    self.queued.device_s = None
            # The "GPU" computes: this thread waits without using a core.
            time.sleep(max(0.0, deadline - time.perf_counter()))
        return rows, result

    def score_prompt(self, prompt_ids: Sequence[int], num_top: int) -> PromptScores:
        """``engine.ScoresPrompts``, simulated: position i's distribution is
        the bank's row i (modulo its rows), whatever the tokens, as a step's
        rows are; scored on this CPU, with no modelled device time."""
        rows = self.bank.shape[0]
        return score_prompt_rows(
            lambda start, stop: self.bank[torch.arange(start, stop) % rows], prompt_ids, num_top)

    def append(self, seq_ids: Sequence[Hashable], token_ids: Sequence[int]) -> None:
        """As TorchEngine.append (SequenceTable.for_append's errors)."""
        with self.state_lock:
            states, _ = self.sequences.for_append(seq_ids, token_ids, _has_pending, _length)
            for state in states:
                state.length += 1
                state.pending = True

    def release(self, seq_id: Hashable) -> None:
        """Forget the sequence; unknown ids are ignored (a cancel may race a finish)."""
        with self.state_lock:
            self.sequences.release(seq_id)

    def length(self, seq_id: Hashable) -> int:
        with self.state_lock:
            return self.sequences[seq_id].length


def _touch(summary: CompactRows, rows: np.ndarray, offsets: np.ndarray, ids: np.ndarray,
           own: np.ndarray) -> CompactRows:
    """`summary` (rows at temperature 1) with each row's touched ids (CSR
    `offsets`, `ids`) taken out of C: handed over with their raw logits, and
    their terms exp(x - m_C) (the kernels' float32 operations) subtracted
    from the cold mass in float64. That leaves m_C's own term (1) in the
    mass, so the result is within float32 rounding of a direct sum (the
    handoff's margin, docs/HANDOFF.md, is 50 times that). A row whose
    touched ids hold its cold argmax changes m_C: marked in `own` (in place)
    for a summary of its own. Returns the summary and the ids added (row,
    id, their term), which the cold draw takes out of its blocks too."""
    vocab = rows.shape[1]
    size = len(summary.cold_max)
    row_of = np.repeat(np.arange(size), np.diff(offsets))
    own[row_of[ids == summary.cold_argmax[row_of]]] = True
    known = np.repeat(np.arange(size), np.diff(summary.touched_offsets)) * vocab \
        + summary.touched_ids.astype(np.int64)  # ascending: by row, then id
    keys = row_of * vocab + ids
    # Per step: searches in the sorted keys, not a set operation or a sort
    # of the ~cold_top * B ids already handed over.
    at = np.searchsorted(known, keys)
    new = known[np.minimum(at, known.size - 1)] != keys if known.size else np.ones(keys.size, bool)
    x = rows[row_of[new], ids[new]].astype(np.float32)
    zc = summary.cold_max[row_of[new]]
    with np.errstate(invalid="ignore", over="ignore"):
        w = np.where(np.isfinite(zc), np.exp(x - zc), np.float32(0)).astype(np.float64)
    mass = summary.cold_mass.astype(np.float64) - np.bincount(row_of[new], w, minlength=size)
    added = np.zeros(size + 1, np.int64)
    np.cumsum(np.bincount(row_of[new], minlength=size), out=added[1:])
    # keys are ascending too: each goes in before the first known key above it
    return CompactRows(
        hot_logits=summary.hot_logits, touched_offsets=summary.touched_offsets + added,
        touched_ids=np.insert(summary.touched_ids, at[new], ids[new].astype(np.int32)),
        touched_logits=np.insert(summary.touched_logits, at[new], x),
        cold_max=summary.cold_max, cold_argmax=summary.cold_argmax,
        cold_mass=np.maximum(mass, 0.0).astype(np.float32)), (row_of[new], ids[new], w)


class _ColdBlocks:
    """The cold draw (``hot_first_summary``'s draws) for the bank's
    prepared rows (temperature 1), without a pass over the row per step:
    each bank row's cold weights exp(x - m_C) (float32; 0 for the ids its
    summary handed over, a bitmap) summed per block of COLD_BLOCK ids in
    float64 at load (``_sampling.cold_block_masses``). A draw walks the
    block masses, less the terms of the ids the request's touched lists
    add, to the block where u * W falls, then that block's weights
    (``_sampling.walk_cold_blocks``): the id ``_cold_tokens`` picks from the
    whole row, up to the rounding of the sums' order and of the exps."""

    def __init__(self, bank, hot_ids: np.ndarray, summary: CompactRows):
        rows, self.dtype = kernel_rows(bank)
        size, vocab = bank.shape
        self.known = np.zeros((size, -(-vocab // 8)), np.uint8)
        offsets = summary.touched_offsets
        for start in range(0, size, SUMMARY_CHUNK):  # bounds the temporaries
            end = min(size, start + SUMMARY_CHUNK)
            known = np.zeros((end - start, vocab), bool)
            known[:, hot_ids] = True
            known[np.repeat(np.arange(end - start), np.diff(offsets[start:end + 1])),
                  summary.touched_ids[offsets[start]:offsets[end]]] = True
            self.known[start:end] = np.packbits(known, axis=1, bitorder="little")
        self.mass = np.empty((size, -(-vocab // COLD_BLOCK)))
        _sampling.cold_block_masses(rows, self.dtype, self.known,
                                    np.ascontiguousarray(summary.cold_max, np.float32),
                                    COLD_BLOCK, self.mass)

    def draw(self, summary: CompactRows, logits, first: int, draws, added_rows, added_ids,
             added_weights) -> CompactRows:
        """`summary` of `logits` (bank rows first.., adjusted by ``_touch``,
        which added `added_*`, by row) with a cold token for each row with a
        finite draw and a cold mass (-1 elsewhere, and where the sums'
        rounding leaves the walk on no weight: that row takes the second
        round)."""
        size = len(summary.cold_max)
        token = np.full(size, -1, np.int32)
        token_logit = np.zeros(size, np.float32)
        offsets = np.zeros(size + 1, np.int64)
        np.cumsum(np.bincount(added_rows, minlength=size), out=offsets[1:])
        _sampling.walk_cold_blocks(
            kernel_rows(logits)[0], self.dtype, self.known, self.mass,
            np.arange(first, first + size, dtype=np.int64),
            np.ascontiguousarray(summary.cold_max, np.float32),
            np.ascontiguousarray(draws, np.float64), offsets,
            np.ascontiguousarray(added_ids, np.int64),
            np.ascontiguousarray(added_weights, np.float64), COLD_BLOCK, token, token_logit)
        return dataclasses.replace(summary, cold_token=token, cold_token_logit=token_logit)


#: CompactRows' optional per-row arrays (the data plane's cold draw)
_DRAWN = ("cold_token", "cold_token_logit")


def _gather_compact(source):
    """CompactRows (cpu form) whose row r is row source[r][1] of source[r][0]
    (cold tokens when every source has them)."""
    hot, lists, logits, cold = [], [], [], {"cold_max": [], "cold_argmax": [], "cold_mass": []}
    if all(summary.cold_token is not None for summary, _ in source):
        cold.update({name: [] for name in _DRAWN})
    for summary, row in source:
        a, b = summary.touched_offsets[row], summary.touched_offsets[row + 1]
        hot.append(summary.hot_logits[row])
        lists.append(summary.touched_ids[a:b])
        logits.append(summary.touched_logits[a:b])
        for name, values in cold.items():
            values.append(getattr(summary, name)[row])
    offsets = np.zeros(len(source) + 1, np.int64)
    np.cumsum([ids.size for ids in lists], out=offsets[1:])
    return CompactRows(
        hot_logits=np.stack(hot), touched_offsets=offsets,
        touched_ids=np.concatenate(lists).astype(np.int32),
        touched_logits=np.concatenate(logits).astype(np.float32),
        cold_max=np.asarray(cold["cold_max"], np.float32),
        cold_argmax=np.asarray(cold["cold_argmax"], np.int32),
        cold_mass=np.asarray(cold["cold_mass"], np.float32),
        **{name: np.asarray(cold[name], dtype) for name, dtype in zip(_DRAWN, (np.int32, np.float32))
           if name in cold})


@dataclass
class _SimulatedSequence:
    length: int  # tokens held, the pending one included
    pending: bool = True  # the last token has not been stepped yet


# Read for every row of every step: attrgetters, not Python functions, so
# that the check costs no Python call per row.
_has_pending = operator.attrgetter("pending")
_length = operator.attrgetter("length")
