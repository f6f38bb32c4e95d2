"""The prefix-cache contract: which computed KV is kept after use, how a prompt finds it, what is evicted."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence as TokenSequence
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from infer.allocator import Allocator


class PrefixCacheConfig(BaseModel):
    """Config section ``prefix_cache``. Plugins subclass it to add their own keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = "none"


@dataclass(frozen=True, slots=True)
class Match:
    """Result of a lookup: the cached blocks covering the first ``num_tokens`` tokens.

    ``handle`` is the cache's own record of where the match ended (a radix node, the last hash); pass the Match back
    to ``lock``/``unlock`` unchanged.
    """

    blocks: tuple[int, ...] = ()
    num_tokens: int = 0
    handle: Any = None


@dataclass(slots=True)
class PrefixCacheStats:
    lookups: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    inserted_blocks: int = 0
    evicted_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0


class PrefixCache(ABC):
    """Keeps computed KV blocks after their sequences release them, and finds them again for new prompts.

    Reference protocol with the allocator: the cache takes its own reference (``allocator.retain``) on every block it
    keeps, and drops it (``allocator.release``) when it evicts the entry. An entry is evictable only when it is not
    locked and the cache holds the only reference (``allocator.refcount(block) == 1``). The engine:

    - on admission: ``m = match(prompt, ns)``, ``lock(m)``, ``allocator.retain(m.blocks)``, starts at ``m.num_tokens``;
    - after each step: ``insert(tokens, block_table, ns)`` with the sequence's committed, computed tokens (only whole
      blocks are kept; drafts never); inserting a prefix that is already cached is a no-op for those blocks;
    - on finish or preemption: ``insert`` once more, ``unlock(m)``, ``allocator.release(block_table)``;
    - when the allocator runs dry: ``evict(n)``.
    """

    config_model: ClassVar[type[PrefixCacheConfig]] = PrefixCacheConfig

    def __init__(self, allocator: Allocator, block_size: int, config: PrefixCacheConfig | None = None):
        self.allocator = allocator
        self.block_size = block_size
        self.config = config or self.config_model()
        self.stats = PrefixCacheStats()

    @abstractmethod
    def match(self, tokens: TokenSequence[int], namespace: Any = None) -> Match:
        """Longest cached prefix of ``tokens`` in ``namespace``, at block granularity.

        Never covers the last token (one token is always computed to get logits): at most ``len(tokens) - 1`` tokens,
        rounded down to whole blocks. Updates hit statistics and recency; takes no references.
        """

    def peek(self, tokens: TokenSequence[int], namespace: Any = None) -> int:
        """Length ``match`` would return, without touching statistics or recency (schedulers call it every step;
        the conformance suite checks both). This default calls ``match``, so it keeps that promise only for a cache
        whose ``match`` has no side effects: override it (the built-ins do)."""
        return self.match(tokens, namespace).num_tokens

    @abstractmethod
    def lock(self, match: Match) -> None:
        """Protect the matched entries from eviction until ``unlock``."""

    @abstractmethod
    def unlock(self, match: Match) -> None:
        """Undo one ``lock``."""

    @abstractmethod
    def insert(self, tokens: TokenSequence[int], blocks: TokenSequence[int], namespace: Any = None) -> int:
        """Offer the KV of ``tokens`` stored in ``blocks`` (``blocks[i]`` holds tokens ``[i*bs, (i+1)*bs)``).

        Only whole blocks are kept. Returns how many of the offered tokens were already cached.
        """

    @abstractmethod
    def evict(self, num_blocks: int) -> int:
        """Free up to ``num_blocks`` blocks (least recently used first, never a locked or shared entry).

        Returns the number of blocks actually returned to the allocator.
        """

    @property
    @abstractmethod
    def num_evictable(self) -> int:
        """Blocks ``evict`` could free right now."""

    def can_evict(self, num_blocks: int) -> bool:
        """Whether ``evict(num_blocks)`` would free them all: ``num_evictable >= num_blocks``, which a cache of
        many blocks should answer without counting them all (the engine asks before every allocation once the pool
        is full of cached blocks; counting a million-block cache each time made a long run quadratic)."""
        return self.num_evictable >= num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks the cache currently holds a reference on."""
        return 0
