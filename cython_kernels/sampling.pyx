# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Batched, exact, linear-time sampling kernels (the decision plane's core).

Order of operations per row (vLLM's, see SIMPLE.md):
  1. logit_bias, then min_tokens bans (banned ids -> -inf)
  2. repetition (prompt + output), frequency and presence (output) penalties
  3. temperature < 1e-5 (as float32): greedy (argmax of step 2, lowest id on ties)
  4. z = logit / temperature
  5. min_p: keep z >= max(z) + ln(min_p)
  6. top_k: keep z >= the k-th largest z (ties at the k-th value kept)
  7. top_p: keep the smallest rank-prefix whose mass reaches top_p of the
     mass left after 5-6 (rank = z descending, token id ascending)
  8. draw one token from what is left, renormalised.

How the work stays linear and small:
  * Steps 1-2 touch only the columns named by the bias, bans and history
    (radix-sorted overrides applied while streaming; never a [V] copy).
  * Pass 1 streams the row once in blocks of SS_BLOCK (64) columns, converting
    float16 / bfloat16 on the fly, and keeps per block its max z and (when
    a mass is needed) its softmax mass relative to that max.
  * The block summaries give a collection threshold that provably contains
    every token that can survive 5-7; pass 2 rereads only the blocks whose
    max reaches it. min_p gives the threshold exactly; top_k takes a level
    that at least k block maxima reach (found by counting them); top_p alone
    takes the highest of a ladder of levels below the max whose blocks hold
    enough mass, checks the collected mass exactly and lowers it if needed.
  * Steps 5-7 run on the collected candidates by quickselect; nothing is
    sorted. With no truncation at all, the block masses pick a block and
    only that block is reread.

Speculative hot-vocab sampling (sample_row_hot; a hot set given): for
untruncated and top_p-alone rows without logprobs, the pass replaces the exp
per logit by a cheap bound on the mass outside the hot set, and the row is
decided from the hot set and the bounds (rejection for untruncated rows, a
nucleus bracketed by the bounds for top_p) with exact corrections where
they cannot decide. Every row keeps exactly the distribution above.

One extension in parts: row.pxi (row sampling), nucleus.pxi (broad
min_p / top_p rows), hot_set.pxi (SHVS), compact.pxi (hot-first compact
rows), dlpack.pxi (reading a bfloat16 input's DLPack capsule without torch),
packed.pxi (packed requests: the codec's checks and the record interpreter),
cold.pxi (the simulated engine's cold draw), masked.pxi (grammar masks on
host rows) and this file (the entries:
KernelBatch, the per-row prologue and epilogue every entry shares,
sample_batch, sample_compact_batch). The parts are included, not separate
modules, so the row functions stay static C functions of one translation
unit that the compiler can inline across parts, as before the split.
"""
import numpy as np

from cython.parallel cimport parallel, prange
from libc.math cimport INFINITY, NAN, expf, log, nextafter, nextafterf
from libc.stdint cimport INT32_MAX, int8_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy, memset

from candidates cimport (Candidates, copy_top, keep_at_least, ranks_before, select_rank,
                         top_p_prefix)
from penalties cimport (BITMAP_MIN_ENTRIES, ColumnBits, Overrides, RowHistory, adjusted_logit,
                       build_overrides)
from philox cimport philox4x32_10, uniform_double
from nucleus cimport (ss_block_mass_before, ss_block_terms_before, ss_blocks_mass_before,
                     ss_bucket_terms)
from row_scalars cimport RowScalars, row_scalars_offsets
from scalar_math cimport (SS_BLOCK, ss_bf16_to_float, ss_block_bound, ss_block_cold_at_or_above,
                          ss_block_cold_exp_sum, ss_block_max_mass, ss_block_max_mass_bf16,
                          ss_block_pair_max_mass, ss_block_pair_max_mass_bf16,
                          ss_block_max_nan, ss_block_max_nan_bf16,
                          ss_block_peak, ss_bound_term, ss_count_at_or_above, ss_exp_array_v,
                          ss_exp_array_w, ss_exp_nonpositive, ss_exp_shifted, ss_half_to_float,
                          ss_lowest_bit, ss_mass_at_or_above)

# Storage dtypes of a logits row.
cpdef enum Dtype:
    DTYPE_FLOAT32 = 0
    DTYPE_FLOAT16 = 1
    DTYPE_BFLOAT16 = 2

# Per-row error codes reported to the Python layer (which raises ValueError).
cpdef enum RowError:
    ERROR_NONE = 0
    ERROR_NAN = 1
    ERROR_POSITIVE_INFINITY = 2
    ERROR_ALL_BANNED = 3
    ERROR_OUT_OF_MEMORY = 4
    ERROR_UNLISTED_OVERRIDE = 5     # compact rows: a bias / ban / history id not handed over
    ERROR_INTERNAL = 6              # a NaN mass with no NaN or +inf z to blame: ours, not the row's

# Per-row SHVS outcome reported to the Python layer (SampleOutput.hot_accepted).
cpdef enum HotOutcome:
    HOT_NOT_TRIED = -1      # no hot set, or a row SHVS does not take (see sample_row_hot)
    HOT_FALLBACK = 0        # tried; the exact full-row computation was needed
    HOT_ACCEPTED = 1        # decided from the hot set and cheap bounds alone

# sample_row_hot's answer when the row must go to the full path.
cdef enum:
    HOT_FALLBACK_FULL = 2

include "row.pxi"
include "nucleus.pxi"
include "hot_set.pxi"
include "compact.pxi"
include "dlpack.pxi"


cdef struct BatchInputs:
    const unsigned char* logits      # row r starts at logits + r * row_stride
    Py_ssize_t row_stride
    int dtype
    Py_ssize_t vocab
    const RowScalars* scalars        # [B]
    const int64_t* bias_offsets      # CSR lists: row r owns ids[offsets[r]:offsets[r + 1]]
    const int32_t* bias_ids
    const float* bias_values
    const int64_t* ban_offsets
    const int32_t* ban_ids
    const int64_t* prompt_offsets
    const int32_t* prompt_ids
    const int64_t* output_offsets
    const int32_t* output_ids
    bint want_logprob                # some row wants its chosen token's logprob
    Py_ssize_t n_top                 # the top-n columns of top_tokens (the most a row wants)
    # Per row (NULL: every row as above): what each row itself asked for,
    # so that no row's path (SHVS, the compact decision) depends on another's.
    const uint8_t* row_wants_logprob
    const int32_t* row_n_top
    # Per row (NULL: none): its logprobs are the raw logits' (score_raw)
    const uint8_t* row_raw_logprobs
    # Per row (NULL: none): >= 0, the row's token, decided already (the
    # hot-first handoff's compact decision): only its logprobs are computed
    const int64_t* row_given_tokens
    int64_t* tokens
    float* logprobs
    int32_t* top_tokens              # [B, n_top]
    float* top_logprobs
    int32_t* errors
    int64_t* error_columns
    HotSet hot                       # n == 0: SHVS off
    int8_t* hot_outcomes


cdef void row_setup(Py_ssize_t r, Workspace* ws, const BatchInputs* b, RowParams* params,
                    Overrides* ov) noexcept nogil:
    """Row r's parameters and its overrides (built in ws), shared by the
    full-row and compact-row entries."""
    cdef RowHistory history
    history.bias_ids = b.bias_ids + b.bias_offsets[r]
    history.bias_values = b.bias_values + b.bias_offsets[r]
    history.n_bias = b.bias_offsets[r + 1] - b.bias_offsets[r]
    history.ban_ids = b.ban_ids + b.ban_offsets[r]
    history.n_ban = b.ban_offsets[r + 1] - b.ban_offsets[r]
    history.prompt_ids = b.prompt_ids + b.prompt_offsets[r]
    history.n_prompt = b.prompt_offsets[r + 1] - b.prompt_offsets[r]
    history.output_ids = b.output_ids + b.output_offsets[r]
    history.n_output = b.output_offsets[r + 1] - b.output_offsets[r]
    params.scalars = b.scalars[r]
    history.repetition = params.scalars.repetition_penalty
    history.presence = params.scalars.presence_penalty
    history.frequency = params.scalars.frequency_penalty
    params.n_top = b.n_top if b.row_n_top == NULL else b.row_n_top[r]
    params.want_logprob = wants_logprob(b, r)
    params.forced_token = -1
    ov.column = ws.override_column
    ov.bias = ws.override_bias
    ov.output_count = ws.override_count
    ov.flags = ws.override_flags
    build_overrides(&history, ws.entry_keys, ws.entry_scratch, &ws.columns, ov)


cdef inline bint wants_logprob(const BatchInputs* b, Py_ssize_t r) noexcept nogil:
    return b.want_logprob and (b.row_wants_logprob == NULL or b.row_wants_logprob[r] != 0)


cdef inline bint scores_raw(const BatchInputs* b, Py_ssize_t r, const RowParams* params) noexcept nogil:
    """Row r's logprobs, asked, are its raw logits' (score_raw), not its sampling's."""
    return (b.row_raw_logprobs != NULL and b.row_raw_logprobs[r] != 0
            and (params.want_logprob or params.n_top > 0))


cdef inline void init_result(RowResult* result) noexcept nogil:
    result.token = -1
    result.logprob = 0.0
    result.error = ERROR_NONE
    result.error_column = -1


cdef inline bint begin_row(Py_ssize_t r, Workspace* ws, const BatchInputs* b, int8_t no_memory,
                           RowParams* params, RowResult* result, Overrides* ov) noexcept nogil:
    """The prologue of every entry's row r: its result cleared, its parameters
    and overrides built in ws. False when the workspace is missing (its
    allocation failed): the row then reports it, with outcome ``no_memory``."""
    if ws == NULL:
        b.errors[r] = ERROR_OUT_OF_MEMORY
        b.error_columns[r] = -1
        b.hot_outcomes[r] = no_memory
        return False
    init_result(result)
    row_setup(r, ws, b, params, ov)
    return True


cdef inline void finish_row(Py_ssize_t r, const RowResult* result, int8_t outcome,
                            const BatchInputs* b) noexcept nogil:
    """The epilogue of every entry's row r: its outcome and result stored."""
    b.hot_outcomes[r] = outcome
    b.tokens[r] = result.token
    b.logprobs[r] = result.logprob if wants_logprob(b, r) else NAN
    b.errors[r] = result.error
    b.error_columns[r] = result.error_column


cdef void sample_one(Py_ssize_t r, Workspace* ws, const BatchInputs* b) noexcept nogil:
    """Row r of sample_batch. Its structs live on this call's stack, so rows
    sampled by different threads share nothing but the read-only inputs."""
    cdef RowParams params
    cdef RowResult result
    cdef Overrides ov
    if not begin_row(r, ws, b, HOT_NOT_TRIED, &params, &result, &ov):
        return
    cdef RowSource src
    src.data = b.logits + r * b.row_stride
    src.dtype = b.dtype
    src.vocab = b.vocab
    # raw logprobs come from the row as given, after the token is drawn as
    # if none were asked (so the same token with or without them)
    cdef RowSource raw_src = src
    cdef bint raw = scores_raw(b, r, &params)
    cdef bint raw_logprob = params.want_logprob
    cdef Py_ssize_t raw_n_top = params.n_top
    cdef int64_t given = -1 if b.row_given_tokens == NULL else b.row_given_tokens[r]
    if raw and given >= 0:
        result.token = given
        score_raw(&raw_src, given, raw_logprob, raw_n_top, ws, &result,
                  b.top_tokens + r * b.n_top, b.top_logprobs + r * b.n_top)
        finish_row(r, &result, HOT_NOT_TRIED, b)
        return
    if raw:
        params.want_logprob = False
        params.n_top = 0
    params.forced_token = given
    if ws.penalized != NULL and ov.n >= ws.penalized_min_overrides:
        penalized_row(&src, &ov, ws.penalized)
        src.data = ws.penalized
        src.dtype = DTYPE_FLOAT32
        ov.n = 0
    # a given token is scored by the full path (SHVS draws, it scores none)
    cdef int outcome = (sample_row_hot(&src, &ov, &params, &b.hot, ws, &result) if given < 0
                        else HOT_NOT_TRIED)
    if outcome == HOT_NOT_TRIED or outcome == HOT_FALLBACK_FULL:
        sample_row(&src, &ov, &params, ws, &result,
                   b.top_tokens + r * b.n_top, b.top_logprobs + r * b.n_top)
    if raw and result.error == ERROR_NONE and result.token >= 0:
        score_raw(&raw_src, result.token, raw_logprob, raw_n_top, ws, &result,
                  b.top_tokens + r * b.n_top, b.top_logprobs + r * b.n_top)
    finish_row(r, &result, HOT_FALLBACK if outcome == HOT_FALLBACK_FULL else outcome, b)


cdef struct CompactInputs:
    const int32_t* hot_position     # [V]: index of an id in the hot ids, -1 when not hot
    const int64_t* touched_offsets  # [B + 1]
    const int32_t* touched_ids
    const float* touched_logits
    const float* cold_max           # [B]
    const int64_t* cold_argmax
    const float* cold_mass
    const int64_t* cold_token       # [B] the data plane's draw inside C, -1 none (NULL: none sent)
    const float* cold_token_logit


cdef void compact_one(Py_ssize_t r, Workspace* ws, const BatchInputs* b,
                      const CompactInputs* k) noexcept nogil:
    """Row r of sample_compact_batch (b's logits are the hot logits)."""
    cdef RowParams params
    cdef RowResult result
    cdef Overrides ov
    if not begin_row(r, ws, b, HANDOFF_DECIDED, &params, &result, &ov):
        return
    if scores_raw(b, r, &params):  # the raw logprobs need the whole row
        finish_row(r, &result, HANDOFF_NEED_FULL, b)
        return
    cdef CompactRow row
    row.hot = b.logits + r * b.row_stride
    row.dtype = b.dtype
    row.hot_ids = b.hot.ids
    row.hot_position = k.hot_position
    row.n_hot = b.hot.n
    row.touched_ids = k.touched_ids + k.touched_offsets[r]
    row.touched_logits = k.touched_logits + k.touched_offsets[r]
    row.n_touched = k.touched_offsets[r + 1] - k.touched_offsets[r]
    row.cold_max = k.cold_max[r]
    row.cold_argmax = k.cold_argmax[r]
    row.cold_mass = k.cold_mass[r]
    cdef int outcome = compact_row(&row, &ov, &params, ws, &result,
                                   b.top_tokens + r * b.n_top, b.top_logprobs + r * b.n_top)
    cdef float inv_t
    if outcome == HANDOFF_NEED_COLD and k.cold_token != NULL and k.cold_token[r] >= 0:
        # The data plane drew the token inside C (docs/HANDOFF.md, "The cold
        # draw"): its logprob is C's log share plus log(w_t / W_C) =
        # (z_t - zc) - log S_C, the second round's sum.
        inv_t = params.scalars.inverse_temperature
        result.token = k.cold_token[r]
        result.logprob = <float>(<double>result.logprob
                                 + (<double>(k.cold_token_logit[r] * inv_t)
                                    - <double>(row.cold_max * inv_t))
                                 - log(<double>row.cold_mass))
        outcome = HANDOFF_DECIDED
    if outcome != HANDOFF_DECIDED:
        result.token = -1
    finish_row(r, &result, outcome, b)
    if outcome == HANDOFF_NEED_COLD:
        b.logprobs[r] = result.logprob      # C's log share, whether logprobs are wanted or not


cdef Py_ssize_t max_row_entries(const BatchInputs* b, Py_ssize_t batch) noexcept nogil:
    """The most bias, ban and history entries of one row: the override capacity."""
    cdef Py_ssize_t most = 0
    cdef Py_ssize_t r, entries
    for r in range(batch):
        entries = (b.bias_offsets[r + 1] - b.bias_offsets[r] + b.ban_offsets[r + 1] - b.ban_offsets[r]
                   + b.prompt_offsets[r + 1] - b.prompt_offsets[r]
                   + b.output_offsets[r + 1] - b.output_offsets[r])
        most = entries if entries > most else most
    return most


cdef class KernelBatch:
    """Everything one kernel call reads and writes, packed once by
    ``sampling.sample`` (keyword-only; every argument already validated).

    logits_bytes: [B, V * itemsize] uint8 view of the rows (rows contiguous,
    any row stride); dtype: DTYPE_*. scalars: the rows' RowScalars
(sampling.ROW_SCALARS); other parameter arrays have length B; the
    ragged id lists are CSR (offsets of length B + 1). Outputs (tokens,
    logprobs, top_tokens [B, n_top], top_logprobs, errors, error_columns,
    hot_outcomes) are written in place; errors[r] != ERROR_NONE marks a row
    that could not be sampled.

    Hot set (SHVS; empty hot_ids turns it off): hot_ids int32 ascending
    unique ids; hot_block_start int64 [n_blocks + 1] and hot_bits uint64
    [n_blocks] index them by block of SS_BLOCK columns (see HotSet).
    hot_outcomes[r] receives row r's HotOutcome.

    Per row (optional; None: every row as want_logprob and top_tokens'
    width say): want_logprob_rows uint8 [B], the rows whose logprob is
    wanted, and n_top_rows int32 [B] (each <= top_tokens' width), the
    top-n each row wants. A row's path (SHVS tried or not, the compact
    decision) and so its token then depend on its own options alone.

    The typed memoryviews keep the arrays alive; ``inputs`` turns them into
    the nogil ``BatchInputs`` the row functions take. Another entry point
    over the same rows and parameters reuses it (or a subclass adds fields)
    instead of growing a positional signature.
    """
    cdef const unsigned char[:, :] logits_bytes
    cdef int dtype
    cdef const RowScalars[::1] scalars
    cdef const int64_t[::1] bias_offsets
    cdef const int32_t[::1] bias_ids
    cdef const float[::1] bias_values
    cdef const int64_t[::1] ban_offsets
    cdef const int32_t[::1] ban_ids
    cdef const int64_t[::1] prompt_offsets
    cdef const int32_t[::1] prompt_ids
    cdef const int64_t[::1] output_offsets
    cdef const int32_t[::1] output_ids
    cdef bint want_logprob
    cdef int num_threads
    cdef int64_t[::1] tokens
    cdef float[::1] logprobs
    cdef int32_t[:, ::1] top_tokens
    cdef float[:, ::1] top_logprobs
    cdef int32_t[::1] errors
    cdef int64_t[::1] error_columns
    cdef const int32_t[::1] hot_ids
    cdef const int64_t[::1] hot_block_start
    cdef const uint64_t[::1] hot_bits
    cdef int8_t[::1] hot_outcomes
    cdef const uint8_t[::1] want_logprob_rows
    cdef const int32_t[::1] n_top_rows
    cdef const uint8_t[::1] raw_logprob_rows
    cdef const int64_t[::1] given_tokens

    def __init__(self, *, const unsigned char[:, :] logits_bytes, int dtype,
                 const RowScalars[::1] scalars,
                 const int64_t[::1] bias_offsets, const int32_t[::1] bias_ids,
                 const float[::1] bias_values,
                 const int64_t[::1] ban_offsets, const int32_t[::1] ban_ids,
                 const int64_t[::1] prompt_offsets, const int32_t[::1] prompt_ids,
                 const int64_t[::1] output_offsets, const int32_t[::1] output_ids,
                 bint want_logprob, int num_threads,
                 int64_t[::1] tokens, float[::1] logprobs,
                 int32_t[:, ::1] top_tokens, float[:, ::1] top_logprobs,
                 int32_t[::1] errors, int64_t[::1] error_columns,
                 const int32_t[::1] hot_ids, const int64_t[::1] hot_block_start,
                 const uint64_t[::1] hot_bits, int8_t[::1] hot_outcomes,
                 const uint8_t[::1] want_logprob_rows=None,
                 const int32_t[::1] n_top_rows=None,
                 const uint8_t[::1] raw_logprob_rows=None,
                 const int64_t[::1] given_tokens=None):
        self.logits_bytes = logits_bytes
        self.dtype = dtype
        self.scalars = scalars
        self.bias_offsets = bias_offsets
        self.bias_ids = bias_ids
        self.bias_values = bias_values
        self.ban_offsets = ban_offsets
        self.ban_ids = ban_ids
        self.prompt_offsets = prompt_offsets
        self.prompt_ids = prompt_ids
        self.output_offsets = output_offsets
        self.output_ids = output_ids
        self.want_logprob = want_logprob
        self.num_threads = num_threads
        self.tokens = tokens
        self.logprobs = logprobs
        self.top_tokens = top_tokens
        self.top_logprobs = top_logprobs
        self.errors = errors
        self.error_columns = error_columns
        self.hot_ids = hot_ids
        self.hot_block_start = hot_block_start
        self.hot_bits = hot_bits
        self.hot_outcomes = hot_outcomes
        rows = logits_bytes.shape[0]
        if want_logprob_rows is not None and want_logprob_rows.shape[0] != rows:
            raise ValueError(f"want_logprob_rows has {want_logprob_rows.shape[0]} rows, not {rows}")
        if n_top_rows is not None and n_top_rows.shape[0] != rows:
            raise ValueError(f"n_top_rows has {n_top_rows.shape[0]} rows, not {rows}")
        if raw_logprob_rows is not None and raw_logprob_rows.shape[0] != rows:
            raise ValueError(f"raw_logprob_rows has {raw_logprob_rows.shape[0]} rows, not {rows}")
        if given_tokens is not None and given_tokens.shape[0] != rows:
            raise ValueError(f"given_tokens has {given_tokens.shape[0]} rows, not {rows}")
        vocab = logits_bytes.shape[1] // (4 if dtype == DTYPE_FLOAT32 else 2)
        for r in range(rows if given_tokens is not None else 0):
            if given_tokens[r] < -1 or given_tokens[r] >= vocab:
                raise ValueError(f"given_tokens[{r}] is {given_tokens[r]}, outside [-1, {vocab})")
        for r in range(rows if n_top_rows is not None else 0):
            if n_top_rows[r] < 0 or n_top_rows[r] > top_tokens.shape[1]:
                raise ValueError(f"n_top_rows[{r}] is {n_top_rows[r]}, outside [0, "
                                 f"{top_tokens.shape[1]}]")
        self.want_logprob_rows = want_logprob_rows
        self.n_top_rows = n_top_rows
        self.raw_logprob_rows = raw_logprob_rows
        self.given_tokens = given_tokens

    cdef void inputs(self, BatchInputs* b) noexcept:
        """Fill ``b`` with pointers into this batch's arrays (B >= 1)."""
        b.logits = &self.logits_bytes[0, 0]
        b.row_stride = self.logits_bytes.strides[0]
        b.dtype = self.dtype
        b.vocab = self.logits_bytes.shape[1] // (4 if self.dtype == DTYPE_FLOAT32 else 2)
        b.scalars = &self.scalars[0]
        # Empty id lists: a NULL base is never dereferenced (every count is 0).
        b.bias_offsets = &self.bias_offsets[0]
        b.bias_ids = &self.bias_ids[0] if self.bias_ids.shape[0] > 0 else NULL
        b.bias_values = &self.bias_values[0] if self.bias_values.shape[0] > 0 else NULL
        b.ban_offsets = &self.ban_offsets[0]
        b.ban_ids = &self.ban_ids[0] if self.ban_ids.shape[0] > 0 else NULL
        b.prompt_offsets = &self.prompt_offsets[0]
        b.prompt_ids = &self.prompt_ids[0] if self.prompt_ids.shape[0] > 0 else NULL
        b.output_offsets = &self.output_offsets[0]
        b.output_ids = &self.output_ids[0] if self.output_ids.shape[0] > 0 else NULL
        b.want_logprob = self.want_logprob
        b.n_top = self.top_tokens.shape[1]
        b.row_wants_logprob = (&self.want_logprob_rows[0] if self.want_logprob_rows is not None
                               else NULL)
        b.row_n_top = &self.n_top_rows[0] if self.n_top_rows is not None else NULL
        b.row_raw_logprobs = (&self.raw_logprob_rows[0] if self.raw_logprob_rows is not None
                              else NULL)
        b.row_given_tokens = &self.given_tokens[0] if self.given_tokens is not None else NULL
        b.tokens = &self.tokens[0]
        b.logprobs = &self.logprobs[0]
        b.top_tokens = &self.top_tokens[0, 0] if b.n_top > 0 else NULL
        b.top_logprobs = &self.top_logprobs[0, 0] if b.n_top > 0 else NULL
        b.errors = &self.errors[0]
        b.error_columns = &self.error_columns[0]
        b.hot.n = self.hot_ids.shape[0]
        b.hot.ids = &self.hot_ids[0] if b.hot.n > 0 else NULL
        b.hot.block_start = &self.hot_block_start[0] if b.hot.n > 0 else NULL
        b.hot.bits = &self.hot_bits[0] if b.hot.n > 0 else NULL
        b.hot_outcomes = &self.hot_outcomes[0]


def sample_batch(KernelBatch batch not None):
    """Sample one token per row of ``batch`` (see KernelBatch), writing its
    outputs in place."""
    cdef Py_ssize_t size = batch.logits_bytes.shape[0]
    if size == 0:
        return
    cdef BatchInputs b
    batch.inputs(&b)
    cdef int num_threads = batch.num_threads

    cdef Py_ssize_t n_blocks = (b.vocab + SS_BLOCK - 1) // SS_BLOCK
    cdef Py_ssize_t max_entries = max_row_entries(&b, size)
    cdef Py_ssize_t r
    cdef Workspace* ws = NULL
    with nogil, parallel(num_threads=num_threads):
        ws = allocate_workspace(b.vocab, n_blocks, max_entries, b.hot.n, b.vocab, True)
        for r in prange(size, schedule='dynamic'):
            sample_one(r, ws, &b)
        free_workspace(ws)


cdef void decide_compact_rows(const BatchInputs* b, const CompactInputs* k, Py_ssize_t size,
                              Py_ssize_t vocab, int num_threads) noexcept nogil:
    """compact_one over rows [0, size) on num_threads threads (vocab: the
    full rows')."""
    cdef Py_ssize_t max_entries = max_row_entries(b, size)
    cdef Py_ssize_t r
    cdef Py_ssize_t max_known = 0
    for r in range(size):
        max_known = max(max_known, k.touched_offsets[r + 1] - k.touched_offsets[r])
    max_known += b.hot.n
    cdef Workspace* ws = NULL
    with parallel(num_threads=num_threads):
        # Candidate arrays sized for the largest row's K, not V (their pages
        # would be mapped afresh every call); the block arrays go unused.
        ws = allocate_workspace(max_known if max_known > 0 else 1, 1, max_entries, 0, vocab, False)
        for r in prange(size, schedule='dynamic'):
            compact_one(r, ws, b, k)
        free_workspace(ws)


def sample_compact_batch(KernelBatch batch not None, Py_ssize_t vocab,
                         const int32_t[::1] hot_position, const int64_t[::1] touched_offsets,
                         const int32_t[::1] touched_ids, const float[::1] touched_logits,
                         const float[::1] cold_max, const int64_t[::1] cold_argmax,
                         const float[::1] cold_mass, const int64_t[::1] cold_token,
                         const float[::1] cold_token_logit):
    """Decide B compact rows; every argument is already validated.

    batch: a KernelBatch whose logits_bytes are the hot logits ([B, |H| *
    itemsize], column j = hot_ids[j]), whose hot_ids are H ascending (its
    block index unused) and whose hot_outcomes receive each row's
    HandoffOutcome; parameters and other outputs as for sample_batch. For
    HANDOFF_NEED_COLD, logprobs[r] holds log(W_C / Z), C's share.
    vocab: V. hot_position int32 [V]: HotVocab.positions(). touched_*: CSR
    (offsets [B + 1]) of each row's touched ids (ascending, none hot) and
    their raw float32 logits. cold_max float32 [B], cold_argmax int64 [B],
    cold_mass float32 [B]: the cold summary. cold_token int64 [B] (-1:
    none) and cold_token_logit float32 [B], or both empty: the data plane's
    draws inside C, checked by check_compact_ids; a NEED_COLD row with one
    is decided with it. Undecided rows' tokens are -1.
    """
    cdef Py_ssize_t size = cold_max.shape[0]
    if size == 0:
        return
    cdef BatchInputs b
    batch.inputs(&b)
    b.vocab = vocab
    cdef int num_threads = batch.num_threads
    cdef CompactInputs k
    k.hot_position = &hot_position[0]
    k.touched_offsets = &touched_offsets[0]
    k.touched_ids = &touched_ids[0] if touched_ids.shape[0] > 0 else NULL
    k.touched_logits = &touched_logits[0] if touched_logits.shape[0] > 0 else NULL
    k.cold_max = &cold_max[0]
    k.cold_argmax = &cold_argmax[0]
    k.cold_mass = &cold_mass[0]
    k.cold_token = &cold_token[0] if cold_token.shape[0] > 0 else NULL
    k.cold_token_logit = &cold_token_logit[0] if cold_token.shape[0] > 0 else NULL
    with nogil:
        decide_compact_rows(&b, &k, size, vocab, num_threads)


include "packed.pxi"
include "cold.pxi"
include "masked.pxi"


def _exp_paths(const float[::1] x, float[::1] scalar, float[::1] vector, float[::1] wide,
               float[::1] mass):
    """Test hook: exp of x (len a multiple of 16) by the scalar exp, the 8-lane
    vector exp, the wide (16-lane) one and the block-mass one, as built for
    this target."""
    cdef Py_ssize_t n = x.shape[0]
    cdef Py_ssize_t i
    if n == 0:
        return
    with nogil:
        for i in range(n):
            scalar[i] = ss_exp_nonpositive(x[i])
        ss_exp_array_v(&x[0], &vector[0], n)
        ss_exp_array_w(&x[0], &wide[0], &mass[0], n)


def _force_override_paths(Py_ssize_t bitmap_min_entries=-1, Py_ssize_t penalized_min_overrides=-1):
    """Test hook: rows with at least bitmap_min_entries bias, ban and history
    entries group them by the bitmap (else by the sort), and rows with at
    least penalized_min_overrides overrides are sampled from a penalized
    copy (else patched block by block), from the next call on; -1 restores
    each default (penalties.pxd, row.pxi). Returns the previous pair."""
    global forced_bitmap_min_entries, forced_penalized_min_overrides
    previous = (forced_bitmap_min_entries, forced_penalized_min_overrides)
    forced_bitmap_min_entries = bitmap_min_entries
    forced_penalized_min_overrides = penalized_min_overrides
    return previous


def row_mass(const unsigned char[:, ::1] rows_bytes, int dtype, double[::1] mass):
    """Bench hook, the exp floor of `bench kernels`: each row's softmax mass
    sum_j exp(x_j - max x) into mass[r], by sample_row's own first pass
    (row_pass with no overrides and T = 1: one read, one vector exp per
    logit) and its rescaling of the block masses to the row max, and nothing
    else. rows_bytes: [B, V * itemsize] of float32 or bfloat16 rows (dtype).
    The masses are returned so that no compiler can drop the exps."""
    cdef Py_ssize_t size = rows_bytes.shape[0]
    cdef Py_ssize_t itemsize = 4 if dtype == DTYPE_FLOAT32 else 2
    if dtype != DTYPE_FLOAT32 and dtype != DTYPE_BFLOAT16:
        raise ValueError("row_mass reads float32 or bfloat16 rows")
    if size == 0:
        return
    cdef RowSource src
    src.dtype = dtype
    src.vocab = rows_bytes.shape[1] // itemsize
    cdef Py_ssize_t n_blocks = (src.vocab + SS_BLOCK - 1) // SS_BLOCK
    cdef Overrides no_overrides
    no_overrides.n = 0
    cdef Workspace* ws = allocate_workspace(src.vocab, n_blocks, 0, 0, src.vocab, False)
    if ws == NULL:
        raise MemoryError()
    cdef Py_ssize_t r
    cdef float row_max
    cdef int nans = 0
    # need_mass is read at run time: a fourth call site passing the constant
    # True made GCC clone row_pass for the sites that need the mass and then
    # inline the max-only one, its clone's last caller, into sample_row, which
    # made greedy, simple and min_p slower on float32 rows. With no constant
    # here sample_row's three sites compile as they do without this hook.
    cdef volatile bint need_mass = True
    with nogil:
        for r in range(size):
            src.data = &rows_bytes[r, 0]
            row_max = row_pass(&src, &no_overrides, ws, n_blocks, 1.0, need_mass, NULL, &nans)
            mass[r] = masses_at_row_max(ws, n_blocks, row_max)
    free_workspace(ws)


def row_scalars_layout():
    """(sizeof(RowScalars), {field: offset}): pins sampling.ROW_SCALARS to the
    C struct (tests/test_params_table.py)."""
    return sizeof(RowScalars), row_scalars_offsets()
