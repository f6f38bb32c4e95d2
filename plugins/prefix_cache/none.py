"""``prefix_cache: none``: keeps nothing, so every prompt is computed in full (the ablation baseline)."""

from __future__ import annotations

from collections.abc import Sequence as TokenSequence
from typing import Any

from infer.prefix_cache import Match, PrefixCache


class NoPrefixCache(PrefixCache):
    """Never holds a block. Lookups are still counted, so a run without caching reports a 0% hit rate."""

    def match(self, tokens: TokenSequence[int], namespace: Any = None) -> Match:
        self.stats.lookups += 1
        self.stats.lookup_tokens += len(tokens)
        return Match()

    def peek(self, tokens: TokenSequence[int], namespace: Any = None) -> int:
        return 0

    def lock(self, match: Match) -> None:
        """Nothing is cached, so nothing needs protecting."""

    def unlock(self, match: Match) -> None:
        """Nothing was locked."""

    def insert(self, tokens: TokenSequence[int], blocks: TokenSequence[int], namespace: Any = None) -> int:
        return 0

    def evict(self, num_blocks: int) -> int:
        return 0

    @property
    def num_evictable(self) -> int:
        return 0
