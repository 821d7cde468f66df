"""The kernels' exps against float64: the scalar one (candidate weights, the
tokens of the block a draw lands in), the 8-lane and 16-lane vector ones
(hot sets, block rescaling) and the block-mass one (the row pass), on the
target the module was built for; and (slow) the same checks plus logprobs
on a build for baseline x86-64, where the vector code takes its generic,
intrinsic-free path (no AVX-512 vmaxps / vscalefps, no FMA)."""
import os
import platform
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from simple_sampler import _sampling

ROOT = Path(__file__).resolve().parents[1]
FLOOR = np.float32(-87.0)
# Relative error bounds the docs in scalar_math.h state (measured: about
# 8e-8 scalar, 1.6e-7 vector).
SCALAR_BOUND = 2e-7
VECTOR_BOUND = 3e-7


def inputs() -> np.ndarray:
    """A dense sweep of [-100, 0] (every 2^n scaling step and both sides of
    the -87 floor), every float in a neighbourhood of the floor, the edges."""
    sweep = np.linspace(-100.0, 0.0, 2_000_003, dtype=np.float64).astype(np.float32)
    near_floor = (FLOOR + np.arange(-2000, 2001, dtype=np.float32)
                  * np.spacing(FLOOR)).astype(np.float32)
    edges = np.array([0.0, -0.0, -1e-30, -1e-7, -np.log(2) / 2, -np.log(2), -86.99999,
                      -87.0, np.nextafter(np.float32(-87.0), np.float32(-100.0)), -87.33, -87.68,
                      -88.0, -103.0, -149.0, -1e4, -3.4e38, -np.inf], np.float32)
    x = np.concatenate([sweep, near_floor, edges])
    return np.concatenate([x, np.zeros(-x.size % 16, np.float32)])


def exp_paths(x: np.ndarray) -> dict[str, np.ndarray]:
    out = {name: np.full_like(x, np.nan) for name in ("scalar", "vector", "wide", "mass")}
    _sampling._exp_paths(x, out["scalar"], out["vector"], out["wide"], out["mass"])
    return out


def check_exp_paths(paths: dict[str, np.ndarray], x: np.ndarray) -> dict[str, float]:
    """Asserts every documented property; returns each path's max relative error."""
    exact = np.exp(x.astype(np.float64))
    in_range = x >= FLOOR
    errors = {}
    for name, values in paths.items():
        assert np.all(np.isfinite(values)), name
        relative = np.abs(values[in_range].astype(np.float64) / exact[in_range] - 1.0)
        errors[name] = float(relative.max())
        assert errors[name] < (SCALAR_BOUND if name == "scalar" else VECTOR_BOUND), (name, errors)
        assert values[x == 0].min() == 1.0 and values[x == 0].max() == 1.0, name
        below = values[~in_range]
        if name == "mass":
            # Block-mass terms below the floor: at most e^-87, never negative.
            assert below.min() >= 0.0 and below.max() <= np.exp(np.float64(FLOOR)) * 1.001
        else:
            assert np.all(below == 0.0), name        # -inf and x < -87: weight exactly 0
        assert np.all(np.diff(values[:2_000_003]) >= -values[1:2_000_003] * 1e-6), name
    return errors


def test_every_exp_path_is_within_its_bound_of_float64():
    x = inputs()
    errors = check_exp_paths(exp_paths(x), x)
    assert errors["vector"] == pytest.approx(errors["wide"], rel=0.5)


def test_the_vector_exps_agree_with_each_other_and_the_scalar_one():
    x = inputs()
    paths = exp_paths(x)
    np.testing.assert_array_equal(paths["vector"], paths["wide"])
    in_range = x >= FLOOR
    np.testing.assert_array_equal(paths["mass"][in_range], paths["wide"][in_range])
    np.testing.assert_allclose(paths["vector"], paths["scalar"], rtol=5e-7, atol=0)


def test_the_bench_row_mass_is_the_float64_mass():
    """_sampling.row_mass, the exp floor of `bench kernels` (the row pass
    itself, at T = 1): every row's softmax mass in float32 and bfloat16
    within float rounding of float64's: peaked, -inf, shifted and flat
    (N(0, 0.02)) rows; widths with a partial last block, with an odd count
    of whole blocks (the pass's last block unpaired) and of one block."""
    import ml_dtypes

    from simple_sampler.sampling import kernel_rows

    rng = np.random.default_rng(5)
    for vocab in (64 * 40 + 17, 64 * 41, 64):
        rows = (3.0 * rng.standard_normal((5, vocab))).astype(np.float32)
        rows[1, rng.integers(0, vocab, vocab // 8)] = -np.inf
        rows[2] -= 150.0
        rows[3] = 0.02 * rng.standard_normal(vocab)
        for dtype in (np.float32, ml_dtypes.bfloat16):
            stored = rows.astype(dtype)
            masses = np.full(len(rows), np.nan)
            _sampling.row_mass(*kernel_rows(stored), masses)
            exact = stored.astype(np.float64)
            exact = np.exp(exact - exact.max(axis=1, keepdims=True)).sum(axis=1)
            np.testing.assert_allclose(masses, exact, rtol=1e-6, err_msg=f"{vocab} {dtype}")
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        _sampling.row_mass(*kernel_rows(rows.astype(np.float16)), masses)


GENERIC_CHECK = textwrap.dedent("""
    import sys
    sys.path[:0] = [sys.argv[1], sys.argv[2]]
    from simple_sampler import _sampling
    assert _sampling.__file__.startswith(sys.argv[1]), _sampling.__file__
    import test_exp
    x = test_exp.inputs()
    print(test_exp.check_exp_paths(test_exp.exp_paths(x), x))
    test_exp.check_logprobs_against_float64()
    test_exp.check_nan_found_by_the_mass_pass()
""")


def check_logprobs_against_float64():
    """Untruncated rows with logprobs, in all three dtypes: the chosen token's
    logprob (the row pass's block masses, rescaled) within 1e-5 of float64."""
    import ml_dtypes

    from simple_sampler.params import SamplingBatch, SamplingParams
    from simple_sampler.reference import log_softmax
    from simple_sampler.sampling import sample

    rng = np.random.default_rng(16)
    vocab = 5000                           # not a multiple of the 64-column block
    rows = (4.0 * rng.standard_normal((12, vocab))).astype(np.float32)
    rows[1, rng.integers(0, vocab, 400)] = -np.inf
    rows[2, :] = rows[2, :] - 200.0        # far below zero: block masses from tiny terms
    rows[3, 64:128] = -np.inf              # a whole banned block
    rows[4, :] = -90.0 + 0.001 * rows[4, :]
    rows[4, 7] = 0.0                       # one token 90 above the rest (below e^-87)
    temperatures = [1.0, 0.8, 1.0, 1.3, 1.0, 0.5, 1.0, 2.0, 1.0, 0.7, 1.0, 1.0]
    batch = SamplingBatch.from_params([SamplingParams(temperature=t, seed=r)
                                       for r, t in enumerate(temperatures)])
    for dtype in (np.float32, np.float16, ml_dtypes.bfloat16):
        stored = rows.astype(dtype)
        out = sample(stored, batch, num_threads=1)
        for r, t in enumerate(temperatures):
            expected = log_softmax(stored[r].astype(np.float64) / np.float32(t))
            token = out.token_ids[r]
            assert np.isfinite(expected[token]), (dtype, r)
            assert abs(out.logprobs[r] - expected[token]) < 1e-5, (dtype, r)


def test_logprobs_match_float64():
    check_logprobs_against_float64()


def check_nan_found_by_the_mass_pass():
    """Rows whose pass computes block masses (untruncated, top_p alone,
    logprobs) report the first NaN's column wherever it sits: among finite
    logits (AVX-512 builds find it through the block's mass), in a block
    otherwise -inf or +inf, in a block of NaNs only, in a partial last block."""
    import ml_dtypes

    from simple_sampler.params import SamplingParams
    from simple_sampler.sampling import sample_requests

    vocab = 64 * 6 + 10
    placements = {"finite": ([200], {}), "with -inf": ([130], {128: 192}),
                  "with +inf": ([70], {64: 128}), "all NaN": ([256], {}),
                  "last block": ([390], {})}
    for name, (columns, filled) in placements.items():
        row = np.linspace(-3.0, 2.0, vocab).astype(np.float32)
        for start, end in filled.items():
            row[start:end] = -np.inf if name == "with -inf" else row[start:end]
            if name == "with +inf":
                row[start + 20] = np.inf
        if name == "all NaN":
            row[256:320] = np.nan
        row[columns] = np.nan
        for dtype in (np.float32, np.float16, ml_dtypes.bfloat16):
            for params, want in ((SamplingParams(), False), (SamplingParams(top_p=0.9), False),
                                 (SamplingParams(temperature=0.7), True)):
                try:
                    sample_requests(row[None].astype(dtype), [params], num_threads=1,
                                    return_logprobs=want)
                except ValueError as error:
                    # The NaN comes first in every row (the +inf is at column 84).
                    assert f"NaN; found at column {min(columns)}" in str(error), (name, error)
                else:
                    raise AssertionError(f"no error for a NaN ({name}, {dtype})")


def test_nan_is_found_by_the_mass_pass():
    check_nan_found_by_the_mass_pass()


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() != "x86_64", reason="baseline x86-64 build")
def test_the_generic_build_meets_the_same_bounds(tmp_path):
    """SIMPLE_SAMPLER_MARCH=x86-64 (SSE2 only): the vector exps compile to
    their generic lane code; the same bounds and logprobs hold."""
    env = {**os.environ, "SIMPLE_SAMPLER_MARCH": "x86-64"}
    build = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"),
         "--build-temp", str(tmp_path / "tmp"), "--force"],
        cwd=ROOT, env=env, capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    # The package's Python beside the generic module, first on the path.
    shutil.copytree(ROOT / "src" / "simple_sampler", tmp_path / "lib" / "simple_sampler",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"), dirs_exist_ok=True)
    assert len(list((tmp_path / "lib" / "simple_sampler").glob("_sampling*.so"))) == 1
    check = subprocess.run([sys.executable, "-c", GENERIC_CHECK, str(tmp_path / "lib"),
                            str(Path(__file__).parent)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr[-4000:]
