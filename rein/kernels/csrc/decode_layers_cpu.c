/* A decode step's decoder layers on the CPU in one call: every layer of a Llama-family or
 * Gemma 3 model whose projections are quantized (rein.kernels.quantized's CpuPanels or
 * Int8Panels), for a step whose rows are all single-token decodes, float32.
 *
 * The model's Python forward makes some 30 calls a layer (module calls, torch's allocations
 * and views, a ctypes call per kernel, each with its checks): at batch 1, where a layer's
 * arithmetic is a few hundred microseconds, that was about a quarter of a step (Gemma 3 270M:
 * 4.4 of 14.9 ms in the layers; SmolLM2-135M: more). Here the same kernels run in the same
 * order on the same floats -- the quantized matmuls of quantized_matmul_cpu.c and
 * quantized_matmul_int8act.c, rms_norm_f32 and add_rms_norm_f32, silu_and_mul_f32,
 * rotary_store_kv_f32 and paged_decode_attention_f32 -- with the intermediates in one work
 * buffer and no Python between them. Only Gemma's tanh GELU is new (torch's formula; torch
 * computes it in its own vectorized code, so its floats may differ in the last bits).
 *
 * rein.kernels.cpu_decode_layers binds a model's layers once (`decode_layer_t`, pointers into
 * tensors the model keeps) and fills a `decode_step_t` per step. Built and loaded with the
 * other kernels by rein/kernels/cpu_native.py.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "fast_exp.h"

/* The kernels this file strings together (their sources say what each computes). */
int quantized_matmul_f32(const float *x, int64_t x_stride, const uint8_t *q, const float *scale,
                         const float *offset, const float *bias, float *out, int64_t out_stride, int64_t rows,
                         int64_t n_out, int64_t cols, int64_t group, int bits, int num_threads);
int quantized_matmul_packed_f32(const float *x, int64_t x_stride, const uint8_t *q, const uint16_t *scale_hi,
                                const int8_t *scale_sub, const uint16_t *offset_hi, const int8_t *offset_sub,
                                int zero, const float *bias, float *out, int64_t out_stride, int64_t rows,
                                int64_t n_out, int64_t cols, int64_t group, int64_t block, int bits,
                                int num_threads);
int quantized_matmul_int8act(const float *x, int64_t x_stride, const uint8_t *q, const float *scale,
                             const float *offset, const float *bias, float *out, int64_t out_stride, int64_t rows,
                             int64_t n_out, int64_t cols, int64_t group, int64_t ablock, int bits, int num_threads);
void rms_norm_f32(const float *x, int64_t x_stride, const float *w, float eps, float *out, int64_t rows,
                  int64_t cols, int num_threads);
void add_rms_norm_f32(float *residual, const float *x, const float *w, float eps, float *out, int64_t rows,
                      int64_t cols, int num_threads);
void silu_and_mul_f32(const float *gate_up, int64_t stride, float *out, int64_t rows, int64_t inter,
                      int num_threads);
void rotary_store_kv_f32(float *q, int64_t q_stride, int64_t q_heads, float *k, int64_t k_stride, const float *v,
                         int64_t v_stride, int64_t kv_heads, int64_t head_dim, int64_t tokens, const float *cos,
                         const float *sin, void *k_cache, void *v_cache, int kv_type, const int64_t *slots,
                         int num_threads);
int paged_decode_attention_f32(const float *query, const void *k_cache, const void *v_cache, int kv_type,
                               const int32_t *block_tables, int64_t bt_stride, const int32_t *context_lens,
                               float *out, float *scratch, int64_t max_len, int64_t batch, int64_t num_heads,
                               int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                               int64_t window, int num_threads);

/* A projection's weight as its kernel takes it (rein.kernels.cpu_native._bind_matmul's
 * arguments): kind 0 quantized_matmul_f32, 1 quantized_matmul_packed_f32, 2
 * quantized_matmul_int8act. */
typedef struct {
    int64_t kind;
    const uint8_t *q;
    const void *scale, *scale_sub, *offset, *offset_sub;
    const float *bias;
    int64_t zero, n_out, cols, group, block, bits;
} decode_weight_t;

typedef struct {
    decode_weight_t qkv, o, gate_up, down;
    /* Llama: input_norm, pre_mlp_norm (its post_attention_layernorm). Gemma 3: all four and
     * the per-head q_norm, k_norm (NULL where the model has none). */
    const float *input_norm, *post_attention_norm, *pre_mlp_norm, *post_mlp_norm, *q_norm, *k_norm;
    void *k_cache, *v_cache;
    int64_t kv_type, block_size;
    int64_t hidden, heads, kv_heads, head_dim, inter;
    int64_t window;        /* sliding window in tokens, 0: none */
    int64_t local_rope;    /* 1: the step's second cos/sin (Gemma 3's local rope) */
    int64_t windowed;      /* 1: the step's second slots and tables (the windowed layers' own storage) */
    int64_t gelu;          /* the MLP's activation: 1 tanh GELU, 0 SiLU */
    float eps, scale;
} decode_layer_t;

/* The step: two of each -- [0] the full-attention layers', [1] the windowed storage's
 * (rein.model.attention.AttentionMetadata.windowed) and the local rope's. */
typedef struct {
    const float *cos[2], *sin[2];               /* [T, head_dim / 2] */
    const int64_t *slots[2];                    /* [T] */
    const int32_t *block_tables[2];             /* [T, bt_stride] */
    const int32_t *context_lens[2];             /* [T] */
    int64_t bt_stride[2], max_context[2];
} decode_step_t;

static int project(const decode_weight_t *w, const float *x, float *out, int64_t rows, int threads) {
    switch (w->kind) {
    case 0:
        return quantized_matmul_f32(x, w->cols, w->q, w->scale, w->offset, w->bias, out, w->n_out, rows, w->n_out,
                                    w->cols, w->group, (int)w->bits, threads);
    case 1:
        return quantized_matmul_packed_f32(x, w->cols, w->q, w->scale, w->scale_sub, w->offset, w->offset_sub,
                                           (int)w->zero, w->bias, out, w->n_out, rows, w->n_out, w->cols, w->group,
                                           w->block, (int)w->bits, threads);
    case 2:
        return quantized_matmul_int8act(x, w->cols, w->q, w->scale, w->offset, w->bias, out, w->n_out, rows,
                                        w->n_out, w->cols, w->group, w->block, (int)w->bits, threads);
    default:
        return -1;
    }
}

/* gate_up [rows, 2 * inter] -> out [rows, inter] = gelu_tanh(gate) * up, as torch's
 * gelu(approximate="tanh"): 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), with
 * 1 + tanh(a) = 2 - 2 / (1 + e^(2a)) through fast_exp.h, which vectorizes (libm's tanhf
 * did not: about 1.4% of a Gemma 3 decode step at batch 1 on an AVX2 machine). */
static void gelu_tanh_and_mul(const float *gate_up, float *out, int64_t rows, int64_t inter) {
    const float k0 = 0.7978845608028654f, k1 = 0.044715f;
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        #pragma omp simd
        for (int64_t i = 0; i < inter; i++) {
            const float x = g[i];
            const float one_plus_tanh = 2.0f - 2.0f / (1.0f + fast_expf(2.0f * k0 * (x + k1 * x * x * x)));
            o[i] = 0.5f * x * one_plus_tanh * u[i];
        }
    }
}

/* Floats of work buffer decode_layers_f32 needs for `rows` rows of these layers (the attention
 * scratch for `threads` threads and `max_context` tokens included). */
int64_t decode_layers_work_floats(const decode_layer_t *layers, int64_t count, int64_t rows, int64_t max_context,
                                  int threads) {
    int64_t most = 0;
    for (int64_t i = 0; i < count; i++) {
        const decode_layer_t *l = layers + i;
        const int64_t qs = l->heads * l->head_dim, kvs = l->kv_heads * l->head_dim;
        const int64_t need = rows * (2 * l->hidden + (qs + 2 * kvs) + qs + kvs + qs + 2 * l->inter + l->inter)
                             + (int64_t)threads * l->heads * max_context;
        if (need > most) most = need;
    }
    return most;
}

/* x [rows, hidden] (contiguous) through layers[0..count): the residual stream updated in place,
 * as the model's forward would leave it before its final norm. `work`: at least
 * decode_layers_work_floats(...) floats. Returns 0, or the first kernel's error (-1 a shape it
 * does not take, -2 out of memory), x then partly updated. */
int decode_layers_f32(const decode_layer_t *layers, int64_t count, const decode_step_t *step, float *x,
                      int64_t rows, float *work, int num_threads) {
    for (int64_t i = 0; i < count; i++) {
        const decode_layer_t *l = layers + i;
        const int64_t hidden = l->hidden, d = l->head_dim;
        const int64_t qs = l->heads * d, kvs = l->kv_heads * d, qkv_size = qs + 2 * kvs;
        float *h = work;                        /* [rows, hidden]: a norm's output */
        float *qkv = h + rows * hidden;         /* [rows, q + 2 kv] */
        float *q = qkv + rows * qkv_size;       /* [rows, heads, d]: the attention's query */
        float *k = q + rows * qs;               /* [rows, kv_heads, d]: k normed (q/k norm only) */
        float *att = k + rows * kvs;            /* [rows, heads, d] */
        float *o = att + rows * qs;             /* [rows, hidden] */
        float *gu = o + rows * hidden;          /* [rows, 2 inter] */
        float *act = gu + rows * 2 * l->inter;  /* [rows, inter] */
        float *scratch = act + rows * l->inter; /* the attention's scores */
        const int r = (int)l->local_rope, s = (int)l->windowed;
        int rc;

        rms_norm_f32(x, hidden, l->input_norm, l->eps, h, rows, hidden, num_threads);
        if ((rc = project(&l->qkv, h, qkv, rows, num_threads))) return rc;
        float *key = qkv + qs;
        int64_t q_stride = qkv_size, k_stride = qkv_size;
        float *query = qkv;
        if (l->q_norm) {   /* per-head norms into q and k (contiguous), as the model's q_norm(view) */
            for (int64_t t = 0; t < rows; t++) {
                rms_norm_f32(qkv + t * qkv_size, d, l->q_norm, l->eps, q + t * qs, l->heads, d, 1);
                rms_norm_f32(qkv + t * qkv_size + qs, d, l->k_norm, l->eps, k + t * kvs, l->kv_heads, d, 1);
            }
            query = q, key = k, q_stride = qs, k_stride = kvs;
        }
        rotary_store_kv_f32(query, q_stride, l->heads, key, k_stride, qkv + qs + kvs, qkv_size, l->kv_heads, d, rows,
                            step->cos[r], step->sin[r], l->k_cache, l->v_cache, (int)l->kv_type, step->slots[s],
                            num_threads);
        if (!l->q_norm)   /* the attention takes its query contiguous */
            for (int64_t t = 0; t < rows; t++) memcpy(q + t * qs, qkv + t * qkv_size, sizeof(float) * qs);
        rc = paged_decode_attention_f32(q, l->k_cache, l->v_cache, (int)l->kv_type, step->block_tables[s],
                                        step->bt_stride[s], step->context_lens[s], att, scratch,
                                        step->max_context[s], rows, l->heads, l->kv_heads, d, l->block_size,
                                        l->scale, l->window, num_threads);
        if (rc) return rc;
        if ((rc = project(&l->o, att, o, rows, num_threads))) return rc;
        if (l->post_attention_norm) {   /* Gemma 3: the attention's output normed before the residual add */
            rms_norm_f32(o, hidden, l->post_attention_norm, l->eps, h, rows, hidden, num_threads);
            memcpy(o, h, sizeof(float) * rows * hidden);
        }
        add_rms_norm_f32(x, o, l->pre_mlp_norm, l->eps, h, rows, hidden, num_threads);
        if ((rc = project(&l->gate_up, h, gu, rows, num_threads))) return rc;
        if (l->gelu) gelu_tanh_and_mul(gu, act, rows, l->inter);
        else silu_and_mul_f32(gu, 2 * l->inter, act, rows, l->inter, num_threads);
        if ((rc = project(&l->down, act, o, rows, num_threads))) return rc;
        const float *added = o;
        if (l->post_mlp_norm) {
            rms_norm_f32(o, hidden, l->post_mlp_norm, l->eps, h, rows, hidden, num_threads);
            added = h;
        }
        for (int64_t j = 0; j < rows * hidden; j++) x[j] += added[j];
    }
    return 0;
}
