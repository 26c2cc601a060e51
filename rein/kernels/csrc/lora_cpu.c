/* LoRA adapter products on the CPU, float32: for one projection (or one part of a fused one)
 * and every token t of a step whose adapter slot s is live,
 *
 *     out[t, offset : offset + N] += B[s] @ (A[s] @ x[t])
 *
 * with A [S, R, in] and B [S, N, R] the projection's per-slot stacks (ranks zero-padded to R;
 * rein/model/lora/layers.py). torch does this as an index_select, two small matmuls and an
 * index_add per adapter per projection (bench/lora.py: 960 such groups a SmolLM2 step at 8
 * adapters); here it is one call per projection part. On the CPU the stacks' memory holds
 * A_s.T [in, R] and B_s.T [R, N], the operands of (x @ A_s.T) @ B_s.T: both products then run
 * along contiguous vectors of ranks and of output columns, with no horizontal sums and no
 * transposes per chunk.
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

/* Output columns the expand keeps in registers at a time (four AVX-512 vectors). */
#define TILE 64
/* 16 floats, loaded from and stored to any float address. */
typedef float vec16 __attribute__((vector_size(64), aligned(4), may_alias));
/* The largest chunk (tokens of one slot handled together) and rank the kernel takes; the
 * caller (cpu_native.lora_apply) cuts chunks to at most MAX_CHUNK and falls back above MAX_RANK. */
#define MAX_CHUNK 32
#define MAX_RANK 512
/* Work too small to be worth waking a thread team for (multiply-adds). */
#define PARALLEL_MIN_WORK 262144

int lora_max_chunk(void) { return MAX_CHUNK; }
int lora_max_rank(void) { return MAX_RANK; }

/* Ranks the shrink keeps in one vector per token (one AVX-512 vector of floats). */
#define RANK_TILE 16

/* buf[j, r0:r0 + RANK_TILE] for NB tokens: x rows against A_s read through its transpose at
 * [in, rank] (the layout LoRAPart keeps on the CPU), one broadcast multiply-add per token and
 * input feature on a vector of ranks; NB accumulators in flight hide the FMA latency. Inlined
 * with NB constant so that they stay in registers. */
static inline __attribute__((always_inline)) void shrink_block(
        const float *x, int64_t x_stride, const int64_t *tokens, const int nb, const float *at, int64_t rank,
        int64_t r0, int64_t in, float *buf) {
    float acc[8][RANK_TILE] = {{0}};
    const float *rows[8];
    for (int j = 0; j < nb; j++) rows[j] = x + tokens[j] * x_stride;
    for (int64_t k = 0; k < in; k++) {
        const float *w = at + k * rank + r0;
        for (int j = 0; j < nb; j++) {
            const float v = rows[j][k];
            #pragma omp simd
            for (int i = 0; i < RANK_TILE; i++) acc[j][i] += w[i] * v;
        }
    }
    for (int j = 0; j < nb; j++)
        for (int i = 0; i < RANK_TILE; i++) buf[j * rank + r0 + i] = acc[j][i];
}

/* buf[j, :] = A_s @ x[tokens[j]] for the n tokens of one chunk (n <= MAX_CHUNK); A_s read
 * through at [in, rank]. */
static void shrink(const float *x, int64_t x_stride, const int64_t *tokens, int64_t n, const float *at,
                   int64_t rank, int64_t in, float *buf) {
    const int64_t tiled = rank / RANK_TILE * RANK_TILE;
    for (int64_t r0 = 0; r0 < tiled; r0 += RANK_TILE) {
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) shrink_block(x, x_stride, tokens + j, 8, at, rank, r0, in, buf + j * rank);
        for (; j + 4 <= n; j += 4) shrink_block(x, x_stride, tokens + j, 4, at, rank, r0, in, buf + j * rank);
        for (; j < n; j++) shrink_block(x, x_stride, tokens + j, 1, at, rank, r0, in, buf + j * rank);
    }
    if (tiled == rank) return;
    /* Ranks past the last full tile (a rank that is not a multiple of 16). */
    for (int64_t j = 0; j < n; j++) {
        const float *xj = x + tokens[j] * x_stride;
        float acc[RANK_TILE] = {0};
        for (int64_t k = 0; k < in; k++) {
            const float v = xj[k];
            const float *w = at + k * rank;
            for (int64_t r = tiled; r < rank; r++) acc[r - tiled] += w[r] * v;
        }
        for (int64_t r = tiled; r < rank; r++) buf[j * rank + r] = acc[r - tiled];
    }
}

/* out[tokens[j], offset + c] += sum_r B_s[c, r] * buf[j, r] for the chunk's n tokens, B_s read
 * through its transpose bt [rank, cols] (the layout LoRAPart keeps on the CPU): the inner loop
 * runs along the output columns, a tile of them held in registers over the rank. */
static void expand(const float *buf, int64_t n, const float *bt, int64_t rank, int64_t cols, float *out,
                   int64_t out_stride, int64_t offset, const int64_t *tokens) {
    for (int64_t c0 = 0; c0 < cols; c0 += TILE) {
        const int64_t width = cols - c0 < TILE ? cols - c0 : TILE;
        for (int64_t j = 0; j < n; j++) {
            const float *bj = buf + j * rank;
            float *o = out + tokens[j] * out_stride + offset + c0;
            const float *col = bt + c0;
            if (width == TILE) {
                /* Four vectors of 16 columns in registers over the rank (GCC's and clang's vector
                 * types: one AVX-512 register each here, pairs or quads of narrower ones
                 * elsewhere). */
                vec16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
                for (int64_t r = 0; r < rank; r++) {
                    const vec16 *row = (const vec16 *)(col + r * cols);
                    const float v = bj[r];
                    a0 += row[0] * v;
                    a1 += row[1] * v;
                    a2 += row[2] * v;
                    a3 += row[3] * v;
                }
                vec16 *ov = (vec16 *)o;
                ov[0] += a0;
                ov[1] += a1;
                ov[2] += a2;
                ov[3] += a3;
            } else {
                for (int64_t i = 0; i < width; i++) {
                    float acc = 0.0f;
                    for (int64_t r = 0; r < rank; r++) acc += col[r * cols + i] * bj[r];
                    o[i] += acc;
                }
            }
        }
    }
}

/* x [T, in] (rows x_stride floats apart, unit column stride); out [T, >= offset + cols] (rows
 * out_stride apart), added to in place; lora_a_t [S, in, rank] and lora_b_t [S, rank, cols]
 * contiguous: A and B transposed (LoRAPart's lora_a [S, rank, in] and lora_b [S, cols, rank]
 * are views of them); order: the step's token indices sorted by slot; chunks [num_chunks, 3]: (slot,
 * begin, end) into order, end - begin <= MAX_CHUNK; live [S]: nonzero where this projection
 * holds an adapter in the slot (chunks of other slots are skipped: their products are zero).
 * Returns 0, or -1 (nothing written) for a rank or chunk beyond the kernel's limits, or a slot,
 * a run or a token index out of range. */
int lora_apply_f32(const float *x, int64_t x_stride, float *out, int64_t out_stride, int64_t offset,
                   const float *lora_a_t, const float *lora_b_t, int64_t rank, int64_t in, int64_t cols,
                   int64_t num_tokens, int64_t num_slots, const int64_t *order, int64_t num_order,
                   const int64_t *chunks, int64_t num_chunks, const uint8_t *live, int num_threads) {
    if (rank < 1 || rank > MAX_RANK) return -1;
    for (int64_t i = 0; i < num_order; i++)
        if (order[i] < 0 || order[i] >= num_tokens) return -1;
    int64_t tokens = 0;
    for (int64_t c = 0; c < num_chunks; c++) {
        const int64_t slot = chunks[3 * c], begin = chunks[3 * c + 1], end = chunks[3 * c + 2];
        if (slot < 0 || slot >= num_slots || begin < 0 || end > num_order || end - begin < 0
                || end - begin > MAX_CHUNK)
            return -1;
        if (live[slot]) tokens += end - begin;
    }
    const int64_t work = tokens * rank * (in + cols);
    #pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1 && work >= PARALLEL_MIN_WORK)
    for (int64_t c = 0; c < num_chunks; c++) {
        const int64_t slot = chunks[3 * c], begin = chunks[3 * c + 1], n = chunks[3 * c + 2] - begin;
        if (!live[slot] || n == 0) continue;
        float buf[MAX_CHUNK * MAX_RANK];
        shrink(x, x_stride, order + begin, n, lora_a_t + slot * in * rank, rank, in, buf);
        expand(buf, n, lora_b_t + slot * rank * cols, rank, cols, out, out_stride, offset, order + begin);
    }
    return 0;
}
