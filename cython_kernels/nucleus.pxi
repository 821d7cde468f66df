# Truncation of broad rows (included by sampling.pyx after row.pxi).
#
# min_p and top_p keep a prefix of the row in the order "z descending, then
# token id ascending". Where that prefix is large (a high temperature, a flat
# row: most of the vocabulary), selecting it among collected candidates costs
# a quickselect over most of V. Broad rows go here instead, reading the row in
# place block by block, with no candidate array of size V:
#
# * sample_broad, by rejection (the idea of FlashInfer's sorting-free top-p
#   sampling, flashinfer/sampling.py top_p_sampling_from_probs; written here
#   for one row on a CPU): draw s from the kept tokens R (min_p's, or all);
#   one pass sums the mass ranked before s; below top_p of R's mass, s is in
#   the nucleus and is the token; otherwise the nucleus lies wholly before s,
#   so draw again from the tokens before s, whose block masses that pass just
#   summed. Every round keeps R a superset of the nucleus and a draw from R
#   that lands in the nucleus is distributed as the nucleus, so the token is
#   exactly the truncated distribution's. A round is accepted with
#   probability >= top_p, and a rejection shrinks R: about 1 / top_p rounds.
# * sample_by_buckets, after MAX_REJECTION_ROUNDS rejections (with draws of
#   its own, so the mixture stays exact): the tokens above the truncation's
#   floor binned by z - row max into NUCLEUS_BUCKETS buckets, the boundary
#   bucket found by their masses and ordered exactly, the draw by bucket.

cdef enum:
    NUCLEUS_BUCKETS = 4096
    MAX_REJECTION_ROUNDS = 6


cdef inline bint is_broad(const Workspace* ws, Py_ssize_t n_blocks, float threshold) noexcept nogil:
    """More than a sixteenth of the blocks reach the collection threshold: a
    candidate set too large to select among cheaply, drawn by sample_broad."""
    return ss_count_at_or_above(ws.block_max, n_blocks, threshold) * 16 > n_blocks


cdef inline float min_p_floor(float row_max, double log_min_p) noexcept nogil:
    """The least float z with (double)z - row_max >= log_min_p, so that the
    float compare z >= it keeps exactly the tokens the double min_p rule keeps
    (the rule is monotone in z; row_max itself passes, min_p <= 1)."""
    cdef float z = <float>(row_max + log_min_p)
    while z > -INFINITY and <double>z - row_max >= log_min_p:
        z = nextafterf(z, -INFINITY)
    while <double>z - row_max < log_min_p:
        z = nextafterf(z, INFINITY)
    return z


cdef inline float top_p_floor(float row_max, double row_mass, double top_p,
                              Py_ssize_t vocab) noexcept nogil:
    """A z below the nucleus: the tokens under t weigh less than
    V * exp(t - row max) together, so at t = row max + ln((1 - top_p) * mass / V)
    the tokens at or above t already hold top_p of the mass. One more unit
    lower covers the rounding of the row mass."""
    return <float>(row_max + log((1.0 - top_p) * row_mass / vocab) - 1.0)


cdef struct Buckets:
    float inv_t
    float row_max
    float floor         # tokens below it are out (min_p) or past the nucleus (top_p)
    float scale         # buckets per unit of z below the row max
    double* mass        # [NUCLEUS_BUCKETS]


cdef inline uint64_t bucket_block(const RowSource* src, const Overrides* ov, Workspace* ws,
                                  const Buckets* bk, Py_ssize_t b, int32_t only_bucket,
                                  float* z, float* w, int32_t* bucket) noexcept nogil:
    cdef const float* x = reread_block(src, b, ov, ws.block)
    return ss_bucket_terms(x, bk.inv_t, bk.row_max, bk.floor, bk.scale, NUCLEUS_BUCKETS - 1,
                           only_bucket, z, w, bucket)


cdef inline Py_ssize_t collect_bucket(const RowSource* src, const Overrides* ov, Workspace* ws,
                                      const Buckets* bk, Py_ssize_t n_blocks,
                                      int32_t which) noexcept nogil:
    """The tokens of one bucket as candidates (z, token, w), in id order."""
    cdef float z[SS_BLOCK]
    cdef float w[SS_BLOCK]
    cdef int32_t bucket[SS_BLOCK]
    cdef Py_ssize_t n = 0
    cdef Py_ssize_t b
    cdef uint64_t lanes
    cdef int j
    for b in range(n_blocks):
        if ws.block_max[b] < bk.floor:
            continue
        lanes = bucket_block(src, ov, ws, bk, b, which, z, w, bucket)
        while lanes:
            j = ss_lowest_bit(lanes)
            lanes &= lanes - 1
            ws.cand_z[n] = z[j]
            ws.cand_token[n] = <int32_t>(b * SS_BLOCK + j)
            ws.cand_w[n] = w[j]
            n += 1
    return n


cdef inline Py_ssize_t tied_prefix(const Candidates* c, double target) noexcept nogil:
    """top_p_prefix for candidates that share one z and are in id order: the
    order is the array's, so the prefix ends where the running mass reaches
    target."""
    cdef double acc = 0.0
    cdef Py_ssize_t i
    for i in range(c.n):
        acc += c.w[i]
        if acc >= target:
            return i + 1
    return c.n


cdef int64_t sample_by_buckets(const RowSource* src, const Overrides* ov, const RowParams* p,
                               Workspace* ws, Py_ssize_t n_blocks, float row_max, float z_floor,
                               double top_p_mass, uint64_t draw_index) noexcept nogil:
    """Draw from the tokens with z >= z_floor, truncated to top_p of
    `top_p_mass` (< 0: top_p of the kept tokens' own mass) when top_p < 1,
    with the uniform of `draw_index`. z_floor < row max unless min_p is 1."""
    cdef Buckets bk
    bk.inv_t = p.scalars.inverse_temperature
    bk.row_max = row_max
    bk.floor = z_floor
    # (capped: a span of a few ulps would give an infinite scale and NaN buckets)
    bk.scale = <float>min(NUCLEUS_BUCKETS / (<double>row_max - z_floor), 1e30) if row_max > z_floor else 0.0
    bk.mass = ws.bucket_mass
    memset(bk.mass, 0, NUCLEUS_BUCKETS * sizeof(double))

    # Pass 2: each bucket's mass.
    cdef float z[SS_BLOCK]
    cdef float w[SS_BLOCK]
    cdef int32_t bucket[SS_BLOCK]
    cdef Py_ssize_t b
    cdef uint64_t lanes
    cdef int j
    for b in range(n_blocks):
        if ws.block_max[b] < z_floor:
            continue
        lanes = bucket_block(src, ov, ws, &bk, b, -1, z, w, bucket)
        while lanes:
            j = ss_lowest_bit(lanes)
            lanes &= lanes - 1
            bk.mass[bucket[j]] += w[j]
    cdef double kept_mass = 0.0
    cdef Py_ssize_t k
    for k in range(NUCLEUS_BUCKETS):
        kept_mass += bk.mass[k]

    # The boundary bucket: the first whose mass takes the running sum to the
    # target; its tokens are ordered exactly, the buckets before it are whole.
    cdef Py_ssize_t boundary = NUCLEUS_BUCKETS
    cdef double before = 0.0
    cdef double target
    cdef Candidates c
    c.z = ws.cand_z
    c.token = ws.cand_token
    c.w = ws.cand_w
    c.n = 0
    cdef Py_ssize_t count = 0
    cdef Py_ssize_t i
    cdef float z_low, z_high
    if p.scalars.top_p < 1.0:
        target = p.scalars.top_p * (top_p_mass if top_p_mass >= 0 else kept_mass)
        boundary = 0
        while boundary < NUCLEUS_BUCKETS and before + bk.mass[boundary] < target:
            before += bk.mass[boundary]
            boundary += 1
        if boundary < NUCLEUS_BUCKETS:
            c.n = collect_bucket(src, ov, ws, &bk, n_blocks, <int32_t>boundary)
            z_low = c.z[0]
            z_high = c.z[0]
            for i in range(c.n):
                z_low = c.z[i] if c.z[i] < z_low else z_low
                z_high = c.z[i] if c.z[i] > z_high else z_high
            if z_low == z_high:
                count = tied_prefix(&c, target - before)
            else:
                count = top_p_prefix(&c, target - before)
            kept_mass = before
            for i in range(count):
                kept_mass += c.w[i]

    # Pass 4: the draw, over the whole buckets before the boundary (in bucket
    # order, ids ascending in each), then the boundary's prefix.
    cdef double u = uniform_double(p.scalars.seed, p.scalars.step, draw_index)
    cdef double draw = u * kept_mass
    cdef double acc = 0.0
    cdef Py_ssize_t chosen = -1
    for k in range(boundary if boundary < NUCLEUS_BUCKETS else NUCLEUS_BUCKETS):
        if bk.mass[k] > 0:
            if acc + bk.mass[k] > draw:
                chosen = k
                break
            acc += bk.mass[k]
    cdef int64_t last_positive = -1
    if chosen < 0 and count > 0:
        for i in range(count):
            if c.w[i] > 0:
                acc += c.w[i]
                last_positive = c.token[i]
                if acc > draw:
                    return c.token[i]
        return last_positive if last_positive >= 0 else c.token[0]
    if chosen < 0:          # rounding left the draw past every bucket: the last token
        for k in range(boundary if boundary < NUCLEUS_BUCKETS else NUCLEUS_BUCKETS):
            if bk.mass[k] > 0:
                chosen = k
        draw = INFINITY
    for b in range(n_blocks):
        if ws.block_max[b] < z_floor:
            continue
        lanes = bucket_block(src, ov, ws, &bk, b, <int32_t>chosen, z, w, bucket)
        while lanes:
            j = ss_lowest_bit(lanes)
            lanes &= lanes - 1
            if w[j] > 0:
                acc += w[j]
                last_positive = b * SS_BLOCK + j
                if acc > draw:
                    return last_positive
    return last_positive


cdef inline Py_ssize_t plain_run_end(const RowSource* src, const Overrides* ov,
                                     Py_ssize_t b) noexcept nogil:
    """The end of the run of plain blocks (plain_block: whole, no override)
    from block b of a row read in place (float32, bfloat16): b itself when
    block b is not plain."""
    if src.dtype == DTYPE_FLOAT16:
        return b
    cdef Py_ssize_t ov_pos = first_override_at(ov, b * SS_BLOCK)
    cdef Py_ssize_t end_column = ov.column[ov_pos] if ov_pos < ov.n else src.vocab
    return max(b, min(end_column, src.vocab) // SS_BLOCK)


cdef inline double masses_before(const RowSource* src, const Overrides* ov, Workspace* ws,
                                 Py_ssize_t n_blocks, float inv_t, float row_max, float z_cut,
                                 int64_t id_cut, float terms_from) noexcept nogil:
    """Each block's mass ranked before the cut (z_cut, id_cut) into
    ws.block_kept (ss_blocks_mass_before: the exps of ss_block_mass_before,
    or in the blocks whose max reaches terms_from, which kept their terms
    (terms_floor; +inf: none), the row pass's terms ws.terms summed); returns
    their sum. Blocks whose max is below z_cut hold none and are not read.
    Each run of plain blocks goes to it in one call, read in place; any other
    block alone, as reread_block_stored gives it."""
    cdef double total = 0.0
    cdef Py_ssize_t b = 0
    cdef Py_ssize_t end
    cdef const void* x
    cdef bint bf16
    while b < n_blocks:
        end = plain_run_end(src, ov, b)
        if end > b:
            bf16 = src.dtype == DTYPE_BFLOAT16
            x = <const char*>src.data + b * SS_BLOCK * (2 if bf16 else 4)
        elif ws.block_max[b] < z_cut:
            ws.block_kept[b] = 0.0
            b += 1
            continue
        else:
            end = b + 1
            x = reread_block_stored(src, b, ov, ws.block, &bf16)
        ss_blocks_mass_before(x, bf16, b, end, ws.block_max, ws.block_scale, ws.terms,
                              terms_from, inv_t, row_max, z_cut, id_cut, ws.block_kept, &total)
        b = end
    return total


cdef inline int64_t draw_before(const RowSource* src, const Overrides* ov, Workspace* ws,
                                Py_ssize_t n_blocks, float inv_t, float row_max, float z_cut,
                                int64_t id_cut, double total, double u,
                                float terms_from) noexcept nogil:
    """A token ranked before the cut, drawn by mass with uniform u: a block
    by ws.block_kept (as masses_before left them, terms_from the same), then
    a column in it."""
    cdef double target = u * total
    cdef double acc = 0.0
    cdef double before_chosen = 0.0
    cdef Py_ssize_t b
    cdef Py_ssize_t chosen = -1
    for b in range(n_blocks):
        if ws.block_kept[b] > 0:
            chosen = b
            before_chosen = acc
            acc += ws.block_kept[b]
            if acc > target:
                break
    if chosen < 0:
        return -1
    cdef float w[SS_BLOCK]
    cdef uint64_t kept = 0
    cdef int64_t lane_cut = min(max(id_cut - chosen * SS_BLOCK, <int64_t>0), <int64_t>SS_BLOCK)
    cdef bint bf16
    cdef const void* x = reread_block_stored(src, chosen, ov, ws.block, &bf16)
    cdef int j
    if ws.block_max[chosen] >= terms_from:
        ss_block_terms_before(x, bf16, inv_t, ws.terms + chosen * SS_BLOCK, z_cut,
                              <int32_t>lane_cut, &kept)
        for j in range(SS_BLOCK):
            w[j] = ws.block_scale[chosen] * ws.terms[chosen * SS_BLOCK + j]
    else:
        ss_block_mass_before(x, bf16, inv_t, row_max, z_cut, <int32_t>lane_cut, w, &kept)
    acc = before_chosen
    cdef int64_t last_positive = -1
    while kept:
        j = ss_lowest_bit(kept)
        kept &= kept - 1
        if w[j] > 0:
            acc += w[j]
            last_positive = chosen * SS_BLOCK + j
            if acc > target:
                return last_positive
    return last_positive


cdef int64_t sample_broad(const RowSource* src, const Overrides* ov, const RowParams* p,
                          Workspace* ws, Py_ssize_t n_blocks, float row_max, float z_floor,
                          double row_mass) noexcept nogil:
    """Draw from a broad row's min_p / top_p truncation by rejection (see the
    top of this file). z_floor: min_p's floor (min_p_floor), -inf without
    min_p; row_mass: the whole row's mass from the row pass when the kept
    tokens are all of them (top_p alone: their block masses are
    ws.block_mass, and the row pass kept the terms of the blocks near the
    row max, which the rejection test then sums without an exp), < 0
    otherwise."""
    cdef float inv_t = p.scalars.inverse_temperature
    cdef float terms_from = terms_floor(row_max, src.dtype) if row_mass >= 0 else INFINITY
    cdef double kept_mass
    cdef int64_t token
    if row_mass >= 0:
        kept_mass = row_mass
        token = draw_from_blocks(src, ov, inv_t, ws, n_blocks, row_max, row_mass,
                                 uniform_double(p.scalars.seed, p.scalars.step, 0), NULL)
    else:
        # "before (z_floor, V)": every token with z >= z_floor
        kept_mass = masses_before(src, ov, ws, n_blocks, inv_t, row_max, z_floor, src.vocab,
                                  INFINITY)
        token = draw_before(src, ov, ws, n_blocks, inv_t, row_max, z_floor, src.vocab, kept_mass,
                            uniform_double(p.scalars.seed, p.scalars.step, 0), INFINITY)
    if p.scalars.top_p >= 1.0:
        return token
    cdef double target = p.scalars.top_p * kept_mass
    cdef double mass_before
    cdef float z_token
    cdef const float* x
    cdef int round_index
    for round_index in range(1, MAX_REJECTION_ROUNDS + 1):
        x = reread_block(src, token // SS_BLOCK, ov, ws.block)
        z_token = x[token % SS_BLOCK] * inv_t
        mass_before = masses_before(src, ov, ws, n_blocks, inv_t, row_max, z_token, token,
                                    terms_from)
        if mass_before < target:
            return token
        token = draw_before(src, ov, ws, n_blocks, inv_t, row_max, z_token, token, mass_before,
                            uniform_double(p.scalars.seed, p.scalars.step, round_index),
                            terms_from)
    return sample_by_buckets(src, ov, p, ws, n_blocks, row_max, z_floor if row_mass < 0 else
                             top_p_floor(row_max, row_mass, p.scalars.top_p, src.vocab),
                             row_mass, MAX_REJECTION_ROUNDS + 1)
