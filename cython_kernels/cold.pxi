# The simulated engine's cold draw (included by sampling.pyx; serving/simulated.py):
# the seeds and uniforms of a draw inside the cold region C, and a walk of C's
# weights by block masses instead of a pass over the row per step.


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


def cold_draw_uniforms(const uint64_t[::1] seed, const uint64_t[::1] step, double[::1] out):
    """out[r]: the uniform in [0, 1) of row r's draw inside C, on the
    stream ``cold_stream_seeds`` names: draw 0 of Philox(that seed,
    step[r]), the uniform the second request's untruncated draw uses, so a
    data plane that draws the cold token itself (``hot_first_summary``'s
    cold_draws) spends the same randomness, independent of the compact
    draw."""
    cdef uint32_t words[4]
    cdef Py_ssize_t r
    for r in range(seed.shape[0]):
        philox4x32_10(seed[r], step[r], COLD_STREAM_DRAW, words)
        out[r] = uniform_double((<uint64_t>words[0] << 32) | words[1], step[r], 0)


cdef inline double cold_weight(const unsigned char* row, int dtype, Py_ssize_t i,
                               const uint8_t* known, float cold_max) noexcept nogil:
    """exp(x_i - m_C) in float32 (0 for an id handed over: its bit in
    `known`, a little-endian bitmap)."""
    if (known[i >> 3] >> (i & 7)) & 1:
        return 0.0
    return expf(stored_logit(row, dtype, i) - cold_max)


def cold_block_masses(const unsigned char[:, ::1] rows, int dtype, const uint8_t[:, ::1] known,
                      const float[::1] cold_max, Py_ssize_t block, double[:, ::1] out):
    """out[r, b]: the cold weights exp(x - m_C) of row r's ids b * block ..
    (b + 1) * block - 1 summed in float64, ids whose bit is set in known[r]
    (little-endian, V bits) left out; rows whose m_C is not finite get 0.
    With ``walk_cold_blocks``: the simulated engine's cold draw
    (serving/simulated.py), a cumulative walk of the row without a pass over
    it per step."""
    cdef Py_ssize_t vocab = rows.shape[1] // (4 if dtype == DTYPE_FLOAT32 else 2)
    cdef Py_ssize_t r, b, i
    cdef double mass
    with nogil:
        for r in range(rows.shape[0]):
            for b in range(out.shape[1]):
                mass = 0.0
                if cold_max[r] > -INFINITY and cold_max[r] < INFINITY:
                    for i in range(b * block, min((b + 1) * block, vocab)):
                        mass += cold_weight(&rows[r, 0], dtype, i, &known[r, 0], cold_max[r])
                out[r, b] = mass


def walk_cold_blocks(const unsigned char[:, ::1] rows, int dtype, const uint8_t[:, ::1] known,
                     const double[:, ::1] block_mass, const int64_t[::1] table_row,
                     const float[::1] cold_max, const double[::1] draws,
                     const int64_t[::1] added_offsets, const int64_t[::1] added_ids,
                     const double[::1] added_weights, Py_ssize_t block,
                     int32_t[::1] token, float[::1] token_logit):
    """Row r's cold token: the id where draws[r] * W falls along its cold
    weights in id order (``cold_block_masses``' weights, W their sum), found
    through the block masses of table row table_row[r] (its bitmap the
    same row of `known`) less the weights of the ids row r adds (CSR
    added_offsets / added_ids / added_weights: handed over by this request,
    left out of the walk too). rows[r] is the row itself. token[r] = -1
    (untouched token_logit) where draws[r] is NaN, W is not positive, or the
    sums' rounding leaves the walk on no weight."""
    cdef Py_ssize_t vocab = rows.shape[1] // (4 if dtype == DTYPE_FLOAT32 else 2)
    cdef Py_ssize_t blocks = block_mass.shape[1]
    cdef Py_ssize_t r, b, i, a, t, found
    cdef double total, target, acc, mass, w
    cdef bint added
    with nogil:
        for r in range(rows.shape[0]):
            token[r] = -1
            t = table_row[r]
            if draws[r] != draws[r]:
                continue
            total = 0.0
            for b in range(blocks):
                total += block_mass[t, b]
            for a in range(added_offsets[r], added_offsets[r + 1]):
                total -= added_weights[a]
            if not total > 0.0:
                continue
            target = draws[r] * total
            if target >= total:
                target = nextafter(total, 0.0)
            acc = 0.0
            found = -1
            for b in range(blocks):
                mass = block_mass[t, b]
                for a in range(added_offsets[r], added_offsets[r + 1]):
                    if added_ids[a] // block == b:
                        mass -= added_weights[a]
                if acc + mass > target:
                    found = b
                    break
                acc += mass
            if found < 0:
                continue
            for i in range(found * block, min((found + 1) * block, vocab)):
                added = False
                for a in range(added_offsets[r], added_offsets[r + 1]):
                    added = added or added_ids[a] == i
                w = 0.0 if added else cold_weight(&rows[r, 0], dtype, i, &known[t, 0],
                                                  cold_max[r])
                acc += w
                if w > 0.0 and acc > target:
                    token[r] = <int32_t>i
                    token_logit[r] = stored_logit(&rows[r, 0], dtype, i)
                    break
