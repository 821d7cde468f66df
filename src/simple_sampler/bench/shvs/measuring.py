"""`simple-sampler bench shvs`: speculative hot-vocab sampling against the full
path, side by side, B=64, one thread, logprobs off.

Rows ``smollm2`` (real SmolLM2 rows, held out from the calibration prompts),
``synthetic`` (151,936-token rows from ``rows.synthetic_hot_rows``: NOT
MODEL OUTPUTS; the real tokens keep their identity through one fixed id map,
so the calibrated hot set, mapped the same way, applies) and ``flat``
(bench kernels' flat rows at that V, an untrained model's: the hot set holds
almost none of the mass, so SHVS must hand every row over cheaply); configs ``top_p``
and ``all`` (bench kernels' settings, which SHVS passes on to the full path).
shvs and full alternate within each repeat; medians are reported.
``prefix_us`` is the full kernel on the first |H| columns of hot-first rows:
a lower bound for a data plane that hands over only the hot prefix (measured,
not an implemented path here).

What the rows, configurations and columns mean and how to read them:
docs/BENCHMARKS.md, "SHVS against the full path".
"""
from __future__ import annotations

import time

import numpy as np

from ...models import cache_dir
from ...params import SamplingBatch
from ...rows import map_hot_ids, real_rows, synthetic_hot_rows
from ...sampling import sample
from ...shvs.hot_vocab import HotProfile, HotVocab, load_profile
from ..kernels.measuring import ALL_FEATURES, TOP_P_ONLY, make_batch, rows_of_kind, time_per_row

SYNTHETIC_VOCAB = 151_936
BATCH = 64
CONFIGS = {"top_p": (TOP_P_ONLY, 0), "all": (ALL_FEATURES, 256)}


def resolve_profile(path: str | None, quick: bool) -> HotProfile:
    """The profile at `path`; else the model repository's default; else one
    calibrated now and cached (a smaller calibration with `quick`)."""
    from .. import calibrate

    if path:
        return load_profile(path)
    if calibrate.DEFAULT_OUTPUT.is_file():
        return load_profile(calibrate.DEFAULT_OUTPUT)
    cached = cache_dir() / ("hot_vocab-smollm2-quick.npz" if quick else "hot_vocab-smollm2.npz")
    if cached.is_file():
        return load_profile(cached)
    prompts = calibrate.load_calibration_prompts()
    profile = (calibrate.calibrate(prompts[:8], tokens=16, repeats=1,
                                   sizes=(512, 1024, 2048, 4096)) if quick
               else calibrate.calibrate(prompts))
    profile.save(cached)
    return profile


def side_by_side(rows: np.ndarray, batch: SamplingBatch, hot: HotVocab,
                 repeats: int) -> tuple[float, float, float]:
    """(shvs us/row, full us/row, acceptance): alternating calls, medians."""
    run = lambda h: sample(rows, batch, return_logprobs=False, num_threads=1, hot_vocab=h)
    acceptance = float(np.mean(run(hot).hot_accepted == 1))
    run(None)
    times = {"shvs": [], "full": []}
    for _ in range(repeats):
        for name, h in (("shvs", hot), ("full", None)):
            start = time.perf_counter()
            run(h)
            times[name].append(time.perf_counter() - start)
    us = {k: float(np.median(v)) / len(rows) * 1e6 for k, v in times.items()}
    return us["shvs"], us["full"], acceptance


def prefix_batch(batch: SamplingBatch, hot_ids: np.ndarray, vocab: int) -> SamplingBatch:
    """`batch` for hot-first prefix rows: history ids renumbered to their
    prefix column; ids outside the hot set dropped (a hot-first layout would
    account for them in its cold-region summary)."""
    column = np.full(vocab, -1, np.int64)
    column[hot_ids] = np.arange(hot_ids.size)
    fields = dict(batch.__dict__)
    for name in ("prompt", "output"):
        offsets, ids = fields[f"{name}_offsets"], column[np.asarray(fields[f"{name}_ids"], np.int64)]
        kept = ids >= 0
        fields[f"{name}_offsets"] = np.r_[0, np.cumsum(kept)].astype(np.int64)[offsets]
        fields[f"{name}_ids"] = ids[kept]
    return SamplingBatch(**fields)


def prefix_us(rows: np.ndarray, batch: SamplingBatch, hot_ids: np.ndarray, repeats: int) -> float:
    """us/row of the full kernel over the first |H| columns of hot-first rows."""
    prefix = np.ascontiguousarray(rows[:, hot_ids])
    local = prefix_batch(batch, hot_ids, rows.shape[1])
    return time_per_row(lambda: sample(prefix, local, return_logprobs=False, num_threads=1),
                        len(rows), repeats)


def run(profile_path: str | None = None, repeats: int = 31, quick: bool = False) -> dict:
    """{"results": [...], "hot_first": [...], "profile": {...}} as documented."""
    profile = resolve_profile(profile_path, quick)
    size = profile.chosen_size
    real = real_rows(BATCH)
    mapped = map_hot_ids(profile.order[:size], SYNTHETIC_VOCAB)
    kinds = {"smollm2": (real, profile.order[:size]),
             "synthetic": (synthetic_hot_rows(real, SYNTHETIC_VOCAB), mapped),
             "flat": (rows_of_kind("flat", SYNTHETIC_VOCAB, BATCH)[0], mapped)}
    results, hot_first = [], []
    for kind, (rows, hot_ids) in kinds.items():
        hot = HotVocab(hot_ids, rows.shape[1])
        for config, (params, history) in CONFIGS.items():
            batch = make_batch(params, rows, history)
            shvs_us, full_us, acceptance = side_by_side(rows, batch, hot, repeats)
            results.append({"rows": kind, "vocab": int(rows.shape[1]), "config": config,
                            "hot_size": size, "acceptance": round(acceptance, 4),
                            "us_per_row": {"shvs": round(shvs_us, 2), "full": round(full_us, 2)}})
            hot_first.append({"rows": kind, "config": config, "hot_size": size,
                              "prefix_us": round(prefix_us(rows, batch, hot_ids, repeats), 2)})
    return {"results": results, "hot_first": hot_first,
            "profile": {"chosen_size": size, "vocab": profile.vocab_size, **profile.meta}}


def format_table(report: dict) -> str:
    lines = [f"us per row, single thread, B={BATCH}, hot set |H|={report['profile']['chosen_size']} "
             f"from {report['profile']['prompts']} calibration prompts",
             f"{'rows':>10} {'vocab':>7} {'config':>6} {'accept':>7} {'shvs':>8} {'full':>8} "
             f"{'full/shvs':>9} {'hot-first prefix':>16}"]
    for r, h in zip(report["results"], report["hot_first"]):
        us = r["us_per_row"]
        lines.append(f"{r['rows']:>10} {r['vocab']:>7} {r['config']:>6} {r['acceptance']:>7.3f} "
                     f"{us['shvs']:>8.1f} {us['full']:>8.1f} {us['full'] / us['shvs']:>9.2f} "
                     f"{h['prefix_us']:>16.1f}")
    return "\n".join(lines)
