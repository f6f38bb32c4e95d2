/* Paged attention's AVX-512 kernels (paged_attention.h): a bf16 pool's key and value rows (DIRECT_HEAD_DIMS wide) read
 * straight from the pool and widened in registers once for all the query heads of a pass, or multiplied as they
 * are on AVX512-BF16's dot products (`dots`); and the value weighing of several heads a pass over float32 or bf16
 * rows, 64 columns a pass. The scores' kernels hold a head's query in registers: a copy of each per head size, the
 * size a constant in it (score_heads dispatches). */
#include "paged_attention.h"

#if INFER_AVX512
/* results[h][c..c+64) = sum_j weights[h][j] * values[j][c..c+64) for `count` (1 to WEIGH_HEADS, a constant once
 * inlined) heads sharing the value rows (values[j] at rows[j] + offset elements: floats, or bf16 widened in
 * registers when `bf16`): each value row is loaded once for all of them, and their 4 x count accumulators are
 * independent chains (one head's four alone wait on the FMA latency, 4 cycles a key). The same sums, in the same
 * order, as weigh_values with factor 1. */
static inline __attribute__((always_inline)) void weigh_heads_block(float *const *weights, const void *const *rows,
                                                                    ptrdiff_t offset, int64_t n,
                                                                    float *const *results, const int count,
                                                                    const int bf16, kv_stream *stream) {
    __m512 acc[WEIGH_HEADS][4];
    for (int h = 0; h < count; h++)
        for (int i = 0; i < 4; i++) acc[h][i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        if (j % 2 == 0) stream_lines(stream, STREAM_LINES);
        __m512 v[4];
        for (int i = 0; i < 4; i++)
            v[i] = bf16 ? bf16x16_load((const uint16_t *)rows[j] + offset + 16 * i)
                        : _mm512_loadu_ps((const float *)rows[j] + offset + 16 * i);
        for (int h = 0; h < count; h++) {
            const __m512 w = _mm512_set1_ps(weights[h][j]);
            for (int i = 0; i < 4; i++) acc[h][i] = _mm512_fmadd_ps(w, v[i], acc[h][i]);
        }
    }
    for (int h = 0; h < count; h++)
        for (int i = 0; i < 4; i++) _mm512_storeu_ps(results[h] + 16 * i, acc[h][i]);
}

/* weigh_heads_block for `count` heads, the count and the rows' type constants in each copy (the accumulators stay in
 * registers). */
void weigh_pass(float *const *weights, const void *const *rows, ptrdiff_t offset, int64_t n, float *const *results,
                int count, int bf16, kv_stream *stream) {
#define WEIGH_CASE(k) \
    case k: \
        if (bf16) weigh_heads_block(weights, rows, offset, n, results, k, 1, stream); \
        else weigh_heads_block(weights, rows, offset, n, results, k, 0, stream); \
        break;
    switch (count) {
        WEIGH_CASE(1)
        WEIGH_CASE(2)
        WEIGH_CASE(3)
        WEIGH_CASE(4)
        WEIGH_CASE(5)
        default:
            if (bf16) weigh_heads_block(weights, rows, offset, n, results, WEIGH_HEADS, 1, stream);
            else weigh_heads_block(weights, rows, offset, n, results, WEIGH_HEADS, 0, stream);
    }
#undef WEIGH_CASE
}

/* Keys j..j+3's scores `four` into scores (those below n: the last pass repeats a key) and into the running
 * maxima `top`. */
static inline __attribute__((always_inline)) void keep_scores(__m128 four, float *scores, int64_t j, int64_t n,
                                                              __m128 *top) {
    if (j + 4 <= n) {
        _mm_storeu_ps(scores + j, four);
        *top = _mm_max_ps(*top, four);
        return;
    }
    float last[4];
    _mm_storeu_ps(last, four);
    for (int64_t r = 0; r < n - j; r++) {
        scores[j + r] = last[r];
        *top = _mm_max_ps(*top, _mm_set1_ps(last[r]));
    }
}

/* scores[h][j] = scale * queries[h] . keys[j] for `count` (1 to 3) query heads of `head_dim` (64 to
 * DIRECT_HEAD_DIM_MAX, a multiple of 64; both constants once inlined) and j < n, each key widened once for all of
 * them, 64 columns at a time, four keys a pass; best[h] their maxima. The last pass repeats key n - 1 where fewer
 * than four are left (a key's score never depends on the others of its pass). */
static inline __attribute__((always_inline)) void score_bf16_block(const float *const *queries,
                                                                   const uint16_t *const *keys, int64_t n,
                                                                   float scale, float *const *scores, float *best,
                                                                   const int count, const int head_dim,
                                                                   kv_stream *stream) {
    __m512 qv[3][DIRECT_HEAD_DIM_MAX / 16];
    __m128 top[3];
    for (int h = 0; h < count; h++) {
        for (int i = 0; i < head_dim / 16; i++) qv[h][i] = _mm512_loadu_ps(queries[h] + 16 * i);
        top[h] = _mm_set1_ps(-INFINITY);
    }
    const __m128 factor = _mm_set1_ps(scale);
    for (int64_t j = 0; j < n; j += 4) {
        __m512 acc[3][4];
        stream_lines(stream, STREAM_LINES);
        for (int r = 0; r < 4; r++) {
            const uint16_t *key = keys[j + r < n ? j + r : n - 1];
            for (int c = 0; c < head_dim; c += 64) {
                const __m512 k0 = bf16x16_load(key + c), k1 = bf16x16_load(key + c + 16),
                             k2 = bf16x16_load(key + c + 32), k3 = bf16x16_load(key + c + 48);
                for (int h = 0; h < count; h++) {
                    const __m512 *q = qv[h] + c / 16;
                    const __m512 first = c ? _mm512_fmadd_ps(q[0], k0, acc[h][r]) : _mm512_mul_ps(q[0], k0);
                    acc[h][r] = _mm512_fmadd_ps(q[3], k3, _mm512_fmadd_ps(q[2], k2, _mm512_fmadd_ps(q[1], k1,
                                                                                                   first)));
                }
            }
        }
        for (int h = 0; h < count; h++)
            keep_scores(_mm_mul_ps(sum4x16(acc[h][0], acc[h][1], acc[h][2], acc[h][3]), factor), scores[h], j, n,
                        &top[h]);
    }
    for (int h = 0; h < count; h++) best[h] = max4(top[h]);
}
#endif

#if INFER_AVX512_BF16
/* score_bf16_block on AVX512-BF16's dot products: the queries rounded to bf16 once, each key row's bf16 multiplied
 * as it is in the pool, two VDPBF16PS a query head per 64 columns where the float32 path widens four registers and
 * runs four FMAs. */
static inline __attribute__((always_inline)) void score_dots_block(const float *const *queries,
                                                                   const uint16_t *const *keys, int64_t n,
                                                                   float scale, float *const *scores, float *best,
                                                                   const int count, const int head_dim,
                                                                   kv_stream *stream) {
    __m512bh qb[3][DIRECT_HEAD_DIM_MAX / 32];
    __m128 top[3];
    for (int h = 0; h < count; h++) {
        for (int i = 0; i < head_dim / 32; i++)
            qb[h][i] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(queries[h] + 32 * i + 16),
                                           _mm512_loadu_ps(queries[h] + 32 * i));
        top[h] = _mm_set1_ps(-INFINITY);
    }
    const __m128 factor = _mm_set1_ps(scale);
    for (int64_t j = 0; j < n; j += 4) {
        __m512 acc[3][4];
        stream_lines(stream, STREAM_LINES);
        for (int r = 0; r < 4; r++) {
            const uint16_t *key = keys[j + r < n ? j + r : n - 1];
            for (int h = 0; h < count; h++) acc[h][r] = _mm512_setzero_ps();
            for (int c = 0; c < head_dim; c += 64) {
                const __m512bh k0 = (__m512bh)_mm512_loadu_si512(key + c);
                const __m512bh k1 = (__m512bh)_mm512_loadu_si512(key + c + 32);
                for (int h = 0; h < count; h++)
                    acc[h][r] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[h][r], qb[h][c / 32], k0), qb[h][c / 32 + 1],
                                                 k1);
            }
        }
        for (int h = 0; h < count; h++)
            keep_scores(_mm_mul_ps(sum4x16(acc[h][0], acc[h][1], acc[h][2], acc[h][3]), factor), scores[h], j, n,
                        &top[h]);
    }
    for (int h = 0; h < count; h++) best[h] = max4(top[h]);
}

/* weigh_heads_block on the dot products, for 64 columns of a bf16 pool's value rows: results[h] = sum_j
 * probs[h][j] * values[j] with the probabilities rounded to bf16 (probs: pairs of consecutive keys; past an odd n's
 * last key, a probability 0 beside its row read again). Two value rows' words interleaved (VPUNPCKLWD/HWD) are the
 * pairs VDPBF16PS multiplies with a head's two probabilities broadcast: each sum register then holds 16 of the 64
 * columns out of order, which one permute a 16 puts back on the store. */
static inline __attribute__((always_inline)) void weigh_dots_block(const uint32_t *const *probs,
                                                                   const void *const *rows, ptrdiff_t offset,
                                                                   int64_t n, float *const *results,
                                                                   const int count, kv_stream *stream) {
    __m512 acc[WEIGH_HEADS][4];
    for (int h = 0; h < count; h++)
        for (int i = 0; i < 4; i++) acc[h][i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 2) {
        stream_lines(stream, STREAM_LINES);
        const uint16_t *first = (const uint16_t *)rows[j] + offset;
        const uint16_t *second = (const uint16_t *)rows[j + 1 < n ? j + 1 : j] + offset;
        const __m512i a0 = _mm512_loadu_si512(first), a1 = _mm512_loadu_si512(first + 32);
        const __m512i b0 = _mm512_loadu_si512(second), b1 = _mm512_loadu_si512(second + 32);
        const __m512bh v[4] = {(__m512bh)_mm512_unpacklo_epi16(a0, b0), (__m512bh)_mm512_unpackhi_epi16(a0, b0),
                               (__m512bh)_mm512_unpacklo_epi16(a1, b1), (__m512bh)_mm512_unpackhi_epi16(a1, b1)};
        for (int h = 0; h < count; h++) {
            const __m512bh pair = (__m512bh)_mm512_set1_epi32((int)probs[h][j / 2]);
            for (int i = 0; i < 4; i++) acc[h][i] = _mm512_dpbf16_ps(acc[h][i], pair, v[i]);
        }
    }
    /* register 2i + 0 holds columns 32i + {0-3, 8-11, 16-19, 24-27}, 2i + 1 the 4-7s (per 128-bit lane) */
    const __m512i low = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i high = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int h = 0; h < count; h++)
        for (int i = 0; i < 2; i++) {
            _mm512_storeu_ps(results[h] + 32 * i, _mm512_permutex2var_ps(acc[h][2 * i], low, acc[h][2 * i + 1]));
            _mm512_storeu_ps(results[h] + 32 * i + 16,
                             _mm512_permutex2var_ps(acc[h][2 * i], high, acc[h][2 * i + 1]));
        }
}

/* Each head's float probabilities rounded to bf16 pairs in `pairs` (DECODE_CHUNK / 2 words a head of a pass, the
 * word past an odd n's last key zero), then weigh_dots_block over WEIGH_HEADS heads and 64 of head_dim's columns
 * at a time. */
void weigh_dots(float *const *weights, int64_t heads, const void *const *rows, ptrdiff_t offset, int64_t n,
                int64_t head_dim, uint32_t *pairs, float *const *results, kv_stream *stream) {
    const uint32_t *rounded[WEIGH_HEADS];
    for (int64_t h = 0; h < heads; h += WEIGH_HEADS) {
        const int count = heads - h < WEIGH_HEADS ? (int)(heads - h) : WEIGH_HEADS;
        for (int i = 0; i < count; i++) {
            uint32_t *own = pairs + i * (DECODE_CHUNK / 2);
            const float *w = weights[h + i];
            for (int64_t at = 0; at < n; at += 32) {
                const __m512 low = _mm512_maskz_loadu_ps(first_lanes(n - at), w + at);
                const __m512 high = _mm512_maskz_loadu_ps(first_lanes(n - at - 16), w + at + 16);
                _mm512_storeu_si512(own + at / 2, (__m512i)_mm512_cvtne2ps_pbh(high, low));
            }
            rounded[i] = own;
        }
        for (int64_t c = 0; c < head_dim; c += 64) {
            float *at[WEIGH_HEADS];
            for (int i = 0; i < count; i++) at[i] = results[h + i] + c;
            switch (count) {
#define DOTS_CASE(k) case k: weigh_dots_block(rounded, rows, offset + c, n, at, k, stream); break;
                DOTS_CASE(1) DOTS_CASE(2) DOTS_CASE(3) DOTS_CASE(4) DOTS_CASE(5)
                default: weigh_dots_block(rounded, rows, offset + c, n, at, WEIGH_HEADS, stream);
#undef DOTS_CASE
            }
        }
    }
}
#endif

#if INFER_AVX512
/* score_bf16_block's heads three at a time, or with `dots` (AVX512-BF16 builds) score_dots_block's, for one head
 * size (a constant once inlined). */
static inline __attribute__((always_inline)) void score_heads_sized(const float *const *queries, int64_t heads,
                                                                    const uint16_t *const *keys, int64_t n,
                                                                    float scale, float *const *scores, float *best,
                                                                    int dots, const int head_dim,
                                                                    kv_stream *stream) {
    (void)dots;
    for (int64_t h = 0; h < heads; h += 3) {
        const int count = heads - h < 3 ? (int)(heads - h) : 3;
#define SCORE_CASE(block, k) \
    case k: block(queries + h, keys, n, scale, scores + h, best + h, k, head_dim, stream); break;
#if INFER_AVX512_BF16
        if (dots) {
            switch (count) { SCORE_CASE(score_dots_block, 1) SCORE_CASE(score_dots_block, 2)
                             default: score_dots_block(queries + h, keys, n, scale, scores + h, best + h, 3,
                                                       head_dim, stream); }
            continue;
        }
#endif
        switch (count) { SCORE_CASE(score_bf16_block, 1) SCORE_CASE(score_bf16_block, 2)
                         default: score_bf16_block(queries + h, keys, n, scale, scores + h, best + h, 3, head_dim,
                                                   stream); }
#undef SCORE_CASE
    }
}

void score_heads(const float *const *queries, int64_t heads, const uint16_t *const *keys, int64_t n, float scale,
                 float *const *scores, float *best, int dots, int64_t head_dim, kv_stream *stream) {
    switch (head_dim) {
#define SIZED_CASE(size) \
    case size: score_heads_sized(queries, heads, keys, n, scale, scores, best, dots, size, stream); break;
        DIRECT_HEAD_DIMS(SIZED_CASE)
#undef SIZED_CASE
        default: abort();  /* the caller asks direct_head_dim first */
    }
}
#endif
