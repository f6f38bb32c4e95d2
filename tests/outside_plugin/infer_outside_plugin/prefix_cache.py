"""``prefix_cache: outside-prefix``: whole blocks keyed by their namespace and every token up to their end."""

from __future__ import annotations

from collections.abc import Sequence as TokenSequence
from dataclasses import dataclass
from typing import Any

from infer.allocator import Allocator
from infer.prefix_cache import Match, PrefixCache, PrefixCacheConfig

Key = tuple[Any, tuple[int, ...]]


@dataclass
class _Entry:
    """One cached block; ``parent`` is the key of the block before it (None for a prompt's first block)."""

    block: int
    parent: Key | None
    num_children: int = 0
    num_locks: int = 0
    last_used: int = 0


class TokenPrefixCache(PrefixCache):
    """Block ``i`` of a prompt is cached under ``(namespace, tokens[:(i + 1) * block_size])``. Entries form a tree
    (a block's parent is always cached), and only leaves are evicted: the unlocked ones whose block only the cache
    holds, least recently used first."""

    def __init__(self, allocator: Allocator, block_size: int, config: PrefixCacheConfig | None = None):
        super().__init__(allocator, block_size, config)
        self._entries: dict[Key, _Entry] = {}
        self._clock = 0

    def match(self, tokens: TokenSequence[int], namespace: Any = None) -> Match:
        keys = self._matched_keys(tokens, namespace)
        self._touch(keys)
        num_tokens = len(keys) * self.block_size
        self.stats.lookups += 1
        self.stats.lookup_tokens += len(tokens)
        self.stats.hit_tokens += num_tokens
        return Match(tuple(self._entries[key].block for key in keys), num_tokens, handle=tuple(keys))

    def peek(self, tokens: TokenSequence[int], namespace: Any = None) -> int:
        return len(self._matched_keys(tokens, namespace)) * self.block_size

    def lock(self, match: Match) -> None:
        for key in match.handle or ():
            self._entries[key].num_locks += 1

    def unlock(self, match: Match) -> None:
        for key in match.handle or ():
            self._entries[key].num_locks -= 1

    def insert(self, tokens: TokenSequence[int], blocks: TokenSequence[int], namespace: Any = None) -> int:
        num_blocks = min(len(tokens) // self.block_size, len(blocks))
        keys = self._keys(tokens, namespace, num_blocks)
        already_cached, parent = 0, None
        for key, block in zip(keys, blocks):
            if key in self._entries:
                already_cached += self.block_size
            else:
                self.allocator.retain([block])
                self._entries[key] = _Entry(block, parent)
                if parent is not None:
                    self._entries[parent].num_children += 1
                self.stats.inserted_blocks += 1
            parent = key
        self._touch(keys)
        return already_cached

    def evict(self, num_blocks: int) -> int:
        freed = 0
        while freed < num_blocks:
            leaves = [key for key, entry in self._entries.items() if not entry.num_children and self._free_to_go(entry)]
            if not leaves:
                break
            key = min(leaves, key=lambda leaf: self._entries[leaf].last_used)
            entry = self._entries.pop(key)
            if entry.parent is not None:
                self._entries[entry.parent].num_children -= 1
            self.allocator.release([entry.block])
            freed += 1
        self.stats.evicted_blocks += freed
        return freed

    @property
    def num_evictable(self) -> int:
        # An entry can go once all its children have: count those whose whole subtree is free to go, children first.
        blocked: set[Key] = set()
        count = 0
        for key in sorted(self._entries, key=lambda key: len(key[1]), reverse=True):
            entry = self._entries[key]
            if key in blocked or not self._free_to_go(entry):
                if entry.parent is not None:
                    blocked.add(entry.parent)
            else:
                count += 1
        return count

    @property
    def num_cached_blocks(self) -> int:
        return len(self._entries)

    def _free_to_go(self, entry: _Entry) -> bool:
        return not entry.num_locks and self.allocator.refcount(entry.block) == 1

    def _keys(self, tokens: TokenSequence[int], namespace: Any, num_blocks: int) -> list[Key]:
        return [(namespace, tuple(tokens[: (index + 1) * self.block_size])) for index in range(num_blocks)]

    def _matched_keys(self, tokens: TokenSequence[int], namespace: Any) -> list[Key]:
        # The last token is never matched: it is always computed, to get the logits of the next one.
        keys = []
        for key in self._keys(tokens, namespace, max(len(tokens) - 1, 0) // self.block_size):
            if key not in self._entries:
                break
            keys.append(key)
        return keys

    def _touch(self, keys: list[Key]) -> None:
        self._clock += 1
        for key in keys:
            self._entries[key].last_used = self._clock
