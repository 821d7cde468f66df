/* The bucketed truncation of broad rows (nucleus.pxi): a block's z, weights
 * and buckets, computed by one compiled function for every pass over a row.
 */
#ifndef SIMPLE_SAMPLER_NUCLEUS_H
#define SIMPLE_SAMPLER_NUCLEUS_H

#include <stddef.h>

#include "scalar_math.h"

/* For the SS_BLOCK logits x of a block: z_j = x_j * inv_t, w_j =
 * exp(z_j - z_max) and bucket_j = (int)((z_max - z_j) * scale) capped at
 * last_bucket, written to z, w and bucket (for the 8-lane groups that hold a
 * returned lane; the others are left as they were); returns the lanes with
 * z_j >= z_floor as bits (lanes past the row end hold -inf and are never
 * set), and with only_bucket >= 0 just those of them in that bucket.
 *
 * Every rounding is a separate IEEE operation on the stored z, so the
 * bucket is a non-increasing function of z (ties share one) and the order
 * "z descending, then id" never crosses a bucket boundary. noinline and no
 * FP contraction: each pass over a row (histogram, boundary, draw) calls
 * this one compiled copy, so a lane gets the same z, w and bucket in every
 * pass; an inlined or cloned copy could fuse z_max - x * inv_t into an FMA in one pass
 * and not in another. */
__attribute__((noinline, noclone, optimize("fp-contract=off")))
static uint64_t ss_bucket_terms(const float* x, float inv_t, float z_max, float z_floor,
                                float scale, int32_t last_bucket, int32_t only_bucket,
                                float* z, float* w, int32_t* bucket)
{
    uint64_t mask = 0;
    for (int j = 0; j < SS_BLOCK; j += SS_LANES) {
        ss_vf zv = ss_load(x + j) * inv_t;
        ss_vf below_max = z_max - zv;
        /* capped before the conversion, which is undefined past INT_MAX */
        ss_vf scaled = below_max * scale;
        scaled = ss_select((ss_vi)(scaled < (float)last_bucket), scaled,
                           (ss_vf){} + (float)last_bucket);
        ss_vi b = __builtin_convertvector(scaled, ss_vi);
        ss_vi hit = (ss_vi)(zv >= z_floor);
        if (only_bucket >= 0)
            hit &= (ss_vi)(b == only_bucket);
        uint64_t lanes = ss_lane_bits(hit);
        /* one bucket's lanes are rare: the exp only where one is set (it is
         * lane by lane, so a lane's w does not depend on its neighbours) */
        if (lanes == 0)
            continue;
        ss_vf wv = ss_exp_nonpositive_v(zv - z_max);
        __builtin_memcpy(z + j, &zv, sizeof zv);
        __builtin_memcpy(w + j, &wv, sizeof wv);
        __builtin_memcpy(bucket + j, &b, sizeof b);
        mask |= lanes << j;
    }
    return mask;
}

/* The mass of a block's tokens ranked before a cut: sum of w_j =
 * exp(z_j - z_max), z_j = x_j * inv_t, over the lanes with z_j > z_cut, or
 * z_j == z_cut and j < lane_cut (the cut token's column relative to this
 * block, clamped to [0, SS_BLOCK]: ties in earlier blocks rank before it,
 * ties in later ones after it). With w non-NULL, also each lane's w and the
 * kept lanes as bits (*kept), for a draw that walks the block. One compiled
 * copy for the same reason as ss_bucket_terms: the walk must see the lanes'
 * weights as the block's mass summed them. x holds the block's logits as
 * floats, or with bf16 set as the stored bfloat16 row, widened in registers
 * (the same floats: a converted copy would be stored and reloaded, and the
 * reloads stall on store forwarding). */
/* The 8-lane group j of a block, as z = x * inv_t (*z), and its lanes ranked
 * before the cut (returned: -1 where kept): z > z_cut, or z == z_cut and the
 * column below lane_cut. Every block but the cut token's has the cut past its
 * end (lane_cut = SS_BLOCK: z >= z_cut) or before its start (0: z > z_cut),
 * one compare, the same lanes (NaN in neither). */
static inline __attribute__((always_inline)) ss_vi ss_kept_lanes_v(
    const void* x, int bf16, float inv_t, float z_cut, int32_t lane_cut, int j, ss_vf* z)
{
    ss_vf zv = (bf16 ? ss_load_bf16_v((const uint16_t*)x + j) : ss_load((const float*)x + j))
               * inv_t;
    *z = zv;
    if (lane_cut >= SS_BLOCK)
        return (ss_vi)(zv >= z_cut);
    if (lane_cut <= 0)
        return (ss_vi)(zv > z_cut);
    ss_vi lane = (ss_vi){0, 1, 2, 3, 4, 5, 6, 7} + j;
    return (ss_vi)(zv > z_cut) | ((ss_vi)(zv == z_cut) & (ss_vi)(lane < lane_cut));
}

#if defined(__AVX512F__)
/* ss_kept_lanes_v for the 16-lane group j of a block, its z given, as a mask
 * register. */
static inline __attribute__((always_inline)) __mmask16 ss_kept_lanes_w(ss_vw z, float z_cut,
                                                                      int32_t lane_cut, int j)
{
    const __m512 cut = _mm512_set1_ps(z_cut);
    if (lane_cut >= SS_BLOCK)
        return _mm512_cmp_ps_mask((__m512)z, cut, _CMP_GE_OQ);
    if (lane_cut <= 0)
        return _mm512_cmp_ps_mask((__m512)z, cut, _CMP_GT_OQ);
    __m512i lane = _mm512_add_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3,
                                                     2, 1, 0), _mm512_set1_epi32(j));
    return _mm512_cmp_ps_mask((__m512)z, cut, _CMP_GT_OQ)
           | (_mm512_cmp_ps_mask((__m512)z, cut, _CMP_EQ_OQ)
              & _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(lane_cut)));
}

static inline __attribute__((always_inline)) ss_vw ss_block_z_w(const void* x, int bf16, int j,
                                                                float inv_t)
{
    return (bf16 ? ss_load_bf16_w((const uint16_t*)x + j) : ss_load_w((const float*)x + j)) * inv_t;
}

/* 16-lane form (the row pass's width on AVX-512): the same terms and kept
 * lanes, the exp per 16-lane group that holds a kept lane, the kept lanes a
 * mask register that adds the terms and is the kept bits. */
static inline __attribute__((always_inline)) float ss_block_mass_before_at(
    const void* x, int bf16, float inv_t, float z_max, float z_cut, int32_t lane_cut, float* w,
    uint64_t* kept)
{
    __m512 acc = _mm512_setzero_ps();
    uint64_t mask = 0;
    for (int j = 0; j < SS_BLOCK; j += SS_WIDE_LANES) {
        ss_vw zv = ss_block_z_w(x, bf16, j, inv_t);
        __mmask16 keep = ss_kept_lanes_w(zv, z_cut, lane_cut, j);
        if (keep == 0)
            continue;
        ss_vw wv = ss_exp_nonpositive_w(zv - z_max);
        acc = _mm512_mask_add_ps(acc, keep, acc, (__m512)wv);
        if (w) {
            __builtin_memcpy(w + j, &wv, sizeof wv);
            mask |= (uint64_t)keep << j;
        }
    }
    if (w)
        *kept = mask;
    return ss_hsum_w((ss_vw)acc);
}
#else
static inline __attribute__((always_inline)) float ss_block_mass_before_at(
    const void* x, int bf16, float inv_t, float z_max, float z_cut, int32_t lane_cut, float* w,
    uint64_t* kept)
{
    ss_vf acc = {};
    uint64_t mask = 0;
    for (int j = 0; j < SS_BLOCK; j += SS_LANES) {
        ss_vf zv;
        ss_vi keep = ss_kept_lanes_v(x, bf16, inv_t, z_cut, lane_cut, j, &zv);
        uint64_t lanes = ss_lane_bits(keep);
        if (lanes == 0)         /* the exp only where a lane is kept (it is lane by lane) */
            continue;
        ss_vf wv = ss_exp_nonpositive_v(zv - z_max);
        acc += ss_select(keep, wv, (ss_vf){});
        if (w) {
            __builtin_memcpy(w + j, &wv, sizeof wv);
            mask |= lanes << j;
        }
    }
    if (w)
        *kept = mask;
    return ss_sum_lanes(acc);
}

#endif

/* ss_block_mass_before_at as one compiled copy (see above), for the walk of
 * the block a draw lands in (draw_before). */
__attribute__((noinline, noclone, optimize("fp-contract=off")))
static float ss_block_mass_before(const void* x, int bf16, float inv_t, float z_max,
                                  float z_cut, int32_t lane_cut, float* w, uint64_t* kept)
{
    return ss_block_mass_before_at(x, bf16, inv_t, z_max, z_cut, lane_cut, w, kept);
}

/* ss_block_mass_before from the terms the row pass kept (terms: the block's
 * SS_BLOCK values exp(z_j - block max), ss_block_max_mass's), with no exp:
 * the sum of the kept lanes' terms, and the kept lanes as bits (*kept). The
 * caller scales it by the block's exp(block max - row max), so the masses
 * before a cut are the row pass's own terms, the ones the row mass summed. */
#if defined(__AVX512F__)
/* 16 lanes at a time, as ss_block_mass_before's 16-lane form (the 8-lane
 * form below takes twice the groups, each with a lane-bits extraction). */
static inline float ss_block_terms_before(const void* x, int bf16, float inv_t,
                                          const float* terms, float z_cut, int32_t lane_cut,
                                          uint64_t* kept)
{
    __m512 acc = _mm512_setzero_ps();
    uint64_t mask = 0;
    for (int j = 0; j < SS_BLOCK; j += SS_WIDE_LANES) {
        __mmask16 keep = ss_kept_lanes_w(ss_block_z_w(x, bf16, j, inv_t), z_cut, lane_cut, j);
        acc = _mm512_mask_add_ps(acc, keep, acc, _mm512_loadu_ps(terms + j));
        mask |= (uint64_t)keep << j;
    }
    *kept = mask;
    return ss_hsum_w((ss_vw)acc);
}
#else
static inline float ss_block_terms_before(const void* x, int bf16, float inv_t,
                                          const float* terms, float z_cut, int32_t lane_cut,
                                          uint64_t* kept)
{
    ss_vf acc = {};
    uint64_t mask = 0;
    for (int j = 0; j < SS_BLOCK; j += SS_LANES) {
        ss_vf zv;
        ss_vi keep = ss_kept_lanes_v(x, bf16, inv_t, z_cut, lane_cut, j, &zv);
        acc += ss_select(keep, ss_load(terms + j), (ss_vf){});
        mask |= ss_lane_bits(keep) << j;
    }
    *kept = mask;
    return ss_sum_lanes(acc);
}
#endif

/* Each block's mass ranked before the cut (z_cut, id_cut) for blocks
 * [first, last) in one call (masses_before's pass over a row): block b's
 * SS_BLOCK logits at x + (b - first) * SS_BLOCK (floats, or with bf16 the
 * stored bfloat16s), its mass into kept[b] (0, its logits unread, when its
 * max z is below z_cut) and added to *total in block order. A block whose max
 * reaches terms_from sums the row pass's terms, scaled by block_scale[b]
 * (ss_block_terms_before); any other sums its exps (ss_block_mass_before_at).
 * The floats are a call per block's: this copy is compiled with the same
 * fp-contract=off, and a run of plain blocks in one call spares each block a
 * call, its reread and the horizontal sum's wait before the next block. */
__attribute__((noinline, noclone, optimize("fp-contract=off")))
static void ss_blocks_mass_before(const void* x, int bf16, ptrdiff_t first, ptrdiff_t last,
                                  const float* block_max, const float* block_scale,
                                  const float* terms, float terms_from, float inv_t,
                                  float z_max, float z_cut, int64_t id_cut, float* kept,
                                  double* total)
{
    double sum = *total;
    uint64_t bits;
    for (ptrdiff_t b = first; b < last; b++) {
        if (block_max[b] < z_cut) {
            kept[b] = 0.0f;
            continue;
        }
        int64_t lane_cut = id_cut - b * SS_BLOCK;
        lane_cut = lane_cut < 0 ? 0 : lane_cut > SS_BLOCK ? SS_BLOCK : lane_cut;
        ptrdiff_t offset = (b - first) * SS_BLOCK;
        const void* block = bf16 ? (const void*)((const uint16_t*)x + offset)
                                 : (const void*)((const float*)x + offset);
        kept[b] = block_max[b] >= terms_from
            ? block_scale[b] * ss_block_terms_before(block, bf16, inv_t, terms + b * SS_BLOCK,
                                                     z_cut, (int32_t)lane_cut, &bits)
            : ss_block_mass_before_at(block, bf16, inv_t, z_max, z_cut, (int32_t)lane_cut,
                                      NULL, NULL);
        sum += kept[b];
    }
    *total = sum;
}

#endif
