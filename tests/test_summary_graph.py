"""``serving.summary_graph``: what a CUDA graph replays is ``hot_first.summarize``
on padded inputs; here, on the CPU, a padded step (rows rounded up to their
bucket, touched keys padded to a capacity) is checked to give the step's own
compact rows, those of ``hot_first_summary``. The capture and replay need a
GPU: ``bench summary-gpu`` checks the graphed rows there (docs/results/
gpu-2026-11-27b.md)."""
import numpy as np
import pytest
import torch

from simple_sampler.handoff import host_arrays
from simple_sampler.serving.hot_first import hot_first_summary, hot_set_on, step_inputs, summarize
from simple_sampler.serving.summary_graph import (GraphedSummary, own_rows, padded_inputs,
                                                  padded_keys, row_bucket)


def test_row_buckets_are_four_per_doubling_and_never_smaller():
    assert [row_bucket(b) for b in (1, 8, 9, 13, 17, 33, 49, 65, 100, 129, 200, 257)] == [
        1, 8, 10, 14, 20, 40, 56, 80, 112, 160, 224, 320]
    assert len({row_bucket(b) for b in range(129, 257)}) == 4
    for size in range(1, 1025):
        assert size <= row_bucket(size) <= max(8, size * 1.25)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cold_top", [0, 5])
def test_a_padded_step_gives_the_steps_own_compact_rows(dtype, cold_top):
    rng = np.random.default_rng(3)
    size, vocab = 13, 2 * 1024 + 300
    logits = torch.from_numpy(rng.normal(0, 2, (size, vocab)).astype(np.float32)).to(dtype)
    hot_ids = np.sort(rng.choice(vocab, 200, replace=False)).astype(np.int32)
    outside = np.setdiff1d(np.arange(vocab), hot_ids)
    lists = [np.sort(rng.choice(outside, int(rng.integers(0, 6)), replace=False))
             for _ in range(size)]
    offsets = np.r_[0, np.cumsum([len(ids) for ids in lists])]
    ids = np.concatenate(lists)
    temperature = rng.choice([0.0, 0.7, 1.0, 1.3], size)
    tops = np.where(rng.random(size) < 0.5, cold_top, 0)
    draws = np.where(rng.random(size) < 0.7, rng.random(size), np.nan)
    expected = hot_first_summary(logits, hot_ids, offsets, ids, temperature, tops, draws).cpu()

    inputs, most = step_inputs(size, vocab, offsets, ids, temperature, tops, draws)
    rows = row_bucket(size)
    assert rows > size  # the case: rows padded
    offsets_p, keys, count, inv_t, uniforms, tops_p = padded_inputs(inputs, rows)
    keys = padded_keys(keys, 256, int(hot_ids[0]))
    padded = torch.zeros((rows, vocab), dtype=dtype)
    padded[:size] = logits
    hot, handed = hot_set_on(torch.device("cpu"), hot_ids, vocab)
    out = summarize(padded, hot, handed, most, True,
                    *(torch.from_numpy(np.ascontiguousarray(a))
                      for a in (offsets_p, keys, count, inv_t, uniforms, tops_p)))
    got = own_rows(dict(zip(out, host_arrays(list(out.values())))), size)
    for name, value in vars(expected).items():
        np.testing.assert_array_equal(getattr(got, name), value, err_msg=name)


def test_off_a_gpu_the_graphed_summary_is_the_eager_one():
    rng = np.random.default_rng(4)
    logits = torch.from_numpy(rng.normal(0, 2, (6, 3000)).astype(np.float32))
    hot_ids = np.arange(0, 3000, 7, dtype=np.int32)
    arguments = (hot_ids, np.zeros(7, np.int64), np.zeros(0, np.int64), np.ones(6), 0,
                 rng.random(6))
    graphs = GraphedSummary()
    got, expected = graphs(logits, *arguments), hot_first_summary(logits, *arguments).cpu()
    assert not graphs.graphs and not graphs.refused
    for name, value in vars(expected).items():
        np.testing.assert_array_equal(getattr(got, name), value, err_msg=name)
