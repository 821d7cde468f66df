# Column-wise logit adjustments: logit_bias, min_tokens bans and the
# repetition / frequency / presence penalties, in vLLM's order.
#
# Only the columns a row's bias, ban list and history name can change, so the
# row's entries are grouped by column (a linear-time radix sort of h entries,
# never O(V)) into a sorted list of overrides. Each override says how to
# adjust its column; the row loader applies it to the logit it has just read,
# so the adjustments cost no random reads of the row.
from libc.math cimport INFINITY
from libc.stdint cimport int32_t, uint64_t

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
    """Steps 1-2 for override i applied to its column's raw logit."""
    logit = logit + ov.bias[i]
    if ov.flags[i] & OVERRIDE_BANNED:
        return -INFINITY
    if (ov.flags[i] & OVERRIDE_SEEN) and ov.repetition != 1.0:
        logit = logit / ov.repetition if logit > 0 else logit * ov.repetition
    if ov.output_count[i] > 0:
        logit = logit - ov.frequency * ov.output_count[i] - ov.presence
    return logit


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


cdef inline void build_overrides(const RowHistory* h, uint64_t* keys, uint64_t* scratch,
                                 Overrides* out) noexcept nogil:
    """Fill `out` (capacity >= h's total entries; keys and scratch likewise).

    Bias ids are unique per row (the Python layer checks)."""
    out.repetition = h.repetition
    out.presence = h.presence
    out.frequency = h.frequency
    out.n = 0
    cdef bint uses_history = (h.repetition != 1.0 or h.presence != 0.0
                              or h.frequency != 0.0)
    cdef Py_ssize_t n = 0
    cdef Py_ssize_t i
    for i in range(h.n_bias):
        keys[n] = _entry_key(h.bias_ids[i], ENTRY_BIAS, i)
        n += 1
    for i in range(h.n_ban):
        keys[n] = _entry_key(h.ban_ids[i], ENTRY_BAN, 0)
        n += 1
    if uses_history:
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
