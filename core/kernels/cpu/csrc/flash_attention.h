/* Flash attention's parts (infer_flash_attention): the call and its plan, its work items and the pool's key rows,
 * shared by the AVX512-BF16 kernels (flash_attention.c) and the AMX ones (flash_attention_amx.c). The whole of it
 * needs AVX512-BF16; builds without it have only the entry, which aborts (the Python side asks infer_flash_kind
 * first). */
#ifndef INFER_FLASH_ATTENTION_H
#define INFER_FLASH_ATTENTION_H

#include "common.h"

#if INFER_AVX512_BF16
#define FLASH_TOKENS 16  /* query tokens per work item: times the query heads of one KV head, its rows */
#define FLASH_KEYS 32    /* keys per step of the online softmax: two registers of scores per row */

/* Whether the build can run the bf16 products on AMX tiles (where the OS allows: flash_call.amx), and the head sizes
 * the AMX kernel takes, X(size) each (a copy of it per size), the largest and whether a size is one of them. */
#define FLASH_AMX INFER_AMX
#define FLASH_AMX_HEAD_DIMS(X) X(64) X(128) X(256)
#define FLASH_AMX_HEAD_DIM_MAX 256

static inline int flash_amx_head_dim(int64_t head_dim) {
    return head_dim == 64 || head_dim == 128 || head_dim == 256;
}

/* One call of infer_flash_attention: its arguments (cpu_kernels.h) and its plan. Chunk i's K/V of KV head kvh, its
 * keys flash_first_key onwards (their count rounded up to FLASH_KEYS), are packed at packed_at[i] + kvh * (that
 * count) * head_dim of packed_keys and packed_values; its work items are items_at[i] .. items_at[i + 1] - 1. */
typedef struct {
    const float *q;
    int64_t q_stride;
    const void *kv;
    const int32_t *block_tables;
    int64_t table_stride;
    const int64_t *starts, *query_lens, *contexts, *tables;
    int64_t count;
    float *out;
    int64_t num_heads, num_kv_heads, head_dim, block_size, num_blocks;
    float scale;
    int64_t kv_bf16, fma;
    int64_t window;  /* a sliding window: each row sees its last `window` positions (0: every earlier one) */
    const float *sinks;  /* NULL, or a sink logit per query head in each row's denominator (-INFINITY: none) */
    int amx;  /* the bf16 products on AMX tiles (FLASH_AMX_HEAD_DIMS; the build and Linux allow): an item per head */
    int64_t *packed_at, *items_at;
    uint16_t *packed_keys, *packed_values;
} flash_call;

/* The first key a row at `position` sees (0 without a window). */
static inline int64_t flash_first_seen(const flash_call *call, int64_t position) {
    const int64_t first = call->window ? position - call->window + 1 : 0;
    return first > 0 ? first : 0;
}

/* Chunk i's first packed key: the first its first row sees. Keys before it are never packed or read, and its tiles
 * of FLASH_KEYS start there. */
static inline int64_t flash_first_key(const flash_call *call, int64_t i) {
    return flash_first_seen(call, call->contexts[i] - call->query_lens[i]);
}

/* The packed keys of chunk i from `base` on: up to its context, rounded up to whole tiles. */
static inline int64_t flash_packed_keys(const flash_call *call, int64_t i, int64_t base) {
    return (call->contexts[i] - base + FLASH_KEYS - 1) / FLASH_KEYS * FLASH_KEYS;
}

/* Work item `item` (items_at: the chunks' first items): its chunk, which of `heads` heads (the query heads on AMX,
 * the KV heads on the dot products), its first query token in the chunk and how many (the chunk's last tiles of
 * tokens, which see the most keys, first), the first token's position, the chunk's first packed key and its
 * packed keys (rounded up to whole tiles), and the first key of the first tile the item reads (its first token's
 * first seen key's tile). */
typedef struct {
    int64_t chunk, head, first, tokens, offset, base, keys, from;
} flash_item;

static inline flash_item flash_item_at(const flash_call *call, int64_t item, int64_t heads) {
    flash_item it = {0};
    while (call->items_at[it.chunk + 1] <= item) it.chunk++;
    const int64_t local = item - call->items_at[it.chunk], length = call->query_lens[it.chunk];
    const int64_t tiles = (length + FLASH_TOKENS - 1) / FLASH_TOKENS;
    it.head = local % heads;
    it.first = (tiles - 1 - local / heads) * FLASH_TOKENS;
    it.tokens = length - it.first < FLASH_TOKENS ? length - it.first : FLASH_TOKENS;
    it.offset = call->contexts[it.chunk] - length + it.first;
    it.base = flash_first_key(call, it.chunk);
    it.keys = flash_packed_keys(call, it.chunk, it.base);
    it.from = it.base + (flash_first_seen(call, it.offset) - it.base) / FLASH_KEYS * FLASH_KEYS;
    return it;
}

/* Token j's key row of KV head kvh in chunk i's sequence (its value row is `values` bytes on), or NULL past the
 * context (padding of the last tile). */
static inline const char *flash_key_row(const flash_call *call, int64_t i, int64_t kvh, int64_t j) {
    if (j >= call->contexts[i]) return NULL;
    const int32_t *table = call->block_tables + call->tables[i] * call->table_stride;
    const int64_t slot = (int64_t)table[j / call->block_size] * call->block_size + j % call->block_size;
    const size_t element = call->kv_bf16 ? 2 : 4;
    return (const char *)call->kv + (slot * call->num_kv_heads * call->head_dim + kvh * call->head_dim) * element;
}

/* The pool's V half, in bytes past its K half. */
static inline size_t flash_values(const flash_call *call) {
    return (size_t)(call->num_blocks * call->block_size * call->num_kv_heads * call->head_dim) *
           (call->kv_bf16 ? 2 : 4);
}

#if FLASH_AMX
/* flash_attention_amx.c: chunk i's K/V of KV head kvh packed for the AMX kernel (`keys` rows from key `base`,
 * padding zero), and every work item run on AMX tiles: a worksharing loop, called by every thread of the call's
 * parallel region. */
INFER_HIDDEN void flash_pack_amx(const flash_call *call, int64_t i, int64_t kvh, int64_t base, int64_t keys,
                                 uint16_t *packed_keys, uint16_t *packed_values);
INFER_HIDDEN void flash_items_amx(const flash_call *call);
#endif
#endif

#endif
