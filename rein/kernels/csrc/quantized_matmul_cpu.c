/* Weight-only quantized matmul on the CPU: out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), x and
 * out float32, w in rein's QuantizedWeight form (rein/kernels/quantized.py):
 *
 *     w[n, k] = scale[n, k / group] * q[n, k] + offset[n, k / group]
 *
 * bits 4: q uint8 [N, K / 2]; in each run of 32 columns, byte j holds column j (low nibble)
 *         and column j + 16 (high nibble);
 * bits 8: q int8 [N, K].
 *
 * Decode reads every weight once per step, so on a CPU its speed is the bytes it reads: 4-bit
 * weights are about a fifth of float32's (with their scales). Each thread takes pairs of weight
 * rows, expands them to float32 into a buffer that stays in L1 (2 x K floats), and multiplies
 * them by every activation row, MR rows at a time with 2 x MR accumulators in registers, so a
 * weight is read from memory once and converted once per call however many rows x has. The
 * sums are float32 FMAs over k in order of 8-column chunks, so a result differs from the
 * dequantized weight's product only in the order of additions.
 *
 * Built and loaded with the other kernels by rein/kernels/cpu_native.py (-march=native).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

/* One vector of float32 lanes and what the kernels do with it: 16 lanes with AVX-512, 8 with
 * AVX2+FMA, 1 (plain C) elsewhere. V_U8 / V_I8 expand VL integers (bytes) to floats. */
#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define VL 16
typedef __m512 vf;
#define V_ZERO() _mm512_setzero_ps()
#define V_LOAD(p) _mm512_loadu_ps(p)
#define V_STORE(p, v) _mm512_storeu_ps(p, v)
#define V_SET1(s) _mm512_set1_ps(s)
#define V_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define V_HSUM(v) _mm512_reduce_add_ps(v)
#define V_U8(m128) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(m128))
#define V_I8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define MR 8
#elif defined(__AVX2__) && defined(__FMA__)
#define VL 8
typedef __m256 vf;
#define V_ZERO() _mm256_setzero_ps()
#define V_LOAD(p) _mm256_loadu_ps(p)
#define V_STORE(p, v) _mm256_storeu_ps(p, v)
#define V_SET1(s) _mm256_set1_ps(s)
#define V_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define V_U8(m128) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m128))
#define V_I8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
static inline float V_HSUM(__m256 v) {
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}
#define MR 4
#else
#define VL 1
typedef float vf;
#define V_ZERO() 0.0f
#define V_LOAD(p) (*(p))
#define V_STORE(p, v) (*(p) = (v))
#define V_SET1(s) (s)
#define V_FMA(a, b, c) ((a) * (b) + (c))
#define V_HSUM(v) (v)
#define MR 4
#endif
/* MR: activation rows per register tile. 2 x MR accumulators, 2 weight vectors and an
 * activation vector must fit the registers (16 vector registers with AVX2, 32 with AVX-512). */

/* Below this many weights a call is not worth waking a thread team for. */
#define PARALLEL_MIN_WEIGHTS 65536

/* Columns c..c+VL of one weight row as floats, scale * q + offset; c a multiple of VL, and of
 * 32 for 4-bit rows when VL < 32 is not (the caller walks a 32-column run VL at a time). */
static inline __attribute__((always_inline)) vf weights_at(const uint8_t *row, int bits, int64_t c, vf s, vf o) {
#if VL > 1
    if (bits == 4) {
        const __m128i packed = _mm_loadu_si128((const __m128i *)(row + c / 32 * 16));
        const int64_t in_run = c % 32;
        __m128i nibbles = in_run < 16 ? packed : _mm_srli_epi16(packed, 4);
        nibbles = _mm_and_si128(nibbles, _mm_set1_epi8(0x0F));
#if VL == 8
        if (in_run % 16) nibbles = _mm_srli_si128(nibbles, 8);
#endif
        return V_FMA(V_U8(nibbles), s, o);
    }
    return V_FMA(V_I8((const int8_t *)row + c), s, o);
#else
    if (bits == 4) {
        const uint8_t byte = row[c / 32 * 16 + c % 16];
        return (float)(c % 32 < 16 ? byte & 0x0F : byte >> 4) * s + o;
    }
    return (float)((const int8_t *)row)[c] * s + o;
#endif
}

/* Rows n, n+1 of w (a, b: their bytes; sa, oa, sb, ob: their scales and offsets) times x rows
 * 0..mr: dots[2i] = x_i . w_n, dots[2i+1] = x_i . w_{n+1}. Each weight vector is expanded once
 * and used for all mr rows (decode). The loop walks 32-column runs; a run's group is its column
 * >> gshift (groups are powers of two here), its second half's too for 16-column groups. */
static inline __attribute__((always_inline)) void fused_tile(
        const float *x, int64_t x_stride, const uint8_t *a, const uint8_t *b, const float *sa, const float *oa,
        const float *sb, const float *ob, int64_t cols, int gshift, int bits, int mr, float *dots) {
    vf acc_a[MR], acc_b[MR];
    #pragma GCC unroll 8
    for (int i = 0; i < MR; i++) { acc_a[i] = V_ZERO(); acc_b[i] = V_ZERO(); }
    for (int64_t c = 0; c < cols; c += 32) {
        #pragma GCC unroll 32
        for (int64_t v = 0; v < 32; v += VL) {
            const int64_t g = (c + v) >> gshift;
            const vf wa = weights_at(a, bits, c + v, V_SET1(sa[g]), V_SET1(oa ? oa[g] : 0.0f));
            const vf wb = weights_at(b, bits, c + v, V_SET1(sb[g]), V_SET1(ob ? ob[g] : 0.0f));
            #pragma GCC unroll 8
            for (int i = 0; i < MR; i++) {
                if (i < mr) {
                    const vf xv = V_LOAD(x + i * x_stride + c + v);
                    acc_a[i] = V_FMA(wa, xv, acc_a[i]);
                    acc_b[i] = V_FMA(wb, xv, acc_b[i]);
                }
            }
        }
    }
    #pragma GCC unroll 8
    for (int i = 0; i < MR; i++) {
        if (i < mr) { dots[2 * i] = V_HSUM(acc_a[i]); dots[2 * i + 1] = V_HSUM(acc_b[i]); }
    }
}

/* Row n of w expanded to float32 into dst (cols floats). */
static void dequantize_row(const uint8_t *q, const float *scale, const float *offset, int64_t n, int64_t cols,
                           int64_t group, int bits, float *dst) {
    const int64_t groups = cols / group;
    const uint8_t *row = q + n * (bits == 4 ? cols / 2 : cols);
    for (int64_t g = 0; g < groups; g++) {
        const vf s = V_SET1(scale[n * groups + g]), o = V_SET1(offset ? offset[n * groups + g] : 0.0f);
        for (int64_t c = g * group; c < (g + 1) * group; c += VL) V_STORE(dst + c, weights_at(row, bits, c, s, o));
    }
}

/* Expanded rows a, b (float32) times x rows 0..mr, as fused_tile (many activation rows: each
 * weight is expanded once per call, not once per MR rows). */
static inline __attribute__((always_inline)) void dense_tile(const float *x, int64_t x_stride, const float *a,
                                                             const float *b, int64_t cols, int mr, float *dots) {
    vf acc_a[MR], acc_b[MR];
    #pragma GCC unroll 8
    for (int i = 0; i < MR; i++) { acc_a[i] = V_ZERO(); acc_b[i] = V_ZERO(); }
    for (int64_t c = 0; c < cols; c += VL) {
        const vf wa = V_LOAD(a + c), wb = V_LOAD(b + c);
        #pragma GCC unroll 8
        for (int i = 0; i < MR; i++) {
            if (i < mr) {
                const vf xv = V_LOAD(x + i * x_stride + c);
                acc_a[i] = V_FMA(wa, xv, acc_a[i]);
                acc_b[i] = V_FMA(wb, xv, acc_b[i]);
            }
        }
    }
    #pragma GCC unroll 8
    for (int i = 0; i < MR; i++) {
        if (i < mr) { dots[2 * i] = V_HSUM(acc_a[i]); dots[2 * i + 1] = V_HSUM(acc_b[i]); }
    }
}

/* The row counts the compiler specializes (mr a constant in each copy, the loops unrolled). */
#define FOR_EACH_MR(CALL) \
    switch (mr) { \
        case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; \
        case 4: if (MR > 4) { CALL(4); break; } /* fall through */ \
        case 5: if (MR > 5) { CALL(5); break; } /* fall through */ \
        case 6: if (MR > 6) { CALL(6); break; } /* fall through */ \
        case 7: if (MR > 7) { CALL(7); break; } /* fall through */ \
        default: CALL(MR); break; \
    }

static void fused_rows(const float *x, int64_t x_stride, const uint8_t *a, const uint8_t *b, const float *sa,
                       const float *oa, const float *sb, const float *ob, int64_t cols, int gshift, int bits,
                       int mr, float *dots) {
    /* bits a constant in each copy too: no test of it in the inner loop */
#define FUSED(R) (bits == 4 ? fused_tile(x, x_stride, a, b, sa, oa, sb, ob, cols, gshift, 4, R, dots) \
                            : fused_tile(x, x_stride, a, b, sa, oa, sb, ob, cols, gshift, 8, R, dots))
    FOR_EACH_MR(FUSED)
#undef FUSED
}

/* log2(group) for a power of two; a single group per row counts as one too (shift past the row). */
static int group_shift(int64_t group, int64_t cols) {
    if (group >= cols) return 62;
    int shift = 0;
    while (((int64_t)1 << shift) < group) shift++;
    return ((int64_t)1 << shift) == group ? shift : -1;
}

static void dense_rows(const float *x, int64_t x_stride, const float *a, const float *b, int64_t cols, int mr,
                       float *dots) {
#define DENSE(R) dense_tile(x, x_stride, a, b, cols, R, dots)
    FOR_EACH_MR(DENSE)
#undef DENSE
}

static int shape_ok(int64_t cols, int64_t group, int bits) {
    return cols % 32 == 0 && group > 0 && cols % group == 0 && group % 16 == 0 &&
           (bits == 8 || (bits == 4 && group % 32 == 0));
}

int quantized_matmul_mr(void) { return MR; }

/* x [rows, cols] (rows x_stride floats apart) times w [n_out, cols] transposed -> out [rows, n_out]
 * (rows out_stride floats apart), plus bias [n_out] when not NULL. Returns 0, or -1 when the
 * shape is not one this kernel takes (cols not whole runs of 32, or groups not dividing it). */
int quantized_matmul_f32(const float *x, int64_t x_stride, const uint8_t *q, const float *scale,
                         const float *offset, const float *bias, float *out, int64_t out_stride, int64_t rows,
                         int64_t n_out, int64_t cols, int64_t group, int bits, int num_threads) {
    if (!shape_ok(cols, group, bits)) return -1;
    const int64_t pairs = (n_out + 1) / 2, row_bytes = bits == 4 ? cols / 2 : cols, groups = cols / group;
    const int gshift = group_shift(group, cols);
    /* One tile of activation rows: expand in registers (groups a power of two or whole rows). */
    const int fused = rows <= MR && gshift >= 0;
    #pragma omp parallel num_threads(num_threads) if (num_threads > 1 && n_out * cols >= PARALLEL_MIN_WEIGHTS)
    {
        float *buf = fused ? NULL : aligned_alloc(64, (size_t)(2 * cols) * sizeof(float));
        float dots[2 * MR];
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < pairs; p++) {
            const int64_t n = 2 * p;
            const int64_t nb = n + 1 < n_out ? n + 1 : n;   /* an odd last row pairs with itself */
            if (fused) {
                fused_rows(x, x_stride, q + n * row_bytes, q + nb * row_bytes, scale + n * groups,
                           offset ? offset + n * groups : NULL, scale + nb * groups,
                           offset ? offset + nb * groups : NULL, cols, gshift, bits, (int)rows, dots);
                for (int i = 0; i < rows; i++) {
                    out[i * out_stride + n] = dots[2 * i] + (bias ? bias[n] : 0.0f);
                    if (nb != n) out[i * out_stride + nb] = dots[2 * i + 1] + (bias ? bias[nb] : 0.0f);
                }
                continue;
            }
            float *a = buf, *b = buf + cols;
            dequantize_row(q, scale, offset, n, cols, group, bits, a);
            dequantize_row(q, scale, offset, nb, cols, group, bits, b);
            for (int64_t m0 = 0; m0 < rows; m0 += MR) {
                const int mr = rows - m0 < MR ? (int)(rows - m0) : MR;
                dense_rows(x + m0 * x_stride, x_stride, a, b, cols, mr, dots);
                for (int i = 0; i < mr; i++) {
                    out[(m0 + i) * out_stride + n] = dots[2 * i] + (bias ? bias[n] : 0.0f);
                    if (nb != n) out[(m0 + i) * out_stride + nb] = dots[2 * i + 1] + (bias ? bias[nb] : 0.0f);
                }
            }
        }
        free(buf);
    }
    return 0;
}

/* Rows row0..row0+count of w as float32 into dst [count, cols] (the large-batch path: expand a
 * slice, then a dense matmul). Same shape rules and return as quantized_matmul_f32. */
int dequantize_rows_f32(const uint8_t *q, const float *scale, const float *offset, float *dst, int64_t row0,
                        int64_t count, int64_t cols, int64_t group, int bits, int num_threads) {
    if (!shape_ok(cols, group, bits)) return -1;
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && count * cols >= PARALLEL_MIN_WEIGHTS)
    for (int64_t r = 0; r < count; r++)
        dequantize_row(q, scale, offset, row0 + r, cols, group, bits, dst + r * cols);
    return 0;
}
