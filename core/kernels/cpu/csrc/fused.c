/* A few tokens through whole layers in one call each: a layer's dense parts around attention
 * (infer_layer_attention_input, infer_layer_feed_forward), a stack of layers with their KV writes and paged
 * attention (infer_layers_few), and an EAGLE head's draft step (infer_draft_head_step). Each chains the other
 * files' kernels; a projection takes the packed-weight GEMV (gemv.c), or where the layer has its weights laid out
 * for the tile GEMM (gemm_tiles.c) that for any rows (its GEMV up to PASS_ROWS). */
#include "common.h"

/* Whether layer_linear multiplies `rows` rows on `tiles` with bf16 dot products, which round its input to bf16: then
 * the step rounds it where it makes it (the norm's or the SiLU's store), not in a copy. */
static inline int tiles_take_bf16(const uint16_t *tiles, int64_t tiles_fma, int64_t rows) {
    return tiles && !tiles_fma && rows > PASS_ROWS;
}

/* A projection of a layer, its weights stored as `kind` (`x` float32, or bf16 where tiles_take_bf16). A bf16
 * projection with tiles has them as its only copy (`w` NULL): up to PASS_ROWS rows take their GEMV (float32 x and
 * FMAs, the arithmetic of infer_linear_bf16), more the tile GEMM. */
static void layer_linear(const void *w, int64_t kind, const float *scales, int64_t groups, const uint16_t *tiles,
                         int64_t tiles_fma, const void *x, int x_bf16, int64_t rows, int64_t k, const float *bias,
                         float *y, int64_t n_out) {
    if (tiles)
        infer_linear_tiles(x, x_bf16, rows, k, tiles, bias, y, 0, n_out, tiles_fma || rows <= PASS_ROWS);
    else if (kind == KIND_I8)
        infer_linear_i8(x, rows, k, w, scales, groups, bias, y, n_out);
    else if (kind == KIND_BF16)
        infer_linear_bf16(x, rows, k, w, bias, y, n_out);
    else if (kind >= KIND_Q4_0 && kind <= KIND_MXFP4 && rows > infer_block_pass_rows())  /* GGUF's blocks */
        infer_gemm_blocks(x, rows, k, w, kind, bias, y, n_out, -1);  /* past one GEMV pass */
    else if (kind >= KIND_Q4_0 && kind <= KIND_MXFP4)
        infer_linear_blocks(x, rows, k, w, kind, bias, y, n_out);
    else
        infer_linear_f16(x, rows, k, w, bias, y, n_out);
}

/* ---- a few tokens through a layer's dense parts ----------------------------------------------------------------- */

/* A buffer a thread keeps from call to call, grown to the largest asked for and never shrunk. */
typedef struct {
    void *data;
    size_t bytes;
} held_buffer;

/* `buffer`'s memory, at least `bytes` of it (NULL when out of memory). A large step's gate/up rows (50 MB of float32
 * at 2,048 tokens of Qwen3-0.6B, 110 MB of Gemma 3 1B) are past the 32 MiB up to which malloc reuses freed memory:
 * a fresh buffer for each layer would be mapped and faulted in anew, which takes Gemma 3's prefill step of 40
 * prompts of 50 tokens to 1.35x the time of the same step op by op (docs/performance.md). */
static void *hold(held_buffer *buffer, size_t bytes) {
    if (bytes > buffer->bytes) {
        free(buffer->data);
        buffer->data = malloc(bytes);
        buffer->bytes = buffer->data ? bytes : 0;
    }
    return buffer->data;
}

void infer_layer_attention_input(const infer_layer *layer, int64_t tokens, float *residual, const float *delta,
                                 const int64_t *positions, const float *cos_table, const float *sin_table,
                                 float *qkv) {
    const int bf16 = tiles_take_bf16(layer->qkv_tiles, layer->tiles_fma, tokens);
    void *normed = malloc((bf16 ? sizeof(uint16_t) : sizeof(float)) * tokens * layer->hidden);
    infer_add_rms_norm_mixed(residual, delta, 0, normed, bf16, layer->input_norm, tokens, layer->hidden, layer->eps);
    layer_linear(layer->qkv, layer->qkv_kind, layer->qkv_scales, layer->qkv_groups, layer->qkv_tiles,
                 layer->tiles_fma, normed, bf16, tokens, layer->hidden, layer->qkv_bias, qkv, layer->qkv_width);
    const int own_table = layer->cos_table != NULL;
    rope_layer_heads(qkv, positions, own_table ? layer->cos_table : cos_table,
                     own_table ? layer->sin_table : sin_table, tokens, layer->qkv_width,
                     layer->q_width / layer->head_dim, layer->rotated_heads, layer->head_dim,
                     layer->rotary_dim ? layer->rotary_dim : layer->head_dim, layer->q_norm, layer->k_norm,
                     layer->eps);
    free(normed);
}

void infer_layer_feed_forward(const infer_layer *layer, int64_t tokens, const float *attended, float *residual,
                              float *delta) {
    const int64_t hidden = layer->hidden, intermediate = layer->intermediate;
    const int normed_bf16 = tiles_take_bf16(layer->gate_up_tiles, layer->tiles_fma, tokens);
    const int activated_bf16 = tiles_take_bf16(layer->down_tiles, layer->tiles_fma, tokens);
    float *projected = malloc(sizeof(float) * tokens * hidden);
    void *normed = malloc((normed_bf16 ? sizeof(uint16_t) : sizeof(float)) * tokens * hidden);
    static __thread held_buffer held_gate_up, held_activated;
    float *gate_up = hold(&held_gate_up, sizeof(float) * tokens * 2 * intermediate);
    void *activated = hold(&held_activated, (activated_bf16 ? sizeof(uint16_t) : sizeof(float)) * tokens *
                                            intermediate);
    layer_linear(layer->o, layer->o_kind, layer->o_scales, layer->o_groups, layer->o_tiles, layer->tiles_fma,
                 attended, 0, tokens, layer->q_width, layer->o_bias, projected, hidden);
    if (layer->attn_out_norm)  /* normed in place: without a delta the rows are read before they are written */
        infer_add_rms_norm(projected, NULL, projected, layer->attn_out_norm, tokens, hidden, layer->eps);
    infer_add_rms_norm_mixed(residual, projected, 0, normed, normed_bf16, layer->post_norm, tokens, hidden,
                             layer->eps);
    layer_linear(layer->gate_up, layer->gate_up_kind, layer->gate_up_scales, layer->gate_up_groups,
                 layer->gate_up_tiles, layer->tiles_fma, normed, normed_bf16, tokens, hidden, layer->gate_up_bias,
                 gate_up, 2 * intermediate);
    gated_mul_rows(gate_up, activated, tokens, intermediate, layer->activation, activated_bf16);
    layer_linear(layer->down, layer->down_kind, layer->down_scales, layer->down_groups, layer->down_tiles,
                 layer->tiles_fma, activated, activated_bf16, tokens, intermediate, layer->down_bias, delta, hidden);
    if (layer->mlp_out_norm) infer_add_rms_norm(delta, NULL, delta, layer->mlp_out_norm, tokens, hidden, layer->eps);
    free(normed);
    free(projected);
}

/* ---- a few tokens through a stack of layers, attention included ------------------------------------------------- */

void infer_layers_few(const infer_layer *layers, const int64_t *kv_layers, int64_t count, int64_t tokens,
                      float *residual, float *delta, const int64_t *positions, const float *cos_table,
                      const float *sin_table, void *kv, int64_t kv_layer_stride, const infer_attention_step *step) {
    if (count == 0) return;
    const int64_t qkv_width = layers[0].qkv_width, q_width = layers[0].q_width;
    const int64_t kv_width = step->num_kv_heads * step->head_dim;
    const int64_t num_slots = step->num_blocks * step->block_size;
    float *qkv = malloc(sizeof(float) * tokens * qkv_width), *attended = calloc(tokens * q_width, sizeof(float));
    for (int64_t l = 0; l < count; l++) {
        void *pool = (char *)kv + kv_layers[l] * kv_layer_stride * (step->kv_bf16 ? 2 : 4);
        infer_layer_attention_input(&layers[l], tokens, residual, l ? delta : NULL, positions, cos_table, sin_table,
                                    qkv);
        infer_write_kv(qkv + q_width, qkv_width, qkv + q_width + kv_width, qkv_width, pool, step->slots, tokens,
                       kv_width, num_slots, step->kv_bf16);
        infer_paged_attention(qkv, qkv_width, pool, step->block_tables, step->table_stride, step->rows,
                              step->seq_of_query, step->context_lens, step->own_keys, attended, step->queries,
                              step->num_heads, step->num_kv_heads, step->head_dim, step->block_size,
                              step->num_blocks, step->max_context, step->scale, step->kv_bf16, step->dots,
                              step->windows ? step->windows[kv_layers[l]] : 0,
                              step->sinks ? step->sinks + kv_layers[l] * step->num_heads : NULL);
        infer_layer_feed_forward(&layers[l], tokens, attended, residual, delta);
    }
    free(attended);
    free(qkv);
}

/* ---- a draft head's step (EAGLE) -------------------------------------------------------------------------------- */

/* A row of `vocab` logits' `width` largest into choice (in descending order, the first of equal ones first) and
 * their softmax probabilities over the whole row into top. The row is overwritten (its exponentials). */
static void top_guesses(float *row, int64_t vocab, int64_t width, int64_t *choice, float *top) {
    for (int64_t w = 0; w < width; w++) {
        top[w] = -INFINITY;
        choice[w] = 0;
    }
    for (int64_t v = 0; v < vocab; v++) {  /* insertion into the `width` largest so far */
        if (!(row[v] > top[width - 1])) continue;
        int64_t at = width - 1;
        for (; at > 0 && row[v] > top[at - 1]; at--) {
            top[at] = top[at - 1];
            choice[at] = choice[at - 1];
        }
        top[at] = row[v];
        choice[at] = v;
    }
    const float best = top[0], total = exp_shifted_sum(row, vocab, best);
    for (int64_t w = 0; w < width; w++) top[w] = expf(top[w] - best) / total;
}

void infer_draft_head_step(const infer_draft_head *head, const infer_layer *layer, int64_t tokens,
                           const float *embeds, const float *features, const int64_t *positions,
                           const float *cos_table, const float *sin_table, void *kv,
                           const infer_attention_step *step, const int64_t *last_rows, int64_t seqs,
                           float *predicted, int64_t width, int64_t *guesses, float *confidence) {
    const int64_t hidden = head->hidden, vocab = head->vocab;
    float *pairs = malloc(sizeof(float) * tokens * 2 * hidden);
    float *x = malloc(sizeof(float) * tokens * hidden), *delta = malloc(sizeof(float) * tokens * hidden);
    float *logits = malloc(sizeof(float) * seqs * vocab);
    for (int64_t t = 0; t < tokens; t++) {  /* norms of unchanged rows: no residual is added */
        infer_add_rms_norm((float *)embeds + t * hidden, NULL, pairs + t * 2 * hidden, head->embed_norm, 1, hidden,
                           head->eps);
        infer_add_rms_norm((float *)features + t * hidden, NULL, pairs + t * 2 * hidden + hidden, head->feature_norm,
                           1, hidden, head->eps);
    }
    layer_linear(head->fc, head->fc_kind, head->fc_scales, head->fc_groups, NULL, 0, pairs, 0, tokens, 2 * hidden,
                 head->fc_bias, x, hidden);
    const int64_t own_layer = 0;
    infer_layers_few(layer, &own_layer, 1, tokens, x, delta, positions, cos_table, sin_table, kv, 0, step);
    for (int64_t s = 0; s < seqs; s++)
        infer_add_rms_norm(x + last_rows[s] * hidden, delta + last_rows[s] * hidden, predicted + s * hidden,
                           head->norm, 1, hidden, head->eps);
    layer_linear(head->out, head->out_kind, head->out_scales, head->out_groups, NULL, 0, predicted, 0, seqs, hidden,
                 NULL, logits, vocab);
    for (int64_t s = 0; s < seqs; s++)
        top_guesses(logits + s * vocab, vocab, width, guesses + s * width, confidence + s * width);
    free(logits);
    free(delta);
    free(x);
    free(pairs);
}
