# Row sampling (included by sampling.pyx): the full row of V logits, steps
# 1-8 of the module docstring in two passes, and the per-thread workspace.

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


# Candidates per block of a compact row's untruncated draw: their masses are
# summed per block once (with the row's mass), so the draw crosses whole
# blocks and walks inside one, not a running sum over every known id twice.
cdef Py_ssize_t DRAW_BLOCK = 64

# top_p alone keeps the row pass's terms (ws.terms) of a float32 row only for
# the blocks whose max z is within TERMS_GAP of the row max as the pass reaches
# them, so every block within it of the final row max has them (terms_floor). A
# broad row's rejection test reads a block only for a token at or below the
# block's max, which for a block further down is a token under e^-8 of the top
# token's weight: it recomputes that block's exps instead. A peaked float32
# row, which takes the candidate path and never reads terms, stores a few
# percent of its blocks, not a float per column (that made fitted float32 rows
# 16-41% slower). A bfloat16 row keeps every block's: its pass is bound by the
# exps, not the stores, and recomputing them made fitted bfloat16 rows at
# T >= 1.5 up to 24% slower (docs/results/kernels-2026-11-28c-terms.md).
cdef float TERMS_GAP = 8.0


cdef inline float terms_floor(float row_max, int dtype) noexcept nogil:
    """The least block max z whose block kept its terms, given the row max
    as the row pass knew it (-inf: every block)."""
    return -INFINITY if dtype == DTYPE_BFLOAT16 else row_max - TERMS_GAP


cdef struct Workspace:
    float block[SS_BLOCK]
    float* block_max         # [n_blocks]: max z of the block
    float* block_mass        # [n_blocks]: its softmax mass, relative to the row max
    float* block_scale       # [n_blocks]: exp(block max - row max), its mass's rescaling
    float* terms             # [n_blocks * SS_BLOCK]: exp(z - block max) per column (top_p alone; TERMS_GAP)
    uint64_t* entry_keys     # [max_entries]: bias, ban and history entries
    uint64_t* entry_scratch
    ColumnBits columns       # many entries' grouping (penalties.pxd)
    float* penalized         # [vocab] or NULL: a row with overrides in most blocks (penalized_row)
    Py_ssize_t penalized_min_overrides  # a row with this many overrides or more is copied there
    int32_t* override_column # [max_entries]: Overrides arrays
    float* override_bias
    int32_t* override_count
    unsigned char* override_flags
    float* cand_z            # [vocab]
    int32_t* cand_token
    float* cand_w
    double* cand_block_w     # [vocab / 64 + 1]: the candidates' mass per block of 64 (compact rows)
    float* hot_z             # [hot size]: z of the hot tokens, in id order
    float* hot_w             # [hot size]: exp(z - row max)
    float* block_hot         # [n_blocks]: hot mass of the block
    float* block_total       # [n_blocks]: the block's bound total (hot_pass)
    float* block_ref         # [n_blocks]: the logit its bound terms are relative to
    double* bucket_mass      # [NUCLEUS_BUCKETS]: broad rows' truncation (nucleus.pxi)
    float* block_kept        # [n_blocks]: mass ranked before a cut, per block (nucleus.pxi)


cdef struct RowParams:
    RowScalars scalars          # the row's parameters (row_scalars.pxd)
    Py_ssize_t n_top            # top-n logprobs wanted
    bint want_logprob
    int64_t forced_token        # >= 0: the row's token, scored, not drawn (score_raw)


cdef inline bint level_truncated(const RowParams* p) noexcept nogil:
    """Truncated at a level below the row max (min_p, top_k), which SHVS and
    the compact rows leave to the full path unless the level provably
    excludes the cold region. A new truncation of that kind joins here."""
    return p.scalars.min_p > 0 or p.scalars.top_k > 0


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


cdef inline Py_ssize_t first_override_at(const Overrides* ov, Py_ssize_t column) noexcept nogil:
    """The first override at or after `column` (ov.n when none)."""
    cdef Py_ssize_t lo = 0
    cdef Py_ssize_t hi = ov.n
    cdef Py_ssize_t mid
    while lo < hi:
        mid = (lo + hi) >> 1
        if ov.column[mid] < column:
            lo = mid + 1
        else:
            hi = mid
    return lo


cdef inline const float* reread_block(const RowSource* src, Py_ssize_t b, const Overrides* ov,
                                      float* buf) noexcept nogil:
    cdef Py_ssize_t ov_pos = first_override_at(ov, b * SS_BLOCK)
    return block_logits(src, b, ov, &ov_pos, buf)


cdef inline const void* reread_block_stored(const RowSource* src, Py_ssize_t b,
                                            const Overrides* ov, float* buf,
                                            bint* bf16) noexcept nogil:
    """Block b for a block function that widens bfloat16 itself: a plain
    bfloat16 block as stored (bf16[0] set), any other as reread_block's
    floats."""
    cdef Py_ssize_t ov_pos = first_override_at(ov, b * SS_BLOCK)
    bf16[0] = src.dtype == DTYPE_BFLOAT16 and plain_block(src, b, ov, ov_pos)
    if bf16[0]:
        return <const uint16_t*>src.data + b * SS_BLOCK
    return block_logits(src, b, ov, &ov_pos, buf)


# By default a row with n overrides, n x this >= its blocks, is sampled from
# penalized_row's copy (it counts overrides, not the blocks they fall in: a
# long history's ids spread over most blocks): patching block by block then
# costs more than one copy, since each patched block is stored element by
# element and at once reloaded as vectors.
cdef enum:
    PENALIZED_ROW_BLOCKS_PER_OVERRIDE = 2

# The thresholds' test seam (sampling._force_override_paths): -1, the defaults.
cdef Py_ssize_t forced_bitmap_min_entries = -1
cdef Py_ssize_t forced_penalized_min_overrides = -1


cdef inline void penalized_row(const RowSource* src, const Overrides* ov, float* out) noexcept nogil:
    """The row's penalized, pre-temperature logits as float32, every column:
    the floats block_logits gives, so a row sampled from them draws the
    same token."""
    cdef Py_ssize_t j
    cdef const uint16_t* half_row = <const uint16_t*>src.data
    if src.dtype == DTYPE_FLOAT32:
        memcpy(out, src.data, src.vocab * sizeof(float))
    elif src.dtype == DTYPE_FLOAT16:
        for j in range(src.vocab):
            out[j] = ss_half_to_float(half_row[j])
    else:
        for j in range(src.vocab):
            out[j] = ss_bf16_to_float(half_row[j])
    for j in range(ov.n):
        out[ov.column[j]] = adjusted_logit(out[ov.column[j]], ov, j)


cdef inline float count_lower_bound(const Workspace* ws, Py_ssize_t n_blocks, float row_max,
                                    Py_ssize_t k) noexcept nogil:
    """A threshold t with at least k blocks whose max reaches it, so at least
    k tokens have z >= t: a lower bound on the k-th largest z, found by
    counting block maxima over a ladder of gaps below the row max and then
    bisecting until at most k + k / 2 blocks reach it (or the bisection runs
    out of floats between two levels: block maxima tied at one value), so a
    collection at t rereads about k blocks whatever the row's spread. Each
    count is one vectorized pass over the block maxima."""
    if ss_count_at_or_above(ws.block_max, n_blocks, row_max) >= k:
        return row_max
    cdef float missed = row_max         # fewer than k blocks reach it
    cdef float gap = 0.5
    cdef Py_ssize_t reaching = ss_count_at_or_above(ws.block_max, n_blocks, row_max - gap)
    while reaching < k:
        if gap > 64:
            return -INFINITY
        missed = row_max - gap
        gap = 2 * gap
        reaching = ss_count_at_or_above(ws.block_max, n_blocks, row_max - gap)
    cdef float reached = row_max - gap  # k or more blocks reach it
    cdef float middle
    cdef Py_ssize_t count
    while reaching > k + k // 2:
        middle = 0.5 * (reached + missed)
        if middle == reached or middle == missed:
            break
        count = ss_count_at_or_above(ws.block_max, n_blocks, middle)
        if count >= k:
            reached = middle
            reaching = count
        else:
            missed = middle
    return reached


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
                           float* kept_terms, int* nan_count) noexcept nogil:
    """Per block, max z (ws.block_max) and, with need_mass, its softmax mass
    relative to that max (ws.block_mass), from one load of the block
    (ss_block_max_mass; two blocks at a time where both are plain), and its
    terms into kept_terms (ws.terms, or NULL for none) where its max reaches
    terms_floor of the running row max (as it stood before the block, or
    before its pair); counts NaN blocks. Returns the row max z."""
    cdef float row_max = -INFINITY
    cdef int nans = 0                   # a local: kept in a register
    cdef Py_ssize_t ov_pos = 0
    cdef Py_ssize_t b
    cdef const float* x
    cdef float m
    cdef float mass
    cdef const uint16_t* half_row = <const uint16_t*>src.data
    cdef float* terms = NULL
    cdef float pair_max[2]
    cdef float pair_mass[2]
    cdef int k
    if not need_mass:
        for b in range(n_blocks):
            if src.dtype == DTYPE_BFLOAT16 and plain_block(src, b, ov, ov_pos):
                # widened in registers (block_logits would store a float copy)
                m = ss_block_max_nan_bf16(half_row + b * SS_BLOCK, &nans)
            else:
                m = ss_block_max_nan(block_logits(src, b, ov, &ov_pos, ws.block), &nans)
            ws.block_max[b] = m * inv_t
            row_max = ws.block_max[b] if ws.block_max[b] > row_max else row_max
        nan_count[0] += nans
        return row_max
    b = 0
    while b < n_blocks:
        if kept_terms != NULL:
            terms = kept_terms + b * SS_BLOCK
        if src.dtype != DTYPE_FLOAT16 and plain_block(src, b + 1, ov, ov_pos):
            # Blocks b and b + 1 of a row read in place (float32, bfloat16),
            # whole and with no override (the first override at or after b's
            # start lies past b + 1's end): both maxima first, then both
            # masses (ss_block_pair_max_mass), the floats the single blocks
            # below would give.
            if src.dtype == DTYPE_BFLOAT16:
                ss_block_pair_max_mass_bf16(half_row + b * SS_BLOCK, inv_t, pair_max, pair_mass,
                                            &nans, terms, terms_floor(row_max, src.dtype))
            else:
                ss_block_pair_max_mass(<const float*>src.data + b * SS_BLOCK, inv_t, pair_max,
                                       pair_mass, &nans, terms, terms_floor(row_max, src.dtype))
            for k in range(2):
                ws.block_mass[b] = pair_mass[k]
                ws.block_max[b] = pair_max[k] * inv_t
                row_max = ws.block_max[b] if ws.block_max[b] > row_max else row_max
                b += 1
            continue
        if src.dtype == DTYPE_BFLOAT16 and plain_block(src, b, ov, ov_pos):
            m = ss_block_max_mass_bf16(half_row + b * SS_BLOCK, inv_t, &mass, &nans, terms,
                                       terms_floor(row_max, src.dtype))
        else:
            x = block_logits(src, b, ov, &ov_pos, ws.block)
            m = ss_block_max_mass(x, inv_t, &mass, &nans, terms, terms_floor(row_max, src.dtype))
        ws.block_mass[b] = mass
        ws.block_max[b] = m * inv_t
        row_max = ws.block_max[b] if ws.block_max[b] > row_max else row_max
        b += 1
    nan_count[0] += nans
    return row_max


cdef inline double masses_at_row_max(Workspace* ws, Py_ssize_t n_blocks,
                                     float row_max) noexcept nogil:
    """The online softmax's rescaling after row_pass, for every block at once:
    each block's mass moves from its own max to the row max by exp(block max
    - row max) (ws.block_scale, kept for the terms), in vector lanes. Returns
    the row's mass, their sum."""
    cdef Py_ssize_t b
    cdef double row_mass = 0.0
    cdef float* scale = ws.block_scale
    ss_exp_shifted(ws.block_max, row_max, scale, n_blocks)
    for b in range(n_blocks):
        ws.block_mass[b] = ws.block_mass[b] * scale[b]
    for b in range(n_blocks):
        row_mass += ws.block_mass[b]
    return row_mass


cdef void sample_row(const RowSource* src, const Overrides* ov, const RowParams* p,
                     Workspace* ws, RowResult* result, int32_t* top_tokens,
                     float* top_logprobs) noexcept nogil:
    """The full path: exact for every row, one streaming pass plus rereads."""
    cdef Py_ssize_t n_blocks = (src.vocab + SS_BLOCK - 1) // SS_BLOCK
    cdef float inv_t = p.scalars.inverse_temperature

    cdef bint truncating = (not p.scalars.greedy) and (level_truncated(p) or p.scalars.top_p < 1.0)
    cdef bint top_p_alone = (not p.scalars.greedy) and p.scalars.top_p < 1.0 and not level_truncated(p)
    cdef bint need_mass = (p.want_logprob or p.n_top > 0 or top_p_alone
                           or not (p.scalars.greedy or truncating))

    # Pass 1, the only full read of the row (row_pass). Each call site passes
    # constant arguments. top_p alone keeps the terms of the blocks near the
    # row max for the rejection test of a broad row (TERMS_GAP, nucleus.pxi),
    # at a site of its own: the terms chosen at run time in the mass site
    # made fitted float32 rows 10-15% slower even with no term stored, and
    # float32 logprobs 10% slower. With three sites GCC keeps row_pass out of
    # line (two sites: inlined, and a third once cost bfloat16 rows 10-25%;
    # with this loop, bench kernels on a shared host saw bfloat16 rows 0-5%
    # slower than with two sites).
    cdef int nan_count = 0
    cdef float row_max
    if top_p_alone:
        row_max = row_pass(src, ov, ws, n_blocks, inv_t, True, ws.terms, &nan_count)
    elif need_mass:
        row_max = row_pass(src, ov, ws, n_blocks, inv_t, True, NULL, &nan_count)
    else:
        row_max = row_pass(src, ov, ws, n_blocks, inv_t, False, NULL, &nan_count)
    if nan_count > 0 or row_max == INFINITY:
        result.error = find_bad_column(src, ov, inv_t, ws.block, &result.error_column)
        if result.error == ERROR_NONE:  # never a token drawn from a NaN mass
            result.error = ERROR_INTERNAL
        return
    if row_max == -INFINITY:
        result.error = ERROR_ALL_BANNED
        return

    cdef double row_mass = masses_at_row_max(ws, n_blocks, row_max) if need_mass else 0.0
    cdef double log_row_mass = log(row_mass) if need_mass else 0.0

    # Collection threshold: every token that can survive 5-7 has z >= it.
    cdef float threshold = INFINITY
    cdef double log_min_p = log(p.scalars.min_p) if p.scalars.min_p > 0 else -INFINITY
    cdef float bound
    cdef Py_ssize_t gap_index = 0
    if truncating:
        threshold = -INFINITY
        if p.scalars.min_p > 0:
            # Collected a hair low; the exact boundary is applied in double below.
            bound = <float>(row_max + log_min_p)
            threshold = bound - (1e-6 * (bound if bound > 0 else -bound) + 1e-30)
        if p.scalars.top_k > 0 and ss_count_at_or_above(ws.block_max, n_blocks, threshold) > p.scalars.top_k:
            bound = count_lower_bound(ws, n_blocks, row_max, p.scalars.top_k)
            threshold = bound if bound > threshold else threshold
        if top_p_alone:
            threshold = top_p_threshold(ws, n_blocks, row_max, p.scalars.top_p * row_mass, &gap_index)
    # A broad truncation (min_p and top_p without top_k, most of the row
    # above the threshold) is drawn by rejection (nucleus.pxi), collecting nothing.
    cdef bint broad = (truncating and p.scalars.top_k <= 0
                       and is_broad(ws, n_blocks, threshold))
    cdef float min_p_z = min_p_floor(row_max, log_min_p) if broad and p.scalars.min_p > 0 else -INFINITY
    # The top-n logprobs need n tokens collected: n blocks whose max reaches the threshold.
    cdef float collect_at = INFINITY if broad else threshold
    if p.n_top > 0 and ss_count_at_or_above(ws.block_max, n_blocks, collect_at) < p.n_top:
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
        while top_p_alone and not broad and threshold > -INFINITY:
            nucleus_mass = 0.0
            for i in range(c.n):
                if c.z[i] >= threshold:
                    nucleus_mass += c.w[i]
            if nucleus_mass >= p.scalars.top_p * row_mass:
                break
            gap_index += 1
            threshold = top_p_threshold(ws, n_blocks, row_max, p.scalars.top_p * row_mass, &gap_index)
            collect_at = threshold if threshold < collect_at else collect_at
            c.n = collect(src, ov, inv_t, ws, n_blocks, collect_at, row_max)

    if p.n_top > 0:
        count = min(p.n_top, c.n)
        copy_top(&c, count, top_tokens, top_logprobs)
        for i in range(count):
            top_logprobs[i] = <float>(top_logprobs[i] - row_max - log_row_mass)

    cdef double u
    cdef double kept_mass
    if p.forced_token >= 0:
        result.token = p.forced_token
    elif p.scalars.greedy:
        result.token = first_argmax(src, ov, ws, n_blocks, row_max, ws.block)
    elif not truncating:
        u = uniform_double(p.scalars.seed, p.scalars.step, 0)
        result.token = draw_from_blocks(src, ov, inv_t, ws, n_blocks, row_max, row_mass, u, NULL)
    elif broad:
        result.token = sample_broad(src, ov, p, ws, n_blocks, row_max, min_p_z,
                                    row_mass if top_p_alone else -1.0)
    else:
        keep_at_least(&c, threshold)
        if p.scalars.min_p > 0:
            i = 0
            while i < c.n:      # the exact min_p boundary, in double
                if <double>c.z[i] - row_max < log_min_p:
                    c.n -= 1
                    c.z[i] = c.z[c.n]
                    c.token[i] = c.token[c.n]
                    c.w[i] = c.w[c.n]
                else:
                    i += 1
        if p.scalars.top_k > 0 and c.n > p.scalars.top_k:
            select_rank(&c, p.scalars.top_k - 1)
            keep_at_least(&c, c.z[p.scalars.top_k - 1])
        count = c.n
        if p.scalars.top_p < 1.0:
            if top_p_alone:
                kept_mass = row_mass
            else:
                kept_mass = 0.0
                for i in range(c.n):
                    kept_mass += c.w[i]
            count = top_p_prefix(&c, p.scalars.top_p * kept_mass)
        u = uniform_double(p.scalars.seed, p.scalars.step, 0)
        result.token = c.token[draw_index(&c, count, u)]

    if p.want_logprob:
        x = reread_block(src, result.token // SS_BLOCK, ov, ws.block)
        result.logprob = <float>(x[result.token % SS_BLOCK] * inv_t - row_max - log_row_mass)
    result.error = ERROR_NONE


cdef void score_raw(const RowSource* src, int64_t token, bint want_logprob, Py_ssize_t n_top,
                    Workspace* ws, RowResult* result, int32_t* top_tokens,
                    float* top_logprobs) noexcept nogil:
    """vLLM's raw logprobs of a row sampled already: `token`'s (into
    result.logprob, with `want_logprob`) and the n_top most likely, under
    log_softmax of the logits as the model gave them (`src`: no bias, ban,
    penalty or temperature; vllm/v1/sample/sampler.py, ``Sampler.forward``,
    logprobs_mode raw_logprobs). sample_row itself scores them, with
    neutral parameters and the token forced: the same passes, exps and
    ties as every other logprob here."""
    cdef RowParams neutral
    cdef RowResult scored
    cdef Overrides none
    memset(&neutral, 0, sizeof(RowParams))
    memset(&none, 0, sizeof(Overrides))
    neutral.scalars.inverse_temperature = 1.0
    neutral.scalars.top_p = 1.0
    neutral.scalars.repetition_penalty = 1.0
    neutral.n_top = n_top
    neutral.want_logprob = want_logprob
    neutral.forced_token = token
    none.repetition = 1.0
    scored.logprob = 0.0
    scored.error = ERROR_NONE
    scored.error_column = -1
    sample_row(src, &none, &neutral, ws, &scored, top_tokens, top_logprobs)
    if scored.error != ERROR_NONE:  # never after a draw from the same row; reported if it were
        result.error = scored.error
        result.error_column = scored.error_column
    elif want_logprob:
        result.logprob = scored.logprob


cdef Workspace* allocate_workspace(Py_ssize_t vocab, Py_ssize_t n_blocks, Py_ssize_t max_entries,
                                   Py_ssize_t n_hot, Py_ssize_t id_limit,
                                   bint full_rows) noexcept nogil:
    """A thread's scratch. vocab: the widest row it reads; id_limit: the
    vocabulary the rows' bias, ban and history ids fall in; full_rows: it
    samples whole rows (sample_one), which may be penalized_row's."""
    cdef Workspace* ws = <Workspace*>malloc(sizeof(Workspace))
    if ws == NULL:
        return NULL
    ws.penalized = NULL
    ws.penalized_min_overrides = (
        (n_blocks + PENALIZED_ROW_BLOCKS_PER_OVERRIDE - 1) // PENALIZED_ROW_BLOCKS_PER_OVERRIDE
        if forced_penalized_min_overrides < 0 else forced_penalized_min_overrides)
    if full_rows and max_entries >= ws.penalized_min_overrides:
        ws.penalized = <float*>malloc(vocab * sizeof(float))
        if ws.penalized == NULL:
            free(ws)
            return NULL
    cdef Py_ssize_t entries = max_entries if max_entries > 0 else 1
    cdef Py_ssize_t words = (id_limit + 63) // 64
    ws.columns.min_entries = (BITMAP_MIN_ENTRIES if forced_bitmap_min_entries < 0
                              else forced_bitmap_min_entries)
    # the bitmap only where some row has entries enough to use it
    ws.columns.words = words if max_entries >= ws.columns.min_entries else 0
    ws.columns.bits = <uint64_t*>calloc(ws.columns.words + 1, sizeof(uint64_t))
    ws.columns.seen = <uint64_t*>calloc(ws.columns.words + 1, sizeof(uint64_t))
    ws.columns.banned = <uint64_t*>calloc(ws.columns.words + 1, sizeof(uint64_t))
    ws.columns.rank = <int32_t*>malloc((ws.columns.words + 1) * sizeof(int32_t))
    ws.block_max = <float*>malloc(n_blocks * sizeof(float))
    ws.block_mass = <float*>malloc(n_blocks * sizeof(float))
    ws.block_scale = <float*>malloc(n_blocks * sizeof(float))
    ws.terms = <float*>malloc(n_blocks * SS_BLOCK * sizeof(float))
    ws.entry_keys = <uint64_t*>malloc(entries * sizeof(uint64_t))
    ws.entry_scratch = <uint64_t*>malloc(entries * sizeof(uint64_t))
    ws.override_column = <int32_t*>malloc(entries * sizeof(int32_t))
    ws.override_bias = <float*>malloc(entries * sizeof(float))
    ws.override_count = <int32_t*>malloc(entries * sizeof(int32_t))
    ws.override_flags = <unsigned char*>malloc(entries)
    ws.cand_z = <float*>malloc(vocab * sizeof(float))
    ws.cand_token = <int32_t*>malloc(vocab * sizeof(int32_t))
    ws.cand_w = <float*>malloc(vocab * sizeof(float))
    ws.cand_block_w = <double*>malloc((vocab // DRAW_BLOCK + 1) * sizeof(double))
    ws.hot_z = <float*>malloc((n_hot if n_hot > 0 else 1) * sizeof(float))
    ws.hot_w = <float*>malloc((n_hot if n_hot > 0 else 1) * sizeof(float))
    ws.block_hot = <float*>malloc(n_blocks * sizeof(float))
    ws.block_total = <float*>malloc(n_blocks * sizeof(float))
    ws.block_ref = <float*>malloc(n_blocks * sizeof(float))
    ws.bucket_mass = <double*>malloc(NUCLEUS_BUCKETS * sizeof(double))
    ws.block_kept = <float*>malloc(n_blocks * sizeof(float))
    if (ws.columns.bits == NULL or ws.columns.seen == NULL or ws.columns.banned == NULL
            or ws.columns.rank == NULL or ws.bucket_mass == NULL or ws.block_kept == NULL or ws.hot_z == NULL or ws.hot_w == NULL or ws.block_hot == NULL or ws.block_total == NULL
            or ws.block_ref == NULL or ws.block_max == NULL or ws.block_mass == NULL
            or ws.block_scale == NULL or ws.terms == NULL or ws.entry_keys == NULL
            or ws.entry_scratch == NULL or ws.override_column == NULL or ws.override_bias == NULL
            or ws.override_count == NULL or ws.override_flags == NULL
            or ws.cand_z == NULL or ws.cand_token == NULL or ws.cand_w == NULL
            or ws.cand_block_w == NULL):
        free_workspace(ws)
        return NULL
    return ws


cdef void free_workspace(Workspace* ws) noexcept nogil:
    if ws == NULL:
        return
    free(ws.block_max)
    free(ws.block_mass)
    free(ws.block_scale)
    free(ws.terms)
    free(ws.entry_keys)
    free(ws.entry_scratch)
    free(ws.penalized)
    free(ws.columns.bits)
    free(ws.columns.seen)
    free(ws.columns.banned)
    free(ws.columns.rank)
    free(ws.override_column)
    free(ws.override_bias)
    free(ws.override_count)
    free(ws.override_flags)
    free(ws.cand_z)
    free(ws.cand_token)
    free(ws.cand_w)
    free(ws.cand_block_w)
    free(ws.hot_z)
    free(ws.hot_w)
    free(ws.block_hot)
    free(ws.block_total)
    free(ws.block_ref)
    free(ws.bucket_mass)
    free(ws.block_kept)
    free(ws)
