"""`simple-sampler bench handoff`: the hot-first handoff against full rows,
side by side, B=64, one thread, logprobs off.

Per vocabulary, dtype and config, on the same rows in one run:
  full       ``sample`` on the full rows (what crosses today: V logits a row)
  hot_first  the decision plane's whole cost with the handoff: the compact
             kernel on every row, plus the second request (``sample`` on the
             undecided rows' full rows, conditioned on C where the draw fell
             there), per row of the batch
  summary    the data plane's side (``touched_lists`` and
             ``hot_first_summary`` in torch) measured on THIS CPU; in
             deployment it runs on the GPU next to the logits, so this
             column is not the decision plane's cost
bytes_per_row: full = V * itemsize; hot_first = the compact rows' arrays
(hot logits in the row dtype, touched ids int32 and logits float32 with
their offsets, the three cold-summary values), averaged over the batch.
fallback_rate: the share of rows the compact form could not decide.

Rows: V=49,152 real SmolLM2 rows (``rows.real_rows``); V=151,936 synthetic
rows (NOT MODEL OUTPUTS) built by ``rows.synthetic_hot_rows``, where
the real tokens keep their identity through a fixed id map so a hot set can
apply (``rows.synthetic_rows`` permutes each row afresh: no hot set could).
The hot set is the shipped profile's order (its chosen size by default),
calibrated on other prompts; mapped through the same id map at 151,936.
Configs as ``bench shvs``: ``top_p`` (0.9 alone) and ``all`` (bench
kernels' settings with 256 history ids a row).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

from ...handoff import DEFAULT_COLD_TOP, decide_hot_first, run_now, sample_compact
from ...rows import HOT_ROWS_SOURCE, ROWS_SOURCE, map_hot_ids, real_rows, synthetic_hot_rows
from ...sampling import sample
from ...serving.hot_first import compact_rows
from ...shvs.hot_vocab import HotVocab
from ..kernels.measuring import make_batch, time_interleaved
from ..shvs.measuring import BATCH, CONFIGS, SYNTHETIC_VOCAB, resolve_profile

SUMMARY_NOTE = ("summary: the data plane's torch side measured on this CPU; in deployment it "
                "runs on the GPU next to the logits")


def _tensor(rows: np.ndarray) -> torch.Tensor:
    if rows.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(rows.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(rows)


def measure(rows: np.ndarray, batch, hot: HotVocab, cold_top: int, repeats: int,
            clock: str = "wall") -> dict:
    """One vocabulary / dtype / config: us per row of each column, bytes per
    row and the fallback rate."""
    tensor = _tensor(rows)
    options = dict(return_logprobs=False, num_threads=1)

    def summarize():
        return compact_rows(tensor, batch, hot, cold_top)

    compact = summarize()

    def decide():
        return run_now(decide_hot_first(
            compact, batch, hot, lambda compact, batch: sample_compact(compact, batch, hot, **options),
            lambda undecided, second: sample(rows[undecided], second, **options)))

    outcome = decide().outcome
    us = time_interleaved({
        "full": lambda: sample(rows, batch, return_logprobs=False, num_threads=1),
        "hot_first": decide,
        "summary": summarize,
    }, len(rows), repeats, clock)
    return {"bytes_per_row": {"full": int(rows.shape[1] * rows.itemsize),
                              "hot_first": round(compact.nbytes() / len(rows), 1)},
            "us_per_row": {k: round(v, 2) for k, v in us.items()},
            "fallback_rate": round(float(np.mean(outcome != 0)), 4),
            "fallbacks": {"need_full": int(np.sum(outcome == 1)),
                          "need_cold": int(np.sum(outcome == 2))}}


def run(profile_path: str | None = None, repeats: int = 15, hot_size: int | None = None,
        cold_top: int = DEFAULT_COLD_TOP, dtypes=("float32", "bfloat16"),
        clock: str = "wall") -> dict:
    torch.set_num_threads(1)
    profile = resolve_profile(profile_path, quick=False)
    size = profile.chosen_size if hot_size is None else hot_size
    real = real_rows(BATCH)
    kinds = ((real, profile.order[:size]),
             (synthetic_hot_rows(real, SYNTHETIC_VOCAB),
              map_hot_ids(profile.order[:size], SYNTHETIC_VOCAB)))
    results = []
    for base, ids in kinds:
        vocab = base.shape[1]
        hot = HotVocab(ids, vocab)
        for dtype in dtypes:
            rows = base if dtype == "float32" else base.astype(ml_dtypes.bfloat16)
            for config, (params, history) in CONFIGS.items():
                batch = make_batch(params, base, history)
                results.append({"vocab": vocab, "batch": BATCH, "dtype": dtype, "config": config,
                                "rows": ROWS_SOURCE(vocab) if vocab != SYNTHETIC_VOCAB else
                                HOT_ROWS_SOURCE,
                                **measure(rows, batch, hot, cold_top, repeats, clock)})
    return {"results": results, "hot_size": size, "cold_top": cold_top, "threads": 1,
            "clock": clock, "note": SUMMARY_NOTE}


def format_table(report: dict) -> str:
    lines = [f"us per row ({report['clock']} clock), B={BATCH}, one thread, "
             f"|H|={report['hot_size']}, cold_top={report['cold_top']}; "
             f"{report['note']}",
             f"{'vocab':>7} {'dtype':>8} {'config':>6} {'bytes full':>10} {'hot_first':>9} "
             f"{'ratio':>6} {'us full':>8} {'hot_first':>9} {'summary':>8} {'fallback':>8}  rows"]
    for r in report["results"]:
        b, us = r["bytes_per_row"], r["us_per_row"]
        lines.append(f"{r['vocab']:>7} {r['dtype']:>8} {r['config']:>6} {b['full']:>10} "
                     f"{b['hot_first']:>9.0f} {b['hot_first'] / b['full']:>6.1%} "
                     f"{us['full']:>8.1f} {us['hot_first']:>9.1f} {us['summary']:>8.1f} "
                     f"{r['fallback_rate']:>8.2%}  {r['rows']}")
    return "\n".join(lines)
