/* Weight-only quantized matmul on the CPU: out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), x and
 * out float32, w group-wise affine integers (rein/kernels/quantized.py):
 *
 *     w[n, k] = scale[n, k / group] * q[n, k] + offset[n, k / group]
 *
 * in the CPU's panel layout (`CpuPanels`, made once at load): the rows in panels of 16, and
 * within a panel, column by column, the 16 rows' integers side by side --
 *
 *     bits 8: q int8 [panel][k][16]
 *     bits 4: q uint8 [panel][k][8], byte j = row j (low nibble) | row j + 8 (high nibble)
 *     scale, offset: float32 [panel][k / group][16]
 *
 * -- so one load and one conversion give one column of a panel as a vector of 16 floats (one
 * AVX-512 register, two AVX2 ones), ready to multiply by a broadcast activation: the inner loop
 * of a register-tiled sgemm, with no transposition and no horizontal sums. Decode (a few rows)
 * expands each column in registers and uses it for every row; more rows expand a panel once
 * into a k-major float32 buffer (16 x K floats, in L2) and run tiles of MP rows over it. A
 * weight is read from memory once per call whatever the row count, which is what decode's
 * speed is on a CPU: 4-bit weights are about a fifth of float32's bytes with their scales.
 *
 * Built and loaded with the other kernels by rein/kernels/cpu_native.py (-march=native).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define PANEL 16

/* A panel column (16 floats) is NV vectors of VL lanes: one with AVX-512, two with AVX2+FMA,
 * 16 scalars in plain C. MP: activation rows per tile; MP x NV accumulators, NV weight vectors
 * and a broadcast must fit the vector registers (32 with AVX-512, 16 with AVX2). */
#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define VL 16
#define MP 12
typedef __m512 vf;
#define V_ZERO() _mm512_setzero_ps()
#define V_LOAD(p) _mm512_loadu_ps(p)
#define V_STORE(p, v) _mm512_storeu_ps(p, v)
#define V_SET1(s) _mm512_set1_ps(s)
#define V_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#elif defined(__AVX2__) && defined(__FMA__)
#define VL 8
#define MP 6
typedef __m256 vf;
#define V_ZERO() _mm256_setzero_ps()
#define V_LOAD(p) _mm256_loadu_ps(p)
#define V_STORE(p, v) _mm256_storeu_ps(p, v)
#define V_SET1(s) _mm256_set1_ps(s)
#define V_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#else
#define VL 1
#define MP 4
typedef float vf;
#define V_ZERO() 0.0f
#define V_LOAD(p) (*(p))
#define V_STORE(p, v) (*(p) = (v))
#define V_SET1(s) (s)
#define V_FMA(a, b, c) ((a) * (b) + (c))
#endif
#define NV (PANEL / VL)

/* Below this many weights a call is not worth waking a thread team for. */
#define PARALLEL_MIN_WEIGHTS 65536

/* Column k of a panel as NV vectors of floats: scale * q + offset (s, o: the group's 16 each). */
static inline __attribute__((always_inline)) void column(const uint8_t *q, int bits, int64_t k, const float *s,
                                                         const float *o, vf *w) {
#if VL == 16
    __m128i ints;
    if (bits == 4) {
        const __m128i packed = _mm_loadl_epi64((const __m128i *)(q + k * 8));
        const __m128i mask = _mm_set1_epi8(0x0F);
        ints = _mm_unpacklo_epi64(_mm_and_si128(packed, mask), _mm_and_si128(_mm_srli_epi16(packed, 4), mask));
        w[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(ints));
    } else {
        ints = _mm_loadu_si128((const __m128i *)(q + k * 16));
        w[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(ints));
    }
    w[0] = o ? V_FMA(w[0], V_LOAD(s), V_LOAD(o)) : _mm512_mul_ps(w[0], V_LOAD(s));
#elif VL == 8
    if (bits == 4) {
        const __m128i packed = _mm_loadl_epi64((const __m128i *)(q + k * 8));
        const __m128i mask = _mm_set1_epi8(0x0F);
        w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(packed, mask)));
        w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(packed, 4), mask)));
    } else {
        w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + k * 16))));
        w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + k * 16 + 8))));
    }
    for (int v = 0; v < 2; v++)
        w[v] = o ? V_FMA(w[v], V_LOAD(s + 8 * v), V_LOAD(o + 8 * v)) : _mm256_mul_ps(w[v], V_LOAD(s + 8 * v));
#else
    for (int j = 0; j < PANEL; j++) {
        const int value = bits == 4 ? (q[k * 8 + j % 8] >> (j < 8 ? 0 : 4)) & 0x0F : ((const int8_t *)q)[k * 16 + j];
        w[j] = (float)value * s[j] + (o ? o[j] : 0.0f);
    }
#endif
}

/* out tile [mr x 16] of one panel: x rows 0..mr times the panel, column by column expanded in
 * registers (decode: no buffer, each column used by all mr rows). */
static inline __attribute__((always_inline)) void fused_tile(const float *x, int64_t x_stride, const uint8_t *q,
                                                             const float *scale, const float *offset, int64_t cols,
                                                             int64_t group, int bits, int mr, float *tile) {
    vf acc[MP][NV];
    for (int i = 0; i < MP; i++)
        for (int v = 0; v < NV; v++) acc[i][v] = V_ZERO();
    for (int64_t g = 0; g < cols / group; g++) {
        const float *s = scale + g * PANEL, *o = offset ? offset + g * PANEL : NULL;
        for (int64_t k = g * group; k < (g + 1) * group; k++) {
            vf w[NV];
            column(q, bits, k, s, o, w);
            #pragma GCC unroll 12
            for (int i = 0; i < MP; i++) {
                if (i < mr) {
                    const vf xb = V_SET1(x[i * x_stride + k]);
                    for (int v = 0; v < NV; v++) acc[i][v] = V_FMA(w[v], xb, acc[i][v]);
                }
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < NV; v++) V_STORE(tile + i * PANEL + v * VL, acc[i][v]);
}

/* The same tile from a panel already expanded into wt [cols][16] floats. */
static inline __attribute__((always_inline)) void dense_tile(const float *x, int64_t x_stride, const float *wt,
                                                             int64_t cols, int mr, float *tile) {
    vf acc[MP][NV];
    for (int i = 0; i < MP; i++)
        for (int v = 0; v < NV; v++) acc[i][v] = V_ZERO();
    for (int64_t k = 0; k < cols; k++) {
        vf w[NV];
        for (int v = 0; v < NV; v++) w[v] = V_LOAD(wt + k * PANEL + v * VL);
        #pragma GCC unroll 12
        for (int i = 0; i < MP; i++) {
            if (i < mr) {
                const vf xb = V_SET1(x[i * x_stride + k]);
                for (int v = 0; v < NV; v++) acc[i][v] = V_FMA(w[v], xb, acc[i][v]);
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < NV; v++) V_STORE(tile + i * PANEL + v * VL, acc[i][v]);
}

/* Copies for each row count, so the compiler unrolls the row loops with mr a constant. */
#define FOR_EACH_ROW_COUNT(CALL) \
    switch (mr) { \
        case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; case 4: CALL(4); break; \
        case 5: CALL(5); break; case 6: CALL(6); break; case 7: CALL(7); break; case 8: CALL(8); break; \
        case 9: CALL(9); break; case 10: CALL(10); break; case 11: CALL(11); break; default: CALL(MP); break; \
    }

static void fused_rows(const float *x, int64_t x_stride, const uint8_t *q, const float *scale, const float *offset,
                       int64_t cols, int64_t group, int bits, int mr, float *tile) {
#define FUSED(R) (bits == 4 ? fused_tile(x, x_stride, q, scale, offset, cols, group, 4, R, tile) \
                            : fused_tile(x, x_stride, q, scale, offset, cols, group, 8, R, tile))
    FOR_EACH_ROW_COUNT(FUSED)
#undef FUSED
}

static void dense_rows(const float *x, int64_t x_stride, const float *wt, int64_t cols, int mr, float *tile) {
#define DENSE(R) dense_tile(x, x_stride, wt, cols, R, tile)
    FOR_EACH_ROW_COUNT(DENSE)
#undef DENSE
}

/* Panel p of w expanded to float32 into wt [cols][16]. */
static void expand_panel(const uint8_t *q, const float *scale, const float *offset, int64_t cols, int64_t group,
                         int bits, float *wt) {
    for (int64_t g = 0; g < cols / group; g++) {
        const float *s = scale + g * PANEL, *o = offset ? offset + g * PANEL : NULL;
        for (int64_t k = g * group; k < (g + 1) * group; k++) {
            vf w[NV];
            column(q, bits, k, s, o, w);
            for (int v = 0; v < NV; v++) V_STORE(wt + k * PANEL + v * VL, w[v]);
        }
    }
}

int quantized_panels_mp(void) { return MP; }

/* x [rows, cols] (rows x_stride floats apart) times w [n_out, cols] transposed -> out [rows, n_out]
 * (rows out_stride floats apart), plus bias [n_out] when not NULL. w: the panel layout above,
 * ceil(n_out / 16) panels (the last one's missing rows are zeros, never written out).
 * Returns 0, or -1 for a shape the layout cannot have (group not dividing cols). */
int quantized_matmul_f32(const float *x, int64_t x_stride, const uint8_t *q, const float *scale,
                         const float *offset, const float *bias, float *out, int64_t out_stride, int64_t rows,
                         int64_t n_out, int64_t cols, int64_t group, int bits, int num_threads) {
    if (group <= 0 || cols % group || (bits != 4 && bits != 8)) return -1;
    const int64_t panels = (n_out + PANEL - 1) / PANEL, groups = cols / group;
    const int64_t panel_bytes = cols * PANEL * bits / 8;
    const int fused = rows <= MP;   /* one tile of rows: expand in registers, no buffer */
    #pragma omp parallel num_threads(num_threads) if (num_threads > 1 && n_out * cols >= PARALLEL_MIN_WEIGHTS)
    {
        float *wt = fused ? NULL : aligned_alloc(64, (size_t)(cols * PANEL) * sizeof(float));
        float tile[MP * PANEL];
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const uint8_t *qp = q + p * panel_bytes;
            const float *sp = scale + p * groups * PANEL, *op = offset ? offset + p * groups * PANEL : NULL;
            const int64_t n0 = p * PANEL;
            const int np = n_out - n0 < PANEL ? (int)(n_out - n0) : PANEL;
            if (!fused) expand_panel(qp, sp, op, cols, group, bits, wt);
            for (int64_t m0 = 0; m0 < rows; m0 += MP) {
                const int mr = rows - m0 < MP ? (int)(rows - m0) : MP;
                if (fused) fused_rows(x + m0 * x_stride, x_stride, qp, sp, op, cols, group, bits, mr, tile);
                else dense_rows(x + m0 * x_stride, x_stride, wt, cols, mr, tile);
                for (int i = 0; i < mr; i++) {
                    float *o = out + (m0 + i) * out_stride + n0;
                    for (int j = 0; j < np; j++) o[j] = tile[i * PANEL + j] + (bias ? bias[n0 + j] : 0.0f);
                }
            }
        }
        free(wt);
    }
    return 0;
}
