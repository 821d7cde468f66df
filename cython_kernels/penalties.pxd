# Column-wise logit adjustments: logit_bias, min_tokens bans and the
# repetition / frequency / presence penalties, in vLLM's order.
#
# Only the columns a row's bias, ban list and history name can change, so the
# adjustments are computed for those columns alone (O(h log h) for h entries,
# never O(V)) and kept as a sorted list of (column, new logit) overrides that
# the row loader patches in as it streams the row.
from libc.math cimport INFINITY
from libc.stdint cimport int32_t, int64_t, uint64_t
from libc.stdlib cimport qsort

cdef enum EntryKind:
    ENTRY_BIAS = 0
    ENTRY_BAN = 1
    ENTRY_PROMPT = 2
    ENTRY_OUTPUT = 3


cdef struct Overrides:
    int32_t* column     # ascending
    float* logit        # the adjusted (pre-temperature) logit of that column
    Py_ssize_t n


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


cdef inline int _compare_keys(const void* a, const void* b) noexcept nogil:
    cdef uint64_t x = (<const uint64_t*>a)[0]
    cdef uint64_t y = (<const uint64_t*>b)[0]
    return (x > y) - (x < y)


cdef inline uint64_t _entry_key(int32_t column, int kind, Py_ssize_t payload) noexcept nogil:
    # column | kind | payload (index into the bias values): sorts by column.
    return (<uint64_t>column << 32) | (<uint64_t>kind << 28) | <uint64_t>payload


cdef inline bint has_adjustments(const RowHistory* h) noexcept nogil:
    cdef bint uses_history = (h.repetition != 1.0 or h.presence != 0.0
                              or h.frequency != 0.0)
    return h.n_bias > 0 or h.n_ban > 0 or (
        uses_history and h.n_prompt + h.n_output > 0)


cdef inline float _penalize(float logit, const RowHistory* h, bint seen,
                            Py_ssize_t output_count) noexcept nogil:
    if seen and h.repetition != 1.0:
        logit = logit / h.repetition if logit > 0 else logit * h.repetition
    if output_count > 0:
        logit = logit - h.frequency * output_count - h.presence
    return logit


cdef inline void build_overrides(const RowHistory* h, float (*read_logit)(const void*, Py_ssize_t) noexcept nogil,
                                 const void* row, uint64_t* keys, Overrides* out) noexcept nogil:
    """Fill `out` (capacity >= total entries) with the row's adjusted columns.

    `keys` is scratch of the same capacity. Bias ids are unique per row (the
    Python layer checks), so a column gets at most one bias entry."""
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
    qsort(keys, n, sizeof(uint64_t), _compare_keys)

    cdef Py_ssize_t start = 0
    cdef Py_ssize_t end
    cdef int32_t column
    cdef int kind
    cdef float logit
    cdef bint banned, seen
    cdef Py_ssize_t output_count
    out.n = 0
    while start < n:
        column = <int32_t>(keys[start] >> 32)
        end = start
        logit = read_logit(row, column)
        banned = False
        seen = False
        output_count = 0
        while end < n and <int32_t>(keys[end] >> 32) == column:
            kind = <int>((keys[end] >> 28) & 0xF)
            if kind == ENTRY_BIAS:
                logit = logit + h.bias_values[keys[end] & 0xFFFFFFF]
            elif kind == ENTRY_BAN:
                banned = True
            elif kind == ENTRY_PROMPT:
                seen = True
            else:
                seen = True
                output_count += 1
            end += 1
        if banned:
            logit = -INFINITY
        out.column[out.n] = column
        out.logit[out.n] = _penalize(logit, h, seen, output_count)
        out.n += 1
        start = end
