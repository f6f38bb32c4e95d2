"""``allocator: stack``: a LIFO free list. The block released last is handed out next, while it is likely still in
the GPU's L2 cache; blocks deep in the stack stay untouched (the opposite of ``paged``'s FIFO rotation)."""

from __future__ import annotations

from infer import hookimpl
from infer.allocator import AllocatorConfig, RefcountingAllocator


class StackAllocator(RefcountingAllocator):
    """Free blocks on a stack; reference counting comes from the core's ``RefcountingAllocator``."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, config: AllocatorConfig | None = None):
        super().__init__(num_blocks, block_size, max_model_len, config)
        self._free = list(range(num_blocks - 1, 0, -1))  # block 1 on top; the null block 0 is never on the stack

    @property
    def num_free(self) -> int:
        return len(self._free)

    def _take_free(self, n: int) -> list[int]:
        return [self._free.pop() for _ in range(n)]

    def _put_free(self, block: int) -> None:
        self._free.append(block)


@hookimpl
def register_allocators(register):
    register(
        "stack",
        "infer_example_plugin.stack:StackAllocator",
        description="LIFO free list: the most recently freed block is reused first",
    )
