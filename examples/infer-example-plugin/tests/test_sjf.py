"""The policy itself: what the conformance suite cannot know about sjf."""

from collections import deque

from infer_example_plugin.sjf import SJFScheduler

from infer.kv_cache_manager import KVCacheManager
from infer.plugins.allocators.paged import PagedAllocator
from infer.plugins.prefix_cache.none import NoPrefixCache
from infer.sampling_params import SamplingParams
from infer.scheduler import SchedulerView
from infer.sequence import Sequence


def test_shortest_prompt_is_admitted_first_and_ties_keep_arrival_order():
    allocator = PagedAllocator(num_blocks=64, block_size=4, max_model_len=64)
    kv = KVCacheManager(allocator, NoPrefixCache(allocator, 4), max_model_len=64)
    lengths = {"long": 30, "short": 3, "medium": 10, "short-later": 3}
    waiting = deque(Sequence(name, [1] * length, SamplingParams(max_tokens=4)) for name, length in lengths.items())
    view = SchedulerView(waiting, [], kv, max_num_seqs=8, max_num_batched_tokens=100, max_model_len=64)
    assert [seq.seq_id for seq in SJFScheduler().order_waiting(view)] == ["short", "short-later", "medium", "long"]
