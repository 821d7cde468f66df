# Selection over a row's surviving candidates, without sorting them.
#
# Candidates are parallel arrays (value z, token id, weight w) ordered by the
# key "z descending, then token id ascending": a strict total order, so ties
# in z have one defined rank and every selection below is deterministic.
# All routines are expected-linear quickselects with pivots from a hash of the
# range (deterministic, so results never depend on thread or batch).
from libc.stdint cimport int32_t, uint64_t

cdef struct Candidates:
    float* z
    int32_t* token
    float* w
    Py_ssize_t n


cdef inline bint ranks_before(const Candidates* c, Py_ssize_t a, Py_ssize_t b) noexcept nogil:
    return c.z[a] > c.z[b] or (c.z[a] == c.z[b] and c.token[a] < c.token[b])


cdef inline void swap_items(Candidates* c, Py_ssize_t a, Py_ssize_t b) noexcept nogil:
    cdef float z = c.z[a]
    cdef int32_t t = c.token[a]
    cdef float w = c.w[a]
    c.z[a] = c.z[b]
    c.token[a] = c.token[b]
    c.w[a] = c.w[b]
    c.z[b] = z
    c.token[b] = t
    c.w[b] = w


cdef inline Py_ssize_t pick_pivot(const Candidates* c, Py_ssize_t lo, Py_ssize_t hi) noexcept nogil:
    """Median (by rank) of three positions chosen by hashing the range."""
    cdef uint64_t h = (<uint64_t>lo * 0x9E3779B97F4A7C15ULL) ^ (<uint64_t>hi * 0xC2B2AE3D27D4EB4FULL)
    h ^= h >> 31
    cdef Py_ssize_t span = hi - lo
    cdef Py_ssize_t a = lo + <Py_ssize_t>(h % <uint64_t>span)
    cdef Py_ssize_t b = lo + <Py_ssize_t>((h >> 21) % <uint64_t>span)
    cdef Py_ssize_t m = lo + <Py_ssize_t>((h >> 42) % <uint64_t>span)
    if ranks_before(c, a, b):
        if ranks_before(c, b, m):
            return b
        return m if ranks_before(c, a, m) else a
    if ranks_before(c, a, m):
        return a
    return m if ranks_before(c, b, m) else b


cdef inline Py_ssize_t partition(Candidates* c, Py_ssize_t lo, Py_ssize_t hi) noexcept nogil:
    """Partition [lo, hi) around a pivot; returns the pivot's final position.

    Items ranked before the pivot end up left of it, the rest right of it."""
    cdef Py_ssize_t p = pick_pivot(c, lo, hi)
    swap_items(c, p, hi - 1)
    cdef Py_ssize_t store = lo
    cdef Py_ssize_t i
    for i in range(lo, hi - 1):
        if ranks_before(c, i, hi - 1):
            swap_items(c, i, store)
            store += 1
    swap_items(c, store, hi - 1)
    return store


cdef inline void select_rank(Candidates* c, Py_ssize_t rank) noexcept nogil:
    """Reorder so position `rank` holds the item of that rank (0 = first),
    items before it rank before it and items after it rank after it."""
    cdef Py_ssize_t lo = 0
    cdef Py_ssize_t hi = c.n
    cdef Py_ssize_t p
    while hi - lo > 1:
        p = partition(c, lo, hi)
        if p == rank:
            return
        if p < rank:
            lo = p + 1
        else:
            hi = p


cdef inline void copy_top(const Candidates* c, Py_ssize_t n, int32_t* tokens,
                          float* z) noexcept nogil:
    """The first n candidates by rank (n <= c.n), in rank order, into tokens
    and z, leaving c in its own order: the draw walks the candidates in that
    order, so a row asking for its top-n logprobs draws the token it draws
    without them. Insertion into the n kept so far, most of the candidates
    refused by one compare with the last kept (n is at most 20)."""
    cdef Py_ssize_t kept = 0
    cdef Py_ssize_t i, j
    cdef float zi
    cdef int32_t ti
    for i in range(c.n):
        zi = c.z[i]
        ti = c.token[i]
        if kept == n and not (zi > z[n - 1] or (zi == z[n - 1] and ti < tokens[n - 1])):
            continue
        j = kept if kept < n else n - 1
        while j > 0 and (zi > z[j - 1] or (zi == z[j - 1] and ti < tokens[j - 1])):
            z[j] = z[j - 1]
            tokens[j] = tokens[j - 1]
            j -= 1
        z[j] = zi
        tokens[j] = ti
        if kept < n:
            kept += 1


cdef inline void keep_at_least(Candidates* c, float threshold) noexcept nogil:
    """Keep the items with z >= threshold (stable compaction: past the
    first item dropped, every item is written at the next slot, which
    advances only when kept, with no branch)."""
    cdef Py_ssize_t kept = 0
    cdef Py_ssize_t i
    # read-only up to the first item dropped: where the candidates were
    # collected at this very threshold (top_p alone) every item stays, and
    # the moves below, each waiting on the last compare, cost a broad nucleus
    # (a high temperature, a flat row) a fifth to a third of its time
    while kept < c.n and c.z[kept] >= threshold:
        kept += 1
    for i in range(kept, c.n):
        c.z[kept] = c.z[i]
        c.token[kept] = c.token[i]
        c.w[kept] = c.w[i]
        kept += c.z[i] >= threshold
    c.n = kept


cdef inline Py_ssize_t top_p_prefix(Candidates* c, double target) noexcept nogil:
    """Length J of the nucleus: the smallest rank-prefix whose mass reaches
    `target` (the first item whose inclusive cumulative weight is >= target
    closes it; all items if the total stays below target).

    Reorders the candidates so the nucleus occupies positions [0, J)."""
    cdef Py_ssize_t lo = 0
    cdef Py_ssize_t hi = c.n
    cdef double before = 0.0      # mass of items ranked before position lo
    cdef double left
    cdef Py_ssize_t p, i
    while hi - lo > 1:
        p = partition(c, lo, hi)
        left = before
        for i in range(lo, p):
            left += c.w[i]
        if left >= target:
            hi = p
        elif left + c.w[p] >= target:
            return p + 1
        else:
            before = left + c.w[p]
            lo = p + 1
    if lo < hi and before + c.w[lo] >= target:
        return lo + 1
    return hi if hi > lo else lo
