/* Quantized matmul with int8 activations on the CPU: out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n])
 * where x is first quantized per row and per block of `ablock` columns to int8 with a float
 * scale (llama.cpp's Q8_0: d = amax / 127, q = round(x / d)), and the products are integer dot
 * products -- four int8 x uint8 products summed into an int32 lane per instruction (AVX-512
 * VNNI's vpdpbusd; AVX2's pmaddubsw + pmaddwd), where the float32 path
 * (quantized_matmul_cpu.c) converts every weight to a float and does a float multiply-add.
 *
 * The weight (rein.kernels.quantized.Int8Panels, made once at load) is unsigned integers u with
 * a float32 scale and offset per group of `group` columns,
 *
 *     w[n, k] = scale[n, k / group] * u[n, k] + offset[n, k / group]
 *
 * (a signed or zero-pointed source is shifted to unsigned and the shift folded into the offset),
 * rows in panels of 16, and within a panel the columns in runs of 4 (bytes) or 8 (nibbles), a
 * run's 16 rows one 32-bit lane each -- the operand order of vpdpbusd:
 *
 *     bits 8: q uint8 [panel][k / 4][16 rows][4]: byte i = column 4c + i
 *     bits 4: q uint8 [panel][k / 8][16 rows][4]: byte i = column 8c + i (low nibble) | 8c + 4 + i (high)
 *     scale, offset: float32 [panel][k / group][16]
 *
 * so one 64-byte load is 4 (8) columns of all 16 rows and one broadcast of 4 activation bytes
 * feeds them: a row's block sum of u * qa is exact in int32, and per block
 *
 *     out += (scale * d_x) * sum(u * qa) + offset * (d_x * sum(qa))
 *
 * in float32 (d_x * sum(qa) is computed once per row and block, when x is quantized). ablock
 * divides the group, so the weight's scale is constant over each block.
 *
 * Builds: AVX-512 VNNI (16 rows a zmm), AVX2 (8 rows a ymm; pmaddubsw saturates pairs at 16
 * bits, so 8-bit weights are made signed (u - 128) and multiplied with the sign trick, the 128
 * folded back into the offset), plain C loops. Built with the other kernels by
 * rein/kernels/cpu_native.py (-march=native); the tests force the AVX2 and plain builds.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define I8_PANEL 16

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX2__) && defined(__FMA__)
#define I8_VNNI 1
#define I8_MP 12
#elif defined(__AVX2__) && defined(__FMA__)
#define I8_AVX2 1
#define I8_MP 4
#else
#define I8_MP 4
#endif

/* Below this many weights a call is not worth waking a thread team for. */
#define I8_PARALLEL_MIN_WEIGHTS 65536

/* Row m of x -> int8 xq (cols), per block: d (xd) and d * sum(q) (xsum). */
static void quantize_row(const float *x, int64_t cols, int64_t ablock, int8_t *xq, float *xd, float *xsum) {
    for (int64_t b = 0; b < cols / ablock; b++) {
        const float *v = x + b * ablock;
        float amax = 0.0f;
        for (int64_t j = 0; j < ablock; j++) amax = fmaxf(amax, fabsf(v[j]));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        int32_t sum = 0;
        for (int64_t j = 0; j < ablock; j++) {
            /* nearbyintf: round half to even, as torch.round (the tests' reference) */
            const int32_t q = (int32_t)nearbyintf(v[j] * id);
            xq[b * ablock + j] = (int8_t)q;
            sum += q;
        }
        xd[b] = d;
        xsum[b] = d * (float)sum;
    }
}

/* Activation bytes k..k+3 of row i as one 32-bit lane value. */
static inline int32_t four_bytes(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

#if defined(I8_VNNI)
/* out tile [mr x 16] of one panel (q, scale, offset: the panel's) for activation rows xq. */
static inline __attribute__((always_inline)) void int8_tile(const int8_t *xq, const float *xd, const float *xsum,
                                                            int64_t cols, int64_t ablock, const uint8_t *q,
                                                            const float *scale, const float *offset, int64_t group,
                                                            int bits, int mr, float *tile) {
    const int64_t blocks = cols / ablock;
    __m512 acc[I8_MP];
    for (int i = 0; i < I8_MP; i++) acc[i] = _mm512_setzero_ps();
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t k0 = b * ablock, g = k0 / group;
        __m512i dot[I8_MP];
        for (int i = 0; i < I8_MP; i++) dot[i] = _mm512_setzero_si512();
        if (bits == 4) {
            for (int64_t k = k0; k < k0 + ablock; k += 8) {
                const __m512i v = _mm512_loadu_si512((const void *)(q + k * 8));
                const __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
                #pragma GCC unroll 12
                for (int i = 0; i < I8_MP; i++) {
                    if (i < mr) {
                        const int8_t *xr = xq + i * cols + k;
                        dot[i] = _mm512_dpbusd_epi32(dot[i], lo, _mm512_set1_epi32(four_bytes(xr)));
                        dot[i] = _mm512_dpbusd_epi32(dot[i], hi, _mm512_set1_epi32(four_bytes(xr + 4)));
                    }
                }
            }
        } else {
            for (int64_t k = k0; k < k0 + ablock; k += 4) {
                const __m512i v = _mm512_loadu_si512((const void *)(q + k * 16));
                #pragma GCC unroll 12
                for (int i = 0; i < I8_MP; i++)
                    if (i < mr) dot[i] = _mm512_dpbusd_epi32(dot[i], v, _mm512_set1_epi32(four_bytes(xq + i * cols + k)));
            }
        }
        const __m512 s = _mm512_loadu_ps(scale + g * I8_PANEL), o = _mm512_loadu_ps(offset + g * I8_PANEL);
        #pragma GCC unroll 12
        for (int i = 0; i < I8_MP; i++) {
            if (i < mr) {
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]), _mm512_mul_ps(s, _mm512_set1_ps(xd[i * blocks + b])),
                                         acc[i]);
                acc[i] = _mm512_fmadd_ps(o, _mm512_set1_ps(xsum[i * blocks + b]), acc[i]);
            }
        }
    }
    for (int i = 0; i < mr; i++) _mm512_storeu_ps(tile + i * I8_PANEL, acc[i]);
}
#elif defined(I8_AVX2)
/* 4 products summed per 32-bit lane: u (unsigned, < 128) times x (signed bytes). */
static inline __m256i dot4(__m256i u, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
}

static inline __attribute__((always_inline)) void int8_tile(const int8_t *xq, const float *xd, const float *xsum,
                                                            int64_t cols, int64_t ablock, const uint8_t *q,
                                                            const float *scale, const float *offset, int64_t group,
                                                            int bits, int mr, float *tile) {
    const int64_t blocks = cols / ablock;
    __m256 acc[I8_MP][2];
    for (int i = 0; i < I8_MP; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    const __m256i nibble = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8((char)0x80);
    /* 8-bit weights are multiplied as u - 128 (signed, |.| <= 128): the offset takes 128 * scale back */
    const __m256 shift = _mm256_set1_ps(bits == 8 ? 128.0f : 0.0f);
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t k0 = b * ablock, g = k0 / group;
        __m256i dot[I8_MP][2];
        for (int i = 0; i < I8_MP; i++) dot[i][0] = dot[i][1] = _mm256_setzero_si256();
        if (bits == 4) {
            for (int64_t k = k0; k < k0 + ablock; k += 8) {
                for (int h = 0; h < 2; h++) {   /* rows 0..7, then 8..15 */
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(q + k * 8 + 32 * h));
                    const __m256i lo = _mm256_and_si256(v, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
                    for (int i = 0; i < I8_MP; i++) {
                        if (i < mr) {
                            const int8_t *xr = xq + i * cols + k;
                            dot[i][h] = _mm256_add_epi32(dot[i][h], dot4(lo, _mm256_set1_epi32(four_bytes(xr))));
                            dot[i][h] = _mm256_add_epi32(dot[i][h], dot4(hi, _mm256_set1_epi32(four_bytes(xr + 4))));
                        }
                    }
                }
            }
        } else {
            for (int64_t k = k0; k < k0 + ablock; k += 4) {
                for (int h = 0; h < 2; h++) {
                    __m256i v = _mm256_loadu_si256((const __m256i *)(q + k * 16 + 32 * h));
                    if (bits == 8) v = _mm256_xor_si256(v, flip);   /* u - 128 as signed bytes */
                    const __m256i mag = bits == 8 ? _mm256_abs_epi8(v) : v;
                    for (int i = 0; i < I8_MP; i++) {
                        if (i < mr) {
                            __m256i x = _mm256_set1_epi32(four_bytes(xq + i * cols + k));
                            if (bits == 8) x = _mm256_sign_epi8(x, v);
                            dot[i][h] = _mm256_add_epi32(dot[i][h], dot4(mag, x));
                        }
                    }
                }
            }
        }
        for (int h = 0; h < 2; h++) {
            const __m256 s = _mm256_loadu_ps(scale + g * I8_PANEL + 8 * h);
            const __m256 o = _mm256_fmadd_ps(shift, s, _mm256_loadu_ps(offset + g * I8_PANEL + 8 * h));
            for (int i = 0; i < I8_MP; i++) {
                if (i < mr) {
                    acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i][h]),
                                                _mm256_mul_ps(s, _mm256_set1_ps(xd[i * blocks + b])), acc[i][h]);
                    acc[i][h] = _mm256_fmadd_ps(o, _mm256_set1_ps(xsum[i * blocks + b]), acc[i][h]);
                }
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(tile + i * I8_PANEL + 8 * h, acc[i][h]);
}
#else
static inline void int8_tile(const int8_t *xq, const float *xd, const float *xsum, int64_t cols, int64_t ablock,
                             const uint8_t *q, const float *scale, const float *offset, int64_t group, int bits,
                             int mr, float *tile) {
    const int64_t blocks = cols / ablock;
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < I8_PANEL; j++) tile[i * I8_PANEL + j] = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t k0 = b * ablock, g = k0 / group;
        for (int i = 0; i < mr; i++) {
            const int8_t *xr = xq + i * cols;
            for (int j = 0; j < I8_PANEL; j++) {
                int32_t dot = 0;
                for (int64_t k = k0; k < k0 + ablock; k++) {
                    const int u = bits == 4 ? (q[(k / 8) * 64 + j * 4 + k % 4] >> (k % 8 < 4 ? 0 : 4)) & 0x0F
                                            : q[(k / 4) * 64 + j * 4 + k % 4];
                    dot += u * xr[k];
                }
                tile[i * I8_PANEL + j] += (float)dot * (scale[g * I8_PANEL + j] * xd[i * blocks + b])
                                          + offset[g * I8_PANEL + j] * xsum[i * blocks + b];
            }
        }
    }
}
#endif

/* Copies for each row count, so the compiler unrolls the row loops with mr a constant. */
static void int8_rows(const int8_t *xq, const float *xd, const float *xsum, int64_t cols, int64_t ablock,
                      const uint8_t *q, const float *scale, const float *offset, int64_t group, int bits, int mr,
                      float *tile) {
#define I8_TILE(R) (bits == 4 ? int8_tile(xq, xd, xsum, cols, ablock, q, scale, offset, group, 4, R, tile) \
                              : int8_tile(xq, xd, xsum, cols, ablock, q, scale, offset, group, 8, R, tile))
    switch (mr) {
        case 1: I8_TILE(1); break;
        case 2: I8_TILE(2); break;
        case 3: I8_TILE(3); break;
#if I8_MP > 4
        case 4: I8_TILE(4); break; case 5: I8_TILE(5); break; case 6: I8_TILE(6); break;
        case 7: I8_TILE(7); break; case 8: I8_TILE(8); break; case 9: I8_TILE(9); break;
        case 10: I8_TILE(10); break; case 11: I8_TILE(11); break;
#endif
        default: I8_TILE(I8_MP); break;
    }
#undef I8_TILE
}

/* x [rows, cols] float32 (rows x_stride floats apart) quantized per row and block of ablock
 * columns, times w [n_out, cols] transposed (the panel layout above, ceil(n_out / 16) panels) ->
 * out [rows, n_out] (rows out_stride floats apart), plus bias [n_out] when not NULL. bits: 4
 * (nibble runs) or 8 (bytes; any unsigned weight up to 8 bits). Returns 0, -1 for a shape the
 * layout cannot have, -2 when out of memory. */
int quantized_matmul_int8act(const float *x, int64_t x_stride, const uint8_t *q, const float *scale,
                             const float *offset, const float *bias, float *out, int64_t out_stride, int64_t rows,
                             int64_t n_out, int64_t cols, int64_t group, int64_t ablock, int bits, int num_threads) {
    if ((bits != 4 && bits != 8) || group <= 0 || ablock <= 0 || ablock % 8 || cols % group || group % ablock)
        return -1;
    const int64_t blocks = cols / ablock;
    int8_t *xq = malloc((size_t)(rows * cols));
    float *xd = malloc((size_t)(rows * blocks) * sizeof(float)), *xsum = malloc((size_t)(rows * blocks) * sizeof(float));
    if (!xq || !xd || !xsum) {
        free(xq), free(xd), free(xsum);
        return -2;
    }
    const int parallel = num_threads > 1 && n_out * cols >= I8_PARALLEL_MIN_WEIGHTS;
    /* A decode step's few rows are quantized in microseconds: a thread team of their own would
     * cost more (and on a busy machine, a wait for every thread to be scheduled). */
    #pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && rows * cols >= I8_PARALLEL_MIN_WEIGHTS) \
        schedule(static)
    for (int64_t m = 0; m < rows; m++)
        quantize_row(x + m * x_stride, cols, ablock, xq + m * cols, xd + m * blocks, xsum + m * blocks);
    const int64_t panels = (n_out + I8_PANEL - 1) / I8_PANEL, groups = cols / group;
    const int64_t panel_bytes = cols * I8_PANEL * bits / 8;
    #pragma omp parallel for num_threads(num_threads) if (parallel) schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        float tile[I8_MP * I8_PANEL];
        const int64_t n0 = p * I8_PANEL;
        const int np = n_out - n0 < I8_PANEL ? (int)(n_out - n0) : I8_PANEL;
        for (int64_t m0 = 0; m0 < rows; m0 += I8_MP) {
            const int mr = rows - m0 < I8_MP ? (int)(rows - m0) : I8_MP;
            int8_rows(xq + m0 * cols, xd + m0 * blocks, xsum + m0 * blocks, cols, ablock, q + p * panel_bytes,
                      scale + p * groups * I8_PANEL, offset + p * groups * I8_PANEL, group, bits, mr, tile);
            for (int i = 0; i < mr; i++) {
                float *o = out + (m0 + i) * out_stride + n0;
                for (int j = 0; j < np; j++) o[j] = tile[i * I8_PANEL + j] + (bias ? bias[n0 + j] : 0.0f);
            }
        }
    }
    free(xq), free(xd), free(xsum);
    return 0;
}
