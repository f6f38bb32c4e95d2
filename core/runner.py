"""The model runner: turns a step plan into flattened batch metadata, runs the model, returns the logits rows needed."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infer.attention import AttentionBackend, AttentionMetadata
from infer.sequence import Sequence


@dataclass(slots=True)
class BatchRows:
    """Which logits rows belong to which sequence: ``seq``'s rows are ``start .. start + count - 1`` and predict the
    tokens at positions ``first_position .. first_position + count - 1``."""

    seq: Sequence
    start: int
    count: int
    first_position: int


@dataclass(slots=True)
class StepOutput:
    logits: torch.Tensor  # [num_rows, vocab] float32
    rows: list[BatchRows]
    hidden_states: torch.Tensor | None = None  # [num_rows, hidden] when a drafter needs them


def step_tokens(seq: Sequence, num_new_tokens: int) -> list[int]:
    """The tokens computed this step: uncomputed committed tokens first, then drafts."""
    start = seq.num_computed_tokens
    end = start + num_new_tokens
    committed = seq.num_tokens
    if end <= committed:
        if num_new_tokens <= 4:
            return [seq.token_at(p) for p in range(start, end)]
        return seq.token_ids[start:end]
    tokens = [seq.token_at(p) for p in range(start, committed)]
    return tokens + seq.draft_token_ids[: end - committed]


class ModelRunner:
    """Owns the KV pool tensor and runs one forward pass per step."""

    def __init__(self, model, attention: AttentionBackend, kv_cache: torch.Tensor, device: torch.device):
        self.model = model
        self.attention = attention
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = attention.block_size

    def build_metadata(self, scheduled: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, AttentionMetadata]:
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        for seq, num_new in scheduled:
            start = seq.num_computed_tokens
            input_ids.extend(step_tokens(seq, num_new))
            positions.extend(range(start, start + num_new))
            query_lens.append(num_new)
            seq_lens.append(start + num_new)
        max_blocks = max(len(seq.block_table) for seq, _ in scheduled)
        tables = [seq.block_table + [0] * (max_blocks - len(seq.block_table)) for seq, _ in scheduled]
        block_tables = torch.tensor(tables, dtype=torch.int32)
        positions_t = torch.tensor(positions, dtype=torch.int64)
        seq_index = torch.repeat_interleave(torch.arange(len(scheduled)), torch.tensor(query_lens))
        block_ids = block_tables[seq_index, positions_t // self.block_size].to(torch.int64)
        slot_mapping = block_ids * self.block_size + positions_t % self.block_size
        query_start_loc = torch.zeros(len(scheduled) + 1, dtype=torch.int32)
        query_start_loc[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0)
        metadata = AttentionMetadata(
            positions=positions_t.to(self.device),
            query_start_loc=query_start_loc.to(self.device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
            block_tables=block_tables.to(self.device),
            slot_mapping=slot_mapping.to(self.device),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        return torch.tensor(input_ids, dtype=torch.int64, device=self.device), metadata

    @staticmethod
    def logits_rows(scheduled: list[tuple[Sequence, int]]) -> tuple[list[int], list[BatchRows]]:
        """Flat token indices whose logits are needed: every token at or past the sequence's last committed one."""
        indices: list[int] = []
        rows: list[BatchRows] = []
        offset = 0
        for seq, num_new in scheduled:
            end = seq.num_computed_tokens + num_new
            first = max(seq.num_computed_tokens, seq.num_tokens - 1)
            if end >= seq.num_tokens:
                rows.append(BatchRows(seq, len(indices), end - first, first + 1))
                indices.extend(range(offset + first - seq.num_computed_tokens, offset + num_new))
            offset += num_new
        return indices, rows

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Sequence, int]], want_hidden: bool = False) -> StepOutput:
        input_ids, metadata = self.build_metadata(scheduled)
        metadata = self.attention.prepare(metadata)
        hidden = self.model(input_ids, metadata.positions, self.kv_cache, metadata, self.attention)
        indices, rows = self.logits_rows(scheduled)
        index = torch.tensor(indices, dtype=torch.int64, device=hidden.device)
        selected = hidden.index_select(0, index)
        logits = self.model.compute_logits(selected)
        return StepOutput(logits=logits.float(), rows=rows, hidden_states=selected if want_hidden else None)
