/* Decode attention over the paged KV cache on the CPU, float32.
 *
 * One query token per request attends to its cached context, reading K and V straight
 * from the cache blocks: no gathered copy, no padding to the longest request. Work is
 * split over (request, kv head) pairs; each pair handles its group of query heads
 * (grouped-query attention), so every cached K/V row is read once per step.
 *
 * Built at first use by rein/kernels/cpu_native.py (cc -O3 -march=native -fopenmp) and
 * called through ctypes; the torch reference path stands in when no compiler is there.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256

/* exp(x) for x <= 0 (scores minus their max), vectorizable: 2^n * p(r), r in [-ln2/2, ln2/2],
 * a degree-6 Taylor polynomial; relative error under 2e-7 (float32 rounding is 6e-8). */
static inline float exp_nonpositive(float x) {
    if (x < -87.0f) x = -87.0f;
    const float log2e = 1.44269504088896341f;
    const float ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
    float n = floorf(x * log2e + 0.5f);
    float r = x - n * ln2_hi - n * ln2_lo;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { int32_t i; float f; } two_n;
    two_n.i = ((int32_t)n + 127) << 23;
    return p * two_n.f;
}

/* query [B, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_tables [B, bt_stride]
 * (int32); context_lens [B] (int32, >= 1); out [B, Hq, D]. scratch holds num_threads * G * max_len
 * floats. Returns 0, or -1 when the shapes are outside what this kernel handles. */
int paged_decode_attention_f32(
    const float *query, const float *k_cache, const float *v_cache,
    const int32_t *block_tables, int64_t bt_stride, const int32_t *context_lens,
    float *out, float *scratch, int64_t max_len,
    int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, float scale, int num_threads)
{
    const int64_t group = num_heads / num_kv_heads;
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM || group * num_kv_heads != num_heads)
        return -1;
    const int64_t row = num_kv_heads * head_dim;          /* floats per cache slot */
    const int64_t pairs = batch * num_kv_heads;

    #pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) if (num_threads > 1)
    for (int64_t pair = 0; pair < pairs; pair++) {
        const int64_t b = pair / num_kv_heads, h = pair % num_kv_heads;
        const int64_t len = context_lens[b];
        const int32_t *table = block_tables + b * bt_stride;
        const float *q = query + (b * num_heads + h * group) * head_dim;
        float *s = scratch + (int64_t)omp_get_thread_num() * group * max_len;

        /* scores s[g * len + t] = scale * q_g . k_t */
        for (int64_t t = 0; t < len; t++) {
            const float *k = k_cache + ((int64_t)table[t / block_size] * block_size + t % block_size) * row
                             + h * head_dim;
            for (int64_t g = 0; g < group; g++) {
                const float *qg = q + g * head_dim;
                float dot = 0.0f;
                #pragma omp simd reduction(+:dot)
                for (int64_t d = 0; d < head_dim; d++) dot += qg[d] * k[d];
                s[g * len + t] = dot * scale;
            }
        }
        /* softmax over t, per query head */
        float inv_sum[MAX_GROUP];
        for (int64_t g = 0; g < group; g++) {
            float *sg = s + g * len;
            float m = -INFINITY;
            #pragma omp simd reduction(max:m)
            for (int64_t t = 0; t < len; t++) m = sg[t] > m ? sg[t] : m;
            float sum = 0.0f;
            #pragma omp simd reduction(+:sum)
            for (int64_t t = 0; t < len; t++) {
                float e = exp_nonpositive(sg[t] - m);
                sg[t] = e;
                sum += e;
            }
            inv_sum[g] = 1.0f / sum;
        }
        /* out_g = sum_t p_g[t] v_t / sum_g */
        float acc[MAX_GROUP * MAX_HEAD_DIM];
        memset(acc, 0, sizeof(float) * group * head_dim);
        for (int64_t t = 0; t < len; t++) {
            const float *v = v_cache + ((int64_t)table[t / block_size] * block_size + t % block_size) * row
                             + h * head_dim;
            for (int64_t g = 0; g < group; g++) {
                const float p = s[g * len + t];
                float *a = acc + g * head_dim;
                #pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) a[d] += p * v[d];
            }
        }
        float *o = out + (b * num_heads + h * group) * head_dim;
        for (int64_t g = 0; g < group; g++)
            for (int64_t d = 0; d < head_dim; d++) o[g * head_dim + d] = acc[g * head_dim + d] * inv_sum[g];
    }
    return 0;
}
