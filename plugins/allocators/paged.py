"""``allocator: paged``: vLLM-style free list with reference counts; blocks are taken one at a time, on demand."""

from __future__ import annotations

from infer.allocator import AllocatorConfig, RefcountingAllocator


class PagedAllocator(RefcountingAllocator):
    """A free list of block ids (1 .. num_blocks-1): any free block serves, so nothing fragments.

    The most recently freed block is handed out first, and a block never used before only when no used one is free
    (the lowest id first). On a CPU the pool's pages are mapped in as its blocks are first written
    (``infer.host.zeroed_pages``), so its resident memory stays at the most blocks in use at once instead of walking
    through the whole pool as requests come and go, and a reused block's lines may still be cached. The prefix caches
    hold the blocks they keep (``retain``): this order decides nothing about what they evict."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, config: AllocatorConfig | None = None):
        super().__init__(num_blocks, block_size, max_model_len, config)
        self._free: list[int] = list(range(num_blocks - 1, 0, -1))  # a stack: its top, the end, is taken first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def _take_free(self, n: int) -> list[int]:
        return [self._free.pop() for _ in range(n)]

    def _put_free(self, block: int) -> None:
        self._free.append(block)
