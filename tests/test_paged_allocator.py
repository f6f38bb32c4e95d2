"""The paged allocator hands out the blocks it has handed out before, so a CPU pool's resident pages (mapped in as
blocks are first written) stay at the most blocks in use at once, however many requests come and go."""

from __future__ import annotations

import random

from infer.kv_cache_manager import KVCacheManager
from infer.plugins.allocators.paged import PagedAllocator
from infer.registry import get_registry
from infer.testing.scheduler import Limits, Request, SimulatedEngine, expected_outputs


class RecordingAllocator(PagedAllocator):
    """Remembers every block it handed out and the most it held at once."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.handed_out: set[int] = set()
        self.peak_in_use = 0

    def allocate(self, n):
        blocks = super().allocate(n)
        self.handed_out.update(blocks or ())
        self.peak_in_use = max(self.peak_in_use, self.capacity - self.num_free)
        return blocks


def test_random_allocations_touch_no_more_blocks_than_they_hold_at_once():
    allocator = RecordingAllocator(num_blocks=512, block_size=16, max_model_len=1024)
    rng = random.Random(0)
    held: list[list[int]] = []
    for _ in range(5000):
        if held and (rng.random() < 0.5 or allocator.num_free < 8):
            allocator.release(held.pop(rng.randrange(len(held))))
        else:
            held.append(allocator.allocate(rng.randint(1, 8)))
    assert allocator.peak_in_use < allocator.capacity  # the pool was never full: untouched blocks stayed available
    assert allocator.handed_out == set(range(1, allocator.peak_in_use + 1))


def test_a_stream_of_requests_reuses_the_blocks_of_those_that_finished():
    """Requests arriving a few at a time over many steps: the pool's blocks ever written are those the busiest step
    held, not a walk through the pool."""
    limits = Limits(num_blocks=400, block_size=4, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32)
    registry = get_registry()
    scheduler_config = registry.config_model("scheduler", "fcfs")(
        name="fcfs", max_num_seqs=limits.max_num_seqs, max_num_batched_tokens=limits.max_num_batched_tokens
    )
    allocator = RecordingAllocator(limits.num_blocks, limits.block_size, limits.max_model_len)
    kv = KVCacheManager(allocator, registry.load("prefix_cache", "none")(allocator, limits.block_size), 64)
    engine = SimulatedEngine(registry.load("scheduler", "fcfs")(scheduler_config), kv, limits)
    workload = [Request(8 + i % 13, 4 + i % 9, arrival_step=3 * i) for i in range(120)]
    assert [seq.num_output_tokens for seq in engine.run(workload)] == expected_outputs(workload)
    blocks_requested = sum(-(-(r.prompt_len + r.max_tokens) // limits.block_size) for r in workload)
    assert blocks_requested > 4 * allocator.peak_in_use  # the stream needed many times the blocks held at once
    assert allocator.handed_out == set(range(1, allocator.peak_in_use + 1))
