"""The static decode step (``serving/static_decode.py``) against the Hugging
Face eager forward (full recompute, no cache) on tiny random-weight Llama and
Qwen2 models: the same greedy tokens, logits within float32 rounding, as
sequences join, leave and reuse slots. The CUDA-graph tests skip without a
GPU (none here: that path has not run)."""
import pytest
import torch

from fakes import reference_logits, tiny
from simple_sampler.serving.static_decode import (SHIPPED_CONFIGS, StaticEngine, buckets_for,
                                                  config_path, model_from_config)

TOLERANCE = 1e-4  # max abs logit difference, float32
CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="no CUDA GPU here (the CUDA-graph path is unrun)")


def run_schedule(engine, model, tolerance=TOLERANCE):
    """Greedy decoding under joins, leaves, subsets and slot reuse; every
    row's logits against the full recompute, every token its argmax."""
    prompts = {"a": [1, 2, 3, 4, 5], "b": [7, 8], "c": [9], "d": [11, 12, 13, 14],
               "e": [20, 21, 22]}
    tokens = {key: list(p) for key, p in prompts.items()}
    schedule = [(["a", "b"], [], ["a", "b"]), ([], [], ["b", "a"]), (["c"], [], ["c", "a"]),
                ([], [], ["a", "b", "c"]), ([], ["b"], ["a", "c"]), (["d"], [], ["d", "c", "a"]),
                (["e"], ["a"], ["e", "d"]), ([], [], ["c", "d", "e"]), ([], [], ["e", "c", "d"])]
    worst, steps = 0.0, 0
    for joining, leaving, subset in schedule:
        for key in joining:
            engine.add(key, prompts[key])
        for key in leaving:
            engine.release(key)
        logits = engine.step(subset)
        chosen = logits.argmax(dim=-1).tolist()
        for row, key in enumerate(subset):
            expected = reference_logits(model, tokens[key])
            worst = max(worst, (logits[row].to(expected.device) - expected).abs().max().item())
            assert chosen[row] == int(expected.argmax()), (key, steps)
        engine.append(subset, chosen)
        for key, token in zip(subset, chosen):
            tokens[key].append(token)
        steps += 1
    assert worst < tolerance, worst


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_static_decode_matches_the_hugging_face_forward(family):
    model = tiny(family)
    run_schedule(StaticEngine(model, max_batch_size=9, max_context=32), model)


def test_buckets_and_the_contract_it_keeps():
    assert buckets_for(256) == (1, 8, 16, 32, 64, 128, 256)
    assert buckets_for(20) == (1, 8, 16, 20) and buckets_for(1) == (1,)
    model = tiny("llama")
    engine = StaticEngine(model, max_batch_size=9, max_context=8)
    assert engine.graphs.bucket(9) == 9 and engine.graphs.bucket(2) == 8
    with pytest.raises(ValueError, match="batch_invariant runs with TorchEngine on the CPU"):
        StaticEngine(model, batch_invariant=True)
    engine.add("x", [1, 2])
    engine.step(["x"])
    with pytest.raises(ValueError, match="no pending token"):
        engine.step(["x"])
    for _ in range(6):  # to max_context: 2 + 6 tokens
        engine.append(["x"], [3])
        engine.step(["x"])
    with pytest.raises(ValueError, match="max_context"):
        engine.append(["x"], [3])


def test_other_families_are_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    model.config.num_key_value_heads = 2  # what TorchEngine reads
    with pytest.raises(ValueError, match="covers llama, qwen2 models, not 'gpt2'"):
        StaticEngine(model, max_batch_size=2, max_context=8)


@pytest.mark.parametrize("name, vocab, layers", [
    ("smollm2-135m", 49_152, 30), ("qwen2.5-0.5b", 151_936, 24), ("llama-3.2-1b", 128_256, 16),
    ("llama-3.1-8b", 128_256, 32)])
def test_the_shipped_configs_name_the_public_shapes(name, vocab, layers):
    import json

    assert name in SHIPPED_CONFIGS
    config = json.loads(config_path(name).read_text())
    assert config["vocab_size"] == vocab and config["num_hidden_layers"] == layers
    assert config["model_type"] in ("llama", "qwen2")


def test_a_config_builds_a_random_model_with_its_shapes(tmp_path):
    import json

    config = json.loads(config_path("smollm2-135m").read_text())
    config.update(num_hidden_layers=1, hidden_size=64, intermediate_size=64,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = model_from_config(tmp_path)
    again = model_from_config(tmp_path / "config.json")
    assert model.config.vocab_size == 300 and not model.training
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    with pytest.raises(FileNotFoundError, match="model config must be one of smollm2-135m"):
        config_path(tmp_path / "nothing")


@CUDA
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_cuda_graphs_replay_the_eager_forwards_tokens(family):
    """On a GPU, float32: the graphs are captured and replayed, and the
    tokens equal the eager Hugging Face forward's."""
    model = tiny(family, device="cuda")
    engine = StaticEngine(model, max_batch_size=9, max_context=32)
    assert engine.graphs.graphed and not engine.graphs.graphs  # captured at first use
    run_schedule(engine, model, tolerance=1e-3)
    assert engine.graphs.graphs and set(engine.graphs.graphs) <= {(0, 1), (0, 8), (0, 9)}


@CUDA
def test_cuda_warm_up_captures_every_windows_graphs_before_any_step():
    """After ``split_slots(2)``, ``warm_up`` captures each window's buckets
    (1 and 8 of 8 slots each); the steps after it capture nothing more, and
    their tokens are still the eager forward's."""
    model = tiny("llama", device="cuda")
    engine = StaticEngine(model, max_batch_size=16, max_context=32)
    engine.split_slots(2)
    assert engine.warm_up() == 4
    captured = dict(engine.graphs.graphs)
    assert set(captured) == {(0, 1), (0, 8), (8, 1), (8, 8)}
    assert engine.warm_up() == 0  # nothing left to capture
    run_schedule(engine, model, tolerance=1e-3)
    assert engine.graphs.graphs == captured


@CUDA
def test_cuda_seeded_inline_draws_repeat_on_the_static_engine():
    import numpy as np

    from simple_sampler.params import SamplingBatch, SamplingParams
    from simple_sampler.serving.inline import sample_torch

    model = tiny("llama", torch.bfloat16, "cuda")
    runs = []
    for _ in range(2):
        engine = StaticEngine(model, max_batch_size=8, max_context=32, host_logits=False)
        ids = list(range(8))
        for i in ids:
            engine.add(i, [i + 1, i + 2])
        drawn = []
        for step in range(6):
            rows = engine.step(ids)
            assert rows.device.type == "cuda"
            batch = SamplingBatch.from_params(
                [SamplingParams(seed=i, top_p=0.9) for i in ids], steps=[step] * 8)
            tokens, _ = sample_torch(rows, batch)
            engine.append(ids, tokens.tolist())
            drawn.append(tokens)
        runs.append(np.stack(drawn))
    assert (runs[0] == runs[1]).all()


def test_forward_only_replays_the_greedy_tokens_and_counts_the_bytes_it_reads():
    """forward_only's loop feeds each argmax back on the device: its cache
    ends as greedy decoding through the engine leaves it."""
    from simple_sampler.serving.static_decode import bytes_per_step, forward_only_ms

    model = tiny("llama")
    engines = [StaticEngine(model, max_batch_size=8, max_context=16) for _ in range(2)]
    ids = list(range(8))
    for engine in engines:
        for i in ids:
            engine.add(i, [i + 1, i + 3, 5])
        engine.append(ids, engine.step(ids).argmax(dim=-1).tolist())
    assert forward_only_ms(engines[0], 5) > 0
    for _ in range(5):
        engines[1].append(ids, engines[1].step(ids).argmax(dim=-1).tolist())
    # positions 3 .. 7 written by both, the same keys
    assert torch.allclose(engines[0].keys[:, :, :, :8], engines[1].keys[:, :, :, :8], atol=1e-5)
    read = bytes_per_step(engines[0], 8)
    params = sum(p.numel() for p in model.parameters()) * 4
    embedding = model.model.embed_tokens.weight.numel() * 4  # untied: the rows' only
    assert read["weights"] == params - embedding + 8 * 64 * 4
    assert read["kv_cache"] == 2 * 2 * 8 * 2 * 16 * 16 * 4  # k+v, layers, rows, heads, C, D
    with pytest.raises(ValueError, match="room for the steps"):  # 8 cached + 9 > 16
        forward_only_ms(engines[1], 9)


@pytest.mark.slow  # SmolLM2's tokenizer and real rows (cached after the first run)
def test_the_gpu_bench_runs_every_cell_on_the_cpu(tmp_path):
    import json

    from simple_sampler.bench.serve_gpu import measuring as serve_gpu

    config = json.loads(config_path("smollm2-135m").read_text())
    config.update(num_hidden_layers=1, hidden_size=32, intermediate_size=32,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    (tmp_path / "config.json").write_text(json.dumps(config))
    # simple_overlap: two lanes, each stepping its own window of the slots
    modes = [m for m in serve_gpu.MODES if m[0] in ("simple", "simple_overlap", "gpu_inline")]
    report = serve_gpu.run(dtype="float32", batches=[8], instances=1, warmup=2, measure=4,
                           top_p=(1.0, 0.95), modes=modes, model_config=str(tmp_path),
                           rows=("flat", "fitted"), device="cpu")
    results = report["results"]
    assert [(r["mode"], r["top_p"]) for r in results[:1]] == [("forward_only", None)]
    assert len(results) == 1 + 3 * 2 * 2
    bound = results[0]
    assert bound["hbm_estimate_ms"] > 0 and bound["vs_hbm_estimate"] > 0
    assert {r["rows"] for r in results[1:]} == {"flat (the model's own rows)",
                                                "fitted: real SmolLM2 rows"}
    for r in results[1:]:
        assert r["tokens_per_s"] > 0 and r["vs_forward_only"] > 0 and r["vs_gpu_inline"] > 0
    assert "RANDOM WEIGHTS" in report["settings"]["model"]
    assert "forward_only" in serve_gpu.format_report(report)


def test_every_lane_gets_a_window_whatever_the_division_leaves():
    """Widths differ by one at most, so that every lane has a window to
    admit into: with ceil-wide windows, 4 slots over 3 lanes made 2."""
    engine = StaticEngine(tiny("llama", device="cpu"), max_batch_size=4, max_context=16)
    engine.split_slots(3)
    assert engine.windows == [range(0, 2), range(2, 3), range(3, 4)]
    assert [engine.free_in_lane(lane) for lane in range(3)] == [2, 1, 1]
    engine.add("last", [1, 2], lane=2)
    assert engine.sequences["last"].slot == 3 and engine.free_in_lane(2) == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_lane_windows_step_their_own_slots_only(device):
    """split_slots(2): each lane's sequences in a window of slots of its own,
    and a lane's step computes its window's bucket, not every slot (on CUDA:
    a graph per window and bucket); the rows are still the full recompute's."""
    model = tiny("llama", device=device)
    tolerance = TOLERANCE if device == "cpu" else 1e-3
    engine = StaticEngine(model, max_batch_size=16, max_context=32)
    engine.split_slots(2)
    assert engine.windows == [range(0, 8), range(8, 16)]
    computed = []
    decode = engine.static.decode
    engine.static.decode = lambda t, p, start=0: computed.append((start, len(t))) or decode(
        t, p, start)
    prompts = {"a": [1, 2, 3], "b": [4], "c": [5, 6], "d": [7, 8, 9, 10], "e": [11]}
    lanes = {"a": 0, "b": 0, "c": 1, "d": 1, "e": 1}
    tokens = {key: list(p) for key, p in prompts.items()}
    for key, prompt in prompts.items():
        engine.add(key, prompt, lane=lanes[key])
    assert [engine.sequences[k].slot for k in prompts] == [0, 1, 8, 9, 10]
    assert (engine.free_in_lane(0), engine.free_in_lane(1)) == (6, 5)
    for subset in (["a", "b"], ["c", "d", "e"], ["e", "c"], ["b"], ["d", "c", "e"], ["a"]):
        logits = engine.step(subset)
        chosen = logits.argmax(dim=-1).tolist()
        for row, key in enumerate(subset):
            expected = reference_logits(model, tokens[key])
            assert (logits[row].to(expected.device) - expected).abs().max().item() < tolerance
        engine.append(subset, chosen)
        for key, token in zip(subset, chosen):
            tokens[key].append(token)
    # decode steps only (prefills are eager): each within one window, 8 rows at most
    assert computed and {start for start, _ in computed} == {0, 8}
    assert all(rows <= 8 for _, rows in computed)
    if engine.graphs.graphed:
        assert {start for start, _ in engine.graphs.graphs} == {0, 8}
    engine.release("c")
    engine.add("f", [3], lane=1)
    assert engine.sequences["f"].slot == 8  # the window's lowest free slot
    with pytest.raises(ValueError, match="one lane's window"):
        engine.step(["a", "f"])
    with pytest.raises(RuntimeError, match="split_slots while sequences hold slots"):
        engine.split_slots(2)
    for key in [f"x{i}" for i in range(5)]:
        engine.add(key, [1], lane=1)
    with pytest.raises(RuntimeError, match="every slot of lane 1's window is taken"):
        engine.add("y", [1], lane=1)
    with pytest.raises(ValueError, match=r"lanes must be in \[1, 16\]"):
        StaticEngine(model, max_batch_size=16, max_context=8).split_slots(17)
