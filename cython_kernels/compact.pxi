# Hot-first handoff: compact rows (included by sampling.pyx; docs/HANDOFF.md
# has the derivation).
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


cdef inline float stored_logit(const unsigned char* row, int dtype, Py_ssize_t i) noexcept nogil:
    """Logit i of a row stored in `dtype`, as float32."""
    if dtype == DTYPE_FLOAT32:
        return (<const float*>row)[i]
    if dtype == DTYPE_FLOAT16:
        return ss_half_to_float((<const uint16_t*>row)[i])
    return ss_bf16_to_float((<const uint16_t*>row)[i])


cdef inline float hot_logit(const CompactRow* row, Py_ssize_t i) noexcept nogil:
    return stored_logit(row.hot, row.dtype, i)


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


cdef inline double block_weight_sums(const Candidates* c, double* sums) noexcept nogil:
    """sums[b] := the weights of candidates [64 b, 64 b + 64) summed in 8
    lanes (a fixed order: the same sums for the same candidates, whatever
    the batch); returns the sums added in block order, the candidates'
    mass."""
    cdef double lanes[8]
    cdef double total = 0.0
    cdef Py_ssize_t i, j, end
    cdef Py_ssize_t start = 0
    cdef Py_ssize_t b = 0
    while start < c.n:
        end = start + DRAW_BLOCK if start + DRAW_BLOCK < c.n else c.n
        for j in range(8):
            lanes[j] = 0.0
        if end - start == DRAW_BLOCK:
            for i in range(start, end, 8):
                for j in range(8):
                    lanes[j] += c.w[i + j]
        else:
            for i in range(start, end):
                lanes[(i - start) % 8] += c.w[i]
        sums[b] = (((lanes[0] + lanes[1]) + (lanes[2] + lanes[3]))
                   + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7])))
        total += sums[b]
        start += DRAW_BLOCK
        b += 1
    return total


cdef inline Py_ssize_t draw_by_block_sums(const Candidates* c, const double* sums,
                                          double target) noexcept nogil:
    """Inverse-CDF draw in array order for a target in [0, the mass
    block_weight_sums returned): the block where the running sum of the
    block sums passes target, then the candidate inside it where the running
    sum does; the block's last candidate of positive weight when rounding
    leaves target unreached inside it."""
    cdef double acc = 0.0
    cdef double before_chosen = 0.0
    cdef Py_ssize_t i, end
    cdef Py_ssize_t chosen = 0
    cdef Py_ssize_t start = 0
    cdef Py_ssize_t b = 0
    while start < c.n:
        if sums[b] > 0:
            chosen = start
            before_chosen = acc
            acc += sums[b]
            if acc > target:
                break
        start += DRAW_BLOCK
        b += 1
    end = chosen + DRAW_BLOCK if chosen + DRAW_BLOCK < c.n else c.n
    acc = before_chosen
    cdef Py_ssize_t last_positive = chosen
    for i in range(chosen, end):
        if c.w[i] > 0:
            acc += c.w[i]
            last_positive = i
            if acc > target:
                return i
    return last_positive


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
    cdef float inv_t = p.scalars.inverse_temperature
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
    cdef bint level_truncating = level_truncated(p)
    cdef bint truncating = level_truncating or p.scalars.top_p < 1.0
    cdef bint need_mass = (p.want_logprob or p.n_top > 0
                           or not (p.scalars.greedy or level_truncating))
    cdef double cold_weight = (row.cold_mass * ss_exp_nonpositive(zc - row_max)
                               if zc > -INFINITY else 0.0)
    cdef double known_mass = 0.0
    cdef double log_total = 0.0
    if need_mass:
        ss_exp_shifted(c.z, row_max, c.w, c.n)
        known_mass = block_weight_sums(&c, ws.cand_block_w)
        log_total = log(known_mass + cold_weight)
    cdef Py_ssize_t i, count, upper_count
    if p.n_top > 0:
        if count_above(&c, zc) < p.n_top:
            return HANDOFF_NEED_FULL
        copy_top(&c, p.n_top, top_tokens, top_logprobs)
        for i in range(p.n_top):
            top_logprobs[i] = <float>(top_logprobs[i] - row_max - log_total)

    cdef double log_min_p = log(p.scalars.min_p) if p.scalars.min_p > 0 else -INFINITY
    cdef bint cold_out = zc == -INFINITY
    cdef double target, total_lo, total_hi
    cdef float chosen_z
    if p.scalars.greedy:
        i = first_at(&c, known_max)
        if i >= 0 and (known_max > zc or (known_max == zc and c.token[i] < row.cold_argmax)):
            result.token = c.token[i]
            chosen_z = known_max
        else:
            result.token = row.cold_argmax
            chosen_z = zc
    elif not truncating:
        target = uniform_double(p.scalars.seed, p.scalars.step, 0) * (known_mass + cold_weight)
        if target >= known_mass:
            # The caller adds this (the log of C's share) to the logprob of
            # the token it draws inside C.
            result.logprob = <float>(log(cold_weight) - log_total)
            return HANDOFF_NEED_COLD
        i = draw_by_block_sums(&c, ws.cand_block_w, target)
        result.token = c.token[i]
        chosen_z = c.z[i]
    elif level_truncating:
        if p.scalars.min_p > 0:
            cold_out = cold_out or <double>zc - row_max < log_min_p
            keep_min_p(&c, row_max, log_min_p)
        if p.scalars.top_k > 0 and not cold_out:
            # Only the known tokens strictly above zc can be among the top
            # k when k of them are; otherwise C's survivors are unknown.
            keep_at_least(&c, nextafterf(zc, INFINITY))
            cold_out = c.n >= p.scalars.top_k
        if not cold_out:
            return HANDOFF_NEED_FULL
        # C is out of the candidate set: what is left is the full path's.
        if p.scalars.top_k > 0 and c.n > p.scalars.top_k:
            select_rank(&c, p.scalars.top_k - 1)
            keep_at_least(&c, c.z[p.scalars.top_k - 1])
        if not need_mass:
            ss_exp_shifted(c.z, row_max, c.w, c.n)
        count = c.n
        if p.scalars.top_p < 1.0:
            count = top_p_prefix(&c, p.scalars.top_p * weight_sum(&c))
        i = draw_index(&c, count, uniform_double(p.scalars.seed, p.scalars.step, 0))
        result.token = c.token[i]
        chosen_z = c.z[i]
    else:
        # top_p alone: the nucleus must end strictly above zc, where every
        # token ranks before all of C, whatever S_C is within its margin.
        total_lo = known_mass + cold_weight * (1.0 - COLD_MASS_MARGIN)
        total_hi = known_mass + cold_weight * (1.0 + COLD_MASS_MARGIN)
        if not keep_nucleus_cover(&c, row_max, nextafterf(zc, INFINITY), p.scalars.top_p * total_hi):
            return HANDOFF_NEED_FULL
        upper_count = top_p_prefix(&c, p.scalars.top_p * total_hi)
        c.n = upper_count
        count = top_p_prefix(&c, p.scalars.top_p * total_lo)
        if count != upper_count:
            return HANDOFF_NEED_FULL
        i = draw_index(&c, count, uniform_double(p.scalars.seed, p.scalars.step, 0))
        result.token = c.token[i]
        chosen_z = c.z[i]
    result.logprob = <float>(chosen_z - row_max - log_total)
    return HANDOFF_DECIDED
