/* exp for float32 that the compiler vectorizes, shared by rein's CPU kernels: 2^n * p(r) with
 * r in [-ln2/2, ln2/2] and p a degree-6 Taylor polynomial; relative error under 2e-7 (float32
 * rounding is 6e-8). Inputs are clamped to [-87, 88], where float32's exp stays normal and finite.
 */
#ifndef REIN_FAST_EXP_H
#define REIN_FAST_EXP_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float fast_expf(float x) {
    if (x < -87.0f) x = -87.0f;
    if (x > 88.0f) x = 88.0f;
    const float log2e = 1.44269504088896341f;
    const float ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
    float n = rintf(x * log2e);   /* nearest; rintf vectorizes (floorf did not, with gcc 12) */
    float r = x - n * ln2_hi - n * ln2_lo;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;   /* 2^n as a float's bits */
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);            /* a bit cast the vectorizer understands */
    return p * two_n;
}

#endif
