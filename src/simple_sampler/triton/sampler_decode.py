"""The sampler model's requests decoded: every input checked (naming the
input, the row and the allowed range) and packed for the kernels
(:func:`decode_request`; the tensors: ``sampler_codec``'s docstring)."""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from .. import _sampling
from ..handoff import CompactRows, host_array
from ..histories import checked_lists
from ..params import PARAMS, SamplingBatch, first_failed_check
from ..schema import COLD_SUMMARY_RECORD, ROW_SCALARS_RECORD, InvalidRequest
from .sampler_codec import (COLD_DRAW_NAMES, COLD_SUMMARY_NAMES, COMPACT_INPUTS, EXTRA_CHECKS,
                            ID_LIST_INPUTS, INPUT_NAMES, PACKED_INPUTS, PADDING, RULE_INPUTS,
                            SCALAR_INPUTS)

_KNOWN_INPUTS = frozenset(INPUT_NAMES)
#: The dtype each per-row scalar input is decoded to (the batch's columns').
_DECODED = {**{name: PARAMS[field].dtype for name, (field, _) in SCALAR_INPUTS.items()},
            "random_seed": np.uint64, "step": np.int64, "min_tokens": np.int64,
            "num_top_logprobs": np.int64, "return_log_probs": np.bool_,
            "raw_logprobs": np.bool_, "given_token_id": np.int64}
#: ``row_scalars``' records in those dtypes: one astype decodes every column.
_DECODED_RECORD = np.dtype([(name, _DECODED[name]) for name in PACKED_INPUTS])
_PACKED_SET = frozenset(PACKED_INPUTS)
_PACKED_SET = frozenset(PACKED_INPUTS)


@dataclass
class RowsRequest:
    """One decoded request: logits [B, V] (numpy or CPU torch), the rows'
    parameters, which rows want their logprob, and each row's top-n."""

    logits: object
    batch: SamplingBatch
    return_log_probs: np.ndarray
    num_top_logprobs: np.ndarray
    #: the compact form (``handoff.CompactRows``) when it came instead of logits
    compact: object = None
    #: ``logits_ref`` when the logits are rows of the llm's arena (checked
    #: again after sampling: ``row_reader.RowReader.check``)
    logits_ref: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.batch)


def _per_row_array(name: str, array: np.ndarray, rows: int, width: int | None = 1) -> np.ndarray:
    array = np.asarray(array)
    if array.ndim != 2 or array.shape[0] != rows or (width is not None and array.shape[1] != width):
        expected = f"[{rows}, {width if width is not None else 'L'}]"
        raise InvalidRequest(f"{name} must have shape {expected} (one row per logits row), "
                           f"got {list(array.shape)}")
    return array


def _scalar(inputs: Mapping, name: str, rows: int, default, dtype) -> np.ndarray:
    if inputs.get(name) is None:
        return np.full(rows, default, dtype=dtype)
    return _per_row_array(name, inputs[name], rows)[:, 0].astype(dtype)


_NO_IDS = np.zeros(0, np.int64)


def _id_lists(name: str, padded, rows: int, vocab: int, values=None):
    """CSR (offsets int64, ids) of a -1 padded [B, L] input with every id
    checked, and the float32 entries of `values` (same shape) at those ids
    when given. int32 ids (the schema's) in one Cython pass
    (``_sampling.padded_lists``), others through numpy."""
    padded = _per_row_array(name, padded, rows, width=None)
    if padded.dtype == np.int32:
        offsets, ids, taken, bad = _sampling.padded_lists(
            np.ascontiguousarray(padded), vocab,
            None if values is None else np.ascontiguousarray(values, np.float32))
        if bad >= 0:
            _refuse_ids(name, vocab, *divmod(bad, padded.shape[1]), padded)
        return offsets, ids, taken
    if padded.dtype.kind not in "iu":
        padded = padded.astype(np.int64)
    # PADDING is the only negative value allowed: two reductions decide it
    if padded.size and (padded.min() < PADDING or padded.max() >= vocab):
        valid = (padded == PADDING) | ((padded >= 0) & (padded < vocab))
        _refuse_ids(name, vocab, *np.argwhere(~valid)[0], padded)
    used = padded != PADDING
    offsets = np.zeros(rows + 1, np.int64)
    np.cumsum(used.sum(axis=1), out=offsets[1:])
    return offsets, padded[used], None if values is None else values[used].astype(np.float32)


def _refuse_ids(name: str, vocab: int, row: int, column: int, padded) -> None:
    raise InvalidRequest(f"row {row}: {name} must be token ids in [0, {vocab}) or "
                         f"{PADDING} (padding), got {padded[row, column]}")


def _logits_shape(logits) -> tuple[int, int]:
    shape = tuple(logits.shape)
    if len(shape) != 2 or shape[0] < 1 or shape[1] < 1:
        raise InvalidRequest(f"logits must have shape [B, V] with B, V >= 1, got {list(shape)}")
    return shape


def decode_request(inputs: Mapping[str, object], vocab_size: int = 0,
                   hot_vocab=None, reader=None) -> RowsRequest:
    """Check one request's tensors and pack them for the kernels.

    inputs: tensor name -> array ([B, ...], see the module table); absent
        optional inputs may be missing or None. logits (or hot_logits) may
        be a CPU torch tensor (BF16 reaches Python that way).
    vocab_size: when > 0, the logits must have exactly this many columns.
    hot_vocab: the sampler's ``HotVocab`` (None: compact rows are refused).
    reader: a ``row_reader.RowReader`` the rows of ``logits_ref`` and the
        ids of ``history_ref`` are read through, in place (None: both are
        refused).
    Raises InvalidRequest naming the input, the row and the allowed range.
    """
    unknown = sorted(inputs.keys() - _KNOWN_INPUTS)
    if unknown:
        raise InvalidRequest(f"unknown input {unknown[0]}; the sampler takes "
                             f"{', '.join(INPUT_NAMES)}")
    records = _records(inputs) if inputs.get("row_scalars") is not None else None
    logits, compact, rows, vocab = _rows_source(inputs, hot_vocab, reader)
    if vocab_size and vocab != vocab_size:
        raise InvalidRequest(f"logits must have {vocab_size} columns (the model's vocabulary), "
                           f"got {vocab}")
    scalar = _scalar_reader(inputs, records, rows)
    columns = {field: scalar(name, default) for name, (field, default) in SCALAR_INPUTS.items()}
    # absent: every row's history length (the lists are read below)
    step = (scalar("step", None)
            if records is not None or inputs.get("step") is not None else None)
    min_tokens = scalar("min_tokens", 0)
    num_top = scalar("num_top_logprobs", 0)
    _check_scalars(columns, {"step": step, "min_tokens": min_tokens, "num_top_logprobs": num_top})

    if records is None and inputs.get("random_seed") is None:
        seed = np.fromiter((secrets.randbits(64) for _ in range(rows)), np.uint64, rows)
    else:
        seed = scalar("random_seed", None)
    # An absent list is no ids for any row: one empty CSR shared by all of
    # them (nothing writes into a decoded batch's arrays).
    no_lists = (np.zeros(rows + 1, np.int64), _NO_IDS)
    lists = {name: no_lists if inputs.get(name) is None
             else _id_lists(name, inputs[name], rows, vocab)[:2]
             for name in ID_LIST_INPUTS}
    if inputs.get("history_ref") is not None:
        lists.update(_history_lists(inputs, reader, vocab, rows))
    generated_offsets = lists["generated_ids"][0]
    if step is None:
        step = np.diff(generated_offsets)
    end_ids = lists["end_id"]
    ban_offsets, ban_ids = (end_ids if not end_ids[1].size
                            else _banned_end_ids(*end_ids, step < min_tokens))
    bias_offsets, bias_ids, bias_values = _logit_bias(inputs, rows, lists["logit_bias_ids"])
    raw = scalar("raw_logprobs", False)
    given = _given_tokens(scalar("given_token_id", -1), vocab, compact is not None)
    batch = SamplingBatch(
        **columns, seed=seed, step=step,
        bias_offsets=bias_offsets, bias_ids=bias_ids, bias_values=bias_values,
        ban_offsets=ban_offsets, ban_ids=ban_ids,
        prompt_offsets=lists["prompt_ids"][0], prompt_ids=lists["prompt_ids"][1],
        output_offsets=generated_offsets, output_ids=lists["generated_ids"][1],
        raw_logprobs=raw if raw.any() else None, given_token_ids=given,
    )
    try:  # the scalars, steps and ids were checked above, the offsets built here
        batch.validate_bias(vocab)
    except ValueError as error:
        raise InvalidRequest(str(error)) from None
    return RowsRequest(logits, batch, scalar("return_log_probs", False),
                       num_top, compact, inputs.get("logits_ref"))


def _rows_source(inputs: Mapping, hot_vocab, reader) -> tuple[object, object, int, int]:
    """Where the rows come from: (logits or None, ``CompactRows`` or None,
    B, V): the logits as sent or read through ``logits_ref``, the compact
    rows (with their full rows by reference or not)."""
    logits = inputs.get("logits")
    compact = None
    refs = inputs.get("logits_ref")
    if refs is not None:
        if logits is not None:
            raise InvalidRequest("send logits_ref or logits, not both")
        if reader is None:
            raise InvalidRequest("logits_ref needs a sampler on the llm model's host")
        try:
            logits = reader.rows(refs)
        except ValueError as error:
            raise InvalidRequest(str(error)) from None
    if inputs.get("hot_logits") is not None:
        if inputs.get("logits") is not None:
            raise InvalidRequest("send logits or the compact rows (hot_logits, ...), not both")
        if hot_vocab is None:
            raise InvalidRequest("hot_logits needs a sampler with a hot set (hot_vocab_profile)")
        compact = _compact_rows(inputs, hot_vocab)
        rows, vocab = len(compact.cold_max), hot_vocab.vocab_size
        if logits is not None and tuple(logits.shape) != (rows, vocab):
            raise InvalidRequest(f"logits_ref with compact rows must name their {rows} full rows "
                                 f"of V={vocab}, got {list(logits.shape)}")
    elif stray := [name for name in (*COMPACT_INPUTS, *COLD_DRAW_NAMES, "cold_summary")
                   if inputs.get(name) is not None]:
        raise InvalidRequest(f"{stray[0]} comes with compact rows (hot_logits, ...), which this "
                             f"request does not send: it would be ignored")
    elif logits is None:
        raise InvalidRequest("logits is required: [B, V] next-token logits")
    else:
        rows, vocab = _logits_shape(logits)
    return logits, compact, rows, vocab


def _history_lists(inputs: Mapping, reader, vocab: int, rows: int) -> dict[str, tuple]:
    """prompt_ids' and generated_ids' CSR lists as ``history_ref`` names them
    in the llm's shared histories (``histories.checked_lists``)."""
    if inputs.get("prompt_ids") is not None or inputs.get("generated_ids") is not None:
        raise InvalidRequest("send history_ref or prompt_ids / generated_ids, not both")
    if reader is None:
        raise InvalidRequest("history_ref needs a sampler on the llm model's host")
    try:
        prompt_offsets, prompt_ids, output_offsets, output_ids = checked_lists(
            inputs["history_ref"], reader.histories, vocab, rows)
    except ValueError as error:
        raise InvalidRequest(str(error)) from None
    return {"prompt_ids": (prompt_offsets, prompt_ids), "generated_ids": (output_offsets, output_ids)}


def _given_tokens(given: np.ndarray, vocab: int, compact: bool) -> np.ndarray | None:
    """``given_token_id`` checked: [-1, V), and with full rows only (None: no row's given)."""
    message = first_failed_check([("given_token_id", given, (given >= -1) & (given < vocab),
                                   f"in [-1, {vocab})")])
    if message:
        raise InvalidRequest(message)
    if not (given >= 0).any():
        return None
    if compact:
        raise InvalidRequest("given_token_id is scored on full rows (logits or logits_ref), "
                             "not on compact ones (hot_logits, ...)")
    return given


def _scalar_reader(inputs: Mapping, records: np.ndarray | None, rows: int):
    """``scalar(name, default)``: a per-row scalar input's [B] column in its
    decoded dtype, from its own tensor or from the ``row_scalars`` records."""
    if records is None:
        def scalar(name, default):
            return _scalar(inputs, name, rows, default, _DECODED[name])
        return scalar
    if len(records) != rows:
        raise InvalidRequest(f"row_scalars must have shape [{rows}, "
                             f"{ROW_SCALARS_RECORD.itemsize}] (one row per logits row), "
                             f"got [{len(records)}, {ROW_SCALARS_RECORD.itemsize}]")
    decoded = records.astype(_DECODED_RECORD)

    def scalar(name, default):
        return decoded[name]
    return scalar


def _check_scalars(columns: dict, extra: dict) -> None:
    """params.RULES' checks of the batch's columns and EXTRA_CHECKS' of the
    other scalars (None: not sent): InvalidRequest with the first failure."""
    checks = [(name, columns[param.name], param.rule(columns[param.name]), param.allowed)
              for name, param in RULE_INPUTS]
    checks += [(name, extra[name], rule(extra[name]), allowed)
               for name, rule, allowed in EXTRA_CHECKS if extra[name] is not None]
    message = first_failed_check(checks)
    if message:
        raise InvalidRequest(message)


def _records(inputs: Mapping) -> np.ndarray:
    """``row_scalars`` as ROW_SCALARS_RECORD [B] (a view), after checking
    that none of the inputs it packs came too."""
    packed = np.asarray(inputs["row_scalars"])
    # only the inputs that came are looked at (none, from the pool)
    both = sorted(name for name in inputs.keys() & _PACKED_SET if inputs[name] is not None)
    if both:
        raise InvalidRequest(f"row_scalars carries {both[0]}: send one of them, not both")
    if (packed.ndim != 2 or packed.shape[1] != ROW_SCALARS_RECORD.itemsize
            or packed.dtype != np.uint8):
        raise InvalidRequest(f"row_scalars must be UINT8 [B, {ROW_SCALARS_RECORD.itemsize}] "
                             f"(schema.ROW_SCALARS_RECORD), got {packed.dtype} "
                             f"{list(packed.shape)}")
    return np.ascontiguousarray(packed).view(ROW_SCALARS_RECORD)[:, 0]


def _compact_rows(inputs: Mapping, hot_vocab):
    """``handoff.CompactRows`` from the compact inputs (shapes checked here,
    contents by ``sample_compact``)."""
    hot = inputs["hot_logits"]
    if len(tuple(hot.shape)) != 2 or hot.shape[1] != hot_vocab.size or hot.shape[0] < 1:
        raise InvalidRequest(f"hot_logits must have shape [B, {hot_vocab.size}] (the sampler's "
                           f"hot set), got {list(hot.shape)}")
    rows = hot.shape[0]
    packed = inputs.get("cold_summary")
    needed = COMPACT_INPUTS[:3] if packed is not None else COMPACT_INPUTS
    missing = [name for name in needed if inputs.get(name) is None]
    if missing:
        raise InvalidRequest(f"hot_logits needs {', '.join(missing)} too")
    touched = _per_row_array("touched_ids", inputs["touched_ids"], rows, width=None)
    logits = _per_row_array("touched_logits", inputs["touched_logits"], rows, width=None)
    if logits.shape != touched.shape:
        raise InvalidRequest(f"touched_logits must have the shape of touched_ids "
                           f"{list(touched.shape)}, got {list(logits.shape)}")
    offsets, ids, logits = _id_lists("touched_ids", touched, rows, hot_vocab.vocab_size, logits)
    if packed is not None:
        cold = _cold_summary(inputs, packed, rows)
    else:
        sent = [name for name in COLD_DRAW_NAMES if inputs.get(name) is not None]
        if sent and len(sent) != len(COLD_DRAW_NAMES):
            raise InvalidRequest(f"{' and '.join(COLD_DRAW_NAMES)} must be sent together")
        cold = {name: _per_row_array(name, inputs[name], rows)[:, 0]
                for name in COMPACT_INPUTS[3:] + tuple(sent)}
    return CompactRows(
        hot_logits=host_array(hot),
        touched_offsets=offsets, touched_ids=ids.astype(np.int32, copy=False),
        touched_logits=logits, **cold)


def _cold_summary(inputs: Mapping, packed, rows: int) -> dict[str, np.ndarray]:
    """``cold_summary`` as CompactRows' cold fields (views of its records),
    after checking that none of the inputs it packs came too."""
    both = [name for name in COLD_SUMMARY_NAMES if inputs.get(name) is not None]
    if both:
        raise InvalidRequest(f"cold_summary carries {both[0]}: send one of them, not both")
    packed = np.asarray(packed)
    if (packed.dtype != np.uint8
            or packed.shape != (rows, COLD_SUMMARY_RECORD.itemsize)):
        raise InvalidRequest(f"cold_summary must be UINT8 [{rows}, "
                             f"{COLD_SUMMARY_RECORD.itemsize}] (schema.COLD_SUMMARY_RECORD, "
                             f"one row per hot_logits row), got {packed.dtype} "
                             f"{list(packed.shape)}")
    records = np.ascontiguousarray(packed).view(COLD_SUMMARY_RECORD)[:, 0]
    return {name: records[name] for name in COLD_SUMMARY_NAMES}


def _banned_end_ids(offsets: np.ndarray, ids: np.ndarray, before_min_tokens: np.ndarray):
    """End ids of the rows still short of min_tokens, as CSR."""
    if before_min_tokens.all():  # every row short of min_tokens: its end ids as they came
        return offsets, ids
    lengths = np.diff(offsets)
    keep = np.repeat(before_min_tokens, lengths)
    counts = lengths * before_min_tokens
    ban_offsets = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=ban_offsets[1:])
    return ban_offsets, ids[keep]


def _logit_bias(inputs: Mapping, rows: int, id_lists: tuple[np.ndarray, np.ndarray]):
    offsets, ids = id_lists
    values = inputs.get("logit_bias_values")
    raw_ids = inputs.get("logit_bias_ids")
    if values is None and raw_ids is None:
        return offsets, ids, np.zeros(0, np.float64)
    if values is None or raw_ids is None:
        raise InvalidRequest("logit_bias_ids and logit_bias_values must be sent together")
    values = _per_row_array("logit_bias_values", values, rows, width=None)
    if values.shape != np.shape(raw_ids):
        raise InvalidRequest(f"logit_bias_values must have the shape of logit_bias_ids "
                           f"{list(np.shape(raw_ids))}, got {list(values.shape)}")
    return offsets, ids, values[np.asarray(raw_ids) != PADDING].astype(np.float64)
