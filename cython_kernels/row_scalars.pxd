# The kernels' per-row scalar parameters, one struct per row: the C side of
# sampling.ROW_SCALARS, a numpy structured dtype derived from params.RULES in
# the same field order and aligned as C aligns this struct
# (tests/test_params_table.py holds the two to row_scalars_offsets()).
# Fields named as the table names its parameters are that column as it is.
from libc.stdint cimport int64_t, uint8_t, uint64_t


cdef struct RowScalars:
    float inverse_temperature   # temperature: 1 / T, 1 for greedy rows
    uint8_t greedy              # temperature < GREEDY_TEMPERATURE
    int64_t top_k               # 0 = off (also k >= V)
    double top_p                # 1 = off
    double min_p                # 0 = off
    float repetition_penalty
    float presence_penalty
    float frequency_penalty
    uint64_t seed
    uint64_t step


cdef inline dict row_scalars_offsets():
    """Each field's offset in RowScalars, by name."""
    cdef RowScalars s
    cdef size_t base = <size_t>&s
    return {"inverse_temperature": <size_t>&s.inverse_temperature - base,
            "greedy": <size_t>&s.greedy - base, "top_k": <size_t>&s.top_k - base,
            "top_p": <size_t>&s.top_p - base, "min_p": <size_t>&s.min_p - base,
            "repetition_penalty": <size_t>&s.repetition_penalty - base,
            "presence_penalty": <size_t>&s.presence_penalty - base,
            "frequency_penalty": <size_t>&s.frequency_penalty - base,
            "seed": <size_t>&s.seed - base, "step": <size_t>&s.step - base}
