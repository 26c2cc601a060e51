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
 * or, for GGUF's 5- and 6-bit types held packed (rein/kernels/packed_bits.py), with GGUF's
 * two-level scales and an integer zero:
 *
 *     w[n, k] = scale_g[n, k / group] * (q[n, k] - zero) + offset_g[n, k / group]
 *     bits 5, 6: q uint8 [panel]: nibbles [k][8] as bits 4 above, then one plane per high bit,
 *                uint16 [k] each (bit j: row j's bit 4, then bit 5)
 *     scale_g = float16 scale [panel][k / block][16] x int8 scale_sub [panel][k / group][16]
 *     (no sub: x 1), offset_g likewise (or none)
 *
 * -- the group's scale and offset are made once per group in a 16-float buffer (zero folded into
 * the offset), and the integers are made as int8 columns and multiplied as 8-bit ones: four
 * columns a 512-bit vector in registers with AVX-512BW (nibbles split, each plane one masked
 * byte add), else 16 columns at a time into an int8 [16][16] buffer in L1 (AVX2: a byte
 * shuffle and compare per plane; plain C: loops).
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
#if defined(__F16C__) && !defined(__AVX2__)
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
#define V_MUL(a, b) _mm512_mul_ps(a, b)
#define V_ADD(a, b) _mm512_add_ps(a, b)
#elif defined(__AVX2__) && defined(__FMA__)
#define VL 8
#define MP 6
typedef __m256 vf;
#define V_ZERO() _mm256_setzero_ps()
#define V_LOAD(p) _mm256_loadu_ps(p)
#define V_STORE(p, v) _mm256_storeu_ps(p, v)
#define V_SET1(s) _mm256_set1_ps(s)
#define V_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define V_MUL(a, b) _mm256_mul_ps(a, b)
#define V_ADD(a, b) _mm256_add_ps(a, b)
#else
#define VL 1
#define MP 4
typedef float vf;
#define V_ZERO() 0.0f
#define V_LOAD(p) (*(p))
#define V_STORE(p, v) (*(p) = (v))
#define V_SET1(s) (s)
#define V_FMA(a, b, c) ((a) * (b) + (c))
#define V_MUL(a, b) ((a) * (b))
#define V_ADD(a, b) ((a) + (b))
#endif
#define NV (PANEL / VL)

/* Below this many weights a call is not worth waking a thread team for. */
#define PARALLEL_MIN_WEIGHTS 65536

/* A panel's scales and offsets, in one of the two forms above. */
typedef struct {
    const float *scale, *offset;              /* bits 4, 8: float32 [groups][16] */
    const uint16_t *scale_hi, *offset_hi;     /* bits 5, 6: float16 [blocks][16] */
    const int8_t *scale_sub, *offset_sub;     /* bits 5, 6: int8 [groups][16], or NULL */
    int64_t ratio;                            /* groups per block */
    float zero;
} scales_t;

static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t bits;
    float f;
    if (exp == 0) {   /* zero or subnormal: man x 2^-24, exact in float */
        f = (float)man * (1.0f / 16777216.0f);
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    memcpy(&f, &bits, 4);
    return f;
}

/* VL float16 / int8 -> VL floats. */
#if VL == 16
#define V_HALVES(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define V_INT8S(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#elif VL == 8
#if defined(__F16C__)
#define V_HALVES(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#else
#define V_HALVES(p) _mm256_setr_ps(half_to_float((p)[0]), half_to_float((p)[1]), half_to_float((p)[2]), \
                                   half_to_float((p)[3]), half_to_float((p)[4]), half_to_float((p)[5]), \
                                   half_to_float((p)[6]), half_to_float((p)[7]))
#endif
#define V_INT8S(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#endif

/* Group g's 16 scales and offsets: pointers into the float32 form, or made in sbuf / obuf from
 * the two-level form with the zero folded into the offset (scale * q + (offset - zero * scale)). */
static inline __attribute__((always_inline)) void group_scales(const scales_t *sc, int packed, int64_t g,
                                                               float *sbuf, float *obuf, const float **s,
                                                               const float **o) {
    if (!packed) {
        *s = sc->scale + g * PANEL;
        *o = sc->offset ? sc->offset + g * PANEL : NULL;
        return;
    }
    const int64_t b = g / sc->ratio;
    const int8_t *ssub = sc->scale_sub ? sc->scale_sub + g * PANEL : NULL;
    const int8_t *osub = sc->offset_sub ? sc->offset_sub + g * PANEL : NULL;
#if VL >= 8
    for (int v = 0; v < NV; v++) {   /* VL lanes at a time: float16 -> float32, x int8, zero folded in */
        const vf top = V_HALVES(sc->scale_hi + b * PANEL + v * VL);
        const vf scale = ssub ? V_MUL(top, V_INT8S(ssub + v * VL)) : top;
        vf offset = V_ZERO();
        if (sc->offset_hi) {
            offset = V_HALVES(sc->offset_hi + b * PANEL + v * VL);
            if (osub) offset = V_MUL(offset, V_INT8S(osub + v * VL));
        }
        offset = V_FMA(V_SET1(-sc->zero), scale, offset);
        V_STORE(sbuf + v * VL, scale);
        V_STORE(obuf + v * VL, offset);
    }
#else
    for (int j = 0; j < PANEL; j++) {
        sbuf[j] = half_to_float(sc->scale_hi[b * PANEL + j]) * (ssub ? (float)ssub[j] : 1.0f);
        obuf[j] = sc->offset_hi ? half_to_float(sc->offset_hi[b * PANEL + j]) * (osub ? (float)osub[j] : 1.0f) : 0.0f;
        obuf[j] -= sc->zero * sbuf[j];
    }
#endif
    *s = sbuf;
    *o = sc->offset_hi || sc->zero != 0.0f ? obuf : NULL;
}

/* The one-row kernel asks for a panel's integers this many columns ahead of their use. */
#define PREFETCH_COLUMNS 64

/* Column k of a panel's integers as NV vectors of floats, unscaled (bits 4: 0..15; bits 8: int8). */
static inline __attribute__((always_inline)) void column_ints(const uint8_t *q, int bits, int64_t k, vf *w) {
#if VL == 16
    if (bits == 4) {
        const __m128i packed = _mm_loadl_epi64((const __m128i *)(q + k * 8));
        const __m128i mask = _mm_set1_epi8(0x0F);
        w[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
            _mm_unpacklo_epi64(_mm_and_si128(packed, mask), _mm_and_si128(_mm_srli_epi16(packed, 4), mask))));
    } else {
        w[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + k * 16))));
    }
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
#else
    for (int j = 0; j < PANEL; j++)
        w[j] = (float)(bits == 4 ? (q[k * 8 + j % 8] >> (j < 8 ? 0 : 4)) & 0x0F : ((const int8_t *)q)[k * 16 + j]);
#endif
}

/* Column k of a panel as NV vectors of floats: scale * q + offset (s, o: the group's 16 each). */
static inline __attribute__((always_inline)) void column(const uint8_t *q, int bits, int64_t k, const float *s,
                                                         const float *o, vf *w) {
    column_ints(q, bits, k, w);
#if VL >= 8
    for (int v = 0; v < NV; v++)
        w[v] = o ? V_FMA(w[v], V_LOAD(s + v * VL), V_LOAD(o + v * VL)) : V_MUL(w[v], V_LOAD(s + v * VL));
#else
    for (int j = 0; j < PANEL; j++) w[j] = w[j] * s[j] + (o ? o[j] : 0.0f);
#endif
}

#if VL == 16 && defined(__AVX512BW__)
/* Columns k..k + 3 of a 5/6-bit panel as int8 in one 512-bit vector, column by 128-bit lane:
 * their 32 nibble bytes split and put in column order, then each plane's 64 bits (the 4
 * columns' words, contiguous) added under a byte mask. */
static inline __attribute__((always_inline)) __m512i expand_four(const uint8_t *q, int64_t cols, int bits,
                                                                 int64_t k) {
    const __m256i mask = _mm256_set1_epi8(0x0F);
    const __m256i v = _mm256_loadu_si256((const __m256i *)(q + k * 8));
    const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
    const __m512i lanes = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_unpacklo_epi64(lo, hi)),
                                             _mm256_unpackhi_epi64(lo, hi), 1);   /* k, k+2, k+1, k+3 */
    __m512i four = _mm512_shuffle_i64x2(lanes, lanes, _MM_SHUFFLE(3, 1, 2, 0));
    for (int p = 0; p < bits - 4; p++) {
        uint64_t m;
        memcpy(&m, q + cols * 8 + p * cols * 2 + k * 2, 8);
        four = _mm512_mask_add_epi8(four, (__mmask64)m, four, _mm512_set1_epi8((char)(16 << p)));
    }
    return four;
}
#endif

/* Columns k0..k0 + 15 of a 5/6-bit panel (q: the panel's bytes, cols its columns) as int8
 * [16 columns][16 rows] in buf (0..63, the 8-bit panel layout). */
#define EXPAND 16
static inline __attribute__((always_inline)) void expand_packed(const uint8_t *q, int64_t cols, int bits, int64_t k0,
                                                                int8_t *buf) {
    const uint8_t *nib = q + k0 * 8;
#if VL == 16 && defined(__AVX512BW__)
    for (int c = 0; c < EXPAND; c += 4) _mm512_storeu_si512((void *)(buf + c * 16), expand_four(q, cols, bits, k0 + c));
#elif VL >= 8
    const __m256i mask = _mm256_set1_epi8(0x0F);
#if !(defined(__AVX512BW__) && defined(__AVX512VL__))
    /* byte i of a 2-column vector: bit (i % 8) of the plane byte (i / 8) -- a per-lane shuffle */
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i select = _mm256_set1_epi64x(0x8040201008040201LL);
#endif
    for (int c = 0; c < EXPAND; c += 4) {
        /* 4 columns' nibbles: per 128-bit lane, column c (lo 8, hi 8) and c + 2, then c + 1 and c + 3 */
        const __m256i v = _mm256_loadu_si256((const __m256i *)(nib + c * 8));
        const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
        const __m256i even = _mm256_unpacklo_epi64(lo, hi), odd = _mm256_unpackhi_epi64(lo, hi);
        __m256i pair[2] = {_mm256_permute2x128_si256(even, odd, 0x20), _mm256_permute2x128_si256(even, odd, 0x31)};
        for (int p = 0; p < bits - 4; p++) {
            const uint8_t *plane = q + cols * 8 + p * cols * 2 + (k0 + c) * 2;
            for (int h = 0; h < 2; h++) {
                uint32_t m;   /* columns c + 2h and c + 2h + 1: 32 rows' bits */
                memcpy(&m, plane + 4 * h, 4);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
                pair[h] = _mm256_mask_add_epi8(pair[h], (__mmask32)m, pair[h], _mm256_set1_epi8((char)(16 << p)));
#else
                const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)m), spread);
                const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, select), select);
                pair[h] = _mm256_or_si256(pair[h], _mm256_and_si256(set, _mm256_set1_epi8((char)(16 << p))));
#endif
            }
        }
        _mm256_storeu_si256((__m256i *)(buf + c * 16), pair[0]);
        _mm256_storeu_si256((__m256i *)(buf + c * 16 + 32), pair[1]);
    }
#else
    for (int c = 0; c < EXPAND; c++)
        for (int j = 0; j < PANEL; j++) {
            int value = (nib[c * 8 + j % 8] >> (j < 8 ? 0 : 4)) & 0x0F;
            for (int p = 0; p < bits - 4; p++) {
                const uint8_t *plane = q + cols * 8 + p * cols * 2 + (k0 + c) * 2;
                value |= ((plane[j / 8] >> (j % 8)) & 1) << (4 + p);
            }
            buf[c * 16 + j] = (int8_t)value;
        }
#endif
}

/* out tile [mr x 16] of one panel: x rows 0..mr times the panel, column by column expanded in
 * registers (decode: no buffer, each column used by all mr rows). */
static inline __attribute__((always_inline)) void fused_tile(const float *x, int64_t x_stride, const uint8_t *q,
                                                             const scales_t *sc, int64_t cols, int64_t group,
                                                             int bits, int mr, float *tile) {
    vf acc[MP][NV];
    float sbuf[PANEL] __attribute__((aligned(64))), obuf[PANEL] __attribute__((aligned(64)));
    for (int i = 0; i < MP; i++)
        for (int v = 0; v < NV; v++) acc[i][v] = V_ZERO();
    const int packed = bits == 5 || bits == 6;
#if VL == 16 && defined(__AVX512BW__)
    if (packed) {   /* 4 columns at a time, expanded and used in registers */
        for (int64_t g = 0; g < cols / group; g++) {
            const float *s, *o;
            group_scales(sc, packed, g, sbuf, obuf, &s, &o);
            const vf sv = V_LOAD(s), ov = o ? V_LOAD(o) : V_ZERO();
            for (int64_t k = g * group; k < (g + 1) * group; k += 4) {
                const __m512i four = expand_four(q, cols, bits, k);
                const vf w[4] = {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(four, 0))),
                                 _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(four, 1))),
                                 _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(four, 2))),
                                 _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(four, 3)))};
                for (int j = 0; j < 4; j++) {
                    const vf wj = V_FMA(w[j], sv, ov);
                    #pragma GCC unroll 12
                    for (int i = 0; i < MP; i++)
                        if (i < mr) acc[i][0] = V_FMA(wj, V_SET1(x[i * x_stride + k + j]), acc[i][0]);
                }
            }
        }
        for (int i = 0; i < mr; i++) V_STORE(tile + i * PANEL, acc[i][0]);
        return;
    }
#endif
    const int64_t step = packed ? EXPAND : group;   /* columns expanded at a time (packed: to int8 in L1) */
    int8_t ints[EXPAND * PANEL] __attribute__((aligned(64)));
    for (int64_t g = 0; g < cols / group; g++) {
        const float *s, *o;
        group_scales(sc, packed, g, sbuf, obuf, &s, &o);
        for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += step) {
            if (packed) expand_packed(q, cols, bits, k0, ints);
            for (int64_t k = k0; k < k0 + step; k++) {
                vf w[NV];
                if (packed) column((const uint8_t *)ints, 8, k - k0, s, o, w);
                else column(q, bits, k, s, o, w);
                #pragma GCC unroll 12
                for (int i = 0; i < MP; i++) {
                    if (i < mr) {
                        const vf xb = V_SET1(x[i * x_stride + k]);
                        for (int v = 0; v < NV; v++) acc[i][v] = V_FMA(w[v], xb, acc[i][v]);
                    }
                }
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < NV; v++) V_STORE(tile + i * PANEL + v * VL, acc[i][v]);
}

/* fused_tile for one row (decode at batch 1) whose group is a multiple of 4, with the group's
 * scale and offset taken out of the sum: per group, out += scale * sum_k(q_k x_k) + offset *
 * sum_k(x_k) (xsum[g], made once per call), so a column costs its integers' conversion and one
 * multiply-add where it cost two (the weight made first, then multiplied). The sums of q x
 * run in four accumulators (one per column of each run of four): with one, every column waited
 * for the previous column's multiply-add. The floats differ from fused_tile's by rounding only. */
static inline __attribute__((always_inline)) void fused_row(const float *x, const float *xsum, const uint8_t *q,
                                                            const scales_t *sc, int64_t cols, int64_t group,
                                                            int bits, float *tile) {
    vf acc[NV];
    float sbuf[PANEL] __attribute__((aligned(64))), obuf[PANEL] __attribute__((aligned(64)));
    for (int v = 0; v < NV; v++) acc[v] = V_ZERO();
    const int packed = bits == 5 || bits == 6;
    int8_t ints[EXPAND * PANEL] __attribute__((aligned(64)));
    for (int64_t g = 0; g < cols / group; g++) {
        const float *s, *o;
        group_scales(sc, packed, g, sbuf, obuf, &s, &o);
        vf part[4][NV];
        for (int j = 0; j < 4; j++)
            for (int v = 0; v < NV; v++) part[j][v] = V_ZERO();
#if VL == 16 && defined(__AVX512BW__)
        if (packed) {   /* 4 columns at a time, expanded and used in registers */
            for (int64_t k = g * group; k < (g + 1) * group; k += 4) {
                const __m512i four = expand_four(q, cols, bits, k);
                part[0][0] = V_FMA(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(four, 0))),
                                   V_SET1(x[k]), part[0][0]);
                part[1][0] = V_FMA(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(four, 1))),
                                   V_SET1(x[k + 1]), part[1][0]);
                part[2][0] = V_FMA(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(four, 2))),
                                   V_SET1(x[k + 2]), part[2][0]);
                part[3][0] = V_FMA(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(four, 3))),
                                   V_SET1(x[k + 3]), part[3][0]);
            }
        } else
#endif
        {
            const int64_t step = packed ? EXPAND : group;   /* columns expanded at a time (packed: to int8 in L1) */
            for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += step) {
                if (packed) expand_packed(q, cols, bits, k0, ints);
                for (int64_t k = k0; k < k0 + step; k += 4) {
#if VL >= 8
                    if (!packed) _mm_prefetch((const char *)q + (k + PREFETCH_COLUMNS) * 2 * bits, _MM_HINT_T0);
#endif
                    #pragma GCC unroll 4
                    for (int j = 0; j < 4; j++) {
                        vf w[NV];
                        if (packed) column_ints((const uint8_t *)ints, 8, k + j - k0, w);
                        else column_ints(q, bits, k + j, w);
                        const vf xb = V_SET1(x[k + j]);
                        for (int v = 0; v < NV; v++) part[j][v] = V_FMA(w[v], xb, part[j][v]);
                    }
                }
            }
        }
        for (int v = 0; v < NV; v++) {
            const vf sum = V_ADD(V_ADD(part[0][v], part[1][v]), V_ADD(part[2][v], part[3][v]));
            acc[v] = V_FMA(sum, V_LOAD(s + v * VL), acc[v]);
            if (o) acc[v] = V_FMA(V_LOAD(o + v * VL), V_SET1(xsum[g]), acc[v]);
        }
    }
    for (int v = 0; v < NV; v++) V_STORE(tile + v * VL, acc[v]);
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

static void fused_rows(const float *x, const float *xsum, int64_t x_stride, const uint8_t *q, const scales_t *sc,
                       int64_t cols, int64_t group, int bits, int mr, float *tile) {
    if (mr == 1 && xsum) {
        switch (bits) {
            case 4: fused_row(x, xsum, q, sc, cols, group, 4, tile); return;
            case 5: fused_row(x, xsum, q, sc, cols, group, 5, tile); return;
            case 6: fused_row(x, xsum, q, sc, cols, group, 6, tile); return;
            default: fused_row(x, xsum, q, sc, cols, group, 8, tile); return;
        }
    }
#define FUSED(R) (bits == 4   ? fused_tile(x, x_stride, q, sc, cols, group, 4, R, tile) \
                  : bits == 5 ? fused_tile(x, x_stride, q, sc, cols, group, 5, R, tile) \
                  : bits == 6 ? fused_tile(x, x_stride, q, sc, cols, group, 6, R, tile) \
                              : fused_tile(x, x_stride, q, sc, cols, group, 8, R, tile))
    FOR_EACH_ROW_COUNT(FUSED)
#undef FUSED
}

static void dense_rows(const float *x, int64_t x_stride, const float *wt, int64_t cols, int mr, float *tile) {
#define DENSE(R) dense_tile(x, x_stride, wt, cols, R, tile)
    FOR_EACH_ROW_COUNT(DENSE)
#undef DENSE
}

/* Panel p of w expanded to float32 into wt [cols][16]. */
static void expand_panel(const uint8_t *q, const scales_t *sc, int64_t cols, int64_t group, int bits, float *wt) {
    float sbuf[PANEL] __attribute__((aligned(64))), obuf[PANEL] __attribute__((aligned(64)));
    const int packed = bits == 5 || bits == 6;
    const int64_t step = packed ? EXPAND : group;   /* columns expanded at a time (packed: to int8 in L1) */
    int8_t ints[EXPAND * PANEL] __attribute__((aligned(64)));
    for (int64_t g = 0; g < cols / group; g++) {
        const float *s, *o;
        group_scales(sc, packed, g, sbuf, obuf, &s, &o);
        for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += step) {
            if (packed) expand_packed(q, cols, bits, k0, ints);
            for (int64_t k = k0; k < k0 + step; k++) {
                vf w[NV];
                if (packed) column((const uint8_t *)ints, 8, k - k0, s, o, w);
                else column(q, bits, k, s, o, w);
                for (int v = 0; v < NV; v++) V_STORE(wt + k * PANEL + v * VL, w[v]);
            }
        }
    }
}

int quantized_panels_mp(void) { return MP; }

/* The product over all panels; `all` points at panel 0's scales, `blocks` per panel row. */
static int matmul(const float *x, int64_t x_stride, const uint8_t *q, const scales_t *all, const float *bias,
                  float *out, int64_t out_stride, int64_t rows, int64_t n_out, int64_t cols, int64_t group,
                  int64_t blocks, int bits, int num_threads) {
    const int64_t panels = (n_out + PANEL - 1) / PANEL, groups = cols / group;
    const int64_t panel_bytes = cols * PANEL * bits / 8;
    const int fused = rows <= MP;   /* one tile of rows: expand in registers, no buffer */
    /* One row (decode at batch 1) whose groups are runs of four columns: fused_row, with the
     * row's sum over each group made here once. */
    float *xsum = rows == 1 && group % 4 == 0 ? malloc((size_t)groups * sizeof(float)) : NULL;
    if (xsum)
        for (int64_t g = 0; g < groups; g++) {
            float sum = 0.0f;
            for (int64_t k = g * group; k < (g + 1) * group; k++) sum += x[k];
            xsum[g] = sum;
        }
    #pragma omp parallel num_threads(num_threads) if (num_threads > 1 && n_out * cols >= PARALLEL_MIN_WEIGHTS)
    {
        float *wt = fused ? NULL : aligned_alloc(64, (size_t)(cols * PANEL) * sizeof(float));
        float tile[MP * PANEL];
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const uint8_t *qp = q + p * panel_bytes;
            const int64_t per_group = p * groups * PANEL, per_block = p * blocks * PANEL;
            scales_t sc = *all;
            if (sc.scale) sc.scale += per_group;
            if (sc.offset) sc.offset += per_group;
            if (sc.scale_hi) sc.scale_hi += per_block;
            if (sc.offset_hi) sc.offset_hi += per_block;
            if (sc.scale_sub) sc.scale_sub += per_group;
            if (sc.offset_sub) sc.offset_sub += per_group;
            const int64_t n0 = p * PANEL;
            const int np = n_out - n0 < PANEL ? (int)(n_out - n0) : PANEL;
            if (!fused) expand_panel(qp, &sc, cols, group, bits, wt);
            for (int64_t m0 = 0; m0 < rows; m0 += MP) {
                const int mr = rows - m0 < MP ? (int)(rows - m0) : MP;
                if (fused) fused_rows(x + m0 * x_stride, xsum, x_stride, qp, &sc, cols, group, bits, mr, tile);
                else dense_rows(x + m0 * x_stride, x_stride, wt, cols, mr, tile);
                for (int i = 0; i < mr; i++) {
                    float *o = out + (m0 + i) * out_stride + n0;
                    for (int j = 0; j < np; j++) o[j] = tile[i * PANEL + j] + (bias ? bias[n0 + j] : 0.0f);
                }
            }
        }
        free(wt);
    }
    free(xsum);
    return 0;
}

/* x [rows, cols] (rows x_stride floats apart) times w [n_out, cols] transposed -> out [rows, n_out]
 * (rows out_stride floats apart), plus bias [n_out] when not NULL. w: the 4- or 8-bit panel
 * layout above, ceil(n_out / 16) panels (the last one's missing rows are zeros, never written
 * out). Returns 0, or -1 for a shape the layout cannot have (group not dividing cols). */
int quantized_matmul_f32(const float *x, int64_t x_stride, const uint8_t *q, const float *scale,
                         const float *offset, const float *bias, float *out, int64_t out_stride, int64_t rows,
                         int64_t n_out, int64_t cols, int64_t group, int bits, int num_threads) {
    if (group <= 0 || cols % group || (bits != 4 && bits != 8)) return -1;
    const scales_t sc = {scale, offset, NULL, NULL, NULL, NULL, 1, 0.0f};
    return matmul(x, x_stride, q, &sc, bias, out, out_stride, rows, n_out, cols, group, cols / group, bits,
                  num_threads);
}

/* The same for the packed 5- and 6-bit layout: scale_hi and offset_hi (or NULL) float16
 * [panel][cols / block][16], scale_sub and offset_sub (or NULL) int8 [panel][cols / group][16],
 * zero the integer subtracted. Returns -1 for a shape the layout cannot have. */
int quantized_matmul_packed_f32(const float *x, int64_t x_stride, const uint8_t *q, const uint16_t *scale_hi,
                                const int8_t *scale_sub, const uint16_t *offset_hi, const int8_t *offset_sub,
                                int zero, const float *bias, float *out, int64_t out_stride, int64_t rows,
                                int64_t n_out, int64_t cols, int64_t group, int64_t block, int bits,
                                int num_threads) {
    if (group <= 0 || group % EXPAND || block <= 0 || cols % block || block % group || (bits != 5 && bits != 6) || !scale_hi ||
        (offset_sub && !offset_hi))
        return -1;
    const scales_t sc = {NULL, NULL, scale_hi, offset_hi, scale_sub, offset_sub, block / group, (float)zero};
    return matmul(x, x_stride, q, &sc, bias, out, out_stride, rows, n_out, cols, group, cols / block, bits,
                  num_threads);
}
