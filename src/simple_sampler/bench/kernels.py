"""`simple-sampler bench kernels`: microseconds per row, side by side.

For each vocabulary and dtype, on the same B rows in one run:
  simple          every feature on: temperature 0.8, top_k 50, top_p 0.95,
                  min_p 0.05, repetition 1.1, presence 0.5, frequency 0.5,
                  256 history tokens per row (128 prompt + 128 output)
  simple_top_p    top_p 0.9 alone at temperature 1 (needs the row's whole mass)
  simple_greedy   temperature 0
  simple_logprobs `simple` plus the chosen token's logprob (a full-row exp)
  torch_sort      the vLLM-style PyTorch sampler (baselines.py), `simple`'s settings
  floor           numpy max over the same rows in their storage dtype (bfloat16
                  rows: the max of their int16 bit patterns, the same bytes read,
                  since numpy has no bfloat16 max)
All single-threaded (kernel num_threads=1, torch.set_num_threads(1)).
Rows: real SmolLM2 logits at V=49,152; synthetic rows fitted to them otherwise.
"""
from __future__ import annotations

import time

import ml_dtypes
import numpy as np

from ..params import History, SamplingBatch, SamplingParams
from ..rows import ROWS_SOURCE, rows_for
from ..sampling import sample

VOCABS = (49_152, 128_256, 151_936)
ALL_FEATURES = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, min_p=0.05,
                              repetition_penalty=1.1, presence_penalty=0.5,
                              frequency_penalty=0.5)
TOP_P_ONLY = SamplingParams(top_p=0.9)
GREEDY = SamplingParams(temperature=0.0)


def make_batch(params: SamplingParams, rows: np.ndarray, history_tokens: int,
               seed: int = 0) -> SamplingBatch:
    """One SamplingBatch for all rows; histories drawn from each row's own
    likely tokens (half) and uniformly (half), as a real conversation mixes."""
    rng = np.random.default_rng(seed)
    size, vocab = rows.shape
    histories = []
    for r in range(size):
        likely = np.argpartition(-rows[r].astype(np.float32), 512)[:512]
        ids = np.concatenate([rng.choice(likely, history_tokens // 2),
                              rng.integers(0, vocab, history_tokens - history_tokens // 2)])
        rng.shuffle(ids)
        half = history_tokens // 2
        histories.append(History(prompt_ids=ids[:half].tolist(), output_ids=ids[half:].tolist()))
    seeded = [SamplingParams(**{**params.__dict__, "seed": seed * 1000 + r}) for r in range(size)]
    return SamplingBatch.from_params(seeded, histories)


def time_per_row(fn, rows: int, repeats: int) -> float:
    """Median wall time of fn() over `repeats` calls, in microseconds per row."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) / rows * 1e6


def run(vocabs=VOCABS, batch: int = 64, dtypes=("float32", "bfloat16"), repeats: int = 20,
        baseline_repeats: int = 3, history_tokens: int = 256) -> list[dict]:
    import torch

    torch.set_num_threads(1)
    results = []
    for vocab in vocabs:
        base = rows_for(vocab, batch)
        batches = {
            "simple": make_batch(ALL_FEATURES, base, history_tokens),
            "simple_top_p": make_batch(TOP_P_ONLY, base, 0),
            "simple_greedy": make_batch(GREEDY, base, 0),
        }
        for dtype in dtypes:
            if dtype == "float32":
                rows = np.ascontiguousarray(base, np.float32)
                floor_rows = rows
                torch_rows = torch.from_numpy(rows)
            else:
                rows = base.astype(ml_dtypes.bfloat16)
                floor_rows = rows.view(np.int16)
                torch_rows = torch.from_numpy(rows.view(np.int16)).view(torch.bfloat16)
            us = {}
            for name, params in batches.items():
                us[name] = time_per_row(
                    lambda: sample(rows, params, return_logprobs=False, num_threads=1),
                    batch, repeats)
            us["simple_logprobs"] = time_per_row(
                lambda: sample(rows, batches["simple"], return_logprobs=True, num_threads=1),
                batch, repeats)
            from ..baselines import torch_sort_sample

            generator = torch.Generator().manual_seed(0)
            us["torch_sort"] = time_per_row(
                lambda: torch_sort_sample(torch_rows, batches["simple"], generator),
                batch, baseline_repeats)
            us["floor"] = time_per_row(lambda: floor_rows.max(axis=1), batch, repeats)
            results.append({
                "vocab": vocab, "batch": batch, "dtype": dtype, "rows": ROWS_SOURCE(vocab),
                "threads": 1, "us_per_row": {k: round(v, 2) for k, v in us.items()},
                "ratios": {
                    "simple_over_floor": round(us["simple"] / us["floor"], 2),
                    "simple_top_p_over_floor": round(us["simple_top_p"] / us["floor"], 2),
                    "torch_sort_over_simple": round(us["torch_sort"] / us["simple"], 1),
                },
            })
    return results


def format_table(results: list[dict]) -> str:
    columns = ("simple", "simple_top_p", "simple_greedy", "simple_logprobs", "torch_sort", "floor")
    lines = ["us per row, single thread, B=%d" % results[0]["batch"] if results else "",
             f"{'vocab':>7} {'dtype':>8} " + " ".join(f"{c:>15}" for c in columns)
             + f" {'simple/floor':>12} {'top_p/floor':>11} {'torch/simple':>12}  rows"]
    for r in results:
        us = r["us_per_row"]
        ratios = r["ratios"]
        lines.append(f"{r['vocab']:>7} {r['dtype']:>8} " + " ".join(f"{us[c]:>15.1f}" for c in columns)
                     + f" {ratios['simple_over_floor']:>12.2f} {ratios['simple_top_p_over_floor']:>11.2f}"
                     f" {ratios['torch_sort_over_simple']:>12.1f}  {r['rows']}")
    return "\n".join(lines)
