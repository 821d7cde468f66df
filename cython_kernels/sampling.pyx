# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Batched, exact, linear-time sampling kernels (the decision plane's core).

Order of operations per row (vLLM's, see SIMPLE.md):
  1. logit_bias, then min_tokens bans (banned ids -> -inf)
  2. repetition (prompt + output), frequency and presence (output) penalties
  3. temperature < 1e-5: greedy (argmax of step 2, lowest id on ties)
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
"""
from cython.parallel cimport parallel, prange
from libc.math cimport INFINITY, NAN, log, nextafterf
from libc.stdint cimport INT32_MAX, int8_t, int32_t, int64_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc

from candidates cimport (Candidates, keep_at_least, ranks_before, select_rank, sort_prefix,
                         top_p_prefix)
from penalties cimport Overrides, RowHistory, adjusted_logit, build_overrides
from philox cimport philox4x32_10, uniform_double
from scalar_math cimport (SS_BLOCK, ss_bf16_to_float, ss_block_bound, ss_block_cold_at_or_above,
                          ss_block_cold_exp_sum, ss_block_max_mass, ss_block_max_mass_bf16,
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

# Per-row SHVS outcome reported to the Python layer (SampleOutput.hot_accepted).
cpdef enum HotOutcome:
    HOT_NOT_TRIED = -1      # no hot set, or a row SHVS does not take (see sample_row_hot)
    HOT_FALLBACK = 0        # tried; the exact full-row computation was needed
    HOT_ACCEPTED = 1        # decided from the hot set and cheap bounds alone

# sample_row_hot's answer when the row must go to the full path.
cdef enum:
    HOT_FALLBACK_FULL = 2

# The cold-mass bounds: ss_bound_term overestimates each term by at most
# COLD_BOUND_RATIO; the bound is widened by COLD_BOUND_MARGIN (relative: the
# float rounding of its terms, under 2e-5, and of the exact masses it must
# dominate), COLD_SUM_MARGIN of the blocks' bound totals (the float sums it
# is the difference of, and the scalar and vector forms of a hot token's
# term, each under 2e-5 of the total) and COLD_BOUND_SLACK (blocks whose
# scale flushed to 0 below e^-87, where the exact vector exp still returns
# up to e^-87).
cdef double COLD_BOUND_RATIO = 1.0615
cdef double COLD_BOUND_MARGIN = 1e-4
cdef double COLD_SUM_MARGIN = 1e-4
cdef double COLD_BOUND_SLACK = 1e-30
cdef double LOG2E = 1.4426950408889634
# hot_pass: how far (in log2 units) a block's max may rise above the running
# reference before the block takes its own: ss_bound_term's exponent must
# stay below 128.
cdef float BOUND_HEADROOM = 100.0

# top_p alone: gaps below the row max (in z) tried as collection thresholds,
# the first whose blocks can hold the nucleus mass first. The last is "all".
cdef enum:
    N_TOP_P_GAPS = 15
cdef float TOP_P_GAPS[N_TOP_P_GAPS]
TOP_P_GAPS[:] = [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 16.0, 24.0, 32.0, INFINITY]


cdef struct RowSource:
    const void* data
    int dtype
    Py_ssize_t vocab


cdef struct Workspace:
    float block[SS_BLOCK]
    float* block_max         # [n_blocks]: max z of the block
    float* block_mass        # [n_blocks]: its softmax mass, relative to the row max
    uint64_t* entry_keys     # [max_entries]: bias, ban and history entries
    uint64_t* entry_scratch
    int32_t* override_column # [max_entries]: Overrides arrays
    float* override_bias
    int32_t* override_count
    unsigned char* override_flags
    float* cand_z            # [vocab]
    int32_t* cand_token
    float* cand_w
    float* hot_z             # [hot size]: z of the hot tokens, in id order
    float* hot_w             # [hot size]: exp(z - row max)
    float* block_hot         # [n_blocks]: hot mass of the block
    float* block_total       # [n_blocks]: the block's bound total (hot_pass)
    float* block_ref         # [n_blocks]: the logit its bound terms are relative to


cdef struct RowParams:
    float inverse_temperature   # 1 for greedy rows
    bint greedy
    Py_ssize_t top_k            # 0 = off
    double top_p                # 1 = off
    double min_p                # 0 = off
    uint64_t seed
    uint64_t step
    Py_ssize_t n_top            # top-n logprobs wanted
    bint want_logprob


cdef struct RowResult:
    int64_t token
    float logprob
    int error
    int64_t error_column


cdef inline bint plain_block(const RowSource* src, Py_ssize_t b, const Overrides* ov,
                             Py_ssize_t ov_pos) noexcept nogil:
    """Block b is whole and no override falls in it (ov_pos: the first
    override at or after its start): its stored logits are its logits."""
    cdef Py_ssize_t end = (b + 1) * SS_BLOCK
    return end <= src.vocab and not (ov_pos < ov.n and ov.column[ov_pos] < end)


cdef inline const float* block_logits(const RowSource* src, Py_ssize_t b, const Overrides* ov,
                                      Py_ssize_t* ov_pos, float* buf) noexcept nogil:
    """Penalized, pre-temperature logits of block b: SS_BLOCK floats, -inf
    past the row's end. Reads float32 rows in place when no override falls in
    the block; otherwise converts / copies into buf and patches the overrides.
    ov_pos[0]: first override at or after the block start; advanced past it."""
    cdef Py_ssize_t start = b * SS_BLOCK
    cdef Py_ssize_t count = min(<Py_ssize_t>SS_BLOCK, src.vocab - start)
    cdef Py_ssize_t j
    cdef const uint16_t* half_row
    if src.dtype == DTYPE_FLOAT32:
        if plain_block(src, b, ov, ov_pos[0]):
            return <const float*>src.data + start
        for j in range(count):
            buf[j] = (<const float*>src.data)[start + j]
    elif src.dtype == DTYPE_FLOAT16:
        half_row = <const uint16_t*>src.data + start
        for j in range(count):
            buf[j] = ss_half_to_float(half_row[j])
    else:
        half_row = <const uint16_t*>src.data + start
        for j in range(count):
            buf[j] = ss_bf16_to_float(half_row[j])
    for j in range(count, SS_BLOCK):
        buf[j] = -INFINITY
    while ov_pos[0] < ov.n and ov.column[ov_pos[0]] < start + count:
        j = ov.column[ov_pos[0]] - start
        buf[j] = adjusted_logit(buf[j], ov, ov_pos[0])
        ov_pos[0] += 1
    return buf


cdef inline const float* reread_block(const RowSource* src, Py_ssize_t b, const Overrides* ov,
                                      float* buf) noexcept nogil:
    cdef Py_ssize_t lo = 0
    cdef Py_ssize_t hi = ov.n
    cdef Py_ssize_t mid
    while lo < hi:          # first override at or after the block start
        mid = (lo + hi) >> 1
        if ov.column[mid] < b * SS_BLOCK:
            lo = mid + 1
        else:
            hi = mid
    return block_logits(src, b, ov, &lo, buf)


cdef inline float count_lower_bound(const Workspace* ws, Py_ssize_t n_blocks, float row_max,
                                    Py_ssize_t k) noexcept nogil:
    """A threshold t with at least k blocks whose max reaches it, so at least
    k tokens have z >= t: a lower bound on the k-th largest z, found by
    counting block maxima over a ladder of gaps and then bisecting."""
    cdef float gap = 0.5
    cdef float near = 0.0
    while ss_count_at_or_above(ws.block_max, n_blocks, row_max - gap) < k:
        if gap > 64:
            return -INFINITY
        near = gap
        gap = 2 * gap
    cdef float middle
    cdef int step
    for step in range(6):
        middle = 0.5 * (near + gap)
        if ss_count_at_or_above(ws.block_max, n_blocks, row_max - middle) >= k:
            gap = middle
        else:
            near = middle
    return row_max - gap


cdef inline int find_bad_column(const RowSource* src, const Overrides* ov, float inverse_temperature,
                                float* buf, int64_t* column) noexcept nogil:
    """Locate the first NaN or +inf z (error path only)."""
    cdef Py_ssize_t n_blocks = (src.vocab + SS_BLOCK - 1) // SS_BLOCK
    cdef Py_ssize_t b, j
    cdef const float* x
    cdef float z
    for b in range(n_blocks):
        x = reread_block(src, b, ov, buf)
        for j in range(min(<Py_ssize_t>SS_BLOCK, src.vocab - b * SS_BLOCK)):
            z = x[j] * inverse_temperature
            if z != z or z == INFINITY:
                column[0] = b * SS_BLOCK + j
                return ERROR_NAN if z != z else ERROR_POSITIVE_INFINITY
    column[0] = -1
    return ERROR_NONE


cdef inline Py_ssize_t collect(const RowSource* src, const Overrides* ov, float inverse_temperature,
                               Workspace* ws, Py_ssize_t n_blocks, float threshold,
                               float row_max) noexcept nogil:
    """Candidates (z, token, exp(z - row_max)) for every z >= threshold,
    rereading only the blocks whose max reaches it."""
    cdef Py_ssize_t n = 0
    cdef Py_ssize_t b, j, start
    cdef const float* x
    cdef float z
    for b in range(n_blocks):
        if ws.block_max[b] < threshold:
            continue
        x = reread_block(src, b, ov, ws.block)
        start = b * SS_BLOCK
        for j in range(min(<Py_ssize_t>SS_BLOCK, src.vocab - start)):
            z = x[j] * inverse_temperature
            ws.cand_z[n] = z
            ws.cand_token[n] = <int32_t>(start + j)
            n += z >= threshold
    for j in range(n):
        ws.cand_w[j] = ss_exp_nonpositive(ws.cand_z[j] - row_max)
    return n


cdef inline float top_p_threshold(const Workspace* ws, Py_ssize_t n_blocks, float row_max,
                                  double target, Py_ssize_t* gap_index) noexcept nogil:
    """Highest threshold row_max - TOP_P_GAPS[i], i >= gap_index[0], whose
    blocks hold at least `target` mass (a necessary condition for the nucleus
    to lie above it; the caller checks the sufficient one exactly)."""
    cdef float threshold
    while gap_index[0] < N_TOP_P_GAPS - 1:
        threshold = row_max - TOP_P_GAPS[gap_index[0]]
        if ss_mass_at_or_above(ws.block_max, ws.block_mass, n_blocks, threshold) >= target:
            return threshold
        gap_index[0] += 1
    return -INFINITY


cdef inline Py_ssize_t draw_index(const Candidates* c, Py_ssize_t count, double u) noexcept nogil:
    """Inverse-CDF draw over the first `count` candidates in array order."""
    cdef double total = 0.0
    cdef Py_ssize_t i
    for i in range(count):
        total += c.w[i]
    cdef double target = u * total
    cdef double acc = 0.0
    cdef Py_ssize_t last_positive = 0
    for i in range(count):
        if c.w[i] > 0:
            acc += c.w[i]
            last_positive = i
            if acc > target:
                return i
    return last_positive


cdef inline int64_t draw_from_blocks(const RowSource* src, const Overrides* ov, float inverse_temperature,
                                     Workspace* ws, Py_ssize_t n_blocks, float row_max,
                                     double row_mass, double u,
                                     const uint64_t* skip_bits) noexcept nogil:
    """Draw from the untruncated distribution: pick a block by its mass,
    then a column inside it; only that block is reread. skip_bits (NULL for
    none) marks columns to leave out (the hot set, when the block masses
    are cold masses)."""
    cdef double target = u * row_mass
    cdef double acc = 0.0
    cdef double before_chosen = 0.0
    cdef Py_ssize_t b, j
    cdef Py_ssize_t chosen = 0
    for b in range(n_blocks):
        if ws.block_mass[b] > 0:
            chosen = b
            before_chosen = acc
            acc += ws.block_mass[b]
            if acc > target:
                break
    acc = before_chosen
    cdef const float* x = reread_block(src, chosen, ov, ws.block)
    cdef uint64_t skip = skip_bits[chosen] if skip_bits != NULL else 0
    cdef Py_ssize_t last_positive = -1
    cdef float w
    for j in range(min(<Py_ssize_t>SS_BLOCK, src.vocab - chosen * SS_BLOCK)):
        if (skip >> j) & 1:
            continue
        w = ss_exp_nonpositive(x[j] * inverse_temperature - row_max)
        if w > 0:
            acc += w
            last_positive = j
            if acc > target:
                return chosen * SS_BLOCK + j
    return chosen * SS_BLOCK + (last_positive if last_positive >= 0 else 0)


cdef inline int64_t first_argmax(const RowSource* src, const Overrides* ov, const Workspace* ws,
                                 Py_ssize_t n_blocks, float row_max, float* buf) noexcept nogil:
    cdef Py_ssize_t b, j
    cdef const float* x
    for b in range(n_blocks):
        if ws.block_max[b] == row_max:
            x = reread_block(src, b, ov, buf)
            for j in range(SS_BLOCK):
                if x[j] == row_max:
                    return b * SS_BLOCK + j
    return -1


cdef inline float row_pass(const RowSource* src, const Overrides* ov, Workspace* ws,
                           Py_ssize_t n_blocks, float inv_t, bint need_mass,
                           int* nan_count) noexcept nogil:
    """Per block, max z (ws.block_max) and, with need_mass, its softmax mass
    relative to that max (ws.block_mass), from one load of the block
    (ss_block_max_mass); counts NaN blocks. Returns the row max z."""
    cdef float row_max = -INFINITY
    cdef int nans = 0                   # a local: kept in a register
    cdef Py_ssize_t ov_pos = 0
    cdef Py_ssize_t b
    cdef const float* x
    cdef float m
    cdef float mass
    cdef const uint16_t* half_row = <const uint16_t*>src.data
    for b in range(n_blocks):
        if src.dtype == DTYPE_BFLOAT16 and plain_block(src, b, ov, ov_pos):
            # widened in registers (block_logits would store a float copy)
            if need_mass:
                m = ss_block_max_mass_bf16(half_row + b * SS_BLOCK, inv_t, &mass, &nans)
                ws.block_mass[b] = mass
            else:
                m = ss_block_max_nan_bf16(half_row + b * SS_BLOCK, &nans)
        else:
            x = block_logits(src, b, ov, &ov_pos, ws.block)
            if need_mass:
                m = ss_block_max_mass(x, inv_t, &mass, &nans)
                ws.block_mass[b] = mass
            else:
                m = ss_block_max_nan(x, &nans)
        ws.block_max[b] = m * inv_t
        row_max = ws.block_max[b] if ws.block_max[b] > row_max else row_max
    nan_count[0] += nans
    return row_max


cdef void sample_row(const RowSource* src, const Overrides* ov, const RowParams* p,
                     Workspace* ws, RowResult* result, int32_t* top_tokens,
                     float* top_logprobs) noexcept nogil:
    """The full path: exact for every row, one streaming pass plus rereads."""
    cdef Py_ssize_t n_blocks = (src.vocab + SS_BLOCK - 1) // SS_BLOCK
    cdef float inv_t = p.inverse_temperature

    cdef bint truncating = (not p.greedy) and (p.min_p > 0 or p.top_k > 0 or p.top_p < 1.0)
    cdef bint top_p_alone = (not p.greedy) and p.top_p < 1.0 and p.min_p <= 0 and p.top_k <= 0
    cdef bint need_mass = (p.want_logprob or p.n_top > 0 or top_p_alone
                           or not (p.greedy or truncating))

    # Pass 1, the only full read of the row (row_pass). Two call sites with
    # a constant need_mass: each loop is compiled for its case alone.
    cdef int nan_count = 0
    cdef float row_max
    if need_mass:
        row_max = row_pass(src, ov, ws, n_blocks, inv_t, True, &nan_count)
    else:
        row_max = row_pass(src, ov, ws, n_blocks, inv_t, False, &nan_count)
    if nan_count > 0 or row_max == INFINITY:
        result.error = find_bad_column(src, ov, inv_t, ws.block, &result.error_column)
        return
    if row_max == -INFINITY:
        result.error = ERROR_ALL_BANNED
        return

    # The online softmax's rescaling, for every block at once: each block's
    # mass moves from its own max to the row max by exp(block max - row max),
    # in vector lanes (cand_w is free until candidates are collected).
    cdef double row_mass = 0.0
    cdef float* scale = ws.cand_w
    if need_mass:
        ss_exp_shifted(ws.block_max, row_max, scale, n_blocks)
        for b in range(n_blocks):
            ws.block_mass[b] = ws.block_mass[b] * scale[b]
        for b in range(n_blocks):
            row_mass += ws.block_mass[b]
    cdef double log_row_mass = log(row_mass) if need_mass else 0.0

    # Collection threshold: every token that can survive 5-7 has z >= it.
    cdef float threshold = INFINITY
    cdef double log_min_p = log(p.min_p) if p.min_p > 0 else -INFINITY
    cdef float bound
    cdef Py_ssize_t gap_index = 0
    if truncating:
        threshold = -INFINITY
        if p.min_p > 0:
            # Collected a hair low; the exact boundary is applied in double below.
            bound = <float>(row_max + log_min_p)
            threshold = bound - (1e-6 * (bound if bound > 0 else -bound) + 1e-30)
        if p.top_k > 0 and ss_count_at_or_above(ws.block_max, n_blocks, threshold) > p.top_k:
            bound = count_lower_bound(ws, n_blocks, row_max, p.top_k)
            threshold = bound if bound > threshold else threshold
        if top_p_alone:
            threshold = top_p_threshold(ws, n_blocks, row_max, p.top_p * row_mass, &gap_index)
    # The top-n logprobs need n tokens collected: n blocks whose max reaches the threshold.
    cdef float collect_at = threshold
    if p.n_top > 0 and ss_count_at_or_above(ws.block_max, n_blocks, threshold) < p.n_top:
        collect_at = count_lower_bound(ws, n_blocks, row_max, p.n_top)

    cdef Candidates c
    c.z = ws.cand_z
    c.token = ws.cand_token
    c.w = ws.cand_w
    c.n = 0
    cdef Py_ssize_t i, count
    cdef double nucleus_mass
    if collect_at < INFINITY:
        c.n = collect(src, ov, inv_t, ws, n_blocks, collect_at, row_max)
        while top_p_alone and threshold > -INFINITY:
            nucleus_mass = 0.0
            for i in range(c.n):
                if c.z[i] >= threshold:
                    nucleus_mass += c.w[i]
            if nucleus_mass >= p.top_p * row_mass:
                break
            gap_index += 1
            threshold = top_p_threshold(ws, n_blocks, row_max, p.top_p * row_mass, &gap_index)
            collect_at = threshold if threshold < collect_at else collect_at
            c.n = collect(src, ov, inv_t, ws, n_blocks, collect_at, row_max)

    if p.n_top > 0:
        count = min(p.n_top, c.n)
        select_rank(&c, count - 1)
        sort_prefix(&c, count)
        for i in range(count):
            top_tokens[i] = c.token[i]
            top_logprobs[i] = <float>(c.z[i] - row_max - log_row_mass)

    cdef double u
    cdef double kept_mass
    if p.greedy:
        result.token = first_argmax(src, ov, ws, n_blocks, row_max, ws.block)
    elif not truncating:
        u = uniform_double(p.seed, p.step, 0)
        result.token = draw_from_blocks(src, ov, inv_t, ws, n_blocks, row_max, row_mass, u, NULL)
    else:
        keep_at_least(&c, threshold)
        if p.min_p > 0:
            i = 0
            while i < c.n:      # the exact min_p boundary, in double
                if <double>c.z[i] - row_max < log_min_p:
                    c.n -= 1
                    c.z[i] = c.z[c.n]
                    c.token[i] = c.token[c.n]
                    c.w[i] = c.w[c.n]
                else:
                    i += 1
        if p.top_k > 0 and c.n > p.top_k:
            select_rank(&c, p.top_k - 1)
            keep_at_least(&c, c.z[p.top_k - 1])
        count = c.n
        if p.top_p < 1.0:
            if top_p_alone:
                kept_mass = row_mass
            else:
                kept_mass = 0.0
                for i in range(c.n):
                    kept_mass += c.w[i]
            count = top_p_prefix(&c, p.top_p * kept_mass)
        u = uniform_double(p.seed, p.step, 0)
        result.token = c.token[draw_index(&c, count, u)]

    if p.want_logprob:
        x = reread_block(src, result.token // SS_BLOCK, ov, ws.block)
        result.logprob = <float>(x[result.token % SS_BLOCK] * inv_t - row_max - log_row_mass)
    result.error = ERROR_NONE


cdef struct HotSet:
    const int32_t* ids           # [n] ascending token ids
    const int64_t* block_start   # [n_blocks + 1]: block b's hot ids are ids[block_start[b]:block_start[b + 1]]
    const uint64_t* bits         # [n_blocks]: bit j of bits[b] set when column b * SS_BLOCK + j is hot
    Py_ssize_t n


cdef struct HotSummary:
    float row_max                # max z over the whole row
    float to_bits                # the ss_bound_term scale of this row
    double hot_mass              # M_H = sum over hot of exp(z - row_max)
    double cold_bound            # sum over cold of the bound terms, relative to row_max
    double bound_total           # the same over every token: sizes the rounding margin
    double cold_upper            # C_ub >= the exact cold mass
    double cold_lower            # C_lb <= the exact cold mass


cdef inline void bound_rest(const HotSummary* s, double removed, double* lower,
                            double* upper) noexcept nogil:
    """Bounds on the exact mass of the cold tokens whose bound terms (scaled
    to row_max) sum to s.cold_bound - removed: each term is at least its
    token's weight and at most COLD_BOUND_RATIO times it, the sums are off by
    at most COLD_SUM_MARGIN of the row's bound total, and the weights the
    bounds must hold for are rounded too (COLD_BOUND_MARGIN)."""
    cdef double rest = s.cold_bound - removed
    upper[0] = ((rest + COLD_SUM_MARGIN * s.bound_total) * (1.0 + COLD_BOUND_MARGIN)
                + COLD_BOUND_SLACK)
    rest = rest - COLD_SUM_MARGIN * s.bound_total
    lower[0] = rest / COLD_BOUND_RATIO * (1.0 - COLD_BOUND_MARGIN) if rest > 0 else 0.0


cdef inline bint hot_pass(const RowSource* src, const Overrides* ov, float inv_t, const HotSet* hot,
                          Workspace* ws, Py_ssize_t n_blocks, HotSummary* out) noexcept nogil:
    """One streaming pass, no exact exp outside the hot set. Per block: its
    max z (ws.block_max, hot and cold columns alike) and ss_block_bound of
    all its columns less the same terms of its hot columns, relative to a
    reference logit (ws.block_ref): a bound on its cold mass (ws.block_mass)
    and the block's bound total (ws.block_total, which sizes the rounding
    margin), both scaled to the row max at the end. The reference is the
    row's running max before the block, so the bound need not wait for the
    block's own max; a block rising more than BOUND_HEADROOM above it (or
    the first one) takes its own max instead, which keeps every term's
    exponent in range. Per hot token: z (ws.hot_z) and exp(z - row max)
    (ws.hot_w); per block the hot mass (ws.block_hot). Returns False when the
    row holds a NaN or +inf, or every token is banned: the full path then
    reports it."""
    cdef float to_bits = <float>(inv_t * LOG2E * 8388608.0)     # 2^23
    cdef float headroom = BOUND_HEADROOM * 8388608.0
    cdef int nan_count = 0
    cdef Py_ssize_t ov_pos = 0
    cdef Py_ssize_t b, i, start
    cdef const float* x
    cdef float m, v
    cdef float total
    cdef float hot_part
    cdef float ref = -INFINITY
    cdef float row_max = -INFINITY
    for b in range(n_blocks):
        x = block_logits(src, b, ov, &ov_pos, ws.block)
        m = ss_block_peak(x, &nan_count)
        ws.block_max[b] = m * inv_t
        row_max = ws.block_max[b] if ws.block_max[b] > row_max else row_max
        start = b * SS_BLOCK
        if not (-INFINITY < m < INFINITY):
            for i in range(hot.block_start[b], hot.block_start[b + 1]):
                ws.hot_z[i] = x[hot.ids[i] - start] * inv_t
            ws.block_ref[b] = 0.0
            ws.block_mass[b] = 0.0
            ws.block_total[b] = 0.0
            continue
        if ref == -INFINITY or (m - ref) * to_bits > headroom:
            ref = m
        total = ss_block_bound(x, ref, to_bits)
        hot_part = 0.0
        for i in range(hot.block_start[b], hot.block_start[b + 1]):
            v = x[hot.ids[i] - start]
            ws.hot_z[i] = v * inv_t
            hot_part = hot_part + ss_bound_term(v, ref, to_bits)
        ws.block_ref[b] = ref
        ws.block_mass[b] = total - hot_part
        ws.block_total[b] = total
        ref = m if m > ref else ref
    if nan_count > 0 or row_max == INFINITY or row_max == -INFINITY:
        return False
    ss_exp_shifted(ws.hot_z, row_max, ws.hot_w, hot.n)
    cdef double hot_mass = 0.0
    cdef float block_hot
    for b in range(n_blocks):
        block_hot = 0.0
        for i in range(hot.block_start[b], hot.block_start[b + 1]):
            block_hot = block_hot + ws.hot_w[i]
        ws.block_hot[b] = block_hot
        hot_mass += block_hot
    # The cold terms are exactly the block's terms less its hot ones. Scaled
    # to row_max here (ws.block_mass, ws.block_total) for top_p_hot's ladder.
    cdef float* scale = ws.cand_w           # free until candidates are collected
    for b in range(n_blocks):
        scale[b] = ws.block_ref[b] * inv_t
    ss_exp_shifted(scale, row_max, scale, n_blocks)
    for b in range(n_blocks):
        ws.block_mass[b] = ws.block_mass[b] * scale[b]
        ws.block_total[b] = ws.block_total[b] * scale[b]
    out.row_max = row_max
    out.to_bits = to_bits
    out.hot_mass = hot_mass
    out.cold_bound = ss_mass_at_or_above(ws.block_max, ws.block_mass, n_blocks, -INFINITY)
    out.bound_total = ss_mass_at_or_above(ws.block_max, ws.block_total, n_blocks, -INFINITY)
    bound_rest(out, 0.0, &out.cold_lower, &out.cold_upper)
    return True


cdef inline double exact_cold_mass(const RowSource* src, const Overrides* ov, float inv_t,
                                   const HotSet* hot, Workspace* ws, Py_ssize_t n_blocks,
                                   float row_max) noexcept nogil:
    """The fallback's exact cold mass: ws.block_mass[b] becomes the mass of
    block b's cold columns, exp(z - row_max) summed; returns their total."""
    cdef Py_ssize_t ov_pos = 0
    cdef Py_ssize_t b
    cdef double total = 0.0
    cdef const float* x
    for b in range(n_blocks):
        x = block_logits(src, b, ov, &ov_pos, ws.block)     # every block: it advances ov_pos
        ws.block_mass[b] = (ss_block_cold_exp_sum(x, hot.bits[b], inv_t, row_max)
                            if ws.block_max[b] > -INFINITY else 0.0)
        total += ws.block_mass[b]
    return total


cdef inline int32_t draw_hot(const HotSet* hot, const Workspace* ws, Py_ssize_t n_blocks,
                             double target) noexcept nogil:
    """The hot token at `target` in [0, M_H) along the hot tokens in id order:
    a block by its hot mass (ws.block_hot), then a token inside it."""
    cdef double acc = 0.0
    cdef Py_ssize_t b
    cdef Py_ssize_t chosen = -1
    for b in range(n_blocks):
        if ws.block_hot[b] > 0:
            chosen = b
            if acc + ws.block_hot[b] > target:
                break
            acc += ws.block_hot[b]
    cdef Py_ssize_t i
    cdef Py_ssize_t last_positive = hot.block_start[chosen]
    for i in range(hot.block_start[chosen], hot.block_start[chosen + 1]):
        if ws.hot_w[i] > 0:
            acc += ws.hot_w[i]
            last_positive = i
            if acc > target:
                return hot.ids[i]
    return hot.ids[last_positive]


cdef inline int64_t draw_exact(const RowSource* src, const Overrides* ov, float inv_t,
                               const HotSet* hot, Workspace* ws, Py_ssize_t n_blocks,
                               const HotSummary* s, double cold_mass, double target) noexcept nogil:
    """The token at `target` in [0, M_H + C) along the line where the hot
    tokens come first, then the cold ones (each in id order); needs
    ws.block_mass to hold exact cold masses (exact_cold_mass)."""
    if target < s.hot_mass or cold_mass <= 0:
        return draw_hot(hot, ws, n_blocks, target)
    return draw_from_blocks(src, ov, inv_t, ws, n_blocks, s.row_max, cold_mass,
                            (target - s.hot_mass) / cold_mass, hot.bits)


cdef inline int untruncated_hot(const RowSource* src, const Overrides* ov, const RowParams* p,
                                const HotSet* hot, Workspace* ws, Py_ssize_t n_blocks,
                                const HotSummary* s, RowResult* result) noexcept nogil:
    """Exact rejection sampling of the untruncated distribution P(t) = w_t / S,
    S = M_H + C, knowing only M_H and C_ub >= C.

    Lay [0, M_H + C_ub) out as: the hot tokens (total M_H), then the cold
    ones (total C), then a rejection gap (C_ub - C). Draw u uniformly on it.
    u < M_H: the hot token at u, decided from H alone. Otherwise compute C
    exactly; u in the cold part picks that cold token; u in the gap draws
    afresh from the exact distribution (an independent draw index). Then for
    every token t: P(t) = w_t / (M_H + C_ub) + (C_ub - C) / (M_H + C_ub) * w_t / S
    = w_t * (S + C_ub - C) / ((M_H + C_ub) * S) = w_t / S, since
    S + C_ub - C = M_H + C_ub. Acceptance is M_H / (M_H + C_ub): the hot
    mass, less what the bound overestimates."""
    cdef double u = uniform_double(p.seed, p.step, 0) * (s.hot_mass + s.cold_upper)
    if u < s.hot_mass:
        result.token = draw_hot(hot, ws, n_blocks, u)
        return HOT_ACCEPTED
    cdef double cold = exact_cold_mass(src, ov, p.inverse_temperature, hot, ws, n_blocks, s.row_max)
    if u >= s.hot_mass + cold:
        u = uniform_double(p.seed, p.step, 1) * (s.hot_mass + cold)
    result.token = draw_exact(src, ov, p.inverse_temperature, hot, ws, n_blocks, s, cold, u)
    return HOT_FALLBACK


cdef inline Py_ssize_t collect_above(const RowSource* src, const Overrides* ov, float inv_t,
                                     const HotSet* hot, Workspace* ws, Py_ssize_t n_blocks,
                                     const HotSummary* s, float threshold, double* cold_mass,
                                     double* removed) noexcept nogil:
    """Candidates for every token with z >= threshold: hot ones from the hot
    arrays, cold ones by rereading the blocks whose max reaches it, except
    those whose cold bound shows that no cold token does (a cold token's
    weight is at most its block's cold bound, give or take the rounding
    margin). Adds the cold candidates' exact mass to cold_mass[0] and their
    bound terms (as hot_pass scaled them) to removed[0]. Returns the count."""
    cdef Py_ssize_t n = 0
    cdef Py_ssize_t b, i, j, start, first
    cdef const float* x
    cdef uint64_t found
    cdef double scale
    cdef double level = ss_exp_nonpositive(threshold - s.row_max) * (1.0 - COLD_BOUND_MARGIN)
    for b in range(n_blocks):
        if ws.block_max[b] < threshold:
            continue
        for i in range(hot.block_start[b], hot.block_start[b + 1]):
            ws.cand_z[n] = ws.hot_z[i]
            ws.cand_token[n] = hot.ids[i]
            ws.cand_w[n] = ws.hot_w[i]
            n += ws.hot_z[i] >= threshold
        if ws.block_mass[b] + COLD_SUM_MARGIN * ws.block_total[b] < level:
            continue
        x = reread_block(src, b, ov, ws.block)
        found = ss_block_cold_at_or_above(x, hot.bits[b], inv_t, threshold)
        if found == 0:
            continue
        start = b * SS_BLOCK
        first = n
        while found:
            j = ss_lowest_bit(found)
            found &= found - 1
            ws.cand_z[n] = x[j] * inv_t
            ws.cand_token[n] = <int32_t>j
            n += 1
        scale = ss_exp_nonpositive(ws.block_ref[b] * inv_t - s.row_max)
        for i in range(first, n):
            ws.cand_w[i] = ss_exp_nonpositive(ws.cand_z[i] - s.row_max)
            cold_mass[0] += ws.cand_w[i]
            removed[0] += ss_bound_term(x[ws.cand_token[i]], ws.block_ref[b], s.to_bits) * scale
            ws.cand_token[i] += <int32_t>start
    return n


cdef inline int top_p_hot(const RowSource* src, const Overrides* ov, const RowParams* p,
                          const HotSet* hot, Workspace* ws, Py_ssize_t n_blocks,
                          const HotSummary* s, RowResult* result) noexcept nogil:
    """top_p alone, exactly, knowing the row's mass S only within bounds.
    Returns -1 when the bounds leave the nucleus undecided for every draw
    (the caller runs the full path).

    Collect U = every token with z >= t (hot ones from the hot set, cold
    ones by rereading the few blocks whose max reaches t), t the highest of
    a ladder of levels below the max whose blocks can hold the nucleus. The
    mass of U is exact; the cold tokens outside U are bounded, so
    S in [S_lb, S_ub]. Every token outside U has z < t, so it ranks after
    all of U: if mass(U) >= p S_ub, the nucleus is a rank-prefix of U. With
    cum_k the mass of U's first k tokens by rank (z descending, id
    ascending), the nucleus is the first J, J = min{k : cum_k >= p S};
    J2 = min{k : cum_k >= p S_ub} >= J and J1 = min{k : cum_k >= p S_lb} <= J.
    Draw t from the first J2 by mass. Rank(t) <= J1: t is in the nucleus,
    decided without S. Otherwise compute S (so J) exactly; keep t if
    rank(t) <= J, else draw afresh (an independent draw index) from the
    first J. For t in the nucleus,
    P(t) = w_t / cum_J2 + (cum_J2 - cum_J) / cum_J2 * w_t / cum_J = w_t / cum_J,
    and no token outside it is ever returned."""
    cdef double ladder_target = p.top_p * (s.hot_mass + s.cold_lower)
    cdef Candidates c
    c.z = ws.cand_z
    c.token = ws.cand_token
    c.w = ws.cand_w
    cdef Py_ssize_t gap_index = 0
    cdef float threshold
    cdef double cold_in, removed, mass, lower, upper, target_hi
    cdef Py_ssize_t i
    while True:
        if gap_index == N_TOP_P_GAPS - 1:
            return -1       # U would be the whole row: the full path's job
        threshold = s.row_max - TOP_P_GAPS[gap_index]
        gap_index += 1
        # U's mass is at most its blocks' hot mass plus their cold bounds.
        if (ss_mass_at_or_above(ws.block_max, ws.block_hot, n_blocks, threshold)
                + ss_mass_at_or_above(ws.block_max, ws.block_mass, n_blocks, threshold)
                < ladder_target):
            continue
        cold_in = 0.0
        removed = 0.0
        c.n = collect_above(src, ov, p.inverse_temperature, hot, ws, n_blocks, s, threshold,
                            &cold_in, &removed)
        bound_rest(s, removed, &lower, &upper)
        target_hi = p.top_p * (s.hot_mass + cold_in + upper)
        mass = 0.0
        for i in range(c.n):
            mass += c.w[i]
        if mass >= target_hi:
            break
    cdef Py_ssize_t upper_count = top_p_prefix(&c, target_hi)
    c.n = upper_count
    cdef Py_ssize_t lower_count = top_p_prefix(&c, p.top_p * (s.hot_mass + cold_in + lower))
    cdef Py_ssize_t drawn = draw_index(&c, upper_count, uniform_double(p.seed, p.step, 0))
    result.token = c.token[drawn]
    if drawn < lower_count:
        return HOT_ACCEPTED
    cdef double cold = exact_cold_mass(src, ov, p.inverse_temperature, hot, ws, n_blocks, s.row_max)
    cdef Py_ssize_t nucleus = top_p_prefix(&c, p.top_p * (s.hot_mass + cold))
    for i in range(nucleus):
        if c.token[i] == result.token:
            return HOT_FALLBACK
    result.token = c.token[draw_index(&c, nucleus, uniform_double(p.seed, p.step, 1))]
    return HOT_FALLBACK


cdef int sample_row_hot(const RowSource* src, const Overrides* ov, const RowParams* p,
                        const HotSet* hot, Workspace* ws, RowResult* result) noexcept nogil:
    """Speculative hot-vocab sampling of one row; returns its HotOutcome, or
    HOT_FALLBACK_FULL when the caller must run the full path.

    Taken only by rows whose full path must account for the whole row's
    mass: untruncated sampling and top_p alone, without logprobs. Greedy
    rows and rows truncated by min_p or top_k are already one max pass on the
    full path, which the cold region's max needs anyway (HOT_NOT_TRIED).
    When the bounds alone cannot place the nucleus inside H, the full path
    serves the row (the token SHVS off would give); when only the draw lands
    where the bounds cannot decide, the exact corrections documented in
    untruncated_hot and top_p_hot serve it."""
    if (p.greedy or p.want_logprob or p.n_top > 0 or p.min_p > 0 or p.top_k > 0
            or hot.n == 0):
        return HOT_NOT_TRIED
    cdef Py_ssize_t n_blocks = (src.vocab + SS_BLOCK - 1) // SS_BLOCK
    cdef HotSummary s
    if not hot_pass(src, ov, p.inverse_temperature, hot, ws, n_blocks, &s):
        return HOT_FALLBACK_FULL
    if p.top_p >= 1.0:
        return untruncated_hot(src, ov, p, hot, ws, n_blocks, &s, result)
    cdef int outcome = top_p_hot(src, ov, p, hot, ws, n_blocks, &s, result)
    return outcome if outcome >= 0 else HOT_FALLBACK_FULL


cdef Workspace* allocate_workspace(Py_ssize_t vocab, Py_ssize_t n_blocks,
                                   Py_ssize_t max_entries, Py_ssize_t n_hot) noexcept nogil:
    cdef Workspace* ws = <Workspace*>malloc(sizeof(Workspace))
    if ws == NULL:
        return NULL
    cdef Py_ssize_t entries = max_entries if max_entries > 0 else 1
    ws.block_max = <float*>malloc(n_blocks * sizeof(float))
    ws.block_mass = <float*>malloc(n_blocks * sizeof(float))
    ws.entry_keys = <uint64_t*>malloc(entries * sizeof(uint64_t))
    ws.entry_scratch = <uint64_t*>malloc(entries * sizeof(uint64_t))
    ws.override_column = <int32_t*>malloc(entries * sizeof(int32_t))
    ws.override_bias = <float*>malloc(entries * sizeof(float))
    ws.override_count = <int32_t*>malloc(entries * sizeof(int32_t))
    ws.override_flags = <unsigned char*>malloc(entries)
    ws.cand_z = <float*>malloc(vocab * sizeof(float))
    ws.cand_token = <int32_t*>malloc(vocab * sizeof(int32_t))
    ws.cand_w = <float*>malloc(vocab * sizeof(float))
    ws.hot_z = <float*>malloc((n_hot if n_hot > 0 else 1) * sizeof(float))
    ws.hot_w = <float*>malloc((n_hot if n_hot > 0 else 1) * sizeof(float))
    ws.block_hot = <float*>malloc(n_blocks * sizeof(float))
    ws.block_total = <float*>malloc(n_blocks * sizeof(float))
    ws.block_ref = <float*>malloc(n_blocks * sizeof(float))
    if (ws.hot_z == NULL or ws.hot_w == NULL or ws.block_hot == NULL or ws.block_total == NULL
            or ws.block_ref == NULL or ws.block_max == NULL or ws.block_mass == NULL or ws.entry_keys == NULL
            or ws.entry_scratch == NULL or ws.override_column == NULL or ws.override_bias == NULL
            or ws.override_count == NULL or ws.override_flags == NULL
            or ws.cand_z == NULL or ws.cand_token == NULL or ws.cand_w == NULL):
        free_workspace(ws)
        return NULL
    return ws


cdef void free_workspace(Workspace* ws) noexcept nogil:
    if ws == NULL:
        return
    free(ws.block_max)
    free(ws.block_mass)
    free(ws.entry_keys)
    free(ws.entry_scratch)
    free(ws.override_column)
    free(ws.override_bias)
    free(ws.override_count)
    free(ws.override_flags)
    free(ws.cand_z)
    free(ws.cand_token)
    free(ws.cand_w)
    free(ws.hot_z)
    free(ws.hot_w)
    free(ws.block_hot)
    free(ws.block_total)
    free(ws.block_ref)
    free(ws)


cdef struct BatchInputs:
    const unsigned char* logits      # row r starts at logits + r * row_stride
    Py_ssize_t row_stride
    int dtype
    Py_ssize_t vocab
    const float* inverse_temperature
    const unsigned char* greedy
    const int64_t* top_k
    const double* top_p
    const double* min_p
    const float* repetition
    const float* presence
    const float* frequency
    const uint64_t* seed
    const uint64_t* step
    const int64_t* bias_offsets      # CSR lists: row r owns ids[offsets[r]:offsets[r + 1]]
    const int32_t* bias_ids
    const float* bias_values
    const int64_t* ban_offsets
    const int32_t* ban_ids
    const int64_t* prompt_offsets
    const int32_t* prompt_ids
    const int64_t* output_offsets
    const int32_t* output_ids
    bint want_logprob
    Py_ssize_t n_top
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
    history.repetition = b.repetition[r]
    history.presence = b.presence[r]
    history.frequency = b.frequency[r]
    params.inverse_temperature = b.inverse_temperature[r]
    params.greedy = b.greedy[r] != 0
    params.top_k = b.top_k[r]
    params.top_p = b.top_p[r]
    params.min_p = b.min_p[r]
    params.seed = b.seed[r]
    params.step = b.step[r]
    params.n_top = b.n_top
    params.want_logprob = b.want_logprob
    ov.column = ws.override_column
    ov.bias = ws.override_bias
    ov.output_count = ws.override_count
    ov.flags = ws.override_flags
    build_overrides(&history, ws.entry_keys, ws.entry_scratch, ov)


cdef inline void init_result(RowResult* result) noexcept nogil:
    result.token = -1
    result.logprob = 0.0
    result.error = ERROR_NONE
    result.error_column = -1


cdef inline void store_result(Py_ssize_t r, const RowResult* result, const BatchInputs* b) noexcept nogil:
    b.tokens[r] = result.token
    b.logprobs[r] = result.logprob if b.want_logprob else NAN
    b.errors[r] = result.error
    b.error_columns[r] = result.error_column


cdef inline bint out_of_memory(Py_ssize_t r, const Workspace* ws, const BatchInputs* b,
                               int8_t outcome) noexcept nogil:
    """No workspace (its allocation failed): row r reports it."""
    if ws != NULL:
        return False
    b.errors[r] = ERROR_OUT_OF_MEMORY
    b.error_columns[r] = -1
    b.hot_outcomes[r] = outcome
    return True


cdef void sample_one(Py_ssize_t r, Workspace* ws, const BatchInputs* b) noexcept nogil:
    """Row r of sample_batch. Its structs live on this call's stack, so rows
    sampled by different threads share nothing but the read-only inputs."""
    if out_of_memory(r, ws, b, HOT_NOT_TRIED):
        return
    cdef RowSource src
    cdef RowParams params
    cdef RowResult result
    cdef Overrides ov
    src.data = b.logits + r * b.row_stride
    src.dtype = b.dtype
    src.vocab = b.vocab
    init_result(&result)
    row_setup(r, ws, b, &params, &ov)
    cdef int outcome = sample_row_hot(&src, &ov, &params, &b.hot, ws, &result)
    if outcome == HOT_NOT_TRIED or outcome == HOT_FALLBACK_FULL:
        sample_row(&src, &ov, &params, ws, &result,
                   b.top_tokens + r * b.n_top, b.top_logprobs + r * b.n_top)
    b.hot_outcomes[r] = HOT_FALLBACK if outcome == HOT_FALLBACK_FULL else outcome
    store_result(r, &result, b)


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
    any row stride); dtype: DTYPE_*. Parameter arrays have length B; the
    ragged id lists are CSR (offsets of length B + 1). Outputs (tokens,
    logprobs, top_tokens [B, n_top], top_logprobs, errors, error_columns,
    hot_outcomes) are written in place; errors[r] != ERROR_NONE marks a row
    that could not be sampled.

    Hot set (SHVS; empty hot_ids turns it off): hot_ids int32 ascending
    unique ids; hot_block_start int64 [n_blocks + 1] and hot_bits uint64
    [n_blocks] index them by block of SS_BLOCK columns (see HotSet).
    hot_outcomes[r] receives row r's HotOutcome.

    The typed memoryviews keep the arrays alive; ``inputs`` turns them into
    the nogil ``BatchInputs`` the row functions take. Another entry point
    over the same rows and parameters reuses it (or a subclass adds fields)
    instead of growing a positional signature.
    """
    cdef const unsigned char[:, :] logits_bytes
    cdef int dtype
    cdef const float[::1] inverse_temperature
    cdef const unsigned char[::1] greedy
    cdef const int64_t[::1] top_k
    cdef const double[::1] top_p
    cdef const double[::1] min_p
    cdef const float[::1] repetition
    cdef const float[::1] presence
    cdef const float[::1] frequency
    cdef const uint64_t[::1] seed
    cdef const uint64_t[::1] step
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

    def __init__(self, *, const unsigned char[:, :] logits_bytes, int dtype,
                 const float[::1] inverse_temperature, const unsigned char[::1] greedy,
                 const int64_t[::1] top_k, const double[::1] top_p, const double[::1] min_p,
                 const float[::1] repetition, const float[::1] presence,
                 const float[::1] frequency, const uint64_t[::1] seed,
                 const uint64_t[::1] step,
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
                 const uint64_t[::1] hot_bits, int8_t[::1] hot_outcomes):
        self.logits_bytes = logits_bytes
        self.dtype = dtype
        self.inverse_temperature = inverse_temperature
        self.greedy = greedy
        self.top_k = top_k
        self.top_p = top_p
        self.min_p = min_p
        self.repetition = repetition
        self.presence = presence
        self.frequency = frequency
        self.seed = seed
        self.step = step
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

    cdef void inputs(self, BatchInputs* b) noexcept:
        """Fill ``b`` with pointers into this batch's arrays (B >= 1)."""
        b.logits = &self.logits_bytes[0, 0]
        b.row_stride = self.logits_bytes.strides[0]
        b.dtype = self.dtype
        b.vocab = self.logits_bytes.shape[1] // (4 if self.dtype == DTYPE_FLOAT32 else 2)
        b.inverse_temperature = &self.inverse_temperature[0]
        b.greedy = &self.greedy[0]
        b.top_k = &self.top_k[0]
        b.top_p = &self.top_p[0]
        b.min_p = &self.min_p[0]
        b.repetition = &self.repetition[0]
        b.presence = &self.presence[0]
        b.frequency = &self.frequency[0]
        b.seed = &self.seed[0]
        b.step = &self.step[0]
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
        ws = allocate_workspace(b.vocab, n_blocks, max_entries, b.hot.n)
        for r in prange(size, schedule='dynamic'):
            sample_one(r, ws, &b)
        free_workspace(ws)


# ---------------------------------------------------------------------------
# Hot-first handoff: compact rows (docs/HANDOFF.md has the derivation).
#
# A compact row is what the data plane hands over instead of the V logits:
# the raw logits of the known ids K = H u T (the hot set H, shared by the
# batch, and the row's touched ids T: every id its bias, bans or penalties
# can change, plus any the data plane chose to add), and a summary of the
# cold region C = V \ K, whose logits no override touches: its max m_C, the
# lowest id reaching it, and S_C = sum_{i in C} exp(x_i / T - m_C / T).
# compact_row decides the row from these in O(|K|) or says why it cannot.

cpdef enum HandoffOutcome:
    HANDOFF_DECIDED = 0     # token (and logprob) decided from the compact row
    HANDOFF_NEED_FULL = 1   # the compact row cannot decide: sample the full row as usual
    HANDOFF_NEED_COLD = 2   # the draw fell in C: sample the full row conditioned on C

# S_C arrives as a float32 sum of float32 exps computed by another library
# (torch, on the GPU in deployment); the decisions that depend on it hold
# for every value within this relative margin of it (docs/HANDOFF.md).
cdef double COLD_MASS_MARGIN = 1e-4
# The Philox draw index whose words seed a NEED_COLD row's second request:
# the conditional draw's stream, independent of the compact draw (index 0).
cdef uint64_t COLD_STREAM_DRAW = 2


cdef struct CompactRow:
    const unsigned char* hot     # [n_hot] raw logits of the hot ids, storage dtype `dtype`
    int dtype
    const int32_t* hot_ids       # [n_hot] ascending
    const int32_t* hot_position  # [V]: index of an id in hot_ids, -1 when not hot
    Py_ssize_t n_hot
    const int32_t* touched_ids   # [n_touched] ascending, none in H
    const float* touched_logits  # [n_touched] raw logits
    Py_ssize_t n_touched
    float cold_max               # max raw logit over C (-inf: C empty or all -inf)
    int64_t cold_argmax          # lowest id in C reaching cold_max
    double cold_mass             # S_C, relative to cold_max, at the row's temperature


cdef inline float hot_logit(const CompactRow* row, Py_ssize_t i) noexcept nogil:
    if row.dtype == DTYPE_FLOAT32:
        return (<const float*>row.hot)[i]
    if row.dtype == DTYPE_FLOAT16:
        return ss_half_to_float((<const uint16_t*>row.hot)[i])
    return ss_bf16_to_float((<const uint16_t*>row.hot)[i])


cdef inline bint bad_z(float z) noexcept nogil:
    return z != z or z == INFINITY


cdef inline Py_ssize_t known_logits(const CompactRow* row, const Overrides* ov, float inv_t,
                                    Candidates* c, RowResult* result) noexcept nogil:
    """c := (z, token) of every known id, the hot ones (in hot_ids order)
    then the touched ones, z = adjusted_logit * inv_t: the full path's float
    operations, so the same floats. Branch-free loops over the row; each
    override finds its column through hot_position or the touched list.
    Returns -1 with result.error set for a NaN or +inf z (the lowest such
    id, as the full path reports), or an override whose column was not
    handed over (the cold summary would be wrong for it)."""
    cdef Py_ssize_t n_hot = row.n_hot
    cdef Py_ssize_t n = n_hot + row.n_touched
    cdef Py_ssize_t i, o, pos
    cdef Py_ssize_t t = 0
    cdef const uint16_t* half = <const uint16_t*>row.hot
    if row.dtype == DTYPE_FLOAT32:
        for i in range(n_hot):
            c.z[i] = (<const float*>row.hot)[i] * inv_t
    elif row.dtype == DTYPE_FLOAT16:
        for i in range(n_hot):
            c.z[i] = ss_half_to_float(half[i]) * inv_t
    else:
        for i in range(n_hot):
            c.z[i] = ss_bf16_to_float(half[i]) * inv_t
    for i in range(n_hot):
        c.token[i] = row.hot_ids[i]
    for i in range(row.n_touched):
        c.z[n_hot + i] = row.touched_logits[i] * inv_t
        c.token[n_hot + i] = row.touched_ids[i]
    cdef int32_t column
    cdef float x
    for o in range(ov.n):
        column = ov.column[o]
        pos = row.hot_position[column]
        if pos >= 0:
            x = hot_logit(row, pos)
        else:
            while t < row.n_touched and row.touched_ids[t] < column:
                t += 1
            if t == row.n_touched or row.touched_ids[t] != column:
                result.error = ERROR_UNLISTED_OVERRIDE
                result.error_column = column
                return -1
            pos = n_hot + t
            x = row.touched_logits[t]
        c.z[pos] = adjusted_logit(x, ov, o) * inv_t
    cdef int bad = 0
    for i in range(n):
        bad |= (c.z[i] != c.z[i]) | (c.z[i] == INFINITY)
    if bad:
        result.error_column = INT32_MAX
        for i in range(n):
            if bad_z(c.z[i]) and c.token[i] < result.error_column:
                result.error_column = c.token[i]
                result.error = ERROR_NAN if c.z[i] != c.z[i] else ERROR_POSITIVE_INFINITY
        return -1
    c.n = n
    return n


cdef inline Py_ssize_t count_above(const Candidates* c, float level) noexcept nogil:
    cdef Py_ssize_t n = 0
    cdef Py_ssize_t i
    for i in range(c.n):
        n += c.z[i] > level
    return n


cdef inline float max_z(const Candidates* c) noexcept nogil:
    """Max z (no NaN: known_logits refused them), in 8 independent lanes:
    one running max would wait on each compare (latency-bound)."""
    cdef float lanes[8]
    cdef Py_ssize_t i, j
    for j in range(8):
        lanes[j] = -INFINITY
    cdef Py_ssize_t whole = c.n - c.n % 8
    for i in range(0, whole, 8):
        for j in range(8):
            lanes[j] = c.z[i + j] if c.z[i + j] > lanes[j] else lanes[j]
    for i in range(whole, c.n):
        lanes[0] = c.z[i] if c.z[i] > lanes[0] else lanes[0]
    for j in range(1, 8):
        lanes[0] = lanes[j] if lanes[j] > lanes[0] else lanes[0]
    return lanes[0]


cdef inline Py_ssize_t first_at(const Candidates* c, float value) noexcept nogil:
    """Position of the lowest id whose z equals value (-1: none)."""
    cdef Py_ssize_t best = -1
    cdef Py_ssize_t i
    for i in range(c.n):
        if c.z[i] == value and (best < 0 or c.token[i] < c.token[best]):
            best = i
    return best


cdef inline void keep_min_p(Candidates* c, float row_max, double log_min_p) noexcept nogil:
    """Keep the items min_p keeps, by the full path's exact test in double.
    A float pre-test a hair below the level rejects most items on a branch
    that is almost never taken (min_p keeps few)."""
    cdef float bound = <float>(row_max + log_min_p)
    cdef float level = bound - (1e-6 * (bound if bound > 0 else -bound) + 1e-30)
    cdef Py_ssize_t kept = 0
    cdef Py_ssize_t i
    for i in range(c.n):
        if c.z[i] >= level and <double>c.z[i] - row_max >= log_min_p:
            c.z[kept] = c.z[i]
            c.token[kept] = c.token[i]
            c.w[kept] = c.w[i]
            kept += 1
    c.n = kept


cdef inline double weight_sum(const Candidates* c) noexcept nogil:
    """Sum of the weights in double, in 4 independent lanes (a fixed order:
    the same sum for the same candidates, whatever the batch)."""
    cdef double lanes[4]
    cdef Py_ssize_t i, j
    for j in range(4):
        lanes[j] = 0.0
    cdef Py_ssize_t whole = c.n - c.n % 4
    for i in range(0, whole, 4):
        for j in range(4):
            lanes[j] += c.w[i + j]
    for i in range(whole, c.n):
        lanes[0] += c.w[i]
    return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3])


cdef inline bint keep_nucleus_cover(Candidates* c, float row_max, float floor,
                                    double target) noexcept nogil:
    """Keep the items with z >= t, t the highest of row_max - TOP_P_GAPS[i]
    (never below floor) whose items hold at least `target` mass: a set that
    holds the nucleus, small for a peaked row (the full path's ladder,
    top_p_threshold). False when even z >= floor falls short."""
    cdef float level
    cdef Py_ssize_t g, i
    cdef float mass
    cdef double exact
    keep_at_least(c, floor)
    for g in range(N_TOP_P_GAPS):
        level = row_max - TOP_P_GAPS[g]
        level = floor if level < floor else level
        mass = 0.0      # a float estimate picks the level, a double sum decides
        for i in range(c.n):
            mass += c.w[i] if c.z[i] >= level else 0.0
        if mass >= target * (1.0 - 1e-5) or level == floor:
            exact = 0.0
            for i in range(c.n):
                exact += c.w[i] if c.z[i] >= level else 0.0
            if exact >= target:
                keep_at_least(c, level)
                return True
            if level == floor:
                return False
    return False


cdef int compact_row(const CompactRow* row, const Overrides* ov, const RowParams* p,
                     Workspace* ws, RowResult* result, int32_t* top_tokens,
                     float* top_logprobs) noexcept nogil:
    """One compact row: returns its HandoffOutcome (result.error set: the
    row's error instead). With zc = m_C / T (an upper bound on every cold z)
    and M = max(max known z, zc) the row max:
      greedy       always decided: the best known vs m_C, ties by lowest id
                   (cold_argmax is C's lowest id at m_C);
      untruncated  a draw on [0, W_K + W_C), W_C = S_C e^(zc - M): a known
                   token, or NEED_COLD (the caller draws inside C);
      min_p/top_k  decided when they exclude C (zc below the min_p level, or
                   top_k known tokens strictly above zc); C is then out of
                   the candidate set and the rest is the full path's;
      top_p alone  decided when the nucleus is a prefix of the known tokens
                   strictly above zc for every S_C within COLD_MASS_MARGIN.
    Anything else, and top-n logprobs that C could enter: NEED_FULL.
    Exps only where a mass is needed: over every known token for logprobs,
    untruncated and top_p-alone rows, else over the survivors of min_p /
    top_k."""
    cdef Candidates c
    c.z = ws.cand_z
    c.token = ws.cand_token
    c.w = ws.cand_w
    c.n = 0
    cdef float inv_t = p.inverse_temperature
    if known_logits(row, ov, inv_t, &c, result) < 0:
        if (bad_z(row.cold_max) and row.cold_argmax >= 0
                and row.cold_argmax < result.error_column
                and result.error != ERROR_UNLISTED_OVERRIDE):
            result.error = ERROR_NAN if row.cold_max != row.cold_max else ERROR_POSITIVE_INFINITY
            result.error_column = row.cold_argmax
        return HANDOFF_DECIDED
    if bad_z(row.cold_max):
        result.error = ERROR_NAN if row.cold_max != row.cold_max else ERROR_POSITIVE_INFINITY
        result.error_column = row.cold_argmax
        return HANDOFF_DECIDED
    cdef float zc = row.cold_max * inv_t
    cdef float known_max = max_z(&c)
    cdef float row_max = zc if zc > known_max else known_max
    if row_max == -INFINITY:
        result.error = ERROR_ALL_BANNED
        return HANDOFF_DECIDED
    cdef bint truncating = p.min_p > 0 or p.top_k > 0 or p.top_p < 1.0
    cdef bint level_truncating = p.min_p > 0 or p.top_k > 0
    cdef bint need_mass = (p.want_logprob or p.n_top > 0
                           or not (p.greedy or level_truncating))
    cdef double cold_weight = (row.cold_mass * ss_exp_nonpositive(zc - row_max)
                               if zc > -INFINITY else 0.0)
    cdef double known_mass = 0.0
    cdef double log_total = 0.0
    if need_mass:
        ss_exp_shifted(c.z, row_max, c.w, c.n)
        known_mass = weight_sum(&c)
        log_total = log(known_mass + cold_weight)
    cdef Py_ssize_t i, count, upper_count
    if p.n_top > 0:
        if count_above(&c, zc) < p.n_top:
            return HANDOFF_NEED_FULL
        select_rank(&c, p.n_top - 1)
        sort_prefix(&c, p.n_top)
        for i in range(p.n_top):
            top_tokens[i] = c.token[i]
            top_logprobs[i] = <float>(c.z[i] - row_max - log_total)

    cdef double log_min_p = log(p.min_p) if p.min_p > 0 else -INFINITY
    cdef bint cold_out = zc == -INFINITY
    cdef double target, total_lo, total_hi
    cdef float chosen_z
    if p.greedy:
        i = first_at(&c, known_max)
        if i >= 0 and (known_max > zc or (known_max == zc and c.token[i] < row.cold_argmax)):
            result.token = c.token[i]
            chosen_z = known_max
        else:
            result.token = row.cold_argmax
            chosen_z = zc
    elif not truncating:
        target = uniform_double(p.seed, p.step, 0) * (known_mass + cold_weight)
        if target >= known_mass:
            # The caller adds this (the log of C's share) to the logprob of
            # the token it draws inside C.
            result.logprob = <float>(log(cold_weight) - log_total)
            return HANDOFF_NEED_COLD
        i = draw_index(&c, c.n, target / known_mass)
        result.token = c.token[i]
        chosen_z = c.z[i]
    elif level_truncating:
        if p.min_p > 0:
            cold_out = cold_out or <double>zc - row_max < log_min_p
            keep_min_p(&c, row_max, log_min_p)
        if p.top_k > 0 and not cold_out:
            # Only the known tokens strictly above zc can be among the top
            # k when k of them are; otherwise C's survivors are unknown.
            keep_at_least(&c, nextafterf(zc, INFINITY))
            cold_out = c.n >= p.top_k
        if not cold_out:
            return HANDOFF_NEED_FULL
        # C is out of the candidate set: what is left is the full path's.
        if p.top_k > 0 and c.n > p.top_k:
            select_rank(&c, p.top_k - 1)
            keep_at_least(&c, c.z[p.top_k - 1])
        if not need_mass:
            ss_exp_shifted(c.z, row_max, c.w, c.n)
        count = c.n
        if p.top_p < 1.0:
            count = top_p_prefix(&c, p.top_p * weight_sum(&c))
        i = draw_index(&c, count, uniform_double(p.seed, p.step, 0))
        result.token = c.token[i]
        chosen_z = c.z[i]
    else:
        # top_p alone: the nucleus must end strictly above zc, where every
        # token ranks before all of C, whatever S_C is within its margin.
        total_lo = known_mass + cold_weight * (1.0 - COLD_MASS_MARGIN)
        total_hi = known_mass + cold_weight * (1.0 + COLD_MASS_MARGIN)
        if not keep_nucleus_cover(&c, row_max, nextafterf(zc, INFINITY), p.top_p * total_hi):
            return HANDOFF_NEED_FULL
        upper_count = top_p_prefix(&c, p.top_p * total_hi)
        c.n = upper_count
        count = top_p_prefix(&c, p.top_p * total_lo)
        if count != upper_count:
            return HANDOFF_NEED_FULL
        i = draw_index(&c, count, uniform_double(p.seed, p.step, 0))
        result.token = c.token[i]
        chosen_z = c.z[i]
    result.logprob = <float>(chosen_z - row_max - log_total)
    return HANDOFF_DECIDED


cdef struct CompactInputs:
    const int32_t* hot_position     # [V]: index of an id in the hot ids, -1 when not hot
    const int64_t* touched_offsets  # [B + 1]
    const int32_t* touched_ids
    const float* touched_logits
    const float* cold_max           # [B]
    const int64_t* cold_argmax
    const float* cold_mass


cdef void compact_one(Py_ssize_t r, Workspace* ws, const BatchInputs* b,
                      const CompactInputs* k) noexcept nogil:
    """Row r of sample_compact_batch (b's logits are the hot logits)."""
    if out_of_memory(r, ws, b, HANDOFF_DECIDED):
        return
    cdef CompactRow row
    cdef RowParams params
    cdef RowResult result
    cdef Overrides ov
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
    init_result(&result)
    row_setup(r, ws, b, &params, &ov)
    b.hot_outcomes[r] = compact_row(&row, &ov, &params, ws, &result,
                                    b.top_tokens + r * b.n_top, b.top_logprobs + r * b.n_top)
    store_result(r, &result, b)
    if b.hot_outcomes[r] == HANDOFF_NEED_COLD:
        b.logprobs[r] = result.logprob      # C's log share, whether logprobs are wanted or not


def sample_compact_batch(KernelBatch batch not None, Py_ssize_t vocab,
                         const int32_t[::1] hot_position, const int64_t[::1] touched_offsets,
                         const int32_t[::1] touched_ids, const float[::1] touched_logits,
                         const float[::1] cold_max, const int64_t[::1] cold_argmax,
                         const float[::1] cold_mass):
    """Decide B compact rows; every argument is already validated.

    batch: a KernelBatch whose logits_bytes are the hot logits ([B, |H| *
    itemsize], column j = hot_ids[j]), whose hot_ids are H ascending (its
    block index unused) and whose hot_outcomes receive each row's
    HandoffOutcome; parameters and other outputs as for sample_batch. For
    HANDOFF_NEED_COLD, logprobs[r] holds log(W_C / Z), C's share.
    vocab: V. hot_position int32 [V]: HotVocab.positions(). touched_*: CSR
    (offsets [B + 1]) of each row's touched ids (ascending, none hot) and
    their raw float32 logits. cold_max float32 [B], cold_argmax int64 [B],
    cold_mass float32 [B]: the cold summary.
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
    cdef Py_ssize_t max_entries = max_row_entries(&b, size)
    cdef Py_ssize_t r
    cdef Py_ssize_t max_known = 0
    for r in range(size):
        max_known = max(max_known, touched_offsets[r + 1] - touched_offsets[r])
    max_known += b.hot.n
    cdef Workspace* ws = NULL
    with nogil, parallel(num_threads=num_threads):
        # Candidate arrays sized for the largest row's K, not V (their pages
        # would be mapped afresh every call); the block arrays go unused.
        ws = allocate_workspace(max_known if max_known > 0 else 1, 1, max_entries, 0)
        for r in prange(size, schedule='dynamic'):
            compact_one(r, ws, &b, &k)
        free_workspace(ws)


def cold_stream_seeds(const uint64_t[::1] seed, const uint64_t[::1] step, uint64_t[::1] out):
    """out[r]: the seed of row r's conditional draw inside C (its second
    request keeps step[r]): 64 bits of Philox(seed[r], step[r], draw 2), a
    stream independent of the compact draw and a function of (seed, step)
    alone."""
    cdef uint32_t words[4]
    cdef Py_ssize_t r
    for r in range(seed.shape[0]):
        philox4x32_10(seed[r], step[r], COLD_STREAM_DRAW, words)
        out[r] = (<uint64_t>words[0] << 32) | words[1]


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
