# Counter-based random numbers: Philox4x32 with 10 rounds (Salmon et al.,
# "Parallel random numbers: as easy as 1, 2, 3", SC'11).
#
# A draw is a pure function of (key, counter): the sampler keys it by the
# request's 64-bit seed and puts the decoding step and a draw index in the
# counter, so a row's randomness never depends on batch size, row position,
# shard, instance or thread.
from libc.stdint cimport uint32_t, uint64_t

cdef inline void _philox_round(uint32_t* c, uint32_t k0, uint32_t k1) noexcept nogil:
    cdef uint64_t p0 = <uint64_t>0xD2511F53u * c[0]
    cdef uint64_t p1 = <uint64_t>0xCD9E8D57u * c[2]
    cdef uint32_t c1 = c[1]
    cdef uint32_t c3 = c[3]
    c[0] = <uint32_t>(p1 >> 32) ^ c1 ^ k0
    c[1] = <uint32_t>p1
    c[2] = <uint32_t>(p0 >> 32) ^ c3 ^ k1
    c[3] = <uint32_t>p0


cdef inline void philox4x32_10(uint64_t seed, uint64_t step, uint64_t draw,
                               uint32_t* out) noexcept nogil:
    """Four 32-bit words for counter (step, draw) under key seed."""
    cdef uint32_t k0 = <uint32_t>seed
    cdef uint32_t k1 = <uint32_t>(seed >> 32)
    out[0] = <uint32_t>step
    out[1] = <uint32_t>(step >> 32)
    out[2] = <uint32_t>draw
    out[3] = <uint32_t>(draw >> 32)
    cdef int i
    for i in range(10):
        _philox_round(out, k0, k1)
        k0 = k0 + 0x9E3779B9u
        k1 = k1 + 0xBB67AE85u


cdef inline double uniform_double(uint64_t seed, uint64_t step, uint64_t draw) noexcept nogil:
    """Uniform double in [0, 1) with 53 random bits."""
    cdef uint32_t words[4]
    philox4x32_10(seed, step, draw, words)
    cdef uint64_t bits = ((<uint64_t>words[0] << 32) | words[1]) >> 11
    return bits * (1.0 / 9007199254740992.0)
