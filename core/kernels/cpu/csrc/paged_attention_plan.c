/* Paged attention's planning (paged_attention.h): the call split into runs of queries whose partial results fit,
 * each run's work items with their costs, and the threads' shares of them. Which item computes a query head's chunk
 * never changes what it computes, so none of this changes a result. */
#include "paged_attention.h"

/* Partial results (floats) infer_paged_attention holds at once: queries go through in runs whose partials fit, so a
 * long prefill chunk over a long context (a float32 step's every query) never holds one for every (query, head,
 * chunk) together. A query's result is its own, so the runs change nothing. */
#define DECODE_PARTIALS (4 << 20)

/* The run's groups: group g is queries group_first[g] .. group_first[g + 1] - 1 (up to DECODE_GROUP consecutive
 * queries of one sequence). Also where each query's partials start (plan->partial_at, plan->partials) and the keys
 * the run reads in all. Returns the number of groups. */
static int64_t find_groups(const decode_call *call, int64_t *group_first, decode_plan *plan, int64_t *total_keys) {
    int64_t groups = 0;
    for (int64_t i = 0; i < call->queries; i++) {
        if (i == 0 || call->seq_of_query[i] != call->seq_of_query[i - 1] ||
            i - group_first[groups - 1] == DECODE_GROUP)
            group_first[groups++] = i;
        plan->partial_at[i] = plan->partials;
        plan->partials += call->num_heads * query_chunks(call, i);
        *total_keys += call->context_lens[i] - first_key(call, i);
    }
    group_first[groups] = call->queries;
    return groups;
}

/* The groups' chunks, from the first of any of its queries to the last of its longest context: group g's are
 * chunk_first[g] .. chunk_first[g + 1] - 1, the first of them chunk group_from[g] of its sequence. Returns the
 * number of chunks. */
static int64_t find_chunks(const decode_call *call, const int64_t *group_first, int64_t groups,
                           int64_t *chunk_first, int64_t *group_from) {
    int64_t chunks = 0;
    for (int64_t g = 0; g < groups; g++) {
        int64_t longest = 0, from = INT64_MAX;
        for (int64_t i = group_first[g]; i < group_first[g + 1]; i++) {
            if (call->context_lens[i] > longest) longest = call->context_lens[i];
            if (first_key(call, i) / DECODE_CHUNK < from) from = first_key(call, i) / DECODE_CHUNK;
        }
        chunk_first[g] = chunks;
        group_from[g] = from;
        chunks += chunks_of(longest) - from;
    }
    chunk_first[groups] = chunks;
    return chunks;
}

/* An item's keys: its chunk's, from the earliest first key among its queries (rounded down to even with `dots`,
 * whose pairs of keys then stay the same whichever queries share the item) up to their longest context. */
static void span_item(decode_item *it, const decode_call *call) {
    int64_t from = INT64_MAX;
    it->end = 0;
    for (int64_t i = it->first_query; i < it->end_query; i++) {
        if (call->context_lens[i] > it->end) it->end = call->context_lens[i];
        if (first_key(call, i) < from) from = first_key(call, i);
    }
    if (call->dots) from &= ~(int64_t)1;
    it->start = it->c * DECODE_CHUNK > from ? it->c * DECODE_CHUNK : from;
    if (it->end > it->c * DECODE_CHUNK + DECODE_CHUNK) it->end = it->c * DECODE_CHUNK + DECODE_CHUNK;
}

/* An item takes every KV head of its chunk, whose slots it then reads whole and in order, where there are items
 * enough for the threads; else one KV head (a single sequence's few chunks). */
static int64_t kv_head_split(int64_t chunks, int parallel, int64_t num_kv_heads) {
#ifdef _OPENMP
    const int64_t threads = parallel ? omp_get_max_threads() : 1;
#else
    const int64_t threads = 1;
    (void)parallel;
#endif
    return chunks >= 4 * threads ? 1 : num_kv_heads;
}

/* The items: a group's chunk (its KV heads, or one of `split` shares of them), then a draft tree's leaves' own
 * chunks. A leaf takes its group's items for the chunks before its own position's, and an item of its own for that
 * chunk, whose last key is its own (the same keys, in the same order, as a query at that position whose K/V sat
 * there: the same bits). An item's cost is its keys times its queries (plus a fixed part) per KV head. */
static void list_items(const decode_call *call, decode_plan *plan, const int64_t *group_first,
                       const int64_t *chunk_first, const int64_t *group_from, const int64_t *group_of_chunk,
                       int64_t chunks, int64_t split, const int64_t *leaf_query) {
    plan->cost_before[0] = 0;
    for (int64_t item = 0; item < plan->total_items; item++) {
        decode_item *it = &plan->items[item];
        it->first_kv_head = 0;
        it->kv_heads = call->num_kv_heads;
        it->own = -1;
        if (item < chunks * split) {
            const int64_t chunk = item / split, g = group_of_chunk[chunk];
            it->c = group_from[g] + chunk - chunk_first[g];
            it->first_query = group_first[g];
            it->end_query = group_first[g + 1];
            it->kv_heads = call->num_kv_heads / split;
            it->first_kv_head = item % split * it->kv_heads;
        } else {  /* a leaf's own chunk, every KV head */
            it->first_query = leaf_query[item - chunks * split];
            it->end_query = it->first_query + 1;
            it->c = (call->context_lens[it->first_query] - 1) / DECODE_CHUNK;
            it->own = call->own_keys[it->first_query];
        }
        span_item(it, call);
        plan->cost_before[item + 1] = plan->cost_before[item] +
                                      ((it->end - it->start) * (it->end_query - it->first_query) + 8) * it->kv_heads;
    }
}

decode_plan make_decode_plan(const decode_call *call) {
    const int64_t queries = call->queries;
    decode_plan plan = {0};
    int64_t *group_first = malloc(sizeof(int64_t) * (queries + 1));
    int64_t *chunk_first = malloc(sizeof(int64_t) * (queries + 1));
    int64_t *group_from = malloc(sizeof(int64_t) * (queries + 1));
    plan.partial_at = malloc(sizeof(int64_t) * queries);
    int64_t total_keys = 0;
    const int64_t groups = find_groups(call, group_first, &plan, &total_keys);
    const int64_t chunks = find_chunks(call, group_first, groups, chunk_first, group_from);
    int64_t *group_of_chunk = malloc(sizeof(int64_t) * (chunks > 0 ? chunks : 1));
    for (int64_t g = 0; g < groups; g++)
        for (int64_t c = chunk_first[g]; c < chunk_first[g + 1]; c++) group_of_chunk[c] = g;
    int64_t leaves = 0, *leaf_query = malloc(sizeof(int64_t) * (queries > 0 ? queries : 1));
    for (int64_t i = 0; call->own_keys && i < queries; i++)
        if (call->own_keys[i] >= 0) leaf_query[leaves++] = i;
    plan.parallel = total_keys * call->num_heads >= 2048;
    const int64_t split = kv_head_split(chunks, plan.parallel, call->num_kv_heads);
    plan.total_items = chunks * split + leaves;
    plan.items = malloc(sizeof(decode_item) * (plan.total_items > 0 ? plan.total_items : 1));
    plan.cost_before = malloc(sizeof(int64_t) * (plan.total_items + 1));
    list_items(call, &plan, group_first, chunk_first, group_from, group_of_chunk, chunks, split, leaf_query);
    free(leaf_query);
    free(group_of_chunk);
    free(group_from);
    free(chunk_first);
    free(group_first);
    return plan;
}

void free_decode_plan(decode_plan *plan) {
    free(plan->cost_before);
    free(plan->items);
    free(plan->partial_at);
}

int64_t run_start(const int64_t *cost_before, int64_t items, int64_t member, int64_t team) {
    if (member >= team) return items;
    const int64_t target = cost_before[items] * member / team;
    int64_t low = 0, high = items;  /* the first item whose cost_before reaches the target */
    while (low < high) {
        const int64_t middle = (low + high) / 2;
        if (cost_before[middle] < target) low = middle + 1;
        else high = middle;
    }
    return low;
}

void infer_paged_attention(const float *q, int64_t q_stride, const void *kv, const int32_t *block_tables,
                           int64_t table_stride, const int64_t *rows, const int64_t *seq_of_query,
                           const int64_t *context_lens, const int64_t *own_keys, float *out, int64_t queries,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                           int64_t num_blocks, int64_t max_context, float scale, int64_t kv_bf16, int64_t dots,
                           int64_t window, const float *sinks) {
    (void)max_context;
    const int64_t entry = head_dim + 2;
    for (int64_t first = 0, last = 0; first < queries; first = last) {
        for (int64_t held = 0; last < queries; last++) {
            const decode_call one = {.context_lens = context_lens + last, .window = window};
            const int64_t need = num_heads * query_chunks(&one, 0) * entry;
            if (last > first && held + need > DECODE_PARTIALS) break;
            held += need;
        }
        const decode_call call = {q, q_stride, kv, block_tables, table_stride, rows ? rows + first : NULL, first,
                                  seq_of_query + first, context_lens + first, own_keys ? own_keys + first : NULL,
                                  out, last - first, num_heads, num_kv_heads, head_dim, block_size, num_blocks,
                                  scale, kv_bf16, dots, window, sinks};
        decode_plan plan = make_decode_plan(&call);
        run_decode_plan(&call, &plan);
        free_decode_plan(&plan);
    }
}
