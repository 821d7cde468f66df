"""The torch engine with rows crossing hot-first (``TorchEngine.prepare_hot_first``):
its rows stay where the forward left them and its own summary hook
(``summary_graph.GraphedSummary``: CUDA graphs on a GPU, eager torch here)
summarizes them. Through the decode loop, greedy tokens equal the full rows'
and seeded ones repeat. The CUDA case runs only where a GPU is visible (never
in CI); there it also checks that the rows stayed on the device and that the
summary was replayed from a captured graph."""
import asyncio

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fakes import FakeTokenizer
from simple_sampler.bench.serve_sim.measuring import hot_first_sampler
from simple_sampler.params import SamplingParams
from simple_sampler.serving.decoder import Decoder
from simple_sampler.serving.samplers import threaded
from simple_sampler.serving.generation import GenerationRequest
from simple_sampler.serving.engine import SummarizesHotFirst
from simple_sampler.serving.text import TextCodec
from simple_sampler.serving.torch_engine import TorchEngine
from simple_sampler.shvs.hot_vocab import HotVocab

#: a vocabulary past the summary's cold_top (256), so rows keep a cold region
VOCAB = 3000
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))]


class WideTokenizer(FakeTokenizer):
    """FakeTokenizer's letters for VOCAB ids (id i is letter i mod 28)."""

    alphabet = FakeTokenizer.alphabet * (-(-VOCAB // len(FakeTokenizer.alphabet)))


def tiny_model(device: str):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    ).eval().to(device)


def generate(engine: TorchEngine, sampler, params: list[SamplingParams]) -> list[list[int]]:
    async def run():
        decoder = Decoder(engine, TextCodec(WideTokenizer()), "simple", sampler)
        await decoder.start()
        try:
            rng = np.random.default_rng(1)
            handles = [decoder.submit(GenerationRequest(
                prompt_ids=rng.integers(0, VOCAB, 5).tolist(), max_tokens=12,
                ignore_end=True, sampling=p)) for p in params]
            tokens = []
            for handle in handles:
                ids = []
                async for event in handle:
                    assert event.error is None, event.error
                    ids += event.token_ids
                tokens.append(ids)
            return tokens
        finally:
            await decoder.close()
    return asyncio.run(run())


@pytest.mark.parametrize("device", DEVICES)
def test_hot_first_rows_give_the_full_rows_greedy_tokens_and_repeat_seeded_ones(device):
    model = tiny_model(device)
    hot = HotVocab(np.arange(0, VOCAB, 7), VOCAB)
    greedy = [SamplingParams(temperature=0.0) for _ in range(6)]
    full = generate(TorchEngine(model, max_batch_size=8, max_context=32), threaded(), greedy)

    engine = TorchEngine(model, max_batch_size=8, max_context=32)
    assert isinstance(engine, SummarizesHotFirst)
    sampler = hot_first_sampler(engine, hot, instances=2)
    assert not engine.host_logits  # prepared: the rows stay where the forward left them
    assert generate(engine, sampler, greedy) == full

    seeded = [SamplingParams(seed=s, temperature=1.0) for s in range(4)] + \
        [SamplingParams(seed=9, top_p=0.8, repetition_penalty=1.3)]
    first = generate(engine, sampler, seeded)
    assert generate(engine, sampler, seeded) == first
    assert len({tuple(ids) for ids in first[:4]}) == 4  # different seeds, different draws
    assert sampler.stats["rows"] == 12 * (len(greedy) + 2 * len(seeded))

    if device == "cuda":
        engine.add("probe", [1, 2, 3])
        assert engine.step(["probe"]).device.type == "cuda"
        assert engine.hot_first_summary.graphs and not engine.hot_first_summary.refused


@pytest.mark.parametrize("device", DEVICES)
def test_undecided_rows_reach_the_host_whole_in_their_dtype(device):
    """``rows_to_host``: the rows a compact decision left undecided, in the
    order asked, bitwise the device's rows, on the host (pinned from a GPU)."""
    from simple_sampler.serving.hot_first import rows_to_host

    logits = torch.randn(6, 50, device=device).to(torch.bfloat16)
    rows = rows_to_host(logits, [4, 1, 4])
    assert rows.device.type == "cpu" and rows.dtype == torch.bfloat16
    assert torch.equal(rows, logits[[4, 1, 4]].cpu())
