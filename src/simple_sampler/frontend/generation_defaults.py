"""The model's own sampling defaults at the OpenAI door, as vLLM applies them.

A model's ``generation_config.json`` may recommend sampling parameters
(Llama 3.1 Instruct: temperature 0.6, top_p 0.9; Qwen2.5 Instruct: 0.7, 0.8,
top_k 20, repetition_penalty 1.05). vLLM's OpenAI server uses them for every
field a request leaves out, unless started with ``--generation-config vllm``
(vllm/config/model.py, ``ModelConfig.get_diff_sampling_param``; the
requests' ``to_sampling_params`` take them): the fields below, read through
transformers' ``GenerationConfig.to_diff_dict`` as vLLM reads them, and
``max_new_tokens`` as chat's default ``max_tokens``. ``serve
--generation-config`` chooses the same way here; the Triton endpoints
(generate, the ensemble, TensorRT-LLM's inputs) are not touched: there a
request's missing input keeps its documented default, as in TensorRT-LLM's
backend.
"""
from __future__ import annotations

import logging
import os

from ..params import SamplingParams

log = logging.getLogger(__name__)

#: what a generation config may default, as vLLM reads it (its "available_params")
SAMPLING_FIELDS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature",
                   "top_k", "top_p", "min_p")
MAX_NEW_TOKENS = "max_new_tokens"


def sampling_defaults(directory: str | os.PathLike | None, choice: str = "auto") -> dict:
    """{field: value} for the request fields the model's directory recommends
    (``max_new_tokens`` given as ``max_tokens``); empty with choice ``vllm``
    (``FrontendSettings.generation_config``), without a directory or without
    a generation config there (vLLM then falls back on config.json's
    generation fields; this door does not). Raises ValueError naming the file
    (and the field) when it does not parse or holds a value no request may
    send."""
    if choice == "vllm" or directory is None:
        return {}
    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    from transformers import GenerationConfig  # lazy: the front door loads it for its tokenizer

    try:
        # transformers checks its own fields (max_new_tokens > 0) and the JSON
        # (OSError), SamplingParams ours; a number must be a number, not its text
        recommended = GenerationConfig.from_pretrained(directory).to_diff_dict()
        defaults = {name: recommended[name] for name in SAMPLING_FIELDS
                    if recommended.get(name) is not None}
        for name, value in defaults.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r}")
        SamplingParams(**defaults).validate()
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: {error} (serve --generation-config vllm leaves the file's "
                         f"sampling parameters out)") from None
    if recommended.get(MAX_NEW_TOKENS) is not None:
        defaults["max_tokens"] = recommended[MAX_NEW_TOKENS]
    if defaults:
        log.warning("the OpenAI API's requests take %s from %s where they leave them out (as "
                    "vLLM's default --generation-config auto; serve --generation-config vllm: "
                    "none)", ", ".join(f"{k} {v}" for k, v in defaults.items()), path)
    return defaults
