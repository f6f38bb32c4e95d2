"""``prefix_cache: hash``: vLLM's automatic prefix caching: one entry per full block, keyed by a chained hash."""

from __future__ import annotations

import hashlib
import itertools
import struct
from collections import OrderedDict
from collections.abc import Iterator
from collections.abc import Sequence as TokenSequence
from dataclasses import dataclass
from typing import Any

from infer.allocator import Allocator
from infer.prefix_cache import Match, PrefixCache, PrefixCacheConfig


@dataclass(slots=True)
class _Entry:
    """One cached block. ``parent`` is the previous block's hash (None for block 0)."""

    block: int
    parent: bytes | None
    num_children: int = 0
    num_locks: int = 0


class HashPrefixCache(PrefixCache):
    """Caches full blocks by a hash of everything before and in them, as vLLM does.

    Block ``i``'s key is ``sha256(key(i-1) + tokens of block i)``; block 0 chains from a seed derived from the
    namespace, so one namespace never sees another's blocks. A key therefore names a whole prefix, and a lookup walks
    from block 0 and stops at the first miss.

    Hash choice: SHA-256 over the tokens packed as little-endian int64, the namespace encoded by its ``repr`` (so it
    should be a str, int, tuple of those, or None). It is deterministic across processes, and being cryptographic, no
    tenant can craft a collision to read another's KV (vLLM's GHSA-rm76-4mrf-v9r8 is the non-cryptographic failure).
    Equal keys are taken as equal prefixes without comparing tokens: an accidental collision is about 2**-128 likely.

    Entries form a tree (every entry's parent is cached: only leaves are evicted), so a match never returns a chain
    with a hole. Eviction takes unlocked entries whose block only the cache holds, least recently used first; every
    match and insert refreshes a chain tail first, head last, so a parent is always more recent than its children and
    tails go before the prefixes they extend.
    """

    def __init__(self, allocator: Allocator, block_size: int, config: PrefixCacheConfig | None = None):
        super().__init__(allocator, block_size, config)
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._pack_block = struct.Struct(f"<{block_size}q").pack

    def match(self, tokens: TokenSequence[int], namespace: Any = None) -> Match:
        keys = self._matched_keys(tokens, namespace)
        self._refresh(keys)
        num_tokens = len(keys) * self.block_size
        self.stats.lookups += 1
        self.stats.lookup_tokens += len(tokens)
        self.stats.hit_tokens += num_tokens
        blocks = tuple(self._entries[key].block for key in keys)
        return Match(blocks, num_tokens, handle=tuple(keys))

    def peek(self, tokens: TokenSequence[int], namespace: Any = None) -> int:
        return len(self._matched_keys(tokens, namespace)) * self.block_size

    def lock(self, match: Match) -> None:
        for key in match.handle or ():
            self._entries[key].num_locks += 1

    def unlock(self, match: Match) -> None:
        for key in match.handle or ():
            entry = self._entries[key]
            if entry.num_locks == 0:
                raise RuntimeError("prefix cache: unlock of a match that is not locked")
            entry.num_locks -= 1

    def insert(self, tokens: TokenSequence[int], blocks: TokenSequence[int], namespace: Any = None) -> int:
        num_blocks = min(len(tokens) // self.block_size, len(blocks))
        keys = list(self._chain(tokens, namespace, num_blocks))
        new_blocks = []
        parent = None
        for key, block in zip(keys, blocks):
            if key not in self._entries:
                self._add(key, block, parent)
                new_blocks.append(block)
            parent = key
        self.allocator.retain(new_blocks)
        self._refresh(keys)
        self.stats.inserted_blocks += len(new_blocks)
        # Every entry's parent is cached, so the blocks already present are exactly a prefix of the chain.
        return (num_blocks - len(new_blocks)) * self.block_size

    def evict(self, num_blocks: int) -> int:
        victims = list(itertools.islice(self._eviction_order(), max(num_blocks, 0)))
        self.allocator.release([self._remove(key) for key in victims])
        self.stats.evicted_blocks += len(victims)
        return len(victims)

    @property
    def num_evictable(self) -> int:
        return sum(1 for _ in self._eviction_order())

    def can_evict(self, num_blocks: int) -> bool:
        return sum(1 for _ in itertools.islice(self._eviction_order(), max(num_blocks, 0))) >= num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._entries)

    def _chain(self, tokens: TokenSequence[int], namespace: Any, num_blocks: int) -> Iterator[bytes]:
        """Keys of the first ``num_blocks`` blocks of ``tokens``, computed lazily (a lookup stops at its first miss)."""
        key = hashlib.sha256(repr(namespace).encode()).digest()
        for start in range(0, num_blocks * self.block_size, self.block_size):
            key = hashlib.sha256(key + self._pack_block(*tokens[start : start + self.block_size])).digest()
            yield key

    def _matched_keys(self, tokens: TokenSequence[int], namespace: Any) -> list[bytes]:
        # At most len(tokens) - 1 tokens: the last prompt token is always computed, to get logits.
        num_blocks = max(len(tokens) - 1, 0) // self.block_size
        return list(itertools.takewhile(self._entries.__contains__, self._chain(tokens, namespace, num_blocks)))

    def _refresh(self, keys: list[bytes]) -> None:
        for key in reversed(keys):
            self._entries.move_to_end(key)

    def _add(self, key: bytes, block: int, parent: bytes | None) -> None:
        self._entries[key] = _Entry(block, parent)
        if parent is not None:
            self._entries[parent].num_children += 1

    def _remove(self, key: bytes) -> int:
        """Drop an entry (its children must be gone already); returns its block, for the caller to release."""
        entry = self._entries.pop(key)
        if entry.parent is not None:
            self._entries[entry.parent].num_children -= 1
        return entry.block

    def _eviction_order(self) -> Iterator[bytes]:
        """Keys ``evict`` would take, in order, without changing anything.

        One pass from the least recently used end suffices: children are older than their parents, so by the time a
        parent comes up, every child that can go has been counted out.
        """
        children_left: dict[bytes, int] = {}
        for key, entry in self._entries.items():
            if entry.num_locks or children_left.get(key, entry.num_children):
                continue
            if self.allocator.refcount(entry.block) != 1:
                continue
            yield key
            if entry.parent is not None:
                parent_children = children_left.get(entry.parent, self._entries[entry.parent].num_children)
                children_left[entry.parent] = parent_children - 1
