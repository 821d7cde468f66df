"""The torch and static engines' rows in the model's dtype (bfloat16 and
float16 are not widened to float32): every consumer takes them, and since
the kernels read bfloat16 exactly and widening is exact, the tokens drawn
from bfloat16 rows are the ones drawn from the same rows widened: full rows
through the sampler pool and its shared-memory arena, hot-first rows, and
the in-line torch sampler. The sampler is configured for the engine's dtype
from ``EngineSpec.logits_dtype``, in ``serve`` and in the served GPU bench."""
import numpy as np
import pytest
import torch

from fakes import tiny
from simple_sampler import cli
from simple_sampler.bench.serve_sim.measuring import hot_first_sampler
from simple_sampler.params import SamplingBatch, SamplingParams
from simple_sampler.row_arena import RowArena
from simple_sampler.row_reader import RowReader
from simple_sampler.serving.engines import engine_spec
from simple_sampler.serving.inline import sample_torch
from simple_sampler.serving.static_decode import StaticEngine
from simple_sampler.serving.torch_engine import TorchEngine
from simple_sampler.settings import LlmSettings
from simple_sampler.shvs.hot_vocab import HotVocab
from simple_sampler.triton.sampler_pool import SamplerPool
from simple_sampler.triton.sampler_targets import SamplerTarget
from simple_sampler.triton.sampler_serve import serve_request
from test_torch_hot_first import VOCAB, generate, tiny_model

SEEDED = [SamplingParams(seed=s, temperature=1.0) for s in range(3)] + [
    SamplingParams(seed=7, top_p=0.8, repetition_penalty=1.3),
    SamplingParams(seed=8, top_k=20, temperature=0.7, min_p=0.02),
    SamplingParams(temperature=0.0)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (the graphs' outputs, the host copy)"))])
@pytest.mark.parametrize("engine_class", [TorchEngine, StaticEngine])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_rows_come_in_the_models_dtype(engine_class, dtype, device):
    engine = engine_class(tiny("llama", dtype, device), max_batch_size=4, max_context=16)
    assert engine.logits_dtype == dtype
    engine.add("a", [1, 2, 3])
    engine.add("b", [4])
    prefilled = engine.step(["a", "b"])
    engine.append(["a", "b"], prefilled.float().argmax(dim=-1).tolist())
    engine.add("c", [5, 6])
    for rows in (prefilled, engine.step(["b", "a", "c"])):  # decode and prefill together
        assert rows.dtype == dtype and rows.shape[1] == 97 and rows.device.type == "cpu"
        assert torch.isfinite(rows).all()


class Widened:
    """An engine whose rows are the wrapped engine's widened to float32 (the
    engines' rows before they kept the model's dtype)."""

    def __init__(self, engine):
        self.engine = engine

    def step(self, seq_ids):
        return self.engine.step(seq_ids).float()

    def __getattr__(self, name):
        return getattr(self.engine, name)


def bfloat16_engine(widened: bool):
    engine = StaticEngine(tiny_model("cpu").to(torch.bfloat16), max_batch_size=8,
                          max_context=32)
    return Widened(engine) if widened else engine


def full_row_pool(arena: RowArena) -> SamplerPool:
    """Full rows to one stand-in sampler instance that reads them from the
    arena (the sampler model's own code, ``serve_request``)."""
    reader = RowReader()
    target = SamplerTarget("local", lambda inputs: serve_request(inputs, VOCAB, None,
                                                                 reader).outputs,
                           shares_memory=True)
    return SamplerPool([target], arena=arena)


def test_bfloat16_full_rows_through_the_arena_draw_the_widened_rows_tokens():
    arena = RowArena(slots=2, slot_bytes=8 * VOCAB * 4)
    try:
        leased = []
        lease = arena.lease
        arena.lease = lambda rows: leased.append(rows.dtype) or lease(rows)
        tokens = generate(bfloat16_engine(False), full_row_pool(arena), SEEDED)
        assert leased and all(str(dtype) == "bfloat16" for dtype in leased)
        assert generate(bfloat16_engine(True), full_row_pool(arena), SEEDED) == tokens
    finally:
        arena.close()
    assert len({tuple(ids) for ids in tokens[:3]}) == 3  # different seeds, different draws


def test_bfloat16_hot_first_rows_draw_the_widened_rows_tokens():
    hot = HotVocab(np.arange(0, VOCAB, 7), VOCAB)
    narrow = bfloat16_engine(False)
    tokens = generate(narrow, hot_first_sampler(narrow, hot, instances=2), SEEDED)
    # the widened rows through the same summary and decision
    wide = bfloat16_engine(True)
    assert generate(wide, hot_first_sampler(wide.engine, hot, instances=2), SEEDED) == tokens


def test_the_inline_sampler_draws_from_bfloat16_rows_as_from_their_widening():
    rng = np.random.default_rng(3)
    rows = torch.from_numpy(rng.standard_normal((len(SEEDED), 500)).astype(np.float32) * 3)
    narrow = rows.to(torch.bfloat16)
    batch = SamplingBatch.from_params(SEEDED)
    batch.seed = np.arange(len(SEEDED), dtype=np.uint64)
    tokens, logprobs = sample_torch(narrow, batch)
    wide_tokens, wide_logprobs = sample_torch(narrow.float(), batch)
    assert tokens.tolist() == wide_tokens.tolist()
    assert np.array_equal(logprobs, wide_logprobs)


@pytest.mark.parametrize("engine", ["torch", "static"])
def test_the_sampler_is_configured_for_the_models_dtype(engine, capsys):
    for torch_dtype, expected in (("float32", "fp32"), ("bfloat16", "bf16"),
                                  ("float16", "fp16")):
        settings = LlmSettings(engine=engine, device="cuda", torch_dtype=torch_dtype)
        assert engine_spec(engine).logits_dtype(settings) == expected
    # rows that would not be what the sampler's input is declared as
    assert cli.main(["serve", "--engine", engine, "--logits-dtype", "bf16"]) == 2
    assert "differs from the " + engine + " engine's logits (fp32)" in capsys.readouterr().err


def test_the_served_gpu_bench_configures_its_samplers_for_the_engines_rows(monkeypatch):
    from simple_sampler.bench.serve_gpu_served import measuring as served

    repositories = []

    def assemble(sampler, llm, prefix):
        repositories.append((sampler, llm))
        raise RuntimeError("stop before a server starts")

    monkeypatch.setattr(served, "assemble_in_temp", assemble)
    mode = served.MODES[0]
    settings = {"device": "cuda", "dtype": "bfloat16", "model_config": "llama-3.2-1b",
                "model": None, "instances": 2, "micro_batches": 1, "stream_interval": 1,
                "max_context": 64}
    with pytest.raises(RuntimeError, match="stop before"):
        served.run_server(mode, settings, [8], [1.0], 4, None)
    (sampler, llm), = repositories
    assert llm.torch_dtype == "bfloat16" and sampler.logits_dtype == "bf16"
