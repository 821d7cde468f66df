"""The model's generation_config.json as the OpenAI door's defaults for the
sampling fields a request leaves out (vLLM's --generation-config auto), and
none with --generation-config vllm: read from a model directory, checked,
and applied by the real app (FastAPI's TestClient, the real tokenizer) to
what would be sent to the llm model."""
import json

import pytest
from fastapi.testclient import TestClient

from simple_sampler.client import Chunk
from simple_sampler.frontend.app import build_app
from simple_sampler.frontend.generation_defaults import sampling_defaults
from simple_sampler.frontend.translate import PARAM_INPUTS, Served

MODEL = "some-instruct-model"
CONTEXT = 512
#: Qwen2.5-7B-Instruct's recommendations, and a max_new_tokens
RECOMMENDED = {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "do_sample": True,
               "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
               "max_new_tokens": 300}


def model_dir(tmp_path, config):
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_the_files_sampling_fields_are_the_defaults(tmp_path):
    assert sampling_defaults(model_dir(tmp_path, RECOMMENDED)) == {
        "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
        "max_tokens": 300}


def test_the_penalties_vllm_reads_are_defaults_too(tmp_path):
    """vLLM's available_params hold presence and frequency penalties too
    (vllm/config/model.py, ``get_diff_sampling_param``)."""
    config = {**RECOMMENDED, "presence_penalty": 1.5, "frequency_penalty": -0.5}
    assert sampling_defaults(model_dir(tmp_path, config)) == {
        "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
        "presence_penalty": 1.5, "frequency_penalty": -0.5, "max_tokens": 300}
    with pytest.raises(ValueError, match="presence_penalty"):
        sampling_defaults(model_dir(tmp_path, {"presence_penalty": 3.0}))


def test_vllm_a_file_without_sampling_fields_or_no_file_give_none(tmp_path):
    assert sampling_defaults(model_dir(tmp_path, RECOMMENDED), "vllm") == {}
    assert sampling_defaults(model_dir(tmp_path, {"eos_token_id": 2, "bos_token_id": 1})) == {}
    assert sampling_defaults(tmp_path / "nowhere") == {}
    assert sampling_defaults(None) == {}


@pytest.mark.parametrize("config, field", [({"top_p": 1.5}, "top_p"),
                                           ({"temperature": -1.0}, "temperature"),
                                           ({"max_new_tokens": 0}, "max_new_tokens")])
def test_a_value_no_request_may_send_stops_the_start_naming_the_file(tmp_path, config, field):
    with pytest.raises(ValueError) as refused:
        sampling_defaults(model_dir(tmp_path, config))
    assert str(tmp_path / "generation_config.json") in str(refused.value)
    assert field in str(refused.value) and "--generation-config vllm" in str(refused.value)


class Recorder:
    def __init__(self):
        self.plans = []

    def generate(self, plan):
        self.plans.append(plan)

        async def chunks():
            yield Chunk(" Paris.", [3], [-0.5], -0.5, len(plan.prompt_ids), 1, "stop")
        return chunks()


def door(codec, defaults):
    recorder = Recorder()
    served = Served(MODEL, codec, CONTEXT, len(codec.tokenizer), sampling_defaults=defaults)
    return TestClient(build_app(served, recorder.generate)), recorder


def sent(client, recorder, path, **fields):
    body = {"model": MODEL, **({"messages": [{"role": "user", "content": "Capital of France?"}]}
                               if "chat" in path else {"prompt": "The capital of France is"}),
            **fields}
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return recorder.plans[-1]


def test_a_request_takes_the_defaults_for_what_it_leaves_out_and_keeps_what_it_sends(codec):
    client, recorder = door(codec, sampling_defaults_of(RECOMMENDED))
    params = sent(client, recorder, "/v1/chat/completions").params
    assert {name: params[PARAM_INPUTS[name]] for name in
            ("temperature", "top_p", "top_k", "repetition_penalty")} == {
        "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    assert params["max_tokens"] == 300
    params = sent(client, recorder, "/v1/chat/completions", temperature=0.0, top_k=-1,
                  max_tokens=12).params
    assert params[PARAM_INPUTS["temperature"]] == 0.0 and params[PARAM_INPUTS["top_k"]] == -1
    assert params[PARAM_INPUTS["top_p"]] == 0.8 and params["max_tokens"] == 12
    # completions: the same defaults, and OpenAI's 16 tokens (vLLM's request default)
    params = sent(client, recorder, "/v1/completions").params
    assert params[PARAM_INPUTS["temperature"]] == 0.7 and params["max_tokens"] == 16


def test_without_defaults_a_request_is_sent_as_before(codec):
    client, recorder = door(codec, {})
    params = sent(client, recorder, "/v1/chat/completions").params
    assert PARAM_INPUTS["temperature"] not in params and params[PARAM_INPUTS["top_p"]] == 1.0
    assert params["max_tokens"] == CONTEXT - len(recorder.plans[-1].prompt_ids)


def test_max_new_tokens_never_outgrows_the_context(codec):
    client, recorder = door(codec, {"max_tokens": 10_000})
    plan = sent(client, recorder, "/v1/chat/completions")
    assert plan.params["max_tokens"] == CONTEXT - len(plan.prompt_ids)


def sampling_defaults_of(config):
    return {("max_tokens" if k == "max_new_tokens" else k): v for k, v in config.items()
            if k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")}


def instruct_model(tmp_path):
    """SmolLM2's tokenizer and config (no weights) with RECOMMENDED's generation config."""
    from simple_sampler import models

    smollm2 = models.cache_dir() / models.SMOLLM2_CACHE_NAME
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (tmp_path / name).write_bytes((smollm2 / name).read_bytes())
    return model_dir(tmp_path, RECOMMENDED)


def test_the_door_reads_the_running_models_directory_and_not_a_simulated_ones(tmp_path):
    from simple_sampler.frontend.backend import served_by
    from simple_sampler.settings import LlmSettings

    instruct_model(tmp_path)
    torch = LlmSettings(engine="torch", model=str(tmp_path))
    assert served_by(torch).sampling_defaults == sampling_defaults_of(RECOMMENDED)
    assert served_by(torch, "vllm").sampling_defaults == {}
    simulated = LlmSettings(engine="simulated", model=str(tmp_path))
    assert served_by(simulated).sampling_defaults == {}


def test_serves_flag_reaches_the_door(tmp_path):
    """`serve --generation-config vllm` (parsed as serve parses it) reaches
    what the door serves; by default the model's file does."""
    import argparse

    from simple_sampler.frontend.backend import FrontendServer
    from simple_sampler.settings import FrontendSettings, LlmSettings

    parser = argparse.ArgumentParser()
    FrontendSettings.add_arguments(parser)
    llm = LlmSettings(engine="torch", model=str(instruct_model(tmp_path)))
    for argv, expected in (([], sampling_defaults_of(RECOMMENDED)),
                           (["--generation-config", "vllm"], {})):
        frontend = FrontendSettings.from_arguments(parser.parse_args(argv)).validate()
        door = FrontendServer.of(frontend, "127.0.0.1:1", 1.0)
        assert door.prepare(llm).served.sampling_defaults == expected


@pytest.mark.parametrize("text, field", [('{"temperature": 0.7,', None),
                                         ('{"temperature": "0.7"}', "temperature")])
def test_a_file_that_does_not_parse_or_holds_text_for_a_number_stops_the_start(tmp_path, text,
                                                                               field):
    (tmp_path / "generation_config.json").write_text(text)
    with pytest.raises(ValueError) as refused:
        sampling_defaults(tmp_path)
    assert str(tmp_path / "generation_config.json") in str(refused.value)
    assert field is None or field in str(refused.value)
