"""``allocator: outside-fifo``: a FIFO free list."""

from __future__ import annotations

from collections import deque

from infer.allocator import AllocatorConfig, RefcountingAllocator


class FifoAllocator(RefcountingAllocator):
    """Hands out the block released longest ago first."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, config: AllocatorConfig | None = None):
        super().__init__(num_blocks, block_size, max_model_len, config)
        self._free = deque(range(1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def _take_free(self, n: int) -> list[int] | None:
        return [self._free.popleft() for _ in range(n)]

    def _put_free(self, block: int) -> None:
        self._free.append(block)
