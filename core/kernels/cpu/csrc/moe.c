/* A mixture-of-experts layer's experts for the few tokens each takes in a step (infer_moe_experts): every active
 * expert's packed weights streamed from memory once, gate and up in one pass with the activation (SwiGLU, or
 * gpt-oss's clamped SwiGLU) on their sums plus biases, then down with each token's row (plus bias) added into its
 * output times its routing weight.
 *
 * Work is split by weight blocks, not by experts: each thread takes its share of every active expert's gate/up
 * blocks, then its share of the output columns (the down projection's blocks) for every expert in turn, so both
 * cores stay busy whatever the routing (one expert taking every token included), and each output column is summed
 * by one thread, experts in ascending order: no atomics, the same sums whatever the thread count. */
#include "common.h"

/* Blocks [*first, *last) of `blocks` that thread `thread` of `threads` takes. */
static inline void thread_share(int64_t blocks, int thread, int threads, int64_t *first, int64_t *last) {
    *first = blocks * thread / threads;
    *last = blocks * (thread + 1) / threads;
}

static inline int64_t weight_bytes(int kind) { return kind == KIND_I8 ? 1 : 2; }

/* The activation of gate g and up u (cpu_kernels.h), in transformers' order of operations. */
static inline float activate(float g, float u, int64_t activation, float limit, float alpha) {
    if (activation == ACTIVATION_CLAMPED_SWIGLU) {
        g = fminf(g, limit);
        u = fminf(fmaxf(u, -limit), limit);
        return (u + 1.0f) * (g * (1.0f / (1.0f + expf(-(g * alpha)))));
    }
    return g / (1.0f + expf(-g)) * u;
}

void infer_moe_experts(const float *x, int64_t hidden, int64_t width, int64_t experts, const int64_t *expert_ids,
                       const int64_t *starts, const int64_t *tokens, const float *weights, const int64_t *gate_up,
                       const int64_t *gate_up_scales, int64_t gate_up_groups, const int64_t *down,
                       const int64_t *down_scales, int64_t down_groups, int64_t kind, const int64_t *gate_up_bias,
                       const int64_t *down_bias, int64_t activation, float limit, float alpha, float *out) {
    const int64_t pairs = starts[experts];
    int64_t most = 0;  /* the most tokens one expert takes */
    for (int64_t e = 0; e < experts; e++)
        if (starts[e + 1] - starts[e] > most) most = starts[e + 1] - starts[e];
    float *rows = malloc(sizeof(float) * pairs * hidden);       /* x's rows, grouped by expert */
    float *activated = malloc(sizeof(float) * pairs * width);   /* silu(gate) * up, grouped by expert */
    const int64_t gate_up_block = 4 * hidden * weight_bytes(kind), down_block = 4 * width * weight_bytes(kind);
    const int64_t gate_up_group = kind == KIND_I8 ? hidden / gate_up_groups : hidden;
    const int64_t down_group = kind == KIND_I8 ? width / down_groups : width;
#pragma omp parallel
    {
        int thread = 0, threads = 1;
#ifdef _OPENMP
        thread = omp_get_thread_num();
        threads = omp_get_num_threads();
#endif
        float *gate = malloc(sizeof(float) * 8 * most), *up = gate + 4 * most;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < pairs; p++) memcpy(rows + p * hidden, x + tokens[p] * hidden, sizeof(float) * hidden);
        int64_t first, last;
        thread_share(width / 4, thread, threads, &first, &last);
        for (int64_t e = 0; e < experts; e++) {
            const int64_t start = starts[e], count = starts[e + 1] - start, id = expert_ids[e];
            const char *weight = (const char *)(intptr_t)gate_up[id];
            const float *scales = kind == KIND_I8 ? (const float *)(intptr_t)gate_up_scales[id] : NULL;
            const float *bias = gate_up_bias ? (const float *)(intptr_t)gate_up_bias[id] : NULL;
            for (int64_t b = first; b < last; b++) {
                const int64_t b_up = b + width / 4;  /* gate rows first, then up's */
                block_sums(rows + start * hidden, count, hidden, weight + b * gate_up_block,
                           scales ? scales + b * 4 * gate_up_groups : NULL, gate_up_group, (int)kind, gate);
                block_sums(rows + start * hidden, count, hidden, weight + b_up * gate_up_block,
                           scales ? scales + b_up * 4 * gate_up_groups : NULL, gate_up_group, (int)kind, up);
                for (int64_t r = 0; r < count; r++)
                    for (int i = 0; i < 4; i++) {
                        float g = gate[r * 4 + i], u = up[r * 4 + i];
                        if (bias) {
                            g += bias[b * 4 + i];
                            u += bias[width + b * 4 + i];
                        }
                        activated[(start + r) * width + b * 4 + i] = activate(g, u, activation, limit, alpha);
                    }
            }
        }
#pragma omp barrier
        thread_share(hidden / 4, thread, threads, &first, &last);
        for (int64_t e = 0; e < experts; e++) {
            const int64_t start = starts[e], count = starts[e + 1] - start, id = expert_ids[e];
            const char *weight = (const char *)(intptr_t)down[id];
            const float *scales = kind == KIND_I8 ? (const float *)(intptr_t)down_scales[id] : NULL;
            const float *bias = down_bias ? (const float *)(intptr_t)down_bias[id] : NULL;
            for (int64_t b = first; b < last; b++) {
                block_sums(activated + start * width, count, width, weight + b * down_block,
                           scales ? scales + b * 4 * down_groups : NULL, down_group, (int)kind, gate);
                for (int64_t r = 0; r < count; r++)
                    for (int i = 0; i < 4; i++)
                        out[tokens[start + r] * hidden + b * 4 + i] +=
                            weights[start + r] * (gate[r * 4 + i] + (bias ? bias[b * 4 + i] : 0.0f));
            }
        }
        free(gate);
    }
    free(rows);
    free(activated);
}
