"""The step's plan on the wire: what rank 0 broadcasts to the other ranks each step."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from infer.distributed.group import TensorParallelGroup

if TYPE_CHECKING:
    from infer.sequence import Sequence

# Message kinds of the header rank 0 broadcasts: [kind, argument, 0, 0].
STEP, POOL, STOP = 1, 2, 3
HEADER_SIZE = 4


def pack_step(scheduled: list[tuple[Sequence, int]], input_ids: torch.Tensor, indices: list[int]) -> torch.Tensor:
    """One int64 tensor with what a rank needs to run a step: counts, then each sequence's computed and new token
    counts, its block table, the logits rows, then the step's tokens."""
    tables = [seq.block_table for seq, _ in scheduled]
    values = [len(scheduled), len(indices)]
    values += [seq.num_computed_tokens for seq, _ in scheduled]
    values += [num_new for _, num_new in scheduled]
    values += [len(table) for table in tables]
    for table in tables:
        values += table
    values += indices
    return torch.cat([torch.tensor(values, dtype=torch.int64), input_ids.to("cpu", torch.int64)])


def unpack_step(payload: torch.Tensor) -> tuple[list[list[int]], list[int], list[int], list[int], torch.Tensor]:
    """``(block_tables, num_computed, num_new, indices, input_ids)`` from ``pack_step``'s tensor."""
    head = payload[:2].tolist()
    num_seqs, num_indices = head
    counts = payload[2 : 2 + 3 * num_seqs].tolist()
    computed, new, lengths = counts[:num_seqs], counts[num_seqs : 2 * num_seqs], counts[2 * num_seqs :]
    offset = 2 + 3 * num_seqs
    flat = payload[offset : offset + sum(lengths) + num_indices].tolist()
    tables, position = [], 0
    for length in lengths:
        tables.append(flat[position : position + length])
        position += length
    indices = flat[position:]
    return tables, computed, new, indices, payload[offset + len(flat) :]


class Channel:
    """Rank 0's messages to the other ranks: a fixed-size header broadcast, then the step's payload."""

    def __init__(self, group: TensorParallelGroup, device: torch.device):
        self.group = group
        self.device = device  # where the collectives' tensors live (the CPU for gloo, the rank's GPU for NCCL)

    def send(self, kind: int, argument: int = 0, payload: torch.Tensor | None = None) -> None:
        header = torch.tensor([kind, argument, 0, 0], dtype=torch.int64, device=self.device)
        self.group.broadcast(header)
        if payload is not None:
            self.group.broadcast(payload.to(self.device))

    def receive(self) -> tuple[int, int, torch.Tensor | None]:
        header = self.group.broadcast(torch.empty(HEADER_SIZE, dtype=torch.int64, device=self.device))
        kind, argument = header[:2].tolist()
        if kind != STEP:
            return kind, argument, None
        payload = self.group.broadcast(torch.empty(argument, dtype=torch.int64, device=self.device))
        return kind, argument, payload.cpu()
