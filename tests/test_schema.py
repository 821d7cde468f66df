"""One declaration per tensor (simple_sampler.schema): every config.pbtxt
and the tables of docs/TENSORS.md must agree with it, name, dtype and dims,
and the codecs take their lists from it."""
import json
import re

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from simple_sampler import cli, schema
from simple_sampler.client import common
from simple_sampler.serving.generation import GenerationRequest
from simple_sampler.settings import LlmSettings, SamplerSettings
from simple_sampler.triton import generate_io, sampler_codec
from simple_sampler.launch.install import project_file
from simple_sampler.launch.serve import assemble_repository

TENSORS_DOC = project_file("docs/TENSORS.md")
#: docs/TENSORS.md heading -> the tensors its table lists
DOC_TABLES = {
    "`ensemble` inputs": schema.ENSEMBLE.inputs,
    "`ensemble` outputs": schema.ENSEMBLE.outputs,
    "`llm` inputs beyond the ensemble's": tuple(t for t in schema.LLM.inputs
                                                if t not in schema.ENSEMBLE.inputs),
    "`llm` outputs beyond the ensemble's": tuple(t for t in schema.LLM.outputs
                                                 if t not in schema.ENSEMBLE.outputs),
    "`tensorrt_llm` inputs": schema.TRTLLM_CORE.inputs,
    "`tensorrt_llm` outputs": schema.TRTLLM_CORE.outputs,
    "`preprocessing` outputs": tuple(t for t in schema.PREPROCESSING.outputs
                                     if t not in schema.TRTLLM_PREPROCESSING_OUTPUTS),
    "TensorRT-LLM's `preprocessing` inputs": schema.TRTLLM_PREPROCESSING_INPUTS,
    "TensorRT-LLM's `preprocessing` outputs": schema.TRTLLM_PREPROCESSING_OUTPUTS,
    "`postprocessing` inputs": schema.POSTPROCESSING.inputs,
    "`postprocessing` outputs": schema.POSTPROCESSING.outputs,
    "`simple_sampler` inputs": schema.SAMPLER.inputs,
    "`simple_sampler` outputs": schema.SAMPLER.outputs,
}


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    repository = assemble_repository(tmp_path_factory.mktemp("repository"), SamplerSettings(),
                                     LlmSettings())
    return {name: text_format.Parse((repository / name / "config.pbtxt").read_text(),
                                    model_config_pb2.ModelConfig())
            for name in schema.MODELS}


def config_mismatches(model: schema.Model, config) -> list[str]:
    """Where a parsed config.pbtxt differs from the schema."""
    problems = []
    for kind, declared, written in (("input", model.inputs, config.input),
                                    ("output", model.outputs, config.output)):
        by_name = {t.name: t for t in written}
        if set(by_name) != {t.name for t in declared}:
            problems.append(f"{model.name} {kind}s {sorted(by_name)} != schema "
                            f"{sorted(t.name for t in declared)}")
            continue
        for tensor in declared:
            entry = by_name[tensor.name]
            data_type = model_config_pb2.DataType.Name(entry.data_type)
            if data_type not in [schema.Tensor(tensor.name, d).config_type
                                 for d in tensor.dtypes]:
                problems.append(f"{model.name}.{tensor.name}: {data_type}, schema {tensor.dtypes}")
            if tuple(entry.dims) != tensor.dims:
                problems.append(f"{model.name}.{tensor.name}: dims {list(entry.dims)}, "
                                f"schema {list(tensor.dims)}")
            if kind == "input" and entry.optional != tensor.optional:
                problems.append(f"{model.name}.{tensor.name}: optional {entry.optional}")
    return problems


def doc_tables(text: str) -> dict[str, list[list[str]]]:
    """heading -> rows (cells, backticks kept) of the table under each ### heading."""
    tables, heading = {}, None
    for line in text.splitlines():
        if line.startswith("### "):
            heading = line[4:].strip()
        elif line.startswith("|") and heading and not set(line) <= set("|-: "):
            tables.setdefault(heading, []).append([c.strip() for c in line.strip("|").split("|")])
    return {h: rows[1:] for h, rows in tables.items()}  # the header row dropped


def _text(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def table_mismatches(tensors, rows) -> list[str]:
    """Where a docs table differs from the schema: name, dtype, dims, and
    for inputs the default and allowed columns."""
    problems = []
    names = [re.fullmatch(r"`(\w+)`", row[0]) for row in rows]
    if None in names or [m.group(1) for m in names] != [t.name for t in tensors]:
        return [f"names {[row[0] for row in rows]} != schema {[t.name for t in tensors]}"]
    for tensor, row in zip(tensors, rows):
        expected = [f"`{tensor.name}`", ", ".join(tensor.dtypes),
                    "[" + ", ".join(map(str, tensor.dims)) + "]"]
        if len(row) == 5:
            expected += [_text(tensor.default), tensor.allowed]
        if row != expected:
            problems.append(f"{row} != schema {expected}")
    return problems


@pytest.mark.parametrize("name", schema.MODELS)
def test_each_config_declares_the_schemas_tensors(configs, name):
    assert config_mismatches(schema.MODELS[name], configs[name]) == []


def test_a_wrong_name_or_dtype_in_a_config_is_caught(configs):
    config = model_config_pb2.ModelConfig()
    config.CopyFrom(configs["simple_sampler"])
    config.input[1].data_type = model_config_pb2.DataType.Value("TYPE_FP64")
    assert config_mismatches(schema.SAMPLER, config) == [
        f"simple_sampler.{config.input[1].name}: TYPE_FP64, schema ('FP32',)"]
    config.input[1].name = "temprature"
    assert "schema" in config_mismatches(schema.SAMPLER, config)[0]


def test_the_ensemble_wires_the_schemas_tensors(configs):
    steps = {step.model_name: step for step in configs["ensemble"].ensemble_scheduling.step}
    ensemble = set(schema.ENSEMBLE.input_names) | set(schema.ENSEMBLE.output_names)
    for name, step in steps.items():
        model = schema.MODELS[name]
        assert set(step.input_map) <= set(model.input_names), name
        assert set(step.output_map) <= set(model.output_names), name
        assert set(step.input_map.values()) - ensemble <= {"_input_ids", "_input_lengths"}, name
    assert set(steps["llm"].output_map.values()) == set(schema.ENSEMBLE.output_names)


def test_the_tensorrt_llm_ensemble_hands_each_input_to_llm_by_its_name(configs):
    """TensorRT-LLM's core model's interface: every input reaches llm by its
    own name (an alias there: generate_io.ALIASES), and its outputs are
    llm's of TensorRT-LLM's shapes under that model's names."""
    (step,) = configs["tensorrt_llm"].ensemble_scheduling.step
    assert step.model_name == "llm"
    assert dict(step.input_map) == {schema.CORE_INPUT_NAMES.get(name, name): name
                                    for name in schema.TRTLLM_CORE.input_names}
    assert set(step.input_map) <= set(schema.LLM.input_names)
    assert dict(step.output_map) == schema.CORE_OUTPUT_NAMES
    assert set(step.output_map) <= set(schema.LLM.output_names)
    for name, llm_name in schema.CORE_INPUT_NAMES.items():
        llm_input, core_input = schema.LLM.input(llm_name), schema.TRTLLM_CORE.input(name)
        assert (llm_input.dtype, llm_input.dims) == (core_input.dtype, core_input.dims)
    for llm_name, name in schema.CORE_OUTPUT_NAMES.items():
        llm_output, output = schema.LLM.output(llm_name), schema.TRTLLM_CORE.output(name)
        assert (llm_output.dtype, llm_output.dims) == (output.dtype, output.dims), name


#: Ensemble inputs that preprocessing turns into input_ids: llm is given
#: those ids instead. Every other ensemble input reaches llm by its own name.
TOKENIZED = {"text_input", "apply_chat_template"}


def test_every_ensemble_input_reaches_preprocessing_and_llm(configs):
    """Complete, not a subset: an input added to the schema (a new sampling
    parameter) and not wired to llm in model_repository/ensemble/config.pbtxt
    would be dropped silently by Triton's ensemble."""
    steps = {step.model_name: dict(step.input_map)
             for step in configs["ensemble"].ensemble_scheduling.step}
    inputs = schema.ENSEMBLE.input_names
    assert TOKENIZED <= set(inputs)
    assert steps["preprocessing"] == {name: name for name in inputs}
    assert steps["llm"] == {**{name: name for name in inputs if name not in TOKENIZED},
                            "input_ids": "_input_ids", "input_lengths": "_input_lengths"}


def test_the_docs_tables_are_the_schema():
    tables = doc_tables(TENSORS_DOC.read_text())
    assert set(DOC_TABLES) <= set(tables), sorted(tables)
    for heading, tensors in DOC_TABLES.items():
        assert table_mismatches(tensors, tables[heading]) == [], heading


def test_a_wrong_name_or_dtype_in_a_docs_table_is_caught():
    rows = doc_tables(TENSORS_DOC.read_text())["`simple_sampler` inputs"]
    wrong_dtype = [row[:] for row in rows]
    wrong_dtype[2][1] = "FP32"  # runtime_top_k is INT32
    assert len(table_mismatches(schema.SAMPLER.inputs, wrong_dtype)) == 1
    wrong_name = [row[:] for row in rows]
    wrong_name[2][0] = "`top_k`"
    assert table_mismatches(schema.SAMPLER.inputs, wrong_name)[0].startswith("names")


def test_the_codecs_and_clients_use_the_schema():
    assert set(generate_io.INPUT_NAMES) == set(schema.LLM.input_names)
    assert set(sampler_codec.INPUT_NAMES) == set(schema.SAMPLER.input_names)
    # the client leaves out other clients' inputs (client/common.py says why)
    assert set(common.SCALAR_TYPES) | set(common.LIST_TYPES) | {common.PROMPT} == \
        set(schema.ENSEMBLE.input_names) - common.OTHER_CLIENTS_INPUTS
    assert common.OTHER_CLIENTS_INPUTS < set(schema.ENSEMBLE.input_names)
    assert {t.name for t in cli.GENERATION_FLAGS} <= set(schema.ENSEMBLE.input_names)
    perf_inputs = json.loads(project_file("client/perf_inputs.json").read_text())["data"]
    assert set().union(*perf_inputs) <= set(schema.ENSEMBLE.input_names)
    # The defaults the schema states are the ones the code applies.
    assert schema.ENSEMBLE.input("max_tokens").default == GenerationRequest.max_tokens
    # (in the vLLM backend's shapes: in TensorRT-LLM's, no top_k and no top_p
    # is greedy, as there, top_k 1: docs/TENSORS.md)
    request = generate_io.decode_generate({"text_input": [b"hi"]}).request
    for name, field in generate_io.SAMPLING_INPUTS.items():
        assert getattr(request.sampling, field) == schema.ENSEMBLE.input(name).default, name
    assert generate_io.decode_generate({"text_input": [[b"hi"]]}).request.sampling.top_k == 1
    for name, (field, default) in sampler_codec.SCALAR_INPUTS.items():
        assert default == schema.SAMPLER.input(name).default, name


def test_sampler_tensors_built_by_the_client_have_the_schemas_dtypes():
    import numpy as np

    from simple_sampler import SamplingParams
    from simple_sampler.params import SamplingBatch
    from simple_sampler.triton.sampler_codec import batch_arrays

    batch = SamplingBatch.from_params([SamplingParams(seed=1)] * 2)
    for name, array in batch_arrays(batch).items():
        assert array.dtype == np.dtype(schema.SAMPLER.input(name).numpy), name
