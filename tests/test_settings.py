"""One declaration per setting (simple_sampler.settings): the serve options,
the config.pbtxt templates, the models' parsing and the defaults elsewhere
all follow it."""
import dataclasses
import inspect
import re

import pytest
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from simple_sampler import cli
from simple_sampler.serving import torch_engine
from simple_sampler.serving.decoder import Decoder
from simple_sampler.serving.engines import ENGINES
from simple_sampler.settings import (ENGINE_NAMES, FrontendSettings, LlmSettings,
                                     SamplerSettings, ServerSettings, allowed_range)
from simple_sampler.launch import templates
from simple_sampler.launch.install import project_file
from simple_sampler.launch.serve import assemble_repository

#: the models' settings (a config.pbtxt each), then the launcher's own
MODEL_SETTINGS = (SamplerSettings, LlmSettings)
SETTINGS = (*MODEL_SETTINGS, FrontendSettings, ServerSettings)


def read_config(path) -> model_config_pb2.ModelConfig:
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def template_text(model: str) -> str:
    return project_file(f"model_repository/{model}/config.pbtxt").read_text()


@pytest.mark.parametrize("cls", SETTINGS)
def test_every_setting_is_declared_with_help_and_a_checked_range(cls):
    assert cls.settings_fields()
    for f in cls.settings_fields():
        assert f.metadata["help"], f.name
        choices, minimum = f.metadata["choices"], f.metadata["minimum"]
        if choices:
            assert f.default in choices, f.name
            with pytest.raises(ValueError, match=f"{f.name} must be one of"):
                cls(**{f.name: "bogus"}).validate()
        if minimum is not None:
            assert f.default >= minimum, f.name
            with pytest.raises(ValueError, match=re.escape(f"{f.name} must be {allowed_range(f)}, got")):
                cls(**{f.name: type(f.default)(minimum - 1)}).validate()
        if f.metadata["maximum"] is not None:
            assert f.default <= f.metadata["maximum"], f.name
            with pytest.raises(ValueError, match=re.escape(f"{f.name} must be {allowed_range(f)}, got")):
                cls(**{f.name: f.metadata["maximum"] + 1}).validate()
        if isinstance(f.default, float):
            for value in (float("nan"), float("inf")):
                with pytest.raises(ValueError, match=f"{f.name} must be a finite number"):
                    cls(**{f.name: value}).validate()


@pytest.mark.parametrize("cls", MODEL_SETTINGS)
def test_each_template_reads_exactly_the_models_parameters(cls):
    """A model's config.pbtxt ``parameters`` are its settings' parameter
    fields, each filled from the placeholder of the same name; every other
    field fills a placeholder of one of the templates."""
    text = template_text(cls.triton_model)
    keys = re.findall(r'key: "(\w+)"\s+value: \{ string_value: "\$\{(\w+)\}" \}', text)
    assert all(key == placeholder for key, placeholder in keys), keys
    assert sorted(key for key, _ in keys) == sorted(cls().parameters())
    every_placeholder = set().union(*(templates.placeholders(template_text(m))
                                      for m in ("ensemble", "preprocessing", "llm",
                                                "postprocessing", "simple_sampler")))
    assert set(cls().template_values()) <= every_placeholder


def test_the_launcher_writes_what_the_models_read_back(tmp_path):
    sampler = SamplerSettings(sampler_instances=3, sampler_max_batch_size=8, logits_dtype="bf16",
                              num_threads=2, vocab_size=49_152, hot_vocab_profile="hot_vocab.npz")
    llm = LlmSettings(sampling_mode="inline", engine_max_batch_size=7, max_context=300,
                      launch_ahead="off", sampler_shards=5, shutdown_grace_s=4.5,
                      batch_invariant=True, generate_max_batch_size=9,
                      preprocessing_instances=2, decoupled_mode=False,
                      model='/models/a "quoted" name\\with a backslash')  # escaped, read as is
    repository = assemble_repository(tmp_path, sampler, llm)
    configs = {m: read_config(repository / m / "config.pbtxt")
               for m in ("ensemble", "preprocessing", "llm", "simple_sampler")}
    # TensorRT-LLM's BLS model's name: the same ensemble
    assert read_config(repository / "tensorrt_llm_bls" / "config.pbtxt") == configs["ensemble"]

    def parameters(config):
        return {k: v.string_value for k, v in config.parameters.items()}

    # Triton's own fields (max_batch_size, instance counts) are not parameters.
    assert LlmSettings.from_parameters(parameters(configs["llm"])).parameters() == \
        llm.parameters()
    assert SamplerSettings.from_parameters(parameters(configs["simple_sampler"])) == \
        SamplerSettings(num_threads=2, vocab_size=49_152, hot_vocab_profile="hot_vocab.npz")
    sampler_config = configs["simple_sampler"]
    assert sampler_config.max_batch_size == 8
    assert sampler_config.instance_group[0].count == 3
    logits = next(t for t in sampler_config.input if t.name == "logits")
    assert model_config_pb2.DataType.Name(logits.data_type) == "TYPE_BF16"
    assert {m: configs[m].max_batch_size for m in ("ensemble", "preprocessing", "llm")} == \
        dict.fromkeys(("ensemble", "preprocessing", "llm"), 9)
    assert configs["preprocessing"].instance_group[0].count == 2
    # decoupled_mode is Triton's own field, which the llm model reads back
    # (from Triton's JSON of its configuration: a false field left out)
    assert not configs["llm"].model_transaction_policy.decoupled
    as_json = json_format.MessageToDict(configs["llm"], preserving_proto_field_name=True)
    assert LlmSettings.from_config(as_json).parameters() == llm.parameters()
    assert not LlmSettings.from_config(as_json).decoupled_mode
    decoupled = assemble_repository(tmp_path / "decoupled", sampler,
                                    dataclasses.replace(llm, decoupled_mode=True))
    as_json = json_format.MessageToDict(read_config(decoupled / "llm" / "config.pbtxt"),
                                        preserving_proto_field_name=True)
    assert LlmSettings.from_config(as_json).decoupled_mode
    # TensorRT-LLM's core model's interface, batched as the models it calls;
    # not written unbatched (its tensors have the batch dimension)
    assert read_config(repository / "tensorrt_llm" / "config.pbtxt").max_batch_size == 9
    unbatched = assemble_repository(tmp_path / "unbatched", sampler,
                                    dataclasses.replace(llm, generate_max_batch_size=0))
    assert (unbatched / "llm").is_dir() and not (unbatched / "tensorrt_llm").exists()


def test_parameters_are_parsed_and_checked_by_name():
    settings = LlmSettings.from_parameters({"batch_invariant": "TRUE", "micro_batches": "2",
                                            "shutdown_grace_s": "1.5"})
    assert (settings.batch_invariant, settings.micro_batches, settings.shutdown_grace_s) == \
        (True, 2, 1.5)
    assert LlmSettings.from_parameters(settings.parameters()) == settings
    # The llm parameter's older name, from repositories written before the rename.
    assert LlmSettings.from_parameters({"max_batch_size": "8"}).engine_max_batch_size == 8
    with pytest.raises(ValueError, match="unknown llm parameter bogus; known: model, engine"):
        LlmSettings.from_parameters({"bogus": "1"})
    with pytest.raises(ValueError, match="micro_batches must be int, got 'two'"):
        LlmSettings.from_parameters({"micro_batches": "two"})
    with pytest.raises(ValueError, match="micro_batches must be >= 1, got 0"):
        LlmSettings.from_parameters({"micro_batches": "0"})
    with pytest.raises(ValueError, match="batch_invariant must be true or false, got 'yes'"):
        LlmSettings.from_parameters({"batch_invariant": "yes"})
    with pytest.raises(ValueError, match="unknown simple_sampler parameter sampler_instances"):
        SamplerSettings.from_parameters({"sampler_instances": "2"})  # Triton's field, not ours
    with pytest.raises(ValueError, match="llm parameters set engine_max_batch_size twice"):
        LlmSettings.from_parameters({"max_batch_size": "8", "engine_max_batch_size": "16"})
    for text in ("nan", "inf", "-infinity"):
        with pytest.raises(ValueError, match="shutdown_grace_s must be a finite number"):
            LlmSettings.from_parameters({"shutdown_grace_s": text})


def test_serve_options_come_from_the_settings():
    parser = cli.build_parser()
    args = parser.parse_args(["serve"])
    assert SamplerSettings.from_arguments(args) == SamplerSettings()
    assert LlmSettings.from_arguments(args) == LlmSettings()
    args = parser.parse_args(["serve", "--instances", "3", "--max-batch-size", "16",
                              "--logits-dtype", "fp16", "--engine-max-batch-size", "8",
                              "--micro-batches", "2", "--shutdown-grace", "2",
                              "--batch-invariant", "--model", "/m", "--no-decoupled-mode"])
    assert SamplerSettings.from_arguments(args) == SamplerSettings(
        sampler_instances=3, sampler_max_batch_size=16, logits_dtype="fp16")
    assert LlmSettings.from_arguments(args) == LlmSettings(
        engine_max_batch_size=8, micro_batches=2, shutdown_grace_s=2.0, batch_invariant=True,
        model="/m", decoupled_mode=False)
    assert LlmSettings.from_arguments(parser.parse_args(["serve", "--decoupled-mode"])) == \
        LlmSettings()
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--engine", "vllm"])
    flagged = [f.name for cls in SETTINGS for f in cls.settings_fields()
               if f.metadata["flag"] is not None]
    assert all(hasattr(args, name) for name in flagged)


def test_the_defaults_elsewhere_are_the_settings():
    micro_batches = inspect.signature(Decoder).parameters["micro_batches"].default
    assert micro_batches == LlmSettings.micro_batches == 1
    assert (torch_engine.DEFAULT_MAX_BATCH_SIZE, torch_engine.DEFAULT_MAX_CONTEXT) == \
        (LlmSettings.engine_max_batch_size, LlmSettings.max_context)


def test_the_engine_names_are_the_registrys():
    assert ENGINE_NAMES == tuple(ENGINES)
    assert LlmSettings.settings_fields()[1].metadata["choices"] == ENGINE_NAMES
    scoped = {name for cls in SETTINGS for f in cls.settings_fields()
              for name in (*f.metadata["engines"], *f.metadata["required_by"])}
    assert scoped and scoped <= set(ENGINES)


def test_settings_of_one_engine_are_refused_with_another():
    with pytest.raises(ValueError, match="batch_invariant applies to engine torch only, not "
                                         "simulated"):
        LlmSettings(engine="simulated", batch_invariant=True).validate()
    with pytest.raises(ValueError, match="engine tensorrt_llm needs model"):
        LlmSettings(engine="tensorrt_llm").validate()
    LlmSettings(engine="tensorrt_llm", model="/m", tensor_parallel_size=2).validate()


def doc_rows(heading: str) -> list[list[str]]:
    """The table rows (header dropped) under a ## heading of docs/CONFIGURATION.md."""
    rows, inside = [], False
    for line in project_file("docs/CONFIGURATION.md").read_text().splitlines():
        if line.startswith("## "):
            inside = line[3:].strip() == heading
        elif inside and line.startswith("|") and not set(line) <= set("|-: "):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows[1:]


def documented(cls, f) -> list[str]:
    """What docs/CONFIGURATION.md's row for a settings field must say (no
    config.pbtxt holds the front door's: "-")."""
    m = f.metadata
    flags = [] if m["flag"] is None else [m["flag"] or "--" + f.name.replace("_", "-")]
    if flags and f.default is True:  # argparse's BooleanOptionalAction: --no-x as well
        flags.append("--no-" + flags[0][2:])
    flags += [a for a in m["aliases"] if a[0] == "-"]
    allowed = ", ".join(map(str, m["choices"])) if m["choices"] else allowed_range(f)
    where = ("parameter" if m["parameter"] else "Triton field" if cls.triton_model else "-") + "".join(
        f" (older key `{a}`)" for a in m["aliases"] if a[0] != "-")
    default = str(f.default).lower() if isinstance(f.default, bool) else str(f.default)
    return [f"`{f.name}`", ", ".join(f"`{flag}`" for flag in flags), f"`{default}`", allowed,
            where, m["help"]]


@pytest.mark.parametrize("cls, heading", [
    (LlmSettings, "`llm` and the text models (`LlmSettings`)"),
    (SamplerSettings, "`simple_sampler` (`SamplerSettings`)"),
    (FrontendSettings, "The OpenAI-compatible API (`FrontendSettings`)"),
    (ServerSettings, "Triton's endpoints (`ServerSettings`)"),
])
def test_the_configuration_doc_tables_are_the_settings(cls, heading):
    assert doc_rows(heading) == [documented(cls, f) for f in cls.settings_fields()]
