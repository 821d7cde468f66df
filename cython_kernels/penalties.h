/* One override's adjustment of a logit (penalties.pxd, adjusted_logit),
 * without branches: a long history's overrides alternate between counted and
 * not, positive and negative logits, so branches on them are often
 * mispredicted, and computing every case costs less.
 */
#ifndef SIMPLE_SAMPLER_PENALTIES_H
#define SIMPLE_SAMPLER_PENALTIES_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* first when take_first, else second, chosen by bit masks (never a jump). */
static inline float ss_select_float(int take_first, float first, float second)
{
    uint32_t a, b;
    uint32_t mask = 0u - (uint32_t)(take_first != 0);
    memcpy(&a, &first, sizeof a);
    memcpy(&b, &second, sizeof b);
    a = (a & mask) | (b & ~mask);
    memcpy(&first, &a, sizeof a);
    return first;
}

/* vLLM's order: bias added; banned -> -inf; seen (prompt or output) and a
 * repetition penalty: divided when positive, multiplied otherwise (a penalty
 * of 1 does both exactly); counted in the output: less frequency x count and
 * presence. Each case is the operation it was as a branch: the same floats,
 * the frequency term included (x - frequency * count contracts to one fused
 * multiply-add where the target has one, as it did before; torch's two
 * roundings may differ from it in the last bit). */
static inline float ss_adjusted_logit(float logit, float bias, int seen, int banned,
                                      int32_t count, float repetition, float frequency,
                                      float presence)
{
    float x = logit + bias;
    float repeated = ss_select_float(x > 0.0f, x / repetition, x * repetition);
    x = ss_select_float(seen, repeated, x);
    float counted = x - frequency * count - presence;
    x = ss_select_float(count > 0, counted, x);
    return ss_select_float(banned, -INFINITY, x);
}

#endif
