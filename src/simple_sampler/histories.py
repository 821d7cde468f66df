"""Token histories named by reference: each row's prompt and output ids as
ranges of one flat int32 array, instead of lists copied for every step.

The decode loop keeps every sequence's history in one ``[slots,
max_context]`` array (``serving.batch_state.BatchState``). Where that array
lies in a shared-memory region the local sampler instances map
(``row_arena.RowArena.histories``), a step names each penalized row's ids by
``history_ref`` INT64 [B, 5] (``HISTORY_REF_COLUMNS``: the region's key and
two half-open ranges, in int32 elements from the start of the region's
data) and the sampler gathers them from there (``row_reader.RowReader.
histories``, ``checked_lists``): B x history ids a step are no longer
gathered and padded on the llm's thread, copied through BLS and unpadded
by the sampler. A row with no penalty on has empty ranges.

The ranges hold still for the step: a sequence's ids before its length are
written once, when admitted or appended, and its slot is freed and reused
only once no step in flight holds its row (a local instance's call is never
abandoned: ``SamplerTarget.late_after``). Remote endpoints get the lists
(``SamplerPool``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import _sampling

#: history_ref's columns: region key, then [start, stop) of the row's prompt
#: ids and of its output ids, in int32 elements of the region's data.
HISTORY_REF_COLUMNS = ("region", "prompt_start", "prompt_stop", "output_start", "output_stop")
#: ``ranges_csr``'s bound on ids: any int32 >= 0 (the lists are this process's own)
ANY_ID = 2**31
NO_IDS = np.zeros(0, np.int32)
NO_IDS.flags.writeable = False  # shared by every empty list handed out


def ranges_index(starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(CSR offsets int64 [n + 1], the index of every element) of the ranges
    [starts[r], starts[r] + counts[r]) laid end to end (int64 [n] each)."""
    offsets = np.zeros(len(starts) + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    # index of the i-th element overall = its row's start + (i - its row's offset)
    return offsets, np.arange(offsets[-1]) + np.repeat(starts - offsets[:-1], counts)


def ranges_csr(flat: np.ndarray, starts: np.ndarray, stops: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
    """CSR (offsets int64 [n + 1], ids int32) of ``flat[starts[r]:stops[r]]``
    per row r (flat: int32, contiguous; starts, stops: int [n] each, stops
    >= starts, both within `flat`; ValueError otherwise)."""
    starts, stops = np.asarray(starts, np.int64), np.asarray(stops, np.int64)
    offsets, ids, bad_row, _ = _sampling.range_lists(flat, starts, stops, 0, max(len(flat), 1),
                                                     int(len(flat) > 0), ANY_ID)
    if bad_row >= 0:
        raise ValueError(f"row {bad_row}'s range [{starts[bad_row]}, {stops[bad_row]}) is not "
                         f"within the {len(flat)} ids")
    return offsets, ids


@dataclass
class HistoryRef:
    """B rows' prompt and output ids as ranges of `ids` (``refs``: INT64
    [B, 5], ``HISTORY_REF_COLUMNS``, what a request carries; `ids`: the
    flat int32 array the ranges index, this process's view of the region)."""

    refs: np.ndarray
    ids: np.ndarray

    def take(self, rows) -> "HistoryRef":
        return HistoryRef(self.refs[np.asarray(rows, np.int64)], self.ids)

    def lists(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(prompt offsets, prompt ids, output offsets, output ids), CSR."""
        return (*ranges_csr(self.ids, self.refs[:, 1], self.refs[:, 2]),
                *ranges_csr(self.ids, self.refs[:, 3], self.refs[:, 4]))


def checked_lists(refs, histories_of, vocab: int, rows: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The lists a request's ``history_ref`` names, gathered from the region
    (one copy, on the sampler's side): (prompt offsets, prompt ids, output
    offsets, output ids). `histories_of`: region key -> (its int32 data
    [2, slots, max_context] flat, slots, max_context), refusing a region
    that holds no histories (``row_reader.RowReader.histories``). Each range
    must lie within one row of its half (output ids in ``tokens``, prompt
    ids in ``prompt_seen``), so a request names at most what the lists
    would carry. Raises ValueError, naming history_ref, for a malformed
    reference, a range elsewhere, or an id outside [0, vocab)."""
    refs = np.asarray(refs)
    if refs.dtype != np.int64 or refs.shape != (rows, len(HISTORY_REF_COLUMNS)):
        raise ValueError(f"history_ref must be INT64 [{rows}, {len(HISTORY_REF_COLUMNS)}] "
                         f"({', '.join(HISTORY_REF_COLUMNS)}), got {refs.dtype} {list(refs.shape)}")
    key = int(refs[0, 0])
    if (refs[:, 0] != key).any():
        raise ValueError("history_ref rows must name one region")
    ids, slots, context = histories_of(key)
    half = slots * context
    lists = []
    for name, column, first in (("prompt", 1, half), ("output", 3, 0)):
        offsets, listed, bad_row, bad_id = _sampling.range_lists(
            ids, refs[:, column], refs[:, column + 1], first, context, slots, vocab)
        if bad_row >= 0:
            raise ValueError(f"history_ref's {name} ranges must each lie within one row of "
                             f"[{first}, {first + half}), rows of {context} ids (the region's "
                             f"{'prompt_seen' if name == 'prompt' else 'tokens'}); row "
                             f"{bad_row}'s is [{refs[bad_row, column]}, {refs[bad_row, column + 1]})")
        if bad_id >= 0:
            raise ValueError(f"history_ref: the {name} ids it names must be token ids in "
                             f"[0, {vocab}), got {int(listed[bad_id])}")
        lists += [offsets, listed]
    return tuple(lists)
