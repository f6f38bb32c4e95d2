/* Paged attention's parts (infer_paged_attention): the plan of one run of queries, its work items and how the
 * threads share them (paged_attention_plan.c), the run itself (paged_attention.c), and the AVX-512 kernels that
 * read a bf16 pool's rows in place (paged_attention_avx512.c; head sizes DIRECT_HEAD_DIMS).
 *
 * Split decoding: the work items are (group, chunk of DECODE_CHUNK keys, its KV heads or one of them), where a group
 * is up to DECODE_GROUP consecutive queries of one sequence. An item lists its key rows once for the whole group,
 * then every query head of the group that sees the chunk scores them, takes their softmax against the chunk's own
 * maximum and weighs the value rows into a partial result; the chunks' partial results are then merged per query
 * head in chunk order.
 *
 * Sliding windows (`window` > 0): query i sees only its context's last `window` tokens, so its chunks start at the
 * one that holds its first key (first_key), and an item's rows start at its queries' earliest first key: blocks
 * wholly before every window are never read. A query scores its own keys only (those before its first key weigh
 * zero), so its result is the same alone or beside others.
 *
 * Attention sinks (`sinks`, one logit per query head): the merge adds exp(sink - m) to each head's denominator, m
 * the larger of its chunks' maximum and the sink; the work items do not change. */
#ifndef INFER_PAGED_ATTENTION_H
#define INFER_PAGED_ATTENTION_H

#include "common.h"

/* Keys per work item. A constant, so that a query's result never depends on the other queries of its step (a
 * verified draft row equals the decode row it replaces, bit for bit). */
#define DECODE_CHUNK 64
/* Consecutive queries of one sequence (a verification's rows, a chunk's) that share a work item's key rows. */
#define DECODE_GROUP 16
/* Query heads of one pass of the AVX-512 kernels' value weighing (paged_attention_avx512.c). */
#define WEIGH_HEADS 6
/* The head sizes whose bf16 rows the AVX-512 kernels read in place, X(size) each (a copy of the scores' kernels per
 * size, which holds the queries in registers), and the largest. */
#define DIRECT_HEAD_DIMS(X) X(64) X(128) X(256)
#define DIRECT_HEAD_DIM_MAX 256

static inline int direct_head_dim(int64_t head_dim) {
    return head_dim == 64 || head_dim == 128 || head_dim == 256;
}

/* One run of infer_paged_attention's queries: its arguments (cpu_kernels.h), query i being token row rows[i], or
 * row_base + i when rows is NULL. */
typedef struct {
    const float *q;
    int64_t q_stride;
    const void *kv;
    const int32_t *block_tables;
    int64_t table_stride;
    const int64_t *rows;
    int64_t row_base;
    const int64_t *seq_of_query, *context_lens, *own_keys;
    float *out;
    int64_t queries, num_heads, num_kv_heads, head_dim, block_size, num_blocks;
    float scale;
    int64_t kv_bf16, dots;
    int64_t window;  /* 0: every earlier token */
    const float *sinks;  /* NULL, or a sink logit per query head (-INFINITY: none) */
} decode_call;

static inline int64_t chunks_of(int64_t context) { return (context + DECODE_CHUNK - 1) / DECODE_CHUNK; }

/* The first of its context's tokens query i sees: the window's first, or 0. */
static inline int64_t first_key(const decode_call *call, int64_t i) {
    const int64_t first = call->window ? call->context_lens[i] - call->window : 0;
    return first > 0 ? first : 0;
}

/* Query i's chunks: first_key's (its first) to its context's last. */
static inline int64_t query_chunks(const decode_call *call, int64_t i) {
    return chunks_of(call->context_lens[i]) - first_key(call, i) / DECODE_CHUNK;
}

/* A work item: keys start..end-1 (of chunk c of its sequence) of KV heads first_kv_head onwards (kv_heads of them) for
 * queries first_query..end_query-1 (a group), or for one leaf whose own K/V sit at token own (-1: none). */
typedef struct {
    int64_t c, first_query, end_query, first_kv_head, kv_heads, own, start, end;
} decode_item;

/* A run's work items and where its partial results go. Partial result (query i, head h, chunk c) is entry
 * partial_at[i] + h * query_chunks(i) + c - first_key(i) / DECODE_CHUNK; an entry is head_dim sums, the chunk's
 * maximum and its exp sum. */
typedef struct {
    decode_item *items;
    int64_t *cost_before;  /* the items' cumulative costs, total_items + 1 of them */
    int64_t total_items;
    int64_t *partial_at;
    int64_t partials;  /* entries in all */
    int parallel;  /* whether the run is worth the threads */
} decode_plan;

/* paged_attention_plan.c: the plan of a run (free it with free_decode_plan), and the first item that member
 * `member` of a team of `team` threads takes (runs of about equal cost). */
INFER_HIDDEN decode_plan make_decode_plan(const decode_call *call);
INFER_HIDDEN void free_decode_plan(decode_plan *plan);
INFER_HIDDEN int64_t run_start(const int64_t *cost_before, int64_t items, int64_t member, int64_t team);

/* paged_attention.c: every item of the plan, then the merge, into the call's out rows. */
INFER_HIDDEN void run_decode_plan(const decode_call *call, const decode_plan *plan);

/* The next work item's K and V lines, requested a few at a time from inside the current item's loops over a bf16
 * pool's rows read in place (the direct path): a burst of requests stalls the core once the line fill buffers are
 * full, and with them the current item's arithmetic, which then waits for memory the requests would have fetched
 * during it. Token t's run of run_bytes (its KV heads' key row) starts at rows[t]; its value run lies `values`
 * bytes on. Idle when token == tokens. */
typedef struct {
    const char *rows[DECODE_CHUNK];
    int64_t tokens, run_bytes, token, offset;
    ptrdiff_t values;
} kv_stream;

/* Requests the stream's next `lines` key lines and their value lines into L2. */
static inline __attribute__((always_inline)) void stream_lines(kv_stream *stream, int64_t lines) {
    for (int64_t i = 0; i < lines && stream->token < stream->tokens; i++) {
        const char *line = stream->rows[stream->token] + stream->offset;
        __builtin_prefetch(line, 0, 2);  /* prefetcht1 on x86 */
        __builtin_prefetch(line + stream->values, 0, 2);
        stream->offset += 64;
        if (stream->offset >= stream->run_bytes) {
            stream->offset = 0;
            stream->token++;
        }
    }
}

/* Lines a pass of the dot-product loops requests: a pass of four keys' scores, of two keys' value rows for 64
 * columns. Qwen3-0.6B's layout (16 query heads over 8 KV heads of 128), 64 sequences, 28 layers of a bf16 pool with
 * blocks scattered at random, 1 thread, on an AMX Xeon: 2 to 16 lines a pass took 1.16-1.25x less time than the
 * next item's lines requested at once (4 the most), and 4 took 1.33x less at 40 keys, 1.29-1.31x at 145 and 1.34x
 * at 600 (9.0-9.3 GB/s of K/V against 6.6-7.2), float32 and dot-product arithmetic alike. */
#define STREAM_LINES 4

#if INFER_AVX512
/* paged_attention_avx512.c, over a bf16 pool's rows read in place (keys[j], values at rows[j] + offset):
 * scores[h][j] = scale * queries[h] . keys[j] for `heads` query heads of head_dim (one of DIRECT_HEAD_DIMS) and
 * j < n, best[h] their maxima, float32 FMAs over the widened keys or with `dots` (AVX512-BF16 builds) the queries
 * rounded to bf16 on the dot products; and results[h] = sum_j weights[h][j] * values[j] for WEIGH_HEADS heads or
 * fewer (`count`), over float32 or bf16 (`bf16`) rows, 64 columns. Each asks for `stream`'s lines as it goes. */
INFER_HIDDEN void score_heads(const float *const *queries, int64_t heads, const uint16_t *const *keys, int64_t n,
                              float scale, float *const *scores, float *best, int dots, int64_t head_dim,
                              kv_stream *stream);
INFER_HIDDEN void weigh_pass(float *const *weights, const void *const *rows, ptrdiff_t offset, int64_t n,
                             float *const *results, int count, int bf16, kv_stream *stream);
#endif

#if INFER_AVX512_BF16
/* paged_attention_avx512.c: results[h] = sum_j weights[h][j] * values[j] for `heads` heads over a bf16 pool's
 * value rows of head_dim (a multiple of 64) on the dot products, the probabilities (n <= DECODE_CHUNK a head, zero
 * past its own keys) rounded to bf16 pairs in `pairs` (this thread's, WEIGH_HEADS * DECODE_CHUNK / 2 words). */
INFER_HIDDEN void weigh_dots(float *const *weights, int64_t heads, const void *const *rows, ptrdiff_t offset,
                             int64_t n, int64_t head_dim, uint32_t *pairs, float *const *results, kv_stream *stream);
#endif

#endif
