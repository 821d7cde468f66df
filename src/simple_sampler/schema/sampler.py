"""The simple_sampler model's tensors: logits (or the hot-first handoff's
compact rows, or a row arena's references) and each row's parameters in,
the drawn token out."""
from __future__ import annotations

import numpy as np

from ..histories import HISTORY_REF_COLUMNS
from ..params import BIAS_ALLOWED
from ..sampling import MAX_TOP_LOGPROBS
from ..settings import LOGITS_ITEMSIZE
from .tensors import TOP_OUTPUTS, Model, Tensor, sampling_tensors, scalar


def _id_list(name, default="none", allowed="token ids, -1 padded"):
    return Tensor(name, "INT32", (-1,), default=default, allowed=allowed)


_LOGITS_DTYPES = tuple(dtype.upper() for dtype in LOGITS_ITEMSIZE)
#: The compact rows of the hot-first handoff (docs/HANDOFF.md), sent instead
#: of logits to a sampler with a hot set.
HANDOFF_INPUTS = (
    Tensor("hot_logits", "FP32", (-1,), default="none (logits come whole)",
           allowed="[B, H] raw logits of the sampler's H hot ids, ascending",
           dtypes=_LOGITS_DTYPES),
    _id_list("touched_ids", allowed="each row's ids outside H that bias, bans or penalties "
                                    "change (and any others handed over), ascending, -1 padded"),
    Tensor("touched_logits", "FP32", (-1,), default="none",
           allowed="their raw logits, shaped as touched_ids"),
    scalar("cold_max", "FP32", "none", "max raw logit of the ids not handed over (C)"),
    scalar("cold_argmax", "INT32", "none", "the lowest id of C reaching cold_max; -1 exactly when "
            "cold_max is -inf"),
    scalar("cold_mass", "FP32", "none", "sum over C of exp(x / T - cold_max / T): finite, "
            ">= 0"),
)
#: With compact rows, optionally: a token the data plane drew inside C on the
#: row's cold stream (handoff.cold_draws), which decides a NEED_COLD row
#: without its full row.
COLD_DRAW_INPUTS = (
    scalar("cold_token", "INT32", "none (-1: not drawn)",
            "-1, or an id of C drawn with P(t) = w_t / W_C on the row's cold stream"),
    scalar("cold_token_logit", "FP32", "none", "cold_token's raw logit (<= cold_max)"),
)


def _packed(name: str, fields: tuple, record: str, default: str, rule: str):
    """(the record dtype, the UINT8 tensor) that carry `fields` (scalar
    tensors) as one record per row, aligned as C aligns a struct of them;
    `record` names the dtype here, `rule` says what a record must hold.
    Each tensor crossing BLS costs the python backend a shared-memory
    allocation, a copy and a Python object on both sides (docs/COPIES.md,
    "Profiling the sampler stub"): the packed tensor is one."""
    dtype = np.dtype([(t.name, t.numpy) for t in fields], align=True)
    return dtype, Tensor(
        # its width declared: Triton refuses another layout's (another version's) by its
        # shape, and a remote endpoint's is read from its configuration (RemoteSampler.check)
        name, "UINT8", (dtype.itemsize,), default=default,
        allowed=f"[B, {dtype.itemsize}]: per row one record of "
                f"{', '.join(t.name for t in fields)} in those tensors' dtypes, little-endian, "
                f"C struct alignment (schema.{record}); {rule}, and none of those tensors "
                f"with it")


#: The cold summary's five fields (HANDOFF_INPUTS[3:], COLD_DRAW_INPUTS), every
#: row's in one tensor, as row_scalars packs the parameters.
COLD_SUMMARY_FIELDS = (*HANDOFF_INPUTS[3:], *COLD_DRAW_INPUTS)
COLD_SUMMARY_RECORD, COLD_SUMMARY = _packed(
    "cold_summary", COLD_SUMMARY_FIELDS, "COLD_SUMMARY_RECORD", "none (each field its own tensor)",
    "cold_token -1 where none was drawn")
#: Rows the llm process placed in its shared-memory row arena (row_arena.py),
#: named instead of sent: same-host sampler instances only.
LOGITS_REF = Tensor("logits_ref", "INT64", (6,), default="none (logits come in the request)",
                    allowed="per row: region key, slot, generation, byte offset, V, dtype code "
                            "(row_arena.REF_COLUMNS); beside compact rows, their full rows for "
                            "the rows the compact ones cannot decide")
#: The rows' prompt and generated ids in the llm process's shared token
#: histories (histories.py), named instead of sent: same-host sampler instances only.
HISTORY_REF = Tensor("history_ref", "INT64", (len(HISTORY_REF_COLUMNS),),
                     default="none (prompt_ids and generated_ids come in the request)",
                     allowed="per row: region key, then [start, stop) of its prompt ids and of its "
                             "generated ids in the region's int32 data (histories."
                             "HISTORY_REF_COLUMNS), each range within one row of the region, every row the "
                             "same region; instead of prompt_ids and generated_ids")
#: The sampler's per-row parameters, one [B, 1] tensor each, or all of them
#: packed into ``row_scalars`` (ROW_SCALARS_RECORD).
_SAMPLER_SCALARS = (
    *sampling_tensors("runtime_top_k", "runtime_top_p"),
    scalar("random_seed", "UINT64", "a fresh random seed per row", "[0, 2^64)",
            param="seed"),
    scalar("step", "INT64", "the number of generated_ids", ">= 0; keys the draw"),
    scalar("min_tokens", "INT32", param="min_tokens",
            allowed=">= 0: end_id banned while step < it"),
    scalar("return_log_probs", "BOOL", False, "output_log_probs for this row"),
    scalar("num_top_logprobs", "INT32", 0, f"[0, {MAX_TOP_LOGPROBS}]"),
    scalar("raw_logprobs", "BOOL", False,
            "true: the row's output_log_probs and top logprobs are its logits' own log_softmax, "
            "before bias, bans, penalties and temperature (vLLM's raw_logprobs); its token is "
            "drawn as without them"),
    scalar("given_token_id", "INT32", -1,
           "[-1, V); >= 0: the row's token, decided already (the hot-first handoff's compact "
           "decision): output_ids echoes it and the logprobs asked are its own (full rows "
           "only); -1: drawn here"),
)
#: The parameters of every row in one tensor: the scalar tensors above, in
#: that order and dtype, one record per row.
ROW_SCALARS_RECORD, ROW_SCALARS = _packed(
    "row_scalars", _SAMPLER_SCALARS, "ROW_SCALARS_RECORD", "none (each parameter its own tensor)",
    "every field is sent (no defaults)")

SAMPLER = Model("simple_sampler", (
    Tensor("logits", "FP32", (-1,), default="required unless hot_logits or logits_ref",
           allowed="finite or -inf, and finite in float32 once bias, penalties and temperature "
                   "apply (a logit of 3e38 at temperature 0.5 is refused); [B, V] next-token logits",
           dtypes=_LOGITS_DTYPES),
    *_SAMPLER_SCALARS[:9],
    _id_list("prompt_ids", allowed="token ids, -1 padded (repetition penalty)"),
    _id_list("generated_ids", allowed="token ids, -1 padded (all penalties)"),
    _id_list("logit_bias_ids", allowed="token ids, -1 padded"),
    Tensor("logit_bias_values", "FP32", (-1,), default="none",
           allowed=f"{BIAS_ALLOWED}, shaped as logit_bias_ids"),
    _SAMPLER_SCALARS[9],
    _id_list("end_id", allowed="token ids, -1 padded (min_tokens)"),
    *_SAMPLER_SCALARS[10:],
    ROW_SCALARS,
    *HANDOFF_INPUTS,
    *COLD_DRAW_INPUTS,
    COLD_SUMMARY,
    LOGITS_REF,
    HISTORY_REF,
    scalar("hot_vocab_fingerprint", "INT64", "none (not checked)",
            "the hot set the caller's other samplers hold (shvs.hot_vocab.fingerprint; 0: "
            "none): refused unless it is this sampler's own"),
), (
    Tensor("output_ids", "INT32", optional=False),
    Tensor("output_log_probs", "FP32", optional=False),
    Tensor(TOP_OUTPUTS[0], "INT32", (-1,), optional=False),
    Tensor(TOP_OUTPUTS[1], "FP32", (-1,), optional=False),
    Tensor("handoff_outcome", "INT8", optional=False),
))
