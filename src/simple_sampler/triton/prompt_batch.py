"""A Triton request of several prompts: its batch dimension (the first) above 1.

TensorRT-LLM's ensemble takes text_input [B, 1] (its client's
``--batch-inputs``), and its tensorrt_llm model generates each prompt on its
own, with that prompt's row of every input (tensorrtllm_backend,
all_models/inflight_batcher_llm/tensorrt_llm/1/model.py, ``convert_request``).
Here too: ``split_prompts`` gives each prompt's inputs with batch dimension 1,
the llm service runs one generation per prompt (or its num_return_sequences,
``generations``), and their responses share the request's one sender
(``llm_delivery.SharedSends``). The preprocessing model
tokenizes each prompt (``encode_prompts``) and gives the batch's ids as
input_ids [B, L], rows padded, with input_lengths [B, 1], the input of the
same name of TensorRT-LLM's model, which cuts each row to its length.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, NamedTuple, TypeVar

import numpy as np

from ..schema import ANSWERS_ONCE, InvalidRequest
from ..settings import MAX_GENERATIONS
from .generate_io import DecodedRequest, encode_prompt
from .vllm_params import SAMPLING_PARAMETERS, vllm_inputs

#: The preprocessing model's output (and the llm model's input) that gives
#: each row of input_ids its prompt's length.
INPUT_LENGTHS = "input_lengths"
#: What pads a shorter prompt's row of input_ids: no token id, so that a row
#: read whole, without its length, is refused rather than generated from.
PAD_ID = -1

T = TypeVar("T")


def _prompt_count(present: Mapping[str, object]) -> int:
    """B: the first dimension of the inputs that have a batch dimension (two
    dimensions or more: every input of a batched model has one; a model of
    max_batch_size 0 gives none, and takes one prompt). Raises
    InvalidRequest naming an input that disagrees."""
    sizes = {name: np.shape(value)[0] for name, value in present.items()
             if np.ndim(value) >= 2}
    if not sizes:
        return 1
    count = max(sizes.values())
    for name, value in present.items():
        if np.ndim(value) < 2 and count > 1 or np.ndim(value) >= 2 and sizes[name] != count:
            raise InvalidRequest(f"{name} has shape {list(np.shape(value))}: a request of "
                                 f"{count} prompts gives every input a first dimension of "
                                 f"{count}, one row per prompt")
    return count


def split_prompts(inputs: Mapping[str, object]) -> list[dict[str, object]]:
    """A request's inputs (name -> array; None: absent) as one dict per
    prompt, in batch order: each input's row for that prompt, with batch
    dimension 1. input_lengths, when given, cuts each prompt's row of
    input_ids to its length and is not passed on. Raises InvalidRequest
    naming the input."""
    present = {name: value for name, value in inputs.items() if value is not None}
    lengths = present.pop(INPUT_LENGTHS, None)
    count = _prompt_count(present)
    if lengths is None:
        if count == 1:
            return [present]
    else:
        lengths = np.asarray(lengths).reshape(-1)
        if "input_ids" not in present:
            raise InvalidRequest(f"{INPUT_LENGTHS} is the length of each row of input_ids, "
                                 "which were not given")
        if lengths.size != count:
            raise InvalidRequest(f"{INPUT_LENGTHS} must hold one length per prompt ({count}), "
                                 f"got {lengths.size}")
    prompts = []
    for index in range(count):
        prompt = {name: value[index:index + 1] if np.ndim(value) >= 2 else value
                  for name, value in present.items()}
        if lengths is not None:
            ids = np.asarray(prompt["input_ids"])
            length, width = lengths[index], ids.shape[-1]
            if not (np.issubdtype(lengths.dtype, np.integer) and 1 <= length <= width):
                raise InvalidRequest(f"{INPUT_LENGTHS} {length} (batch_index {index}) must be "
                                     f"an integer from 1 to input_ids' length, {width}")
            prompt["input_ids"] = ids[..., :length]
        prompts.append(prompt)
    return prompts


def of_prompt(error: InvalidRequest, index: int, count: int) -> InvalidRequest:
    """A refusal of prompt ``index`` of ``count``: named by its batch_index
    when there are several."""
    return error if count == 1 else InvalidRequest(f"batch_index {index}: {error}")


def for_each_prompt(prompts: list[Mapping[str, object]], make: Callable[[Mapping], T]
                    ) -> list[T]:
    """``make`` of each prompt's inputs, in order (``of_prompt`` names a refusal)."""
    made = []
    for index, prompt in enumerate(prompts):
        try:
            made.append(make(prompt))
        except InvalidRequest as error:
            raise of_prompt(error, index, len(prompts)) from None
    return made


def _encode(codec, prompt: Mapping[str, object], parameters) -> list[int]:
    prompt = dict(prompt)
    # the ensemble's vLLM parameters, refused here, its first step, where bad
    vllm_inputs(prompt.pop(SAMPLING_PARAMETERS, None), parameters)
    return encode_prompt(codec, prompt)


class Generation(NamedTuple):
    """One generation of a request: ``decoded``, of prompt ``prompt`` (its
    batch_index), and the outputs that name it in each of its responses."""

    decoded: DecodedRequest
    prompt: int
    outputs: dict[str, np.ndarray]


def generations(prompts: list[DecodedRequest]) -> list[Generation]:
    """Each prompt's sequences (num_return_sequences), in order. batch_index
    names each response of a request of several prompts, sequence_index each
    of a prompt of several sequences (TensorRT-LLM's ``convert_response``).
    With a seed, sequence j draws with seed + j (mod 2^64), as vLLM seeds its
    n (vllm/v1/engine/parallel_sampling.py,
    ``ParentRequest._get_child_sampling_params``): they differ, each
    reproducible. Raises InvalidRequest above MAX_GENERATIONS in all."""
    total = sum(decoded.sequences for decoded in prompts)
    if total > MAX_GENERATIONS:
        raise InvalidRequest(f"the prompts ({len(prompts)}) and their num_return_sequences ask "
                             f"for {total} generations; a request may ask for at most "
                             f"{MAX_GENERATIONS}")
    made = []
    for index, decoded in enumerate(prompts):
        seed = decoded.request.sampling.seed
        for sequence in range(decoded.sequences):
            outputs = {}
            if len(prompts) > 1:
                outputs["batch_index"] = np.array([index], np.int32)
            if decoded.sequences > 1:
                outputs["sequence_index"] = np.array([sequence], np.int32)
            made.append(Generation(decoded if sequence == 0 or seed is None else _seeded(
                decoded, (seed + sequence) % 2**64), index, outputs))
    return made


def check_answered_once(runs: list[Generation]) -> None:
    """Refuse a request that one response cannot answer, as a model that is
    not decoupled must answer (Triton: exactly one response a request):
    streamed, or of several generations (prompts, num_return_sequences),
    each of which has responses of its own. TensorRT-LLM's backend refuses
    a stream, and several prompts, when not decoupled too
    (inflight_batcher_llm/src/utils.cc, ``createRequestsFromInputTensors``)."""
    stream = [run for run in runs if run.decoded.stream]
    if stream:
        name = stream[0].decoded.sent_as.get("stream", "stream")
        raise InvalidRequest(f"{name} is true, but {ANSWERS_ONCE}: send {name} false, or "
                             f"call a server started with decoupled_mode true")
    if len(runs) > 1:
        raise InvalidRequest(
            f"the request asks for {len(runs)} generations (its prompts times their "
            f"num_return_sequences), each answered on its own, but {ANSWERS_ONCE}: send one "
            f"prompt of one sequence a request, or call a server started with decoupled_mode "
            f"true")


def _seeded(decoded: DecodedRequest, seed: int) -> DecodedRequest:
    request = decoded.request
    return dataclasses.replace(decoded, request=dataclasses.replace(
        request, sampling=dataclasses.replace(request.sampling, seed=seed)))


def encode_prompts(codec, inputs: Mapping[str, object], parameters=None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """The preprocessing step over a request's prompts (``encode_prompt``
    each, its vLLM sampling parameters checked): input_ids [B, L], int32,
    each row a prompt's ids padded with PAD_ID to the longest, and
    input_lengths [B], int32. parameters: the request's."""
    ids = for_each_prompt(split_prompts(inputs),
                          lambda prompt: _encode(codec, prompt, parameters))
    lengths = np.array([len(row) for row in ids], np.int32)
    rows = np.full((len(ids), lengths.max()), PAD_ID, np.int32)
    for row, prompt_ids in zip(rows, ids):
        row[:len(prompt_ids)] = prompt_ids
    return rows, lengths
