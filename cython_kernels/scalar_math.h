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
 * polynomial in r, and the scaling by 2^n through the exponent bits. It
 * weighs candidates and the tokens of a block a draw lands in; the vector
 * exp below (a shorter polynomial, rounding by addition) weighs blocks. */
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

/* Lane-wise a > b ? a : b (a NaN in b wins, one in a does not). */
static inline __attribute__((always_inline)) ss_vf ss_max_v(ss_vf a, ss_vf b)
{
    return ss_select((ss_vi)(a > b), a, b);
}

/* The max of the 8 lanes by halving. */
static inline __attribute__((always_inline)) float ss_hmax_v(ss_vf m)
{
#if defined(__clang__)
    m = ss_max_v(m, __builtin_shufflevector(m, m, 4, 5, 6, 7, 0, 1, 2, 3));
    m = ss_max_v(m, __builtin_shufflevector(m, m, 2, 3, 0, 1, 6, 7, 4, 5));
#else
    m = ss_max_v(m, __builtin_shuffle(m, (ss_vi){4, 5, 6, 7, 0, 1, 2, 3}));
    m = ss_max_v(m, __builtin_shuffle(m, (ss_vi){2, 3, 0, 1, 6, 7, 4, 5}));
#endif
    return m[0] > m[1] ? m[0] : m[1];
}

/* The sum of the 8 lanes by halving (3 dependent adds, not 7): lanes 4 apart,
 * then 2 apart, then the last pair, the order ss_hsum_w ends with (the
 * 8-lane row pass's mass relies on it being the same float). */
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

/* The vector exp: exp(x) for x <= 0 with relative error below 3e-7
 * (measured against float64 by tests/test_exp.py), exactly 0 for x < -87
 * and for -inf (a banned token keeps weight 0; NaN lanes give unspecified
 * values, so callers detect NaN themselves). No table, no division, no
 * fast-math:
 *   n = round(x * log2 e) by adding 1.5 * 2^23 (the float's low mantissa
 *       bits then hold n; valid for |n| < 2^22);
 *   r = x - n ln2 in two fused steps (Cody-Waite), |r| <= ln2 / 2;
 *   exp(r) by a degree-5 polynomial fitted to the relative error on
 *       [-ln2/2, ln2/2] with p(0) = 1 exactly (fitting error 9e-8, float
 *       evaluation included 1.5e-7), so a block's max term is exactly 1;
 *   2^n by adding n to the result's exponent field (vscalefps on AVX-512):
 *       for x >= -87, n >= -126 and when n = -126 then r > 0, so the
 *       exponent never leaves the normal range and no denormal is ever formed.
 * Every multiply-add is fused where the target has FMA, by intrinsic, not by
 * the compiler's contraction: the broad-row passes (nucleus.h) are compiled
 * with fp-contract=off so their z is the same float in every pass, and
 * there an exp left to contraction came out as separate multiplies and adds:
 * twice the instructions, and other floats than the row pass's. So every exp
 * below is the same float for the same x in every pass and at every width. */
#define SS_EXP_ROUND 12582912.0f            /* 1.5 * 2^23 */
#define SS_EXP_ROUND_BITS 0x4b400000
#define SS_EXP_P1 9.999997020e-01f
#define SS_EXP_P2 4.999915063e-01f
#define SS_EXP_P3 1.666763574e-01f
#define SS_EXP_P4 4.189793393e-02f
#define SS_EXP_P5 8.290312253e-03f

#if defined(__FMA__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* a * b + c, rounded once where the target has FMA, whatever the caller's
 * fp-contract (without FMA nothing fuses it, contraction on or off). */
static inline __attribute__((always_inline)) ss_vf ss_fma_v(ss_vf a, ss_vf b, ss_vf c)
{
#if defined(__FMA__)
    return (ss_vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

static inline __attribute__((always_inline)) ss_vf ss_exp_nonpositive_v(ss_vf x)
{
    const ss_vf zero = {};
    ss_vi below = (ss_vi)(x < SS_EXP_FLOOR);
    ss_vf clamped = ss_select(below, zero + SS_EXP_FLOOR, x);
    ss_vf t = ss_fma_v(clamped, zero + SS_LOG2E, zero + SS_EXP_ROUND);
    ss_vf nf = t - SS_EXP_ROUND;
    ss_vf r = ss_fma_v(-nf, zero + SS_LN2_HI, clamped);
    r = ss_fma_v(-nf, zero + SS_LN2_LO, r);
    ss_vf p = ss_fma_v(zero + SS_EXP_P5, r, zero + SS_EXP_P4);
    p = ss_fma_v(p, r, zero + SS_EXP_P3);
    p = ss_fma_v(p, r, zero + SS_EXP_P2);
    p = ss_fma_v(p, r, zero + SS_EXP_P1);
    p = ss_fma_v(p, r, zero + 1.0f);
    ss_vi bits = (ss_vi)p + (((ss_vi)t - SS_EXP_ROUND_BITS) << 23);
    return (ss_vf)(bits & ~below);
}

/* The full-row pass works on a whole block at once in the widest vectors the
 * target has: 16 lanes (4 per block) are one AVX-512 register each, two AVX2
 * registers or four SSE2 ones elsewhere; GCC splits them itself. */
#define SS_WIDE_LANES 16
typedef float ss_vw __attribute__((vector_size(4 * SS_WIDE_LANES)));
typedef int32_t ss_vwi __attribute__((vector_size(4 * SS_WIDE_LANES)));

#if defined(__AVX512F__)
/* ss_exp_nonpositive_v's arithmetic on 16 lanes: vmaxps clamps in one
 * instruction (a NaN lane stays NaN: vmaxps returns its second operand, x,
 * when one is NaN) and vscalefps applies 2^n in one, the same float as the
 * exponent add wherever x >= -87. zero_below: 0 below -87 and for -inf
 * through the scaling's zero-masking (one compare more); otherwise such a
 * lane is e^-87 (the block-mass terms, ss_exp_mass_w). */
static inline __attribute__((always_inline)) ss_vw ss_exp_scaled_w(ss_vw x, int zero_below)
{
    const __m512 floor = _mm512_set1_ps(SS_EXP_FLOOR);
    __m512 clamped = _mm512_max_ps(floor, (__m512)x);
    __m512 t = _mm512_fmadd_ps(clamped, _mm512_set1_ps(SS_LOG2E), _mm512_set1_ps(SS_EXP_ROUND));
    __m512 nf = _mm512_sub_ps(t, _mm512_set1_ps(SS_EXP_ROUND));
    __m512 r = _mm512_fnmadd_ps(nf, _mm512_set1_ps(SS_LN2_HI), clamped);
    r = _mm512_fnmadd_ps(nf, _mm512_set1_ps(SS_LN2_LO), r);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(SS_EXP_P5), r, _mm512_set1_ps(SS_EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(SS_EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(SS_EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(SS_EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    if (zero_below)
        return (ss_vw)_mm512_maskz_scalef_ps(_mm512_cmp_ps_mask((__m512)x, floor, _CMP_GE_OQ),
                                             p, nf);
    return (ss_vw)_mm512_scalef_ps(p, nf);
}

static inline __attribute__((always_inline)) ss_vw ss_exp_nonpositive_w(ss_vw x)
{
    return ss_exp_scaled_w(x, 1);
}
#else
/* Two 8-lane exps: the same floats as ss_exp_nonpositive_v lane for lane. */
static inline __attribute__((always_inline)) ss_vw ss_exp_nonpositive_w(ss_vw x)
{
    ss_vf lo = ss_exp_nonpositive_v(__builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7));
    ss_vf hi = ss_exp_nonpositive_v(__builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15));
    return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
#endif

static inline __attribute__((always_inline)) ss_vw ss_load_w(const float* x)
{
    ss_vw v;
    __builtin_memcpy(&v, x, sizeof v);
    return v;
}

/* Lane-wise a > b ? a : b (so a NaN in b wins, one in a does not; callers
 * flag NaN apart): one vmaxps on AVX-512, a compare and a blend elsewhere. */
static inline __attribute__((always_inline)) ss_vw ss_max_w(ss_vw a, ss_vw b)
{
#if defined(__AVX512F__)
    return (ss_vw)_mm512_max_ps((__m512)a, (__m512)b);
#else
    ss_vwi take_a = (ss_vwi)(a > b);
    return (ss_vw)(((ss_vwi)a & take_a) | ((ss_vwi)b & ~take_a));
#endif
}

static inline __attribute__((always_inline)) float ss_hmax_w(ss_vw m)
{
    m = ss_max_w(m, __builtin_shufflevector(m, m, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    m = ss_max_w(m, __builtin_shufflevector(m, m, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    m = ss_max_w(m, __builtin_shufflevector(m, m, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    return m[0] > m[1] ? m[0] : m[1];
}

static inline __attribute__((always_inline)) float ss_hsum_w(ss_vw v)
{
    v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    return v[0] + v[1];
}

/* Any NaN lane: the 16-lane OR folded to one int. */
static inline __attribute__((always_inline)) int ss_any_w(ss_vwi v)
{
    v |= __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v |= __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v |= __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    return (v[0] | v[1]) != 0;
}

/* A block's 64 logits as four 16-lane vectors: float32 read in place, and
 * bfloat16 widened in registers (zero-extend, shift into the high half), so
 * no converted copy is stored and reloaded: a 16-lane load of lanes just
 * written by narrower stores stalls on store forwarding. */
typedef uint16_t ss_vhw __attribute__((vector_size(2 * SS_WIDE_LANES)));

static inline __attribute__((always_inline)) ss_vw ss_load_bf16_w(const uint16_t* h)
{
#if defined(__AVX512F__)
    /* One 16-lane vpmovzxwd and one shift: GCC tunes znver4 to 256-bit
     * vectors and split the generic conversion below into halves, extracts
     * and inserts, five instructions per 16 lanes, which made a bfloat16
     * row's exp pass slower than a float32 row's. */
    return (ss_vw)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)h)),
                                    16);
#else
    ss_vhw v;
    __builtin_memcpy(&v, h, sizeof v);
    return (ss_vw)(__builtin_convertvector(v, ss_vwi) << 16);
#endif
}

typedef uint16_t ss_vh __attribute__((vector_size(2 * SS_LANES)));

static inline __attribute__((always_inline)) ss_vf ss_load_bf16_v(const uint16_t* h)
{
    ss_vh v;
    __builtin_memcpy(&v, h, sizeof v);
    return (ss_vf)(__builtin_convertvector(v, ss_vi) << 16);
}

/* Any NaN among the four vectors, as 0 or 1. */
static inline __attribute__((always_inline)) int ss_block_has_nan(ss_vw v0, ss_vw v1, ss_vw v2,
                                                                 ss_vw v3)
{
#if defined(__AVX512F__)
    /* "unordered" holds where either operand is NaN: two compares into mask
     * registers cover the four vectors. */
    return (_mm512_cmp_ps_mask((__m512)v0, (__m512)v1, _CMP_UNORD_Q)
            | _mm512_cmp_ps_mask((__m512)v2, (__m512)v3, _CMP_UNORD_Q)) != 0;
#else
    return ss_any_w((ss_vwi)(v0 != v0) | (ss_vwi)(v1 != v1) | (ss_vwi)(v2 != v2)
                    | (ss_vwi)(v3 != v3));
#endif
}

/* The block's max (unspecified when it holds a NaN: the row is then an
 * error row, which *nan_count reports). */
static inline __attribute__((always_inline)) float ss_block4_max(ss_vw v0, ss_vw v1, ss_vw v2,
                                                                ss_vw v3, int* nan_count)
{
    *nan_count += ss_block_has_nan(v0, v1, v2, v3);
    return ss_hmax_w(ss_max_w(ss_max_w(v0, v1), ss_max_w(v2, v3)));
}

/* The exp of a block-mass term, x <= 0: ss_exp_nonpositive_w's values
 * wherever x >= -87. Below, a term may be up to e^-87 instead of 0, which
 * vanishes in a block sum that holds the block max's exact 1. With AVX-512
 * that spares the zero-masking's compare, 11 instructions in all, and a NaN
 * lane stays NaN through all of them, so a block's mass is NaN when the
 * block holds one: SS_MASS_FLAGS_NAN. */
#if defined(__AVX512F__)
#define SS_MASS_FLAGS_NAN 1
static inline __attribute__((always_inline)) ss_vw ss_exp_mass_w(ss_vw x)
{
    return ss_exp_scaled_w(x, 0);
}
#else
#define SS_MASS_FLAGS_NAN 0
#define ss_exp_mass_w ss_exp_nonpositive_w
#endif

/* One read of a block for both halves of its softmax summary: returns the
 * block's max m (as ss_block4_max) and sets *mass to
 * sum_j exp(x_j * scale - M), M = m * scale rounded to float (the block max
 * z the caller stores), or 0 when m is not finite; from the same registers.
 * Each argument is one fused multiply-add, rounded once, so the mass is
 * relative to exactly the z the caller rescales from (exp(M - row max)); the
 * max's own term is within half an ulp of M of exp(0) = 1. The running-max
 * rescaling of the online softmax happens across blocks (sample_row scales
 * every block's mass to the row max at the end, in one vector pass); inside
 * a block the max comes first, so every argument is <= that half ulp and a
 * block's mass lies in [1, SS_BLOCK] up to rounding. With terms non-NULL
 * and M >= terms_floor, the SS_BLOCK terms exp(z_j - M) are stored there too
 * (untouched otherwise, and when m is not finite), for a later pass that sums
 * some of them without an exp; the floor spares the stores of blocks that
 * pass will not read. ss_block4_mass_at is the same given the block's max m. */
static inline __attribute__((always_inline)) float ss_block4_mass_at(
    ss_vw v0, ss_vw v1, ss_vw v2, ss_vw v3, float m, float scale, float* mass, int* nan_count,
    float* terms, float terms_floor)
{
    if (!(m > -__builtin_inff() && m < __builtin_inff())) {
        *nan_count += ss_block_has_nan(v0, v1, v2, v3);
        *mass = 0.0f;
        return m;
    }
    float shift = m * scale;
    if (!SS_MASS_FLAGS_NAN || shift == -__builtin_inff())
        *nan_count += ss_block_has_nan(v0, v1, v2, v3);
    if (shift == -__builtin_inff()) {
        /* a finite max whose z overflows (float32's min at T < 1, a masked
         * row's padding): every z of the block is -inf, no mass; its
         * arguments would be -inf - -inf, NaN */
        *mass = 0.0f;
        return m;
    }
    ss_vw e0 = ss_exp_mass_w(v0 * scale - shift), e1 = ss_exp_mass_w(v1 * scale - shift);
    ss_vw e2 = ss_exp_mass_w(v2 * scale - shift), e3 = ss_exp_mass_w(v3 * scale - shift);
    if (terms && shift >= terms_floor) {
        __builtin_memcpy(terms, &e0, sizeof e0);
        __builtin_memcpy(terms + 16, &e1, sizeof e1);
        __builtin_memcpy(terms + 32, &e2, sizeof e2);
        __builtin_memcpy(terms + 48, &e3, sizeof e3);
    }
    ss_vw acc = e0 + e1;
    acc += e2 + e3;
    *mass = ss_hsum_w(acc);
    if (SS_MASS_FLAGS_NAN)      /* m is finite: a NaN mass means a NaN lane */
        *nan_count += *mass != *mass;
    return m;
}

static inline __attribute__((always_inline)) ss_vw ss_max4_w(ss_vw v0, ss_vw v1, ss_vw v2, ss_vw v3)
{
    return ss_max_w(ss_max_w(v0, v1), ss_max_w(v2, v3));
}

static inline __attribute__((always_inline)) float ss_block4_max_mass(
    ss_vw v0, ss_vw v1, ss_vw v2, ss_vw v3, float scale, float* mass, int* nan_count,
    float* terms, float terms_floor)
{
    return ss_block4_mass_at(v0, v1, v2, v3, ss_hmax_w(ss_max4_w(v0, v1, v2, v3)), scale, mass,
                             nan_count, terms, terms_floor);
}

/* ss_block4_max_mass of two consecutive blocks (v, w), both maxima first: a
 * block's exps wait on its max (a reduction tree, then the horizontal max),
 * so one block at a time leaves the exp units idle through that chain; with
 * the second block's max computed beside the first block's exps they are
 * not. Each block's max, mass and terms are the floats ss_block4_max_mass
 * gives it (terms + SS_BLOCK: the second block's). */
static inline __attribute__((always_inline)) void ss_block4_pair_max_mass(
    ss_vw v0, ss_vw v1, ss_vw v2, ss_vw v3, ss_vw w0, ss_vw w1, ss_vw w2, ss_vw w3, float scale,
    float* max, float* mass, int* nan_count, float* terms, float terms_floor)
{
    max[0] = ss_hmax_w(ss_max4_w(v0, v1, v2, v3));
    max[1] = ss_hmax_w(ss_max4_w(w0, w1, w2, w3));
    ss_block4_mass_at(v0, v1, v2, v3, max[0], scale, &mass[0], nan_count, terms, terms_floor);
    ss_block4_mass_at(w0, w1, w2, w3, max[1], scale, &mass[1], nan_count,
                      terms ? terms + SS_BLOCK : terms, terms_floor);
}

#if defined(__AVX512F__)
static inline float ss_block_max_nan(const float* x, int* nan_count)
{
    return ss_block4_max(ss_load_w(x), ss_load_w(x + 16), ss_load_w(x + 32), ss_load_w(x + 48),
                         nan_count);
}

static inline float ss_block_max_mass(const float* x, float scale, float* mass, int* nan_count,
                                      float* terms, float terms_floor)
{
    return ss_block4_max_mass(ss_load_w(x), ss_load_w(x + 16), ss_load_w(x + 32),
                              ss_load_w(x + 48), scale, mass, nan_count, terms, terms_floor);
}

static inline float ss_block_max_nan_bf16(const uint16_t* h, int* nan_count)
{
    return ss_block4_max(ss_load_bf16_w(h), ss_load_bf16_w(h + 16), ss_load_bf16_w(h + 32),
                         ss_load_bf16_w(h + 48), nan_count);
}

/* Blocks x and x + SS_BLOCK as ss_block_max_mass(_bf16) gives them, each
 * block's max into max[k] and mass into mass[k] (ss_block4_pair_max_mass). */
static inline __attribute__((always_inline)) void ss_block_pair_max_mass(const float* x, float scale, float* max, float* mass,
                                          int* nan_count, float* terms, float terms_floor)
{
    ss_block4_pair_max_mass(ss_load_w(x), ss_load_w(x + 16), ss_load_w(x + 32), ss_load_w(x + 48),
                            ss_load_w(x + 64), ss_load_w(x + 80), ss_load_w(x + 96),
                            ss_load_w(x + 112), scale, max, mass, nan_count, terms, terms_floor);
}

static inline __attribute__((always_inline)) void ss_block_pair_max_mass_bf16(const uint16_t* h, float scale, float* max,
                                               float* mass, int* nan_count, float* terms,
                                               float terms_floor)
{
    ss_block4_pair_max_mass(ss_load_bf16_w(h), ss_load_bf16_w(h + 16), ss_load_bf16_w(h + 32),
                            ss_load_bf16_w(h + 48), ss_load_bf16_w(h + 64), ss_load_bf16_w(h + 80),
                            ss_load_bf16_w(h + 96), ss_load_bf16_w(h + 112), scale, max, mass,
                            nan_count, terms, terms_floor);
}

static inline float ss_block_max_mass_bf16(const uint16_t* h, float scale, float* mass,
                                           int* nan_count, float* terms, float terms_floor)
{
    return ss_block4_max_mass(ss_load_bf16_w(h), ss_load_bf16_w(h + 16), ss_load_bf16_w(h + 32),
                              ss_load_bf16_w(h + 48), scale, mass, nan_count, terms, terms_floor);
}
#else
/* Without AVX-512 the block is eight 8-lane vectors. GCC (12) lowers a
 * compare of 16-lane vectors that no register holds lane by lane, with a
 * branch each: on AVX2 (Zen 3) the 16-lane pass above made a row 3-7x
 * slower (docs/results/kernels-2026-11-26-avx2.md). The arithmetic is the
 * 16-lane pass's, in its order: a 16-lane vector k (floats 16k ..
 * 16k+15) is the pair (w[2k], w[2k+1]), so each lane's mass terms are added
 * as there and the horizontal sum starts with the same halves (low + high),
 * and the mass is the same float bit for bit on a given target; the max is
 * order-free. */
static inline __attribute__((always_inline)) float ss_block8_max(const ss_vf* w, int* nan_count)
{
    ss_vi nan = (ss_vi)(w[0] != w[0]);
    ss_vf m = w[0];
    for (int k = 1; k < SS_BLOCK / SS_LANES; k++) {
        nan |= (ss_vi)(w[k] != w[k]);
        m = ss_max_v(m, w[k]);
    }
    nan |= __builtin_shufflevector(nan, nan, 4, 5, 6, 7, 0, 1, 2, 3);
    nan |= __builtin_shufflevector(nan, nan, 2, 3, 0, 1, 6, 7, 4, 5);
    *nan_count += (nan[0] | nan[1]) != 0;
    return ss_hmax_v(m);
}

static inline __attribute__((always_inline)) float ss_block8_max_mass(
    const ss_vf* w, float scale, float* mass, int* nan_count, float* terms, float terms_floor)
{
    float m = ss_block8_max(w, nan_count);
    if (!(m > -__builtin_inff() && m < __builtin_inff())) {
        *mass = 0.0f;
        return m;
    }
    float shift = m * scale;
    if (shift == -__builtin_inff()) {  /* as in ss_block4_mass_at */
        *mass = 0.0f;
        return m;
    }
    ss_vf e[SS_BLOCK / SS_LANES];
    for (int k = 0; k < SS_BLOCK / SS_LANES; k++)
        e[k] = ss_exp_nonpositive_v(w[k] * scale - shift);
    if (terms && shift >= terms_floor)
        __builtin_memcpy(terms, e, sizeof e);
    ss_vf lo = (e[0] + e[2]) + (e[4] + e[6]);
    ss_vf hi = (e[1] + e[3]) + (e[5] + e[7]);
    *mass = ss_sum_lanes(lo + hi);
    return m;
}

#define SS_LOAD_BLOCK8(w, load, x) \
    ss_vf w[SS_BLOCK / SS_LANES];  \
    for (int k = 0; k < SS_BLOCK / SS_LANES; k++) w[k] = load((x) + k * SS_LANES)

static inline float ss_block_max_nan(const float* x, int* nan_count)
{
    SS_LOAD_BLOCK8(w, ss_load, x);
    return ss_block8_max(w, nan_count);
}

static inline float ss_block_max_mass(const float* x, float scale, float* mass, int* nan_count,
                                      float* terms, float terms_floor)
{
    SS_LOAD_BLOCK8(w, ss_load, x);
    return ss_block8_max_mass(w, scale, mass, nan_count, terms, terms_floor);
}

static inline float ss_block_max_nan_bf16(const uint16_t* h, int* nan_count)
{
    SS_LOAD_BLOCK8(w, ss_load_bf16_v, h);
    return ss_block8_max(w, nan_count);
}

static inline float ss_block_max_mass_bf16(const uint16_t* h, float scale, float* mass,
                                           int* nan_count, float* terms, float terms_floor)
{
    SS_LOAD_BLOCK8(w, ss_load_bf16_v, h);
    return ss_block8_max_mass(w, scale, mass, nan_count, terms, terms_floor);
}

/* The AVX-512 pair's contract, one block after the other: eight 8-lane
 * vectors a block already keep the exp units busy through a block's max. */
static inline __attribute__((always_inline)) void ss_block_pair_max_mass(const float* x, float scale, float* max, float* mass,
                                          int* nan_count, float* terms, float terms_floor)
{
    for (int k = 0; k < 2; k++)
        max[k] = ss_block_max_mass(x + k * SS_BLOCK, scale, &mass[k], nan_count,
                                   terms ? terms + k * SS_BLOCK : terms, terms_floor);
}

static inline __attribute__((always_inline)) void ss_block_pair_max_mass_bf16(const uint16_t* h, float scale, float* max,
                                               float* mass, int* nan_count, float* terms,
                                               float terms_floor)
{
    for (int k = 0; k < 2; k++)
        max[k] = ss_block_max_mass_bf16(h + k * SS_BLOCK, scale, &mass[k], nan_count,
                                        terms ? terms + k * SS_BLOCK : terms, terms_floor);
}
#endif

/* Test hooks: the vector exps over n floats (n a multiple of 16), so tests
 * can hold each against float64 on whatever target the module was built for. */
static inline void ss_exp_array_v(const float* x, float* out, long n)
{
    for (long i = 0; i + SS_LANES <= n; i += SS_LANES) {
        ss_vf e = ss_exp_nonpositive_v(ss_load(x + i));
        __builtin_memcpy(out + i, &e, sizeof e);
    }
}

static inline void ss_exp_array_w(const float* x, float* out, float* mass_out, long n)
{
    for (long i = 0; i + SS_WIDE_LANES <= n; i += SS_WIDE_LANES) {
        ss_vw e = ss_exp_nonpositive_w(ss_load_w(x + i));
        __builtin_memcpy(out + i, &e, sizeof e);
        e = ss_exp_mass_w(ss_load_w(x + i));
        __builtin_memcpy(mass_out + i, &e, sizeof e);
    }
}

/* Lanes j .. j+7 of a block that the hot set claims (bit j+l of hot_bits):
 * -1 where hot, 0 where cold. */
static inline ss_vi ss_hot_lanes(uint64_t hot_bits, int j)
{
    const ss_vi lane_bit = {1, 2, 4, 8, 16, 32, 64, 128};
    ss_vi byte = (ss_vi){} + (int32_t)((hot_bits >> j) & 0xFFu);
    return (ss_vi)((byte & lane_bit) != 0);
}

/* A block's max and NaN count with its reductions halved (max, then the NaN
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
    return ss_hmax_v(m);
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
        ss_vf e = ss_exp_nonpositive_v(ss_load(z + i) - shift);
        __builtin_memcpy(out + i, &e, sizeof e);
    }
    for (; i < n; i++) out[i] = ss_exp_nonpositive(z[i] - shift);
}

/* A compare's lanes (-1 or 0) as the low SS_LANES bits. */
static inline uint64_t ss_lane_bits(ss_vi hit)
{
#if defined(__AVX__)
    return (uint64_t)__builtin_ia32_movmskps256((ss_vf)hit);
#else
    uint64_t lanes = 0;
    for (int l = 0; l < SS_LANES; l++) lanes |= (uint64_t)(hit[l] & 1) << l;
    return lanes;
#endif
}

/* Bit j set when column j is cold and x_j * scale >= threshold (the same
 * float product the caller compares): the block's new candidates, found
 * without a branch per column. */
static inline uint64_t ss_block_cold_at_or_above(const float* x, uint64_t hot_bits, float scale,
                                                 float threshold)
{
    uint64_t mask = 0;
    for (int j = 0; j < SS_BLOCK; j += SS_LANES) {
        mask |= ss_lane_bits((ss_vi)(ss_load(x + j) * scale >= threshold)) << j;
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
