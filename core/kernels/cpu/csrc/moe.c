/* A mixture-of-experts layer's experts for the few tokens each takes in a step (infer_moe_experts): every active
 * expert's packed weights streamed from memory once, gate and up in one pass with the activation (SwiGLU, or
 * gpt-oss's clamped SwiGLU) on their sums plus biases, then down with each token's row (plus bias) added into its
 * output times its routing weight.
 *
 * Work is split by weight blocks, not by experts: each thread takes its share of every active expert's gate/up
 * blocks, then its share of the output columns (the down projection's blocks) for every expert in turn, so both
 * cores stay busy whatever the routing (one expert taking every token included), and each output column is summed
 * by one thread, experts in ascending order: no atomics, the same sums whatever the thread count.
 *
 * Over pack_tiles' layout (infer_moe_experts_tiles: bf16 experts where the kernels have tiles, which then hold that
 * copy alone) the same split runs in blocks of 32 output columns for any number of tokens an expert: gate's and up's
 * blocks of a thread's columns, the activation on their sums, then its share of down's columns with the
 * routing-weighted add. An expert of many tokens multiplies on AMX's tiles (its rows rounded to bf16, in chunks that
 * stay in L2), one of few with float32 FMAs over the widened weights, a GEMV pass of 8 rows at a time.
 *
 * Over GGUF's blocks (infer_moe_experts_blocks: Q4_0, Q4_1, Q8_0, MXFP4, Q4_K and Q6_K experts) the split is the
 * first one's, in groups of four output rows: each pair's row of x quantized per 32 columns once (in the layout the
 * gate/up kind's GEMV reads), that GEMV's integer dot products for a thread's gate and up groups, the activation on
 * their sums; then every pair's activations quantized for down's kind, and down's groups of a thread's output
 * columns. An expert of more tokens than one GEMV pass (prefill) takes the block GEMM's int8 design instead
 * (gemm_blocks.c): its rows quantized into that design's tiles (the same values), each group's quants unpacked once
 * and multiplied against every tile, where the GEMV would read the group again for each pass. */
#include "common.h"
#include "tiles.h"

/* Blocks [*first, *last) of `blocks` that thread `thread` of `threads` takes. */
static inline void thread_share(int64_t blocks, int thread, int threads, int64_t *first, int64_t *last) {
    *first = blocks * thread / threads;
    *last = blocks * (thread + 1) / threads;
}

/* The most tokens one of `experts` experts takes (expert e takes pairs starts[e] .. starts[e + 1] - 1). */
static inline int64_t most_tokens(const int64_t *starts, int64_t experts) {
    int64_t most = 0;
    for (int64_t e = 0; e < experts; e++)
        if (starts[e + 1] - starts[e] > most) most = starts[e + 1] - starts[e];
    return most;
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

/* Columns b * 4 .. b * 4 + 3 of `count` rows' activations from their gate and up sums (gate[r * 4 + i], up's
 * likewise) plus the biases where the expert has them (gate's [width] first, then up's): activated has `width`
 * columns a row. */
static inline void activate_group(const float *gate, const float *up, int64_t count, const float *bias, int64_t b,
                                  int64_t width, int64_t activation, float limit, float alpha, float *activated) {
    for (int64_t r = 0; r < count; r++)
        for (int i = 0; i < 4; i++) {
            float g = gate[r * 4 + i], u = up[r * 4 + i];
            if (bias) {
                g += bias[b * 4 + i];
                u += bias[width + b * 4 + i];
            }
            activated[r * width + b * 4 + i] = activate(g, u, activation, limit, alpha);
        }
}

/* out's columns b * 4 .. b * 4 + 3 of the tokens of pairs start .. start + count - 1 plus each pair's routing weight
 * times its down sums (sums[r * 4 + i]) plus the bias where the expert has it. */
static inline void add_routed_group(const float *sums, int64_t count, int64_t start, const float *bias, int64_t b,
                                    const int64_t *tokens, const float *weights, int64_t hidden, float *out) {
    for (int64_t r = 0; r < count; r++)
        for (int i = 0; i < 4; i++)
            out[tokens[start + r] * hidden + b * 4 + i] +=
                weights[start + r] * (sums[r * 4 + i] + (bias ? bias[b * 4 + i] : 0.0f));
}

void infer_moe_experts(const float *x, int64_t hidden, int64_t width, int64_t experts, const int64_t *expert_ids,
                       const int64_t *starts, const int64_t *tokens, const float *weights, const int64_t *gate_up,
                       const int64_t *gate_up_scales, int64_t gate_up_groups, const int64_t *down,
                       const int64_t *down_scales, int64_t down_groups, int64_t kind, const int64_t *gate_up_bias,
                       const int64_t *down_bias, int64_t activation, float limit, float alpha, float *out) {
    const int64_t pairs = starts[experts];
    const int64_t most = most_tokens(starts, experts);
    float *rows = malloc(sizeof(float) * pairs * hidden);       /* x's rows, grouped by expert */
    float *activated = malloc(sizeof(float) * pairs * width);   /* silu(gate) * up, grouped by expert */
    const int64_t gate_up_block = 4 * hidden * weight_bytes(kind), down_block = 4 * width * weight_bytes(kind);
    const int64_t gate_up_group = kind == KIND_I8 ? hidden / gate_up_groups : hidden;
    const int64_t down_group = kind == KIND_I8 ? width / down_groups : width;
#pragma omp parallel
    {
        const int thread = team_member(), threads = team_size();
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
                activate_group(gate, up, count, bias, b, width, activation, limit, alpha, activated + start * width);
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
                add_routed_group(gate, count, start, bias, b, tokens, weights, hidden, out);
            }
        }
        free(gate);
    }
    free(rows);
    free(activated);
}

/* ---- over pack_tiles' layout (infer_moe_experts_tiles) ---------------------------------------------------------- */

/* Rows of an expert's tokens taken at a time: their bf16 rows (hidden 2048: 1 MB) stay in L2 while each block of
 * weights passes over them, as the tile GEMM's TILE_CHUNK_ROWS; a multiple of 32 (AMX's two 16-row tiles). */
#define EXPERT_CHUNK_ROWS 256

/* Rows of expert e's chunk from pair `chunk` on (its pairs are starts[e] .. starts[e + 1] - 1). */
static inline int64_t chunk_rows(const int64_t *starts, int64_t e, int64_t chunk) {
    const int64_t left = starts[e + 1] - chunk;
    return left < EXPERT_CHUNK_ROWS ? left : EXPERT_CHUNK_ROWS;
}

/* uint16s of one block of 32 output columns over k inputs in pack_tiles' layout. */
static inline int64_t tile_block(int64_t k) { return k / 32 * 1024; }

#if INFER_AVX512
/* y[r][0..31] = row r of x (float32, k each) times one block of 32 output columns, rows 0..count-1: the tile
 * GEMV's sums (gemv_block_fma, tiles.h), exact widened weights and float32 FMAs, kept in registers (a constant count
 * per copy: pass_fma). */
static inline __attribute__((always_inline)) void block_fma(const float *x, int64_t k, const uint16_t *wb, float *y,
                                                            const int count) {
    __m512 acc[PASS_ROWS][2];
    gemv_block_fma(x, k, wb, acc, count);
    for (int r = 0; r < count; r++) {
        _mm512_storeu_ps(y + r * 32, acc[r][0]);
        _mm512_storeu_ps(y + r * 32 + 16, acc[r][1]);
    }
}

static void pass_fma(const float *x, int64_t k, const uint16_t *wb, float *y, int count) {
    switch (count) {
#define FMA_CASE(c) case c: block_fma(x, k, wb, y, c); break;
        FMA_CASE(1) FMA_CASE(2) FMA_CASE(3) FMA_CASE(4) FMA_CASE(5) FMA_CASE(6) FMA_CASE(7) FMA_CASE(8)
#undef FMA_CASE
    }
}
#endif

#if INFER_AMX
/* y[r][0..31] for rows 0..padded-1 (a multiple of 32) of xb (bf16, k each) times one block, on AMX tiles: 2 x 2
 * tiles of results per 32 rows, the block's two B tiles per 32 k loaded once for both row tiles. The calling thread
 * has configured its tiles (load_full_tiles). */
static void block_amx(const uint16_t *xb, int64_t padded, int64_t k, const uint16_t *wb, float *y) {
    for (int64_t m = 0; m < padded; m += 32) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        const uint16_t *x0 = xb + m * k, *x1 = x0 + 16 * k;
        for (int64_t t = 0; t < k / 32; t++) {
            if (m == 0) /* the first rows stream the block from memory: its lines asked for 2 and 8 k tiles ahead */
                for (int line = 0; line < 32; line++) {
                    __builtin_prefetch((const char *)(wb + (t + 2) * 1024) + line * 64, 0, 3);
                    __builtin_prefetch((const char *)(wb + (t + 8) * 1024) + line * 64, 0, 2);
                }
            _tile_loadd(4, x0 + t * 32, k * 2);
            _tile_loadd(5, x1 + t * 32, k * 2);
            _tile_loadd(6, wb + t * 1024, 64);
            _tile_loadd(7, wb + t * 1024 + 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        float *at = y + m * 32;
        _tile_stored(0, at, 128);
        _tile_stored(1, at + 16, 128);
        _tile_stored(2, at + 16 * 32, 128);
        _tile_stored(3, at + 16 * 32 + 16, 128);
    }
}
#endif

#if !INFER_AVX512
/* block_fma's sums in plain C (builds without AVX-512, which have no tiles: the reference the tests compare). */
static void block_portable(const float *x, int64_t count, int64_t k, const uint16_t *wb, float *y) {
    for (int64_t r = 0; r < count; r++)
        for (int c = 0; c < 32; c++) {
            float sum = 0.0f;
            for (int64_t t = 0; t < k / 32; t++)
                for (int p = 0; p < 16; p++) {
                    const uint16_t *pair = wb + t * 1024 + (c / 16) * 512 + p * 32 + (c % 16) * 2;
                    sum += x[r * k + t * 32 + 2 * p] * bf16_to_float(pair[0]) +
                           x[r * k + t * 32 + 2 * p + 1] * bf16_to_float(pair[1]);
                }
            y[r * 32 + c] = sum;
        }
}
#endif

/* y [rows][32] = an expert's rows times one block of 32 output columns: on AMX from xb (bf16, zero rows past `rows`
 * up to a multiple of 32) where `amx`, else from x (float32) in passes of PASS_ROWS rows, each pass reading the block
 * again (from L2 after the first). */
static void block_product(const float *x, const uint16_t *xb, int64_t rows, int amx, int64_t k, const uint16_t *wb,
                          float *y) {
#if INFER_AMX
    if (amx) {
        block_amx(xb, (rows + 31) / 32 * 32, k, wb, y);
        return;
    }
#endif
    (void)xb;
    (void)amx;
#if INFER_AVX512
    for (int64_t m = 0; m < rows; m += PASS_ROWS)
        pass_fma(x + m * k, k, wb, y + m * 32, (int)(rows - m < PASS_ROWS ? rows - m : PASS_ROWS));
#else
    block_portable(x, rows, k, wb, y);
#endif
}

/* One row's 32 activated columns from its gate and up sums (plus their biases; NULL: none) into y (float32) or yb
 * (rounded to bf16: the AMX down projection's input). */
static void activate_block(const float *gate, const float *up, const float *gate_bias, const float *up_bias,
                           int64_t activation, float limit, float alpha, float *y, uint16_t *yb) {
#if INFER_AVX512
    const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
    for (int h = 0; h < 32; h += 16) {
        __m512 g = _mm512_loadu_ps(gate + h), u = _mm512_loadu_ps(up + h), value;
        if (gate_bias) {
            g = _mm512_add_ps(g, _mm512_loadu_ps(gate_bias + h));
            u = _mm512_add_ps(u, _mm512_loadu_ps(up_bias + h));
        }
        if (activation == ACTIVATION_CLAMPED_SWIGLU) {
            const __m512 top = _mm512_set1_ps(limit);
            g = _mm512_min_ps(g, top);
            u = _mm512_min_ps(_mm512_max_ps(u, _mm512_sub_ps(zero, top)), top);
            const __m512 scaled = _mm512_sub_ps(zero, _mm512_mul_ps(g, _mm512_set1_ps(alpha)));
            const __m512 sigmoid = _mm512_div_ps(one, _mm512_add_ps(one, exp16(scaled)));
            value = _mm512_mul_ps(_mm512_add_ps(u, one), _mm512_mul_ps(g, sigmoid));
        } else {
            const __m512 sigmoid = _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(zero, g))));
            value = _mm512_mul_ps(_mm512_mul_ps(g, sigmoid), u);
        }
        if (yb)
            _mm256_storeu_si256((__m256i *)(yb + h), bf16x16_from(value));
        else
            _mm512_storeu_ps(y + h, value);
    }
#else
    for (int c = 0; c < 32; c++) {
        const float g = gate[c] + (gate_bias ? gate_bias[c] : 0.0f), u = up[c] + (up_bias ? up_bias[c] : 0.0f);
        const float value = activate(g, u, activation, limit, alpha);
        if (yb)
            yb[c] = float_to_bf16(value);
        else
            y[c] = value;
    }
#endif
}

void infer_moe_experts_tiles(const float *x, int64_t hidden, int64_t width, int64_t experts,
                             const int64_t *expert_ids, const int64_t *starts, const int64_t *tokens,
                             const float *weights, const int64_t *gate_up, const int64_t *down,
                             const int64_t *gate_up_bias, const int64_t *down_bias, int64_t activation, float limit,
                             float alpha, int64_t tile_rows, float *out) {
    const int64_t pairs = starts[experts];
#if INFER_AMX
    const int amx = amx_available();
#else
    const int amx = 0;
#endif
    /* the experts on AMX: their bf16 rows from padded_start[e], each expert's padded to a multiple of 32 */
    int64_t *padded_start = malloc(sizeof(int64_t) * (experts + 1));
    int64_t *bf16_row = malloc(sizeof(int64_t) * (pairs + 1));  /* each pair's bf16 row, -1: none */
    int64_t most = 0;
    padded_start[0] = 0;
    for (int64_t e = 0; e < experts; e++) {
        const int64_t count = starts[e + 1] - starts[e], padded = (count + 31) / 32 * 32;
        const int on_tiles = amx && count >= tile_rows;
        padded_start[e + 1] = padded_start[e] + (on_tiles ? padded : 0);
        for (int64_t r = 0; r < count; r++) bf16_row[starts[e] + r] = on_tiles ? padded_start[e] + r : -1;
        if (padded > most) most = padded;
    }
    if (most > EXPERT_CHUNK_ROWS) most = EXPERT_CHUNK_ROWS;
    const int64_t padded_rows = padded_start[experts];
    float *rows = malloc(sizeof(float) * pairs * hidden);         /* x's rows, grouped by expert */
    float *activated = malloc(sizeof(float) * pairs * width);     /* act(gate, up), grouped by expert */
    uint16_t *rows_bf16 = padded_rows ? malloc(sizeof(uint16_t) * padded_rows * hidden) : NULL;
    uint16_t *activated_bf16 = padded_rows ? malloc(sizeof(uint16_t) * padded_rows * width) : NULL;
    const int64_t gate_up_block = tile_block(hidden), down_block = tile_block(width), up_offset = width / 32;
#pragma omp parallel
    {
        const int thread = team_member(), threads = team_size();
        float *gate = malloc(sizeof(float) * 2 * 32 * most), *up = gate + 32 * most;
#if INFER_AMX
        if (padded_rows) load_full_tiles();
#endif
#pragma omp for schedule(static)
        for (int64_t p = 0; p < pairs; p++) {
            memcpy(rows + p * hidden, x + tokens[p] * hidden, sizeof(float) * hidden);
            if (bf16_row[p] >= 0) floats_to_bf16(rows + p * hidden, rows_bf16 + bf16_row[p] * hidden, hidden);
        }
#pragma omp for schedule(static)
        for (int64_t e = 0; e < experts; e++) {  /* the AMX experts' padding rows: zero */
            const int64_t count = starts[e + 1] - starts[e], end = padded_start[e + 1];
            for (int64_t r = padded_start[e] + count; r < end; r++) {
                memset(rows_bf16 + r * hidden, 0, sizeof(uint16_t) * hidden);
                memset(activated_bf16 + r * width, 0, sizeof(uint16_t) * width);
            }
        }
        int64_t first, last;
        thread_share(width / 32, thread, threads, &first, &last);
        for (int64_t e = 0; e < experts; e++) {
            const int64_t id = expert_ids[e], on_tiles = padded_start[e + 1] > padded_start[e];
            const uint16_t *weight = (const uint16_t *)(intptr_t)gate_up[id];
            const float *bias = gate_up_bias ? (const float *)(intptr_t)gate_up_bias[id] : NULL;
            for (int64_t chunk = starts[e]; chunk < starts[e + 1]; chunk += EXPERT_CHUNK_ROWS) {
                const int64_t count = chunk_rows(starts, e, chunk), row_bf16 = padded_start[e] + (chunk - starts[e]);
                const float *xf = rows + chunk * hidden;
                const uint16_t *xb = on_tiles ? rows_bf16 + row_bf16 * hidden : NULL;
                for (int64_t b = first; b < last; b++) {
                    block_product(xf, xb, count, (int)on_tiles, hidden, weight + b * gate_up_block, gate);
                    block_product(xf, xb, count, (int)on_tiles, hidden, weight + (b + up_offset) * gate_up_block, up);
                    for (int64_t r = 0; r < count; r++)
                        activate_block(gate + r * 32, up + r * 32, bias ? bias + b * 32 : NULL,
                                       bias ? bias + width + b * 32 : NULL, activation, limit, alpha,
                                       activated + (chunk + r) * width + b * 32,
                                       on_tiles ? activated_bf16 + (row_bf16 + r) * width + b * 32 : NULL);
                }
            }
        }
#pragma omp barrier
        thread_share(hidden / 32, thread, threads, &first, &last);
        for (int64_t e = 0; e < experts; e++) {
            const int64_t id = expert_ids[e], on_tiles = padded_start[e + 1] > padded_start[e];
            const uint16_t *weight = (const uint16_t *)(intptr_t)down[id];
            const float *bias = down_bias ? (const float *)(intptr_t)down_bias[id] : NULL;
            for (int64_t chunk = starts[e]; chunk < starts[e + 1]; chunk += EXPERT_CHUNK_ROWS) {
                const int64_t count = chunk_rows(starts, e, chunk), row_bf16 = padded_start[e] + (chunk - starts[e]);
                const uint16_t *ab = on_tiles ? activated_bf16 + row_bf16 * width : NULL;
                for (int64_t b = first; b < last; b++) {
                    block_product(activated + chunk * width, ab, count, (int)on_tiles, width,
                                  weight + b * down_block, gate);
                    for (int64_t r = 0; r < count; r++) {
                        float *y = out + tokens[chunk + r] * hidden + b * 32;
                        const float routed = weights[chunk + r];
                        for (int c = 0; c < 32; c++)
                            y[c] += routed * (gate[r * 32 + c] + (bias ? bias[b * 32 + c] : 0.0f));
                    }
                }
            }
        }
#if INFER_AMX
        if (padded_rows) _tile_release();
#endif
        free(gate);
    }
    free(padded_start);
    free(bf16_row);
    free(rows);
    free(activated);
    free(rows_bf16);
    free(activated_bf16);
}

/* ---- over GGUF's blocks (infer_moe_experts_blocks) -------------------------------------------------------------- */

/* Where each pair's quantized rows sit: experts of more tokens than one GEMV pass (K-quants': KQUANT_GEMV_ROWS), in
 * a kind the block GEMM's int8 design takes, in that design's layout (`row[p]`: the pair's row there, each such
 * expert's from a tile's first row; `*padded`: the rows, tiles whole), the others in the GEMV's (row[p] = -1). */
static void gemm_rows(const int64_t *starts, int64_t experts, int64_t kind, int64_t *row, int64_t *padded) {
    const int64_t lanes = block_gemm_tile_rows(kind);
    *padded = 0;
    for (int64_t e = 0; e < experts; e++) {
        const int64_t count = starts[e + 1] - starts[e];
        const int gemm = lanes && count > (kind == KIND_Q4_K || kind == KIND_Q6_K ? KQUANT_GEMV_ROWS
                                                                                    : infer_block_pass_rows());
        for (int64_t p = starts[e]; p < starts[e + 1]; p++) row[p] = gemm ? *padded + p - starts[e] : -1;
        if (gemm) *padded += (count + lanes - 1) / lanes * lanes;
    }
    row[starts[experts]] = -1;  /* an expert of no pairs at the end reads this one */
}

/* Pairs' rows quantized as a kind's GEMV reads them: q [pairs, k], scales and sums [pairs, per_row]. */
typedef struct {
    int8_t *q;
    float *scales, *sums;
    int64_t per_row;
} gemv_rows;

/* A pair's row of x (k floats) quantized for `kind`: into the GEMM's layout where row >= 0, else the GEMV's. */
static inline void quantize_pair(const float *x, int64_t k, int64_t kind, int64_t p, int64_t row,
                                 const gemv_rows *gemv, const int8_tiles *gemm) {
    if (row >= 0)
        block_gemm_quantize_row(x, k, row, gemm);
    else
        block_quantize_rows(x, 1, k, kind, gemv->q + p * k, gemv->scales + p * gemv->per_row,
                            gemv->sums + p * gemv->per_row);
}

/* One group's sums [count][4] over an expert's pairs from `start`: the GEMM's where its rows are there. */
static inline void expert_group_sums(const uint8_t *group, int64_t k, int64_t kind, int64_t start, int64_t count,
                                     const int64_t *row, const gemv_rows *gemv, const int8_tiles *gemm,
                                     uint8_t *scratch, float *out) {
    if (row[start] >= 0) {
        const int8_tiles tiles = int8_tiles_from(gemm, row[start], k);
        block_gemm_group_sums(group, k, &tiles, count, kind, scratch, out);
    } else {
        block_group_sums(group, k, gemv->q + start * k, gemv->scales + start * gemv->per_row,
                         gemv->sums + start * gemv->per_row, count, kind, out);
    }
}

void infer_moe_experts_blocks(const float *x, int64_t hidden, int64_t width, int64_t experts,
                              const int64_t *expert_ids, const int64_t *starts, const int64_t *tokens,
                              const float *weights, const int64_t *gate_up, int64_t gate_up_kind,
                              const int64_t *down, int64_t down_kind, const int64_t *gate_up_bias,
                              const int64_t *down_bias, int64_t activation, float limit, float alpha, float *out) {
    const int64_t pairs = starts[experts];
    const int64_t x_row = block_row_scales(hidden, gate_up_kind), act_row = block_row_scales(width, down_kind);
    const int64_t most = most_tokens(starts, experts);
    /* each pair's row of x and of activations, quantized per 32 columns as the kinds' GEMVs quantize them (x_row and
     * act_row scales a row, and as many sums), grouped by expert; an expert of many tokens', in the block GEMM's
     * layout instead (gemm_rows) */
    int64_t *x_at = malloc(sizeof(int64_t) * 2 * (pairs + 1)), *act_at = x_at + pairs + 1, x_padded, act_padded;
    gemm_rows(starts, experts, gate_up_kind, x_at, &x_padded);
    gemm_rows(starts, experts, down_kind, act_at, &act_padded);
    gemv_rows x_gemv = {malloc(pairs * hidden), malloc(sizeof(float) * 2 * pairs * x_row), NULL, x_row};
    gemv_rows act_gemv = {malloc(pairs * width), malloc(sizeof(float) * 2 * pairs * act_row), NULL, act_row};
    x_gemv.sums = x_gemv.scales + pairs * x_row;
    act_gemv.sums = act_gemv.scales + pairs * act_row;
    const int8_tiles x_gemm = int8_tiles_alloc(x_padded, hidden), act_gemm = int8_tiles_alloc(act_padded, width);
    float *activated = malloc(sizeof(float) * pairs * width);
    const int64_t gate_up_group = block_group_bytes(hidden, gate_up_kind);
    const int64_t down_group = block_group_bytes(width, down_kind);
#pragma omp parallel
    {
        const int thread = team_member(), threads = team_size();
        float *gate = malloc(sizeof(float) * 8 * most), *up = gate + 4 * most;
        uint8_t *scratch = malloc(block_gemm_scratch_bytes(hidden > width ? hidden : width));
#pragma omp for schedule(static)
        for (int64_t p = 0; p < pairs; p++)
            quantize_pair(x + tokens[p] * hidden, hidden, gate_up_kind, p, x_at[p], &x_gemv, &x_gemm);
        int64_t first, last;
        thread_share(width / 4, thread, threads, &first, &last);
        for (int64_t e = 0; e < experts; e++) {
            const int64_t start = starts[e], count = starts[e + 1] - start, id = expert_ids[e];
            const uint8_t *weight = (const uint8_t *)(intptr_t)gate_up[id];
            const float *bias = gate_up_bias ? (const float *)(intptr_t)gate_up_bias[id] : NULL;
            for (int64_t b = first; b < last; b++) {
                expert_group_sums(weight + b * gate_up_group, hidden, gate_up_kind, start, count, x_at, &x_gemv,
                                  &x_gemm, scratch, gate);
                expert_group_sums(weight + (b + width / 4) * gate_up_group, hidden, gate_up_kind, start, count, x_at,
                                  &x_gemv, &x_gemm, scratch, up);
                activate_group(gate, up, count, bias, b, width, activation, limit, alpha, activated + start * width);
            }
        }
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t p = 0; p < pairs; p++)
            quantize_pair(activated + p * width, width, down_kind, p, act_at[p], &act_gemv, &act_gemm);
        thread_share(hidden / 4, thread, threads, &first, &last);
        for (int64_t e = 0; e < experts; e++) {
            const int64_t start = starts[e], count = starts[e + 1] - start, id = expert_ids[e];
            const uint8_t *weight = (const uint8_t *)(intptr_t)down[id];
            const float *bias = down_bias ? (const float *)(intptr_t)down_bias[id] : NULL;
            for (int64_t b = first; b < last; b++) {
                expert_group_sums(weight + b * down_group, width, down_kind, start, count, act_at, &act_gemv,
                                  &act_gemm, scratch, gate);
                add_routed_group(gate, count, start, bias, b, tokens, weights, hidden, out);
            }
        }
        free(scratch);
        free(gate);
    }
    free(x_at);
    free(x_gemv.q);
    free(x_gemv.scales);
    free(act_gemv.q);
    free(act_gemv.scales);
    free(x_gemm.q);
    free(act_gemm.q);
    free(activated);
}
