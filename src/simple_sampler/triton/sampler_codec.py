"""The `simple_sampler` model's tensors, encoded (``batch_arrays``,
``compact_arrays``: what the llm model and clients send) and decoded,
checked and sampled (``serve_request``, the sampler model's entry: the llm
model's compact requests by one C call, every other request by
``decode_request`` and ``sample_request``), without a server.

A request carries B rows. The inputs' names, dtypes, defaults and ranges
are ``schema.SAMPLER``'s (tabulated in docs/TENSORS.md); shapes include the
batch dimension: logits [B, V] in the model's configured dtype, scalars
[B, 1], id lists [B, L] right-padded with -1 (-1 entries are padding and
nothing else is negative). Instead of logits, a sampler with a hot set
(hot_vocab_profile) takes compact rows: ``schema.HANDOFF_INPUTS`` (the
hot-first handoff, docs/HANDOFF.md), answered with the extra output
``handoff_outcome`` INT8 [B, 1] when a row is left undecided (absent: every
row decided, the common case; one tensor fewer to build, copy through the
server and read per request) (0 decided, 1 the row is needed whole, 2
needed whole and conditioned on C; undecided rows' output_ids are -1 and a
row 2's output_log_probs holds C's log share, unless the request also
carried ``logits_ref`` naming the rows' full rows in the llm's arena: then
the sampler decides them from those in the same request, as the second
round would, and their output_ids hold the token, their outcome still 1 or 2). Outputs: ``output_ids`` INT32 [B, 1];
``output_log_probs`` FP32 [B, 1] when any row asked (NaN on rows that did
not); ``top_logprobs_ids`` INT32 / ``top_logprobs`` FP32 [B, n] when any row
asked for n > 0 (n = the largest asked; a row that asked fewer has -1 / -inf
beyond its own n). The semantics are ``simple_sampler.sampling``'s.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Mapping, NamedTuple

import numpy as np

from .. import _sampling
from .._sampling import FieldType
from ..handoff import CompactRows, decide_from_full_rows, host_array, sample_compact
from ..row_arena import REF_COLUMNS
from ..params import (GREEDY_TEMPERATURE, NON_NEGATIVE, PARAMS, RULES, Interval, SamplingBatch,
                      any_on, first_failed_check)
from ..sampling import KERNEL_FIELDS, MAX_TOP_LOGPROBS, ROW_SCALARS, kernel_rows, sample
from ..schema import (COLD_DRAW_INPUTS, COLD_SUMMARY_RECORD, HANDOFF_INPUTS, ROW_SCALARS_RECORD,
                      SAMPLER, InvalidRequest)

PADDING = -1

#: tensor name -> (SamplingBatch column, default value), for the parameters RULES checks
SCALAR_INPUTS = {t.name: (t.param, t.default) for t in SAMPLER.inputs
                 if t.param in PARAMS}
#: The compact form of the rows (module docstring), instead of logits.
COMPACT_INPUTS = tuple(t.name for t in HANDOFF_INPUTS)
#: With compact rows, optionally: the data plane's cold draw (both or neither).
COLD_DRAW_NAMES = tuple(t.name for t in COLD_DRAW_INPUTS)
#: The inputs ``cold_summary`` packs (schema.COLD_SUMMARY_RECORD's fields).
COLD_SUMMARY_NAMES = COLD_SUMMARY_RECORD.names
ID_LIST_INPUTS = tuple(t.name for t in SAMPLER.inputs if t.dtype == "INT32" and not t.scalar
                       and t.name not in COMPACT_INPUTS)
INPUT_NAMES = SAMPLER.input_names
_KNOWN_INPUTS = frozenset(INPUT_NAMES)
#: (tensor name, its RULES entry) for every checked column
_RULE_INPUTS = tuple((name, param) for param in RULES
                     for name, (column, _) in SCALAR_INPUTS.items() if column == param.name)
#: The inputs ``row_scalars`` packs (schema.ROW_SCALARS_RECORD's fields).
PACKED_INPUTS = ROW_SCALARS_RECORD.names
#: The dtype each per-row scalar input is decoded to (the batch's columns').
_DECODED = {**{name: PARAMS[field].dtype for name, (field, _) in SCALAR_INPUTS.items()},
            "random_seed": np.uint64, "step": np.int64, "min_tokens": np.int64,
            "num_top_logprobs": np.int64, "return_log_probs": np.bool_}
#: ``row_scalars``' records in those dtypes: one astype decodes every column.
_DECODED_RECORD = np.dtype([(name, _DECODED[name]) for name in PACKED_INPUTS])
_PACKED_SET = frozenset(PACKED_INPUTS)
#: decode_request's checks beyond params.RULES: (input, its interval, the
#: allowed range as an error states it).
_EXTRA_CHECKS = (("step", NON_NEGATIVE, ">= 0"), ("min_tokens", NON_NEGATIVE, ">= 0"),
                 ("num_top_logprobs", Interval(0, MAX_TOP_LOGPROBS), f"in [0, {MAX_TOP_LOGPROBS}]"))

#: The llm model's own compact requests (``hot_first_sampler``: the packed
#: parameters, the compact rows, their full rows by reference and the rows'
#: end ids or not), which ``serve_request`` decides in one C call.
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
#: The checks of a packed record: RULES' and _EXTRA_CHECKS', by input.
_RECORD_CHECKS = (*((name, param.rule) for name, param in _RULE_INPUTS),
                  *((name, rule) for name, rule, _ in _EXTRA_CHECKS))
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
    #: again after sampling: ``row_arena.RowReader.check``)
    logits_ref: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.batch)


def _rows_of(name: str, array: np.ndarray, rows: int, width: int | None = 1) -> np.ndarray:
    array = np.asarray(array)
    if array.ndim != 2 or array.shape[0] != rows or (width is not None and array.shape[1] != width):
        expected = f"[{rows}, {width if width is not None else 'L'}]"
        raise InvalidRequest(f"{name} must have shape {expected} (one row per logits row), "
                           f"got {list(array.shape)}")
    return array


def _scalar(inputs: Mapping, name: str, rows: int, default, dtype) -> np.ndarray:
    if inputs.get(name) is None:
        return np.full(rows, default, dtype=dtype)
    return _rows_of(name, inputs[name], rows)[:, 0].astype(dtype)


_NO_IDS = np.zeros(0, np.int64)


def _id_lists(name: str, padded, rows: int, vocab: int, values=None):
    """CSR (offsets int64, ids) of a -1 padded [B, L] input with every id
    checked, and the float32 entries of `values` (same shape) at those ids
    when given. int32 ids (the schema's) in one Cython pass
    (``_sampling.padded_lists``), others through numpy."""
    padded = _rows_of(name, padded, rows, width=None)
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
    reader: a ``row_arena.RowReader`` the rows of ``logits_ref`` are read
        through, in place (None: logits_ref is refused).
    Raises InvalidRequest naming the input, the row and the allowed range.
    """
    unknown = sorted(inputs.keys() - _KNOWN_INPUTS)
    if unknown:
        raise InvalidRequest(f"unknown input {unknown[0]}; the sampler takes "
                             f"{', '.join(INPUT_NAMES)}")
    records = _records(inputs) if inputs.get("row_scalars") is not None else None
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
    elif any(inputs.get(name) is not None for name in (*COLD_DRAW_NAMES, "cold_summary")):
        raise InvalidRequest(f"{' and '.join(COLD_DRAW_NAMES)} (or cold_summary) come with "
                             f"compact rows (hot_logits, ...)")
    elif logits is None:
        raise InvalidRequest("logits is required: [B, V] next-token logits")
    else:
        rows, vocab = _logits_shape(logits)
    if vocab_size and vocab != vocab_size:
        raise InvalidRequest(f"logits must have {vocab_size} columns (the model's vocabulary), "
                           f"got {vocab}")

    if records is None:
        def scalar(name, default):
            return _scalar(inputs, name, rows, default, _DECODED[name])
    else:
        if len(records) != rows:
            raise InvalidRequest(f"row_scalars must have shape [{rows}, "
                                 f"{ROW_SCALARS_RECORD.itemsize}] (one row per logits row), "
                                 f"got [{len(records)}, {ROW_SCALARS_RECORD.itemsize}]")
        decoded = records.astype(_DECODED_RECORD)

        def scalar(name, default):
            return decoded[name]
    columns = {field: scalar(name, default) for name, (field, default) in SCALAR_INPUTS.items()}
    # absent: every row's history length (the lists are read below)
    step = (scalar("step", None)
            if records is not None or inputs.get("step") is not None else None)
    min_tokens = scalar("min_tokens", 0)
    num_top = scalar("num_top_logprobs", 0)
    checks = [(name, columns[param.name], param.rule(columns[param.name]), param.allowed)
              for name, param in _RULE_INPUTS]
    extra = {"step": step, "min_tokens": min_tokens, "num_top_logprobs": num_top}
    checks += [(name, extra[name], rule(extra[name]), allowed)
               for name, rule, allowed in _EXTRA_CHECKS if extra[name] is not None]
    message = first_failed_check(checks)
    if message:
        raise InvalidRequest(message)

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
    generated_offsets = lists["generated_ids"][0]
    if step is None:
        step = np.diff(generated_offsets)
    end_ids = lists["end_id"]
    ban_offsets, ban_ids = (end_ids if not end_ids[1].size
                            else _banned_end_ids(*end_ids, step < min_tokens))
    bias_offsets, bias_ids, bias_values = _logit_bias(inputs, rows, lists["logit_bias_ids"])
    batch = SamplingBatch(
        **columns, seed=seed, step=step,
        bias_offsets=bias_offsets, bias_ids=bias_ids, bias_values=bias_values,
        ban_offsets=ban_offsets, ban_ids=ban_ids,
        prompt_offsets=lists["prompt_ids"][0], prompt_ids=lists["prompt_ids"][1],
        output_offsets=generated_offsets, output_ids=lists["generated_ids"][1],
    )
    try:  # the scalars, steps and ids were checked above, the offsets built here
        batch.validate_bias(vocab)
    except ValueError as error:
        raise InvalidRequest(str(error)) from None
    return RowsRequest(logits, batch, scalar("return_log_probs", False),
                       num_top, compact, refs)


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
    touched = _rows_of("touched_ids", inputs["touched_ids"], rows, width=None)
    logits = _rows_of("touched_logits", inputs["touched_logits"], rows, width=None)
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
        cold = {name: _rows_of(name, inputs[name], rows)[:, 0]
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


def padded(offsets: np.ndarray, values: np.ndarray, dtype=np.int32, fill=PADDING) -> np.ndarray:
    """CSR lists as a [B, L] array right-padded with `fill` (L >= 1)."""
    lengths = np.diff(offsets)
    out = np.full((len(lengths), max(1, int(lengths.max(initial=0)))), fill, dtype=dtype)
    out[np.arange(out.shape[1])[None, :] < lengths[:, None]] = values
    return out


def batch_arrays(batch: SamplingBatch, packed: bool = False) -> dict[str, np.ndarray]:
    """The sampler inputs that carry `batch` (the inverse of decode_request).

    Banned ids travel as a logit bias of -inf, which the kernels treat
    exactly as a ban (a ban overrides any bias the same id had), so a batch
    from the decode loop (stop ids before min_tokens, bad words) needs no
    tensor of its own.

    packed: the fewest tensors (the sampler pool's form; each tensor costs
    the python backend per request, docs/COPIES.md): every per-row
    parameter in ``row_scalars``, return_log_probs from ``want_logprobs``
    (None: every row) among them; the bans as ``end_id`` with min_tokens =
    step + 1 (banned at this step, exactly as above); the histories only
    for the rows with a penalty on (no other row reads them), and not at
    all when none has.
    """
    if packed:
        return _packed_arrays(batch)
    arrays = {}
    for name, (field, _) in SCALAR_INPUTS.items():
        arrays[name] = np.asarray(getattr(batch, field), dtype=SAMPLER.input(name).numpy)[:, None]
    arrays["random_seed"] = np.asarray(batch.seed, np.uint64)[:, None]
    arrays["step"] = np.asarray(batch.step, np.int64)[:, None]
    arrays["prompt_ids"] = padded(batch.prompt_offsets, batch.prompt_ids)
    arrays["generated_ids"] = padded(batch.output_offsets, batch.output_ids)
    bias_offsets, bias_ids, bias_values = _bias_with_bans(batch)
    if bias_ids.size:
        arrays["logit_bias_ids"] = padded(bias_offsets, bias_ids)
        arrays["logit_bias_values"] = padded(bias_offsets, bias_values, np.float32, 0.0)
    return arrays


def _packed_arrays(batch: SamplingBatch) -> dict[str, np.ndarray]:
    size = len(batch)
    records = np.zeros(size, ROW_SCALARS_RECORD)
    for name, (field, _) in SCALAR_INPUTS.items():
        records[name] = getattr(batch, field)
    records["random_seed"] = batch.seed
    records["step"] = batch.step
    records["return_log_probs"] = True if batch.want_logprobs is None else batch.want_logprobs
    arrays = {"row_scalars": records.view(np.uint8).reshape(size, ROW_SCALARS_RECORD.itemsize)}
    bans = np.diff(batch.ban_offsets)
    if bans.any():
        records["min_tokens"] = np.where(bans > 0, np.asarray(batch.step, np.int64) + 1, 0)
        arrays["end_id"] = padded(batch.ban_offsets, batch.ban_ids)
    if np.size(batch.bias_ids):
        arrays["logit_bias_ids"] = padded(batch.bias_offsets, batch.bias_ids)
        arrays["logit_bias_values"] = padded(batch.bias_offsets, batch.bias_values, np.float32, 0.0)
    penalized = any_on(batch, "penalty")
    if penalized.any():
        for name, offsets, ids in (("prompt_ids", batch.prompt_offsets, batch.prompt_ids),
                                   ("generated_ids", batch.output_offsets, batch.output_ids)):
            lengths = np.where(penalized, np.diff(offsets), 0)
            kept = np.repeat(penalized, np.diff(offsets))
            arrays[name] = padded(np.r_[0, np.cumsum(lengths)], np.asarray(ids)[kept])
    return arrays


def _bias_with_bans(batch: SamplingBatch):
    """CSR bias lists where every banned id is -inf (once per row), built
    with numpy (no loop over rows: this runs for every step's batch)."""
    bans = np.diff(batch.ban_offsets)
    if not bans.any():
        return batch.bias_offsets, batch.bias_ids, np.asarray(batch.bias_values, np.float64)
    rows = np.arange(len(batch))
    row = np.concatenate([np.repeat(rows, np.diff(batch.bias_offsets)), np.repeat(rows, bans)])
    ids = np.concatenate([batch.bias_ids, batch.ban_ids]).astype(np.int64)
    values = np.concatenate([batch.bias_values, np.full(batch.ban_ids.size, -np.inf)])
    is_ban = np.concatenate([np.zeros(batch.bias_ids.size, bool), np.ones(batch.ban_ids.size, bool)])
    order = np.lexsort((~is_ban, ids, row))  # by row, then id, a ban before a bias
    row, ids, values = row[order], ids[order], values[order]
    first = np.ones(row.size, bool)  # the first entry of each (row, id): the ban if any
    first[1:] = (row[1:] != row[:-1]) | (ids[1:] != ids[:-1])
    offsets = np.zeros(len(batch) + 1, np.int64)
    np.cumsum(np.bincount(row[first], minlength=len(batch)), out=offsets[1:])
    return offsets, ids[first], values[first]


def compact_arrays(rows, packed: bool = False) -> dict[str, np.ndarray]:
    """The inputs that carry ``handoff.CompactRows`` (``cpu()`` form): the
    inverse of decode_request's compact branch. packed: the cold summary
    in one ``cold_summary`` tensor (the fewest tensors: the llm model's
    form), its cold_token -1 on every row when `rows` has none."""
    arrays = {"hot_logits": rows.hot_logits,
              "touched_ids": padded(rows.touched_offsets, rows.touched_ids),
              "touched_logits": padded(rows.touched_offsets, rows.touched_logits, np.float32, 0.0)}
    names = COLD_SUMMARY_NAMES if rows.cold_token is not None else COMPACT_INPUTS[3:]
    if packed:
        records = np.zeros(len(rows.cold_max), COLD_SUMMARY_RECORD)
        records["cold_token"] = -1
        for name in names:
            records[name] = getattr(rows, name)
        arrays["cold_summary"] = records.view(np.uint8).reshape(len(records), -1)
        return arrays
    for name in names:
        arrays[name] = np.asarray(getattr(rows, name), COLD_SUMMARY_RECORD[name])[:, None]
    return arrays


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
    values = _rows_of("logit_bias_values", values, rows, width=None)
    if values.shape != np.shape(raw_ids):
        raise InvalidRequest(f"logit_bias_values must have the shape of logit_bias_ids "
                           f"{list(np.shape(raw_ids))}, got {list(values.shape)}")
    return offsets, ids, values[np.asarray(raw_ids) != PADDING].astype(np.float64)


def decided_all(outcome: np.ndarray) -> bool:
    """No row left undecided: ``handoff_outcome`` is then not sent (the
    reader takes its absence for all 0, ``outcome_of``)."""
    return not outcome.any()


def outcome_of(outputs: Mapping[str, np.ndarray], rows: int) -> np.ndarray:
    """A compact request's ``handoff_outcome`` [rows, 1] int8, all 0
    (decided) where the sampler sent none (``decided_all``)."""
    outcome = outputs.get("handoff_outcome")
    return np.zeros((rows, 1), np.int8) if outcome is None else outcome


class Served(NamedTuple):
    """``serve_request``'s answer: the output tensors, the rows' SHVS
    outcomes (as ``sample_request``'s), the rows, how many undecided compact
    rows were decided from their full rows in place, and the decoded batch
    (None where the C path decided the request: no row was tried by SHVS)."""

    outputs: dict[str, np.ndarray]
    outcomes: np.ndarray
    rows: int
    in_place: int
    batch: SamplingBatch | None


def serve_request(inputs: Mapping[str, object], vocab_size: int = 0, hot_vocab=None,
                  reader=None, num_threads: int = 1) -> Served:
    """One request to the sampler model, what its ``execute`` runs:
    ``decode_request``, ``sample_request`` and, for rows read from the
    llm's arena, the check that their slot was not reused meanwhile
    (``RowReader.check``, StaleRows). The llm model's own compact requests
    (_PLAIN_COMPACT, end_id and logits_ref or not) are decided by one C call
    (``_sampling.decide_packed_compact``) where the general path makes a
    few hundred Python calls (docs/COPIES.md); a request that call does not
    take (top logprobs, or anything it would refuse: the general path names
    what is wrong), and one whose undecided rows are to be decided from
    their full rows in place, goes the general way: the same outputs
    (tests/test_sampler_io.py). On the C path ``logits_ref`` is resolved
    (mapped, its region, slot and generation checked) only when a row is
    left undecided, the only case that reads it; a request that references
    the wrong number of rows is refused either way. Raises InvalidRequest as
    decode_request and sample_request do."""
    if (hot_vocab is not None and inputs.get("hot_logits") is not None
            and inputs.keys() <= _PLAIN_COMPACT_INPUTS):
        served = _serve_plain_compact(inputs, vocab_size, hot_vocab, reader, num_threads)
        if served is not None:
            return served
    request = decode_request(inputs, vocab_size, hot_vocab, reader)
    outputs, outcomes = sample_request(request, num_threads, hot_vocab)
    if request.logits_ref is not None:
        reader.check(request.logits_ref)
    outcome = outputs.get("handoff_outcome")
    in_place = (int((outcome != 0).sum())
                if outcome is not None and request.logits is not None else 0)
    return Served(outputs, outcomes, len(request), in_place, request.batch)


def _serve_plain_compact(inputs: Mapping, vocab_size: int, hot_vocab, reader,
                         num_threads: int) -> Served | None:
    """serve_request's C path, or None where the general one must answer."""
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
    return Served(outputs, np.full(rows, -1, np.int8), rows, 0, None)


def sample_request(request: RowsRequest, num_threads: int = 1,
                   hot_vocab=None) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Sample one request from ``decode_request`` (whose batch is checked, so
    ``sample`` does not check it again); returns (output name -> array, the rows'
    SHVS outcomes int8 [B]: 1 decided from the hot set, 0 fell back, -1 not
    tried). `hot_vocab`: a ``HotVocab`` or None (SHVS off).

    Raises InvalidRequest for a row the kernels refuse (NaN or +inf logits,
    every token banned), naming the row and column.
    """
    want_logprob = bool(request.return_log_probs.any())
    n_top = int(request.num_top_logprobs.max())
    try:
        if request.compact is not None:
            out = sample_compact(request.compact, request.batch, hot_vocab,
                                 num_top_logprobs=n_top, return_logprobs=want_logprob,
                                 num_threads=num_threads, validated=True, shapes_checked=True)
            if request.logits is not None and out.undecided.any():  # their full rows are mapped
                decide_from_full_rows(out, request.compact, request.batch, hot_vocab,
                                      request.logits, request.return_log_probs,
                                      num_top_logprobs=n_top, num_threads=num_threads)
        else:
            out = sample(request.logits, request.batch, num_top_logprobs=n_top,
                         return_logprobs=want_logprob, num_threads=num_threads,
                         hot_vocab=hot_vocab, validated=True)  # decode_request checked the batch
    except ValueError as error:
        raise InvalidRequest(str(error)) from None
    outputs = {"output_ids": out.token_ids.astype(np.int32)[:, None]}
    if request.compact is not None and not decided_all(out.outcome):
        outputs["handoff_outcome"] = out.outcome[:, None]
    if want_logprob:
        outputs["output_log_probs"] = np.where(request.return_log_probs, out.logprobs,
                                               np.float32(np.nan))[:, None].astype(np.float32)
    if n_top:
        beyond = np.arange(n_top)[None, :] >= request.num_top_logprobs[:, None]
        outputs["top_logprobs_ids"] = np.where(beyond, np.int32(PADDING), out.top_token_ids)
        outputs["top_logprobs"] = np.where(beyond, np.float32(-np.inf), out.top_logprobs)
    return outputs, out.hot_accepted
