"""Sizing the KV pool once at startup, and failing fast when one ``max_model_len`` request cannot fit."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

logger = logging.getLogger("infer")


class KVPoolTooSmallError(RuntimeError):
    """The memory budget leaves no room for a single ``max_model_len`` request."""


@dataclass(frozen=True, slots=True)
class KVPoolPlan:
    num_blocks: int  # including the null block 0
    block_size: int
    bytes_per_token: int  # this host's: every local rank's pool together (and a drafter's own KV)
    max_model_len: int
    rank_bytes_per_token: tuple[int, ...] = ()  # tensor parallel: each rank's pool, over its own KV heads

    @property
    def usable_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    @property
    def max_concurrency(self) -> float:
        return (self.num_blocks - 1) / -(-self.max_model_len // self.block_size)

    def describe(self) -> str:
        ranks = ""
        if self.rank_bytes_per_token:
            per_rank = ", ".join(
                f"rank {rank} {size} B/token ({self.usable_tokens * size / 2**20:.1f} MiB)"
                for rank, size in enumerate(self.rank_bytes_per_token)
            )
            total = sum(self.rank_bytes_per_token)
            ranks = f"; per rank: {per_rank}; all ranks {self.usable_tokens * total / 2**20:.1f} MiB"
        return (
            f"KV pool: {self.num_blocks - 1} blocks x {self.block_size} tokens ({self.usable_tokens} tokens, "
            f"{self.bytes_per_token} B/token, {self.usable_tokens * self.bytes_per_token / 2**20:.1f} MiB); "
            f"max concurrency at max_model_len={self.max_model_len}: {self.max_concurrency:.1f}{ranks}"
        )


def free_device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def plan_kv_pool(
    *,
    budget_bytes: int,
    weight_bytes: int,
    activation_bytes: int,
    bytes_per_token: int,
    block_size: int,
    max_model_len: int,
    num_blocks_override: int | None = None,
    rank_bytes_per_token: tuple[int, ...] = (),
) -> KVPoolPlan:
    """Blocks that fit in ``budget - weights - peak activations``; raises when one max_model_len request won't fit."""
    if num_blocks_override is not None:
        num_blocks = num_blocks_override
        available = (num_blocks - 1) * block_size * bytes_per_token
    else:
        available = budget_bytes - weight_bytes - activation_bytes
        num_blocks = max(available // (block_size * bytes_per_token), 0) + 1
    plan = KVPoolPlan(num_blocks, block_size, bytes_per_token, max_model_len, rank_bytes_per_token)
    needed_blocks = -(-max_model_len // block_size)
    if num_blocks - 1 < needed_blocks:
        fits = (num_blocks - 1) * block_size
        raise KVPoolTooSmallError(
            f"the KV pool holds {fits} tokens ({num_blocks - 1} blocks of {block_size}) but one request of "
            f"model.max_model_len={max_model_len} needs {needed_blocks} blocks "
            f"(budget {budget_bytes / 2**20:.0f} MiB, weights {weight_bytes / 2**20:.0f} MiB, "
            f"activations {activation_bytes / 2**20:.0f} MiB, {bytes_per_token} B per token). "
            f"Largest max_model_len that fits: {fits}. Raise cache.memory_budget or lower model.max_model_len."
        )
    return plan
