"""The static engine's host side of a decode step: a whole bucket stepped in
slot order takes the forward's rows as they are (no gather), and they are
the rows the gather gives in any other order; and ``bench engine-step``,
which times that host side, runs on the CPU."""
import torch

from fakes import reference_logits, tiny
from simple_sampler.serving.static_decode import StaticEngine


def test_a_whole_bucket_in_slot_order_is_the_same_rows_as_any_order():
    model = tiny("llama")
    engine = StaticEngine(model, max_batch_size=8, max_context=16)
    ids = list(range(8))
    prompts = {i: [i + 1, 2 * i + 3] for i in ids}
    for i in ids:
        engine.add(i, prompts[i])
    first = engine.step(ids)  # every row a prompt: one forward, its output as it is
    tokens = first.argmax(dim=-1).tolist()
    engine.append(ids, tokens)
    in_order = engine.step(ids)  # slots 0 .. 7 of bucket 8: no gather
    for i in ids:
        expected = reference_logits(model, prompts[i] + [tokens[i]])
        assert torch.allclose(in_order[i], expected.to(in_order.dtype), atol=1e-4), i
    # the same positions again, the rows asked for in reverse: gathered
    again = StaticEngine(model, max_batch_size=8, max_context=16)
    for i in ids:
        again.add(i, prompts[i])
    again.step(ids)
    again.append(ids, tokens)
    reverse = again.step(ids[::-1])
    assert torch.allclose(reverse.flip(0), in_order, atol=1e-6)


def test_the_engine_step_bench_runs_on_the_cpu():
    from simple_sampler.bench.engine_step import measuring as engine_step

    report = engine_step.run(batches=(8,), vocab=512, steps=2, rounds=1)
    [row] = report["rows"]
    assert report["vocab"] == 512 and report["layers"] == 1 and row["batch"] == 8
    assert row["replay_ms"] > 0 and row["step_ms"] > 0
    assert abs(row["host_ms"] - (row["step_ms"] - row["replay_ms"])) < 1e-9
    assert 0 < row["step_cpu_ms"]  # on the CPU the eager forward is the thread's own work
    assert "CUT DOWN" in engine_step.format_table(report)
