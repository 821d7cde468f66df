from libc.stdint cimport uint16_t, uint64_t

cdef extern from "scalar_math.h" nogil:
    float ss_half_to_float(uint16_t h)
    float ss_bf16_to_float(uint16_t h)
    float ss_exp_nonpositive(float x)
    float ss_block_max_nan(const float* x, int* nan_count)
    float ss_block_max_mass(const float* x, float scale, float* mass, int* nan_count,
                            float* terms, float terms_floor)
    float ss_block_max_nan_bf16(const uint16_t* h, int* nan_count)
    float ss_block_max_mass_bf16(const uint16_t* h, float scale, float* mass, int* nan_count,
                                 float* terms, float terms_floor)
    void ss_block_pair_max_mass(const float* x, float scale, float* max, float* mass,
                                int* nan_count, float* terms, float terms_floor)
    void ss_block_pair_max_mass_bf16(const uint16_t* h, float scale, float* max, float* mass,
                                     int* nan_count, float* terms, float terms_floor)
    void ss_exp_array_v(const float* x, float* out, long n)
    void ss_exp_array_w(const float* x, float* out, float* mass_out, long n)
    void ss_exp_shifted(const float* z, float shift, float* out, long n)
    uint64_t ss_block_cold_at_or_above(const float* x, uint64_t hot_bits, float scale, float threshold)
    int ss_lowest_bit(uint64_t v)
    float ss_block_peak(const float* x, int* nan_count)
    float ss_bound_term(float x, float x_max, float to_bits)
    float ss_block_bound(const float* x, float x_max, float to_bits)
    float ss_block_cold_exp_sum(const float* x, uint64_t hot_bits, float scale, float shift)
    double ss_mass_at_or_above(const float* block_max, const float* mass, long n_blocks, float threshold)
    long ss_count_at_or_above(const float* values, long n, float threshold)
    enum:
        SS_BLOCK
