"""The fake of TensorRT-LLM (tests/fake_tensorrt_llm.py) and the adapter
(serving/trtllm.py) against the recorded API (tests/trtllm_api.json): the
fake may not grow or lose a name or parameter the record does not list, and
the adapter may use only recorded names."""
import dataclasses
import inspect
import json
from pathlib import Path

import pytest

import fake_tensorrt_llm as fake
from simple_sampler.serving.trtllm import TrtLlmEngine
from simple_sampler.serving.trtllm_bridge import DecisionPlaneProcessor

API = json.loads(Path(__file__).with_name("trtllm_api.json").read_text())["names"]


def parameters(function) -> list[str]:
    return [p.name for p in inspect.signature(function).parameters.values()
            if p.name != "self" and p.kind is not p.VAR_KEYWORD]


def test_every_record_names_its_source():
    assert API
    for name, entry in API.items():
        assert entry["source"] and all(s["path"].startswith("tensorrt_llm/")
                                       and "read_this_session" in s for s in entry["source"]), name


def test_the_fake_llm_has_exactly_the_recorded_signature():
    llm = API["LLM"]
    assert parameters(fake.LLM.__init__) == llm["constructor_keywords"]
    for method, record in llm["methods"].items():
        assert parameters(getattr(fake.LLM, method)) == record["parameters"], method


def test_the_fake_request_output_has_exactly_the_recorded_members():
    record = API["RequestOutput"]
    for method, entry in record["methods"].items():
        function = getattr(fake.RequestOutput, method)
        assert parameters(function) == entry["parameters"], method
        assert inspect.iscoroutinefunction(function) == entry.get("async", False), method
    public = {n for n in vars(fake.RequestOutput) if not n.startswith("_")}
    assert public == set(record["methods"])  # the attributes are the instance's
    instance = fake.RequestOutput(llm=None, request_id=1)
    assert set(record["attributes"]) <= set(vars(instance))  # (finish_reason: tests only)


def test_the_fake_sampling_params_and_build_cache_config_match():
    assert [f.name for f in dataclasses.fields(fake.SamplingParams)] == \
        API["SamplingParams"]["keywords"]
    assert parameters(fake.BuildCacheConfig.__init__) == API["BuildCacheConfig"]["parameters"]


def test_the_processor_has_the_batched_logits_processor_signature():
    assert parameters(DecisionPlaneProcessor.__call__) == \
        API["BatchedLogitsProcessor"]["call_parameters"]


@pytest.mark.parametrize("prebuilt", [False, True])
def test_the_adapter_calls_only_recorded_names(tmp_path, prebuilt):
    config = {"vocab_size": 30}
    if prebuilt:
        config = {"pretrained_config": config,
                  "build_config": {"max_batch_size": 2, "max_input_len": 63, "max_seq_len": 64}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    seen = {}

    class Recording(fake.LLM):
        def __init__(self, model, **kwargs):
            seen["LLM"] = {"model", *kwargs}
            super().__init__(model, **kwargs)

        def generate_async(self, inputs, sampling_params, streaming=False):
            seen["SamplingParams"] = {f.name for f in dataclasses.fields(sampling_params)
                                      if getattr(sampling_params, f.name) != f.default}
            return super().generate_async(inputs, sampling_params=sampling_params,
                                          streaming=streaming)

    engine = TrtLlmEngine.from_source(tmp_path, api=(Recording, *fake.API[1:]),
                                      max_batch_size=2, max_context=64,
                                      build_cache_dir=tmp_path / "cache")
    try:
        engine.add("a", [1, 2])
    finally:
        engine.close()
    assert seen["LLM"] <= set(API["LLM"]["constructor_keywords"])
    assert ("max_input_len" in seen["LLM"]) == (not prebuilt)  # a prebuilt engine keeps its own
    assert seen["SamplingParams"] <= set(API["SamplingParams"]["keywords"])
