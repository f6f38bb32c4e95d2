"""``allocator: contiguous``: the pre-PagedAttention baseline. Each sequence reserves ``max_model_len`` worth of
physically contiguous blocks at admission, whatever it will actually use (the ablation baseline for KV waste)."""

from __future__ import annotations

from infer.allocator import AllocatorConfig, RefcountingAllocator


class ContiguousAllocator(RefcountingAllocator):
    """First-fit allocation of contiguous block ranges; ``blocks_needed`` always answers a full reservation."""

    may_fragment = True

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, config: AllocatorConfig | None = None):
        super().__init__(num_blocks, block_size, max_model_len, config)
        self._num_free = num_blocks - 1

    @property
    def num_free(self) -> int:
        return self._num_free

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-max(num_tokens, self.max_model_len) // self.block_size)

    def _take_free(self, n: int) -> list[int] | None:
        start = self._first_fit(n)
        if start is None:
            return None  # enough free blocks, but fragmented: exactly the cost this baseline demonstrates
        self._num_free -= n
        return list(range(start, start + n))

    def _put_free(self, block: int) -> None:
        self._num_free += 1

    def _first_fit(self, n: int) -> int | None:
        run_start, run_length = 1, 0
        for block in range(1, self.num_blocks):
            if self._refcounts[block]:
                run_start, run_length = block + 1, 0
                continue
            run_length += 1
            if run_length == n:
                return run_start
        return 1 if n == 0 else None
