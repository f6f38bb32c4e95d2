"""``prefix_cache: radix``: SGLang's RadixAttention: a token radix tree whose nodes hold KV block ids."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from collections.abc import Sequence as TokenSequence
from dataclasses import dataclass, field
from typing import Any

from infer.allocator import Allocator
from infer.prefix_cache import Match, PrefixCache, PrefixCacheConfig


@dataclass(slots=True, eq=False)
class _Node:
    """An edge of whole blocks: ``tokens`` (a multiple of block_size long) stored in ``blocks``, one id per block.

    ``lock_ref`` counts the locked matches that end at this node or below it.
    """

    tokens: tuple[int, ...] = ()
    blocks: list[int] = field(default_factory=list)
    parent: _Node | None = None
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)  # keyed by the child's first block
    lock_ref: int = 0
    last_access: int = 0


class RadixPrefixCache(PrefixCache):
    """Finds the longest cached prefix of a prompt at block granularity, as SGLang's RadixCache does.

    Each namespace has its own root, so namespaces never share a node. A match or insert that ends inside an edge
    splits the node there, so a Match's handle is always the node where its prefix ends; with ``block_size: 1`` any
    prefix length is reused. ``lock`` adds one to ``lock_ref`` on the path from that node to the root.

    Eviction takes leaves only (a node's tokens are the prefix of its children's), least recently used first by the
    time of the last match or insert through them; a leaf whose blocks all go is removed, and its parent, once
    childless, becomes a leaf in turn. Only an unlocked leaf's trailing blocks that the cache alone holds
    (``allocator.refcount == 1``) are evicted, so ``evict`` can free exactly the number of blocks asked for.
    """

    def __init__(self, allocator: Allocator, block_size: int, config: PrefixCacheConfig | None = None):
        super().__init__(allocator, block_size, config)
        self._roots: dict[Any, _Node] = {}
        self._leaves: set[_Node] = set()  # kept as nodes change, so eviction needs no walk of the tree
        self._clock = itertools.count(1)
        self._num_cached_blocks = 0

    def match(self, tokens: TokenSequence[int], namespace: Any = None) -> Match:
        node, num_node_blocks, blocks = self._walk(self._roots.get(namespace, _Node()), self._matchable_key(tokens))
        if num_node_blocks < len(node.blocks):
            node = self._split(node, num_node_blocks)
        self._touch(node)
        num_tokens = len(blocks) * self.block_size
        self.stats.lookups += 1
        self.stats.lookup_tokens += len(tokens)
        self.stats.hit_tokens += num_tokens
        return Match(tuple(blocks), num_tokens, handle=node if blocks else None)

    def peek(self, tokens: TokenSequence[int], namespace: Any = None) -> int:
        _, _, blocks = self._walk(self._roots.get(namespace, _Node()), self._matchable_key(tokens))
        return len(blocks) * self.block_size

    def lock(self, match: Match) -> None:
        for node in self._path_to_root(match.handle):
            node.lock_ref += 1

    def unlock(self, match: Match) -> None:
        for node in self._path_to_root(match.handle):
            if node.lock_ref == 0:
                raise RuntimeError("prefix cache: unlock of a match that is not locked")
            node.lock_ref -= 1

    def insert(self, tokens: TokenSequence[int], blocks: TokenSequence[int], namespace: Any = None) -> int:
        num_blocks = min(len(tokens) // self.block_size, len(blocks))
        key = tuple(tokens[: num_blocks * self.block_size])
        node, num_node_blocks, matched = self._walk(self._roots.setdefault(namespace, _Node()), key)
        num_cached = len(matched)
        if num_cached < num_blocks:
            if num_node_blocks < len(node.blocks):
                node = self._split(node, num_node_blocks)
            node = self._add_leaf(node, key[num_cached * self.block_size :], list(blocks[num_cached:num_blocks]))
        self._touch(node)
        return num_cached * self.block_size

    def evict(self, num_blocks: int) -> int:
        if num_blocks <= 0:
            return 0
        planned = []
        freed = 0
        for leaf, count in self._eviction_order():
            planned.append((leaf, min(count, num_blocks - freed)))
            freed += planned[-1][1]
            if freed == num_blocks:
                break
        # Planned children come before their parents, so each parent is a leaf by the time it is trimmed.
        for leaf, count in planned:
            self._trim(leaf, count)
        return freed

    @property
    def num_evictable(self) -> int:
        return sum(count for _, count in self._eviction_order())

    def can_evict(self, num_blocks: int) -> bool:
        found = 0
        for _, count in self._eviction_order():
            found += count
            if found >= num_blocks:
                return True
        return num_blocks <= 0

    @property
    def num_cached_blocks(self) -> int:
        return self._num_cached_blocks

    # -- walking and reshaping the tree ---------------------------------------------------------------------------
    def _matchable_key(self, tokens: TokenSequence[int]) -> tuple[int, ...]:
        # At most len(tokens) - 1 tokens (the last prompt token is always computed, to get logits), in whole blocks.
        num_blocks = max(len(tokens) - 1, 0) // self.block_size
        return tuple(tokens[: num_blocks * self.block_size])

    def _walk(self, root: _Node, key: tuple[int, ...]) -> tuple[_Node, int, list[int]]:
        """The deepest cached prefix of ``key`` (whole blocks) below ``root``: the node it ends in, how many of that
        node's blocks it covers (fewer than all when it ends inside the edge), and the blocks along the way."""
        node = root
        offset = 0
        blocks: list[int] = []
        while offset < len(key):
            child = node.children.get(key[offset : offset + self.block_size])
            if child is None:
                break
            num_common = self._num_common_blocks(child.tokens, key, offset)
            blocks.extend(child.blocks[:num_common])
            offset += num_common * self.block_size
            node = child
            if num_common < len(child.blocks):
                return node, num_common, blocks
        return node, len(node.blocks), blocks

    def _num_common_blocks(self, edge: tuple[int, ...], key: tuple[int, ...], offset: int) -> int:
        length = min(len(edge), len(key) - offset)
        if edge[:length] == key[offset : offset + length]:
            return length // self.block_size
        first_difference = next(i for i in range(length) if edge[i] != key[offset + i])
        return first_difference // self.block_size

    def _split(self, node: _Node, num_blocks: int) -> _Node:
        """Cut ``node``'s edge after ``num_blocks`` blocks; returns the new node holding the first part."""
        cut = num_blocks * self.block_size
        head = _Node(
            node.tokens[:cut],
            node.blocks[:num_blocks],
            node.parent,
            lock_ref=node.lock_ref,
            last_access=node.last_access,
        )
        head.parent.children[head.tokens[: self.block_size]] = head
        node.tokens = node.tokens[cut:]
        node.blocks = node.blocks[num_blocks:]
        node.parent = head
        head.children[node.tokens[: self.block_size]] = node
        return head

    def _add_leaf(self, parent: _Node, tokens: tuple[int, ...], blocks: list[int]) -> _Node:
        self.allocator.retain(blocks)
        leaf = _Node(tokens, blocks, parent)
        parent.children[tokens[: self.block_size]] = leaf
        self._leaves.discard(parent)
        self._leaves.add(leaf)
        self._num_cached_blocks += len(blocks)
        self.stats.inserted_blocks += len(blocks)
        return leaf

    def _touch(self, node: _Node) -> None:
        now = next(self._clock)
        for ancestor in self._path_to_root(node):
            ancestor.last_access = now

    @staticmethod
    def _path_to_root(node: _Node | None) -> Iterator[_Node]:
        """``node`` and its ancestors, roots excluded (a root holds no blocks and is never evicted)."""
        while node is not None and node.parent is not None:
            yield node
            node = node.parent

    # -- eviction -------------------------------------------------------------------------------------------------
    def _eviction_order(self) -> Iterator[tuple[_Node, int]]:
        """``(leaf, trailing blocks evict would take)`` in eviction order, without changing anything.

        A leaf all of whose blocks go counts as removed, so its parent joins the candidates once every sibling is gone
        too: the same cascade ``evict`` performs.
        """
        candidates = [(leaf.last_access, id(leaf), leaf) for leaf in self._leaves if leaf.lock_ref == 0]
        heapq.heapify(candidates)
        children_left: dict[_Node, int] = {}
        while candidates:
            _, _, node = heapq.heappop(candidates)
            count = self._num_trailing_evictable(node)
            if count == 0:
                continue
            yield node, count
            parent = node.parent
            if count < len(node.blocks) or parent.parent is None:
                continue
            children_left[parent] = children_left.get(parent, len(parent.children)) - 1
            if children_left[parent] == 0 and parent.lock_ref == 0:
                heapq.heappush(candidates, (parent.last_access, id(parent), parent))

    def _num_trailing_evictable(self, node: _Node) -> int:
        """Trailing blocks of ``node`` that only the cache holds (a running sequence may hold the rest)."""
        count = 0
        for block in reversed(node.blocks):
            if self.allocator.refcount(block) != 1:
                break
            count += 1
        return count

    def _trim(self, leaf: _Node, num_blocks: int) -> None:
        """Release ``leaf``'s last ``num_blocks`` blocks, removing the leaf when none remain."""
        self.allocator.release(leaf.blocks[-num_blocks:])
        self._num_cached_blocks -= num_blocks
        self.stats.evicted_blocks += num_blocks
        if num_blocks < len(leaf.blocks):
            leaf.tokens = leaf.tokens[: -num_blocks * self.block_size]
            leaf.blocks = leaf.blocks[:-num_blocks]
            return
        parent = leaf.parent
        del parent.children[leaf.tokens[: self.block_size]]
        self._leaves.discard(leaf)
        if parent.parent is not None and not parent.children:
            self._leaves.add(parent)
