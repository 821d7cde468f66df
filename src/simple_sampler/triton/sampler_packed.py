"""The C path of the sampler model: the llm model's own compact requests
decided by one call (``_sampling.decide_packed_compact``) over their packed
records (``row_scalars``, ``cold_summary``), where the general path
(``sampler_decode``, ``sampler_serve.sample_request``) makes a few hundred
Python calls (docs/COPIES.md)."""
from __future__ import annotations

from typing import Mapping

import numpy as np

from .. import _sampling
from .._sampling import FieldType
from ..params import GREEDY_TEMPERATURE
from ..row_arena import REF_COLUMNS
from ..sampling import KERNEL_FIELDS, ROW_SCALARS, kernel_rows
from ..schema import COLD_SUMMARY_RECORD, ROW_SCALARS_RECORD
from .sampler_codec import EXTRA_CHECKS, RULE_INPUTS, SCALAR_INPUTS, decided_all

#: The llm model's own compact requests (``hot_first_sampler``: the packed
#: parameters, the compact rows, their full rows by reference and the rows'
#: end ids or not), which ``decide_plain_compact`` decides in one C call.
_PLAIN_COMPACT = ("row_scalars", "hot_logits", "touched_ids", "touched_logits", "cold_summary")
_PLAIN_COMPACT_INPUTS = frozenset((*_PLAIN_COMPACT, "logits_ref", "end_id"))
_FIELD_TYPES = {np.dtype(dtype): int(code) for dtype, code in (
    (np.float32, FieldType.FIELD_FLOAT32), (np.float64, FieldType.FIELD_FLOAT64),
    (np.int32, FieldType.FIELD_INT32), (np.int64, FieldType.FIELD_INT64),
    (np.uint64, FieldType.FIELD_UINT64), (np.bool_, FieldType.FIELD_BOOL))}


def _field(name: str, record: np.dtype = ROW_SCALARS_RECORD) -> tuple[int, int]:
    """(byte offset, _sampling.FieldType) of field `name` of `record`."""
    dtype, offset = record.fields[name][:2]
    return offset, _FIELD_TYPES[dtype]


_INPUT_OF = {**{field: name for name, (field, _) in SCALAR_INPUTS.items()}, "seed": "random_seed"}
#: The checks of a packed record: RULES' and EXTRA_CHECKS', by input.
_RECORD_CHECKS = (*((name, param.rule) for name, param in RULE_INPUTS),
                  *((name, rule) for name, rule, _ in EXTRA_CHECKS))
#: ROW_SCALARS_RECORD's layout for the C pass over the records (its
#: checks' bounds; the kernel fields taken as they are, each from its
#: input's field; the fields it converts or reads; the cold summary's).
PACKED_LAYOUT = _sampling.PackedLayout(
    checked=np.array([_field(name) for name, _ in _RECORD_CHECKS], np.int64),
    bounds=np.array([(rule.low, rule.high, rule.low_open, rule.high_open)
                     for _, rule in _RECORD_CHECKS], np.float64),
    copies=np.array([(*_field(_INPUT_OF.get(param, param)), *_field(name, ROW_SCALARS))
                     for param, fields in (*KERNEL_FIELDS.items(),
                                           ("seed", (("seed", None, None),)),
                                           ("step", (("step", None, None),)))
                     for name, _, convert in fields if convert is None], np.int64),
    special=np.array([_field(_INPUT_OF.get(name, name))
                      for name in _sampling.PACKED_SPECIAL_FIELDS], np.int64),
    cold=np.array([_field(name, COLD_SUMMARY_RECORD) for name in _sampling.PACKED_COLD_FIELDS],
                  np.int64),
    greedy_below=GREEDY_TEMPERATURE, record_size=ROW_SCALARS_RECORD.itemsize,
    cold_size=COLD_SUMMARY_RECORD.itemsize)


#: byte offset of raw_logprobs (one byte, BOOL) in ROW_SCALARS_RECORD
_RAW_LOGPROBS = _field("raw_logprobs")[0]
#: the bytes of given_token_id (INT32) in ROW_SCALARS_RECORD
_GIVEN_TOKEN = slice(_field("given_token_id")[0], _field("given_token_id")[0] + 4)


def is_plain_compact(inputs: Mapping, hot_vocab) -> bool:
    """Whether a request has the form of the llm model's own compact requests
    (``_PLAIN_COMPACT_INPUTS`` alone), the one ``decide_plain_compact`` tries."""
    return (hot_vocab is not None and inputs.get("hot_logits") is not None
            and inputs.keys() <= _PLAIN_COMPACT_INPUTS)


def decide_plain_compact(inputs: Mapping, vocab_size: int, hot_vocab, reader,
                         num_threads: int) -> dict[str, np.ndarray] | None:
    """The output tensors of one of the llm model's own compact requests
    (``is_plain_compact``), decided in one C call; None where the general
    path must answer (one the call would refuse, or undecided rows beside
    their full rows)."""
    if any(inputs.get(name) is None for name in _PLAIN_COMPACT):
        return None
    packed, hot, touched, touched_logits, cold = (inputs[name] for name in _PLAIN_COMPACT)
    end_ids, refs = inputs.get("end_id"), inputs.get("logits_ref")
    if not (isinstance(packed, np.ndarray) and packed.ndim == 2 and num_threads >= 1):
        return None
    rows, vocab = len(packed), hot_vocab.vocab_size
    if end_ids is None:
        end_ids = np.empty((rows, 0), np.int32)
    if not (packed.dtype == np.uint8 and packed.shape == (rows, ROW_SCALARS_RECORD.itemsize)
            and isinstance(cold, np.ndarray) and cold.dtype == np.uint8
            and cold.shape == (rows, COLD_SUMMARY_RECORD.itemsize)
            and isinstance(touched, np.ndarray) and touched.dtype == np.int32
            and isinstance(touched_logits, np.ndarray) and touched_logits.dtype == np.float32
            and touched.ndim == 2 and touched.shape == touched_logits.shape
            and isinstance(end_ids, np.ndarray) and end_ids.dtype == np.int32
            and end_ids.ndim == 2 and len(end_ids) == len(touched) == rows
            and tuple(hot.shape) == (rows, hot_vocab.size) and hot_vocab.size
            and rows > 0 and vocab_size in (0, vocab)):
        return None
    # The full rows are read only for a row the compact decision leaves
    # undecided, and then the general path maps and checks them; here only
    # their count, so that a reference is never taken for rows it cannot name.
    if refs is not None and not (reader is not None and isinstance(refs, np.ndarray)
                                 and refs.shape == (rows, len(REF_COLUMNS))
                                 and refs.dtype == np.int64):
        return None
    if packed[:, _RAW_LOGPROBS].any():  # the C call gives no raw logprobs: the general path does
        return None
    if (packed[:, _GIVEN_TOKEN].copy().view("<i4") != -1).any():  # the general path refuses it
        return None
    try:
        hot_bytes, dtype = kernel_rows(hot)
    except ValueError:
        return None
    tokens = np.empty((rows, 1), np.int32)
    outcome = np.empty((rows, 1), np.int8)
    logprobs = np.empty((rows, 1), np.float32)
    hot_ids, hot_block_start, hot_bits = hot_vocab.kernel_arrays()
    try:
        decided, any_logprob = _sampling.decide_packed_compact(
            PACKED_LAYOUT, packed, hot_bytes, dtype, touched, touched_logits, cold, end_ids,
            hot_ids, hot_block_start, hot_bits, hot_vocab.positions(), vocab, num_threads,
            tokens, outcome, logprobs)
    except ValueError:  # an array that is not C-contiguous (Triton's never are)
        return None
    # undecided rows beside their full rows: decided in place, the general way
    if not decided or (refs is not None and outcome.any()):
        return None
    outputs = {"output_ids": tokens}
    if not decided_all(outcome):
        outputs["handoff_outcome"] = outcome
    if any_logprob:
        outputs["output_log_probs"] = logprobs
    return outputs
