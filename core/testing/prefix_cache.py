"""Conformance suite for prefix caches (contract: ``infer.prefix_cache.PrefixCache``).

The cache runs over a real allocator (the registered ``paged`` one by default), and every call is checked against a
plain-Python model of what it should hold: ``{(namespace, whole-block token prefix): block}``. What the cache keeps
is read from the allocator's reference counts, so a cache that keeps nothing (``none``) conforms too.

A plugin author's whole test file::

    from infer.testing import PrefixCacheConformance

    class TestMyCache(PrefixCacheConformance):
        impl_name = "mine"
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from infer.allocator import Allocator
from infer.prefix_cache import Match, PrefixCache
from infer.registry import get_registry
from infer.testing.suite import ConformanceSuite

AllocatorFactory = Callable[[], Allocator]
PrefixCacheFactory = Callable[[Allocator], PrefixCache]
Key = tuple[Any, tuple[int, ...]]
NAMESPACES = st.sampled_from([None, None, None, "tenant"])  # mostly one tenant, so that prompts find each other


@dataclass
class PrefixCacheModel:
    """What the cache holds: the block storing the last ``block_size`` tokens of each cached whole-block prefix."""

    block_size: int
    entries: dict[Key, int] = field(default_factory=dict)

    def key(self, namespace: Any, tokens: Sequence[int], block_index: int) -> Key:
        return namespace, tuple(tokens[: (block_index + 1) * self.block_size])

    def chain(self, namespace: Any, tokens: Sequence[int], num_blocks: int) -> list[int]:
        """Blocks of the longest cached prefix of ``tokens`` spanning at most ``num_blocks`` blocks."""
        blocks = []
        for index in range(num_blocks):
            block = self.entries.get(self.key(namespace, tokens, index))
            if block is None:
                break
            blocks.append(block)
        return blocks

    def expected_match(self, namespace: Any, tokens: Sequence[int]) -> list[int]:
        # The last token is never matched: it is always computed, to get the logits of the next one.
        return self.chain(namespace, tokens, (len(tokens) - 1) // self.block_size)

    @property
    def blocks(self) -> set[int]:
        return set(self.entries.values())

    def drop(self, blocks: set[int]) -> None:
        self.entries = {key: block for key, block in self.entries.items() if block not in blocks}


class PrefixCacheHarness:
    """A prefix cache over its allocator, with every call checked against the model.

    The harness is the caller the contract describes (the engine's KV cache manager): ``held`` counts the references
    it holds itself, so the cache's own references on a block are ``allocator.refcount(block) - held[block]``.
    """

    def __init__(self, allocator: Allocator, cache: PrefixCache):
        self.allocator = allocator
        self.cache = cache
        self.block_size = cache.block_size
        self.model = PrefixCacheModel(self.block_size)
        self.held: Counter[int] = Counter()
        self.locked: list[Match] = []

    # -- the caller's side of the protocol ---------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[int] | None:
        """Fresh blocks, evicting cached ones first when the allocator runs dry (as the KV cache manager does)."""
        shortfall = num_blocks - self.allocator.num_free
        if shortfall > 0:
            if not self.cache.can_evict(shortfall):
                return None
            self.checked_evict(shortfall)
        blocks = self.allocator.allocate(num_blocks)
        self.held.update(blocks or ())
        return blocks

    def retain(self, blocks: Sequence[int]) -> None:
        self.allocator.retain(list(blocks))
        self.held.update(blocks)

    def release(self, blocks: Sequence[int]) -> None:
        self.allocator.release(list(blocks))
        self.held.subtract(blocks)

    def serve(self, tokens: list[int], namespace: Any = None) -> bool:
        """One request's life: match, lock, take the hit, allocate the rest, insert, unlock, release.

        Returns False, holding nothing, when even eviction cannot make room for the request.
        """
        match = self.checked_match(tokens, namespace)
        self.cache.lock(match)
        self.retain(match.blocks)
        fresh = self.allocate(-(-len(tokens) // self.block_size) - len(match.blocks))
        if fresh is not None:
            self.checked_insert(tokens, list(match.blocks) + fresh, namespace)
        self.cache.unlock(match)
        self.release([*match.blocks, *(fresh or ())][::-1])
        return fresh is not None

    def lock(self, tokens: list[int], namespace: Any = None) -> Match:
        match = self.checked_match(tokens, namespace)
        self.cache.lock(match)
        self.locked.append(match)
        return match

    def unlock(self, match: Match) -> None:
        self.locked.remove(match)
        self.cache.unlock(match)

    # -- checked calls -----------------------------------------------------------------------------------------
    def cache_references(self, block: int) -> int:
        return self.allocator.refcount(block) - self.held[block]

    def all_cache_references(self) -> dict[int, int]:
        return {block: self.cache_references(block) for block in range(1, self.allocator.num_blocks)}

    def checked_match(self, tokens: list[int], namespace: Any = None) -> Match:
        peeked = self.cache.peek(tokens, namespace)
        match = self.cache.match(tokens, namespace)
        expected = self.model.expected_match(namespace, tokens)
        assert match.num_tokens < len(tokens), f"match covers all {len(tokens)} tokens; the last is never matched"
        assert match.num_tokens == len(match.blocks) * self.block_size, (
            f"match of {match.num_tokens} tokens with {len(match.blocks)} blocks of {self.block_size}"
        )
        assert len(match.blocks) <= len(expected), (
            f"match found {len(match.blocks)} blocks {list(match.blocks)}, but only {len(expected)} {expected} "
            "of this prefix were inserted and not evicted"
        )
        assert list(match.blocks) == expected, f"match returned blocks {list(match.blocks)}, cached are {expected}"
        assert peeked == match.num_tokens, f"peek said {peeked} tokens, match found {match.num_tokens}"
        return match

    def checked_insert(self, tokens: list[int], blocks: list[int], namespace: Any = None) -> int:
        num_full_blocks = len(tokens) // self.block_size
        already_cached = len(self.model.chain(namespace, tokens, num_full_blocks)) * self.block_size
        before = self.all_cache_references()
        returned = self.cache.insert(tokens, blocks, namespace)
        taken = self.references_taken(before, blocks[:num_full_blocks])
        for index, block in enumerate(blocks[:num_full_blocks]):
            key = self.model.key(namespace, tokens, index)
            if key in self.model.entries:
                assert block not in taken, f"insert took a reference on block {block}: a duplicate of a cached one"
            elif block in taken:
                self.model.entries[key] = block
        assert already_cached <= returned <= num_full_blocks * self.block_size, (
            f"insert returned {returned} already-cached tokens; {already_cached} of the offered "
            f"{num_full_blocks * self.block_size} whole-block tokens were"
        )
        return returned

    def references_taken(self, before: dict[int, int], offered: list[int]) -> set[int]:
        taken = set()
        for block, count in self.all_cache_references().items():
            change = count - before[block]
            assert change in (0, 1), f"insert changed the cache's references on block {block} by {change}"
            assert change == 0 or block in offered, (
                f"insert took a reference on block {block}, which is not a whole block it was offered"
            )
            if change:
                taken.add(block)
        return taken

    def checked_evict(self, num_blocks: int) -> int:
        evictable = self.cache.num_evictable
        protected = self.protected_blocks()
        free_before = self.allocator.num_free
        freed = self.cache.evict(num_blocks)
        dropped = {block for block in self.model.blocks if self.cache_references(block) == 0}
        assert not dropped & protected, f"evict dropped locked or shared blocks {sorted(dropped & protected)}"
        assert self.allocator.num_free - free_before == freed, (
            f"evict returned {freed}, but {self.allocator.num_free - free_before} blocks went back to the allocator"
        )
        assert freed <= num_blocks, f"evict({num_blocks}) freed {freed} blocks"
        assert freed >= min(num_blocks, evictable), f"evict({num_blocks}) freed {freed} of {evictable} evictable"
        self.model.drop(dropped)
        return freed

    def protected_blocks(self) -> set[int]:
        """Cached blocks ``evict`` must not touch: locked, or referenced by the caller too."""
        locked = {block for match in self.locked for block in match.blocks}
        return (locked | {block for block, count in self.held.items() if count > 0}) & self.model.blocks

    def check_references(self) -> None:
        """The cache holds exactly one reference on each block of the model, and none on any other block."""
        cached = self.model.blocks
        for block, count in self.all_cache_references().items():
            expected = 1 if block in cached else 0
            assert count == expected, f"the cache holds {count} references on block {block}, expected {expected}"
        assert self.cache.num_cached_blocks == len(cached), (
            f"num_cached_blocks is {self.cache.num_cached_blocks}, the cache holds references on {len(cached)}"
        )
        protected = self.protected_blocks()
        unprotected = len(cached - protected)
        assert self.cache.num_evictable <= unprotected, (
            f"num_evictable is {self.cache.num_evictable}, but only {unprotected} cached blocks are neither locked "
            "nor shared"
        )
        evictable = self.cache.num_evictable
        assert self.cache.can_evict(evictable) and not self.cache.can_evict(evictable + 1), (
            f"can_evict disagrees with num_evictable={evictable}: can_evict({evictable}) is "
            f"{self.cache.can_evict(evictable)}, can_evict({evictable + 1}) is {self.cache.can_evict(evictable + 1)}"
        )
        # A cache may protect more than the matched blocks (a whole tree node, say), but only while something is.
        assert protected or self.cache.num_evictable == len(cached), (
            f"num_evictable is {self.cache.num_evictable} with nothing locked or shared; the cache holds {len(cached)}"
        )


class PrefixCacheStateMachine(RuleBasedStateMachine):
    """Requests served, prefixes locked, shared and evicted in random order, with shared prefixes and two tenants."""

    make_allocator: ClassVar[AllocatorFactory]
    make_cache: ClassVar[PrefixCacheFactory]
    max_prompt_tokens: ClassVar[int] = 24

    @classmethod
    def bind(cls, allocator_factory: AllocatorFactory, cache_factory: PrefixCacheFactory) -> type:
        return type(
            cls.__name__,
            (cls,),
            {
                "make_allocator": staticmethod(allocator_factory),
                "make_cache": staticmethod(cache_factory),
            },
        )

    def __init__(self):
        super().__init__()
        allocator = self.make_allocator()
        self.harness = PrefixCacheHarness(allocator, self.make_cache(allocator))
        self.prompts: list[list[int]] = []
        self.shared: list[Match] = []

    def compose(self, base: int, cut: int, extension: list[int]) -> list[int]:
        """A prompt that shares ``cut`` leading tokens with an earlier one, so that prefixes collide."""
        prefix = self.prompts[base % len(self.prompts)][:cut] if self.prompts else []
        return ((prefix + extension) or [0])[: self.max_prompt_tokens]

    @rule(
        base=st.integers(0, 50),
        cut=st.integers(0, 24),
        extension=st.lists(st.integers(0, 2), max_size=12),
        namespace=NAMESPACES,
    )
    def serve(self, base: int, cut: int, extension: list[int], namespace: str | None) -> None:
        tokens = self.compose(base, cut, extension)
        if self.harness.serve(tokens, namespace):
            self.prompts.append(tokens)

    @precondition(lambda self: self.prompts and len(self.harness.locked) < 3)
    @rule(base=st.integers(0, 50), cut=st.integers(1, 24), namespace=NAMESPACES)
    def lock(self, base: int, cut: int, namespace: str | None) -> None:
        self.harness.lock(self.compose(base, cut, []), namespace)

    @precondition(lambda self: self.harness.locked)
    @rule(index=st.integers(0, 2))
    def unlock(self, index: int) -> None:
        self.harness.unlock(self.harness.locked[index % len(self.harness.locked)])

    @precondition(lambda self: self.prompts and len(self.shared) < 2)
    @rule(base=st.integers(0, 50), cut=st.integers(1, 24))
    def share(self, base: int, cut: int) -> None:
        """Reference cached blocks without a lock, as an n > 1 follower sharing its leader's prompt does."""
        match = self.harness.checked_match(self.compose(base, cut, []))
        self.harness.retain(match.blocks)
        self.shared.append(match)

    @precondition(lambda self: self.shared)
    @rule()
    def unshare(self) -> None:
        self.harness.release(self.shared.pop().blocks)

    @precondition(lambda self: self.harness.model.entries)
    @rule(num_blocks=st.integers(0, 8))
    def evict(self, num_blocks: int) -> None:
        self.harness.checked_evict(num_blocks)

    @precondition(lambda self: self.harness.model.entries)
    @rule()
    def drain(self) -> None:
        """Unlocked and unshared, every cached block can be evicted and the whole pool is free again."""
        for match in list(self.harness.locked):
            self.harness.unlock(match)
        while self.shared:
            self.unshare()
        self.harness.checked_evict(len(self.harness.model.blocks))
        allocator = self.harness.allocator
        assert allocator.num_free == allocator.capacity, f"{allocator.capacity - allocator.num_free} blocks leaked"

    @invariant()
    def references_match_the_model(self) -> None:
        self.harness.check_references()


class PrefixCacheConformance(ConformanceSuite):
    """The prefix-cache contract, over a pool of ``num_blocks`` blocks of ``block_size`` tokens."""

    kind = "prefix_cache"
    allocator_name: ClassVar[str] = "paged"
    num_blocks: ClassVar[int] = 20
    block_size: ClassVar[int] = 4
    max_model_len: ClassVar[int] = 64

    @pytest.fixture
    def prefix_cache_factory(self) -> PrefixCacheFactory:
        """Makes a fresh cache over a given allocator. Override to construct yours directly."""
        return self.make_prefix_cache_factory(self.impl_name)

    @pytest.fixture
    def allocator_factory(self) -> AllocatorFactory:
        """The allocator under the cache: the registered ``allocator_name`` (default ``paged``)."""
        allocator_class = get_registry().load("allocator", self.allocator_name)
        return lambda: allocator_class(self.num_blocks, self.block_size, self.max_model_len)

    @pytest.fixture
    def harness(self, allocator_factory, prefix_cache_factory) -> PrefixCacheHarness:
        allocator = allocator_factory()
        return PrefixCacheHarness(allocator, prefix_cache_factory(allocator))

    def make_prefix_cache_factory(self, name: str | None) -> PrefixCacheFactory:
        implementation = self.load_implementation(name)
        config = self.implementation_config(name)
        return lambda allocator: implementation(allocator, allocator.block_size, config)

    def test_state_machine(self, allocator_factory, prefix_cache_factory):
        machine = PrefixCacheStateMachine.bind(allocator_factory, prefix_cache_factory)
        run_state_machine_as_test(machine, settings=self.hypothesis_settings)

    @pytest.mark.parametrize(("block_size", "num_blocks"), [(1, 37), (16, 13)])
    def test_state_machine_over_other_geometries(self, prefix_cache_factory, block_size, num_blocks):
        """The same random protocol on one-token blocks and on blocks longer than most prompts, over pools whose
        sizes are not powers of two (the registered ``allocator_name`` underneath)."""
        allocator_class = get_registry().load("allocator", self.allocator_name)
        machine = PrefixCacheStateMachine.bind(
            lambda: allocator_class(num_blocks, block_size, self.max_model_len), prefix_cache_factory
        )
        run_state_machine_as_test(machine, settings=self.hypothesis_settings)

    def test_empty_cache_matches_nothing(self, harness):
        match = harness.checked_match(list(range(3 * self.block_size)))
        assert (match.blocks, match.num_tokens) == ((), 0)
        harness.check_references()

    def test_insert_then_match_returns_the_same_blocks(self, harness):
        tokens = list(range(3 * self.block_size + 1))
        blocks = harness.allocate(4)
        harness.checked_insert(tokens, blocks, "tenant")
        harness.release(blocks)
        match = harness.checked_match(tokens, "tenant")
        if harness.model.blocks:
            assert list(match.blocks) == blocks[:3]
        harness.check_references()

    def test_match_never_covers_the_last_token(self, harness):
        tokens = list(range(2 * self.block_size))
        harness.serve(tokens)
        match = harness.checked_match(tokens)
        assert match.num_tokens <= self.block_size

    def test_partial_block_is_never_cached(self, harness):
        tokens = list(range(self.block_size + self.block_size // 2))
        harness.serve(tokens)
        assert len(harness.model.blocks) <= 1
        harness.check_references()

    def test_reinserting_a_cached_prefix_keeps_the_first_blocks(self, harness):
        tokens = list(range(2 * self.block_size))
        harness.serve(tokens)
        duplicates = harness.allocate(2)
        returned = harness.checked_insert(tokens, duplicates, None)
        harness.release(duplicates)
        if harness.model.blocks:
            assert returned == len(tokens)
        harness.check_references()

    def test_namespaces_do_not_share_entries(self, harness):
        tokens = list(range(3 * self.block_size))
        harness.serve(tokens, "tenant-a")
        assert harness.checked_match(tokens, "tenant-b").num_tokens == 0

    def test_evict_never_touches_a_locked_entry(self, harness):
        locked_tokens = list(range(3 * self.block_size))
        other_tokens = list(range(100, 100 + 3 * self.block_size))
        harness.serve(locked_tokens)
        harness.serve(other_tokens)
        locked = harness.lock(locked_tokens)
        harness.checked_evict(self.num_blocks)
        assert harness.checked_match(locked_tokens).blocks == locked.blocks
        harness.unlock(locked)
        harness.checked_evict(self.num_blocks)
        assert harness.allocator.num_free == harness.allocator.capacity

    def test_peek_touches_neither_statistics_nor_recency(self, harness):
        """``peek``'s promise (schedulers call it every step): the same length as ``match``, no stats, no recency."""
        old_tokens, new_tokens = list(range(2 * self.block_size + 1)), list(range(100, 100 + 2 * self.block_size + 1))
        harness.serve(old_tokens)
        harness.serve(new_tokens)
        stats = dataclasses.replace(harness.cache.stats)
        length = harness.cache.peek(old_tokens)
        assert harness.cache.stats == stats
        assert length == len(harness.model.expected_match(None, old_tokens)) * self.block_size
        if harness.model.blocks:  # peeking at the older prefix did not make it the more recently used
            harness.checked_evict(2)
            assert harness.cache.peek(old_tokens) == 0 and harness.cache.peek(new_tokens) > 0
        harness.check_references()

    def test_evicts_the_least_recently_used_first(self, harness):
        """``evict``'s promise: least recently used first (here the prefix matched longest ago)."""
        prefixes = [list(range(start, start + 2 * self.block_size + 1)) for start in (0, 100, 200)]
        for tokens in prefixes:
            harness.serve(tokens)
        harness.checked_match(prefixes[0])  # now the most recently used
        if not harness.model.blocks:
            return
        harness.checked_evict(2)
        assert harness.cache.peek(prefixes[1]) == 0  # the least recently used went first
        assert harness.cache.peek(prefixes[0]) > 0 and harness.cache.peek(prefixes[2]) > 0
        harness.check_references()

    def test_evict_returns_what_it_gave_back_to_the_allocator(self, harness):
        for start in (0, 100, 200):
            harness.serve(list(range(start, start + 2 * self.block_size + 1)))
        for num_blocks in (1, 2, self.num_blocks):
            harness.checked_evict(num_blocks)
        harness.check_references()
