/* LoRA adapter products on the CPU, float32: for one projection (or one part of a fused one)
 * and every token t of a step whose adapter slot s is live,
 *
 *     out[t, offset : offset + N] += B[s] @ (A[s] @ x[t])
 *
 * with A [S, R, in] and B [S, N, R] the projection's per-slot stacks (ranks zero-padded to R;
 * rein/model/lora/layers.py). torch does this as an index_select, two small matmuls and an
 * index_add per adapter per projection (bench/lora.py: 960 such groups a SmolLM2 step at 8
 * adapters); here it is one call per projection part.
 *
 * The step's tokens come sorted by slot (`order`, built once a step by LoRAModel.step) and cut
 * into chunks of at most a few tokens of one slot (`chunks`: slot, begin, end into `order`).
 * Each chunk reads its slot's A and B once for all its tokens: an adapter's weights are
 * streamed once per chunk, not once per token. Chunks write disjoint output rows, so they run
 * in parallel without locks (OpenMP, as the other kernels).
 *
 * Built and loaded with the other kernels by rein/kernels/cpu_native.py.
 */
#include <stdint.h>
#include <string.h>

/* Output columns per B tile: B [N, R] is read a tile of rows at a time, transposed to [R, TILE]
 * so that the expand's inner loop runs along the output columns (16 lanes: one AVX-512 vector). */
#define TILE 16
/* The largest chunk (tokens of one slot handled together) and rank the kernel takes; the
 * caller (cpu_native.lora_apply) cuts chunks to at most MAX_CHUNK and falls back above MAX_RANK. */
#define MAX_CHUNK 32
#define MAX_RANK 512
/* Work too small to be worth waking a thread team for (multiply-adds). */
#define PARALLEL_MIN_WORK 262144

int lora_max_chunk(void) { return MAX_CHUNK; }
int lora_max_rank(void) { return MAX_RANK; }

/* buf[j, :] = A_s @ x[tokens[j]] for the n tokens of one chunk (n <= MAX_CHUNK). Four tokens
 * at a time share each load of A's row. */
static void shrink(const float *x, int64_t x_stride, const int64_t *tokens, int64_t n, const float *a,
                   int64_t rank, int64_t in, float *buf) {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        const float *x0 = x + tokens[j] * x_stride, *x1 = x + tokens[j + 1] * x_stride;
        const float *x2 = x + tokens[j + 2] * x_stride, *x3 = x + tokens[j + 3] * x_stride;
        for (int64_t r = 0; r < rank; r++) {
            const float *ar = a + r * in;
            float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
            #pragma omp simd reduction(+:s0, s1, s2, s3)
            for (int64_t k = 0; k < in; k++) {
                const float w = ar[k];
                s0 += w * x0[k];
                s1 += w * x1[k];
                s2 += w * x2[k];
                s3 += w * x3[k];
            }
            buf[j * rank + r] = s0;
            buf[(j + 1) * rank + r] = s1;
            buf[(j + 2) * rank + r] = s2;
            buf[(j + 3) * rank + r] = s3;
        }
    }
    for (; j < n; j++) {
        const float *xj = x + tokens[j] * x_stride;
        for (int64_t r = 0; r < rank; r++) {
            const float *ar = a + r * in;
            float s = 0.0f;
            #pragma omp simd reduction(+:s)
            for (int64_t k = 0; k < in; k++) s += ar[k] * xj[k];
            buf[j * rank + r] = s;
        }
    }
}

/* out[tokens[j], offset + c] += sum_r B_s[c, r] * buf[j, r] for the chunk's n tokens. */
static void expand(const float *buf, int64_t n, const float *b, int64_t rank, int64_t cols, float *out,
                   int64_t out_stride, int64_t offset, const int64_t *tokens) {
    float bt[MAX_RANK * TILE];
    for (int64_t c0 = 0; c0 < cols; c0 += TILE) {
        const int64_t width = cols - c0 < TILE ? cols - c0 : TILE;
        /* This tile of B transposed to [rank, TILE], columns past `width` zero. */
        for (int64_t r = 0; r < rank; r++)
            for (int64_t i = 0; i < TILE; i++) bt[r * TILE + i] = i < width ? b[(c0 + i) * rank + r] : 0.0f;
        for (int64_t j = 0; j < n; j++) {
            const float *bj = buf + j * rank;
            float acc[TILE] = {0};
            for (int64_t r = 0; r < rank; r++) {
                const float v = bj[r];
                const float *row = bt + r * TILE;
                #pragma omp simd
                for (int64_t i = 0; i < TILE; i++) acc[i] += row[i] * v;
            }
            float *o = out + tokens[j] * out_stride + offset + c0;
            if (width == TILE) {
                #pragma omp simd
                for (int64_t i = 0; i < TILE; i++) o[i] += acc[i];
            } else {
                for (int64_t i = 0; i < width; i++) o[i] += acc[i];
            }
        }
    }
}

/* x [T, in] (rows x_stride floats apart, unit column stride); out [T, >= offset + cols] (rows
 * out_stride apart), added to in place; lora_a [S, rank, in] and lora_b [S, cols, rank]
 * contiguous; order: the step's token indices sorted by slot; chunks [num_chunks, 3]: (slot,
 * begin, end) into order, end - begin <= MAX_CHUNK; live [S]: nonzero where this projection
 * holds an adapter in the slot (chunks of other slots are skipped: their products are zero).
 * Returns 0, or -1 (nothing written) for a rank or chunk beyond the kernel's limits. */
int lora_apply_f32(const float *x, int64_t x_stride, float *out, int64_t out_stride, int64_t offset,
                   const float *lora_a, const float *lora_b, int64_t rank, int64_t in, int64_t cols,
                   const int64_t *order, const int64_t *chunks, int64_t num_chunks, const uint8_t *live,
                   int num_threads) {
    if (rank < 1 || rank > MAX_RANK) return -1;
    int64_t tokens = 0;
    for (int64_t c = 0; c < num_chunks; c++) {
        const int64_t n = chunks[3 * c + 2] - chunks[3 * c + 1];
        if (n < 0 || n > MAX_CHUNK) return -1;
        if (live[chunks[3 * c]]) tokens += n;
    }
    const int64_t work = tokens * rank * (in + cols);
    #pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1 && work >= PARALLEL_MIN_WORK)
    for (int64_t c = 0; c < num_chunks; c++) {
        const int64_t slot = chunks[3 * c], begin = chunks[3 * c + 1], n = chunks[3 * c + 2] - begin;
        if (!live[slot] || n == 0) continue;
        float buf[MAX_CHUNK * MAX_RANK];
        shrink(x, x_stride, order + begin, n, lora_a + slot * rank * in, rank, in, buf);
        expand(buf, n, lora_b + slot * cols * rank, rank, cols, out, out_stride, offset, order + begin);
    }
    return 0;
}
