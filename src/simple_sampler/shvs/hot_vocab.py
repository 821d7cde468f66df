"""Hot vocabularies for speculative hot-vocab sampling (SHVS).

A *profile* (``HotProfile``, built by ``simple-sampler calibrate``) orders a
model's vocabulary hot-first by the probability mass the model put on each
token over a calibration prompt set, and records the sizing model per
configuration: kernel cost per row against |H| (c * |H| + c0), acceptance
alpha(|H|) measured on held-out rows, the fallback cost, and the |H| that
maximizes expected rows/s.
It is saved as one small ``.npz`` file that lives in the model repository
next to the sampler's config. A model without a profile simply runs with
SHVS off (``hot_vocab=None``).

A ``HotVocab`` is the hot set handed to ``sample``: token ids plus the
vocabulary size, with the per-block index the kernels read.

Run-time drift: ``HotVocabMonitor`` tracks observed acceptance against the
profile's prediction and recommends a new |H| when it drifts. It never
resizes the hot set by itself: a seeded row's token is a function of the hot
set (among its other inputs), so a hot set that followed each instance's
traffic would let the token depend on which instance served the row. The
recommendation is logged (the simple_sampler backend feeds one monitor per
instance and logs its :meth:`HotVocabMonitor.drift_warning`) and applied by
reconfiguring every instance to the same size at once.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..params import any_on, is_greedy

#: Columns per kernel block (SS_BLOCK in scalar_math.h).
BLOCK = 64
#: The profile file format, checked on load.
PROFILE_FORMAT = "simple-sampler-hot-profile-1"


@dataclass(frozen=True)
class HotVocab:
    """A hot set: ``ids`` int [n] distinct token ids in [0, vocab_size)
    (any order), for rows of ``vocab_size`` columns. Raises ValueError naming
    the field for out-of-range or repeated ids."""

    ids: np.ndarray
    vocab_size: int
    _kernel: tuple = field(init=False, repr=False, compare=False)

    #: What sample() hands the kernel when SHVS is off.
    EMPTY_KERNEL_ARRAYS = (np.empty(0, np.int32), np.zeros(1, np.int64), np.zeros(1, np.uint64))

    def __post_init__(self):
        if self.vocab_size < 1:
            raise ValueError(f"hot_vocab.vocab_size must be >= 1, got {self.vocab_size}")
        ids = np.asarray(self.ids)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"hot_vocab.ids must be a 1-D array of integer token ids, "
                             f"got dtype {ids.dtype} and shape {list(ids.shape)}")
        bad = (ids < 0) | (ids >= self.vocab_size)
        if bad.any():
            raise ValueError(f"hot_vocab.ids must be token ids in [0, {self.vocab_size}), "
                             f"got {int(ids[np.argmax(bad)])}")
        ordered = np.sort(ids.astype(np.int32))
        repeated = ordered[1:] == ordered[:-1]
        if repeated.any():
            raise ValueError(f"hot_vocab.ids must be distinct, got {int(ordered[1:][repeated][0])} "
                             f"more than once")
        n_blocks = -(-self.vocab_size // BLOCK)
        block_start = np.searchsorted(ordered, np.arange(n_blocks + 1) * BLOCK).astype(np.int64)
        bits = np.zeros(n_blocks, np.uint64)
        np.bitwise_or.at(bits, ordered // BLOCK,
                         np.left_shift(np.uint64(1), (ordered % BLOCK).astype(np.uint64)))
        object.__setattr__(self, "ids", ids)
        object.__setattr__(self, "_kernel", (ordered, block_start, bits))

    @property
    def size(self) -> int:
        return int(self.ids.size)

    def kernel_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids int32 ascending [n], block_start int64 [n_blocks + 1], bits
        uint64 [n_blocks]): block b's hot ids are ids[block_start[b]:
        block_start[b + 1]], and bit j of bits[b] marks column 64 b + j."""
        return self._kernel

    def positions(self) -> np.ndarray:
        """int32 [vocab_size]: each id's index in ``kernel_arrays()[0]``, -1
        for ids outside the set (computed once; the handoff kernel's O(1)
        lookup of an override's column)."""
        if getattr(self, "_positions", None) is None:
            positions = np.full(self.vocab_size, -1, np.int32)
            positions[self._kernel[0]] = np.arange(self.size, dtype=np.int32)
            object.__setattr__(self, "_positions", positions)
        return self._positions


def fingerprint(hot_vocab: HotVocab | None) -> int:
    """A positive int64 naming a hot set by its ids and vocabulary (0: no hot
    set), for samplers on other servers to compare with their own
    (``hot_vocab_fingerprint``): with another hot set a row SHVS decides
    draws another (equally exact) token, so a seeded request's text would
    depend on which server sampled it."""
    if hot_vocab is None:
        return 0
    if getattr(hot_vocab, "_fingerprint", None) is None:  # once: a sampler checks every request
        digest = hashlib.blake2b(np.int64(hot_vocab.vocab_size).tobytes()
                                 + hot_vocab.kernel_arrays()[0].astype("<i4").tobytes(),
                                 digest_size=8).digest()
        object.__setattr__(hot_vocab, "_fingerprint", (int.from_bytes(digest, "little") >> 1) or 1)
    return hot_vocab._fingerprint


@dataclass
class SizingCurve:
    """One configuration's sizing measurements over ``HotProfile.sizes``.

    acceptance: float64 [n], the fraction of held-out rows decided from H;
    us_per_row: float64 [n], the measured cost per row with SHVS;
    slope_us, intercept_us: the least-squares fit c * |H| + c0 of the
        accepted-row cost, us_per_row - (1 - acceptance) * full_us;
    full_us: the full path's cost per row (what an undecided row adds).
    """

    acceptance: np.ndarray
    us_per_row: np.ndarray
    slope_us: float
    intercept_us: float
    full_us: float

    def rows_per_s(self, sizes) -> np.ndarray:
        """Predicted rows/s at ``sizes`` (the measured sizes)."""
        return expected_rows_per_s(sizes, self.acceptance, self.slope_us, self.intercept_us,
                                   self.full_us)


@dataclass
class HotProfile:
    """A calibrated hot-first vocabulary order and the sizing model.

    order: int32 [K] token ids, hottest first (K <= vocab_size: the tail
        beyond the largest measured size is not stored).
    vocab_size: V of the model's rows.
    sizes: int64 [n] measured |H| values.
    curves: per configuration ("plain": temperature 1, no truncation, whose
        acceptance is the hot set's mass, and "top_p": top_p 0.9 alone), its
        ``SizingCurve``.
    chosen_size: the |H| maximizing the rows/s of a workload split evenly
        between the configurations (``mixed_rows_per_s``).
    mass: float64 [K], the calibration rows' mean probability mass captured
        by the first k tokens of ``order`` (k = 1..K).
    meta: provenance (model, prompts, rows, tokens, fit quality).
    """

    order: np.ndarray
    vocab_size: int
    sizes: np.ndarray
    curves: dict
    chosen_size: int
    mass: np.ndarray
    meta: dict = field(default_factory=dict)

    def hot_vocab(self, size: int | None = None) -> HotVocab:
        """The first ``size`` (default chosen_size) tokens of the order."""
        size = self.chosen_size if size is None else size
        if not 1 <= size <= self.order.size:
            raise ValueError(f"hot set size must be in [1, {self.order.size}], got {size}")
        return HotVocab(self.order[:size], self.vocab_size)

    def mixed_rows_per_s(self, plain_scale: float = 1.0) -> np.ndarray:
        """Predicted rows/s at each size for a workload split evenly between
        the configurations: the inverse of their mean time per row. With
        plain_scale, the plain configuration's acceptance (the hot set's
        mass, which domain drift moves) is first scaled by it."""
        times = []
        for name, curve in self.curves.items():
            scale = plain_scale if name == "plain" else 1.0
            alpha = np.clip(curve.acceptance * scale, 0.0, 1.0)
            times.append(1.0 / expected_rows_per_s(self.sizes, alpha, curve.slope_us,
                                                   curve.intercept_us, curve.full_us))
        return 1.0 / np.mean(times, axis=0)

    def save(self, path: str | Path) -> Path:
        """Write the profile as one .npz file (parents created)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        scalars = {"format": PROFILE_FORMAT, "vocab_size": self.vocab_size,
                   "chosen_size": self.chosen_size, "meta": self.meta,
                   "fits": {name: {"slope_us": c.slope_us, "intercept_us": c.intercept_us,
                                   "full_us": c.full_us} for name, c in self.curves.items()}}
        arrays = {f"{name}_{key}": getattr(c, key) for name, c in self.curves.items()
                  for key in ("acceptance", "us_per_row")}
        with open(path, "wb") as fh:
            np.savez_compressed(fh, order=self.order.astype(np.int32), sizes=self.sizes,
                                mass=self.mass.astype(np.float32), **arrays,
                                scalars=np.frombuffer(json.dumps(scalars).encode(), np.uint8))
        return path


def load_profile(path: str | Path) -> HotProfile:
    """Read a profile written by ``HotProfile.save``; ValueError if the file
    is not one."""
    with np.load(path) as data:
        if "scalars" not in data:
            raise ValueError(f"{path} is not a hot-vocabulary profile (no 'scalars' entry)")
        scalars = json.loads(data["scalars"].tobytes().decode())
        if scalars.get("format") != PROFILE_FORMAT:
            raise ValueError(f"{path}: profile format {scalars.get('format')!r}, "
                             f"expected {PROFILE_FORMAT!r}")
        curves = {name: SizingCurve(acceptance=data[f"{name}_acceptance"].astype(np.float64),
                                    us_per_row=data[f"{name}_us_per_row"].astype(np.float64),
                                    **fit)
                  for name, fit in scalars["fits"].items()}
        profile = HotProfile(order=data["order"].astype(np.int32),
                             vocab_size=int(scalars["vocab_size"]),
                             sizes=data["sizes"].astype(np.int64), curves=curves,
                             chosen_size=int(scalars["chosen_size"]),
                             mass=data["mass"].astype(np.float64), meta=scalars["meta"])
    HotVocab(profile.order, profile.vocab_size)    # validates the stored order
    return profile


def expected_rows_per_s(size, acceptance, slope_us: float, intercept_us: float,
                        fallback_us: float):
    """The sizing model: 1e6 / (c |H| + c0 + (1 - alpha(|H|)) T_fallback)."""
    size = np.asarray(size, np.float64)
    return 1e6 / (slope_us * size + intercept_us + (1.0 - np.asarray(acceptance)) * fallback_us)


class HotVocabMonitor:
    """Tracks SHVS acceptance at run time and recommends an |H| on drift.

    ``observe(out.hot_accepted, untruncated)`` after each ``sample`` call,
    with ``untruncated`` marking the rows sampled without truncation
    (temperature > 0, top_p 1, no min_p / top_k): their acceptance is the hot
    set's share of the mass, the quantity domain drift moves. (top_p rows are
    decided from H almost always, whatever H holds.) Over a sliding window
    of ``window`` such rows, drift is an observed acceptance more than
    ``tolerance`` off the profile's plain-sampling alpha(size). The
    recommendation scales that acceptance curve by observed / predicted and
    re-maximizes the expected rows/s. It is advice, never
    applied here (see the module docstring)."""

    def __init__(self, profile: HotProfile, size: int | None = None, window: int = 4096,
                 tolerance: float = 0.05):
        self.profile = profile
        self.size = profile.chosen_size if size is None else size
        self.window = window
        self.tolerance = tolerance
        self._outcomes = np.zeros(0, np.int8)
        self._warned_at = -np.inf

    def observe(self, hot_accepted: np.ndarray, untruncated: np.ndarray) -> None:
        """hot_accepted int8 [B] (SampleOutput.hot_accepted); untruncated bool [B]."""
        outcomes = np.asarray(hot_accepted, np.int8)
        outcomes = outcomes[np.asarray(untruncated, bool) & (outcomes >= 0)]
        self._outcomes = np.concatenate([self._outcomes, outcomes])[-self.window:]

    @property
    def rows(self) -> int:
        return int(self._outcomes.size)

    @property
    def acceptance(self) -> float:
        """Observed acceptance over the window (NaN before any counted row)."""
        return float(self._outcomes.mean()) if self.rows else float("nan")

    @property
    def predicted(self) -> float:
        """The profile's plain-sampling alpha at the configured size."""
        curve = self.profile.curves["plain"]
        return float(np.interp(self.size, self.profile.sizes, curve.acceptance))

    @property
    def drifted(self) -> bool:
        """A full window whose acceptance is off the prediction by > tolerance."""
        return self.rows >= self.window and abs(self.acceptance - self.predicted) > self.tolerance

    def recommended_size(self) -> int:
        """The |H| to configure given the observed acceptance (the current
        size while nothing has drifted)."""
        if not self.drifted:
            return self.size
        rate = self.profile.mixed_rows_per_s(self.acceptance / max(self.predicted, 1e-9))
        return int(self.profile.sizes[int(np.argmax(rate))])

    def drift_warning(self, now: float, interval_s: float = 600.0) -> str | None:
        """One log line on drift with the recommended |H|, at most once per
        `interval_s` (`now`: a monotonic clock in seconds); None otherwise.
        Rate-limited because a drifted window stays drifted for every
        request until the instances are reconfigured."""
        if not self.drifted or now - self._warned_at < interval_s:
            return None
        self._warned_at = now
        return (f"hot-vocab drift: SHVS acceptance {self.acceptance:.3f} over the last "
                f"{self.rows} untruncated rows, the profile predicts {self.predicted:.3f} at "
                f"|H| = {self.size}; recommended |H| = {self.recommended_size()} (apply it to "
                f"every instance at once: `simple-sampler calibrate`, docs/DESIGN.md)")


def untruncated_rows(batch) -> np.ndarray:
    """bool [B]: the rows of a ``SamplingBatch`` drawn from the whole
    distribution (not greedy, every truncation of ``params.RULES`` off), whose SHVS
    acceptance is the hot set's share of the mass (what the monitor counts)."""
    return ~is_greedy(batch.temperature) & ~any_on(batch, "truncation")
