"""The text steps' tensors: preprocessing (text to token ids: the ensemble's
step, and beside it TensorRT-LLM's preprocessing interface) and
postprocessing (TensorRT-LLM's: token ids to text).

TensorRT-LLM's interfaces are its inflight_batcher_llm models' (tensorrtllm_
backend, all_models/inflight_batcher_llm/{pre,post}processing/config.pbtxt),
for its clients that call them by name around its tensorrt_llm model
(tools/inflight_batcher_llm/end_to_end_test.py). A preprocessing request
that sends QUERY speaks that interface (``triton.trtllm_text``).
"""
from __future__ import annotations

import dataclasses

from ..params import BIAS_ALLOWED
from .generation import GENERATE_INPUTS, INPUT_IDS, INPUT_LENGTHS
from .tensors import Model, Tensor, scalar

_WORDS = ("strings (empty ones name no word), each encoded alone without special tokens, "
          "as the stop_words and bad_words inputs' words are")
#: TensorRT-LLM's preprocessing inputs (its vision and prompt-table inputs
#: are not inputs here: Triton refuses them by name)
TRTLLM_PREPROCESSING_INPUTS = (
    scalar("QUERY", "BYTES", "none (the ensemble's step: text_input)",
           "non-empty UTF-8: the prompt, encoded as text_input is (no chat template); given, "
           "the request speaks TensorRT-LLM's interface and is answered in its outputs"),
    scalar("REQUEST_OUTPUT_LEN", "INT32", "required with QUERY",
           "any: handed back as it came (its tensorrt_llm model checks it)"),
    Tensor("BAD_WORDS_DICT", "BYTES", (-1,), default="none", allowed=f"{_WORDS}: BAD_WORDS_IDS"),
    Tensor("STOP_WORDS_DICT", "BYTES", (-1,), default="none",
           allowed=f"{_WORDS}: STOP_WORDS_IDS"),
    Tensor("EMBEDDING_BIAS_WORDS", "BYTES", (-1,), default="none",
           allowed="strings, with EMBEDDING_BIAS_WEIGHTS: each word's tokens (special tokens "
                   "included, as the embedding_bias_words input's) get its weight in "
                   "EMBEDDING_BIAS"),
    Tensor("EMBEDDING_BIAS_WEIGHTS", "FP32", (-1,), default="none",
           allowed=f"{BIAS_ALLOWED}, one per EMBEDDING_BIAS_WORDS entry; summed where tokens "
                   f"repeat"),
    scalar("END_ID", "INT32", "the tokenizer's end token", "any: handed back as OUT_END_ID"),
    scalar("PAD_ID", "INT32", "the tokenizer's pad token (its end token where it has none)",
           "any: handed back as OUT_PAD_ID and DECODER_INPUT_ID (INPUT_ID is padded with "
           "the tokenizer's pad id, as there)"),
)
#: TensorRT-LLM's preprocessing outputs: the tensorrt_llm model's inputs
TRTLLM_PREPROCESSING_OUTPUTS = tuple(Tensor(name, dtype, dims, optional=False)
                                     for name, dtype, dims in (
    ("INPUT_ID", "INT32", (-1,)), ("REQUEST_INPUT_LEN", "INT32", (1,)),
    ("DECODER_INPUT_ID", "INT32", (-1,)), ("REQUEST_DECODER_INPUT_LEN", "INT32", (1,)),
    ("BAD_WORDS_IDS", "INT32", (2, -1)), ("STOP_WORDS_IDS", "INT32", (2, -1)),
    ("EMBEDDING_BIAS", "FP32", (-1,)), ("REQUEST_OUTPUT_LEN", "INT32", (-1,)),
    ("OUT_END_ID", "INT32", (1,)), ("OUT_PAD_ID", "INT32", (1,))))

PREPROCESSING = Model("preprocessing", (*GENERATE_INPUTS, *TRTLLM_PREPROCESSING_INPUTS), (
    *(dataclasses.replace(t, optional=False) for t in (INPUT_IDS, INPUT_LENGTHS)),
    *TRTLLM_PREPROCESSING_OUTPUTS))
#: TensorRT-LLM's postprocessing: its tensorrt_llm model's output_ids and
#: sequence_length ([B, beams, T], [B, beams]) in, each sequence's text out
POSTPROCESSING = Model("postprocessing", (
    Tensor("TOKENS_BATCH", "INT32", (-1, -1), optional=False, default="required",
           allowed="[beams, T] token ids: the tensorrt_llm model's output_ids"),
    Tensor("SEQUENCE_LENGTH", "INT32", (-1,), optional=False, default="required",
           allowed="[beams], each in [0, T]: the tensorrt_llm model's sequence_length"),
), (Tensor("OUTPUT", "BYTES", (-1,), optional=False),))
