"""The compiled decode step (``serving/compiled_decode.py``,
``StaticEngine(..., compile_decode=True)``) against the eager static step on
tiny random-weight Llama and Qwen2 models, on the CPU (inductor's C++
backend): the fused weights' projections, logits within float32 rounding and
the same greedy tokens over steps that change bucket, a compile that fails.
The CUDA-graph test skips without a GPU (none here: that path has not run)."""
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


def test_a_compile_that_fails_names_the_option_and_its_cause(monkeypatch):
    def broken(graph, example_inputs):
        raise RuntimeError("no C++ compiler here")

    def compiled_step():  # fresh code objects: dynamo's cache holds the real ones
        wrap = lambda function: torch.compile(  # noqa: E731
            lambda *args: function(*args), backend=broken, fullgraph=True)
        return (wrap(compiled_decode.decode_inputs), wrap(compiled_decode.decode_layer),
                wrap(compiled_decode.decode_head))
    monkeypatch.setattr(compiled_decode, "compiled_step", compiled_step)
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
    assert engine.graphs.graphs and set(engine.graphs.graphs) <= {1, 8, 9}
