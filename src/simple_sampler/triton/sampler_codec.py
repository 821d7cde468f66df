"""The `simple_sampler` model's tensors: their names, and encoded
(``batch_arrays``, ``compact_arrays``: what the llm model and clients send).
Decoded and checked: ``sampler_decode.decode_request``; sampled and served
(the sampler model's entry): ``sampler_serve.serve_request``, the llm
model's compact requests by one C call (``sampler_packed``). All without a
server.

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

from typing import Mapping

import numpy as np

from ..params import NON_NEGATIVE, PARAMS, RULES, Interval, SamplingBatch, any_on
from ..sampling import MAX_TOP_LOGPROBS
from ..schema import (COLD_DRAW_INPUTS, COLD_SUMMARY_RECORD, HANDOFF_INPUTS, ROW_SCALARS_RECORD,
                      SAMPLER)

PADDING = -1
#: What pads a row's top logprobs (schema.TOP_OUTPUTS) beyond its own n.
TOP_PADDING = ((PADDING, np.int32), (-np.inf, np.float32))

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
#: (tensor name, its RULES entry) for every checked column
RULE_INPUTS = tuple((name, param) for param in RULES
                     for name, (column, _) in SCALAR_INPUTS.items() if column == param.name)
#: The inputs ``row_scalars`` packs (schema.ROW_SCALARS_RECORD's fields).
PACKED_INPUTS = ROW_SCALARS_RECORD.names
#: decode_request's checks beyond params.RULES: (input, its interval, the
#: allowed range as an error states it).
EXTRA_CHECKS = (("step", NON_NEGATIVE, ">= 0"), ("min_tokens", NON_NEGATIVE, ">= 0"),
                 ("num_top_logprobs", Interval(0, MAX_TOP_LOGPROBS), f"in [0, {MAX_TOP_LOGPROBS}]"))



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
    all when none has; a batch's ``history_ref`` as it is (only a sampler
    that maps its region reads it: ``SamplerPool`` sends others the lists).
    """
    if packed:
        return _packed_arrays(batch)
    batch = batch.with_histories()
    arrays = {}
    for name, (field, _) in SCALAR_INPUTS.items():
        arrays[name] = np.asarray(getattr(batch, field), dtype=SAMPLER.input(name).numpy)[:, None]
    arrays["random_seed"] = np.asarray(batch.seed, np.uint64)[:, None]
    arrays["step"] = np.asarray(batch.step, np.int64)[:, None]
    if batch.raw_logprobs is not None:
        arrays["raw_logprobs"] = np.asarray(batch.raw_logprobs, bool)[:, None]
    if batch.given_token_ids is not None:
        arrays["given_token_id"] = np.asarray(batch.given_token_ids, np.int32)[:, None]
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
    if batch.num_top_logprobs is not None:
        records["num_top_logprobs"] = batch.num_top_logprobs
    if batch.raw_logprobs is not None:
        records["raw_logprobs"] = batch.raw_logprobs
    records["given_token_id"] = -1 if batch.given_token_ids is None else batch.given_token_ids
    arrays = {"row_scalars": records.view(np.uint8).reshape(size, ROW_SCALARS_RECORD.itemsize)}
    bans = np.diff(batch.ban_offsets)
    if bans.any():
        records["min_tokens"] = np.where(bans > 0, np.asarray(batch.step, np.int64) + 1, 0)
        arrays["end_id"] = padded(batch.ban_offsets, batch.ban_ids)
    if np.size(batch.bias_ids):
        arrays["logit_bias_ids"] = padded(batch.bias_offsets, batch.bias_ids)
        arrays["logit_bias_values"] = padded(batch.bias_offsets, batch.bias_values, np.float32, 0.0)
    penalized = any_on(batch, "penalty")
    if penalized.any() and batch.history_ref is not None:
        arrays["history_ref"] = _named_histories(batch, penalized)
    elif penalized.any():
        for name, offsets, ids in (("prompt_ids", batch.prompt_offsets, batch.prompt_ids),
                                   ("generated_ids", batch.output_offsets, batch.output_ids)):
            lengths = np.where(penalized, np.diff(offsets), 0)
            kept = np.repeat(penalized, np.diff(offsets))
            arrays[name] = padded(np.r_[0, np.cumsum(lengths)], np.asarray(ids)[kept])
    return arrays


def _named_histories(batch: SamplingBatch, penalized: np.ndarray) -> np.ndarray:
    """The batch's ``history_ref`` with the ranges no penalty reads emptied
    (the prompt's without a repetition penalty, the output's without any): a
    row whose penalties were turned off after the batch was built (hot-first's
    second round, ``handoff.fallback_batch``) names nothing to gather."""
    refs = batch.history_ref.refs.copy()
    unread = np.asarray(batch.repetition_penalty) == 1.0
    refs[unread, 2] = refs[unread, 1]
    refs[~penalized, 4] = refs[~penalized, 3]
    return refs


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


def decided_all(outcome: np.ndarray) -> bool:
    """No row left undecided: ``handoff_outcome`` is then not sent (the
    reader takes its absence for all 0, ``outcome_of``)."""
    return not outcome.any()


def outcome_of(outputs: Mapping[str, np.ndarray], rows: int) -> np.ndarray:
    """A compact request's ``handoff_outcome`` [rows, 1] int8, all 0
    (decided) where the sampler sent none (``decided_all``)."""
    outcome = outputs.get("handoff_outcome")
    return np.zeros((rows, 1), np.int8) if outcome is None else outcome
