"""Every model's tensors, declared once: name, data type, dims, whether it may
be left out, what its absence means and what values it takes.

The codecs (``triton/generate_io.py``, ``triton/sampler_codec.py``,
``triton/sampler_decode.py``, ``triton/sampler_client.py``), the Python
client (``client/common.py``) and ``simple-sampler generate`` take names and dtypes from here; the
``config.pbtxt`` files and the tables in docs/TENSORS.md restate them for
Triton and for readers, and tests/test_schema.py holds both to this package:
``tensors`` (the building blocks), ``generation``, ``text_steps`` and
``sampler``.
Adding an input is adding one :class:`Tensor` to its model (and its entry to
the config.pbtxt and the table).

Dims are config.pbtxt's: per request row, without the batch dimension (a
request of B rows sends [B, *dims]). Names follow TensorRT-LLM's: its
ensemble's for the text models, its engine's tensors for the sampler.
"""

from .generation import (CORE_ALIASES, CORE_INPUT_NAMES, CORE_INPUTS, CORE_OUTPUT_NAMES,
                         CORE_OUTPUTS, CORE_TOKEN_INPUTS, ENSEMBLE, GENERATE_INPUTS,
                         GENERATE_OUTPUTS, GUIDE_TYPES, GUIDED_DECODING_INPUTS, IGNORE_EOS,
                         INPUT_IDS, INPUT_LENGTHS, LLM,
                         NUM_TOP_LOGPROBS, PROMPT_LOGPROBS, STOP_SIGNAL, TOP_P_ALLOWED,
                         TRTLLM_CORE, TRTLLM_INPUTS, VLLM_EXTRA_INPUTS, VLLM_EXTRA_OUTPUTS)
from .sampler import (COLD_DRAW_INPUTS, COLD_SUMMARY, COLD_SUMMARY_FIELDS, COLD_SUMMARY_RECORD,
                      HANDOFF_INPUTS, LOGITS_REF, ROW_SCALARS, ROW_SCALARS_RECORD, SAMPLER)
from .tensors import (ANSWERS_ONCE, HOT_SET_REFUSAL, NUMPY, PROMPT_OUTPUTS, SHUTTING_DOWN,
                      TOP_OUTPUTS, InvalidRequest, Model, Tensor)
from .text_steps import (POSTPROCESSING, PREPROCESSING, TRTLLM_PREPROCESSING_INPUTS,
                         TRTLLM_PREPROCESSING_OUTPUTS)

__all__ = [
    "ANSWERS_ONCE", "COLD_DRAW_INPUTS", "COLD_SUMMARY", "COLD_SUMMARY_FIELDS",
    "COLD_SUMMARY_RECORD", "CORE_ALIASES", "CORE_INPUTS", "CORE_INPUT_NAMES", "CORE_OUTPUTS",
    "CORE_OUTPUT_NAMES", "CORE_TOKEN_INPUTS", "ENSEMBLE", "GENERATE_INPUTS", "GENERATE_OUTPUTS",
    "GUIDED_DECODING_INPUTS", "GUIDE_TYPES", "HANDOFF_INPUTS", "HOT_SET_REFUSAL", "IGNORE_EOS",
    "INPUT_IDS", "INPUT_LENGTHS",
    "InvalidRequest", "LLM", "LOGITS_REF", "MODELS", "Model", "NUMPY", "NUM_TOP_LOGPROBS",
    "POSTPROCESSING", "PREPROCESSING", "PROMPT_LOGPROBS", "PROMPT_OUTPUTS", "ROW_SCALARS",
    "ROW_SCALARS_RECORD", "SAMPLER", "SHUTTING_DOWN", "STOP_SIGNAL", "TOP_OUTPUTS",
    "TOP_P_ALLOWED", "TRTLLM_CORE", "TRTLLM_INPUTS", "TRTLLM_PREPROCESSING_INPUTS",
    "TRTLLM_PREPROCESSING_OUTPUTS", "Tensor", "VLLM_EXTRA_INPUTS", "VLLM_EXTRA_OUTPUTS",
]

#: Every model of the repository by its name, for the configs' and docs' checks
MODELS = {model.name: model for model in (ENSEMBLE, PREPROCESSING, LLM, TRTLLM_CORE,
                                          POSTPROCESSING, SAMPLER)}
