"""`serve --engine static` (the registry, the CLI, the settings) and `bench
serve-gpu-served` end to end on the CPU (real servers, a tiny random-weight
shape: figures that mean nothing; the CUDA path has not run here)."""
import json

import pytest

from simple_sampler.cli import build_parser
from simple_sampler.serving.engines import ENGINES, engine_spec
from simple_sampler.serving.static_decode import config_path
from simple_sampler.settings import ENGINES as ENGINE_NAMES, LlmSettings


def tiny_config(folder, **changes):
    """SmolLM2-135M's config cut to one narrow layer (its vocabulary kept:
    the prompts are tokenized with SmolLM2's tokenizer)."""
    config = json.loads(config_path("smollm2-135m").read_text())
    config.update(num_hidden_layers=1, hidden_size=32, intermediate_size=32,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, **changes)
    path = folder / "config.json"
    path.write_text(json.dumps(config))
    return path


def test_serve_offers_the_static_engine_with_a_model_config():
    assert "static" in ENGINES and "static" in ENGINE_NAMES
    # argparse refuses an --engine outside its choices (SystemExit)
    args = build_parser().parse_args(["serve", "--engine", "static", "--device", "cpu",
                                      "--model-config", "smollm2-135m"])
    settings = LlmSettings.from_arguments(args).validate()
    assert (settings.engine, settings.model_config) == ("static", "smollm2-135m")
    assert LlmSettings.from_parameters(settings.parameters()) == settings  # through config.pbtxt
    with pytest.raises(ValueError, match="model_config applies to engine static only"):
        LlmSettings(engine="torch", model_config="smollm2-135m").validate()


def test_the_static_spec_builds_random_weights_and_labels_them(tmp_path):
    settings = LlmSettings(engine="static", model_config=str(tiny_config(tmp_path)),
                           engine_max_batch_size=2, max_context=16).validate()
    spec = engine_spec("static")
    engine = spec.build(settings)
    assert type(engine).__name__ == "StaticEngine" and engine.vocab_size == 49_152
    assert spec.vocab_size(settings, None) == 49_152
    assert "RANDOM WEIGHTS" in spec.describe(settings)
    engine.add("a", [1, 2, 3])
    assert tuple(engine.step(["a"]).shape) == (1, 49_152)


def test_the_hot_set_is_mapped_to_a_wider_shapes_ids():
    from simple_sampler.launch.install import project_file
    from simple_sampler.shvs.hot_vocab import load_profile

    profile = load_profile(project_file("model_repository/simple_sampler/hot_vocab.npz"))
    spec = engine_spec("static")
    wide = spec.hot_profile(profile, LlmSettings(engine="static", model_config="qwen2.5-0.5b"))
    assert wide.vocab_size == 151_936 and int(wide.order.max()) < 151_936
    same = spec.hot_profile(profile, LlmSettings(engine="static", model_config="smollm2-135m"))
    assert same is profile
