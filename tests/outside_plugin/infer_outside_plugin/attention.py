"""``attention: outside-reference``: plain torch attention, one sequence at a time."""

from __future__ import annotations

import torch

from infer.attention import AttentionBackend, AttentionMetadata, gather_blocks, write_kv


class ReferenceAttention(AttentionBackend):
    """Writes this step's K/V with ``write_kv``, gathers each sequence's K/V back through its block table, and
    attends in float32 with each query seeing every position up to its own. Slow, any device, any dtype."""

    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        write_kv(kv_cache, k, v, metadata.slot_mapping)
        output = torch.zeros_like(q)
        queries_per_kv_head = self.num_heads // self.num_kv_heads
        start = 0
        for index, (query_len, seq_len) in enumerate(zip(metadata.query_lens_cpu, metadata.seq_lens_cpu)):
            num_blocks = -(-seq_len // self.block_size)
            keys, values = gather_blocks(kv_cache, metadata.block_tables[index, :num_blocks], torch.float32)
            keys = keys[:seq_len].repeat_interleave(queries_per_kv_head, dim=1)  # [seq_len, num_heads, head_dim]
            values = values[:seq_len].repeat_interleave(queries_per_kv_head, dim=1)
            queries = q[start : start + query_len].float()
            scores = torch.einsum("qhd,khd->hqk", queries, keys) * self.scale  # [num_heads, query_len, seq_len]
            query_positions = torch.arange(seq_len - query_len, seq_len, device=q.device)
            future = torch.arange(seq_len, device=q.device)[None, :] > query_positions[:, None]
            scores.masked_fill_(future, float("-inf"))
            attended = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), values)
            output[start : start + query_len] = attended.to(q.dtype)
            start += query_len
        return output
