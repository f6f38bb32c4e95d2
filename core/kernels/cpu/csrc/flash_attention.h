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

/* Whether the build can run the bf16 products on AMX tiles (where the OS allows: flash_call.amx). */
#define FLASH_AMX INFER_AMX

/* One call of infer_flash_attention: its arguments (cpu_kernels.h) and its plan. Chunk i's K/V of KV head kvh are
 * packed at packed_at[i] + kvh * (its keys rounded up to FLASH_KEYS) * head_dim of packed_keys and packed_values;
 * its work items are items_at[i] .. items_at[i + 1] - 1. */
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
    int amx;  /* the bf16 products on AMX tiles (head_dim 64, the build and Linux allow): a work item per query head */
    int64_t *packed_at, *items_at;
    uint16_t *packed_keys, *packed_values;
} flash_call;

/* Work item `item` (items_at: the chunks' first items): its chunk, which of `heads` heads (the query heads on AMX,
 * the KV heads on the dot products), its first query token in the chunk and how many (the chunk's last tiles of
 * tokens, which see the most keys, first), the first token's position, and the chunk's keys rounded up to whole
 * tiles. */
typedef struct {
    int64_t chunk, head, first, tokens, offset, keys;
} flash_item;

static inline flash_item flash_item_at(int64_t item, const int64_t *items_at, const int64_t *query_lens,
                                       const int64_t *contexts, int64_t heads) {
    flash_item it = {0};
    while (items_at[it.chunk + 1] <= item) it.chunk++;
    const int64_t local = item - items_at[it.chunk], length = query_lens[it.chunk];
    const int64_t tiles = (length + FLASH_TOKENS - 1) / FLASH_TOKENS;
    it.head = local % heads;
    it.first = (tiles - 1 - local / heads) * FLASH_TOKENS;
    it.tokens = length - it.first < FLASH_TOKENS ? length - it.first : FLASH_TOKENS;
    it.offset = contexts[it.chunk] - length + it.first;
    it.keys = (contexts[it.chunk] + FLASH_KEYS - 1) / FLASH_KEYS * FLASH_KEYS;
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
/* flash_attention_amx.c: chunk i's K/V of KV head kvh packed for the AMX kernel (`keys` rows, padding zero), and
 * every work item run on AMX tiles: a worksharing loop, called by every thread of the call's parallel region. */
INFER_HIDDEN void flash_pack_amx(const flash_call *call, int64_t i, int64_t kvh, int64_t keys, uint16_t *packed_keys,
                                 uint16_t *packed_values);
INFER_HIDDEN void flash_items_amx(const flash_call *call);
#endif
#endif

#endif
