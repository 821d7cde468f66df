from libc.stdint cimport int32_t, int64_t, uint64_t

cdef extern from "nucleus.h" nogil:
    uint64_t ss_bucket_terms(const float* x, float inv_t, float z_max, float z_floor, float scale,
                             int32_t last_bucket, int32_t only_bucket, float* z, float* w,
                             int32_t* bucket)
    float ss_block_mass_before(const void* x, bint bf16, float inv_t, float z_max, float z_cut,
                               int32_t lane_cut, float* w, uint64_t* kept)
    float ss_block_terms_before(const void* x, bint bf16, float inv_t, const float* terms,
                                float z_cut, int32_t lane_cut, uint64_t* kept)
    void ss_blocks_mass_before(const void* x, bint bf16, Py_ssize_t first, Py_ssize_t last,
                               const float* block_max, const float* block_scale,
                               const float* terms, float terms_from, float inv_t, float z_max,
                               float z_cut, int64_t id_cut, float* kept, double* total)
