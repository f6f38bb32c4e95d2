"""Triton kernels for the paged KV pool: store this step's K/V, and attend over a mixed varlen batch.

Imported only once the ``triton`` attention backend is chosen and has checked it can run: Triton reads
``TRITON_INTERPRET`` when it is imported and when ``@triton.jit`` decorates these functions, so importing this module
fixes whether they compile for the GPU or run in the CPU interpreter.

One attention kernel serves prefill chunks, decodes and draft verification alike. A program owns one *query tile*
(``BLOCK_Q`` consecutive query tokens of one sequence) for one KV head and all ``QUERIES_PER_KV`` query heads that share
it, so GQA reads each K/V tile once per group: its ``BLOCK_M = BLOCK_Q * QUERIES_PER_KV`` rows are
(token, head-in-group) pairs. It walks the sequence's KV positions in tiles of ``TILE_N`` through the block table with
an online softmax. With ``NUM_SPLITS > 1`` the KV axis is cut into that many ranges handled by separate programs
(flash-decoding) and a second kernel merges their partial results.

Sliding windows (``HAS_WINDOW``, ``window`` positions): a row sees only its own position and the ``window - 1``
before it, and a program's walk starts at its first row's first visible position, so the blocks wholly before the
window are never loaded; the splits divide that shorter range.

Attention sinks (``HAS_SINKS``, a logit per query head): once a row's keys are done its sink joins the softmax's
denominator, ``exp2(sink - m)`` with ``m`` the larger of the row's maximum and the sink (the accumulator rescaled to
``m`` too); with split KV ranges the merge adds it once, over every split's maximum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE_N = 32  # KV positions per inner-loop step; a multiple of 16 so tl.dot accepts it on every GPU.
LOG2_E = 1.4426950408889634  # scores are scaled by this so the kernel can use exp2, the native GPU exponent.
LOG2_E_JIT = tl.constexpr(LOG2_E)  # the same, as the kernels read a global


@triton.jit
def store_kv_kernel(
    key_ptr,  # [T, num_kv_heads, head_dim]
    value_ptr,  # [T, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [T]
    key_stride_token,
    key_stride_head,
    value_stride_token,
    value_stride_head,
    cache_stride_block,
    cache_stride_slot,
    cache_stride_head,
    num_kv_heads,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PADDED: tl.constexpr,
):
    """One program per token: copy its K and V (all KV heads) into its pool slot; slot -1 is padding."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PADDED)[:, None]
    dims = tl.arange(0, HEAD_DIM)[None, :]
    head_mask = heads < num_kv_heads
    key = tl.load(key_ptr + token * key_stride_token + heads * key_stride_head + dims, mask=head_mask)
    value = tl.load(value_ptr + token * value_stride_token + heads * value_stride_head + dims, mask=head_mask)
    cache_offset = (
        (slot // BLOCK_SIZE) * cache_stride_block + (slot % BLOCK_SIZE) * cache_stride_slot + heads * cache_stride_head
    ) + dims
    tl.store(key_cache_ptr + cache_offset, key.to(key_cache_ptr.dtype.element_ty), mask=head_mask)
    tl.store(value_cache_ptr + cache_offset, value.to(value_cache_ptr.dtype.element_ty), mask=head_mask)


@triton.jit
def find_sequence(query_start_loc_ptr, tile_index, num_seqs, BLOCK_Q: tl.constexpr):
    """Binary search for the sequence owning query tile ``tile_index``.

    Sequence ``s`` owns tiles ``query_start_loc[s] // BLOCK_Q + s`` onwards: that index never runs into the next
    sequence's first tile, so the grid can be sized ``T // BLOCK_Q + B`` without a host-built tile table.
    """
    low = 0
    high = num_seqs
    while low < high:
        middle = (low + high) // 2
        first_tile = tl.load(query_start_loc_ptr + middle) // BLOCK_Q + middle
        if first_tile <= tile_index:
            low = middle + 1
        else:
            high = middle
    return low - 1


@triton.jit
def matmul(left, right, DOT_IN_FLOAT32: tl.constexpr):
    """``left @ right`` with float32 products and accumulation.

    "ieee" because fp32 models expect fp32 products, not the GPU's default TF32; 16-bit operands ignore it.
    ``DOT_IN_FLOAT32`` widens the operands first, for the CPU interpreter only (see ``INTERPRETED``).
    """
    if DOT_IN_FLOAT32:
        left = left.to(tl.float32)
        right = right.to(tl.float32)
    return tl.dot(left, right, input_precision="ieee")


@triton.jit
def paged_attention_kernel(
    query_ptr,  # [T, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    output_ptr,  # [T, num_heads, head_dim], written when NUM_SPLITS == 1
    partial_output_ptr,  # [T, num_heads, NUM_SPLITS, head_dim] fp32, unnormalised, when NUM_SPLITS > 1
    partial_max_ptr,  # [T, num_heads, NUM_SPLITS] fp32, running max in log2 units
    partial_sum_ptr,  # [T, num_heads, NUM_SPLITS] fp32, softmax denominator
    sinks_ptr,  # [num_heads] fp32 sink logits, read when HAS_SINKS
    query_start_loc_ptr,  # [B + 1]
    seq_lens_ptr,  # [B]
    block_tables_ptr,  # [B, max_blocks]
    scale_log2,
    num_seqs,
    num_heads,
    tokens_per_split,
    query_stride_token,
    query_stride_head,
    output_stride_token,
    output_stride_head,
    cache_stride_block,
    cache_stride_slot,
    cache_stride_head,
    block_table_stride,
    window,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_IN_FLOAT32: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """Attention of one query tile x one KV-head group over one KV range (see the module docstring)."""
    tile_index = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = find_sequence(query_start_loc_ptr, tile_index, num_seqs, BLOCK_Q)
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    first_query = (tile_index - (query_start // BLOCK_Q + seq)) * BLOCK_Q
    if first_query >= query_len:
        return  # a spare tile of the over-sized grid
    context_len = tl.load(seq_lens_ptr + seq) - query_len

    rows = tl.arange(0, BLOCK_M)
    query_index = first_query + rows // QUERIES_PER_KV  # within the sequence's query tokens
    head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    row_valid = (rows < BLOCK_Q * QUERIES_PER_KV) & (query_index < query_len)
    query_position = context_len + query_index  # bottom-right causal: sees KV positions <= this
    dims = tl.arange(0, HEAD_DIM)
    token = (query_start + query_index).to(tl.int64)
    query = tl.load(
        query_ptr + token[:, None] * query_stride_token + head[:, None] * query_stride_head + dims[None, :],
        mask=row_valid[:, None],
        other=0.0,
    )

    # The tile's last query sees everything before it, its first nothing before its window; this split owns
    # [kv_start, kv_end) of that.
    visible_end = context_len + tl.minimum(first_query + BLOCK_Q, query_len)
    visible_start = 0
    if HAS_WINDOW:
        visible_start = tl.maximum(context_len + first_query - window + 1, 0)
    kv_start = visible_start + split * tokens_per_split
    kv_end = tl.minimum(visible_end, kv_start + tokens_per_split)

    running_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    accumulator = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * block_table_stride
    for tile_start in range(kv_start, kv_end, TILE_N):
        positions = tile_start + tl.arange(0, TILE_N)
        in_range = positions < kv_end
        block = tl.load(block_table_row + positions // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
        slot_offset = (
            block * cache_stride_block + (positions % BLOCK_SIZE) * cache_stride_slot + kv_head * cache_stride_head
        )
        key = tl.load(key_cache_ptr + slot_offset[None, :] + dims[:, None], mask=in_range[None, :], other=0.0)
        value = tl.load(value_cache_ptr + slot_offset[:, None] + dims[None, :], mask=in_range[:, None], other=0.0)

        scores = matmul(query, key, DOT_IN_FLOAT32) * scale_log2  # [BLOCK_M, TILE_N]
        visible = (positions[None, :] <= query_position[:, None]) & in_range[None, :]
        if HAS_WINDOW:
            visible = visible & (positions[None, :] > query_position[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))

        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        # A row with nothing visible yet keeps max -inf; subtracting 0 instead avoids (-inf) - (-inf) = NaN.
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        probabilities = tl.exp2(scores - safe_max[:, None])
        correction = tl.exp2(running_max - safe_max)
        running_sum = running_sum * correction + tl.sum(probabilities, axis=1)
        accumulator = accumulator * correction[:, None] + matmul(probabilities.to(value.dtype), value, DOT_IN_FLOAT32)
        running_max = new_max

    if NUM_SPLITS == 1:
        if HAS_SINKS:  # the sink joins the denominator, against the larger of the row's maximum and the sink
            sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0) * LOG2_E_JIT
            final_max = tl.maximum(running_max, sink)
            shrink = tl.exp2(running_max - final_max)
            running_sum = running_sum * shrink + tl.exp2(sink - final_max)
            accumulator = accumulator * shrink[:, None]
        output = accumulator / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]
        tl.store(
            output_ptr + token[:, None] * output_stride_token + head[:, None] * output_stride_head + dims[None, :],
            output.to(output_ptr.dtype.element_ty),
            mask=row_valid[:, None],
        )
    else:
        partial_index = (token * num_heads + head) * NUM_SPLITS + split
        tl.store(partial_max_ptr + partial_index, running_max, mask=row_valid)
        tl.store(partial_sum_ptr + partial_index, running_sum, mask=row_valid)
        tl.store(
            partial_output_ptr + partial_index[:, None] * HEAD_DIM + dims[None, :],
            accumulator,
            mask=row_valid[:, None],
        )


@triton.jit
def merge_splits_kernel(
    output_ptr,  # [T, num_heads, head_dim]
    partial_output_ptr,  # [T, num_heads, NUM_SPLITS, head_dim]
    partial_max_ptr,  # [T, num_heads, NUM_SPLITS]
    partial_sum_ptr,  # [T, num_heads, NUM_SPLITS]
    sinks_ptr,  # [num_heads] fp32 sink logits, read when HAS_SINKS
    num_heads,
    output_stride_token,
    output_stride_head,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """One program per (token, head): rescale each split's partial softmax to the common max and normalise, the
    head's sink (with ``HAS_SINKS``) in the denominator and in the common max.

    Some split holds each query's own position, which it sees, so the common max is finite; splits that saw nothing
    (past the query, or before its window) carry max -inf and weigh exactly 0.
    """
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    partial_index = (token * num_heads + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    split_max = tl.load(partial_max_ptr + partial_index)
    split_sum = tl.load(partial_sum_ptr + partial_index)
    common_max = tl.max(split_max, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head) * LOG2_E_JIT
        common_max = tl.maximum(common_max, sink)
    weight = tl.exp2(split_max - common_max)
    dims = tl.arange(0, HEAD_DIM)
    partial = tl.load(partial_output_ptr + partial_index[:, None] * HEAD_DIM + dims[None, :])
    denominator = tl.sum(split_sum * weight, axis=0)
    if HAS_SINKS:
        denominator += tl.exp2(sink - common_max)
    output = tl.sum(partial * weight[:, None], axis=0) / denominator
    tl.store(
        output_ptr + token * output_stride_token + head * output_stride_head + dims,
        output.to(output_ptr.dtype.element_ty),
    )


# Triton's CPU interpreter multiplies bfloat16 tl.dot operands as raw bit patterns (triton-lang/triton#11584,
# "not supported yet"). Widening them to float32 first gives the exact products a GPU's bfloat16 MMA computes.
INTERPRETED = type(paged_attention_kernel).__name__ == "InterpretedFunction"


def store_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write this step's K/V (``[T, num_kv_heads, head_dim]``) into ``kv_cache`` at ``slot_mapping`` (-1 skipped)."""
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    num_tokens, num_kv_heads, head_dim = key.shape
    store_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        num_kv_heads,
        BLOCK_SIZE=key_cache.shape[1],
        HEAD_DIM=head_dim,
        HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
    )


def paged_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    scale: float,
    max_seq_len: int,
    block_m: int,
    num_splits: int,
    window: int | None = None,
    max_query_len: int = 1,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """Causal paged attention for a varlen batch; ``num_splits`` (a power of two) > 1 splits the KV axis (each
    sequence's range, up to ``max_seq_len`` positions, or with a sliding ``window`` up to ``window + max_query_len -
    1``); ``sinks``: a float32 sink logit per query head (``[num_heads]``) in each row's denominator, or None."""
    query = _last_dim_contiguous(query)
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    queries_per_kv = num_heads // key_cache.shape[2]
    block_q = block_m // queries_per_kv
    output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    partial_output = partial_max = partial_sum = output  # placeholders: the kernel touches them only when split
    if num_splits > 1:
        partial_max = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=query.device)
        partial_sum = torch.empty_like(partial_max)
        partial_output = torch.empty((*partial_max.shape, head_dim), dtype=torch.float32, device=query.device)
    span = min(max_seq_len, window + max_query_len - 1) if window else max_seq_len
    tokens_per_split = triton.cdiv(triton.cdiv(span, num_splits), TILE_N) * TILE_N
    grid = (num_tokens // block_q + num_seqs, key_cache.shape[2], num_splits)
    paged_attention_kernel[grid](
        query,
        key_cache,
        value_cache,
        output,
        partial_output,
        partial_max,
        partial_sum,
        output if sinks is None else sinks,  # a placeholder without sinks: never read
        query_start_loc,
        seq_lens,
        block_tables,
        scale * LOG2_E,
        num_seqs,
        num_heads,
        tokens_per_split,
        query.stride(0),
        query.stride(1),
        output.stride(0),
        output.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        window or 0,
        QUERIES_PER_KV=queries_per_kv,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=key_cache.shape[1],
        TILE_N=TILE_N,
        NUM_SPLITS=num_splits,
        DOT_IN_FLOAT32=INTERPRETED and query.dtype == torch.bfloat16,
        HAS_WINDOW=bool(window),
        HAS_SINKS=sinks is not None,
    )
    if num_splits > 1:
        merge_splits_kernel[(num_tokens, num_heads)](
            output,
            partial_output,
            partial_max,
            partial_sum,
            output if sinks is None else sinks,
            num_heads,
            output.stride(0),
            output.stride(1),
            NUM_SPLITS=num_splits,
            HEAD_DIM=head_dim,
            HAS_SINKS=sinks is not None,
        )
    return output


def _last_dim_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """The kernels address head_dim with unit stride; views such as a slice of a fused QKV output already have it."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()
