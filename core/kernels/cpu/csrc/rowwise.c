/* The row-wise ops of a step, each one pass over its rows: RMSNorm with its residual add, SiLU-and-multiply, RoPE
 * (also fused with widening a bf16 GEMM's output) and the KV write. Rows are split over the threads from
 * PARALLEL_ELEMENTS elements on. */
#include "common.h"

/* ---- RMSNorm ---------------------------------------------------------------------------------------------------- */

/* For each of `rows` rows of `dim` floats: if delta, residual += delta (in place); then
 * out = residual * rsqrt(mean(residual^2) + eps) * weight, as floats, or rounded to bfloat16 when `bf16_out`. */
static inline __attribute__((always_inline)) void add_rms_norm(float *residual, const void *delta, int delta_bf16,
                                                               void *out, const float *weight, int64_t rows,
                                                               int64_t dim, float eps, const int bf16_out) {
#pragma omp parallel for if (rows * dim >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        float *x = residual + r * dim;
        if (delta && delta_bf16) {  /* a bf16 GEMM's output, widened as it is added */
            const uint16_t *d = (const uint16_t *)delta + r * dim;
            int64_t i = 0;
#if INFER_AVX512
            for (; i + 16 <= dim; i += 16)
                _mm512_storeu_ps(x + i, _mm512_add_ps(_mm512_loadu_ps(x + i), bf16x16_load(d + i)));
#endif
            for (; i < dim; i++) x[i] += bf16_to_float(d[i]);
        } else if (delta) {
            const float *d = (const float *)delta + r * dim;
            for (int64_t i = 0; i < dim; i++) x[i] += d[i];
        }
        float scale = 1.0f / sqrtf(dot(x, x, dim) / (float)dim + eps);
        if (!bf16_out) {
            float *y = (float *)out + r * dim;
            for (int64_t i = 0; i < dim; i++) y[i] = weight[i] * (x[i] * scale);
            continue;
        }
        uint16_t *y = (uint16_t *)out + r * dim;
        int64_t i = 0;
#if INFER_AVX512
        const __m512 factor = _mm512_set1_ps(scale);
        for (; i + 16 <= dim; i += 16)
            _mm256_storeu_si256((__m256i *)(y + i), bf16x16_from(_mm512_mul_ps(
                _mm512_loadu_ps(weight + i), _mm512_mul_ps(_mm512_loadu_ps(x + i), factor))));
#endif
        for (; i < dim; i++) y[i] = float_to_bf16(weight[i] * (x[i] * scale));
    }
}

void infer_add_rms_norm(float *residual, const float *delta, float *out, const float *weight, int64_t rows,
                        int64_t dim, float eps) {
    add_rms_norm(residual, delta, 0, out, weight, rows, dim, eps, 0);
}

void infer_add_rms_norm_mixed(float *residual, const void *delta, int64_t delta_bf16, void *out, int64_t out_bf16,
                              const float *weight, int64_t rows, int64_t dim, float eps) {
    if (out_bf16)
        add_rms_norm(residual, delta, (int)delta_bf16, out, weight, rows, dim, eps, 1);
    else
        add_rms_norm(residual, delta, (int)delta_bf16, out, weight, rows, dim, eps, 0);
}

/* ---- act(gate) * up: SiLU (SwiGLU) or tanh-approximated GELU (GeGLU) -------------------------------------------- */

/* gelu_tanh(g) = g / 2 * (1 + tanh(u)), u = sqrt(2 / pi) * (g + 0.044715 g^3), is g * sigmoid(2u): SiLU's form with
 * sigmoid's argument 2u in place of g. These are 2 sqrt(2 / pi) and 2 sqrt(2 / pi) * 0.044715. */
#define GELU_C1 1.5957691216057308f
#define GELU_C3 0.07135481627159589f

/* gate_up: rows x (2 * width), gate first, as floats or, with `bf16_in`, bfloat16 (a bf16 GEMM's output, widened as
 * it is read); out: rows x width, act(gate) * up with act SiLU or, with `gelu`, GELU's tanh form, as floats or, with
 * `bf16_out`, each value rounded to bfloat16 as it is stored (the next bf16 GEMM's input; the same values as rounding
 * the float result). One body for every form, so the float32 and the bf16 paths agree before the rounding. */
static inline __attribute__((always_inline)) void gated_mul(const void *gate_up, void *out, int64_t rows,
                                                            int64_t width, const int gelu, const int bf16_in,
                                                            const int bf16_out) {
#pragma omp parallel for if (rows * width >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = (const float *)gate_up + r * 2 * width, *up = gate + width;
        const uint16_t *gate_b = (const uint16_t *)gate_up + r * 2 * width, *up_b = gate_b + width;
        float *y = (float *)out + r * width;
        uint16_t *yb = (uint16_t *)out + r * width;
        int64_t i = 0;
#if INFER_AVX512
        for (; i + 16 <= width; i += 16) {
            const __m512 g = bf16_in ? bf16x16_load(gate_b + i) : _mm512_loadu_ps(gate + i);
            const __m512 u = bf16_in ? bf16x16_load(up_b + i) : _mm512_loadu_ps(up + i);
            const __m512 one = _mm512_set1_ps(1.0f);
            const __m512 z = gelu ? _mm512_mul_ps(g, _mm512_fmadd_ps(_mm512_mul_ps(g, g), _mm512_set1_ps(GELU_C3),
                                                                     _mm512_set1_ps(GELU_C1)))
                                  : g;
            const __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), z))));
            const __m512 value = _mm512_mul_ps(_mm512_mul_ps(g, sig), u);
            if (bf16_out)
                _mm256_storeu_si256((__m256i *)(yb + i), bf16x16_from(value));
            else
                _mm512_storeu_ps(y + i, value);
        }
#endif
#if INFER_AVX2
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        for (; i + 8 <= width; i += 8) {
            const __m256 g = bf16_in ? bf16x8_load(gate_b + i) : _mm256_loadu_ps(gate + i);
            const __m256 u = bf16_in ? bf16x8_load(up_b + i) : _mm256_loadu_ps(up + i);
            const __m256 z = gelu ? _mm256_mul_ps(g, _mm256_fmadd_ps(_mm256_mul_ps(g, g), _mm256_set1_ps(GELU_C3),
                                                                     _mm256_set1_ps(GELU_C1)))
                                  : g;
            const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, z))));
            const __m256 value = _mm256_mul_ps(_mm256_mul_ps(g, sig), u);
            if (bf16_out) {
                float values[8];
                _mm256_storeu_ps(values, value);
                floats_to_bf16(values, yb + i, 8);
            } else {
                _mm256_storeu_ps(y + i, value);
            }
        }
#endif
        for (; i < width; i++) {
            const float g = bf16_in ? bf16_to_float(gate_b[i]) : gate[i], u = bf16_in ? bf16_to_float(up_b[i]) : up[i];
            const float z = gelu ? g * (g * g * GELU_C3 + GELU_C1) : g;
            const float value = g / (1.0f + expf(-z)) * u;
            if (bf16_out)
                yb[i] = float_to_bf16(value);
            else
                y[i] = value;
        }
    }
}

void infer_silu_mul(const float *gate_up, float *out, int64_t rows, int64_t width) {
    gated_mul(gate_up, out, rows, width, 0, 0, 0);
}

void infer_gelu_tanh_mul(const float *gate_up, float *out, int64_t rows, int64_t width) {
    gated_mul(gate_up, out, rows, width, 1, 0, 0);
}

void gated_mul_rows(const float *gate_up, void *out, int64_t rows, int64_t width, int64_t activation, int bf16_out) {
    const int gelu = activation == ACT_GELU_TANH;
    if (gelu && bf16_out)
        gated_mul(gate_up, out, rows, width, 1, 0, 1);
    else if (gelu)
        gated_mul(gate_up, out, rows, width, 1, 0, 0);
    else if (bf16_out)
        gated_mul(gate_up, out, rows, width, 0, 0, 1);
    else
        gated_mul(gate_up, out, rows, width, 0, 0, 0);
}

void infer_silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t width) {
    gated_mul(gate_up, out, rows, width, 0, 1, 1);
}

void infer_gelu_tanh_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t width) {
    gated_mul(gate_up, out, rows, width, 1, 1, 1);
}

/* ---- RoPE and the KV write -------------------------------------------------------------------------------------- */

/* One token's first num_heads heads rotated in place by its positions' rows c and s of the cos / signed-sin
 * tables (infer_rope): in each head the first rotary_dim values, pairs (i, i + rotary_dim / 2); the rest pass
 * (partial rotary). */
static inline void rotate_row(float *row, const float *c, const float *s, int64_t num_heads, int64_t head_dim,
                              int64_t rotary_dim) {
    const int64_t half = rotary_dim / 2;
    for (int64_t h = 0; h < num_heads; h++) {
        float *x = row + h * head_dim;
        for (int64_t i = 0; i < half; i++) {
            float a = x[i], b = x[i + half];
            x[i] = a * c[i] + b * s[i];
            x[i + half] = b * c[i + half] + a * s[i + half];
        }
    }
}

void infer_rope(float *qkv, const int64_t *positions, const float *cos_table, const float *sin_table,
                int64_t tokens, int64_t row_stride, int64_t num_heads, int64_t head_dim, int64_t rotary_dim) {
#pragma omp parallel for if (tokens >= 16)
    for (int64_t t = 0; t < tokens; t++)
        rotate_row(qkv + t * row_stride, cos_table + positions[t] * rotary_dim, sin_table + positions[t] * rotary_dim,
                   num_heads, head_dim, rotary_dim);
}

/* One head RMSNormed over head_dim, w * (x * rsqrt(mean(x^2) + eps)), then rotated as rotate_row rotates it, while
 * it is in L1: the sum of squares reads the head, the loop that rotates it scales it first. */
static inline void norm_rotate_head(float *restrict x, const float *restrict w, const float *restrict c,
                                    const float *restrict s, int64_t head_dim, int64_t rotary_dim, float eps) {
    const int64_t half = rotary_dim / 2;
    const float scale = 1.0f / sqrtf(dot(x, x, head_dim) / (float)head_dim + eps);
    for (int64_t i = 0; i < half; i++) {
        float a = w[i] * (x[i] * scale), b = w[i + half] * (x[i + half] * scale);
        x[i] = a * c[i] + b * s[i];
        x[i + half] = b * c[i + half] + a * s[i + half];
    }
    for (int64_t i = rotary_dim; i < head_dim; i++) x[i] = w[i] * (x[i] * scale);
}

/* rotate_row with each head normed first: the first q_heads by q_norm, the rest by k_norm. */
static inline void norm_rotate_row(float *row, const float *c, const float *s, int64_t q_heads, int64_t num_heads,
                                   int64_t head_dim, int64_t rotary_dim, const float *q_norm, const float *k_norm,
                                   float eps) {
    for (int64_t h = 0; h < num_heads; h++)
        norm_rotate_head(row + h * head_dim, h < q_heads ? q_norm : k_norm, c, s, head_dim, rotary_dim, eps);
}

void rope_layer_heads(float *qkv, const int64_t *positions, const float *cos_table, const float *sin_table,
                      int64_t tokens, int64_t row_stride, int64_t q_heads, int64_t num_heads, int64_t head_dim,
                      int64_t rotary_dim, const float *q_norm, const float *k_norm, float eps) {
#pragma omp parallel for if (tokens >= 16)
    for (int64_t t = 0; t < tokens; t++) {
        float *row = qkv + t * row_stride;
        const float *c = cos_table + positions[t] * rotary_dim, *s = sin_table + positions[t] * rotary_dim;
        if (q_norm)
            norm_rotate_row(row, c, s, q_heads, num_heads, head_dim, rotary_dim, q_norm, k_norm, eps);
        else
            rotate_row(row, c, s, num_heads, head_dim, rotary_dim);
    }
}

void infer_rope_norms(const uint16_t *from, float *qkv, const int64_t *positions, const float *cos_table,
                      const float *sin_table, int64_t tokens, int64_t row_stride, int64_t q_heads, int64_t num_heads,
                      int64_t head_dim, const float *q_norm, const float *k_norm, float eps) {
#pragma omp parallel for if (tokens >= 16)
    for (int64_t t = 0; t < tokens; t++) {
        float *row = qkv + t * row_stride;
        if (from) bf16_to_floats(from + t * row_stride, row, row_stride);
        norm_rotate_row(row, cos_table + positions[t] * head_dim, sin_table + positions[t] * head_dim, q_heads,
                        num_heads, head_dim, head_dim, q_norm, k_norm, eps);
    }
}

/* One pass: each row widened, then rotated while it is in L1. */
void infer_rope_widen(const uint16_t *qkv, float *out, const int64_t *positions, const float *cos_table,
                      const float *sin_table, int64_t tokens, int64_t width, int64_t num_heads, int64_t head_dim,
                      int64_t rotary_dim) {
#pragma omp parallel for if (tokens >= 16)
    for (int64_t t = 0; t < tokens; t++) {
        bf16_to_floats(qkv + t * width, out + t * width, width);
        rotate_row(out + t * width, cos_table + positions[t] * rotary_dim, sin_table + positions[t] * rotary_dim,
                   num_heads, head_dim, rotary_dim);
    }
}

void infer_write_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride, void *kv,
                    const int64_t *slots, int64_t tokens, int64_t width, int64_t num_slots, int64_t kv_bf16) {
#pragma omp parallel for if (tokens * width >= PARALLEL_ELEMENTS / 2)
    for (int64_t t = 0; t < tokens; t++) {
        if (slots[t] < 0) continue;
        if (kv_bf16) {
            floats_to_bf16(k + t * k_stride, (uint16_t *)kv + slots[t] * width, width);
            floats_to_bf16(v + t * v_stride, (uint16_t *)kv + (num_slots + slots[t]) * width, width);
            continue;
        }
        memcpy((float *)kv + slots[t] * width, k + t * k_stride, width * sizeof(float));
        memcpy((float *)kv + (num_slots + slots[t]) * width, v + t * v_stride, width * sizeof(float));
    }
}
