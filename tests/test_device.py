"""--engine torch --device cuda, on a machine without a GPU: the settings'
rules, and serving/device.py's refusals for what this machine cannot run
(CUDA itself is never exercised here)."""
import numpy as np
import pytest
import torch

from simple_sampler.serving import device
from simple_sampler.settings import LlmSettings
from simple_sampler.shvs.hot_vocab import HotVocab


def test_cpu_float32_is_the_default_and_resolves_here():
    settings = LlmSettings().validate()
    assert (settings.device, settings.torch_dtype) == ("cpu", "float32")
    assert device.resolve(settings.device, settings.torch_dtype) == (torch.device("cpu"),
                                                                      torch.float32)


@pytest.mark.parametrize("settings, message", [
    (LlmSettings(device="cuda", batch_invariant=True), "batch_invariant runs on the CPU only"),
    (LlmSettings(torch_dtype="bfloat16"), "torch_dtype bfloat16 needs device cuda"),
    (LlmSettings(engine="simulated", device="cuda"), "device applies to engine torch or static only"),
    (LlmSettings(device="tpu"), "device must be one of cpu, cuda"),
    (LlmSettings(device="cuda", torch_dtype="int8"), "torch_dtype must be one of float32"),
])
def test_settings_no_machine_can_run_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        settings.validate()


def test_cuda_settings_pass_the_static_checks():
    LlmSettings(device="cuda", torch_dtype="bfloat16").validate()
    LlmSettings(device="cuda", torch_dtype="float16", sampling_mode="inline").validate()


def test_cuda_is_refused_with_the_reason_when_this_torch_has_none(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(RuntimeError, match=r"device cuda: this torch \(.*\) was built without "
                                           r"CUDA; a CUDA build of torch is needed"):
        device.resolve("cuda", "float32")


def test_cuda_is_refused_when_no_gpu_is_visible(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.9")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="no CUDA GPU is visible.*CUDA_VISIBLE_DEVICES"):
        device.resolve("cuda", "float32")


def test_bfloat16_is_refused_on_a_gpu_without_it(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.9")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(RuntimeError, match="Tesla T4 has no bfloat16 support"):
        device.resolve("cuda", "bfloat16")
    assert device.resolve("cuda", "float16") == (torch.device("cuda", 0), torch.float16)


def tiny_llama(dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64)
    return LlamaForCausalLM(config).eval().to(dtype)


def test_the_torch_engine_builds_on_the_models_device_and_dtype():
    from simple_sampler.serving.torch_engine import TorchEngine

    engine = TorchEngine(tiny_llama(torch.bfloat16), max_batch_size=2, max_context=16,
                         host_logits=False)
    assert engine.device == torch.device("cpu") and engine.keys.dtype == torch.bfloat16
    engine.add("a", [1, 2, 3], max_tokens=4)
    rows = engine.step(["a"])
    assert rows.dtype == torch.bfloat16 and rows.shape == (1, 64) and rows.device.type == "cpu"
    with pytest.raises(ValueError, match="batch_invariant runs on the CPU only, not on meta"):
        TorchEngine(tiny_llama().to("meta"), max_batch_size=2, max_context=16,
                    batch_invariant=True)


def test_engine_torch_device_cuda_is_refused_here_with_the_reason():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    from simple_sampler.serving.engines import engine_spec

    settings = LlmSettings(device="cuda").validate()
    with pytest.raises(RuntimeError, match="device cuda: "):
        engine_spec("torch").build(settings)


def test_the_gpu_bench_refuses_clearly_without_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    from simple_sampler.cli import main

    assert main(["bench", "serve-gpu", "--quick"]) == 2
    assert "simple-sampler bench serve-gpu: device cuda: " in capsys.readouterr().err


def test_the_gpu_bench_rows_run_on_any_device(monkeypatch):
    """serve_gpu.run_one's logic on the CPU (the tiny model stands in for the
    GPU one): both modes produce their figures."""
    import asyncio

    from simple_sampler.bench.serve_gpu import measuring as serve_gpu
    from simple_sampler.serving.text import TextCodec
    from fakes import VOCAB, FakeTokenizer

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)).eval()
    codec = TextCodec(FakeTokenizer())
    hot = HotVocab(np.arange(0, VOCAB, 3), VOCAB)
    for index, (mode, decoder_mode, micro_batches, handoff) in enumerate(serve_gpu.MODES):
        launch_ahead = ("on", "off")[index % 2]  # auto would be off: a CPU data plane
        row = asyncio.run(serve_gpu.run_one(model, codec, mode, decoder_mode, micro_batches,
                                            batch=4, instances=1, warmup=2, measure=4,
                                            top_p=0.9, handoff=handoff, hot=hot,
                                            launch_ahead=launch_ahead))
        assert row["mode"] == mode and row["tokens_per_s"] > 0 and row["itl_ms_p50"] > 0
        assert row["launch_ahead"] == launch_ahead
        assert row["forward_ms_per_step"] > 0
        # only hot-first runs a summary behind the forward
        assert (row["summary_ms_per_step"] > 0) == (handoff == "hot-first")
        # hot-first: the tiny vocabulary's cold ids are all handed over
        # (cold_top 256 > V), so no row needs its full row
        assert row["fallback_rate"] == (0.0 if handoff == "hot-first" else None)


@pytest.mark.slow  # loads SmolLM2's tokenizer
def test_random_weights_take_the_directorys_architecture_and_tokenizer(tmp_path):
    from transformers import LlamaConfig

    from simple_sampler.models import random_model
    from simple_sampler.serving.text import load_tokenizer

    with pytest.raises(FileNotFoundError, match="random weights need a model directory with "
                                                "config.json"):
        random_model(tmp_path)
    LlamaConfig(vocab_size=49_152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp_path)
    load_tokenizer(None).save_pretrained(tmp_path)  # only config and tokenizer: no weights
    model, tokenizer = random_model(tmp_path, torch.bfloat16)
    again, _ = random_model(tmp_path, torch.bfloat16)
    assert model.config.num_hidden_layers == 2 and model.config.vocab_size == 49_152
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and not model.training
    assert tokenizer.eos_token_id == load_tokenizer(None).eos_token_id
    # the same seed, the same weights: one run's step times repeat the other's model
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    assert not torch.equal(model.lm_head.weight, random_model(tmp_path, torch.bfloat16,
                                                              seed=1)[0].lm_head.weight)


def test_the_summary_bench_refuses_clearly_without_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    from simple_sampler.cli import main

    assert main(["bench", "summary-gpu", "--quick"]) == 2
    assert "simple-sampler bench summary-gpu: device cuda: " in capsys.readouterr().err


@pytest.mark.slow  # SmolLM2's real rows (cached after the first run)
def test_the_summary_bench_runs_on_the_cpu_against_the_modelled_charge(capsys):
    import json

    from simple_sampler.cli import main

    assert main(["bench", "summary-gpu", "--device", "cpu", "--quick", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "not where a GPU host runs it" in report["device"]
    assert [(r["config"], r["batch"], r["vocab"]) for r in report["results"]] == [
        ("plain", 8, 49_152), ("top_p", 8, 49_152)]
    for row in report["results"]:
        # four float32 reads of 8 rows of 49,152 at 3.35 TB/s
        assert row["modelled_ms"] == pytest.approx(4 * 8 * 49_152 * 4 / 3.35e12 * 1e3, abs=1e-4)
        assert min(row["ms_per_step"].values()) > 0 and set(row["ms_per_step"]) == {
            "summary", "graphed", "device", "full_copy"}
        assert row["summary_vs_modelled"] == pytest.approx(
            row["ms_per_step"]["summary"] / row["modelled_ms"], rel=0.05)
        # the compact rows carry the hot set's logits and a few ids, not the row
        assert row["bytes_per_row"]["full"] == 49_152 * 4
        assert report["hot_size"] * 4 < row["bytes_per_row"]["compact"] < 0.1 * 49_152 * 4
        # the same torch on the same CPU: nothing may differ
        assert row["against_cpu"] == {"rows_differing": 0, "max_mass_rel_diff": 0.0}
        assert row["graphed_against_cpu"] == row["against_cpu"]  # eager off a GPU


def test_the_cuda_forward_leaves_cudnn_attention_out():
    """cuDNN's SDPA plans a graph per new key length, i.e. every decode step
    (results/gpu-2026-11-27.md); the CPU forward keeps torch's own choice."""
    from torch.nn.attention import SDPBackend

    from simple_sampler.serving import torch_engine

    assert SDPBackend.CUDNN_ATTENTION not in torch_engine._CUDA_ATTENTION
    assert SDPBackend.EFFICIENT_ATTENTION in torch_engine._CUDA_ATTENTION  # takes a bool mask
    with torch_engine._attention_backends(torch.device("cpu")) as chosen:
        assert chosen is None
    was = torch.backends.cuda.cudnn_sdp_enabled()
    with torch_engine._attention_backends(torch.device("cuda")):  # flags only: no GPU needed
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == was
