/* Branch-free scalar helpers the Cython kernels inline into their row loops.
 *
 * They are plain C (not Cython) because they reinterpret float bits through a
 * union, which GCC turns into vector code when the surrounding loop is
 * auto-vectorized; the same code through Cython pointer casts would break
 * strict aliasing and stay scalar.
 */
#ifndef SIMPLE_SAMPLER_SCALAR_MATH_H
#define SIMPLE_SAMPLER_SCALAR_MATH_H

#include <stdint.h>

typedef union { float f; uint32_t u; int32_t i; } ss_bits32;

/* IEEE binary16 -> binary32, exact for every input (normals, subnormals,
 * zeros, infinities, NaNs). Subnormal halves are rebuilt by a float
 * subtraction instead of a normalisation loop so the function has no branch. */
static inline float ss_half_to_float(uint16_t h)
{
    ss_bits32 out, magic;
    uint32_t exponent;
    out.u = (uint32_t)(h & 0x7fffu) << 13;       /* exponent + mantissa */
    exponent = out.u & (0x7c00u << 13);
    out.u += (127u - 15u) << 23;                  /* rebias */
    if (exponent == (0x7c00u << 13)) {            /* inf / nan: max exponent */
        out.u += (128u - 16u) << 23;
    } else if (exponent == 0) {                   /* zero / subnormal */
        magic.u = 113u << 23;
        out.u += 1u << 23;
        out.f -= magic.f;
    }
    out.u |= (uint32_t)(h & 0x8000u) << 16;       /* sign */
    return out.f;
}

/* bfloat16 is the upper half of a binary32. */
static inline float ss_bf16_to_float(uint16_t h)
{
    ss_bits32 out;
    out.u = (uint32_t)h << 16;
    return out.f;
}

/* exp(x) for x <= 0, relative error below 2e-7; exactly 0 for x < -87
 * (including -inf), where binary32 exp would be denormal or zero.
 * Range reduction x = n*ln2 + r with |r| <= ln2/2 (Cody-Waite split of ln2;
 * n rounded by truncating x/ln2 - 1/2, exact for x <= 0), a degree-7 Taylor
 * polynomial in r, and the scaling by 2^n through the exponent bits. The
 * scalar and the vector version compute the same thing in the same order. */
#define SS_EXP_POLY(r) \
    (((((((1.9841270e-4f * (r) + 1.3888889e-3f) * (r) + 8.3333333e-3f) * (r) \
    + 4.1666667e-2f) * (r) + 1.6666667e-1f) * (r) + 0.5f) * (r) + 1.0f) * (r) + 1.0f)
#define SS_LOG2E 1.44269504088896341f
#define SS_LN2_HI 0.693145751953125f
#define SS_LN2_LO 1.42860682030941723e-06f
#define SS_EXP_FLOOR -87.0f

static inline float ss_exp_nonpositive(float x)
{
    float clamped = x < SS_EXP_FLOOR ? SS_EXP_FLOOR : x;
    int32_t n = (int32_t)(clamped * SS_LOG2E - 0.5f);
    float r = clamped - (float)n * SS_LN2_HI;
    r = r - (float)n * SS_LN2_LO;
    ss_bits32 scale;
    scale.i = (n + 127) << 23;
    float result = SS_EXP_POLY(r) * scale.f;
    return x < SS_EXP_FLOOR ? 0.0f : result;
}

/* Block reductions over exactly SS_BLOCK floats, written with GCC/Clang
 * vector extensions so they are SIMD on any target (AVX2 with -march=native,
 * two SSE halves on baseline x86-64, NEON on arm64) without -ffast-math. */
#define SS_BLOCK 64
#define SS_LANES 8
typedef float ss_vf __attribute__((vector_size(4 * SS_LANES)));
typedef int32_t ss_vi __attribute__((vector_size(4 * SS_LANES)));

static inline ss_vf ss_load(const float* x)
{
    ss_vf v;
    __builtin_memcpy(&v, x, sizeof v);
    return v;
}

static inline ss_vf ss_select(ss_vi mask, ss_vf if_true, ss_vf if_false)
{
    return (ss_vf)(((ss_vi)if_true & mask) | ((ss_vi)if_false & ~mask));
}

static inline ss_vf ss_exp_nonpositive_v(ss_vf x)
{
    ss_vi below = x < SS_EXP_FLOOR;
    ss_vf clamped = ss_select(below, (ss_vf){} + SS_EXP_FLOOR, x);
    ss_vi n = __builtin_convertvector(clamped * SS_LOG2E - 0.5f, ss_vi);
    ss_vf nf = __builtin_convertvector(n, ss_vf);
    ss_vf r = clamped - nf * SS_LN2_HI;
    r = r - nf * SS_LN2_LO;
    ss_vf result = SS_EXP_POLY(r) * (ss_vf)((n + 127) << 23);
    return ss_select(below, (ss_vf){}, result);
}

/* sum_j exp((x_j - x_max) * scale), for x_max = max_j x_j finite, scale > 0. */
static inline float ss_block_exp_sum(const float* x, float x_max, float scale)
{
    ss_vf acc = {};
    for (int j = 0; j < SS_BLOCK; j += SS_LANES)
        acc += ss_exp_nonpositive_v((ss_load(x + j) - x_max) * scale);
    float s = 0.0f;
    for (int l = 0; l < SS_LANES; l++) s += acc[l];
    return s;
}

/* max over the block, ignoring NaN; adds the number of NaNs to *nan_count. */
static inline float ss_block_max_count_nan(const float* x, int* nan_count)
{
    ss_vf m = ss_load(x);
    ss_vi nans = (ss_vi)(m != m);
    for (int j = SS_LANES; j < SS_BLOCK; j += SS_LANES) {
        ss_vf v = ss_load(x + j);
        nans += (ss_vi)(v != v);
        m = ss_select(v > m, v, m);
    }
    float best = m[0];
    int count = 0;
    for (int l = 0; l < SS_LANES; l++) {
        best = m[l] > best ? m[l] : best;
        count -= nans[l];
    }
    *nan_count += count;
    return best;
}

/* sum of mass[b] over the blocks whose max reaches threshold. */
static inline double ss_mass_at_or_above(const float* block_max, const float* mass,
                                         long n_blocks, float threshold)
{
    double total = 0.0;
    for (long b = 0; b < n_blocks; b++)
        total += block_max[b] >= threshold ? (double)mass[b] : 0.0;
    return total;
}

static inline long ss_count_at_or_above(const float* values, long n, float threshold)
{
    long count = 0;
    for (long b = 0; b < n; b++) count += values[b] >= threshold;
    return count;
}

#endif
