# Column-wise logit adjustments: logit_bias, min_tokens bans and the
# repetition / frequency / presence penalties, in vLLM's order.
#
# Only the columns a row's bias, ban list and history name can change, so the
# row's entries are grouped by column into a sorted list of overrides. Each
# override says how to adjust its column; the row loader applies it to the
# logit it has just read, so the adjustments cost no random reads of the row.
#
# Grouping h entries: a few are radix-sorted (linear in h, never O(V)). Many
# (a long prompt under a repetition penalty) are marked in a bitmap of the
# vocabulary instead (V / 64 words, kept zeroed between rows), one bitmap per
# kind of entry: their union's set bits, read in word order, are the columns
# ascending, and each column's flags are its bits in the seen and banned
# bitmaps; only a bias or an output id (counted) finds its override, by the
# rank of its bit. That costs a pass over V / 64 words plus a few operations
# an entry, where the sort scatters every entry across memory once per byte
# of the column ids. Both give the same overrides.
from libc.math cimport INFINITY
from libc.stdint cimport int32_t, uint64_t
from libc.string cimport memset

cdef extern from "penalties.h" nogil:
    float ss_adjusted_logit(float logit, float bias, int seen, int banned, int32_t count,
                            float repetition, float frequency, float presence)

cdef extern from *:
    int ss_ctz64 "__builtin_ctzll"(unsigned long long) noexcept nogil
    int ss_popcount64 "__builtin_popcountll"(unsigned long long) noexcept nogil

cdef enum EntryKind:
    ENTRY_BIAS = 0
    ENTRY_BAN = 1
    ENTRY_PROMPT = 2
    ENTRY_OUTPUT = 3

cdef enum OverrideFlag:
    OVERRIDE_BANNED = 1
    OVERRIDE_SEEN = 2        # in the prompt or the output: repetition applies


cdef struct Overrides:
    int32_t* column          # ascending, unique
    float* bias              # added first (0 when the column has no bias)
    int32_t* output_count    # occurrences in the output
    unsigned char* flags     # OverrideFlag bits
    Py_ssize_t n
    float repetition
    float presence
    float frequency


cdef struct ColumnBits:
    uint64_t* bits           # [words]: one bit a column, all zero between rows: bias ids, then every entry's
    uint64_t* seen           # [words]: the prompt's and the output's ids (zero between rows)
    uint64_t* banned         # [words]: the ban list's ids (zero between rows)
    int32_t* rank            # [words]: set bits of `bits` in the words before
    Py_ssize_t words         # 0: no bitmap (every row's entries are sorted)
    Py_ssize_t min_entries   # a row with this many entries or more uses it


# By default a row uses the bitmap from this many entries: below, sorting
# them costs less (on this project's host the two cost the same near 1,024
# entries at V = 49,152 and at V = 151,936 alike: the pass over the words is
# the smaller part).
cdef enum:
    BITMAP_MIN_ENTRIES = 1024


cdef struct RowHistory:
    const int32_t* bias_ids
    const float* bias_values
    Py_ssize_t n_bias
    const int32_t* ban_ids          # banned now (min_tokens not yet reached)
    Py_ssize_t n_ban
    const int32_t* prompt_ids
    Py_ssize_t n_prompt
    const int32_t* output_ids
    Py_ssize_t n_output
    float repetition
    float presence
    float frequency


cdef inline float adjusted_logit(float logit, const Overrides* ov, Py_ssize_t i) noexcept nogil:
    """Steps 1-2 for override i applied to its column's raw logit (penalties.h)."""
    return ss_adjusted_logit(logit, ov.bias[i], ov.flags[i] & OVERRIDE_SEEN,
                             ov.flags[i] & OVERRIDE_BANNED, ov.output_count[i], ov.repetition,
                             ov.frequency, ov.presence)


cdef inline uint64_t _entry_key(int32_t column, int kind, Py_ssize_t payload) noexcept nogil:
    # column in the high word; kind and payload (index of a bias value) low.
    return (<uint64_t>column << 32) | (<uint64_t>kind << 28) | <uint64_t>payload


cdef inline uint64_t* _sort_by_column(uint64_t* keys, uint64_t* scratch, Py_ssize_t n) noexcept nogil:
    """LSD radix sort of keys by their high 32 bits; returns the sorted array
    (keys or scratch). Bytes that are equal in every key are skipped."""
    cdef Py_ssize_t counts[256]
    cdef uint64_t varying = 0
    cdef Py_ssize_t i, digit, total, c
    cdef int shift
    cdef uint64_t* tmp
    for i in range(n):
        varying |= keys[i] ^ keys[0]
    for shift in range(32, 64, 8):
        if ((varying >> shift) & 0xFF) == 0:
            continue
        for digit in range(256):
            counts[digit] = 0
        for i in range(n):
            counts[(keys[i] >> shift) & 0xFF] += 1
        total = 0
        for digit in range(256):
            c = counts[digit]
            counts[digit] = total
            total += c
        for i in range(n):
            digit = (keys[i] >> shift) & 0xFF
            scratch[counts[digit]] = keys[i]
            counts[digit] += 1
        tmp = keys
        keys = scratch
        scratch = tmp
    return keys


cdef inline bint uses_history(const RowHistory* h) noexcept nogil:
    return h.repetition != 1.0 or h.presence != 0.0 or h.frequency != 0.0


cdef inline void build_overrides(const RowHistory* h, uint64_t* keys, uint64_t* scratch,
                                 ColumnBits* columns, Overrides* out) noexcept nogil:
    """Fill `out` (capacity >= h's total entries; keys and scratch likewise;
    columns: a bitmap over every column an entry can name, or words 0).

    Bias ids are unique per row (the Python layer checks)."""
    out.repetition = h.repetition
    out.presence = h.presence
    out.frequency = h.frequency
    out.n = 0
    cdef Py_ssize_t entries = h.n_bias + h.n_ban
    if uses_history(h):
        entries += h.n_prompt + h.n_output
    if columns.words > 0 and entries >= columns.min_entries:
        _overrides_by_bitmap(h, columns, out)
    else:
        _overrides_by_sort(h, keys, scratch, out)


cdef inline void _mark(uint64_t* bits, const int32_t* ids, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        bits[ids[i] >> 6] |= (<uint64_t>1) << (ids[i] & 63)


cdef inline Py_ssize_t _override_of(const ColumnBits* columns, int32_t column) noexcept nogil:
    """The index of `column`'s override: the set bits before its own."""
    cdef uint64_t below = ((<uint64_t>1) << (column & 63)) - 1
    return columns.rank[column >> 6] + ss_popcount64(columns.bits[column >> 6] & below)


cdef inline void _overrides_by_bitmap(const RowHistory* h, ColumnBits* columns,
                                      Overrides* out) noexcept nogil:
    _mark(columns.bits, h.bias_ids, h.n_bias)
    _mark(columns.banned, h.ban_ids, h.n_ban)
    cdef bint history = uses_history(h)
    if history:
        _mark(columns.seen, h.prompt_ids, h.n_prompt)
        _mark(columns.seen, h.output_ids, h.n_output)
    # locals, not the structs' fields: a store through flags (a char
    # pointer) may alias any field, which would be reloaded at every column
    cdef uint64_t* bits = columns.bits
    cdef int32_t* rank = columns.rank
    cdef int32_t* column = out.column
    cdef float* bias = out.bias
    cdef int32_t* count = out.output_count
    cdef unsigned char* flags = out.flags
    cdef Py_ssize_t words = columns.words
    cdef Py_ssize_t o = 0
    cdef Py_ssize_t w
    cdef int b
    cdef uint64_t word, seen, banned
    for w in range(words):
        seen = columns.seen[w]
        banned = columns.banned[w]
        word = bits[w] | seen | banned
        bits[w] = word
        rank[w] = <int32_t>o
        while word != 0:
            b = ss_ctz64(word)
            column[o] = <int32_t>(w * 64 + b)
            bias[o] = 0.0
            count[o] = 0
            flags[o] = <unsigned char>((((seen >> b) & 1) * OVERRIDE_SEEN)
                                       | (((banned >> b) & 1) * OVERRIDE_BANNED))
            o += 1
            word &= word - 1
    out.n = o
    cdef Py_ssize_t i
    for i in range(h.n_bias):
        out.bias[_override_of(columns, h.bias_ids[i])] = h.bias_values[i]
    if history:
        for i in range(h.n_output):
            out.output_count[_override_of(columns, h.output_ids[i])] += 1
    memset(columns.bits, 0, columns.words * sizeof(uint64_t))
    memset(columns.seen, 0, columns.words * sizeof(uint64_t))
    memset(columns.banned, 0, columns.words * sizeof(uint64_t))


cdef inline void _overrides_by_sort(const RowHistory* h, uint64_t* keys, uint64_t* scratch,
                                    Overrides* out) noexcept nogil:
    cdef bint history = uses_history(h)
    cdef Py_ssize_t n = 0
    cdef Py_ssize_t i
    for i in range(h.n_bias):
        keys[n] = _entry_key(h.bias_ids[i], ENTRY_BIAS, i)
        n += 1
    for i in range(h.n_ban):
        keys[n] = _entry_key(h.ban_ids[i], ENTRY_BAN, 0)
        n += 1
    if history:
        for i in range(h.n_prompt):
            keys[n] = _entry_key(h.prompt_ids[i], ENTRY_PROMPT, 0)
            n += 1
        for i in range(h.n_output):
            keys[n] = _entry_key(h.output_ids[i], ENTRY_OUTPUT, 0)
            n += 1
    if n == 0:
        return
    keys = _sort_by_column(keys, scratch, n)

    cdef int32_t column
    cdef int kind
    cdef Py_ssize_t o = -1
    for i in range(n):
        column = <int32_t>(keys[i] >> 32)
        if o < 0 or out.column[o] != column:
            o += 1
            out.column[o] = column
            out.bias[o] = 0.0
            out.output_count[o] = 0
            out.flags[o] = 0
        kind = <int>((keys[i] >> 28) & 0xF)
        if kind == ENTRY_BIAS:
            out.bias[o] = h.bias_values[keys[i] & 0xFFFFFFF]
        elif kind == ENTRY_BAN:
            out.flags[o] |= OVERRIDE_BANNED
        elif kind == ENTRY_PROMPT:
            out.flags[o] |= OVERRIDE_SEEN
        else:
            out.flags[o] |= OVERRIDE_SEEN
            out.output_count[o] += 1
    out.n = o + 1
