# Packed requests and their codec helpers (included by sampling.pyx after the
# entries, whose BatchInputs, CompactInputs and decide_compact_rows it uses):
# the compact ids' checks, padded id lists and ranges of the shared histories
# as CSR, and the interpreter of the packed records (PackedLayout,
# packed_row_scalars, decide_packed_compact) that decides a whole compact
# request in one call.


cdef inline bint hot_bit(const uint64_t* hot_bits, int64_t token) noexcept nogil:
    return (hot_bits[token >> 6] >> (token & 63)) & 1


cdef inline bint in_sorted(const int32_t* ids, Py_ssize_t n, int64_t token) noexcept nogil:
    cdef Py_ssize_t lo = 0
    cdef Py_ssize_t hi = n
    cdef Py_ssize_t mid
    while lo < hi:
        mid = (lo + hi) >> 1
        if ids[mid] < token:
            lo = mid + 1
        else:
            hi = mid
    return lo < n and ids[lo] == token


cdef int compact_ids_problem(const int64_t* offsets, const int32_t* ids, Py_ssize_t rows,
                             const uint64_t* hot_bits, Py_ssize_t vocab,
                             const int64_t* cold_argmax, const int64_t* cold_token,
                             const float* cold_token_logit, const float* cold_max,
                             const float* cold_mass, Py_ssize_t* index) noexcept nogil:
    """check_compact_ids over pointers (cold_token NULL: none); index[0]
    receives the index the problem names."""
    cdef Py_ssize_t r, i
    cdef int32_t token
    cdef int64_t drawn, argmax
    cdef float logit, mass
    for r in range(rows):
        for i in range(offsets[r], offsets[r + 1]):
            token = ids[i]
            index[0] = i
            if token < 0 or token >= vocab:
                return 1
            if i > offsets[r] and token <= ids[i - 1]:
                return 2
            if hot_bit(hot_bits, token):
                return 3
    for r in range(rows):
        index[0] = r
        argmax = cold_argmax[r]
        if argmax < -1 or argmax >= vocab:
            return 4
        # the cold region's maximum: none (-1) when it is -inf, else one of its
        # ids (a NaN or +inf maximum is the kernels' to report, at argmax)
        if cold_max[r] == -INFINITY and argmax != -1:
            return 7
        if cold_max[r] > -INFINITY and cold_max[r] < INFINITY and (
                argmax < 0 or hot_bit(hot_bits, argmax)
                or in_sorted(ids + offsets[r] if ids != NULL else NULL,
                             offsets[r + 1] - offsets[r], argmax)):
            return 7
        mass = cold_mass[r]
        if not (mass >= 0 and mass < INFINITY):
            return 8
    if cold_token == NULL:
        return 0
    for r in range(rows):
        index[0] = r
        drawn = cold_token[r]
        if drawn < -1 or drawn >= vocab:
            return 5
        if drawn < 0:
            continue
        logit = cold_token_logit[r]
        if (hot_bit(hot_bits, drawn)
                or in_sorted(ids + offsets[r] if ids != NULL else NULL,
                             offsets[r + 1] - offsets[r], drawn)
                or logit != logit or logit == INFINITY or logit == -INFINITY
                or logit > cold_max[r]):
            return 6
    return 0


def check_compact_ids(const int64_t[::1] offsets, const int32_t[::1] ids,
                      const uint64_t[::1] hot_bits, Py_ssize_t vocab,
                      const int64_t[::1] cold_argmax, const int64_t[::1] cold_token,
                      const float[::1] cold_token_logit, const float[::1] cold_max,
                      const float[::1] cold_mass):
    """One pass over compact rows' touched ids (CSR: offsets [B + 1], the
    offsets already checked), cold argmaxes and, when cold_token is not
    empty, drawn cold tokens ([B], -1 none) with their logits and the rows'
    cold_max. hot_bits: the hot set's bitmap (``HotVocab.kernel_arrays``;
    19 KB at V = 151,936 where an int32 position table is 600 KB, read at
    random). Returns (problem, index), problem 0 when all are good, 1
    ids[index] outside [0, V), 2 ids[index] not above the id before it in
    its row, 3 ids[index] hot, 4 cold_argmax[index] outside [-1, V), 5
    cold_token[index] outside [-1, V), 6 cold_token[index] not an id of the
    cold region (hot, or touched in its row) or its logit not finite or
    above cold_max[index], 7 cold_argmax[index] not what cold_max[index]
    says (-1 exactly when it is -inf, else an id of the cold region), 8
    cold_mass[index] not finite and >= 0. The numpy checks it replaces made
    a pass (and a temporary) each, per request."""
    cdef Py_ssize_t rows = offsets.shape[0] - 1
    if (cold_argmax.shape[0] != rows or cold_max.shape[0] != rows or cold_mass.shape[0] != rows
            or cold_token.shape[0] not in (0, rows) or cold_token_logit.shape[0] != cold_token.shape[0]):
        raise ValueError(f"cold_argmax, cold_max and cold_mass must have {rows} entries, cold_token and "
                         f"cold_token_logit {rows} or none")
    cdef Py_ssize_t index = 0
    cdef int problem = compact_ids_problem(
        &offsets[0], &ids[0] if ids.shape[0] else NULL, rows, &hot_bits[0], vocab,
        &cold_argmax[0] if cold_argmax.shape[0] else NULL,
        &cold_token[0] if cold_token.shape[0] else NULL,
        &cold_token_logit[0] if cold_token.shape[0] else NULL,
        &cold_max[0] if cold_max.shape[0] else NULL,
        &cold_mass[0] if cold_mass.shape[0] else NULL, &index)
    return problem, (index if problem else 0)


def padded_lists(const int32_t[:, ::1] padded, Py_ssize_t vocab, const float[:, ::1] values=None):
    """CSR of a -1 padded [B, L] int32 id list input (PADDING anywhere in a
    row): (offsets int64 [B + 1], ids int32 [n], the float32 values at those
    entries of `values` [B, L] or None, bad), bad the flat index of the first
    entry that is neither -1 nor in [0, vocab) (offsets, ids and values None
    then), -1 when all are good. Two passes over the ids (``padded_count``,
    ``padded_fill``) where numpy made a mask, a cumsum and a gather per
    array, per request."""
    cdef Py_ssize_t rows = padded.shape[0]
    cdef Py_ssize_t width = padded.shape[1]
    cdef bint with_values = values is not None
    if with_values and (values.shape[0] != rows or values.shape[1] != width):
        raise ValueError(f"values must have the ids' shape [{rows}, {width}], "
                         f"got [{values.shape[0]}, {values.shape[1]}]")
    offsets = np.empty(rows + 1, np.int64)
    cdef int64_t[::1] offset = offsets
    cdef Py_ssize_t bad = padded_count(padded, vocab, NULL, &offset[0])
    if bad >= 0:
        return None, None, None, bad
    out_ids = np.empty(offset[rows], np.int32)
    out_taken = np.empty(offset[rows], np.float32) if with_values else None
    cdef int32_t[::1] ids_out = out_ids
    cdef float[::1] taken_out
    if offset[rows]:
        if with_values:
            taken_out = out_taken
        padded_fill(padded, &values[0, 0] if with_values else NULL, NULL, &ids_out[0],
                    &taken_out[0] if with_values else NULL)
    return offsets, out_ids, out_taken, -1


cdef Py_ssize_t ranges_count(const int64_t[:] starts, const int64_t[:] stops, int64_t first,
                             int64_t row_len, int64_t rows_of, int64_t* offsets) noexcept nogil:
    """The first pass of ``range_lists``: offsets [B + 1] (the caller's) of
    the ranges laid end to end, each range checked. Returns -1, or the first
    row whose range is not within one row of row_len ids of
    [first, first + rows_of x row_len)."""
    cdef Py_ssize_t r
    cdef int64_t start, stop
    offsets[0] = 0
    for r in range(starts.shape[0]):
        start, stop = starts[r], stops[r]
        if stop < start or start < first or stop > first + rows_of * row_len or (
                stop > start and (start - first) // row_len != (stop - 1 - first) // row_len):
            return r
        offsets[r + 1] = offsets[r] + (stop - start)
    return -1


cdef Py_ssize_t ranges_fill(const int32_t* flat, const int64_t[:] starts, const int64_t* offsets,
                            Py_ssize_t vocab, int32_t* ids) noexcept nogil:
    """The second pass: the ranges' ids copied into ids [offsets[B]], read
    unsigned so that one compare refuses a negative id too. Returns -1, or
    the index in ids of an id outside [0, vocab)."""
    cdef Py_ssize_t r, i, n
    cdef uint32_t most = 0
    cdef const int32_t* source
    cdef int32_t* target
    for r in range(starts.shape[0]):
        source, target, n = flat + starts[r], ids + offsets[r], offsets[r + 1] - offsets[r]
        for i in range(n):  # a copy and a running max in one vectorizable loop
            target[i] = source[i]
            most = max(most, <uint32_t>source[i])
    if most < <uint32_t>vocab:
        return -1
    for i in range(offsets[starts.shape[0]]):
        if <uint32_t>ids[i] >= <uint32_t>vocab:
            return i
    return -1


def range_lists(const int32_t[::1] flat not None, const int64_t[:] starts not None,
                const int64_t[:] stops not None, int64_t first, int64_t row_len, int64_t rows_of,
                Py_ssize_t vocab):
    """CSR of ``flat[starts[r]:stops[r]]`` per row r, checked, for
    ``history_ref``'s ranges of the shared histories: (offsets int64
    [B + 1], ids int32 [n], bad_row, bad_id). bad_row: the first row whose
    range is not within one row of row_len ids of [first, first + rows_of x
    row_len) (then offsets and ids are None), else -1; bad_id: the index in
    ids of an id outside [0, vocab), else -1. Two passes, the second a copy
    with the ids' check folded in, where numpy built an index of every id
    (or a slice per row) and took a max over the copy."""
    if stops.shape[0] != starts.shape[0]:
        raise ValueError(f"starts and stops must have one entry per row, got "
                         f"{starts.shape[0]} and {stops.shape[0]}")
    # no product that could overflow: rows_of x row_len <= what follows first
    if (row_len < 1 or rows_of < 0 or not 0 <= first <= flat.shape[0]
            or rows_of > (flat.shape[0] - first) // row_len):
        raise ValueError(f"[{first}, {first} + {rows_of} x {row_len}) is not within the "
                         f"{flat.shape[0]} ids")
    if not 0 < vocab <= <int64_t>INT32_MAX + 1:
        raise ValueError(f"vocab must be in [1, 2**31], got {vocab}")
    offsets = np.empty(starts.shape[0] + 1, np.int64)
    cdef int64_t[::1] offset = offsets
    cdef Py_ssize_t bad
    with nogil:
        bad = ranges_count(starts, stops, first, row_len, rows_of, &offset[0])
    if bad >= 0:
        return None, None, bad, -1
    out_ids = np.empty(offset[starts.shape[0]], np.int32)
    cdef int32_t[::1] ids = out_ids
    if ids.shape[0] == 0:
        return offsets, out_ids, -1, -1
    with nogil:
        bad = ranges_fill(&flat[0], starts, &offset[0], vocab, &ids[0])
    return offsets, out_ids, -1, bad


# How packed_row_scalars reads and writes a field (numpy's dtype of the
# field: sampler_codec maps one to the other).
cpdef enum FieldType:
    FIELD_FLOAT32 = 0
    FIELD_FLOAT64 = 1
    FIELD_INT32 = 2
    FIELD_INT64 = 3
    FIELD_UINT64 = 4
    FIELD_BOOL = 5

# The rows of packed_row_scalars' `special`: the record fields it converts
# (sampling.KERNEL_FIELDS) or only looks at, in this order.
cdef enum:
    SPECIAL_TEMPERATURE = 0
    SPECIAL_TOP_K = 1
    SPECIAL_NUM_TOP_LOGPROBS = 2
    SPECIAL_MIN_TOKENS = 3
    SPECIAL_RETURN_LOG_PROBS = 4
    SPECIAL_FIELDS = 5

#: PackedLayout's special fields by the sampler input each holds, in order.
PACKED_SPECIAL_FIELDS = ("temperature", "top_k", "num_top_logprobs", "min_tokens",
                         "return_log_probs")
#: PackedLayout's cold summary fields, in the order CompactInputs takes them.
PACKED_COLD_FIELDS = ("cold_max", "cold_argmax", "cold_mass", "cold_token", "cold_token_logit")


cdef class PackedLayout:
    """Where the packed records' fields are and what they must hold, built
    once (sampler_codec) for ``packed_row_scalars`` and
    ``decide_packed_compact``.

    checked: int64 [K, 2], (byte offset, FieldType) of each checked field;
    bounds: float64 [K, 4], its allowed interval (low, high, low open, high
    open: params.Interval; NaN never passes). copies: int64 [C, 4], (record
    offset, FieldType, RowScalars offset, FieldType) of each RowScalars
    field taken as it is (sampling.KERNEL_FIELDS), cast as numpy casts.
    special: int64 [5, 2], (offset, FieldType) of the fields
    PACKED_SPECIAL_FIELDS names (temperature: 1 / T and greedy, T below
    greedy_below; top_k: 0 when <= 0 or >= V). cold: int64 [5, 2], the
    cold summary record's fields PACKED_COLD_FIELDS names. record_size,
    cold_size: the bytes of a record and of a cold summary record, which
    the entries require of their inputs' rows."""
    cdef const int64_t[:, ::1] checked
    cdef const double[:, ::1] bounds
    cdef const int64_t[:, ::1] copies
    cdef const int64_t[:, ::1] special
    cdef const int64_t[:, ::1] cold
    cdef double greedy_below
    cdef Py_ssize_t record_size
    cdef Py_ssize_t cold_size

    def __init__(self, *, const int64_t[:, ::1] checked, const double[:, ::1] bounds,
                 const int64_t[:, ::1] copies, const int64_t[:, ::1] special,
                 const int64_t[:, ::1] cold, double greedy_below, Py_ssize_t record_size,
                 Py_ssize_t cold_size):
        if (checked.shape[1] != 2 or bounds.shape[0] != checked.shape[0] or bounds.shape[1] != 4
                or copies.shape[1] != 4 or special.shape[0] != SPECIAL_FIELDS
                or special.shape[1] != 2 or cold.shape[0] != 5 or cold.shape[1] != 2):
            raise ValueError("checked must be [K, 2], bounds [K, 4], copies [C, 4], "
                             f"special [{SPECIAL_FIELDS}, 2], cold [5, 2]")
        self.checked, self.bounds, self.copies = checked, bounds, copies
        self.special, self.cold, self.greedy_below = special, cold, greedy_below
        # every field must lie inside its record: the passes read and write by them
        self.record_size, self.cold_size = record_size, cold_size
        if not (fields_inside(checked, 0, record_size) and fields_inside(copies, 0, record_size)
                and fields_inside(copies, 2, sizeof(RowScalars))
                and fields_inside(special, 0, record_size) and fields_inside(cold, 0, cold_size)):
            raise ValueError("a field lies outside its record (record_size, cold_size, "
                             "RowScalars)")


cdef bint fields_inside(const int64_t[:, ::1] table, Py_ssize_t column, Py_ssize_t size):
    """Every (offset, FieldType) pair at `column` of `table` within `size` bytes."""
    cdef Py_ssize_t i, width
    for i in range(table.shape[0]):
        kind = table[i, column + 1]
        width = 1 if kind == FIELD_BOOL else 4 if kind in (FIELD_FLOAT32, FIELD_INT32) else 8
        if not 0 <= table[i, column] <= size - width:
            return False
    return True


cdef inline bint integer_field(int64_t kind) noexcept nogil:
    return kind != FIELD_FLOAT32 and kind != FIELD_FLOAT64


cdef inline int64_t field_integer(const uint8_t* record, const int64_t* field) noexcept nogil:
    """An integer or bool field exactly (a uint64 as its bits; memcpy: a
    record need not be aligned)."""
    cdef int32_t i32
    cdef int64_t i64
    if field[1] == FIELD_INT32:
        memcpy(&i32, record + field[0], 4)
        return i32
    if field[1] == FIELD_BOOL:
        return record[field[0]] != 0
    memcpy(&i64, record + field[0], 8)
    return i64


cdef inline double field_value(const uint8_t* record, const int64_t* field) noexcept nogil:
    """Any field as a double (exact for floats and for integers below 2**53;
    numpy compares in float64 too)."""
    cdef float f32
    cdef double f64
    cdef uint64_t u64
    if field[1] == FIELD_FLOAT32:
        memcpy(&f32, record + field[0], 4)
        return f32
    if field[1] == FIELD_FLOAT64:
        memcpy(&f64, record + field[0], 8)
        return f64
    if field[1] == FIELD_UINT64:
        memcpy(&u64, record + field[0], 8)
        return <double>u64
    return <double>field_integer(record, field)


cdef inline void copy_field(const uint8_t* record, const int64_t* source, uint8_t* target,
                            const int64_t* destination) noexcept nogil:
    """A record field into a RowScalars field as numpy's assignment casts it
    (floats through a double, integers by their bits)."""
    cdef float f32
    cdef double f64
    cdef int64_t i64
    cdef int32_t i32
    if integer_field(destination[1]):
        i64 = field_integer(record, source)
        if destination[1] == FIELD_INT32:
            i32 = <int32_t>i64
            memcpy(target + destination[0], &i32, 4)
        elif destination[1] == FIELD_BOOL:
            target[destination[0]] = i64 != 0
        else:
            memcpy(target + destination[0], &i64, 8)
    elif destination[1] == FIELD_FLOAT32:
        f32 = <float>field_value(record, source)
        memcpy(target + destination[0], &f32, 4)
    else:
        f64 = field_value(record, source)
        memcpy(target + destination[0], &f64, 8)


cdef Py_ssize_t packed_rows(PackedLayout layout, const uint8_t[:, ::1] records,
                            Py_ssize_t vocab, RowScalars* out, uint8_t* want,
                            int64_t* min_tokens, bint* any_top) noexcept:
    """packed_row_scalars' pass; want and min_tokens [B] receive each row's
    return_log_probs and min_tokens. Returns the first row failing a check,
    -1 when none."""
    cdef Py_ssize_t r, c
    cdef const uint8_t* record
    cdef double value, temperature
    cdef bint ok
    cdef int64_t top_k
    cdef const int64_t[:, ::1] checked = layout.checked
    cdef const double[:, ::1] bounds = layout.bounds
    cdef const int64_t[:, ::1] copies = layout.copies
    cdef const int64_t[:, ::1] special = layout.special
    with nogil:
        for r in range(records.shape[0]):
            record = &records[r, 0]
            for c in range(checked.shape[0]):
                value = field_value(record, &checked[c, 0])
                ok = value > bounds[c, 0] if bounds[c, 2] != 0 else value >= bounds[c, 0]
                ok = ok and (value < bounds[c, 1] if bounds[c, 3] != 0 else value <= bounds[c, 1])
                if not ok:
                    return r
            for c in range(copies.shape[0]):
                copy_field(record, &copies[c, 0], <uint8_t*>&out[r], &copies[c, 2])
            temperature = field_value(record, &special[SPECIAL_TEMPERATURE, 0])
            out[r].greedy = temperature < layout.greedy_below
            out[r].inverse_temperature = 1.0 if out[r].greedy else <float>(1.0 / temperature)
            top_k = field_integer(record, &special[SPECIAL_TOP_K, 0])
            out[r].top_k = 0 if top_k <= 0 or top_k >= vocab else top_k
            any_top[0] = (any_top[0]
                          or field_integer(record, &special[SPECIAL_NUM_TOP_LOGPROBS, 0]) != 0)
            want[r] = field_integer(record, &special[SPECIAL_RETURN_LOG_PROBS, 0]) != 0
            min_tokens[r] = field_integer(record, &special[SPECIAL_MIN_TOKENS, 0])
    return -1


def packed_row_scalars(PackedLayout layout not None, const uint8_t[:, ::1] records,
                       Py_ssize_t vocab, RowScalars[::1] out):
    """The kernels' RowScalars of B packed records (``row_scalars``: uint8
    [B, itemsize]) by ``layout``, every record checked first: the pass
    ``decide_packed_compact`` makes, on its own (tests/test_sampler_io.py
    holds it to the numpy checks and ``sampling.kernel_params``). out:
    RowScalars [B], filled as kernel_params fills it. Returns (the first
    row failing a check, -1 when none: out is then complete; whether any
    row asks for top logprobs)."""
    cdef bint any_top = False
    if out.shape[0] != records.shape[0] or records.shape[1] != layout.record_size:
        raise ValueError(f"records must be [B, {layout.record_size}] and out one RowScalars "
                         f"per record")
    if records.shape[0] == 0:
        return -1, False
    want = np.empty(records.shape[0], np.uint8)
    min_tokens = np.empty(records.shape[0], np.int64)
    cdef uint8_t[::1] want_view = want
    cdef int64_t[::1] min_view = min_tokens
    cdef Py_ssize_t failed = packed_rows(layout, records, vocab, &out[0], &want_view[0],
                                         &min_view[0], &any_top)
    return failed, bool(any_top)


cdef Py_ssize_t padded_count(const int32_t[:, ::1] padded, Py_ssize_t vocab,
                             const uint8_t* keep, int64_t* offsets) noexcept nogil:
    """The first pass of a -1 padded int32 [B, L] id list to CSR: every id
    checked, offsets [B + 1] (the caller's) of the rows' ids, rows with
    keep[r] == 0 (keep not NULL) left empty. Returns -1, or the flat index
    of the first entry neither -1 nor in [0, vocab)."""
    cdef Py_ssize_t width = padded.shape[1]
    cdef Py_ssize_t r, j
    cdef Py_ssize_t n = 0
    cdef int32_t token
    offsets[0] = 0
    for r in range(padded.shape[0]):
        for j in range(width):
            token = padded[r, j]
            if token != -1:
                if token < 0 or token >= vocab:
                    return r * width + j
                if keep == NULL or keep[r]:
                    n += 1
        offsets[r + 1] = n
    return -1


cdef void padded_fill(const int32_t[:, ::1] padded, const float* values, const uint8_t* keep,
                      int32_t* ids, float* taken) noexcept nogil:
    """The second pass: the kept rows' ids into ids [offsets[B]] and, when
    values ([B, L]) is not NULL, the values at them into taken."""
    cdef Py_ssize_t width = padded.shape[1]
    cdef Py_ssize_t r, j
    cdef Py_ssize_t n = 0
    for r in range(padded.shape[0]):
        if keep != NULL and not keep[r]:
            continue
        for j in range(width):
            if padded[r, j] != -1:
                ids[n] = padded[r, j]
                if values != NULL:
                    taken[n] = values[r * width + j]
                n += 1


cdef Py_ssize_t padded_csr(const int32_t[:, ::1] padded, const float* values, Py_ssize_t vocab,
                           const uint8_t* keep, int64_t* offsets, int32_t** ids,
                           float** taken) noexcept nogil:
    """padded_count and padded_fill into malloc'd ids and (values not NULL)
    taken, which the caller frees. Returns padded_count's answer, or -2
    when out of memory."""
    cdef Py_ssize_t bad = padded_count(padded, vocab, keep, offsets)
    if bad != -1:
        return bad
    cdef Py_ssize_t n = offsets[padded.shape[0]]
    ids[0] = <int32_t*>malloc((n if n > 0 else 1) * sizeof(int32_t))
    if values != NULL:
        taken[0] = <float*>malloc((n if n > 0 else 1) * sizeof(float))
    if ids[0] == NULL or (values != NULL and taken[0] == NULL):
        return -2
    padded_fill(padded, values, keep, ids[0], taken[0] if values != NULL else NULL)
    return -1


cdef struct PackedScratch:
    # what decide_packed_compact allocates (NULL-initialized, freed at once)
    RowScalars* scalars
    uint8_t* want
    uint8_t* banned_rows
    int64_t* min_tokens
    int64_t* zero_offsets
    int64_t* touched_offsets
    int32_t* touched_ids
    float* touched_logits
    int64_t* ban_offsets
    int32_t* ban_ids
    float* cold_max
    int64_t* cold_argmax
    float* cold_mass
    int64_t* cold_token
    float* cold_token_logit
    int64_t* tokens
    float* logprobs
    int32_t* errors
    int64_t* error_columns


cdef void free_scratch(PackedScratch* m) noexcept nogil:
    free(m.scalars); free(m.want); free(m.banned_rows); free(m.min_tokens)
    free(m.zero_offsets); free(m.touched_offsets); free(m.touched_ids); free(m.touched_logits)
    free(m.ban_offsets); free(m.ban_ids); free(m.cold_max); free(m.cold_argmax)
    free(m.cold_mass); free(m.cold_token); free(m.cold_token_logit); free(m.tokens)
    free(m.logprobs); free(m.errors); free(m.error_columns)


cdef bint allocate_scratch(PackedScratch* m, Py_ssize_t size) noexcept nogil:
    memset(m, 0, sizeof(PackedScratch))
    m.scalars = <RowScalars*>malloc(size * sizeof(RowScalars))
    m.want = <uint8_t*>malloc(size)
    m.banned_rows = <uint8_t*>malloc(size)
    m.min_tokens = <int64_t*>malloc(size * sizeof(int64_t))
    m.zero_offsets = <int64_t*>calloc(size + 1, sizeof(int64_t))
    m.touched_offsets = <int64_t*>malloc((size + 1) * sizeof(int64_t))
    m.ban_offsets = <int64_t*>malloc((size + 1) * sizeof(int64_t))
    m.cold_max = <float*>malloc(size * sizeof(float))
    m.cold_argmax = <int64_t*>malloc(size * sizeof(int64_t))
    m.cold_mass = <float*>malloc(size * sizeof(float))
    m.cold_token = <int64_t*>malloc(size * sizeof(int64_t))
    m.cold_token_logit = <float*>malloc(size * sizeof(float))
    m.tokens = <int64_t*>malloc(size * sizeof(int64_t))
    m.logprobs = <float*>malloc(size * sizeof(float))
    m.errors = <int32_t*>malloc(size * sizeof(int32_t))
    m.error_columns = <int64_t*>malloc(size * sizeof(int64_t))
    return not (m.scalars == NULL or m.want == NULL or m.banned_rows == NULL
                or m.min_tokens == NULL or m.zero_offsets == NULL or m.touched_offsets == NULL
                or m.ban_offsets == NULL or m.cold_max == NULL or m.cold_argmax == NULL
                or m.cold_mass == NULL or m.cold_token == NULL or m.cold_token_logit == NULL
                or m.tokens == NULL or m.logprobs == NULL or m.errors == NULL
                or m.error_columns == NULL)


cdef bint decide_packed_rows(PackedScratch* m, const int64_t[:, ::1] cold,
                             const unsigned char[:, ::1] hot_bytes, int dtype,
                             const int32_t[:, ::1] touched_ids, const float[:, ::1] touched_logits,
                             const uint8_t[:, ::1] cold_summary, const int32_t[:, ::1] end_ids,
                             const int32_t[::1] hot_ids, const int64_t[::1] hot_block_start,
                             const uint64_t[::1] hot_bits, const int32_t[::1] hot_position,
                             Py_ssize_t vocab, int num_threads, int32_t[:, ::1] tokens,
                             int8_t[:, ::1] outcomes, float[:, ::1] logprobs,
                             bint* any_logprob) noexcept nogil:
    """decide_packed_compact after the records' pass (m.scalars, m.want,
    m.min_tokens filled): False where the general path must take over."""
    cdef Py_ssize_t size = hot_bytes.shape[0]
    cdef Py_ssize_t r
    cdef Py_ssize_t index = 0
    cdef const uint8_t* record
    cdef BatchInputs b
    cdef CompactInputs k
    if padded_csr(touched_ids, &touched_logits[0, 0] if touched_ids.shape[1] else NULL,
                  vocab, NULL, m.touched_offsets, &m.touched_ids, &m.touched_logits) != -1:
        return False
    for r in range(size):
        record = &cold_summary[r, 0]
        m.cold_max[r] = <float>field_value(record, &cold[0, 0])
        m.cold_argmax[r] = field_integer(record, &cold[1, 0])
        m.cold_mass[r] = <float>field_value(record, &cold[2, 0])
        m.cold_token[r] = field_integer(record, &cold[3, 0])
        m.cold_token_logit[r] = <float>field_value(record, &cold[4, 0])
        m.banned_rows[r] = <int64_t>m.scalars[r].step < m.min_tokens[r]
        any_logprob[0] = any_logprob[0] or m.want[r]
    if compact_ids_problem(m.touched_offsets, m.touched_ids, size, &hot_bits[0], vocab,
                           m.cold_argmax, m.cold_token, m.cold_token_logit, m.cold_max,
                           m.cold_mass, &index) != 0:
        return False
    if end_ids.shape[1] == 0:
        memset(m.ban_offsets, 0, (size + 1) * sizeof(int64_t))
    elif padded_csr(end_ids, NULL, vocab, m.banned_rows, m.ban_offsets, &m.ban_ids,
                    NULL) != -1:
        return False
    b.logits = &hot_bytes[0, 0]
    b.row_stride = hot_bytes.strides[0]
    b.dtype = dtype
    b.vocab = vocab
    b.scalars = m.scalars
    # no bias, prompt or output lists: zero offsets, NULL ids (never read)
    b.bias_offsets = m.zero_offsets
    b.bias_ids = NULL
    b.bias_values = NULL
    b.ban_offsets = m.ban_offsets
    b.ban_ids = m.ban_ids
    b.prompt_offsets = m.zero_offsets
    b.prompt_ids = NULL
    b.output_offsets = m.zero_offsets
    b.output_ids = NULL
    b.want_logprob = any_logprob[0]
    b.n_top = 0
    b.row_wants_logprob = m.want
    b.row_n_top = NULL
    b.row_raw_logprobs = NULL
    b.row_given_tokens = NULL
    b.tokens = m.tokens
    b.logprobs = m.logprobs
    b.top_tokens = NULL
    b.top_logprobs = NULL
    b.errors = m.errors
    b.error_columns = m.error_columns
    b.hot.n = hot_ids.shape[0]
    b.hot.ids = &hot_ids[0]
    b.hot.block_start = &hot_block_start[0]
    b.hot.bits = &hot_bits[0]
    b.hot_outcomes = &outcomes[0, 0]
    k.hot_position = &hot_position[0]
    k.touched_offsets = m.touched_offsets
    k.touched_ids = m.touched_ids
    k.touched_logits = m.touched_logits
    k.cold_max = m.cold_max
    k.cold_argmax = m.cold_argmax
    k.cold_mass = m.cold_mass
    k.cold_token = m.cold_token
    k.cold_token_logit = m.cold_token_logit
    decide_compact_rows(&b, &k, size, vocab, num_threads)
    for r in range(size):
        if m.errors[r] != ERROR_NONE:
            return False
        tokens[r, 0] = <int32_t>m.tokens[r]
        logprobs[r, 0] = m.logprobs[r] if m.want[r] else NAN
    return True


def decide_packed_compact(PackedLayout layout not None, const uint8_t[:, ::1] records,
                          const unsigned char[:, ::1] hot_bytes, int dtype,
                          const int32_t[:, ::1] touched_ids, const float[:, ::1] touched_logits,
                          const uint8_t[:, ::1] cold_summary, const int32_t[:, ::1] end_ids,
                          const int32_t[::1] hot_ids, const int64_t[::1] hot_block_start,
                          const uint64_t[::1] hot_bits, const int32_t[::1] hot_position,
                          Py_ssize_t vocab, int num_threads, int32_t[:, ::1] tokens,
                          int8_t[:, ::1] outcomes, float[:, ::1] logprobs):
    """The llm model's compact request (its packed form: sampler_codec's
    ``_PLAIN_COMPACT``, end_id or not) checked and decided in one call: the
    records by ``layout`` (``packed_row_scalars``' pass), the touched and
    end ids as padded_lists reads them (end ids banned on rows whose step is
    below their min_tokens), the ids as check_compact_ids checks them, the
    rows as sample_compact_batch decides them. Shapes are the caller's to
    check: records [B, itemsize], hot_bytes [B, |H| * itemsize] (dtype a
    Dtype), touched_ids / touched_logits [B, L], cold_summary [B, 20]
    (schema.COLD_SUMMARY_RECORD), end_ids [B, L'] (L' = 0: none); the hot
    set's kernel arrays and positions (HotVocab); outputs tokens int32
    [B, 1] (-1 for undecided rows), outcomes int8 [B, 1] (HandoffOutcome)
    and logprobs float32 [B, 1] (NaN on rows that did not ask; C's log
    share on NEED_COLD rows that did).

    Returns (decided, any_logprob): decided False leaves the outputs
    undefined, for a request this call does not take (a row asks for top
    logprobs) or one the general path must refuse by name (a record, id or
    logit the checks or kernels refuse): decode_request and sample_request
    then give the same outputs or the error. any_logprob: some row asked
    for its logprob (output_log_probs is sent)."""
    cdef Py_ssize_t size = records.shape[0]
    if (size < 1 or hot_bytes.shape[0] != size or touched_ids.shape[0] != size
            or touched_logits.shape[0] != size or touched_logits.shape[1] != touched_ids.shape[1]
            or cold_summary.shape[0] != size or end_ids.shape[0] != size
            or tokens.shape[0] != size or outcomes.shape[0] != size or logprobs.shape[0] != size
            or hot_position.shape[0] != vocab or hot_ids.shape[0] == 0
            or records.shape[1] != layout.record_size or cold_summary.shape[1] != layout.cold_size):
        raise ValueError("decide_packed_compact: inputs and outputs must have B >= 1 rows, "
                         "records and cold summaries the layout's sizes, and the hot set's "
                         "arrays V and |H| > 0 entries")
    cdef PackedScratch m
    cdef bint any_top = False
    cdef bint any_logprob = False
    cdef bint decided = False
    try:
        if not allocate_scratch(&m, size):
            raise MemoryError()
        if packed_rows(layout, records, vocab, m.scalars, m.want, m.min_tokens, &any_top) >= 0:
            return False, False
        if any_top:
            return False, False
        with nogil:
            decided = decide_packed_rows(&m, layout.cold, hot_bytes, dtype, touched_ids,
                                         touched_logits, cold_summary, end_ids, hot_ids,
                                         hot_block_start, hot_bits, hot_position, vocab,
                                         num_threads, tokens, outcomes, logprobs, &any_logprob)
        return decided, bool(decided and any_logprob)
    finally:
        free_scratch(&m)
