/* Decode attention over the paged KV cache on the CPU, float32.
 *
 * One query token per request attends to its cached context, reading K and V straight
 * from the cache blocks: no gathered copy, no padding to the longest request. Work is
 * split over requests; each reads every cached K/V row of its context once per step, for
 * all its query heads (grouped-query attention: a kv head serves its group of query heads).
 *
 * Built at first use by rein/kernels/cpu_native.py (cc -O3 -march=native -fopenmp) and
 * called through ctypes; the torch reference path stands in when no compiler is there.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#define MAX_HEADS 256
#define MAX_HEAD_DIM 256

/* exp(x) for x <= 0 (scores minus their max), vectorizable: 2^n * p(r), r in [-ln2/2, ln2/2],
 * a degree-6 Taylor polynomial; relative error under 2e-7 (float32 rounding is 6e-8). */
static inline float exp_nonpositive(float x) {
    if (x < -87.0f) x = -87.0f;
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

/* query [B, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_tables [B, bt_stride]
 * (int32); context_lens [B] (int32, >= 1); out [B, Hq, D]. scratch holds num_threads * Hq * max_len
 * floats. Returns 0, or -1 when the shapes are outside what this kernel handles.
 *
 * One request per iteration, all its heads together: a cache slot's K (or V) row of all kv
 * heads is contiguous, so each row is streamed once, front to back, which the hardware
 * prefetcher follows far better than one head's slice of every row. */
int paged_decode_attention_f32(
    const float *query, const float *k_cache, const float *v_cache,
    const int32_t *block_tables, int64_t bt_stride, const int32_t *context_lens,
    float *out, float *scratch, int64_t max_len,
    int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, float scale, int num_threads)
{
    const int64_t group = num_heads / num_kv_heads;
    if (num_heads > MAX_HEADS || head_dim > MAX_HEAD_DIM || group * num_kv_heads != num_heads)
        return -1;
    const int64_t row = num_kv_heads * head_dim;          /* floats per cache slot */

    #pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) if (num_threads > 1)
    for (int64_t b = 0; b < batch; b++) {
        const int64_t len = context_lens[b];
        const int32_t *table = block_tables + b * bt_stride;
        const float *q = query + b * num_heads * head_dim;
        float *s = scratch + (int64_t)omp_get_thread_num() * num_heads * max_len;

        /* scores s[hq * len + t] = scale * q_hq . k_t[kv head of hq] */
        for (int64_t t = 0; t < len; t++) {
            const float *k = k_cache + ((int64_t)table[t / block_size] * block_size + t % block_size) * row;
            for (int64_t hq = 0; hq < num_heads; hq++) {
                const float *qh = q + hq * head_dim, *kh = k + (hq / group) * head_dim;
                float dot = 0.0f;
                #pragma omp simd reduction(+:dot)
                for (int64_t d = 0; d < head_dim; d++) dot += qh[d] * kh[d];
                s[hq * len + t] = dot * scale;
            }
        }
        /* softmax over t, per query head */
        float inv_sum[MAX_HEADS];
        for (int64_t hq = 0; hq < num_heads; hq++) {
            float *sh = s + hq * len;
            float m = -INFINITY;
            #pragma omp simd reduction(max:m)
            for (int64_t t = 0; t < len; t++) m = sh[t] > m ? sh[t] : m;
            float sum = 0.0f;
            #pragma omp simd reduction(+:sum)
            for (int64_t t = 0; t < len; t++) {
                float e = exp_nonpositive(sh[t] - m);
                sh[t] = e;
                sum += e;
            }
            inv_sum[hq] = 1.0f / sum;
        }
        /* out_hq = sum_t p_hq[t] v_t[kv head of hq] / sum_hq, accumulated in out itself */
        float *o = out + b * num_heads * head_dim;
        memset(o, 0, sizeof(float) * num_heads * head_dim);
        for (int64_t t = 0; t < len; t++) {
            const float *v = v_cache + ((int64_t)table[t / block_size] * block_size + t % block_size) * row;
            for (int64_t hq = 0; hq < num_heads; hq++) {
                const float p = s[hq * len + t];
                const float *vh = v + (hq / group) * head_dim;
                float *a = o + hq * head_dim;
                #pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) a[d] += p * vh[d];
            }
        }
        for (int64_t hq = 0; hq < num_heads; hq++)
            for (int64_t d = 0; d < head_dim; d++) o[hq * head_dim + d] *= inv_sum[hq];
    }
    return 0;
}
