"""Speculative hot-vocab sampling (SHVS): hot sets, their calibrated
profiles and the run-time acceptance monitor. The exact sampling itself runs
inside the Cython kernels (``sample(..., hot_vocab=...)``)."""
from .hot_vocab import (HotProfile, HotVocab, HotVocabMonitor, SizingCurve, expected_rows_per_s,
                        load_profile)

__all__ = ["HotProfile", "HotVocab", "HotVocabMonitor", "SizingCurve", "expected_rows_per_s",
           "load_profile"]
