/* The KV cache element types rein's CPU attention kernels read, and their conversion to
 * float32: the kernels compute in float32 whatever the cache holds, widening K and V as they
 * load them (a 16-bit cache halves the memory a context takes and the bytes a decode step
 * streams; llama.cpp's CPU cache is float16 by default).
 *
 * float16 -> float32 is vcvtph2ps (F16C, in every AVX2 CPU; AVX-512F for 16 lanes);
 * bfloat16 -> float32 is the 16 bits shifted into a float32's top half, exact. Without F16C the
 * plain C build widens _Float16 through the compiler (libgcc's conversion on x86-64).
 *
 * The codes are rein.kernels.cpu_native's KV_TYPES.
 */
#ifndef REIN_KV_TYPES_H
#define REIN_KV_TYPES_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) || defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

enum kv_type { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };

static inline int64_t kv_size(int type) { return type == KV_F32 ? 4 : 2; }

/* Element i of a cache row starting at `base`, as float32. */
static inline float kv_at(const void *base, int64_t i, int type) {
    if (type == KV_F32)
        return ((const float *)base)[i];
    const uint16_t bits = ((const uint16_t *)base)[i];
    if (type == KV_BF16) {
        const uint32_t wide = (uint32_t)bits << 16;
        float f;
        memcpy(&f, &wide, sizeof f);
        return f;
    }
    _Float16 h;
    memcpy(&h, &bits, sizeof h);
    return (float)h;
}

#if defined(__AVX2__) && defined(__F16C__)
/* Elements i .. i+7 as float32. */
static inline __m256 kv_load8(const void *base, int64_t i, int type) {
    if (type == KV_F32)
        return _mm256_loadu_ps((const float *)base + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
    if (type == KV_F16)
        return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

#if defined(__AVX512F__)
/* Elements i .. i+15 as float32. */
static inline __m512 kv_load16(const void *base, int64_t i, int type) {
    if (type == KV_F32)
        return _mm512_loadu_ps((const float *)base + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i));
    if (type == KV_F16)
        return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

/* dst[0..n) = elements 0..n) of src as float32. */
static inline void kv_to_f32(const void *src, int type, float *dst, int64_t n) {
    int64_t i = 0;
    if (type == KV_F32) {
        memcpy(dst, src, sizeof(float) * n);
        return;
    }
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, kv_load16(src, i, type));
#elif defined(__AVX2__) && defined(__F16C__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, kv_load8(src, i, type));
#endif
    for (; i < n; i++) dst[i] = kv_at(src, i, type);
}

#endif
