/* Flash attention for prefill chunks (infer_flash_attention) on AVX512-BF16's dot products, or float32 FMAs over the
 * widened K/V (`fma`), and the entry that plans a call, packs its K/V and hands the work items to these kernels or
 * to the AMX ones (flash_attention_amx.c).
 *
 * Each chunk's K/V of each KV head are packed once (two tiles of keys per 32 as flash_scores reads them, values in
 * key pairs), then work items of FLASH_TOKENS query tokens times the query heads of one KV head run an online
 * softmax over tiles of 32 keys, the last tiles of each chunk (the most keys) first. With `fma` the products are
 * float32 FMAs over the widened K/V instead, Q and the probabilities kept float32 (for CPUs whose float32 rate beats
 * their bf16 dot products, as the tile GEMM's fma). Without fma, at the head sizes FLASH_AMX_HEAD_DIMS on a build
 * and OS with AMX, the products run on AMX tiles instead (K packed as rows, V transposed per tile, a work item per 16
 * query tokens of one head). */
#include "flash_attention.h"

int64_t infer_flash_kind(void) {
#if INFER_AVX512_BF16
    return amx_available() ? 2 : 1;
#else
    return 0;
#endif
}

#if INFER_AVX512_BF16
#define SCORE_ROWS 12      /* rows per pass of Q K^T: 2 accumulators each */
#define WEIGH_ROWS 6       /* rows per pass of P V: 4 accumulators each (64 columns of the result) */
#define SCORE_FMA_ROWS 8   /* flash_scores_fma: 16 accumulators, 4 widened key vectors (more rows spill) */
#define WEIGH_FMA_ROWS 4   /* flash_weigh_fma: 16 accumulators, 8 widened value vectors */

/* ---- one tile of keys: scores and value weighing, a pass of rows at a time -------------------------------------- */

/* A row's 32 scores (two registers) into the scores buffer. */
static inline __attribute__((always_inline)) void store_scores(const __m512 *acc, float *scores) {
    _mm512_storeu_ps(scores, acc[0]);
    _mm512_storeu_ps(scores + 16, acc[1]);
}

/* acc[r] = 64 columns (from c) of row r's running result times rescale[r], for rows 0..count-1: where a tile of P V
 * starts, the earlier tiles' sum scaled to the new row maximum. */
static inline __attribute__((always_inline)) void load_rescaled(__m512 (*acc)[4], int count, const float *acc_rows,
                                                                int64_t head_dim, int64_t c, const float *rescale) {
    for (int r = 0; r < count; r++) {
        const __m512 factor = _mm512_set1_ps(rescale[r]);
        for (int i = 0; i < 4; i++) acc[r][i] = _mm512_mul_ps(_mm512_loadu_ps(acc_rows + r * head_dim + c + 16 * i),
                                                              factor);
    }
}

/* load_rescaled's counterpart: the rows' 64 columns (from c) back into their running results. */
static inline __attribute__((always_inline)) void store_result(__m512 (*acc)[4], int count, float *acc_rows,
                                                               int64_t head_dim, int64_t c) {
    for (int r = 0; r < count; r++)
        for (int i = 0; i < 4; i++) _mm512_storeu_ps(acc_rows + r * head_dim + c + 16 * i, acc[r][i]);
}

/* scores[r][0..31] = q_r . key_j for rows 0..count-1 of qb (bf16, head_dim each) and the 32 keys of one packed
 * tile (two halves of 16 keys; per pair p of head_dim, one register of the 16 keys' (k[2p], k[2p + 1]) pairs). */
static inline __attribute__((always_inline)) void flash_scores(const uint16_t *qb, int64_t head_dim,
                                                               const uint16_t *keys, float *scores, const int count) {
    __m512 acc[SCORE_ROWS][2];
    for (int r = 0; r < count; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < head_dim / 2; p++) {
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(keys + p * 32);
        const __m512bh k1 = (__m512bh)_mm512_loadu_si512(keys + head_dim * 16 + p * 32);
        for (int r = 0; r < count; r++) {
            int32_t pair;
            memcpy(&pair, qb + r * head_dim + 2 * p, sizeof pair);
            const __m512bh qv = (__m512bh)_mm512_set1_epi32(pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qv, k0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qv, k1);
        }
    }
    for (int r = 0; r < count; r++) store_scores(acc[r], scores + r * FLASH_KEYS);
}

/* acc_r[c..c+63] = acc_r[c..c+63] * rescale[r] + sum_j p_rj v_j[c..c+63] for rows 0..count-1: probs (bf16, 32 a
 * row) times one packed tile of values (per key pair, head_dim columns of (v[2j][d], v[2j + 1][d]) pairs). */
static inline __attribute__((always_inline)) void flash_weigh(const uint16_t *probs, const uint16_t *values,
                                                              int64_t head_dim, int64_t c, const float *rescale,
                                                              float *acc_rows, const int count) {
    __m512 acc[WEIGH_ROWS][4];
    load_rescaled(acc, count, acc_rows, head_dim, c, rescale);
    for (int j = 0; j < FLASH_KEYS / 2; j++) {
        const uint16_t *pairs = values + j * 2 * head_dim + 2 * c;
        const __m512bh v0 = (__m512bh)_mm512_loadu_si512(pairs), v1 = (__m512bh)_mm512_loadu_si512(pairs + 32);
        const __m512bh v2 = (__m512bh)_mm512_loadu_si512(pairs + 64), v3 = (__m512bh)_mm512_loadu_si512(pairs + 96);
        for (int r = 0; r < count; r++) {
            int32_t pair;
            memcpy(&pair, probs + r * FLASH_KEYS + 2 * j, sizeof pair);
            const __m512bh pv = (__m512bh)_mm512_set1_epi32(pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], pv, v0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], pv, v1);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], pv, v2);
            acc[r][3] = _mm512_dpbf16_ps(acc[r][3], pv, v3);
        }
    }
    store_result(acc, count, acc_rows, head_dim, c);
}

/* flash_scores with float32 FMAs over the widened keys: rows of qf float32 (not rounded). */
static inline __attribute__((always_inline)) void flash_scores_fma(const float *qf, int64_t head_dim,
                                                                   const uint16_t *keys, float *scores,
                                                                   const int count) {
    __m512 acc[SCORE_FMA_ROWS][2];
    for (int r = 0; r < count; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < head_dim / 2; p++) {
        __m512 even0, odd0, even1, odd1;
        widen_pairs(_mm512_loadu_si512(keys + p * 32), &even0, &odd0);
        widen_pairs(_mm512_loadu_si512(keys + head_dim * 16 + p * 32), &even1, &odd1);
        for (int r = 0; r < count; r++) {
            const __m512 qe = _mm512_set1_ps(qf[r * head_dim + 2 * p]);
            const __m512 qo = _mm512_set1_ps(qf[r * head_dim + 2 * p + 1]);
            acc[r][0] = _mm512_fmadd_ps(qo, odd0, _mm512_fmadd_ps(qe, even0, acc[r][0]));
            acc[r][1] = _mm512_fmadd_ps(qo, odd1, _mm512_fmadd_ps(qe, even1, acc[r][1]));
        }
    }
    for (int r = 0; r < count; r++) store_scores(acc[r], scores + r * FLASH_KEYS);
}

/* flash_weigh with float32 FMAs: probs float32 (32 a row, not rounded) times the widened values. */
static inline __attribute__((always_inline)) void flash_weigh_fma(const float *probs, const uint16_t *values,
                                                                  int64_t head_dim, int64_t c, const float *rescale,
                                                                  float *acc_rows, const int count) {
    __m512 acc[WEIGH_FMA_ROWS][4];
    load_rescaled(acc, count, acc_rows, head_dim, c, rescale);
    for (int j = 0; j < FLASH_KEYS / 2; j++) {
        const uint16_t *pairs = values + j * 2 * head_dim + 2 * c;
        __m512 even[4], odd[4];  /* keys 2j and 2j + 1, 16 columns each */
        for (int i = 0; i < 4; i++) widen_pairs(_mm512_loadu_si512(pairs + 32 * i), &even[i], &odd[i]);
        for (int r = 0; r < count; r++) {
            const __m512 pe = _mm512_set1_ps(probs[r * FLASH_KEYS + 2 * j]);
            const __m512 po = _mm512_set1_ps(probs[r * FLASH_KEYS + 2 * j + 1]);
            for (int i = 0; i < 4; i++)
                acc[r][i] = _mm512_fmadd_ps(po, odd[i], _mm512_fmadd_ps(pe, even[i], acc[r][i]));
        }
    }
    store_result(acc, count, acc_rows, head_dim, c);
}

/* Scores of `rows` rows against one tile of 32 keys, a pass of rows at a time (a constant count per copy, so the
 * sums stay in registers): float32 FMAs over qf's rows, or the dot products over qb's. */
static void flash_score_rows(int fma, const uint16_t *qb, const float *qf, int64_t head_dim, const uint16_t *keys,
                             float *scores, int64_t rows) {
    for (int64_t r = 0; r < rows && fma;) {
        const int n = rows - r < SCORE_FMA_ROWS ? (int)(rows - r) : SCORE_FMA_ROWS;
        switch (n) {
#define SCORE_CASE(c) case c: flash_scores_fma(qf + r * head_dim, head_dim, keys, scores + r * FLASH_KEYS, c); break;
            SCORE_CASE(1) SCORE_CASE(2) SCORE_CASE(3) SCORE_CASE(4) SCORE_CASE(5) SCORE_CASE(6) SCORE_CASE(7)
            SCORE_CASE(8)
#undef SCORE_CASE
        }
        r += n;
    }
    for (int64_t r = 0; r < rows && !fma;) {
        const int n = rows - r < SCORE_ROWS ? (int)(rows - r) : SCORE_ROWS;
        switch (n) {
#define SCORE_CASE(c) case c: flash_scores(qb + r * head_dim, head_dim, keys, scores + r * FLASH_KEYS, c); break;
            SCORE_CASE(1) SCORE_CASE(2) SCORE_CASE(3) SCORE_CASE(4) SCORE_CASE(5) SCORE_CASE(6)
            SCORE_CASE(7) SCORE_CASE(8) SCORE_CASE(9) SCORE_CASE(10) SCORE_CASE(11) SCORE_CASE(12)
#undef SCORE_CASE
        }
        r += n;
    }
}

/* The running results of `rows` rows rescaled and plus their probabilities times one tile of values, 64 columns
 * and a pass of rows at a time: float32 FMAs over the float32 probabilities, or the dot products over the bf16
 * ones. */
static void flash_weigh_rows(int fma, const uint16_t *probs, const float *probs_f, const uint16_t *values,
                             int64_t head_dim, const float *rescale, float *acc, int64_t rows) {
    for (int64_t c = 0; c < head_dim; c += 64) {
        for (int64_t r = 0; r < rows && fma;) {
            const int n = rows - r < WEIGH_FMA_ROWS ? (int)(rows - r) : WEIGH_FMA_ROWS;
            switch (n) {
#define WEIGH_CASE(k) case k: flash_weigh_fma(probs_f + r * FLASH_KEYS, values, head_dim, c, rescale + r, \
                                              acc + r * head_dim, k); break;
                WEIGH_CASE(1) WEIGH_CASE(2) WEIGH_CASE(3) WEIGH_CASE(4)
#undef WEIGH_CASE
            }
            r += n;
        }
        for (int64_t r = 0; r < rows && !fma;) {
            const int n = rows - r < WEIGH_ROWS ? (int)(rows - r) : WEIGH_ROWS;
            switch (n) {
#define WEIGH_CASE(k) case k: flash_weigh(probs + r * FLASH_KEYS, values, head_dim, c, rescale + r, \
                                          acc + r * head_dim, k); break;
                WEIGH_CASE(1) WEIGH_CASE(2) WEIGH_CASE(3) WEIGH_CASE(4) WEIGH_CASE(5) WEIGH_CASE(6)
#undef WEIGH_CASE
            }
            r += n;
        }
    }
}

/* ---- a work item: FLASH_TOKENS query tokens times the query heads of one KV head -------------------------------- */

/* A thread's rows of a work item (FLASH_TOKENS * per_kv at most): Q's rows and the probabilities, float32 (the
 * probabilities in place of the scores) with fma, else bf16; the scores, running results, maxima and sums. */
typedef struct {
    uint16_t *qb, *probs;
    float *qf, *scores, *acc, *best, *total, *rescale, *top;
} flash_rows;

static void alloc_rows(flash_rows *buf, int64_t max_rows, int64_t head_dim, int fma) {
    buf->qb = fma ? NULL : malloc(sizeof(uint16_t) * max_rows * head_dim);
    buf->qf = fma ? malloc(sizeof(float) * max_rows * head_dim) : NULL;
    buf->probs = fma ? NULL : malloc(sizeof(uint16_t) * max_rows * FLASH_KEYS);
    buf->scores = malloc(sizeof(float) * max_rows * FLASH_KEYS);
    buf->acc = malloc(sizeof(float) * max_rows * head_dim);
    buf->best = malloc(sizeof(float) * max_rows);
    buf->total = malloc(sizeof(float) * max_rows);
    buf->rescale = malloc(sizeof(float) * max_rows);
    buf->top = malloc(sizeof(float) * max_rows);
}

static void free_rows(flash_rows *buf) {
    free(buf->top);
    free(buf->rescale);
    free(buf->total);
    free(buf->best);
    free(buf->acc);
    free(buf->scores);
    free(buf->probs);
    free(buf->qf);
    free(buf->qb);
}

/* The item's query rows (row r: token first + r / per_kv, head kvh * per_kv + r % per_kv), as float32 with fma or
 * rounded to bf16; their maxima and sums reset, their results zero. */
static void load_queries(const flash_call *call, const flash_rows *buf, const flash_item *it, int64_t rows) {
    const int64_t per_kv = call->num_heads / call->num_kv_heads, head_dim = call->head_dim;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t token = call->starts[it->chunk] + it->first + r / per_kv, head = it->head * per_kv + r % per_kv;
        const float *q = call->q + token * call->q_stride + head * head_dim;
        if (call->fma)
            memcpy(buf->qf + r * head_dim, q, sizeof(float) * head_dim);
        else
            floats_to_bf16(q, buf->qb + r * head_dim, head_dim);
        buf->best[r] = -INFINITY;
        buf->total[r] = 0.0f;
    }
    memset(buf->acc, 0, sizeof(float) * rows * head_dim);
}

/* Lanes `lane` onwards of the tile's 32 keys (two registers) that a row sees: up to its position (`seen` keys from
 * the tile's first), and with a window from its first key (`hidden` keys of the tile before it). */
static inline __attribute__((always_inline)) void row_lanes(int64_t seen, int64_t hidden, __mmask16 *m0,
                                                            __mmask16 *m1) {
    *m0 = first_lanes(seen) & (__mmask16)~first_lanes(hidden);
    *m1 = first_lanes(seen - 16) & (__mmask16)~first_lanes(hidden - 16);
}

/* The online softmax over the tile of keys k0 onwards, keys past a row's position and before its window (`window`
 * > 0) masked (offset: row 0's position): each row's scaled scores and new maximum, then every row's rescale 16 rows
 * a vector (a scalar expf a row costs a sixth of the softmax; 0 for a row that has seen no key yet, before its
 * window), then the probabilities (in place of the scores with fma, else rounded to bf16 into probs) and their
 * sums. */
static void softmax_tile(const flash_rows *buf, int64_t rows, int64_t per_kv, int64_t offset, int64_t k0,
                         float scale, int fma, int64_t window) {
    float *scores = buf->scores, *best = buf->best, *top = buf->top, *rescale = buf->rescale, *total = buf->total;
    const __m512 factor = _mm512_set1_ps(scale), none = _mm512_set1_ps(-INFINITY);
    for (int64_t r = 0; r < rows; r++) {
        const int64_t seen = offset + r / per_kv - k0 + 1, hidden = window ? seen - window : 0;
        __mmask16 m0, m1;
        row_lanes(seen, hidden, &m0, &m1);
        const __m512 s0 = _mm512_mul_ps(_mm512_loadu_ps(scores + r * FLASH_KEYS), factor);
        const __m512 s1 = _mm512_mul_ps(_mm512_loadu_ps(scores + r * FLASH_KEYS + 16), factor);
        _mm512_storeu_ps(scores + r * FLASH_KEYS, s0);
        _mm512_storeu_ps(scores + r * FLASH_KEYS + 16, s1);
        top[r] = fmaxf(best[r], _mm512_reduce_max_ps(_mm512_max_ps(_mm512_mask_mov_ps(none, m0, s0),
                                                                    _mm512_mask_mov_ps(none, m1, s1))));
    }
    for (int64_t r = 0; r < rows; r += 16) {  /* 0 on the first tile (best -inf) */
        const __mmask16 m = first_lanes(rows - r);
        const __m512 high = _mm512_maskz_loadu_ps(m, top + r);
        const __mmask16 seen = _mm512_cmp_ps_mask(high, none, _CMP_NEQ_OQ);  /* not (-inf) - (-inf) */
        _mm512_mask_storeu_ps(rescale + r, m, _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(
            _mm512_maskz_loadu_ps(m, best + r), high))));
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t seen = offset + r / per_kv - k0 + 1, hidden = window ? seen - window : 0;
        __mmask16 m0, m1;
        row_lanes(seen, hidden, &m0, &m1);
        const __m512 shift = _mm512_set1_ps(top[r]);
        const __m512 p0 = _mm512_maskz_mov_ps(m0, exp16(_mm512_sub_ps(
            _mm512_loadu_ps(scores + r * FLASH_KEYS), shift)));
        const __m512 p1 = _mm512_maskz_mov_ps(m1, exp16(_mm512_sub_ps(
            _mm512_loadu_ps(scores + r * FLASH_KEYS + 16), shift)));
        total[r] = total[r] * rescale[r] + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
        best[r] = top[r];
        if (fma) {  /* the probabilities replace the row's scores, float32 */
            _mm512_storeu_ps(scores + r * FLASH_KEYS, p0);
            _mm512_storeu_ps(scores + r * FLASH_KEYS + 16, p1);
        } else {
            _mm256_storeu_si256((__m256i *)(buf->probs + r * FLASH_KEYS), bf16x16_from(p0));
            _mm256_storeu_si256((__m256i *)(buf->probs + r * FLASH_KEYS + 16), bf16x16_from(p1));
        }
    }
}

/* One work item on the dot products (or the FMAs): its rows' online softmax over every tile of keys from the first
 * row's first (0, or its window's) up to the last row's position (keys beyond it are never seen), then each row's
 * result divided by its sum (plus its head's sink, if any) into out. */
static void flash_item_dots(const flash_call *call, const flash_rows *buf, int64_t item) {
    const int64_t per_kv = call->num_heads / call->num_kv_heads, head_dim = call->head_dim;
    const flash_item it = flash_item_at(call, item, call->num_kv_heads);
    const int64_t rows = it.tokens * per_kv;
    const int64_t at = call->packed_at[it.chunk] + it.head * it.keys * head_dim - it.base * head_dim;
    load_queries(call, buf, &it, rows);
    const int64_t last = it.offset + it.tokens - 1;  /* the last row's position */
    for (int64_t k0 = it.from; k0 <= last; k0 += FLASH_KEYS) {
        flash_score_rows((int)call->fma, buf->qb, buf->qf, head_dim, call->packed_keys + at + k0 * head_dim,
                         buf->scores, rows);
        softmax_tile(buf, rows, per_kv, it.offset, k0, call->scale, (int)call->fma, call->window);
        flash_weigh_rows((int)call->fma, buf->probs, buf->scores, call->packed_values + at + k0 * head_dim, head_dim,
                         buf->rescale, buf->acc, rows);
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t token = call->starts[it.chunk] + it.first + r / per_kv, head = it.head * per_kv + r % per_kv;
        const float inverse = call->sinks ? sink_inverse(buf->total[r], buf->best[r], call->sinks[head])
                                          : 1.0f / buf->total[r];
        float *result = call->out + (token * call->num_heads + head) * head_dim;
        for (int64_t d = 0; d < head_dim; d++) result[d] = buf->acc[r * head_dim + d] * inverse;
    }
}

/* Every work item on the dot products (or the FMAs): a worksharing loop, called by every thread of the call's
 * parallel region. */
static void flash_items_dots(const flash_call *call) {
    flash_rows buf;
    alloc_rows(&buf, FLASH_TOKENS * (call->num_heads / call->num_kv_heads), call->head_dim, (int)call->fma);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < call->items_at[call->count]; item++) flash_item_dots(call, &buf, item);
    free_rows(&buf);
}

/* ---- the call --------------------------------------------------------------------------------------------------- */

/* Key j of one sequence's context (head kvh) into the packed K and V of its tile: keys in two halves of 16 as
 * flash_scores reads them, values in key pairs as flash_weigh reads them. `key`/`value` NULL: zeros (padding). */
static void flash_pack_key(const void *key, const void *value, int kv_bf16, int64_t j, int64_t head_dim,
                           uint16_t *packed_keys, uint16_t *packed_values) {
    uint16_t *kt = packed_keys + (j / FLASH_KEYS) * FLASH_KEYS * head_dim + ((j % FLASH_KEYS) / 16) * 16 * head_dim;
    uint16_t *vt = packed_values + (j / 2) * 2 * head_dim;
    const int lane = (int)(j % 16), odd = (int)(j % 2);
    for (int64_t d = 0; d < head_dim; d++) {
        uint16_t k = 0, v = 0;
        if (key) {
            k = kv_bf16 ? ((const uint16_t *)key)[d] : float_to_bf16(((const float *)key)[d]);
            v = kv_bf16 ? ((const uint16_t *)value)[d] : float_to_bf16(((const float *)value)[d]);
        }
        kt[(d / 2) * 32 + lane * 2 + (d % 2)] = k;
        vt[d * 2 + odd] = v;
    }
}

/* Chunk i's K/V of KV head kvh packed for the dot products (`keys` rows from key `base`, the padding zero). */
static void flash_pack(const flash_call *call, int64_t i, int64_t kvh, int64_t base, int64_t keys,
                       uint16_t *packed_keys, uint16_t *packed_values) {
    const size_t values = flash_values(call);
    for (int64_t j = 0; j < keys; j++) {
        const char *key = flash_key_row(call, i, kvh, base + j);
        flash_pack_key(key, key ? key + values : NULL, (int)call->kv_bf16, j, call->head_dim, packed_keys,
                       packed_values);
    }
}

/* Every chunk's K/V of every KV head packed, for the AMX kernel or the dot products: a worksharing loop, called by
 * every thread of the call's parallel region; its barrier has every tile packed before any is read. */
static void pack_chunks(const flash_call *call) {
#pragma omp for schedule(dynamic, 1) collapse(2)
    for (int64_t i = 0; i < call->count; i++) {
        for (int64_t kvh = 0; kvh < call->num_kv_heads; kvh++) {
            const int64_t base = flash_first_key(call, i), keys = flash_packed_keys(call, i, base);
            const int64_t at = call->packed_at[i] + kvh * keys * call->head_dim;
#if FLASH_AMX
            if (call->amx) {
                flash_pack_amx(call, i, kvh, base, keys, call->packed_keys + at, call->packed_values + at);
                continue;
            }
#endif
            flash_pack(call, i, kvh, base, keys, call->packed_keys + at, call->packed_values + at);
        }
    }
}

/* Where each chunk's packed K/V and work items start (call->packed_at, call->items_at: count + 1 each), and the
 * packed K/V's buffers. */
static void plan_chunks(flash_call *call) {
    const int64_t item_heads = call->amx ? call->num_heads : call->num_kv_heads;
    call->packed_at = malloc(sizeof(int64_t) * (call->count + 1));
    call->items_at = malloc(sizeof(int64_t) * (call->count + 1));
    call->packed_at[0] = call->items_at[0] = 0;
    for (int64_t i = 0; i < call->count; i++) {
        const int64_t keys = flash_packed_keys(call, i, flash_first_key(call, i));
        call->packed_at[i + 1] = call->packed_at[i] + keys * call->num_kv_heads * call->head_dim;
        call->items_at[i + 1] = call->items_at[i] + (call->query_lens[i] + FLASH_TOKENS - 1) / FLASH_TOKENS *
                                                    item_heads;
    }
    call->packed_keys = malloc(sizeof(uint16_t) * call->packed_at[call->count]);
    call->packed_values = malloc(sizeof(uint16_t) * call->packed_at[call->count]);
}
#endif

void infer_flash_attention(const float *q, int64_t q_stride, const void *kv, const int32_t *block_tables,
                           int64_t table_stride, const int64_t *starts, const int64_t *query_lens,
                           const int64_t *contexts, const int64_t *tables, int64_t count, float *out,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                           int64_t num_blocks, float scale, int64_t kv_bf16, int64_t fma, int64_t window,
                           const float *sinks) {
#if INFER_AVX512_BF16
    flash_call call = {q, q_stride, kv, block_tables, table_stride, starts, query_lens, contexts, tables, count, out,
                       num_heads, num_kv_heads, head_dim, block_size, num_blocks, scale, kv_bf16, fma, window,
                       sinks, !fma && flash_amx_head_dim(head_dim) && amx_available(), NULL, NULL, NULL, NULL};
    plan_chunks(&call);
#pragma omp parallel
    {
        pack_chunks(&call);
#if FLASH_AMX
        if (call.amx)
            flash_items_amx(&call);
        else
#endif
            flash_items_dots(&call);
    }
    free(call.packed_values);
    free(call.packed_keys);
    free(call.items_at);
    free(call.packed_at);
#else
    (void)q; (void)q_stride; (void)kv; (void)block_tables; (void)table_stride; (void)starts; (void)query_lens;
    (void)contexts; (void)tables; (void)count; (void)out; (void)num_heads; (void)num_kv_heads; (void)head_dim;
    (void)block_size; (void)num_blocks; (void)scale; (void)kv_bf16; (void)fma; (void)window; (void)sinks;
    abort();  /* the Python side asks infer_flash_kind first */
#endif
}
