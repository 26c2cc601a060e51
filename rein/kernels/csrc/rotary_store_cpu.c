/* Rotary embedding and the KV cache store of one attention layer in one call, on the CPU:
 * q and k rotated in place (rotate-half layout, as Hugging Face Llama), then the rotated k and
 * v written into the paged cache at their slots. In torch that is a rotary call per tensor (or
 * six ops each) and an index_put per cache with its checks and conversions: at batch 1 about
 * 25 us of a layer's overhead, 30-40 times a step, where the work itself is a few hundred floats.
 *
 * The rotation is written as rotary_inplace_f32's (elementwise_cpu.c), so a rotated row is the
 * same floats either way. The cache is float32, float16 or bfloat16 (kv_types.h codes); narrowed
 * with round-to-nearest-even as torch's .to() does. Built and loaded with the other kernels by
 * rein/kernels/cpu_native.py.
 */
#include <stdint.h>
#include <string.h>

#include "kv_types.h"

/* Rows too few to be worth waking a thread team for (elements rotated). */
#define PARALLEL_MIN_ELEMENTS 32768

/* Rotate `heads` contiguous heads of one token in place. */
static inline void rotate_heads(float *x, int64_t heads, int64_t head_dim, const float *c, const float *s) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *x1 = x + h * head_dim, *x2 = x1 + half;
        #pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            const float a = x1[i], b = x2[i];
            x1[i] = a * c[i] - b * s[i];
            x2[i] = b * c[i] + a * s[i];
        }
    }
}

static inline uint16_t to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u)   /* NaN: torch's canonical bfloat16 NaN */
        return 0x7FC0;
    bits += 0x7FFFu + ((bits >> 16) & 1u);    /* round to nearest, ties to even */
    return (uint16_t)(bits >> 16);
}

/* n floats into a cache row of `type`. */
static inline void store_row(void *dst, const float *src, int64_t n, int type) {
    if (type == KV_F32) {
        memcpy(dst, src, sizeof(float) * n);
    } else if (type == KV_BF16) {
        uint16_t *out = (uint16_t *)dst;
        for (int64_t i = 0; i < n; i++) out[i] = to_bf16(src[i]);
    } else {
        _Float16 *out = (_Float16 *)dst;
        for (int64_t i = 0; i < n; i++) out[i] = (_Float16)src[i];
    }
}

/* q [tokens, q_heads, head_dim] and k [tokens, kv_heads, head_dim] rotated in place with cos,
 * sin [tokens, head_dim / 2]; then k and v [tokens, kv_heads, head_dim] stored at cache slot
 * slots[t] (a cache [slots, kv_heads, head_dim] of `kv_type`; a negative slot stores nothing).
 * Each tensor's token rows are `*_stride` floats apart, its heads contiguous within a row. */
void rotary_store_kv_f32(float *q, int64_t q_stride, int64_t q_heads, float *k, int64_t k_stride,
                         const float *v, int64_t v_stride, int64_t kv_heads, int64_t head_dim, int64_t tokens,
                         const float *cos, const float *sin, void *k_cache, void *v_cache, int kv_type,
                         const int64_t *slots, int num_threads) {
    const int64_t half = head_dim / 2, row = kv_heads * head_dim, row_bytes = row * kv_size(kv_type);
    #pragma omp parallel for num_threads(num_threads) \
        if (num_threads > 1 && tokens * (q_heads + kv_heads) * head_dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * half, *s = sin + t * half;
        float *kt = k + t * k_stride;
        rotate_heads(q + t * q_stride, q_heads, head_dim, c, s);
        rotate_heads(kt, kv_heads, head_dim, c, s);
        if (slots[t] < 0)
            continue;
        store_row((char *)k_cache + slots[t] * row_bytes, kt, row, kv_type);
        store_row((char *)v_cache + slots[t] * row_bytes, v + t * v_stride, row, kv_type);
    }
}
