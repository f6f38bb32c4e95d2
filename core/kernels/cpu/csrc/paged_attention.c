/* Paged attention's compute (paged_attention.h): each thread's run of work items, then the merge of each query
 * head's chunks. An item's key rows come straight from the pool through the block table: AVX-512 reads a bf16
 * pool's rows in place (head sizes DIRECT_HEAD_DIMS) and widens them in registers (paged_attention_avx512.c);
 * elsewhere a bf16 pool's rows are widened into a per-thread float buffer, and float32 pools are read in place.
 * With `dots` (a bf16 pool read in place in an AVX512-BF16 build; ignored elsewhere) the queries and the
 * probabilities are rounded to bf16 and multiplied on VDPBF16PS (score_dots_block, weigh_dots), scores, maxima and
 * sums float32: the flash attention's precision, at half the instructions of widening the K/V for float32 FMAs.
 * Against one item per query and KV head over its whole context with keys copied to floats per query, on 2 cores of
 * an AMX Xeon, bf16 pool: batch 1 at 300 keys 35.5 -> 14.7 us a call, two queries of it 65.3 -> 19.9, batch 64 at
 * ~650 keys 2,568 -> 1,335 us (docs/performance.md). */
#include "paged_attention.h"

/* A buffer of at least `bytes` for this thread, kept from call to call in one of SCRATCH_SLOTS slots (its contents
 * are not). The attention runs per layer, many times a step; a fresh malloc of tens of KB can come back as
 * untouched pages, a fault each. */
#define SCRATCH_SLOTS 10
static void *scratch(int slot, size_t bytes) {
    static __thread void *buffers[SCRATCH_SLOTS];
    static __thread size_t sizes[SCRATCH_SLOTS];
    if (sizes[slot] < bytes) {
        free(buffers[slot]);
        sizes[slot] = (bytes + 63) / 64 * 64;
        buffers[slot] = aligned_alloc(64, sizes[slot]);
    }
    return buffers[slot];
}

/* ---- float32 rows: scores and value weighing -------------------------------------------------------------------- */

/* scores[j] = scale * query . keys[j] for j < n; returns their maximum. Eight keys at a time share one
 * horizontal reduction. */
static float score_keys(const float *query, const float *const *keys, int64_t n, int64_t head_dim, float scale,
                        float *scores) {
    float best = -INFINITY;
    int64_t j = 0;
#if INFER_AVX512 && INFER_AVX2
    if (head_dim % 16 == 0) {  /* 16 floats of a key per load; the 8 sums reduced to 8 floats, then as AVX2 does */
        __m256 top = _mm256_set1_ps(-INFINITY), factor = _mm256_set1_ps(scale);
        for (; j + 8 <= n; j += 8) {
            const float *const *k = keys + j;
            __m512 a[8];
            for (int i = 0; i < 8; i++) a[i] = _mm512_setzero_ps();
            for (int64_t c = 0; c < head_dim; c += 16) {
                const __m512 x = _mm512_loadu_ps(query + c);
                for (int i = 0; i < 8; i++) a[i] = _mm512_fmadd_ps(x, _mm512_loadu_ps(k[i] + c), a[i]);
            }
            __m256 h[8];
            for (int i = 0; i < 8; i++) h[i] = _mm256_add_ps(_mm512_castps512_ps256(a[i]), high_half(a[i]));
            __m256 block = _mm256_mul_ps(sum8x8(h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]), factor);
            _mm256_storeu_ps(scores + j, block);
            top = _mm256_max_ps(top, block);
        }
        best = hmax8(top);
    }
#endif
#if INFER_AVX2
    if (head_dim % 8 == 0 && j + 8 <= n) {
        __m256 top = _mm256_set1_ps(-INFINITY), factor = _mm256_set1_ps(scale);
        for (; j + 8 <= n; j += 8) {
            const float *const *k = keys + j;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
            for (int64_t c = 0; c < head_dim; c += 8) {
                __m256 x = _mm256_loadu_ps(query + c);
                a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[0] + c), a0);
                a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[1] + c), a1);
                a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[2] + c), a2);
                a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[3] + c), a3);
                a4 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[4] + c), a4);
                a5 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[5] + c), a5);
                a6 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[6] + c), a6);
                a7 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[7] + c), a7);
            }
            __m256 block = _mm256_mul_ps(sum8x8(a0, a1, a2, a3, a4, a5, a6, a7), factor);
            _mm256_storeu_ps(scores + j, block);
            top = _mm256_max_ps(top, block);
        }
        best = fmaxf(best, hmax8(top));
    }
#endif
    for (; j < n; j++) {
        scores[j] = dot(query, keys[j], head_dim) * scale;
        if (scores[j] > best) best = scores[j];
    }
    return best;
}

/* result = (sum_j weights[j] * values[j]) * factor, values[j] = keys[j] + value_offset. */
static void weigh_values(const float *weights, const float *const *keys, ptrdiff_t value_offset, int64_t n,
                         int64_t head_dim, float factor, float *result) {
    int64_t c = 0;
#if INFER_AVX512
    for (; c + 64 <= head_dim; c += 64) {  /* 64 floats of the result in 4 registers over all the keys */
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t j = 0; j < n; j++) {
            const float *v = keys[j] + value_offset + c;
            const __m512 w = _mm512_set1_ps(weights[j]);
            a0 = _mm512_fmadd_ps(w, _mm512_loadu_ps(v), a0);
            a1 = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 16), a1);
            a2 = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 32), a2);
            a3 = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 48), a3);
        }
        const __m512 f = _mm512_set1_ps(factor);
        _mm512_storeu_ps(result + c, _mm512_mul_ps(a0, f));
        _mm512_storeu_ps(result + c + 16, _mm512_mul_ps(a1, f));
        _mm512_storeu_ps(result + c + 32, _mm512_mul_ps(a2, f));
        _mm512_storeu_ps(result + c + 48, _mm512_mul_ps(a3, f));
    }
#endif
#if INFER_AVX2
    const __m256 f = _mm256_set1_ps(factor);
    for (; c + 64 <= head_dim; c += 64) {  /* 64 floats of the result stay in registers over all the keys */
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        for (int64_t j = 0; j < n; j++) {
            const float *v = keys[j] + value_offset + c;
            __m256 w = _mm256_broadcast_ss(weights + j);
            a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v), a0);
            a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8), a1);
            a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 16), a2);
            a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 24), a3);
            a4 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 32), a4);
            a5 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 40), a5);
            a6 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 48), a6);
            a7 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 56), a7);
        }
        float *r = result + c;
        _mm256_storeu_ps(r, _mm256_mul_ps(a0, f));
        _mm256_storeu_ps(r + 8, _mm256_mul_ps(a1, f));
        _mm256_storeu_ps(r + 16, _mm256_mul_ps(a2, f));
        _mm256_storeu_ps(r + 24, _mm256_mul_ps(a3, f));
        _mm256_storeu_ps(r + 32, _mm256_mul_ps(a4, f));
        _mm256_storeu_ps(r + 40, _mm256_mul_ps(a5, f));
        _mm256_storeu_ps(r + 48, _mm256_mul_ps(a6, f));
        _mm256_storeu_ps(r + 56, _mm256_mul_ps(a7, f));
    }
#endif
    if (c < head_dim) {
        for (int64_t i = c; i < head_dim; i++) result[i] = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            const float *v = keys[j] + value_offset;
            for (int64_t i = c; i < head_dim; i++) result[i] += weights[j] * v[i];
        }
        for (int64_t i = c; i < head_dim; i++) result[i] *= factor;
    }
}

/* results[h] = sum_j weights[h][j] * values[j] (values[j] at rows[j] + value_offset elements) for `heads` heads over
 * the same n value rows: weigh_values with factor 1 for each, several heads a pass where AVX-512 has the registers
 * (weigh_pass). The rows are floats, or, with `bf16` (AVX-512 and DIRECT_HEAD_DIMS only), a bf16 pool's rows
 * widened in registers once for all the heads of a pass. */
static void weigh_heads(float *const *weights, int64_t heads, const void *const *rows, int bf16,
                        ptrdiff_t value_offset, int64_t n, int64_t head_dim, float *const *results,
                        kv_stream *stream) {
    int64_t h = 0;
    (void)bf16;  /* never set without AVX-512 */
    (void)stream;
#if INFER_AVX512
    if (head_dim % 64 == 0) {
        for (; h < heads; h += WEIGH_HEADS) {
            const int count = heads - h < WEIGH_HEADS ? (int)(heads - h) : WEIGH_HEADS;
            for (int64_t c = 0; c < head_dim; c += 64) {
                float *at[WEIGH_HEADS];
                for (int i = 0; i < count; i++) at[i] = results[h + i] + c;
                weigh_pass(weights + h, rows, value_offset + c, n, at, count, bf16, stream);
            }
        }
    }
#endif
    for (; h < heads; h++)
        weigh_values(weights[h], (const float *const *)rows, value_offset, n, head_dim, 1.0f, results[h]);
}

/* ---- a thread's work items -------------------------------------------------------------------------------------- */

/* Every cache line of the K and V rows of tokens start..end-1 (KV heads first_kv_head onwards, kv_heads of them) of
 * the sequence whose block table is `table`, requested into L2 before a work item reads them. A busy engine's
 * sequences hold blocks scattered over the pool (they grow a block at a time, side by side), and the hardware
 * prefetchers, which stop at 4 KB pages, never ramp up over a block's few KB: requested at once, the lines arrive
 * together. On 2 cores of a Zen 4 EPYC, 30 layers of a 3,200-block bf16 pool, blocks scattered at random (builds
 * alternating in one process, two runs): batch 64 at 60 keys 0.67-0.70x the time, batch 48 at 110 keys 0.71-0.73x,
 * batch 16 at 230 keys 0.71-0.72x, batch 4 at 300 keys 0.69-0.70x, batch 1 0.93x; blocks in order 0.87-0.98x. On
 * the block tables of the chat mix's steps (benchmarks' `infer bench --workload chat`): batch 48 at 107 keys 9.0 ->
 * 7.5 ms a step, batch 16 at 230 keys 7.9 -> 6.3. Inlined always: as a function of its own, gcc finds it free of
 * side effects and drops the call. */
static inline __attribute__((always_inline)) void prefetch_chunk(const void *kv, const int32_t *table, int64_t start,
                                                                int64_t end, int64_t first_kv_head, int64_t kv_heads,
                                                                int64_t head_dim, int64_t block_size,
                                                                int64_t slot_width, int64_t pool_slots,
                                                                size_t element) {
    const size_t run = kv_heads * head_dim * element, values = pool_slots * slot_width * element;
    for (int64_t j = start; j < end; j++) {
        const int64_t slot = (int64_t)table[j / block_size] * block_size + j % block_size;
        const char *key = (const char *)kv + (slot * slot_width + first_kv_head * head_dim) * element;
        for (size_t line = 0; line < run; line += 64) {
            __builtin_prefetch(key + line, 0, 2);  /* prefetcht1 on x86 */
            __builtin_prefetch(key + values + line, 0, 2);
        }
    }
}

/* KV heads first_kv_head + from .. first_kv_head + to - 1 of an item's K/V lines, requested (prefetch_chunk). */
static inline __attribute__((always_inline)) void prefetch_item(const decode_call *call, const decode_item *it,
                                                               int64_t from, int64_t to) {
    const int64_t slot_width = call->num_kv_heads * call->head_dim;
    prefetch_chunk(call->kv, call->block_tables + call->seq_of_query[it->first_query] * call->table_stride,
                   it->start, it->end, it->first_kv_head + from, to - from, call->head_dim, call->block_size,
                   slot_width, call->num_blocks * call->block_size, call->kv_bf16 ? 2 : 4);
}

/* A thread's buffers for its items: the chunk's key rows of one KV head (as floats, or as the pool's bf16 rows on
 * the direct path), and per query head of a group (DECODE_GROUP * per_kv at most) its query, scores (then
 * probabilities), keys seen (from its first), the item's keys before its first (a window's), maximum and partial
 * result. */
typedef struct {
    const float *keys[DECODE_CHUNK];
    const uint16_t *raw[DECODE_CHUNK];  /* the direct path's rows (AVX-512 builds) */
    float *scores;
    float **weights;  /* per head: its row of scores */
    float **results;  /* per head: its partial result */
    const float **queries;
    int64_t *seen;  /* per head: the keys of the chunk it sees */
    int64_t *skip;  /* per head: the item's keys before those it sees (before its window) */
    float *best;
    float *converted;  /* a bf16 pool's keys, then values, widened (not on the direct path) */
    uint32_t *pairs;  /* dots' probabilities (AVX512-BF16 builds) */
    kv_stream stream;  /* the next item's lines, on the direct path */
} decode_workspace;

static inline void workspace_buffers(decode_workspace *ws, const decode_call *call) {
    const int64_t group_heads = DECODE_GROUP * (call->num_heads / call->num_kv_heads);
    ws->scores = scratch(1, sizeof(float) * group_heads * DECODE_CHUNK);
    ws->weights = scratch(3, sizeof(float *) * group_heads);
    ws->results = scratch(4, sizeof(float *) * group_heads);
    ws->queries = scratch(5, sizeof(float *) * group_heads);
    ws->seen = scratch(6, sizeof(int64_t) * group_heads);
    ws->skip = scratch(9, sizeof(int64_t) * group_heads);
    ws->best = scratch(7, sizeof(float) * group_heads);
    ws->converted = scratch(2, sizeof(float) * 2 * DECODE_CHUNK * call->head_dim);
#if INFER_AVX512_BF16
    ws->pairs = scratch(8, sizeof(uint32_t) * WEIGH_HEADS * DECODE_CHUNK / 2);
#else
    ws->pairs = NULL;
#endif
}

/* Key row j of the chunk (KV head at element `at` of the pool's K half): the pool's bf16 row itself on the direct
 * path, else a float row (a bf16 pool's K and V widened into this thread's buffer). */
static inline __attribute__((always_inline)) void place_row(decode_workspace *ws, const decode_call *call,
                                                            int64_t j, int64_t at, int direct) {
    const int64_t head_dim = call->head_dim, values = call->num_blocks * call->block_size * call->num_kv_heads *
                                                      head_dim;
    if (direct) {
        ws->raw[j] = (const uint16_t *)call->kv + at;
    } else if (call->kv_bf16) {
        float *key = ws->converted + j * head_dim;
        bf16_to_floats((const uint16_t *)call->kv + at, key, head_dim);
        bf16_to_floats((const uint16_t *)call->kv + values + at, key + DECODE_CHUNK * head_dim, head_dim);
        ws->keys[j] = key;
    } else {
        ws->keys[j] = (const float *)call->kv + at;
    }
}

/* The item's key rows of KV head kvh, in order, and with a leaf's own K/V (token it->own) in place of its
 * position's. Returns where the value rows sit, in elements past the key rows. */
static inline __attribute__((always_inline)) ptrdiff_t list_rows(decode_workspace *ws, const decode_call *call,
                                                                 const decode_item *it, const int32_t *table,
                                                                 int64_t kvh, int direct) {
    const int64_t block_size = call->block_size, slot_width = call->num_kv_heads * call->head_dim;
    const int64_t start = it->start, end = it->end;
    for (int64_t j = start; j < end;) {
        const int64_t first = (int64_t)table[j / block_size] * block_size * slot_width + kvh * call->head_dim;
        for (int64_t t = j % block_size; t < block_size && j < end; t++, j++)
            place_row(ws, call, j - start, first + t * slot_width, direct);
    }
    if (it->own >= 0) {
        const int64_t slot = (int64_t)table[it->own / block_size] * block_size + it->own % block_size;
        place_row(ws, call, end - 1 - start, slot * slot_width + kvh * call->head_dim, direct);
    }
    if (call->kv_bf16 && !direct) return DECODE_CHUNK * call->head_dim;
    return call->num_blocks * block_size * slot_width;
}

/* Every query head of the item's group that sees its chunk, for KV head kvh (a query's heads side by side): its
 * query, keys seen and skipped, scores row and partial result. A leaf's own chunk is its own item, not its group's.
 * Returns the heads. */
static inline __attribute__((always_inline)) int64_t list_heads(decode_workspace *ws, const decode_call *call,
                                                                const decode_plan *plan, const decode_item *it,
                                                                int64_t kvh, float *partial) {
    const int64_t per_kv = call->num_heads / call->num_kv_heads, head_dim = call->head_dim, c = it->c;
    const int64_t *context_lens = call->context_lens, *own_keys = call->own_keys;
    int64_t heads = 0;
    for (int64_t i = it->first_query; i < it->end_query; i++) {
        const int64_t first = first_key(call, i), from = first > it->start ? first : it->start;
        const int64_t n = (context_lens[i] < it->end ? context_lens[i] : it->end) - from;
        const int leaf_later = it->own < 0 && own_keys && own_keys[i] >= 0 &&
                               c >= (context_lens[i] - 1) / DECODE_CHUNK;
        if (n <= 0 || leaf_later) continue;
        const int64_t row = call->rows ? call->rows[i] : call->row_base + i;
        const int64_t count = query_chunks(call, i), at = c - first / DECODE_CHUNK;
        for (int64_t h = kvh * per_kv; h < (kvh + 1) * per_kv; h++, heads++) {
            ws->queries[heads] = call->q + row * call->q_stride + h * head_dim;
            ws->seen[heads] = n;
            ws->skip[heads] = from - it->start;
            ws->weights[heads] = ws->scores + heads * DECODE_CHUNK;
            ws->results[heads] = partial + (plan->partial_at[i] + h * count + at) * (head_dim + 2);
        }
    }
    return heads;
}

/* The heads' scores of the keys each sees and their maxima, then their probabilities against the chunk's own
 * maximum and their sums into the partial results (zero before and past a head's own keys, so that all weigh the
 * chunk's `keys` value rows together). A query's heads see the same keys. */
static inline __attribute__((always_inline)) void score_chunk(decode_workspace *ws, const decode_call *call,
                                                              int64_t heads, int64_t keys, int direct, int dots) {
    const int64_t per_kv = call->num_heads / call->num_kv_heads, head_dim = call->head_dim;
    (void)direct;  /* both read in AVX-512 builds only */
    (void)dots;
    for (int64_t a = 0; a < heads; a += per_kv) {
        const int64_t skip = ws->skip[a];
#if INFER_AVX512
        if (direct) {
            float *scores[per_kv];
            for (int64_t b = 0; b < per_kv; b++) scores[b] = ws->weights[a + b] + skip;
            score_heads(ws->queries + a, per_kv, ws->raw + skip, ws->seen[a], call->scale, scores, ws->best + a,
                        dots, head_dim, &ws->stream);
            continue;
        }
#endif
        for (int64_t b = a; b < a + per_kv; b++)
            ws->best[b] = score_keys(ws->queries[b], ws->keys + skip, ws->seen[b], head_dim, call->scale,
                                     ws->weights[b] + skip);
    }
    for (int64_t a = 0; a < heads; a++) {
        float *own = ws->results[a], *weights = ws->weights[a];
        const int64_t skip = ws->skip[a], end = skip + ws->seen[a];
        own[head_dim] = ws->best[a];
        own[head_dim + 1] = exp_shifted_sum(weights + skip, ws->seen[a], ws->best[a]);
        for (int64_t j = 0; j < skip; j++) weights[j] = 0.0f;
        for (int64_t j = end; j < keys; j++) weights[j] = 0.0f;
    }
}

/* One item of KV head kvh: its key rows listed, every query head that sees them scored, its softmax taken and the
 * value rows weighed into its partial result. */
static inline __attribute__((always_inline)) void attend_chunk(decode_workspace *ws, const decode_call *call,
                                                               const decode_plan *plan, const decode_item *it,
                                                               int64_t kvh, float *partial, int direct, int dots) {
    const int32_t *table = call->block_tables + call->seq_of_query[it->first_query] * call->table_stride;
    const ptrdiff_t value_offset = list_rows(ws, call, it, table, kvh, direct);
    const int64_t heads = list_heads(ws, call, plan, it, kvh, partial), keys = it->end - it->start;
    score_chunk(ws, call, heads, keys, direct, dots);
#if INFER_AVX512_BF16
    if (dots) {
        weigh_dots(ws->weights, heads, (const void *const *)ws->raw, value_offset, keys, call->head_dim, ws->pairs,
                   ws->results, &ws->stream);
        return;
    }
#endif
    weigh_heads(ws->weights, heads, direct ? (const void *const *)ws->raw : (const void *const *)ws->keys, direct,
                value_offset, keys, call->head_dim, ws->results, &ws->stream);
}

/* Points the stream at tokens it->start + from .. it->start + to - 1 of an item, every KV head of it (a bf16 pool):
 * each token's heads lie side by side in its slot, so the lines come in the pool's order. */
static inline void stream_item(kv_stream *stream, const decode_call *call, const decode_item *it, int64_t from,
                               int64_t to) {
    const int64_t slot_width = call->num_kv_heads * call->head_dim, block_size = call->block_size;
    const int32_t *table = call->block_tables + call->seq_of_query[it->first_query] * call->table_stride;
    const char *pool = (const char *)call->kv + it->first_kv_head * call->head_dim * 2;
    for (int64_t j = it->start + from; j < it->start + to; j++) {
        const int64_t slot = (int64_t)table[j / block_size] * block_size + j % block_size;
        stream->rows[j - it->start - from] = pool + slot * slot_width * 2;
    }
    stream->tokens = to - from;
    stream->token = stream->offset = 0;
    stream->run_bytes = it->kv_heads * call->head_dim * 2;
    stream->values = (ptrdiff_t)call->num_blocks * block_size * slot_width * 2;
}

/* This thread's items: its contiguous run (of about equal cost) in order, then what is left of the others' runs from
 * their ends (item_share). It takes its next item before it runs the current one and asks for that item's K/V lines
 * while the current one computes, a share with each of the current one's KV heads (the blocks of a busy engine's
 * pool are scattered): on the direct path a share of its tokens, every KV head of each (its slots whole, in the
 * pool's order), streamed from inside the current head's loops (kv_stream), the rest requested when they end;
 * elsewhere a share of its KV heads, all at once before it. Slots whole in order against one KV head's rows of
 * every token (2 KB apart), Qwen3-0.6B's layout at 64 sequences, 28 layers, 2 cores of an AMX Xeon
 * (`benchmarks/decode_kernels.py`): 1.17-1.25x less time at 60-600 keys with the blocks scattered, 1.24-1.31x with
 * them in order. */
static inline void run_items(const decode_call *call, const decode_plan *plan, float *partial, int direct,
                             int dots, item_share *shares, int threads) {
    decode_workspace ws;
    workspace_buffers(&ws, call);
    ws.stream.tokens = ws.stream.token = 0;
    const int me = team_member();
    int owner;
    int64_t item = share_next(shares, threads, me, &owner);
    if (item >= 0) prefetch_item(call, &plan->items[item], 0, plan->items[item].kv_heads);
    while (item >= 0) {
        const int64_t after = share_next(shares, threads, me, &owner);
        const decode_item *it = &plan->items[item], *next = after >= 0 ? &plan->items[after] : NULL;
        for (int64_t kvh = it->first_kv_head; kvh < it->first_kv_head + it->kv_heads; kvh++) {
            if (next) {  /* the next item's share before each of this one's KV heads */
                const int64_t share = kvh - it->first_kv_head;
                const int64_t from = share * next->kv_heads / it->kv_heads;
                const int64_t to = (share + 1) * next->kv_heads / it->kv_heads;
                const int64_t tokens = next->end - next->start;
                const int64_t first = share * tokens / it->kv_heads, last = (share + 1) * tokens / it->kv_heads;
                if (direct && last > first) stream_item(&ws.stream, call, next, first, last);
                else if (!direct && to > from) prefetch_item(call, next, from, to);
            }
            attend_chunk(&ws, call, plan, it, kvh, partial, direct, dots);
            stream_lines(&ws.stream, INT64_MAX);  /* what the loops left */
        }
        item = after;
    }
}

/* ---- the merge -------------------------------------------------------------------------------------------------- */

/* Query i's result: each head's chunks merged in order, each scaled to their common maximum, the head's sink (if
 * any) in the denominator. */
static inline void merge_query(const decode_call *call, const decode_plan *plan, const float *partial, int64_t i) {
    const int64_t head_dim = call->head_dim, num_heads = call->num_heads, entry = head_dim + 2;
    const int64_t row = call->rows ? call->rows[i] : call->row_base + i;
    const int64_t count = query_chunks(call, i);
    for (int64_t h = 0; h < num_heads; h++) {
        const float *own = partial + (plan->partial_at[i] + h * count) * entry;
        float *restrict result = call->out + (row * num_heads + h) * head_dim;
        if (count == 1) {  /* what the general case computes for one chunk: exp(0) = 1, 0 + x = x */
            const float factor = call->sinks ? sink_inverse(own[head_dim + 1], own[head_dim], call->sinks[h])
                                             : 1.0f / own[head_dim + 1];
            for (int64_t d = 0; d < head_dim; d++) result[d] = own[d] * factor;
            continue;
        }
        float top = -INFINITY, total = 0.0f, scales[count];
        for (int64_t c = 0; c < count; c++) top = fmaxf(top, own[c * entry + head_dim]);
        for (int64_t c = 0; c < count; c++) {
            scales[c] = expf(own[c * entry + head_dim] - top);
            total += own[c * entry + head_dim + 1] * scales[c];
        }
        const float inverse = call->sinks ? sink_inverse(total, top, call->sinks[h]) : 1.0f / total;
        for (int64_t d = 0; d < head_dim; d++) result[d] = 0.0f;
        for (int64_t c = 0; c < count; c++) {
            const float factor = scales[c] * inverse;
            const float *restrict sums = own + c * entry;
            for (int64_t d = 0; d < head_dim; d++) result[d] += sums[d] * factor;
        }
    }
}

void run_decode_plan(const decode_call *call, const decode_plan *plan) {
    float *partial = scratch(0, sizeof(float) * (plan->partials > 0 ? plan->partials : 1) * (call->head_dim + 2));
    /* a bf16 pool's rows read in place (AVX-512), and on the dot products (AVX512-BF16) when asked */
    const int direct = INFER_AVX512 && call->kv_bf16 && direct_head_dim(call->head_dim);
    const int dots = INFER_AVX512_BF16 && call->dots && direct;
    const int threads = plan->parallel ? team_size_max() : 1;
    item_share shares[threads];  /* each thread's run of items of about equal cost */
    for (int s = 0; s < threads; s++)
        share_set(shares, s, run_start(plan->cost_before, plan->total_items, s, threads),
                  run_start(plan->cost_before, plan->total_items, s + 1, threads));
#pragma omp parallel if (plan->parallel)
    {
        run_items(call, plan, partial, direct, dots, shares, threads);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t i = 0; i < call->queries; i++) merge_query(call, plan, partial, i);
    }
}
