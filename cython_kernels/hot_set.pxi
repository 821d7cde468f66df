# Speculative hot-vocab sampling, SHVS (included by sampling.pyx): a row
# decided from the hot set and bounds on the mass outside it, or sent to the
# full path (row.pxi).

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
    cdef double u = uniform_double(p.scalars.seed, p.scalars.step, 0) * (s.hot_mass + s.cold_upper)
    if u < s.hot_mass:
        result.token = draw_hot(hot, ws, n_blocks, u)
        return HOT_ACCEPTED
    cdef double cold = exact_cold_mass(src, ov, p.scalars.inverse_temperature, hot, ws, n_blocks, s.row_max)
    if u >= s.hot_mass + cold:
        u = uniform_double(p.scalars.seed, p.scalars.step, 1) * (s.hot_mass + cold)
    result.token = draw_exact(src, ov, p.scalars.inverse_temperature, hot, ws, n_blocks, s, cold, u)
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
    cdef double ladder_target = p.scalars.top_p * (s.hot_mass + s.cold_lower)
    cdef Candidates c
    c.z = ws.cand_z
    c.token = ws.cand_token
    c.w = ws.cand_w
    cdef Py_ssize_t gap_index = 0
    cdef Py_ssize_t reaching
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
        # A nucleus reaching over most blocks of a long row (a flat or hot
        # row) would be collected and ranked by quickselect here: 34x the full
        # path's cost on flat rows (docs/results/shvs-2026-11-28.md), which is
        # linear at any breadth (nucleus.pxi). Up to 128 blocks (8,192 logits)
        # cost little either way.
        reaching = ss_count_at_or_above(ws.block_max, n_blocks, threshold)
        if reaching > n_blocks // 2 and reaching > 128:
            return -1
        cold_in = 0.0
        removed = 0.0
        c.n = collect_above(src, ov, p.scalars.inverse_temperature, hot, ws, n_blocks, s, threshold,
                            &cold_in, &removed)
        bound_rest(s, removed, &lower, &upper)
        target_hi = p.scalars.top_p * (s.hot_mass + cold_in + upper)
        mass = 0.0
        for i in range(c.n):
            mass += c.w[i]
        if mass >= target_hi:
            break
    cdef Py_ssize_t upper_count = top_p_prefix(&c, target_hi)
    c.n = upper_count
    cdef Py_ssize_t lower_count = top_p_prefix(&c, p.scalars.top_p * (s.hot_mass + cold_in + lower))
    cdef Py_ssize_t drawn = draw_index(&c, upper_count, uniform_double(p.scalars.seed, p.scalars.step, 0))
    result.token = c.token[drawn]
    if drawn < lower_count:
        return HOT_ACCEPTED
    cdef double cold = exact_cold_mass(src, ov, p.scalars.inverse_temperature, hot, ws, n_blocks, s.row_max)
    cdef Py_ssize_t nucleus = top_p_prefix(&c, p.scalars.top_p * (s.hot_mass + cold))
    for i in range(nucleus):
        if c.token[i] == result.token:
            return HOT_FALLBACK
    result.token = c.token[draw_index(&c, nucleus, uniform_double(p.scalars.seed, p.scalars.step, 1))]
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
    if p.scalars.greedy or p.want_logprob or p.n_top > 0 or level_truncated(p) or hot.n == 0:
        return HOT_NOT_TRIED
    cdef Py_ssize_t n_blocks = (src.vocab + SS_BLOCK - 1) // SS_BLOCK
    cdef HotSummary s
    if not hot_pass(src, ov, p.scalars.inverse_temperature, hot, ws, n_blocks, &s):
        return HOT_FALLBACK_FULL
    if p.scalars.top_p >= 1.0:
        return untruncated_hot(src, ov, p, hot, ws, n_blocks, &s, result)
    cdef int outcome = top_p_hot(src, ov, p, hot, ws, n_blocks, &s, result)
    return outcome if outcome >= 0 else HOT_FALLBACK_FULL
