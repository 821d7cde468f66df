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
 * vector version below uses the same steps. */
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

/* The vector exp feeds block masses only: for x < -87 it returns at most
 * e^-87 instead of 0, which vanishes in a sum that holds the block max's 1. */
static inline ss_vf ss_exp_nonpositive_v(ss_vf x)
{
#if defined(__AVX__)
    ss_vf clamped = __builtin_ia32_maxps256(x, (ss_vf){} + SS_EXP_FLOOR);
#else
    ss_vf clamped = ss_select(x < SS_EXP_FLOOR, (ss_vf){} + SS_EXP_FLOOR, x);
#endif
    ss_vi n = __builtin_convertvector(clamped * SS_LOG2E - 0.5f, ss_vi);
    ss_vf nf = __builtin_convertvector(n, ss_vf);
    ss_vf r = clamped - nf * SS_LN2_HI;
    r = r - nf * SS_LN2_LO;
    return SS_EXP_POLY(r) * (ss_vf)((n + 127) << 23);
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

/* Lanes j .. j+7 of a block that the hot set claims (bit j+l of hot_bits):
 * -1 where hot, 0 where cold. */
static inline ss_vi ss_hot_lanes(uint64_t hot_bits, int j)
{
    const ss_vi lane_bit = {1, 2, 4, 8, 16, 32, 64, 128};
    ss_vi byte = (ss_vi){} + (int32_t)((hot_bits >> j) & 0xFFu);
    return (ss_vi)((byte & lane_bit) != 0);
}

/* The sum of the 8 lanes by halving (3 dependent adds, not 7): the lane
 * order of a float sum is free wherever only a bound is needed. */
static inline float ss_sum_lanes(ss_vf v)
{
#if defined(__clang__)
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
#else
    v += __builtin_shuffle(v, (ss_vi){4, 5, 6, 7, 0, 1, 2, 3});
    v += __builtin_shuffle(v, (ss_vi){2, 3, 0, 1, 6, 7, 4, 5});
    v += __builtin_shuffle(v, (ss_vi){1, 0, 3, 2, 5, 4, 7, 6});
#endif
    return v[0];
}

/* ss_block_max_count_nan with its reductions halved (max, then the NaN
 * lanes) instead of lane by lane: a short dependency chain, for the SHVS
 * pass, whose bound starts on it. NaN never wins a lane (vmaxps returns its
 * second operand, the running max, when the first is NaN). */
static inline float ss_block_peak(const float* x, int* nan_count)
{
    ss_vf m = (ss_vf){} - __builtin_inff();
    ss_vi nans = {};
    for (int j = 0; j < SS_BLOCK; j += SS_LANES) {
        ss_vf v = ss_load(x + j);
        nans += (ss_vi)(v != v);
#if defined(__AVX__)
        m = __builtin_ia32_maxps256(v, m);
#else
        m = ss_select((ss_vi)(v > m), v, m);
#endif
    }
    *nan_count -= (int)ss_sum_lanes((ss_vf)__builtin_convertvector(nans, ss_vf));
#if defined(__clang__)
    m = ss_select((ss_vi)(m > __builtin_shufflevector(m, m, 4, 5, 6, 7, 0, 1, 2, 3)), m,
                  __builtin_shufflevector(m, m, 4, 5, 6, 7, 0, 1, 2, 3));
    m = ss_select((ss_vi)(m > __builtin_shufflevector(m, m, 2, 3, 0, 1, 6, 7, 4, 5)), m,
                  __builtin_shufflevector(m, m, 2, 3, 0, 1, 6, 7, 4, 5));
#else
    m = ss_select((ss_vi)(m > __builtin_shuffle(m, (ss_vi){4, 5, 6, 7, 0, 1, 2, 3})), m,
                  __builtin_shuffle(m, (ss_vi){4, 5, 6, 7, 0, 1, 2, 3}));
    m = ss_select((ss_vi)(m > __builtin_shuffle(m, (ss_vi){2, 3, 0, 1, 6, 7, 4, 5})), m,
                  __builtin_shuffle(m, (ss_vi){2, 3, 0, 1, 6, 7, 4, 5}));
#endif
    return m[0] > m[1] ? m[0] : m[1];
}

/* A cheap bound on exp, for a block's mass without an exp per token.
 * For e = (x - x_max) * scale * log2(e) <= 0, the float whose bits are
 * trunc(2^23 (e + 127)) is 2^floor(e) * (1 + frac(e)) (Schraudolph's exp
 * without its correction term), and 2^f <= 1 + f <= 1.0615 * 2^f on [0, 1],
 * so the term is between exp((x - x_max) * scale) and 1.0615 times it.
 * 2^23 (e + 127) is computed as (x - x_max) * to_bits + 127 * 2^23 with
 * to_bits = scale * log2(e) * 2^23 (one subtraction, one fused multiply-add)
 * and clamped at 2^23 (e = -126, the smallest normal; clamping only raises
 * a term). Its float rounding (about 2^-16 in e, whatever the magnitude of
 * x: the clamp caps |e|) and the truncation move a term by less than 2e-5
 * of itself either way: the caller's margin covers that, and the small
 * difference between this scalar form and the vector one below. */
#define SS_BOUND_FLOOR 8388608.0f
#define SS_BOUND_BIAS 1065353216.0f      /* 127 * 2^23 */

static inline float ss_bound_term(float x, float x_max, float to_bits)
{
    float y = __builtin_fmaf(x - x_max, to_bits, SS_BOUND_BIAS);
    y = y < SS_BOUND_FLOOR ? SS_BOUND_FLOOR : y;
    ss_bits32 term;
    term.i = (int32_t)y;
    return term.f;
}

/* sum over the block of ss_bound_term(x_j, x_max, to_bits), x_max >= every x_j. */
static inline float ss_block_bound(const float* x, float x_max, float to_bits)
{
    ss_vf acc[2] = {};
    for (int j = 0; j < SS_BLOCK; j += SS_LANES) {
        ss_vf y = (ss_load(x + j) - x_max) * to_bits + SS_BOUND_BIAS;
#if defined(__AVX__)
        y = __builtin_ia32_maxps256(y, (ss_vf){} + SS_BOUND_FLOOR);
#else
        y = ss_select((ss_vi)(y < SS_BOUND_FLOOR), (ss_vf){} + SS_BOUND_FLOOR, y);
#endif
        acc[(j / SS_LANES) & 1] += (ss_vf)__builtin_convertvector(y, ss_vi);
    }
    return ss_sum_lanes(acc[0] + acc[1]);
}

/* out[i] = exp(z[i] - shift) for z[i] <= shift, vectorized, with exactly 0
 * below e^-87 (a banned token, z = -inf, must keep weight 0). */
static inline void ss_exp_shifted(const float* z, float shift, float* out, long n)
{
    long i = 0;
    for (; i + SS_LANES <= n; i += SS_LANES) {
        ss_vf x = ss_load(z + i) - shift;
        ss_vf e = ss_select((ss_vi)(x < SS_EXP_FLOOR), (ss_vf){}, ss_exp_nonpositive_v(x));
        __builtin_memcpy(out + i, &e, sizeof e);
    }
    for (; i < n; i++) out[i] = ss_exp_nonpositive(z[i] - shift);
}

/* Bit j set when column j is cold and x_j * scale >= threshold (the same
 * float product the caller compares): the block's new candidates, found
 * without a branch per column. */
static inline uint64_t ss_block_cold_at_or_above(const float* x, uint64_t hot_bits, float scale,
                                                 float threshold)
{
    uint64_t mask = 0;
    for (int j = 0; j < SS_BLOCK; j += SS_LANES) {
        ss_vi hit = (ss_vi)(ss_load(x + j) * scale >= threshold);
#if defined(__AVX__)
        uint64_t lanes = (uint64_t)__builtin_ia32_movmskps256((ss_vf)hit);
#else
        uint64_t lanes = 0;
        for (int l = 0; l < SS_LANES; l++) lanes |= (uint64_t)(hit[l] & 1) << l;
#endif
        mask |= lanes << j;
    }
    return mask & ~hot_bits;
}

static inline int ss_lowest_bit(uint64_t v) { return __builtin_ctzll(v); }

/* sum over cold lanes of exp(x_j * scale - shift), for shift >= every cold
 * x_j * scale (the row max): the exact cold mass of the block. */
static inline float ss_block_cold_exp_sum(const float* x, uint64_t hot_bits, float scale, float shift)
{
    ss_vf acc = {};
    for (int j = 0; j < SS_BLOCK; j += SS_LANES) {
        ss_vf term = ss_exp_nonpositive_v(ss_load(x + j) * scale - shift);
        acc += ss_select(ss_hot_lanes(hot_bits, j), (ss_vf){}, term);
    }
    float s = 0.0f;
    for (int l = 0; l < SS_LANES; l++) s += acc[l];
    return s;
}

/* sum of mass[b] over the blocks whose max reaches threshold (float lanes:
 * it only chooses where to look; the caller checks the nucleus exactly). */
static inline double ss_mass_at_or_above(const float* block_max, const float* mass,
                                         long n_blocks, float threshold)
{
    ss_vf acc = {};
    long b = 0;
    for (; b + SS_LANES <= n_blocks; b += SS_LANES) {
        ss_vf m = ss_load(mass + b);
        acc += ss_select(ss_load(block_max + b) >= threshold, m, (ss_vf){});
    }
    double total = 0.0;
    for (int l = 0; l < SS_LANES; l++) total += acc[l];
    for (; b < n_blocks; b++) total += block_max[b] >= threshold ? mass[b] : 0.0f;
    return total;
}

static inline long ss_count_at_or_above(const float* values, long n, float threshold)
{
    long count = 0;
    for (long b = 0; b < n; b++) count += values[b] >= threshold;
    return count;
}

#endif
