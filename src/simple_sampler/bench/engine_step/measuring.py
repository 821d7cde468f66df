"""`simple-sampler bench engine-step`: what a data-plane engine's ``step``
costs the host beyond its forward.

A decode step of the static engine (``serving/static_decode.py``) is one
replay of its bucket's forward; everything else ``step`` and ``append`` do
(bookkeeping under the engine's locks, the bucket's inputs built and copied
in, the rows gathered, on a GPU the device-to-host copy) is host work that
the GPU waits on. This bench times, alternately and over the same engine,
the replay alone and a whole decode step (``step``, then ``append`` of a
fixed token per row: no argmax or sampler on the host), and reports their
difference: the engine's own host time per step.

The model is a SHIPPED SHAPE CUT DOWN: its vocabulary and family, with
``layers`` layers and widths scaled to ``hidden`` (random weights), so that
on a CPU the forward is small beside the host work it is compared with
(there, a smaller ``vocab`` too: the output layer's product grows with it). On
a GPU (``device cuda``) the replay is a CUDA graph's; on a CPU an eager
forward.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from ...host_copy import sleep_until_done
from ...serving.static_decode import (StaticEngine, config_path, model_from_config,
                                      synchronize)

#: the bucket sizes a GPU step runs at B = 64 and 256 (bench serve-gpu's)
BATCHES = (64, 256)
PROMPT_TOKENS = 4


def cut_config(model_config: str, layers: int, hidden: int, vocab: int | None,
               folder: Path) -> Path:
    """A config.json of `model_config`'s family and vocabulary (or `vocab`
    tokens), `layers` layers, widths scaled to `hidden` (head_dim 16, at
    least 2 query heads per key/value head)."""
    config = json.loads(config_path(model_config).read_text())
    if vocab is not None:
        config["vocab_size"] = vocab
    heads = max(2, hidden // 16)
    config.update(num_hidden_layers=layers, hidden_size=hidden, head_dim=hidden // heads,
                  num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                  intermediate_size=2 * hidden, tie_word_embeddings=True)
    path = folder / "config.json"
    path.write_text(json.dumps(config))
    return path


def _timed(function, steps: int, device: torch.device) -> tuple[float, float]:
    """(wall ms, this thread's CPU ms) per call of `function` over `steps`
    calls, the device waited for asleep (``host_copy.sleep_until_done``), so
    that the CPU counts the calls' own waits and work, not the last wait's
    spin."""
    synchronize(device)
    start, cpu = time.perf_counter(), time.thread_time()
    for _ in range(steps):
        function()
    sleep_until_done(device)
    return ((time.perf_counter() - start) / steps * 1e3,
            (time.thread_time() - cpu) / steps * 1e3)


def measure_batch(engine: StaticEngine, batch: int, steps: int, rounds: int) -> dict:
    """Replay alone against a whole step at `batch` rows, `rounds`
    alternated rounds of `steps` calls each; the medians."""
    ids = list(range(batch))
    for seq_id in ids:
        engine.add(seq_id, [1 + seq_id % 7] * PROMPT_TOKENS)
    engine.step(ids)  # the prefill
    tokens = [3] * batch
    engine.append(ids, tokens)
    bucket = engine.graphs.bucket(batch)

    def whole_step():
        engine.step(ids)
        engine.append(ids, tokens)

    def one_round() -> tuple[float, float]:
        return (_timed(lambda: engine.graphs.replay(bucket), steps, engine.device),
                _timed(whole_step, steps, engine.device))

    one_round()  # not counted: first uses (the capture, on a GPU)
    replay, step = zip(*(one_round() for _ in range(rounds)))
    for seq_id in ids:
        engine.release(seq_id)
    replay_ms = statistics.median(wall for wall, _ in replay)
    step_ms = statistics.median(wall for wall, _ in step)
    return {"batch": batch, "replay_ms": replay_ms, "step_ms": step_ms,
            "host_ms": step_ms - replay_ms,
            "step_cpu_ms": statistics.median(cpu for _, cpu in step)}


def run(model_config: str = "llama-3.2-1b", layers: int = 1, hidden: int = 64,
        vocab: int | None = None, batches=BATCHES, steps: int = 20, rounds: int = 3, device: str = "cpu",
        dtype: str = "float32") -> dict:
    """Every B's row (``measure_batch``) over one engine of the cut shape."""
    import tempfile

    from ...serving.device import resolve

    device, torch_dtype = resolve(device, dtype)
    with tempfile.TemporaryDirectory() as folder:
        model = model_from_config(cut_config(model_config, layers, hidden, vocab, Path(folder)),
                                  device, torch_dtype)
    context = PROMPT_TOKENS + (rounds + 1) * steps + 8
    engine = StaticEngine(model, max_batch_size=max(batches), max_context=context)
    rows = [measure_batch(engine, batch, steps, rounds) for batch in batches]
    return {"model_config": model_config, "layers": layers, "hidden": hidden,
            "vocab": engine.vocab_size, "device": str(device), "dtype": dtype,
            "steps": steps, "rounds": rounds, "threads": torch.get_num_threads(),
            "rows": rows}


def format_table(report: dict) -> str:
    lines = [f"static engine on {report['device']}, {report['model_config']} CUT DOWN to "
             f"{report['layers']} layer(s) of width {report['hidden']} (V = "
             f"{report['vocab']:,}, random weights, {report['dtype']}); medians of "
             f"{report['rounds']} alternated rounds of {report['steps']} steps",
             f"{'B':>5} {'replay ms':>10} {'step ms':>10} {'host ms':>10} {'step cpu ms':>12}"]
    lines += [f"{r['batch']:>5} {r['replay_ms']:>10.3f} {r['step_ms']:>10.3f} "
              f"{r['host_ms']:>10.3f} {r['step_cpu_ms']:>12.3f}" for r in report["rows"]]
    lines.append("host ms = step ms - replay ms: the engine's own work per decode step "
                 "(step + append of a fixed token per row) beyond its forward; step cpu ms: "
                 "the stepping thread's CPU per step (its waits for the device asleep: "
                 "about host ms; spinning, they would make it step ms)")
    return "\n".join(lines)
