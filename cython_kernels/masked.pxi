# Grammar masks on host rows (included by sampling.pyx; serving/structured.py,
# StepMasks.applied): a step's rows copied with every token a row's grammar
# rules out at -inf, in one read and one write of each row.

# -inf's bit patterns by storage dtype (Dtype)
cdef uint32_t NEG_INF_FLOAT32 = 0xFF800000u
cdef uint16_t NEG_INF_FLOAT16 = 0xFC00u
cdef uint16_t NEG_INF_BFLOAT16 = 0xFF80u


cdef void masked_row(const unsigned char* src, unsigned char* dst, const int32_t* words,
                     Py_ssize_t vocab, int dtype) noexcept nogil:
    """dst = src with token t at -inf where bit t % 32 of words[t // 32] is clear."""
    cdef Py_ssize_t itemsize = 4 if dtype == DTYPE_FLOAT32 else 2
    cdef uint16_t neg_inf16 = NEG_INF_FLOAT16 if dtype == DTYPE_FLOAT16 else NEG_INF_BFLOAT16
    cdef Py_ssize_t start, count, j
    cdef uint32_t word
    cdef uint32_t* dst32 = <uint32_t*>dst
    cdef const uint32_t* src32 = <const uint32_t*>src
    cdef uint16_t* dst16 = <uint16_t*>dst
    cdef const uint16_t* src16 = <const uint16_t*>src
    for start in range(0, vocab, 32):
        count = min(32, vocab - start)
        word = <uint32_t>words[start >> 5]
        if word == 0xFFFFFFFFu:  # most words of a broad grammar (inside a string)
            memcpy(dst + start * itemsize, src + start * itemsize, count * itemsize)
        elif itemsize == 4:
            for j in range(count):
                dst32[start + j] = src32[start + j] if (word >> j) & 1 else NEG_INF_FLOAT32
        else:
            for j in range(count):
                dst16[start + j] = src16[start + j] if (word >> j) & 1 else neg_inf16


def masked_rows(const unsigned char[:, :] rows, int dtype, const int64_t[::1] guided,
                const int32_t[:, ::1] bitmask, unsigned char[:, ::1] out, int num_threads=1):
    """out = rows, except row guided[i], where each token whose bit in
    bitmask[i] is clear (bit j of word w: token 32 w + j, llguidance's
    layout) is -inf. rows, out: [B, V * itemsize] bytes of float32, float16
    or bfloat16 rows (dtype: Dtype), each contiguous (rows may be strided,
    ``sampling.kernel_rows``); guided: int64 [n] distinct rows in
    [0, B); bitmask: int32 [n, ceil(V / 32)]. Rows on num_threads threads,
    the GIL let go."""
    cdef Py_ssize_t size = rows.shape[0]
    if dtype != DTYPE_FLOAT32 and dtype != DTYPE_FLOAT16 and dtype != DTYPE_BFLOAT16:
        raise ValueError(f"dtype must be a Dtype code, got {dtype}")
    cdef Py_ssize_t itemsize = 4 if dtype == DTYPE_FLOAT32 else 2
    cdef Py_ssize_t vocab = rows.shape[1] // itemsize
    if rows.strides[1] != 1:
        raise ValueError("each of rows must be contiguous")
    if rows.shape[1] % itemsize or out.shape[0] != size or out.shape[1] != rows.shape[1]:
        raise ValueError(f"out must be rows' shape [B, V * {itemsize}], got "
                         f"{[out.shape[0], out.shape[1]]} for {[size, rows.shape[1]]}")
    if bitmask.shape[0] != guided.shape[0] or bitmask.shape[1] != (vocab + 31) // 32:
        raise ValueError(f"bitmask must be [{guided.shape[0]}, {(vocab + 31) // 32}], got "
                         f"{[bitmask.shape[0], bitmask.shape[1]]}")
    which = np.full(size, -1, np.int64)  # each row's bitmask, -1: none
    cdef int64_t[::1] mask_of = which
    cdef Py_ssize_t i, r
    for i in range(guided.shape[0]):
        if not 0 <= guided[i] < size or mask_of[guided[i]] >= 0:
            raise ValueError(f"guided must be distinct rows in [0, {size}), got {guided[i]} "
                             f"at {i}")
        mask_of[guided[i]] = i
    if size == 0:
        return
    with nogil:
        for r in prange(size, schedule='static', num_threads=num_threads):
            if mask_of[r] < 0:
                memcpy(&out[r, 0], &rows[r, 0], vocab * itemsize)
            else:
                masked_row(&rows[r, 0], &out[r, 0], &bitmask[mask_of[r], 0], vocab, dtype)
