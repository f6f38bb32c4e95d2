"""KVCacheManager behaviours found by the conformance suites' random workloads, pinned as plain regressions."""

from __future__ import annotations

from infer.kv_cache_manager import KVCacheManager
from infer.registry import get_registry
from infer.testing.scheduler import Limits, Request, SimulatedEngine, expected_outputs


def simulated_engine(limits: Limits, scheduler: str = "fcfs", prefix_cache: str = "none") -> SimulatedEngine:
    registry = get_registry()
    config = registry.config_model("scheduler", scheduler)(
        name=scheduler, max_num_seqs=limits.max_num_seqs, max_num_batched_tokens=limits.max_num_batched_tokens
    )
    allocator = registry.load("allocator", "paged")(limits.num_blocks, limits.block_size, limits.max_model_len)
    cache = registry.load("prefix_cache", prefix_cache)(allocator, limits.block_size)
    kv = KVCacheManager(allocator, cache, limits.max_model_len)
    return SimulatedEngine(registry.load("scheduler", scheduler)(config), kv, limits)


def test_a_fork_pin_gives_way_when_the_pool_runs_out():
    """A finished leader's pinned prompt (16 of 19 blocks) held the pool against a preempted request queued ahead
    of the follower the pin was kept for: nothing could run again. Hypothesis found it once n > 1 entered the
    scheduler suite's workloads; the pin is now released when an allocation would fail without it."""
    limits = Limits(num_blocks=20, block_size=1, max_model_len=40, max_num_seqs=2, max_num_batched_tokens=4)
    workload = [Request(1, 1), Request(2, 3, arrival_step=1), Request(17, 1, n=2)]
    engine = simulated_engine(limits)
    sequences = engine.run(workload)
    assert [seq.num_output_tokens for seq in sequences] == expected_outputs(workload)
    assert engine.kv.allocator.num_free == engine.kv.allocator.capacity
