/* Prefill attention over the paged KV cache on the CPU: each request's chunk of query tokens
 * attends causally to its cached context (prefix and chunk), flash-attention style. Queries,
 * outputs and arithmetic are float32; the cache float32, float16 or bfloat16 (kv_types.h),
 * widened to float32 once per request and kv head as K and V are packed.
 *
 * torch's CPU flash kernel (the path rein's reference takes) runs its block products through
 * the BLAS sgemm, which on the AMD benchmark machine took 31% of a long-prompt prefill at about
 * 43 GFLOPS; this kernel keeps the products in registers instead:
 *
 * - for each request and kv head, K is packed once, transposed into panels of NR keys
 *   ([keys / NR][head_dim][NR]), and V into contiguous rows ([keys][head_dim]), which every
 *   query head of the group then reuses;
 * - MR query rows at a time (one head, MR consecutive tokens) compute their scores against a
 *   panel with MR x NR sums in registers (a broadcast q value times a panel row of NR keys),
 *   fold them into a running max and sum (online softmax, in base 2: the scores scaled by
 *   log2(e) as they leave the registers, where their row maxima are also taken), and add P x V
 *   to their outputs, NR output columns at a time with MR x NR sums in registers, the outputs'
 *   rescaling by the moved maxima done as they are loaded;
 * - panels past a block's last query position are skipped (causal), and with a sliding window
 *   so are the panels before its first row's window, and the cache blocks before the chunk's
 *   first row's window are never read (the engine may have freed them).
 *
 * GCC's vector extensions, so -march=native picks the instructions (AVX-512: MR 12, NR 32;
 * otherwise MR 6, NR 16). head_dim must be a multiple of NR; the caller falls back to torch
 * otherwise. Work is split over (head, query block) pairs with OpenMP.
 *
 * These products run at this CPU's float32 FMA peak; what keeps the kernel below it is the
 * softmax (an exponential a score) and the per-tile work around the products. bfloat16 dot
 * products (avx512_bf16) would double the rate but need Q or P rounded to bfloat16, errors of
 * ~1e-3 in the outputs against the 2e-5 the tests (and float32 outputs) allow.
 *
 * Built at first use by rein/kernels/cpu_native.py and called through ctypes.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "fast_exp.h"
#include "kv_types.h"
#include <omp.h>

#if defined(__AVX512F__)
#define VEC 16
#define MR 12
#else
#define VEC 8
#define MR 6
#endif
#define NR (2 * VEC)
/* Keys per softmax tile: KB / NR panels' scores, then one online-softmax update and one P x V
 * pass over them (the per-tile work: row maxima, rescaling factors, loading and storing the
 * outputs, comes once per KB keys). */
#define KB (2 * NR)
#define MAX_HEAD_DIM 256

typedef float vec __attribute__((vector_size(VEC * sizeof(float)), aligned(4)));

/* Keys per panel: the caller sizes the packed K/V scratch by it. */
int prefill_attention_f32_nr(void) { return NR; }

static inline vec load_vec(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store_vec(float *p, vec v) { memcpy(p, &v, sizeof v); }

/* Rows fetched this many tokens ahead while packing. */
#define PACK_PREFETCH 8

/* K rows 0..len-1 of kv head `g` -> kt [ceil(len / NR)][head_dim][NR], zero past len; V rows ->
 * vt [len][head_dim]; both float32. */
static void pack_keys_values(const char *k_cache, const char *v_cache, int type, const int32_t *table,
                             int64_t block_size, int64_t row, int64_t g, int64_t head_dim, int64_t len,
                             float *kt, float *vt) {
    const int64_t panels = (len + NR - 1) / NR, esize = kv_size(type);
    memset(kt + (panels - 1) * head_dim * NR, 0, sizeof(float) * head_dim * NR);
    float k[MAX_HEAD_DIM];
    for (int64_t t = 0; t < len; t++) {
        const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
        const int64_t at = (slot * row + g * head_dim) * esize;
        if (t + PACK_PREFETCH < len) {   /* the cache blocks are scattered: fetch ahead across them */
            const int64_t ta = t + PACK_PREFETCH;
            const int64_t ahead = (((int64_t)table[ta / block_size] * block_size + ta % block_size) * row
                                   + g * head_dim) * esize;
            for (int64_t c = 0; c < head_dim * esize; c += 64) {
                __builtin_prefetch(k_cache + ahead + c, 0, 3);
                __builtin_prefetch(v_cache + ahead + c, 0, 3);
            }
        }
        kv_to_f32(k_cache + at, type, k, head_dim);
        kv_to_f32(v_cache + at, type, vt + t * head_dim, head_dim);
        float *dst = kt + (t / NR) * head_dim * NR + t % NR;
        for (int64_t d = 0; d < head_dim; d++) dst[d * NR] = k[d];
    }
}

/* Lane-wise maximum (a compare and a blend: vmaxps where the compiler sees it). */
static inline vec vec_max(vec a, vec b) {
    typedef int32_t ivec __attribute__((vector_size(VEC * sizeof(int32_t)), aligned(4)));
    const ivec take_a = a > b;
    return (vec)((take_a & (ivec)a) | (~take_a & (ivec)b));
}

/* s[MR][0..NR) (rows KB apart) = scale * q rows . panel (head_dim x NR); rmax[r] = the lane-wise
 * maximum of rmax[r] and row r's new scores, taken while they are in registers (the softmax of
 * a row that sees the whole tile needs no pass of its own for its maximum). */
static inline void scores(const float *const *q, const float *panel, int64_t head_dim, float scale, float *s,
                          vec *rmax) {
    vec acc[MR][2];
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = (vec){0};
    for (int64_t d = 0; d < head_dim; d++) {
        const vec w0 = load_vec(panel + d * NR), w1 = load_vec(panel + d * NR + VEC);
        #pragma GCC unroll 12
        for (int r = 0; r < MR; r++) {
            const float a = q[r][d];
            acc[r][0] += a * w0;
            acc[r][1] += a * w1;
        }
    }
    for (int r = 0; r < MR; r++) {
        acc[r][0] *= scale;
        acc[r][1] *= scale;
        store_vec(s + r * KB, acc[r][0]);
        store_vec(s + r * KB + VEC, acc[r][1]);
        rmax[r] = vec_max(rmax[r], vec_max(acc[r][0], acc[r][1]));
    }
}

/* o[MR][head_dim] = o * alpha (per row) + p[MR][0..n) (rows KB apart) x vt rows 0..n, NR columns at
 * a time. */
static inline void add_values(const float *p, int64_t n, const float *vt, const float *alpha, int64_t head_dim,
                              float *o) {
    for (int64_t c = 0; c < head_dim; c += NR) {
        vec acc[MR][2];
        for (int r = 0; r < MR; r++) {
            acc[r][0] = load_vec(o + r * head_dim + c) * alpha[r];
            acc[r][1] = load_vec(o + r * head_dim + c + VEC) * alpha[r];
        }
        const float *v = vt + c;
        for (int64_t j = 0; j < n; j++, v += head_dim) {
            const vec v0 = load_vec(v), v1 = load_vec(v + VEC);
            #pragma GCC unroll 12
            for (int r = 0; r < MR; r++) {
                const float a = p[r * KB + j];
                acc[r][0] += a * v0;
                acc[r][1] += a * v1;
            }
        }
        for (int r = 0; r < MR; r++) {
            store_vec(o + r * head_dim + c, acc[r][0]);
            store_vec(o + r * head_dim + c + VEC, acc[r][1]);
        }
    }
}

/* The scores are kept in base 2 (scaled by scale * log2(e) as they leave the registers), so the
 * softmax's exponentials are 2^x: no multiply by log2(e) in each of them. */
#define LOG2E 1.44269504088896341f
#define LN2 0.693147180559945309f

#if defined(__AVX512F__)
#include <immintrin.h>

/* 2^x on 16 lanes for finite x <= 0: f = x - floor(x) in [0, 1) by vreduceps, a degree-5
 * polynomial for 2^f (a Chebyshev fit, relative error under 2e-7 in float32, as fast_exp.h's),
 * and 2^floor(x) applied by vscalefps, which takes the floor itself and underflows to 0 (no
 * clamping): 8 instructions, where exp through fast_exp.h's reduction takes 11. */
static inline __m512 exp2_nonpositive(__m512 x) {
    const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 p = _mm512_set1_ps(0.00189510733f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.0089462148f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.0558632836f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.240140766f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.693154633f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.999999881f));
    return _mm512_scalef_ps(p, x);
}
#endif

/* 2^x in float32 for the plain and AVX2 builds: fast_exp.h's exp of x ln 2. */
static inline float exp2_scalar(float x) { return fast_expf(x * LN2); }

/* The largest of a vector's lanes. */
static inline float hmax(vec v) {
#if defined(__AVX512F__)
    return _mm512_reduce_max_ps((__m512)v);
#else
    float x = v[0];
    for (int i = 1; i < VEC; i++) x = v[i] > x ? v[i] : x;
    return x;
#endif
}

/* Row r of a tile: sr[j] = 2^(sr[j] - x) for keys first <= j < visible, 0 for the others; the
 * row's lane sums lr[VEC] = lr * a + the new values, VEC lanes wide (reduced once at the end: a
 * horizontal add in every tile would wait on each of its adds). */
static inline void exp_row_masked(float *sr, float *lr, float x, float a, int64_t first, int64_t visible) {
    float sum[VEC] = {0};
    for (int64_t c = 0; c < KB; c += VEC) {
        #pragma omp simd
        for (int64_t l = 0; l < VEC; l++) {
            const int64_t j = c + l;
            sr[j] = j >= first && j < visible ? exp2_scalar(sr[j] - x) : 0.0f;
            sum[l] += sr[j];
        }
    }
    #pragma omp simd
    for (int64_t l = 0; l < VEC; l++) lr[l] = lr[l] * a + sum[l];
}

/* The same for a row that sees every key of the tile. */
static inline void exp_row(float *sr, float *lr, float x, float a) {
#if defined(__AVX512F__)
    const __m512 vx = _mm512_set1_ps(x);
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < KB; j += 16) {
        const __m512 e = exp2_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(sr + j), vx));
        _mm512_storeu_ps(sr + j, e);
        sum = _mm512_add_ps(sum, e);
    }
    _mm512_storeu_ps(lr, _mm512_fmadd_ps(_mm512_loadu_ps(lr), _mm512_set1_ps(a), sum));
#else
    exp_row_masked(sr, lr, x, a, 0, KB);
#endif
}

/* Online softmax of one tile of scores s[MR][KB] in base 2 (keys key0 .. key0 + n; row r sees
 * keys from lo[r] up to pos[r]; rmax[r]: the lane-wise maximum of its computed scores, used for
 * rows that see the whole tile): the running maxima m move up, alpha[r] = 2^(old max - new
 * max) (the factor add_values scales the outputs by), the lane sums lsum are rescaled by it,
 * and s becomes 2^(s - max), 0 where masked. */
static inline void softmax_tile(float *s, int64_t key0, int64_t n, const int64_t *pos, const int64_t *lo,
                                const vec *rmax, float *m, float *lsum, float *alpha) {
    float mx[MR];
    int64_t visible[MR], first[MR];
    for (int r = 0; r < MR; r++) {
        const float *sr = s + r * KB;
        const int64_t v = pos[r] + 1 - key0 < n ? pos[r] + 1 - key0 : n, f = lo[r] - key0;
        float x = m[r];
        if (v == KB && f <= 0) {
            const float t = hmax(rmax[r]);
            x = t > x ? t : x;
        } else {
            #pragma omp simd reduction(max:x)
            for (int64_t j = 0; j < KB; j++) x = j >= f && j < v && sr[j] > x ? sr[j] : x;
        }
        visible[r] = v;
        first[r] = f;
        mx[r] = x;
    }
    /* m = -inf: ~0, nothing to scale yet. A row whose window starts past this tile has seen no
     * key at all (x = -inf too): 1, where 2^(-inf - -inf) would be NaN. */
    #pragma omp simd
    for (int r = 0; r < MR; r++) alpha[r] = mx[r] == -INFINITY ? 1.0f : exp2_scalar(m[r] - mx[r]);
    for (int r = 0; r < MR; r++) {
        if (visible[r] == KB && first[r] <= 0)
            exp_row(s + r * KB, lsum + r * VEC, mx[r], alpha[r]);
        else
            exp_row_masked(s + r * KB, lsum + r * VEC, mx[r], alpha[r], first[r], visible[r]);
        m[r] = mx[r];
    }
}

/* Rows t0 .. t0 + rows of one query head h (at most MR) of a request's chunk against its packed
 * K/V (kt, vt); q0: the chunk's first row in query/out. */
static void query_block(const float *query, float *out, int64_t q0, int64_t t0, int64_t rows, int64_t h,
                        int64_t qrow, int64_t head_dim, int64_t first_pos, int64_t window, float scale,
                        const float *kt, const float *vt) {
    const float *qp[MR];
    int64_t pos[MR], lo[MR];
    for (int r = 0; r < MR; r++) {   /* rows past the chunk repeat its last row */
        const int64_t t = t0 + (r < rows ? r : rows - 1);
        qp[r] = query + (q0 + t) * qrow + h * head_dim;
        pos[r] = first_pos + t;
        lo[r] = window > 0 ? pos[r] - window + 1 : 0;
    }
    /* keys lo[0]..last are visible to some row; panels before lo[0]'s are skipped */
    const int64_t last = pos[rows - 1];
    const int64_t key_start = lo[0] > 0 ? lo[0] / NR * NR : 0;
    float o[MR * MAX_HEAD_DIM], m[MR], alpha[MR], lsum[MR * VEC], s[MR * KB];
    memset(o, 0, sizeof(float) * MR * head_dim);
    memset(lsum, 0, sizeof lsum);
    for (int r = 0; r < MR; r++) m[r] = -INFINITY;

    for (int64_t key0 = key_start; key0 <= last; key0 += KB) {
        vec rmax[MR];
        for (int r = 0; r < MR; r++) rmax[r] = (vec){0} - INFINITY;
        /* the tile's second panel only where some row sees a key in it (its scores are masked
         * out otherwise) */
        for (int64_t panel = 0; panel < KB / NR && key0 + panel * NR <= last; panel++)
            scores(qp, kt + (key0 / NR + panel) * head_dim * NR, head_dim, scale * LOG2E, s + panel * NR, rmax);
        const int64_t n = last + 1 - key0 < KB ? last + 1 - key0 : KB;
        softmax_tile(s, key0, n, pos, lo, rmax, m, lsum, alpha);
        add_values(s, n, vt + key0 * head_dim, alpha, head_dim, o);
    }
    for (int64_t r = 0; r < rows; r++) {
        float *dst = out + (q0 + t0 + r) * qrow + h * head_dim;
        float l = 0.0f;
        #pragma omp simd reduction(+:l)
        for (int64_t j = 0; j < VEC; j++) l += lsum[r * VEC + j];
        const float inv = 1.0f / l;
        #pragma omp simd
        for (int64_t d = 0; d < head_dim; d++) dst[d] = o[r * head_dim + d] * inv;
    }
}

/* query [T, Hq, D] float32 (rows of request i: cu_seqlens_q[i] .. cu_seqlens_q[i+1]); caches
 * [num_blocks, block_size, Hkv, D] of kv_type (enum kv_type); block_tables [B, bt_stride] int32;
 * context_lens [B] int32 (cached tokens, the chunk included); out [T, Hq, D] float32. scratch
 * holds 2 * ceil(max context / NR) * NR * D floats (packed K, then V). window > 0: the row at
 * position p sees keys p - window < k <= p only; window <= 0: all k <= p. Returns 0, or -1 for
 * shapes or a cache type this kernel does not handle (nothing written). */
int paged_prefill_attention_f32(
    const float *query, const void *k_cache, const void *v_cache, int kv_type,
    const int32_t *block_tables, int64_t bt_stride, const int64_t *cu_seqlens_q, const int32_t *context_lens,
    float *out, float *scratch, int64_t max_context, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, float scale, int64_t window, int num_threads)
{
    const int64_t group = num_heads / num_kv_heads;
    if (head_dim % NR != 0 || head_dim > MAX_HEAD_DIM || group * num_kv_heads != num_heads
        || (kv_type != KV_F32 && kv_type != KV_F16 && kv_type != KV_BF16))
        return -1;
    const int64_t row = num_kv_heads * head_dim;
    const int64_t qrow = num_heads * head_dim;
    float *kt = scratch, *vt = scratch + (max_context + NR - 1) / NR * NR * head_dim;

    for (int64_t b = 0; b < batch; b++) {
        const int64_t q0 = cu_seqlens_q[b], q_len = cu_seqlens_q[b + 1] - q0, ctx = context_lens[b];
        if (q_len <= 0)
            continue;
        if (ctx > max_context)
            return -1;
        /* Keys are numbered from `base`, the start of the block holding the first key the chunk's
         * first row sees (0 without a window): blocks before it are never read. */
        const int64_t window_start = window > 0 && ctx - q_len - window + 1 > 0 ? ctx - q_len - window + 1 : 0;
        const int64_t base = window_start / block_size * block_size;
        const int32_t *table = block_tables + b * bt_stride + window_start / block_size;
        const int64_t first_pos = ctx - q_len - base;   /* the chunk's first token, from base */
        const int64_t blocks = (q_len + MR - 1) / MR;
        for (int64_t g = 0; g < num_kv_heads; g++) {
            pack_keys_values(k_cache, v_cache, kv_type, table, block_size, row, g, head_dim, ctx - base, kt, vt);

            /* each head's blocks last to first: a block's work grows with its position (causal),
             * so the blocks left when the threads run out of work are the small ones */
            #pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) if (num_threads > 1)
            for (int64_t item = 0; item < group * blocks; item++) {
                const int64_t h = g * group + item / blocks, t0 = (blocks - 1 - item % blocks) * MR;
                const int64_t rows = q_len - t0 < MR ? q_len - t0 : MR;
                query_block(query, out, q0, t0, rows, h, qrow, head_dim, first_pos, window, scale, kt, vt);
            }
        }
    }
    return 0;
}
