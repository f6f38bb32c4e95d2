"""The allocator contract: which physical KV blocks a sequence gets, and when they come back."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from pydantic import BaseModel, ConfigDict


class AllocatorConfig(BaseModel):
    """Config section ``allocator``. Plugins subclass it to add their own keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = "paged"


class BlockAllocationError(RuntimeError):
    """An allocator invariant was broken (double release, foreign block)."""


class Allocator(ABC):
    """Hands out KV block ids from a pool of ``num_blocks`` (block 0, the null block, is never handed out).

    Blocks are reference counted: ``allocate`` returns blocks with count 1, ``retain`` adds one (a prefix-cache hit,
    a forked sample), ``release`` drops one and the block is free again at 0. Invariants the conformance suite
    checks: no block handed out twice while held; ``num_free + held == capacity``; releasing a free block raises.
    """

    config_model: ClassVar[type[AllocatorConfig]] = AllocatorConfig
    # True when allocate(n) may refuse although n blocks are free (it needs contiguous runs).
    may_fragment: ClassVar[bool] = False

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, config: AllocatorConfig | None = None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.config = config or self.config_model()

    @property
    def capacity(self) -> int:
        """Blocks that can be handed out (all but the null block)."""
        return self.num_blocks - 1

    @property
    @abstractmethod
    def num_free(self) -> int:
        """Blocks available to ``allocate`` right now."""

    @abstractmethod
    def allocate(self, n: int) -> list[int] | None:
        """Return ``n`` free block ids, each with reference count 1, or ``None`` when fewer are free (never partial)."""

    @abstractmethod
    def retain(self, blocks: list[int]) -> None:
        """Add one reference to each held block (raises ``BlockAllocationError`` for a free block)."""

    @abstractmethod
    def release(self, blocks: list[int]) -> None:
        """Drop one reference from each block; a block is free again at 0. Releasing a free block raises."""

    @abstractmethod
    def refcount(self, block: int) -> int:
        """Current reference count of ``block`` (0 when free)."""

    def blocks_needed(self, num_tokens: int) -> int:
        """How many blocks a sequence must hold to store ``num_tokens`` slots.

        Paged allocation holds exactly what is used; a reserving allocator (``contiguous``) answers
        ``max_model_len``'s worth from the first token on, which is how it reserves at admission.
        """
        return -(-num_tokens // self.block_size)


class RefcountingAllocator(Allocator):
    """Reference-count bookkeeping shared by allocators; subclasses decide how free blocks are found and kept."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, config: AllocatorConfig | None = None):
        super().__init__(num_blocks, block_size, max_model_len, config)
        self._refcounts = [0] * num_blocks

    @abstractmethod
    def _take_free(self, n: int) -> list[int] | None:
        """Remove ``n`` blocks from the free set (or return None, changing nothing)."""

    @abstractmethod
    def _put_free(self, block: int) -> None:
        """Return a block whose count reached 0 to the free set."""

    def allocate(self, n: int) -> list[int] | None:
        blocks = self._take_free(n) if n <= self.num_free else None
        for block in blocks or ():
            self._refcounts[block] = 1
        return blocks

    def retain(self, blocks: list[int]) -> None:
        for block in blocks:
            self._check_held(block, "retain")
            self._refcounts[block] += 1

    def release(self, blocks: list[int]) -> None:
        for block in blocks:
            self._check_held(block, "release")
            self._refcounts[block] -= 1
            if self._refcounts[block] == 0:
                self._put_free(block)

    def refcount(self, block: int) -> int:
        return self._refcounts[block]

    def _check_held(self, block: int, action: str) -> None:
        if not 0 < block < self.num_blocks:
            raise BlockAllocationError(
                f"cannot {action} block {block}: not a block of this pool (1..{self.num_blocks - 1})"
            )
        if self._refcounts[block] == 0:
            raise BlockAllocationError(f"cannot {action} block {block}: it is free (double release?)")
