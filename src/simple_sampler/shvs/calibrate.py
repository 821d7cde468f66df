"""`simple-sampler calibrate`: a model's hot vocabulary and its sizing model.

1. Run SmolLM2-135M-Instruct on the shipped calibration prompts
   (``data/calibration_prompts.json``: chat, code, lists, other languages,
   plain completions; none of them is a benchmark prompt of
   ``data/prompts.json``), sampling a continuation of each with this
   project's sampler (temperature 1, top_p 0.95) and the KV cache.
2. Every fourth prompt is held out. Over the others, accumulate each
   token's probability (softmax of the logits) at every decode step and
   order the vocabulary by that mass, hottest first.
3. On the held-out rows, for each candidate |H|: the kernels' cost per row
   with SHVS (top_p 0.9 alone at temperature 1, B=64, one thread; the
   configuration whose full path must read the whole row's mass) and the
   acceptance alpha(|H|) (rows decided from H); and the full path's cost.
4. Fit the accepted-row cost c * |H| + c0 by least squares to
   T(|H|) - (1 - alpha(|H|)) * T_full (a row SHVS cannot decide pays about
   the full path on top), pick the |H| maximizing the expected rows/s
   1 / (c |H| + c0 + (1 - alpha(|H|)) T_full), save the profile and plot
   cost, acceptance and throughput against |H|.
"""
from __future__ import annotations

import json
import math
from importlib import resources
from pathlib import Path

import numpy as np

from ..bench.kernels import TOP_P_ONLY, make_batch, time_per_row
from ..params import SamplingBatch, SamplingParams
from ..sampling import sample
from .hot_vocab import HotProfile, HotVocab, expected_rows_per_s

#: Where the profile goes by default: the sampler's folder of a Triton model repository.
DEFAULT_OUTPUT = Path("model_repository") / "simple_sampler" / "hot_vocab.npz"
DEFAULT_SIZES = (256, 512, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384)
HELD_OUT_EVERY = 4
#: How the calibration continuations are sampled.
GENERATION = SamplingParams(temperature=1.0, top_p=0.95)
BATCH = 64


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
    from ..rows import _eos_ids, _prompt_ids

    model, tokenizer = models.load_smollm2()
    eos_ids = _eos_ids(model, tokenizer)
    out_rows = []
    with torch.no_grad():
        for p, prompt in enumerate(prompts):
            out = model(input_ids=torch.tensor([_prompt_ids(tokenizer, prompt)]), use_cache=True,
                        logits_to_keep=1)
            rows = []
            for step in range(tokens):
                logits = out.logits[0, -1].float().numpy().copy()
                rows.append(logits)
                batch = SamplingBatch.from_params(
                    [SamplingParams(**{**GENERATION.__dict__, "seed": seed * 1_000_003 + p})],
                    steps=[step])
                token = int(sample(logits, batch, return_logprobs=False).token_ids[0])
                if token in eos_ids or step == tokens - 1:
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


def measure(rows: np.ndarray, sizes, order: np.ndarray, repeats: int) -> dict:
    """Cost and acceptance of SHVS at each size on `rows` (top_p 0.9 alone)."""
    rows = rows[:BATCH]
    batch = make_batch(TOP_P_ONLY, rows, 0)
    run = lambda hot: sample(rows, batch, return_logprobs=False, num_threads=1, hot_vocab=hot)
    full_us = time_per_row(lambda: run(None), len(rows), repeats)
    us, acceptance = [], []
    for size in sizes:
        hot = HotVocab(order[:size], rows.shape[1])
        us.append(time_per_row(lambda: run(hot), len(rows), repeats))
        acceptance.append(float(np.mean(run(hot).hot_accepted == 1)))
    return {"full_us": full_us, "us": np.array(us), "acceptance": np.array(acceptance)}


def fit_cost(sizes: np.ndarray, us: np.ndarray, acceptance: np.ndarray,
             full_us: float) -> tuple[float, float, float]:
    """(c, c0, R^2) of the least-squares line c * |H| + c0 through the
    accepted-row cost T(|H|) - (1 - alpha(|H|)) * T_full."""
    accepted_us = us - (1.0 - acceptance) * full_us
    design = np.stack([sizes.astype(np.float64), np.ones(len(sizes))], axis=1)
    (slope, intercept), *_ = np.linalg.lstsq(design, accepted_us, rcond=None)
    residual = accepted_us - design @ np.array([slope, intercept])
    spread = np.sum((accepted_us - accepted_us.mean()) ** 2)
    r2 = 1.0 - float(np.sum(residual ** 2) / spread) if spread > 0 else 1.0
    return float(slope), float(intercept), r2


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
    measured = measure(held_rows, sizes, order, repeats)
    slope, intercept, r2 = fit_cost(sizes, measured["us"], measured["acceptance"],
                                    measured["full_us"])
    rate = expected_rows_per_s(sizes, measured["acceptance"], slope, intercept,
                               measured["full_us"])
    captured = np.cumsum(mass[order]) / mass.sum()
    return HotProfile(
        order=order, vocab_size=vocab, sizes=sizes, acceptance=measured["acceptance"],
        us_per_row=measured["us"], cost_slope_us=slope, cost_intercept_us=intercept,
        fallback_us=measured["full_us"], chosen_size=int(sizes[int(np.argmax(rate))]),
        mass=captured,
        meta={"model": "SmolLM2-135M-Instruct", "prompts": len(prompts),
              "held_out_prompts": len(held), "profile_rows": int(len(profile_rows)),
              "held_out_rows": int(len(held_rows)), "tokens_per_prompt": tokens,
              "measured_rows": int(min(BATCH, len(held_rows))), "fit_r2": r2,
              "generation": {"temperature": GENERATION.temperature, "top_p": GENERATION.top_p},
              "measured_config": "top_p 0.9 alone at temperature 1, one thread"})


def describe(profile: HotProfile) -> str:
    """The fit and the choice, as `calibrate` prints them."""
    p = profile
    rate = expected_rows_per_s(p.sizes, p.acceptance, p.cost_slope_us, p.cost_intercept_us,
                               p.fallback_us)
    lines = [f"profile: {p.meta['profile_rows']} rows from {p.meta['prompts'] - p.meta['held_out_prompts']} "
             f"prompts; measured on {p.meta['measured_rows']} held-out rows "
             f"({p.meta['measured_config']})",
             f"cost fit: {p.cost_slope_us * 1000:.2f} ns * |H| + {p.cost_intercept_us:.1f} us "
             f"(R^2 {p.meta['fit_r2']:.3f}); full path {p.fallback_us:.1f} us/row",
             f"{'|H|':>7} {'mass':>7} {'accept':>7} {'us/row':>8} {'pred rows/s':>12} {'meas rows/s':>12}"]
    for size, alpha, us, predicted in zip(p.sizes, p.acceptance, p.us_per_row, rate):
        mark = "  <- chosen" if size == p.chosen_size else ""
        lines.append(f"{size:>7} {p.mass[size - 1]:>7.4f} {alpha:>7.3f} {us:>8.1f} "
                     f"{predicted:>12.0f} {1e6 / us:>12.0f}{mark}")
    lines.append(f"full path alone: {1e6 / p.fallback_us:.0f} rows/s")
    return "\n".join(lines)


def plot(profile: HotProfile, path: str | Path) -> Path:
    """PNG of cost, acceptance and throughput against |H|, the choice marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = profile
    sizes = p.sizes.astype(np.float64)
    line = np.geomspace(sizes[0], sizes[-1], 200)
    rate = expected_rows_per_s(p.sizes, p.acceptance, p.cost_slope_us, p.cost_intercept_us,
                               p.fallback_us)
    fig, axes = plt.subplots(3, 1, figsize=(7, 9), sharex=True)
    axes[0].plot(sizes, p.us_per_row, "o", label="measured SHVS us/row")
    axes[0].plot(sizes, p.us_per_row - (1 - p.acceptance) * p.fallback_us, "s",
                 label="accepted-row cost")
    axes[0].plot(line, p.cost_slope_us * line + p.cost_intercept_us, "-",
                 label=f"fit {p.cost_slope_us * 1000:.2f} ns*|H| + {p.cost_intercept_us:.1f} us")
    axes[0].axhline(p.fallback_us, color="grey", ls=":", label="full path")
    axes[0].set_ylabel("us per row")
    axes[1].plot(sizes, p.acceptance, "o-", label="acceptance (held-out rows)")
    axes[1].plot(np.arange(1, p.mass.size + 1), p.mass, "-", label="calibration mass in H")
    axes[1].set_ylabel("fraction")
    axes[1].set_ylim(0, 1.02)
    axes[2].plot(sizes, rate, "o-", label="predicted rows/s")
    axes[2].plot(sizes, 1e6 / p.us_per_row, "x", label="measured rows/s")
    axes[2].axhline(1e6 / p.fallback_us, color="grey", ls=":", label="full path")
    axes[2].set_ylabel("rows per second")
    axes[2].set_xlabel("|H| (hot tokens)")
    for ax in axes:
        ax.axvline(p.chosen_size, color="red", ls="--", lw=1)
        ax.set_xscale("log")
        ax.legend(fontsize=8)
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
