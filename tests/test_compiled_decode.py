"""The compiled decode step (``serving/compiled_decode.py``,
``StaticEngine(..., compile_decode=True)``) against the eager static step on
tiny random-weight Llama and Qwen2 models, on the CPU (inductor's C++
backend): the fused weights' projections, logits within float32 rounding and
the same greedy tokens over steps that change bucket, a compile that fails.
The CUDA-graph test skips without a GPU (none here: that path has not run)."""
import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from fakes import tiny
from simple_sampler.serving import compiled_decode
from simple_sampler.serving.compiled_decode import CompileDecodeError, LayerWeights
from simple_sampler.serving.static_decode import StaticEngine
from test_static_decode import CUDA, run_schedule

TOLERANCE = 1e-5  # max abs logit difference, float32: the same arithmetic, fused


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_fused_weights_give_the_same_projections(family):
    model = tiny(family)
    layer = model.model.layers[1]
    attention, mlp = layer.self_attn, layer.mlp
    fused = LayerWeights.fuse(layer)
    x = torch.randn(5, model.config.hidden_size)
    with torch.no_grad():
        qkv = torch.nn.functional.linear(x, fused.qkv, fused.qkv_bias)
        gate_up = torch.nn.functional.linear(x, fused.gate_up, fused.gate_up_bias)
        separate = torch.cat([attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)], -1)
        assert torch.allclose(qkv, separate, atol=1e-6)
        assert torch.allclose(gate_up, torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], -1),
                              atol=1e-6)
    assert (fused.qkv_bias is not None) == (family == "qwen2")  # Qwen2's q/k/v biases
    assert fused.qkv.data_ptr() != attention.q_proj.weight.data_ptr()  # a copy: model untouched
    assert fused.out is attention.o_proj.weight and fused.down is mlp.down_proj.weight


def unique_graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_compiled_step_matches_the_eager_step(family):
    """Greedy decoding through both engines side by side, sequences joining
    and leaving so that the decode steps run buckets 8, 9, 1, 9 and 8: logits
    within float32 rounding, the same tokens, the same cache; after the first
    decode step no bucket above 1 compiles again (one graph for every such
    bucket and every layer)."""
    model = tiny(family)
    eager = StaticEngine(model, max_batch_size=9, max_context=32)
    compiled = StaticEngine(model, max_batch_size=9, max_context=32, compile_decode=True)
    prompts = {key: [key + 1, key + 2, 3][: 1 + key % 3] for key in range(9)}
    # (joining, leaving, stepped); a joining sequence's first step is its eager prefill
    schedule = [(range(5), [], range(5)), ([], [], [4, 2]), (range(5, 9), [], range(5, 9)),
                ([], [], range(9)), ([], [], [0]), ([], [3], [8, 0, 5]), ([], [8], [1, 2, 4])]
    worst, recompiled = 0.0, []
    for index, (joining, leaving, stepped) in enumerate(schedule):
        for engine in (eager, compiled):
            for key in joining:
                engine.add(key, prompts[key])
            for key in leaving:
                engine.release(key)
        stepped = list(stepped)
        before = unique_graphs()
        expected, got = eager.step(stepped), compiled.step(stepped)
        if index > 1 and stepped != [0]:  # prefills and buckets 9, 9, 8 after the first 8
            recompiled += [unique_graphs() - before]
        worst = max(worst, (expected - got).abs().max().item())
        tokens = expected.argmax(dim=-1).tolist()
        assert got.argmax(dim=-1).tolist() == tokens, stepped
        for engine in (eager, compiled):
            engine.append(stepped, tokens)
    assert worst < TOLERANCE, worst
    assert torch.allclose(eager.keys, compiled.keys, atol=TOLERANCE)
    assert torch.allclose(eager.values, compiled.values, atol=TOLERANCE)
    assert recompiled == [0] * 4, recompiled


def broken_compiled_step():
    """compiled_decode.compiled_step's functions over a backend that fails
    as inductor does without a C++ compiler (fresh code objects: dynamo's
    cache holds the real ones)."""
    def broken(graph, example_inputs):
        raise RuntimeError("no C++ compiler here")

    wrap = lambda function: torch.compile(  # noqa: E731
        lambda *args: function(*args), backend=broken, fullgraph=True)
    return (wrap(compiled_decode.decode_inputs), wrap(compiled_decode.decode_layer),
            wrap(compiled_decode.decode_head))


def test_a_compile_that_fails_names_the_option_and_its_cause(monkeypatch):
    monkeypatch.setattr(compiled_decode, "compiled_step", broken_compiled_step)
    engine = StaticEngine(tiny("llama"), max_batch_size=8, max_context=16, compile_decode=True)
    engine.add("x", [1, 2])
    engine.step(["x"])  # the prompt: eager prefill
    engine.append(["x"], [3])
    with pytest.raises(CompileDecodeError,
                       match="compile_decode: torch.compile could not build the decode step "
                             r"\(BackendCompilerFailed: RuntimeError: no C\+\+ compiler here\); run without "
                             "compile_decode"):
        engine.step(["x"])


def test_the_compiled_step_covers_swiglu_only():
    model = tiny("llama")
    model.config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="compile_decode covers SwiGLU"):
        StaticEngine(model, max_batch_size=2, max_context=8, compile_decode=True)


@CUDA
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_cuda_graphs_replay_the_compiled_step(family):
    """On a GPU, float32: the compiled step is captured and replayed per
    bucket, and the tokens equal the eager Hugging Face forward's."""
    model = tiny(family, device="cuda")
    engine = StaticEngine(model, max_batch_size=9, max_context=32, compile_decode=True)
    assert engine.graphs.graphed and not engine.graphs.graphs
    run_schedule(engine, model, tolerance=1e-3)
    assert engine.graphs.graphs and set(engine.graphs.graphs) <= {(0, 1), (0, 8), (0, 9)}


def test_warm_up_compiles_every_step_before_the_first_request():
    """``warm_up`` on the CPU runs each window's buckets once through the
    compiled step: the decode steps after it compile nothing, and their
    rows are still the full recompute's (warm_up wrote only positions no
    query has read)."""
    torch._dynamo.reset()  # the earlier tests' graphs of these shapes would hide a compile
    model = tiny("llama")
    engine = StaticEngine(model, max_batch_size=9, max_context=32, compile_decode=True)
    assert engine.warm_up() == len(engine.graphs.inputs) == 3  # buckets 1, 8 and 9
    before = unique_graphs()
    run_schedule(engine, model)
    assert unique_graphs() == before
    assert StaticEngine(model, max_batch_size=9, max_context=32).warm_up() == 0  # eager: nothing


def tiny_bench_model():
    """(model, codec, label) for serve_gpu.run: a one-layer Llama over the
    fake tokenizer's vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fakes import VOCAB, FakeTokenizer
    from simple_sampler.serving.text import TextCodec

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)).eval()
    return model, TextCodec(FakeTokenizer()), "tiny"


@pytest.mark.parametrize("broken", [None, "compiling", "running"])
def test_the_gpu_bench_runs_both_decode_steps(monkeypatch, broken):
    """bench serve-gpu with --decode-step eager compiled on the CPU (figures
    that mean nothing): forward_only and gpu_inline on both steps, ratios
    within a step; a compiled step that fails, compiling or running, leaves
    the eager rows and says why."""
    from simple_sampler.bench.serve_gpu import measuring as serve_gpu
    from simple_sampler.shvs import HotVocab

    # the shipped profile's hot set needs SmolLM2's vocabulary; no mode here reads it
    monkeypatch.setattr(serve_gpu, "hot_set", lambda vocab: HotVocab(np.arange(3), vocab))
    if broken == "compiling":
        monkeypatch.setattr(compiled_decode, "compiled_step", broken_compiled_step)
    if broken == "running":
        def fails(*args, **kwargs):
            raise RuntimeError("CUDA error: an illegal memory access")
        monkeypatch.setattr(compiled_decode.CompiledForward, "decode", fails)
    modes = [m for m in serve_gpu.MODES if m[0] == "gpu_inline"]
    report = serve_gpu.run(dtype="float32", batches=[8, 16], warmup=2, measure=4, modes=modes,
                           device="cpu", loaded=tiny_bench_model(),
                           decode_steps=("eager", "compiled"))
    results = {(r["mode"], r["batch"]): r for r in report["results"]}
    expected = {(mode, b) for mode in ("forward_only", "gpu_inline") for b in (8, 16)}
    if broken:
        cause = {"compiling": "compile_decode: torch.compile could not build the decode step",
                 "running": "RuntimeError: CUDA error: an illegal memory access"}[broken]
        assert set(results) == expected
        assert report["errors"]["compiled"].startswith(cause)
        assert f"compiled decode step FAILED, its rows left out: {cause}" \
            in serve_gpu.format_report(report)
        return
    assert set(results) == expected | {(f"{m}_compiled", b) for m, b in expected}
    assert report["errors"] == {}
    for (mode, batch), r in results.items():
        step = "compiled" if mode.endswith("_compiled") else "eager"
        assert r["decode_step"] == step and r["tokens_per_s"] > 0
        bound = results[(serve_gpu.step_label("forward_only", step), batch)]
        assert r["vs_forward_only"] == pytest.approx(r["tokens_per_s"] / bound["tokens_per_s"])
    compiled = results[("forward_only_compiled", 8)]
    assert compiled["setup_s"] > 0 and results[("forward_only_compiled", 16)]["graphs_compiled"] == 0
    assert "forward_only_compiled" in serve_gpu.format_report(report)


def test_serve_takes_the_option_for_the_static_engine_only(tmp_path):
    """``serve --engine static --compile-decode``: the registry's builder
    passes it on (construction only: the compile waits for the first
    step); another engine refuses it."""
    import json

    from simple_sampler.serving.compiled_decode import CompiledForward
    from simple_sampler.serving.engines import ENGINES
    from simple_sampler.settings import LlmSettings

    config = tiny("llama").config.to_dict()
    (tmp_path / "config.json").write_text(json.dumps(config))
    settings = LlmSettings(engine="static", model_config=str(tmp_path), compile_decode=True,
                           engine_max_batch_size=4, max_context=16).validate()
    engine = ENGINES["static"].build(settings)
    assert isinstance(engine.static, CompiledForward)
    assert ENGINES["static"].describe(settings).startswith("compiled static decode step on cpu")
    with pytest.raises(ValueError, match="compile_decode applies to engine static only"):
        LlmSettings(compile_decode=True).validate()


def test_the_compiled_step_over_a_lanes_window_matches_the_eager_step():
    """Two lanes' windows (``split_slots``): the second window's steps read
    the cache from its first slot on; the same logits and cache as the
    eager step's, and that window compiles no graph of its own."""
    model = tiny("llama")
    eager = StaticEngine(model, max_batch_size=16, max_context=32)
    compiled = StaticEngine(model, max_batch_size=16, max_context=32, compile_decode=True)
    for engine in (eager, compiled):
        engine.split_slots(2)
        for key in range(6):
            engine.add(key, [key + 1, 2], lane=key % 2)
    worst, graphs = 0.0, []
    for index, stepped in enumerate([range(6), [0, 2, 4], [1, 3, 5], [5, 1], [0, 2, 4], [3]]):
        stepped = list(stepped)
        before = unique_graphs()
        expected, got = eager.step(stepped), compiled.step(stepped)
        if index > 0:  # the first step is the prompts' (both windows): eager prefill
            graphs.append(unique_graphs() - before)
        worst = max(worst, (expected - got).abs().max().item())
        tokens = expected.argmax(dim=-1).tolist()
        assert got.argmax(dim=-1).tolist() == tokens, stepped
        for engine in (eager, compiled):
            engine.append(stepped, tokens)
    assert [eager.sequences[k].slot for k in range(6)] == [0, 8, 1, 9, 2, 10]
    assert worst < TOLERANCE, worst
    assert torch.allclose(eager.keys, compiled.keys, atol=TOLERANCE)
    assert graphs[1:] == [0] * 4, graphs  # window 1 first at the second decode step
