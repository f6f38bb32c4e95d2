"""The prefix caches (none, hash, radix) over a real paged allocator: hits, splits, namespaces, eviction, references."""

from __future__ import annotations

import importlib
import random
from importlib import resources

import pytest
import yaml

from infer.plugins.allocators.paged import PagedAllocator
from infer.plugins.prefix_cache.hash import HashPrefixCache
from infer.plugins.prefix_cache.none import NoPrefixCache
from infer.plugins.prefix_cache.radix import RadixPrefixCache
from infer.registry import Registry

CACHES = [HashPrefixCache, RadixPrefixCache]


def make_cache(cache_class, block_size=4, num_blocks=64):
    allocator = PagedAllocator(num_blocks, block_size, max_model_len=1024)
    return cache_class(allocator, block_size)


def compute(cache, tokens, namespace=None):
    """What a sequence does: reuse the cached prefix, compute the rest into fresh blocks, offer its full blocks.

    Returns the sequence's block table (one reference per block held by the sequence)."""
    match = cache.match(tokens, namespace)
    cache.allocator.retain(list(match.blocks))
    num_full_blocks = len(tokens) // cache.block_size
    blocks = list(match.blocks) + cache.allocator.allocate(num_full_blocks - len(match.blocks))
    cache.insert(tokens, blocks, namespace)
    return blocks


def compute_and_finish(cache, tokens, namespace=None):
    """A sequence that computes ``tokens`` and finishes: afterwards only the cache holds its blocks."""
    blocks = compute(cache, tokens, namespace)
    cache.allocator.release(blocks[::-1])
    return blocks


def num_held(allocator):
    return sum(1 for block in range(1, allocator.num_blocks) if allocator.refcount(block) > 0)


# -- hits ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cache_class", CACHES)
def test_insert_then_match_returns_the_same_blocks(cache_class):
    cache = make_cache(cache_class)
    tokens = list(range(100, 113))  # 3 full blocks of 4, and one token more
    blocks = compute_and_finish(cache, tokens)
    match = cache.match(tokens)
    assert match.blocks == tuple(blocks)
    assert match.num_tokens == 12


@pytest.mark.parametrize("cache_class", CACHES)
def test_match_never_covers_the_last_token(cache_class):
    cache = make_cache(cache_class)
    tokens = list(range(12))
    blocks = compute_and_finish(cache, tokens)
    assert cache.match(tokens).blocks == tuple(blocks[:2])  # the third block would include the last token
    assert cache.match(tokens + [99]).num_tokens == 12
    assert cache.match(tokens[:1]).num_tokens == 0
    assert cache.match([]).num_tokens == 0


def test_radix_with_block_size_1_reuses_all_37_shared_tokens():
    cache = make_cache(RadixPrefixCache, block_size=1, num_blocks=128)
    shared = list(range(1000, 1037))
    first = compute_and_finish(cache, shared + [1, 2, 3, 4, 5])
    match = cache.match(shared + [7, 8, 9])
    assert match.num_tokens == 37
    assert match.blocks == tuple(first[:37])


def test_hash_with_block_size_16_reuses_the_32_shared_tokens_in_whole_blocks():
    cache = make_cache(HashPrefixCache, block_size=16, num_blocks=16)
    shared = list(range(1000, 1037))
    first = compute_and_finish(cache, shared + [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])  # 48 tokens: 3 blocks
    match = cache.match(shared + [7, 8, 9])
    assert match.num_tokens == 32
    assert match.blocks == tuple(first[:2])


def test_radix_match_ending_inside_an_edge_splits_the_node():
    cache = make_cache(RadixPrefixCache)
    tokens = list(range(16))
    blocks = compute_and_finish(cache, tokens + [99])  # one edge of 4 blocks
    diverging = tokens[:8] + [50, 51, 52, 53, 54]
    match = cache.match(diverging)
    assert match.blocks == tuple(blocks[:2])
    cache.lock(match)
    # Had the match locked the whole edge, nothing could go; after the split, the unlocked tail node is a leaf.
    assert cache.num_evictable == 2
    assert cache.evict(4) == 2
    assert cache.match(tokens + [99]).blocks == tuple(blocks[:2])
    cache.unlock(match)
    assert cache.evict(4) == 2
    assert cache.num_cached_blocks == 0


def test_radix_insert_diverging_inside_an_edge_shares_the_common_blocks():
    cache = make_cache(RadixPrefixCache)
    first = compute_and_finish(cache, list(range(16)))
    other_tokens = list(range(8)) + [70, 71, 72, 73, 74, 75, 76, 77]
    other = compute_and_finish(cache, other_tokens)
    assert other[:2] == first[:2]
    assert cache.match(list(range(16)) + [0]).blocks == tuple(first)
    assert cache.match(other_tokens + [0]).blocks == tuple(first[:2] + other[2:])
    assert cache.num_cached_blocks == 6


def test_radix_trims_a_leaf_down_to_the_blocks_still_in_use():
    cache = make_cache(RadixPrefixCache)
    head = compute_and_finish(cache, list(range(4)))
    tokens = list(range(16))
    blocks = compute_and_finish(cache, tokens)  # a leaf of 3 blocks under the 1-block head
    cache.allocator.retain(blocks[1:2])  # an n > 1 follower shares the leaf's first block without a match
    assert cache.num_evictable == 2
    assert cache.evict(10) == 2
    assert cache.match(tokens + [0]).blocks == (head[0], blocks[1])
    cache.allocator.release(blocks[1:2])
    assert cache.evict(10) == 2


@pytest.mark.parametrize("cache_class", CACHES)
def test_namespaces_are_isolated(cache_class):
    cache = make_cache(cache_class)
    tokens = list(range(9))
    tenant_a = compute_and_finish(cache, tokens, namespace="tenant-a")
    assert cache.match(tokens, "tenant-b").num_tokens == 0
    assert cache.match(tokens).num_tokens == 0
    tenant_b = compute_and_finish(cache, tokens, namespace="tenant-b")
    assert set(tenant_a).isdisjoint(tenant_b)
    assert cache.match(tokens, "tenant-a").blocks == tuple(tenant_a)
    assert cache.match(tokens, "tenant-b").blocks == tuple(tenant_b)


@pytest.mark.parametrize("cache_class", CACHES)
def test_inserting_a_cached_prefix_keeps_the_existing_blocks(cache_class):
    cache = make_cache(cache_class)
    tokens = list(range(12))
    kept = compute_and_finish(cache, tokens[:8])
    duplicate = cache.allocator.allocate(3)  # a sequence that computed the same prefix without a hit
    assert cache.insert(tokens, duplicate) == 8
    assert cache.match(tokens + [0]).blocks == (kept[0], kept[1], duplicate[2])
    assert [cache.allocator.refcount(block) for block in duplicate] == [1, 1, 2]
    assert cache.insert(tokens, duplicate) == 12
    assert cache.num_cached_blocks == 3


# -- statistics ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cache_class", CACHES)
def test_stats_count_lookups_hits_inserts_and_evictions(cache_class):
    cache = make_cache(cache_class)
    compute_and_finish(cache, list(range(8)))  # one lookup of 8 tokens, no hit, 2 blocks inserted
    cache.match(list(range(9)))
    cache.evict(1)
    stats = cache.stats
    assert (stats.lookups, stats.lookup_tokens, stats.hit_tokens) == (2, 17, 8)
    assert (stats.inserted_blocks, stats.evicted_blocks) == (2, 1)
    assert stats.hit_rate == pytest.approx(8 / 17)


@pytest.mark.parametrize("cache_class", CACHES)
def test_peek_changes_neither_statistics_nor_recency(cache_class):
    cache = make_cache(cache_class)
    older, newer = list(range(8)), list(range(50, 58))
    older_blocks = compute_and_finish(cache, older)
    compute_and_finish(cache, newer)
    before = (cache.stats.lookups, cache.stats.lookup_tokens, cache.stats.hit_tokens)
    assert cache.peek(older + [0]) == 8
    assert (cache.stats.lookups, cache.stats.lookup_tokens, cache.stats.hit_tokens) == before
    cache.evict(2)
    assert cache.peek(older + [0]) == 0  # still the least recently used
    assert cache.allocator.refcount(older_blocks[0]) == 0


# -- eviction and the reference protocol ---------------------------------------------------------------------------
@pytest.mark.parametrize("cache_class", CACHES)
def test_eviction_takes_the_least_recently_used_first(cache_class):
    cache = make_cache(cache_class)
    first, second = list(range(8)), list(range(50, 58))
    compute_and_finish(cache, first)
    second_blocks = compute_and_finish(cache, second)
    cache.match(first + [0])  # first is now the more recently used
    assert cache.evict(2) == 2
    assert cache.peek(first + [0]) == 8
    assert cache.peek(second + [0]) == 0
    assert all(cache.allocator.refcount(block) == 0 for block in second_blocks)


@pytest.mark.parametrize("cache_class", CACHES)
def test_a_chain_loses_its_tail_before_its_head(cache_class):
    cache = make_cache(cache_class)
    tokens = list(range(13))
    compute_and_finish(cache, tokens)
    assert cache.evict(1) == 1
    assert cache.peek(tokens) == 8
    assert cache.evict(1) == 1
    assert cache.peek(tokens) == 4


@pytest.mark.parametrize("cache_class", CACHES)
def test_locked_entries_are_never_evicted(cache_class):
    cache = make_cache(cache_class)
    locked_tokens = list(range(13))
    compute_and_finish(cache, locked_tokens)
    compute_and_finish(cache, list(range(50, 58)))
    match = cache.match(locked_tokens)
    cache.lock(match)
    assert cache.num_evictable == 2
    assert cache.evict(100) == 2
    assert cache.match(locked_tokens).blocks == match.blocks
    cache.unlock(match)
    assert cache.num_evictable == 3
    with pytest.raises(RuntimeError, match="not locked"):
        cache.unlock(match)


@pytest.mark.parametrize("cache_class", CACHES)
def test_blocks_a_sequence_still_holds_are_not_evictable(cache_class):
    cache = make_cache(cache_class)
    running = compute(cache, list(range(12)))
    assert cache.num_evictable == 0
    assert cache.evict(10) == 0
    cache.allocator.release(running)
    assert cache.num_evictable == 3


@pytest.mark.parametrize("cache_class", CACHES)
def test_a_parent_is_kept_while_a_cached_child_is_held(cache_class):
    cache = make_cache(cache_class)
    tokens = list(range(8))
    parent = compute_and_finish(cache, tokens[:4])
    duplicate = cache.allocator.allocate(2)  # a running sequence that computed the prefix without a hit
    cache.insert(tokens, duplicate)
    # The cache holds parent[0] alone, but its cached child duplicate[1] is still in use: neither can go.
    assert cache.num_evictable == 0
    assert cache.evict(1) == 0
    cache.allocator.release(duplicate)
    assert cache.evict(1) == 1
    assert cache.allocator.refcount(duplicate[1]) == 0
    assert cache.peek(tokens + [0]) == 4
    assert cache.match(tokens + [0]).blocks == (parent[0],)


@pytest.mark.parametrize("cache_class", CACHES)
def test_evict_returns_exactly_the_blocks_given_back_to_the_allocator(cache_class):
    cache = make_cache(cache_class)
    compute_and_finish(cache, list(range(20)))
    compute_and_finish(cache, list(range(50, 62)))
    allocator = cache.allocator
    assert cache.num_evictable == cache.num_cached_blocks == 8
    free_before = allocator.num_free
    assert cache.evict(3) == 3
    assert allocator.num_free == free_before + 3
    assert cache.evict(100) == 5
    assert allocator.num_free == free_before + 8 == allocator.capacity
    assert cache.num_cached_blocks == 0 and cache.num_evictable == 0


@pytest.mark.parametrize("cache_class", CACHES)
@pytest.mark.parametrize("block_size", [1, 4])
def test_random_workload_keeps_the_cache_consistent(cache_class, block_size):
    """Sequences come and go, sharing prefixes across two namespaces, under eviction pressure. Every match returns
    blocks first inserted for exactly that prefix and still held; locked prefixes survive; references add up."""
    rng = random.Random(7)
    cache = make_cache(cache_class, block_size=block_size, num_blocks=48)
    allocator = cache.allocator
    bases = [[rng.randrange(6) for _ in range(20)] for _ in range(3)]
    inserted_block: dict[tuple, int] = {}  # (namespace, prefix tokens) -> block first stored for it
    running = []  # (tokens, namespace, blocks, locked match)
    for _ in range(300):
        action = rng.random()
        if action < 0.5 and len(running) < 4:
            namespace = rng.choice([None, "salt"])
            tokens = rng.choice(bases)[: rng.randrange(1, 21)] + [rng.randrange(6) for _ in range(rng.randrange(6))]
            match = cache.match(tokens, namespace)
            for index, block in enumerate(match.blocks):
                assert inserted_block[namespace, tuple(tokens[: (index + 1) * block_size])] == block
                assert allocator.refcount(block) >= 1
            cache.lock(match)
            allocator.retain(list(match.blocks))
            num_missing = len(tokens) // block_size - len(match.blocks)
            if num_missing > allocator.num_free:
                cache.evict(num_missing - allocator.num_free)
            fresh = allocator.allocate(num_missing)
            if fresh is None:
                cache.unlock(match)
                allocator.release(list(match.blocks))
                continue
            blocks = list(match.blocks) + fresh
            num_cached = cache.insert(tokens, blocks, namespace)
            for index in range(num_cached // block_size, len(blocks)):
                inserted_block[namespace, tuple(tokens[: (index + 1) * block_size])] = blocks[index]
            running.append((tokens, namespace, blocks, match))
        elif action < 0.8 and running:
            _, _, blocks, match = running.pop(rng.randrange(len(running)))
            cache.unlock(match)
            allocator.release(blocks[::-1])
        else:
            evictable, free_before = cache.num_evictable, allocator.num_free
            asked = rng.randrange(1, 10)
            freed = cache.evict(asked)
            assert freed == min(asked, evictable)
            assert allocator.num_free == free_before + freed
        for tokens, namespace, _, match in running:
            assert cache.peek(tokens, namespace) >= match.num_tokens
        held_by_sequences = sum(len(blocks) for _, _, blocks, _ in running)
        total_references = sum(allocator.refcount(block) for block in range(1, allocator.num_blocks))
        assert total_references == held_by_sequences + cache.num_cached_blocks
        assert allocator.num_free + num_held(allocator) == allocator.capacity
    assert cache.stats.hit_tokens > 0 and cache.stats.evicted_blocks > 0


# -- none ----------------------------------------------------------------------------------------------------------
def test_no_prefix_cache_keeps_nothing_but_counts_lookups():
    cache = make_cache(NoPrefixCache)
    blocks = cache.allocator.allocate(2)
    assert cache.insert(list(range(8)), blocks) == 0
    assert [cache.allocator.refcount(block) for block in blocks] == [1, 1]
    match = cache.match(list(range(9)))
    assert (match.blocks, match.num_tokens) == ((), 0)
    cache.lock(match)
    cache.unlock(match)
    assert (cache.num_evictable, cache.evict(5), cache.num_cached_blocks) == (0, 0, 0)
    assert (cache.stats.lookups, cache.stats.lookup_tokens, cache.stats.hit_tokens) == (1, 9, 0)
    assert cache.peek(list(range(9))) == 0 and cache.stats.lookups == 1


# -- registration --------------------------------------------------------------------------------------------------
def test_each_cache_registers_under_its_config_name():
    registry = Registry.from_plugins([importlib.import_module("infer.plugins.prefix_cache")])
    assert registry.names("prefix_cache") == ["hash", "none", "radix"]
    assert registry.load("prefix_cache", "none") is NoPrefixCache
    assert registry.load("prefix_cache", "hash") is HashPrefixCache
    assert registry.load("prefix_cache", "radix") is RadixPrefixCache


def test_hash_fcfs_config_selects_the_hash_cache():
    config = yaml.safe_load((resources.files("infer.configs") / "hash_fcfs.yaml").read_text())
    assert config["prefix_cache"] == {"name": "hash"}
    assert config["scheduler"]["name"] == "fcfs"
