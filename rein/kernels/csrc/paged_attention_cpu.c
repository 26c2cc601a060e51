/* Decode attention over the paged KV cache on the CPU: float32 queries and arithmetic, the
 * cache float32, float16 or bfloat16 (kv_types.h: K and V widened to float32 as they are loaded;
 * one copy of the kernel per cache type, the type a constant in each).
 *
 * One query token per request attends to its cached context, reading K and V straight
 * from the cache blocks: no gathered copy, no padding to the longest request. Work is
 * split over requests; each reads every cached K/V row of its context once per step, for
 * all its query heads (grouped-query attention: a kv head serves its group of query heads).
 *
 * With AVX2, FMA and F16C (x86-64 since 2013) the two passes use intrinsics: scores 8 tokens at a
 * time with one combined reduction, and the value sums held in registers per query head
 * (head_dim a multiple of 8, resp. 64), in 16-float vectors under AVX-512 for narrow heads
 * (head_dim a multiple of 16, not of 64); otherwise the plain loops, vectorized by the compiler.
 * A sliding window starts a request's loops at the block holding its window's first token.
 * Measured by bench/cpu_kernels.py: a 16-bit cache took 0.57-0.65x the float32 cache's time
 * (K and V streamed from memory, half the bytes).
 *
 * Built at first use by rein/kernels/cpu_native.py (cc -O3 -march=native -fopenmp) and
 * called through ctypes; the torch reference path stands in when no compiler is there.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fast_exp.h"
#include "kv_types.h"
#include <omp.h>

#define MAX_HEADS 256
#define MAX_HEAD_DIM 256

/* Cache rows are requested this many tokens ahead of their use, into L2 (prefetcht1): the
 * hardware prefetcher alone kept a step's K/V streaming at about 6 GB/s (each block a short run
 * at a scattered address, each row read a kv head's slice at a time); with these a layer took
 * 0.62-0.68x the time (bench/cpu_kernels.py --parts decode, SmolLM2 shapes, K/V from memory). */
#define PREFETCH_TOKENS 32
#define PREFETCH_V_TOKENS 16

static inline void prefetch_row(const char *row_start, int64_t bytes) {
    for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(row_start + c, 0, 2);
}

/* Inlined into each cache type's copy of the kernel, where `type` is a constant. */
#define SPECIALIZED static inline __attribute__((always_inline))

/* Walks a request's cache slots token by token without dividing by the block size: a 64-bit
 * division per token (t / block_size, t % block_size) is dear beside a small head's scores (the
 * tiny test model's 16-float heads at batch 256: 13% of the kernel's time on an AVX2 machine). */
typedef struct {
    const int32_t *table;
    int64_t block_size, block, offset;
} slot_cursor;

static inline slot_cursor cursor_at(const int32_t *table, int64_t block_size, int64_t t) {
    slot_cursor c = {table, block_size, t / block_size, t % block_size};
    return c;
}

/* The slot of the cursor's token; the cursor moves on to the next token. */
static inline int64_t cursor_next(slot_cursor *c) {
    const int64_t slot = (int64_t)c->table[c->block] * c->block_size + c->offset;
    if (++c->offset == c->block_size) c->offset = 0, c->block++;
    return slot;
}

/* The cursor moved on by n tokens, no slot read (past the context's end, say). */
static inline void cursor_skip(slot_cursor *c, int64_t n) {
    c->offset += n;
    while (c->offset >= c->block_size) c->offset -= c->block_size, c->block++;
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define DECODE_AVX2 1

/* The sums of a0..a7's lanes, as one vector: [sum(a0), ..., sum(a7)]. */
static inline __m256 sum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3,
                          __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
    const __m256 h0123 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 h4567 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20), _mm256_permute2f128_ps(h0123, h4567, 0x31));
}

/* Scores of 8 tokens at a time: each query head's dot products with 8 K rows accumulate in 8
 * vectors, reduced together (9 instructions for 8 dots, where one dot's own reduction costs
 * about 5). The last group of a context that is no multiple of 8 repeats its last row in the
 * missing ones and keeps only its own scores: a scalar loop over those few tokens cost about as
 * much as the rest of a short context (perf, the tiny test model at batch 256). */
SPECIALIZED void scores8_avx2(const float *q, const char *const kr[8], int64_t num_heads, int64_t group,
                              int64_t head_dim, __m256 vscale, float *s, int64_t stride, int64_t n, int type) {
    for (int64_t hq = 0; hq < num_heads; hq++) {
        const float *qh = q + hq * head_dim;
        const int64_t off = (hq / group) * head_dim;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        for (int64_t d = 0; d < head_dim; d += 8) {
            const __m256 qv = _mm256_loadu_ps(qh + d);
            a0 = _mm256_fmadd_ps(qv, kv_load8(kr[0], off + d, type), a0);
            a1 = _mm256_fmadd_ps(qv, kv_load8(kr[1], off + d, type), a1);
            a2 = _mm256_fmadd_ps(qv, kv_load8(kr[2], off + d, type), a2);
            a3 = _mm256_fmadd_ps(qv, kv_load8(kr[3], off + d, type), a3);
            a4 = _mm256_fmadd_ps(qv, kv_load8(kr[4], off + d, type), a4);
            a5 = _mm256_fmadd_ps(qv, kv_load8(kr[5], off + d, type), a5);
            a6 = _mm256_fmadd_ps(qv, kv_load8(kr[6], off + d, type), a6);
            a7 = _mm256_fmadd_ps(qv, kv_load8(kr[7], off + d, type), a7);
        }
        const __m256 dots = _mm256_mul_ps(sum8(a0, a1, a2, a3, a4, a5, a6, a7), vscale);
        if (n == 8) {
            _mm256_storeu_ps(s + hq * stride, dots);
        } else {   /* the head's row of scores ends after n: the next head's follows */
            float tail[8];
            _mm256_storeu_ps(tail, dots);
            memcpy(s + hq * stride, tail, n * sizeof(float));
        }
    }
}

/* All `len` scores of a request, 8 tokens at a time, K rows prefetched PREFETCH_TOKENS ahead. */
SPECIALIZED void scores_avx2(const float *q, const char *k_cache, const int32_t *table, int64_t block_size,
                             int64_t row, int64_t len, int64_t num_heads, int64_t group, int64_t head_dim,
                             float scale, float *s, int type) {
    const int64_t row_bytes = row * kv_size(type);
    const __m256 vscale = _mm256_set1_ps(scale);
    slot_cursor at = cursor_at(table, block_size, 0), ahead = cursor_at(table, block_size, PREFETCH_TOKENS);
    const char *kr[8];
    int64_t t = 0;
    for (; t + 8 <= len; t += 8) {
        for (int j = 0; j < 8; j++) kr[j] = k_cache + cursor_next(&at) * row_bytes;
        if (t + PREFETCH_TOKENS + 8 <= len)
            for (int j = 0; j < 8; j++) prefetch_row(k_cache + cursor_next(&ahead) * row_bytes, row_bytes);
        else
            cursor_skip(&ahead, 8);
        scores8_avx2(q, kr, num_heads, group, head_dim, vscale, s + t, len, 8, type);
    }
    if (t < len) {
        const int64_t n = len - t;
        for (int j = 0; j < 8; j++) kr[j] = j < n ? k_cache + cursor_next(&at) * row_bytes : kr[n - 1];
        scores8_avx2(q, kr, num_heads, group, head_dim, vscale, s + t, len, n, type);
    }
}

/* out_hq = sum_t p_hq[t] v_t / sum_hq for head_dim a multiple of 64: one query head and 64
 * columns at a time, their sums held in 8 registers over the whole context (no load and
 * store of the accumulator per token). */
SPECIALIZED void values_avx2(const char *v_cache, const int32_t *table, int64_t block_size, int64_t row,
                             int64_t len, int64_t num_heads, int64_t group, int64_t head_dim, const float *s,
                             const float *inv_sum, float *o, int type) {
    const int64_t esize = kv_size(type);
    slot_cursor ahead = cursor_at(table, block_size, PREFETCH_V_TOKENS);
    for (int64_t hq = 0; hq < num_heads; hq++) {
        const float *p = s + hq * len;
        for (int64_t c = (hq / group) * head_dim, end = c + head_dim, oc = hq * head_dim; c < end; c += 64, oc += 64) {
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
            for (int64_t t0 = 0, blk = 0; t0 < len; t0 += block_size, blk++) {
                const char *v = v_cache + ((int64_t)table[blk] * block_size * row + c) * esize;
                const int64_t n = len - t0 < block_size ? len - t0 : block_size;
                for (int64_t j = 0; j < n; j++, v += row * esize) {
                    /* the first head's pass brings whole V rows into L2 for the other kv heads' passes */
                    if (hq == 0 && c == 0 && t0 + j + PREFETCH_V_TOKENS < len)
                        prefetch_row(v_cache + cursor_next(&ahead) * row * esize, row * esize);
                    const __m256 pv = _mm256_set1_ps(p[t0 + j]);
                    a0 = _mm256_fmadd_ps(pv, kv_load8(v, 0, type), a0);
                    a1 = _mm256_fmadd_ps(pv, kv_load8(v, 8, type), a1);
                    a2 = _mm256_fmadd_ps(pv, kv_load8(v, 16, type), a2);
                    a3 = _mm256_fmadd_ps(pv, kv_load8(v, 24, type), a3);
                    a4 = _mm256_fmadd_ps(pv, kv_load8(v, 32, type), a4);
                    a5 = _mm256_fmadd_ps(pv, kv_load8(v, 40, type), a5);
                    a6 = _mm256_fmadd_ps(pv, kv_load8(v, 48, type), a6);
                    a7 = _mm256_fmadd_ps(pv, kv_load8(v, 56, type), a7);
                }
            }
            const __m256 inv = _mm256_set1_ps(inv_sum[hq]);
            float *out = o + oc;
            _mm256_storeu_ps(out, _mm256_mul_ps(a0, inv));
            _mm256_storeu_ps(out + 8, _mm256_mul_ps(a1, inv));
            _mm256_storeu_ps(out + 16, _mm256_mul_ps(a2, inv));
            _mm256_storeu_ps(out + 24, _mm256_mul_ps(a3, inv));
            _mm256_storeu_ps(out + 32, _mm256_mul_ps(a4, inv));
            _mm256_storeu_ps(out + 40, _mm256_mul_ps(a5, inv));
            _mm256_storeu_ps(out + 48, _mm256_mul_ps(a6, inv));
            _mm256_storeu_ps(out + 56, _mm256_mul_ps(a7, inv));
        }
    }
}

/* The same for head_dim a multiple of 8 but not of 64 (16, 32, 80, 96, ...): the output's
 * [heads x head_dim] floats 64 at a time, each of its 8 vectors with its own query head's
 * probabilities and its own slice of the V row, all held in registers over the context. The
 * plain loop it replaces re-read and re-stored every head's output per token. */
SPECIALIZED void values_avx2_narrow(const char *v_cache, const int32_t *table, int64_t block_size, int64_t row,
                                    int64_t len, int64_t num_heads, int64_t group, int64_t head_dim,
                                    const float *s, const float *inv_sum, float *o, int type) {
    const int64_t esize = kv_size(type), total = num_heads * head_dim;
    for (int64_t c0 = 0; c0 < total; c0 += 64) {
        const int64_t n = total - c0 < 64 ? (total - c0) / 8 : 8;
        const float *p[8];
        int64_t col[8];
        /* vectors past n repeat the last one: summed like the others (no branch per vector and
         * token), never stored */
        for (int64_t i = 0; i < 8; i++) {
            const int64_t c = c0 + 8 * (i < n ? i : n - 1), hq = c / head_dim;
            p[i] = s + hq * len;
            col[i] = (hq / group) * head_dim + c % head_dim;
        }
        __m256 a[8];
        for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
        slot_cursor at = cursor_at(table, block_size, 0), ahead = cursor_at(table, block_size, PREFETCH_V_TOKENS);
        for (int64_t t = 0; t < len; t++) {
            const char *v = v_cache + cursor_next(&at) * row * esize;
            /* the first pass over the row brings V rows in ahead of use (without it, perf put
             * about a third of the kernel's samples on the first loads of V rows' cache lines) */
            if (c0 == 0 && t + PREFETCH_V_TOKENS < len)
                prefetch_row(v_cache + cursor_next(&ahead) * row * esize, row * esize);
            #pragma GCC unroll 8
            for (int i = 0; i < 8; i++)
                a[i] = _mm256_fmadd_ps(_mm256_set1_ps(p[i][t]), kv_load8(v, col[i], type), a[i]);
        }
        for (int64_t i = 0; i < n; i++) {
            const int64_t c = c0 + 8 * i;
            _mm256_storeu_ps(o + c, _mm256_mul_ps(a[i], _mm256_set1_ps(inv_sum[c / head_dim])));
        }
    }
}
#endif

#if defined(__AVX512F__)
#define DECODE_AVX512 1

/* One pass of values_avx512_narrow: a[i] = sum_t p[i][t] * V_t[col[i] .. col[i] + 16), for
 * i < nv (4 or 8, a constant once inlined: no loop or branch per vector and token). */
SPECIALIZED void values_pass_avx512(const char *v_cache, const int32_t *table, int64_t block_size,
                                    int64_t row_bytes, int64_t len, const float *const p[8], const int64_t col[8],
                                    __m512 a[8], int nv, int prefetch, int type) {
    for (int i = 0; i < nv; i++) a[i] = _mm512_setzero_ps();
    slot_cursor at = cursor_at(table, block_size, 0), ahead = cursor_at(table, block_size, PREFETCH_V_TOKENS);
    for (int64_t t = 0; t < len; t++) {
        const char *v = v_cache + cursor_next(&at) * row_bytes;
        if (prefetch && t + PREFETCH_V_TOKENS < len)
            prefetch_row(v_cache + cursor_next(&ahead) * row_bytes, row_bytes);
        #pragma GCC unroll 8
        for (int i = 0; i < nv; i++)
            a[i] = _mm512_fmadd_ps(_mm512_set1_ps(p[i][t]), kv_load16(v, col[i], type), a[i]);
    }
}

/* values_avx2_narrow with 16-float vectors, for head_dim a multiple of 16 but not of 64 (16,
 * 32, 48, 80, 96, ...): half the broadcasts, loads and FMA instructions a token. 128 output
 * floats a pass, or 64 where no more are left (the tiny test model's 4 heads of 16: one pass
 * of 4 vectors). */
SPECIALIZED void values_avx512_narrow(const char *v_cache, const int32_t *table, int64_t block_size, int64_t row,
                                      int64_t len, int64_t num_heads, int64_t group, int64_t head_dim,
                                      const float *s, const float *inv_sum, float *o, int type) {
    const int64_t row_bytes = row * kv_size(type), total = num_heads * head_dim;
    for (int64_t c0 = 0; c0 < total; c0 += 128) {
        const int64_t n = total - c0 < 128 ? (total - c0) / 16 : 8;
        const float *p[8];
        int64_t col[8];
        for (int64_t i = 0; i < 8; i++) {   /* past n: the last one again (summed, not stored) */
            const int64_t c = c0 + 16 * (i < n ? i : n - 1), hq = c / head_dim;
            p[i] = s + hq * len;
            col[i] = (hq / group) * head_dim + c % head_dim;
        }
        __m512 a[8];
        if (n <= 4)
            values_pass_avx512(v_cache, table, block_size, row_bytes, len, p, col, a, 4, c0 == 0, type);
        else
            values_pass_avx512(v_cache, table, block_size, row_bytes, len, p, col, a, 8, c0 == 0, type);
        for (int64_t i = 0; i < n; i++) {
            const int64_t c = c0 + 16 * i;
            _mm512_storeu_ps(o + c, _mm512_mul_ps(a[i], _mm512_set1_ps(inv_sum[c / head_dim])));
        }
    }
}
#endif

/* One request's attention: its query q [Hq, D] against its `len` cached tokens (table, from the
 * window's first block; the first `skip` of them before the window) into o [Hq, D], with scores
 * in s (Hq * len floats). */
SPECIALIZED void decode_request(const float *q, const char *k_cache, const char *v_cache, const int32_t *table,
                                int64_t len, int64_t skip, float *o, float *s, int64_t num_heads, int64_t group,
                                int64_t head_dim, int64_t row, int64_t block_size, float scale, int type) {
    const int64_t row_bytes = row * kv_size(type);
    /* scores s[hq * len + t] = scale * q_hq . k_t[kv head of hq] */
    int64_t t = 0;
#if DECODE_AVX2
    if (head_dim % 8 == 0) {
        scores_avx2(q, k_cache, table, block_size, row, len, num_heads, group, head_dim, scale, s, type);
        t = len;
    }
#endif
    for (slot_cursor at = cursor_at(table, block_size, t); t < len; t++) {
        const char *k = k_cache + cursor_next(&at) * row_bytes;
        for (int64_t hq = 0; hq < num_heads; hq++) {
            const float *qh = q + hq * head_dim;
            const int64_t off = (hq / group) * head_dim;
            float dot = 0.0f;
            #pragma omp simd reduction(+:dot)
            for (int64_t d = 0; d < head_dim; d++) dot += qh[d] * kv_at(k, off + d, type);
            s[hq * len + t] = dot * scale;
        }
    }
    /* softmax over t, per query head */
    float inv_sum[MAX_HEADS];
    for (int64_t hq = 0; hq < num_heads; hq++) {
        float *sh = s + hq * len;
        float m = -INFINITY;
        #pragma omp simd reduction(max:m)
        for (int64_t t = skip; t < len; t++) m = sh[t] > m ? sh[t] : m;
        float sum = 0.0f;
        #pragma omp simd reduction(+:sum)
        for (int64_t t = skip; t < len; t++) {
            float e = fast_expf(sh[t] - m);
            sh[t] = e;
            sum += e;
        }
        for (int64_t t = 0; t < skip; t++) sh[t] = 0.0f;
        inv_sum[hq] = 1.0f / sum;
    }
    /* out_hq = sum_t p_hq[t] v_t[kv head of hq] / sum_hq, accumulated in out itself */
#if DECODE_AVX2
    if (head_dim % 64 == 0) {
        values_avx2(v_cache, table, block_size, row, len, num_heads, group, head_dim, s, inv_sum, o, type);
        return;
    }
#if DECODE_AVX512
    if (head_dim % 16 == 0) {
        values_avx512_narrow(v_cache, table, block_size, row, len, num_heads, group, head_dim, s, inv_sum, o, type);
        return;
    }
#endif
    if (head_dim % 8 == 0) {
        values_avx2_narrow(v_cache, table, block_size, row, len, num_heads, group, head_dim, s, inv_sum, o, type);
        return;
    }
#endif
    memset(o, 0, sizeof(float) * num_heads * head_dim);
    slot_cursor at = cursor_at(table, block_size, 0);
    for (int64_t t = 0; t < len; t++) {
        const char *v = v_cache + cursor_next(&at) * row_bytes;
        for (int64_t hq = 0; hq < num_heads; hq++) {
            const float p = s[hq * len + t];
            const int64_t off = (hq / group) * head_dim;
            float *a = o + hq * head_dim;
            #pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) a[d] += p * kv_at(v, off + d, type);
        }
    }
    for (int64_t hq = 0; hq < num_heads; hq++)
        for (int64_t d = 0; d < head_dim; d++) o[hq * head_dim + d] *= inv_sum[hq];
}

/* query [B, Hq, D] float32; k_cache, v_cache [num_blocks, block_size, Hkv, D] of kv_type (enum
 * kv_type); block_tables [B, bt_stride] (int32); context_lens [B] (int32, >= 1); out [B, Hq, D]
 * float32. scratch holds num_threads * Hq * max_len floats. window > 0: the query (position
 * len - 1) sees only its last `window` tokens, and table entries before the block holding the
 * first of them are never read (freed blocks, maybe -1); window <= 0: the whole context.
 * Returns 0, or -1 when the shapes or the cache type are outside what this kernel handles.
 *
 * One request per iteration, all its heads together: a cache slot's K (or V) row of all kv
 * heads is contiguous, so each row is streamed once, front to back, which the hardware
 * prefetcher follows far better than one head's slice of every row. */
int paged_decode_attention_f32(
    const float *query, const void *k_cache, const void *v_cache, int kv_type,
    const int32_t *block_tables, int64_t bt_stride, const int32_t *context_lens,
    float *out, float *scratch, int64_t max_len,
    int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, float scale, int64_t window, int num_threads)
{
    const int64_t group = num_heads / num_kv_heads;
    if (num_heads > MAX_HEADS || head_dim > MAX_HEAD_DIM || group * num_kv_heads != num_heads
        || (kv_type != KV_F32 && kv_type != KV_F16 && kv_type != KV_BF16))
        return -1;
    const int64_t row = num_kv_heads * head_dim;          /* elements per cache slot */

    #pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) if (num_threads > 1)
    for (int64_t b = 0; b < batch; b++) {
        /* A window starts the request at the block holding its first visible token: `len` and
         * `table` then count from that block, and the `skip` tokens of it before the window
         * are scored (whole-block loops stay as they are) but get probability 0. */
        const int64_t full_len = context_lens[b];
        const int64_t window_start = window > 0 && full_len > window ? full_len - window : 0;
        const int64_t first_block = window_start / block_size;
        const int64_t len = full_len - first_block * block_size;
        const int64_t skip = window_start - first_block * block_size;
        const int32_t *table = block_tables + b * bt_stride + first_block;
        const float *q = query + b * num_heads * head_dim;
        float *o = out + b * num_heads * head_dim;
        float *s = scratch + (int64_t)omp_get_thread_num() * num_heads * max_len;
        /* the switch here, inside the parallel loop's body (which OpenMP outlines before
         * inlining), gives each cache type a copy with its loads fixed */
        switch (kv_type) {
        case KV_F16:
            decode_request(q, k_cache, v_cache, table, len, skip, o, s, num_heads, group, head_dim, row,
                           block_size, scale, KV_F16);
            break;
        case KV_BF16:
            decode_request(q, k_cache, v_cache, table, len, skip, o, s, num_heads, group, head_dim, row,
                           block_size, scale, KV_BF16);
            break;
        default:
            decode_request(q, k_cache, v_cache, table, len, skip, o, s, num_heads, group, head_dim, row,
                           block_size, scale, KV_F32);
        }
    }
    return 0;
}
