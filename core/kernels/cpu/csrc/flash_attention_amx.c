/* Flash attention's bf16 products on AMX tiles (flash_attention.h; head sizes FLASH_AMX_HEAD_DIMS), transposed: 16
 * query tokens of one head are the 16 lanes of every register. S^T = K Q^T (keys as A rows, Q^T as the B tiles), so
 * each register of scores is one key for the 16 tokens and the softmax's maxima, sums and rescaling are lane-wise
 * (no reductions across a register); O^T += V^T P^T, a tile of results per 16 dims x 16 tokens. The first 64 dims'
 * results stay in four tiles (2, 3, 6, 7) through the whole item; a larger head's other dims are held in memory
 * and pass through tiles 0 and 1 (the scores' tiles, free once a tile's scores are stored) for each tile of keys:
 * 128 dims' results alone would fill all eight tiles. A lane's maximum moves only when a tile's exceeds it by more
 * than FLASH_SLACK (then the held results are rescaled once), so the probabilities stay below e^FLASH_SLACK before
 * the final division: the same sums as rescaling at every tile, far fewer rescalings. The kernel is written once
 * over the head size, a constant in each copy (flash_items_amx dispatches). */
#include "flash_attention.h"

#if INFER_AVX512_BF16 && FLASH_AMX
#define FLASH_SLACK 8.0f
#define HELD_DIMS 64  /* the results held in tiles 2, 3, 6, 7 */

/* Key j into the AMX layouts: keys as rows of head_dim bf16, values transposed per tile of 32 keys (head_dim rows
 * of 32 keys, the A operand of V^T P^T). `key`/`value` NULL: zeros (padding past the context). */
static inline void flash_pack_key_amx(const void *key, const void *value, int kv_bf16, int64_t j, int64_t head_dim,
                                      uint16_t *packed_keys, uint16_t *packed_values) {
    uint16_t *kt = packed_keys + j * head_dim;
    uint16_t *vt = packed_values + (j / FLASH_KEYS) * FLASH_KEYS * head_dim + j % FLASH_KEYS;
    if (key && kv_bf16) {  /* a bf16 pool's row as it is */
        memcpy(kt, key, sizeof(uint16_t) * head_dim);
        for (int64_t d = 0; d < head_dim; d++) vt[d * FLASH_KEYS] = ((const uint16_t *)value)[d];
        return;
    }
    for (int64_t d = 0; d < head_dim; d++) {
        kt[d] = key ? float_to_bf16(((const float *)key)[d]) : 0;
        vt[d * FLASH_KEYS] = key ? float_to_bf16(((const float *)value)[d]) : 0;
    }
}

void flash_pack_amx(const flash_call *call, int64_t i, int64_t kvh, int64_t base, int64_t keys,
                    uint16_t *packed_keys, uint16_t *packed_values) {
    const size_t values = flash_values(call);
    for (int64_t j = 0; j < keys; j++) {
        const char *key = flash_key_row(call, i, kvh, base + j);
        flash_pack_key_amx(key, key ? key + values : NULL, (int)call->kv_bf16, j, call->head_dim, packed_keys,
                           packed_values);
    }
}

/* Tiles 0 and 1 = S^T of 32 keys (rows of head_dim bf16, from `keys`) and the 16 tokens of q_t (Q^T, head_dim / 2
 * dim pairs). */
static inline __attribute__((always_inline)) void flash_scores_amx(const uint32_t (*q_t)[16], const uint16_t *keys,
                                                                   const int head_dim) {
    _tile_zero(0);
    _tile_zero(1);
    for (int d = 0; d < head_dim; d += 32) {
        _tile_loadd(4, q_t[d / 2], 64);
        _tile_loadd(5, keys + d, head_dim * 2);
        _tile_dpbf16ps(0, 5, 4);
        _tile_loadd(5, keys + 16 * head_dim + d, head_dim * 2);
        _tile_dpbf16ps(1, 5, 4);
    }
}

/* Tiles 0 and 1 (S^T) into scores: a key per row, a token per lane. */
static inline __attribute__((always_inline)) void store_scores(float (*scores)[16]) {
    _tile_stored(0, &scores[0][0], 64);
    _tile_stored(1, &scores[16][0], 64);
}

/* Q^T as B tiles (q_t: per dim pair, the 16 tokens' pairs) from `tokens` (<= 16) query rows q_stride floats apart,
 * rounded to bf16; lanes past `tokens` zero queries, whose results are never read. */
static inline __attribute__((always_inline)) void transpose_queries(const float *q, int64_t q_stride, int64_t tokens,
                                                                    uint32_t (*q_t)[16], const int head_dim) {
    uint32_t q_rows[16][FLASH_AMX_HEAD_DIM_MAX / 2];  /* Q in bf16, a token per row (its dim pairs as 32-bit words) */
    for (int64_t t = 0; t < 16; t++) {
        for (int d = 0; d < head_dim; d += 32) {
            const __m512 low = t < tokens ? _mm512_loadu_ps(q + t * q_stride + d) : _mm512_setzero_ps();
            const __m512 high = t < tokens ? _mm512_loadu_ps(q + t * q_stride + d + 16) : _mm512_setzero_ps();
            _mm512_storeu_si512(&q_rows[t][d / 2], (__m512i)_mm512_cvtne2ps_pbh(high, low));
        }
    }
    const __m512i token_rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2,
                                                                   1, 0),
                                                  _mm512_set1_epi32(FLASH_AMX_HEAD_DIM_MAX / 2));
    for (int p = 0; p < head_dim / 2; p++)
        _mm512_storeu_si512(q_t[p], _mm512_i32gather_epi32(token_rows, &q_rows[0][p], 4));
}

/* The tile's scores scaled, in place: key k0 + j is seen by the tokens at or after its position (offset: token 0's)
 * and, with a window (> 0), less than `window` positions after it; masked to -inf for the others. Returns each
 * token's maximum over the tile. Unrolled, so that the four chains of maxima stay in registers. */
static inline __attribute__((always_inline)) __m512 scale_scores(float (*scores)[16], int64_t k0, int64_t offset,
                                                                 int64_t window, __m512 factor) {
    const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
    __m512 tops[4] = {minus_inf, minus_inf, minus_inf, minus_inf};
#pragma GCC unroll 32
    for (int j = 0; j < FLASH_KEYS; j++) {
        const int64_t ahead = k0 + j - offset, behind = ahead + window - 1;  /* the last token that sees it */
        __mmask16 seen = ahead <= 0 ? 0xFFFF : ahead >= 16 ? 0 : (__mmask16)(0xFFFFu << ahead);
        if (window) seen &= behind >= 15 ? 0xFFFF : behind < 0 ? 0 : (__mmask16)(0xFFFFu >> (15 - behind));
        const __m512 scaled = _mm512_mask_mul_ps(minus_inf, seen, _mm512_loadu_ps(scores[j]), factor);
        _mm512_storeu_ps(scores[j], scaled);
        tops[j % 4] = _mm512_max_ps(tops[j % 4], scaled);
    }
    return _mm512_max_ps(_mm512_max_ps(tops[0], tops[1]), _mm512_max_ps(tops[2], tops[3]));
}

/* Every token's results times its lane of rescale: the held tiles (2, 3, 6, 7) through `results`, the other dims
 * (`spilled`, head_dim - HELD_DIMS rows of 16 tokens) in place. */
static inline __attribute__((always_inline)) void rescale_results(float (*results)[16], float (*spilled)[16],
                                                                  __m512 rescale, const int head_dim) {
    _tile_stored(2, &results[0][0], 64);
    _tile_stored(3, &results[16][0], 64);
    _tile_stored(6, &results[32][0], 64);
    _tile_stored(7, &results[48][0], 64);
    for (int d = 0; d < HELD_DIMS; d++)
        _mm512_storeu_ps(results[d], _mm512_mul_ps(_mm512_loadu_ps(results[d]), rescale));
    for (int d = 0; d < head_dim - HELD_DIMS; d++)
        _mm512_storeu_ps(spilled[d], _mm512_mul_ps(_mm512_loadu_ps(spilled[d]), rescale));
    _tile_loadd(2, &results[0][0], 64);
    _tile_loadd(3, &results[16][0], 64);
    _tile_loadd(6, &results[32][0], 64);
    _tile_loadd(7, &results[48][0], 64);
}

/* P^T as a B tile (probs: per key pair, the 16 tokens' pairs) = exp(scores - held), rounded to bf16; returns their
 * sums per token. Unrolled, so that the four chains of sums stay in registers. */
static inline __attribute__((always_inline)) __m512 tile_probs(float (*scores)[16], __m512 held,
                                                               uint16_t (*probs)[16][2]) {
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512 sums[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
#pragma GCC unroll 16
    for (int j = 0; j < FLASH_KEYS; j += 2) {
        const __m512 p0 = exp16(_mm512_sub_ps(_mm512_loadu_ps(scores[j]), held));
        const __m512 p1 = exp16(_mm512_sub_ps(_mm512_loadu_ps(scores[j + 1]), held));
        sums[j / 2 % 4] = _mm512_add_ps(sums[j / 2 % 4], _mm512_add_ps(p0, p1));
        const __m512i pair = _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
        _mm512_storeu_si512(&probs[j / 2][0][0], pair);
    }
    return _mm512_add_ps(_mm512_add_ps(sums[0], sums[1]), _mm512_add_ps(sums[2], sums[3]));
}

/* O^T += V^T P^T for one tile of 32 keys: `values` this tile's V^T (a dim per row, 32 keys), P^T from probs; the
 * first 64 dims into the held tiles, the others two tiles of 16 dims at a time through tiles 0 and 1 from and back
 * to `spilled`. */
static inline __attribute__((always_inline)) void weigh_tile(const uint16_t (*probs)[16][2], const uint16_t *values,
                                                             float (*spilled)[16], const int head_dim) {
    _tile_loadd(4, &probs[0][0][0], 64);
    _tile_loadd(5, values, FLASH_KEYS * 2);
    _tile_dpbf16ps(2, 5, 4);
    _tile_loadd(5, values + 16 * FLASH_KEYS, FLASH_KEYS * 2);
    _tile_dpbf16ps(3, 5, 4);
    _tile_loadd(5, values + 32 * FLASH_KEYS, FLASH_KEYS * 2);
    _tile_dpbf16ps(6, 5, 4);
    _tile_loadd(5, values + 48 * FLASH_KEYS, FLASH_KEYS * 2);
    _tile_dpbf16ps(7, 5, 4);
    for (int d = HELD_DIMS; d < head_dim; d += 32) {
        float (*low)[16] = spilled + d - HELD_DIMS, (*high)[16] = low + 16;
        _tile_loadd(0, &low[0][0], 64);
        _tile_loadd(1, &high[0][0], 64);
        _tile_loadd(5, values + d * FLASH_KEYS, FLASH_KEYS * 2);
        _tile_dpbf16ps(0, 5, 4);
        _tile_loadd(5, values + (d + 16) * FLASH_KEYS, FLASH_KEYS * 2);
        _tile_dpbf16ps(1, 5, 4);
        _tile_stored(0, &low[0][0], 64);
        _tile_stored(1, &high[0][0], 64);
    }
}

/* O^T (the held tiles 2, 3, 6, 7 through `results`, the other dims from `spilled`, which follows it) back to a row
 * per token, divided by the token's sum (total, against its maximum held) with the head's `sink` logit added
 * (-INFINITY: none), into out (rows out_stride floats apart). */
static inline __attribute__((always_inline)) void store_tokens(__m512 total, __m512 held, float sink, int64_t tokens,
                                                               float (*results)[16], float *out, int64_t out_stride,
                                                               const int head_dim) {
    _tile_stored(2, &results[0][0], 64);
    _tile_stored(3, &results[16][0], 64);
    _tile_stored(6, &results[32][0], 64);
    _tile_stored(7, &results[48][0], 64);
    float inverse[16];
    _mm512_storeu_ps(inverse, _mm512_div_ps(_mm512_set1_ps(1.0f), total));
    if (sink > -INFINITY) {
        float sums[16], maxima[16];
        _mm512_storeu_ps(sums, total);
        _mm512_storeu_ps(maxima, held);
        for (int64_t t = 0; t < tokens; t++) inverse[t] = sink_inverse(sums[t], maxima[t], sink);
    }
    const __m512i dim_rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1,
                                                                 0), _mm512_set1_epi32(16));
    for (int64_t t = 0; t < tokens; t++) {
        const __m512 factor_t = _mm512_set1_ps(inverse[t]);
        for (int d = 0; d < head_dim; d += 16)
            _mm512_storeu_ps(out + t * out_stride + d,
                             _mm512_mul_ps(_mm512_i32gather_ps(dim_rows, &results[d][t], 4), factor_t));
    }
}

/* One work item: `tokens` (<= 16) query rows of one head, q_stride floats apart, positions offset onwards, against
 * the keys and values packed by flash_pack_key_amx from key `from` (a tile's first: the first any row sees) on,
 * with a sliding `window` (0: none) and the head's `sink` logit (-INFINITY: none), into out (rows out_stride floats
 * apart). The caller has loaded the tile configuration (every tile 16 rows of 64 bytes). Each tile's scores are
 * computed on the tile unit while the previous tile's softmax runs on the vector units: at head size 64 they stay
 * in tiles 0 and 1 until the next tile's turn; a larger head's weighing needs those tiles, so its scores are stored
 * at once (two buffers of scores). A token that has seen no key yet (before its window) holds -inf, and its
 * probabilities are taken against 0 instead (all zero, not (-inf) - (-inf)). */
static inline __attribute__((always_inline)) void flash_item_amx(const float *q, int64_t q_stride, int64_t tokens,
                                                                 int64_t offset, int64_t from, int64_t window,
                                                                 const uint16_t *keys, const uint16_t *values,
                                                                 float scale, float sink, float *out,
                                                                 int64_t out_stride, const int head_dim) {
    uint32_t q_t[FLASH_AMX_HEAD_DIM_MAX / 2][16];  /* Q^T as B tiles: per dim pair, the 16 tokens' pairs */
    float scores[2][FLASH_KEYS][16];               /* S^T of this tile and the next: a key per row */
    uint16_t probs[FLASH_KEYS / 2][16][2];         /* P^T as a B tile: per key pair, the 16 tokens' pairs */
    float results[FLASH_AMX_HEAD_DIM_MAX][16];     /* O^T: the held tiles' dims, then the spilled ones */
    float (*spilled)[16] = results + HELD_DIMS;
    transpose_queries(q, q_stride, tokens, q_t, head_dim);
    const __m512 factor = _mm512_set1_ps(scale);
    __m512 held = _mm512_set1_ps(-INFINITY), total = _mm512_setzero_ps();  /* per token: its sums' maximum */
    _tile_zero(2);
    _tile_zero(3);
    _tile_zero(6);
    _tile_zero(7);
    for (int d = 0; d < head_dim - HELD_DIMS; d++) _mm512_storeu_ps(spilled[d], _mm512_setzero_ps());
    const int64_t last = offset + tokens - 1;
    const int spills = head_dim > HELD_DIMS;
    flash_scores_amx(q_t, keys, head_dim);
    for (int64_t k0 = from, tile = 0; k0 <= last; k0 += FLASH_KEYS, tile ^= 1) {
        float (*own)[16] = scores[tile];
        if (!spills || k0 == from) store_scores(own);
        if (k0 + FLASH_KEYS <= last) {
            flash_scores_amx(q_t, keys + (k0 - from + FLASH_KEYS) * head_dim, head_dim);
            if (spills) store_scores(scores[tile ^ 1]);
        }
        const __m512 top = scale_scores(own, k0, offset, window, factor);
        const __mmask16 moved = _mm512_cmp_ps_mask(top, _mm512_add_ps(held, _mm512_set1_ps(FLASH_SLACK)),
                                                   _CMP_GT_OQ);
        if (moved) {  /* those tokens' sums rescaled to their new maxima (none held yet on the first tile) */
            const __m512 target = _mm512_mask_mov_ps(held, moved, top);
            __m512 rescale = exp16(_mm512_sub_ps(held, target));
            if (window) rescale = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), moved, rescale);  /* not -inf - -inf */
            total = _mm512_mul_ps(total, rescale);
            if (k0 > from) rescale_results(results, spilled, rescale, head_dim);
            held = target;
        }
        const __m512 shift = window ? _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(held, _mm512_set1_ps(-INFINITY),
                                                                             _CMP_NEQ_OQ), held) : held;
        total = _mm512_add_ps(total, tile_probs(own, shift, probs));
        weigh_tile(probs, values + (k0 - from) * head_dim, spilled, head_dim);
    }
    store_tokens(total, held, sink, tokens, results, out, out_stride, head_dim);
}

/* Every work item of one head size (a constant once inlined). */
static inline __attribute__((always_inline)) void flash_items_sized(const flash_call *call, const int head_dim) {
    const int64_t per_kv = call->num_heads / call->num_kv_heads;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < call->items_at[call->count]; item++) {
        const flash_item it = flash_item_at(call, item, call->num_heads);
        const int64_t at = call->packed_at[it.chunk] + (it.head / per_kv * it.keys + it.from - it.base) * head_dim;
        const int64_t row = call->starts[it.chunk] + it.first;
        flash_item_amx(call->q + row * call->q_stride + it.head * head_dim, call->q_stride, it.tokens, it.offset,
                       it.from, call->window, call->packed_keys + at, call->packed_values + at, call->scale,
                       call->sinks ? call->sinks[it.head] : -INFINITY,
                       call->out + (row * call->num_heads + it.head) * head_dim, call->num_heads * head_dim,
                       head_dim);
    }
}

void flash_items_amx(const flash_call *call) {
    load_full_tiles();
    switch (call->head_dim) {
#define SIZED_CASE(size) case size: flash_items_sized(call, size); break;
        FLASH_AMX_HEAD_DIMS(SIZED_CASE)
#undef SIZED_CASE
        default: abort();  /* call->amx is set for these sizes only */
    }
    _tile_release();
}
#endif
