"""The sampler side of the row arena (``row_arena``): regions mapped
read-only by the key a request names (``logits_ref``, ``history_ref``),
every name, range and generation checked before a row is read."""
from __future__ import annotations

import mmap
import os
import stat
from collections import OrderedDict

import numpy as np

from .row_arena import (CODE_DTYPES, HEADER_BYTES, HEADER_WORDS, HISTORY_MAGIC, MAGIC, REF_COLUMNS, SHM_DIR,
                        StaleRows, region_name)

#: What each column of a request's next row adds, in strides: the offset alone.
_OFFSET_STEP = np.array([column == "offset" for column in REF_COLUMNS], np.int64)


class RowReader:
    """The sampler side: maps regions read-only by key, keeps the last
    `max_regions` mapped and none unlinked since (an llm model reloaded)."""

    def __init__(self, max_regions: int = 16):
        self.max_regions = max_regions
        self.maps: OrderedDict[int, tuple[mmap.mmap, np.ndarray]] = OrderedDict()

    def _region(self, key: int, named_by: str = "logits_ref", magic=MAGIC):
        """(mapping, header) of region `key` of `magic`'s kind, or ValueError."""
        found = self.maps.get(key)
        if found is None:
            found = self._map(key, named_by)
        else:
            self.maps.move_to_end(key)
        if found[1][0] != magic:
            kind = "token histories" if magic == HISTORY_MAGIC else "logits rows"
            raise ValueError(f"{named_by} names region {region_name(key)}, which holds no {kind}")
        return found

    def _map(self, key: int, named_by: str):
        path = os.path.join(SHM_DIR, region_name(key))
        try:  # never blocks on a FIFO nor follows a link: /dev/shm is anyone's
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise ValueError(f"{named_by} names region {region_name(key)}, which does not "
                             f"exist (its llm model unloaded?)") from None
        except OSError as error:
            raise ValueError(f"{named_by} names {path}, which is not a region: {error}") from None
        try:
            found = os.fstat(fd)
            if not stat.S_ISREG(found.st_mode) or found.st_uid != os.getuid():
                raise ValueError("not a file of this user's")
            mapped = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
            header = np.ndarray(HEADER_BYTES // 8, np.uint64, mapped)
        except (OSError, ValueError, TypeError) as error:  # empty, or shorter than a header
            raise ValueError(f"{named_by} names {path}, which is not a region: {error}") from None
        finally:
            os.close(fd)
        if header[0] not in (MAGIC, HISTORY_MAGIC):
            raise ValueError(f"{named_by} names {path}, which is not a region")
        # regions unlinked since (a reloaded llm model's) stay charged while mapped
        for gone in [k for k in self.maps if not os.path.exists(os.path.join(
                SHM_DIR, region_name(k)))]:
            del self.maps[gone]
        self.maps[key] = (mapped, header)
        while len(self.maps) > self.max_regions:
            self.maps.popitem(last=False)  # the arrays over it keep it mapped while alive
        return mapped, header

    def rows(self, refs: np.ndarray) -> np.ndarray:
        """The rows `refs` ([B, 6], REF_COLUMNS) name: a read-only [B, V]
        view of the region. Raises ValueError for references that are
        malformed or name no region, StaleRows for a slot given back."""
        refs = np.asarray(refs)
        if refs.ndim != 2 or refs.shape[1] != len(REF_COLUMNS) or refs.shape[0] < 1:
            raise ValueError(f"logits_ref must have shape [B, {len(REF_COLUMNS)}] "
                             f"({', '.join(REF_COLUMNS)}), got {list(refs.shape)}")
        key, slot, generation, offset, vocab, code = refs[0].tolist()
        if code not in CODE_DTYPES or vocab < 1:
            raise ValueError(f"logits_ref: dtype code must be one of {sorted(CODE_DTYPES)} and "
                             f"V >= 1, got {code}, {vocab}")
        dtype = CODE_DTYPES[code]
        stride = int(refs[1, 3] - offset) if len(refs) > 1 else vocab * dtype.itemsize
        # every row as the first, its offset a stride further: one comparison
        expected = refs[0] + _OFFSET_STEP * stride * np.arange(len(refs))[:, None]
        if not (refs == expected).all():
            raise ValueError("logits_ref rows must name one region, slot, generation, V and "
                             "dtype, at evenly spaced offsets")
        if stride < vocab * dtype.itemsize or offset < 0:
            raise ValueError("logits_ref offsets must be evenly spaced rows that do not overlap")
        mapped, header = self._region(key)
        slots, slot_bytes = int(header[1]), int(header[2])
        end = offset + stride * (len(refs) - 1) + vocab * dtype.itemsize
        if HEADER_BYTES + end > len(mapped) or (
                slot >= 0 and (slot >= slots or not slot * slot_bytes <= offset
                               or end > (slot + 1) * slot_bytes)):
            raise ValueError(f"logits_ref: rows [{offset}, {end}) lie outside their slot or region")
        _check_generation(header, key, slot, generation)
        return np.ndarray((len(refs), vocab), dtype, mapped, HEADER_BYTES + offset,
                          (stride, dtype.itemsize))

    def histories(self, key: int) -> tuple[np.ndarray, int, int]:
        """(its int32 data, flat and read-only; slots; max_context) of the
        histories region `key` (``RowArena.histories``, ``history_ref``)."""
        mapped, header = self._region(key, "history_ref", HISTORY_MAGIC)
        slots, max_context = int(header[1]), int(header[2])
        if min(slots, max_context) < 1 or len(mapped) < HEADER_BYTES + 8 * slots * max_context:
            raise ValueError(f"history_ref names {region_name(key)}, not the histories it says")
        return np.ndarray(2 * slots * max_context, np.int32, mapped, HEADER_BYTES), slots, max_context

    def check(self, refs: np.ndarray) -> None:
        """StaleRows unless the slot `refs` name still holds their generation."""
        key, slot, generation = refs[0, :3].tolist()
        if slot >= 0:
            _check_generation(self._region(key)[1], key, slot, generation)


def _check_generation(header: np.ndarray, key: int, slot: int, generation: int) -> None:
    """StaleRows unless `slot` (>= 0; shared rows have none) still holds `generation`."""
    if slot >= 0 and int(header[HEADER_WORDS + slot]) != generation:
        raise StaleRows(f"slot {slot} of {region_name(key)} was given back before its rows "
                        f"were sampled (generation {generation}, now "
                        f"{int(header[HEADER_WORDS + slot])})")
