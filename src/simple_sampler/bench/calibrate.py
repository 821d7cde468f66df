"""`simple-sampler calibrate`: a model's hot vocabulary and its sizing model.

1. Run SmolLM2-135M-Instruct on the shipped calibration prompts
   (``data/calibration_prompts.json``: chat, code, lists, other languages,
   plain completions; none of them is a benchmark prompt of
   ``data/prompts.json``), sampling a continuation of each with this
   project's sampler (temperature 1, top_p 0.95) and the KV cache.
2. Every fourth prompt is held out. Over the others, accumulate each
   token's probability (softmax of the logits) at every decode step and
   order the vocabulary by that mass, hottest first.
3. On the held-out rows, for each candidate |H| and each configuration SHVS
   takes ("plain": temperature 1, no truncation, whose acceptance is the hot
   set's mass; "top_p": top_p 0.9 alone): the kernels' cost per row with
   SHVS (B=64, one thread) and the acceptance alpha(|H|) (rows decided
   from H); and the full path's cost.
4. Per configuration, fit the accepted-row cost c * |H| + c0 by least
   squares to T(|H|) - (1 - alpha(|H|)) * T_full (a row SHVS cannot decide
   pays about the full path on top), so its expected rows/s is
   1 / (c |H| + c0 + (1 - alpha(|H|)) T_full). Pick the |H| maximizing the
   rows/s of a workload split evenly between the two, save the profile and
   plot cost, acceptance and throughput against |H|.
"""
from __future__ import annotations

import json
import math
from importlib import resources
from pathlib import Path

import numpy as np

from ..params import SamplingBatch, SamplingParams
from ..sampling import sample
from ..shvs.hot_vocab import HotProfile, HotVocab, SizingCurve
from .kernels.measuring import TOP_P_ONLY, make_batch, time_per_row

#: Where the profile goes by default: the sampler's folder of a Triton model repository.
DEFAULT_OUTPUT = Path("model_repository") / "simple_sampler" / "hot_vocab.npz"
DEFAULT_SIZES = (256, 512, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384)
HELD_OUT_EVERY = 4
#: How the calibration continuations are sampled.
GENERATION = SamplingParams(temperature=1.0, top_p=0.95)
BATCH = 64
#: The configurations SHVS takes, measured for the sizing model.
CONFIGS = {"plain": SamplingParams(), "top_p": TOP_P_ONLY}


def load_calibration_prompts() -> list[dict]:
    """The shipped calibration prompts: ``{"text": str, "chat": bool}`` each."""
    text = (resources.files("simple_sampler") / "data" / "calibration_prompts.json").read_text(
        encoding="utf-8")
    return json.loads(text)


def generate_rows(prompts: list[dict], tokens: int, seed: int = 0) -> list[np.ndarray]:
    """Per prompt, float32 [L, V] next-token logits of a sampled continuation
    (1 <= L <= tokens; it stops after an end-of-sequence token)."""
    import torch

    from .. import models
    from ..rows import eos_ids, prompt_ids

    model, tokenizer = models.load_smollm2()
    ends = eos_ids(model, tokenizer)
    out_rows = []
    with torch.no_grad():
        for p, prompt in enumerate(prompts):
            out = model(input_ids=torch.tensor([prompt_ids(tokenizer, prompt)]), use_cache=True,
                        logits_to_keep=1)
            rows = []
            for step in range(tokens):
                logits = out.logits[0, -1].float().numpy().copy()
                rows.append(logits)
                batch = SamplingBatch.from_params(
                    [SamplingParams(**{**GENERATION.__dict__, "seed": seed * 1_000_003 + p})],
                    steps=[step])
                token = int(sample(logits, batch, return_logprobs=False).token_ids[0])
                if token in ends or step == tokens - 1:
                    break
                out = model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values,
                            use_cache=True)
            out_rows.append(np.stack(rows))
    return out_rows


def token_mass(rows: np.ndarray) -> np.ndarray:
    """float64 [V]: the sum over rows of softmax(row) (temperature 1)."""
    z = rows.astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    np.exp(z, out=z)
    z /= z.sum(axis=1, keepdims=True)
    return z.sum(axis=0)


def measure(rows: np.ndarray, params: SamplingParams, sizes, order: np.ndarray,
            repeats: int) -> dict:
    """Cost and acceptance of SHVS at each size on `rows` under `params`."""
    rows = rows[:BATCH]
    batch = make_batch(params, rows, 0)
    run = lambda hot: sample(rows, batch, return_logprobs=False, num_threads=1, hot_vocab=hot)
    full_us = time_per_row(lambda: run(None), len(rows), repeats)
    us, acceptance = [], []
    for size in sizes:
        hot = HotVocab(order[:size], rows.shape[1])
        us.append(time_per_row(lambda: run(hot), len(rows), repeats))
        acceptance.append(float(np.mean(run(hot).hot_accepted == 1)))
    return {"full_us": full_us, "us": np.array(us), "acceptance": np.array(acceptance)}


def fit_curve(sizes: np.ndarray, measured: dict) -> tuple[SizingCurve, float]:
    """The SizingCurve of one configuration's measurements, and the fit's
    R^2: the least-squares line c * |H| + c0 through the accepted-row cost
    T(|H|) - (1 - alpha(|H|)) * T_full."""
    us, acceptance, full_us = measured["us"], measured["acceptance"], measured["full_us"]
    accepted_us = us - (1.0 - acceptance) * full_us
    design = np.stack([sizes.astype(np.float64), np.ones(len(sizes))], axis=1)
    (slope, intercept), *_ = np.linalg.lstsq(design, accepted_us, rcond=None)
    residual = accepted_us - design @ np.array([slope, intercept])
    spread = np.sum((accepted_us - accepted_us.mean()) ** 2)
    r2 = 1.0 - float(np.sum(residual ** 2) / spread) if spread > 0 else 1.0
    return SizingCurve(acceptance=acceptance, us_per_row=us, slope_us=float(slope),
                       intercept_us=float(intercept), full_us=full_us), r2


def calibrate(prompts: list[dict] | None = None, tokens: int = 48, sizes=DEFAULT_SIZES,
              repeats: int = 9, seed: int = 0) -> HotProfile:
    """Build a profile for SmolLM2 (see the module docstring)."""
    prompts = load_calibration_prompts() if prompts is None else prompts
    if len(prompts) < 2:
        raise ValueError(f"calibration needs at least 2 prompts (one held out), got {len(prompts)}")
    generated = generate_rows(prompts, tokens, seed)
    held = [i for i in range(len(prompts)) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1] or [1]
    profile_rows = np.concatenate([r for i, r in enumerate(generated) if i not in held])
    held_rows = np.concatenate([generated[i] for i in held])
    vocab = profile_rows.shape[1]
    mass = token_mass(profile_rows)
    order = np.lexsort((np.arange(vocab), -mass)).astype(np.int32)
    sizes = np.array(sorted({min(int(s), vocab) for s in sizes}), np.int64)
    order = order[:sizes[-1]]
    curves, r2 = {}, {}
    for name, params in CONFIGS.items():
        curves[name], r2[name] = fit_curve(sizes, measure(held_rows, params, sizes, order, repeats))
    profile = HotProfile(
        order=order, vocab_size=vocab, sizes=sizes, curves=curves, chosen_size=0,
        mass=np.cumsum(mass[order]) / mass.sum(),
        meta={"model": "SmolLM2-135M-Instruct", "prompts": len(prompts),
              "held_out_prompts": len(held), "profile_rows": int(len(profile_rows)),
              "held_out_rows": int(len(held_rows)), "tokens_per_prompt": tokens,
              "measured_rows": int(min(BATCH, len(held_rows))), "fit_r2": r2,
              "generation": {"temperature": GENERATION.temperature, "top_p": GENERATION.top_p},
              "configs": {"plain": "temperature 1, no truncation",
                          "top_p": "top_p 0.9 alone at temperature 1"},
              "threads": 1})
    profile.chosen_size = int(sizes[int(np.argmax(profile.mixed_rows_per_s()))])
    return profile


def describe(profile: HotProfile) -> str:
    """The fits and the choice, as `calibrate` prints them."""
    p = profile
    lines = [f"profile: {p.meta['profile_rows']} rows from "
             f"{p.meta['prompts'] - p.meta['held_out_prompts']} prompts; measured on "
             f"{p.meta['measured_rows']} held-out rows, B={BATCH}, one thread"]
    for name, curve in p.curves.items():
        lines.append(f"{name:>6} ({p.meta['configs'][name]}): accepted-row cost "
                     f"{curve.slope_us * 1000:.2f} ns * |H| + {curve.intercept_us:.1f} us "
                     f"(R^2 {p.meta['fit_r2'][name]:.3f}); full path {curve.full_us:.1f} us/row")
    header = f"{'|H|':>7} {'mass':>7}"
    for name in p.curves:
        header += f" {name + ' acc':>10} {name + ' us':>9}"
    lines.append(header + f" {'pred rows/s':>12} {'meas rows/s':>12}")
    measured = 1e6 / np.mean([c.us_per_row for c in p.curves.values()], axis=0)
    for i, (size, predicted) in enumerate(zip(p.sizes, p.mixed_rows_per_s())):
        row = f"{size:>7} {p.mass[size - 1]:>7.4f}"
        for curve in p.curves.values():
            row += f" {curve.acceptance[i]:>10.3f} {curve.us_per_row[i]:>9.1f}"
        mark = "  <- chosen" if size == p.chosen_size else ""
        lines.append(row + f" {predicted:>12.0f} {measured[i]:>12.0f}{mark}")
    full = 1.0 / np.mean([c.full_us for c in p.curves.values()]) * 1e6
    lines.append(f"rows/s: an even mix of the configurations; full path alone: {full:.0f} rows/s")
    return "\n".join(lines)


def plot(profile: HotProfile, path: str | Path) -> Path:
    """PNG of cost, acceptance and throughput against |H|, the choice marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = profile
    sizes = p.sizes.astype(np.float64)
    line = np.geomspace(sizes[0], sizes[-1], 200)
    fig, axes = plt.subplots(3, 1, figsize=(7, 10), sharex=True)
    for name, curve in p.curves.items():
        points = axes[0].plot(sizes, curve.us_per_row, "o", label=f"{name}: measured us/row")
        axes[0].plot(sizes, curve.us_per_row - (1 - curve.acceptance) * curve.full_us, "s",
                     color=points[0].get_color(), mfc="none",
                     label=f"{name}: accepted-row cost (fitted)")
        axes[0].plot(line, curve.slope_us * line + curve.intercept_us, "-",
                     color=points[0].get_color(),
                     label=f"{name}: fit {curve.slope_us * 1000:.2f} ns*|H| + "
                           f"{curve.intercept_us:.1f} us")
        axes[0].axhline(curve.full_us, color=points[0].get_color(), ls=":",
                        label=f"{name}: full path")
        axes[1].plot(sizes, curve.acceptance, "o-", label=f"{name}: acceptance (held out)")
        axes[2].plot(sizes, curve.rows_per_s(p.sizes), "o-", label=f"{name}: predicted")
    axes[1].plot(np.arange(1, p.mass.size + 1), p.mass, "-", label="calibration mass in H")
    axes[2].plot(sizes, p.mixed_rows_per_s(), "s-", label="even mix: predicted")
    measured = 1e6 / np.mean([c.us_per_row for c in p.curves.values()], axis=0)
    axes[2].plot(sizes, measured, "x", label="even mix: measured")
    axes[0].set_ylabel("us per row")
    axes[1].set_ylabel("fraction")
    axes[1].set_ylim(0, 1.02)
    axes[2].set_ylabel("rows per second")
    axes[2].set_xlabel("|H| (hot tokens)")
    for ax in axes:
        ax.axvline(p.chosen_size, color="red", ls="--", lw=1)
        ax.set_xscale("log")
        ax.legend(fontsize=7)
    axes[0].set_title(f"SHVS sizing, {p.meta.get('model', '')}, V={p.vocab_size}: "
                      f"chosen |H| = {p.chosen_size}")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(output: str | Path = DEFAULT_OUTPUT, plot_path: str | Path | None = None,
         prompts: int | None = None, tokens: int = 48, sizes=DEFAULT_SIZES,
         repeats: int = 9) -> HotProfile:
    """What the CLI runs: calibrate, print, save the profile and the plot."""
    chosen = load_calibration_prompts()
    chosen = chosen if prompts is None else chosen[:prompts]
    profile = calibrate(chosen, tokens, sizes, repeats)
    saved = profile.save(output)
    drawn = plot(profile, plot_path or Path(output).with_suffix(".png"))
    print(describe(profile))
    print(f"profile: {saved} ({math.ceil(saved.stat().st_size / 1024)} KiB); plot: {drawn}")
    return profile
