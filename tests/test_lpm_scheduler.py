"""The lpm scheduler over a real allocator, radix cache and KV cache manager: order, FCFS cut-over, holding, aging."""

from __future__ import annotations

import importlib
import itertools
from collections import deque
from importlib import resources

import pytest
import yaml
from pydantic import ValidationError

from infer.kv_cache_manager import KVCacheManager
from infer.plugins.allocators.paged import PagedAllocator
from infer.plugins.prefix_cache.radix import RadixPrefixCache
from infer.plugins.schedulers.lpm import LPMScheduler, LPMSchedulerConfig
from infer.registry import Registry
from infer.sampling_params import SamplingParams
from infer.scheduler import SchedulerView
from infer.sequence import Sequence, SequenceQueues, SequenceStatus

BLOCK_SIZE = 4
_seq_ids = itertools.count()


class TestView(SchedulerView):
    """A scheduler's view that keeps its KV manager at hand, for the steps these tests play themselves."""

    __test__ = False

    def __init__(self, waiting, running, kv, *args, **kwargs):
        super().__init__(waiting, running, kv, *args, **kwargs)
        self.kv = kv


def make_view(max_num_seqs=16, max_num_batched_tokens=512):
    allocator = PagedAllocator(num_blocks=256, block_size=BLOCK_SIZE, max_model_len=512)
    kv = KVCacheManager(allocator, RadixPrefixCache(allocator, BLOCK_SIZE), max_model_len=512)
    return TestView(deque(), [], kv, max_num_seqs, max_num_batched_tokens, max_model_len=512)


def arrive(view, prompt):
    seq = Sequence(f"seq-{next(_seq_ids)}", list(prompt), SamplingParams())
    view.waiting.append(seq)
    return seq


def warm_cache(view, prompt):
    """Leave ``prompt``'s full blocks in the prefix cache, as a finished request would."""
    allocator, cache = view.kv.allocator, view.kv.prefix_cache
    blocks = allocator.allocate(len(prompt) // BLOCK_SIZE)
    cache.insert(prompt, blocks)
    allocator.release(blocks)


def step(scheduler, view):
    """One engine step without a model: scheduled tokens count as computed, full blocks go to the cache."""
    plan = scheduler.schedule(view)
    for seq, num_new_tokens in plan.scheduled:
        seq.num_computed_tokens += num_new_tokens
        view.kv.commit(seq)
    return [seq for seq, _ in plan.scheduled]


def finish_running(view):
    for seq in list(view.running):
        view.kv.free(seq)
        SequenceQueues(view.waiting, view.running).finish(seq)


def tokens(start, count):
    return list(range(start, start + count))


def test_longest_cached_prefix_goes_first_ties_by_arrival():
    view = make_view()
    warm_cache(view, tokens(0, 16))
    no_hit = arrive(view, tokens(500, 20))
    short_hit = arrive(view, tokens(0, 8) + tokens(600, 12))
    long_hit = arrive(view, tokens(0, 16) + tokens(700, 4))
    long_hit_later = arrive(view, tokens(0, 16) + tokens(800, 4))
    assert LPMScheduler().order_waiting(view) == [long_hit, long_hit_later, short_hit, no_hit]


def test_above_the_threshold_waiting_requests_go_in_arrival_order():
    view = make_view()
    warm_cache(view, tokens(0, 16))
    waiting = [arrive(view, tokens(500, 20)), arrive(view, tokens(600, 20)), arrive(view, tokens(0, 20))]
    assert LPMScheduler(LPMSchedulerConfig(fcfs_threshold=2)).order_waiting(view) == waiting
    assert LPMScheduler(LPMSchedulerConfig(fcfs_threshold=3)).order_waiting(view)[0] is waiting[2]


def test_requests_sharing_an_uncached_prefix_are_held_until_the_first_has_computed_it():
    view = make_view()
    scheduler = LPMScheduler()
    system_prompt = tokens(0, 40)
    first = arrive(view, system_prompt + tokens(100, 5))
    unrelated = arrive(view, tokens(500, 45))
    siblings = [arrive(view, system_prompt + tokens(200 + 10 * i, 5)) for i in range(2)]
    assert step(scheduler, view) == [first, unrelated]
    assert all(seq.num_times_passed_over == 1 for seq in siblings)
    assert step(scheduler, view) == siblings
    assert [seq.num_cached_prompt_tokens for seq in siblings] == [40, 40]


def test_a_prefix_already_cached_is_no_reason_to_hold():
    view = make_view()
    system_prompt = tokens(0, 40)
    warm_cache(view, system_prompt)
    waiting = [arrive(view, system_prompt + tokens(100 + 100 * i, 50)) for i in range(3)]  # they share only the cache
    assert LPMScheduler().order_waiting(view) == waiting


def test_a_running_request_still_in_prefill_holds_its_siblings():
    view = make_view(max_num_batched_tokens=48)
    scheduler = LPMScheduler()
    system_prompt = tokens(0, 80)
    leader = arrive(view, system_prompt + tokens(100, 4))
    assert step(scheduler, view) == [leader]  # a 48-token chunk of 84
    sibling = arrive(view, system_prompt + tokens(200, 4))
    # The leader takes 36 tokens; 12 would be left for the sibling, which has 48 tokens cached and shares 32 more.
    assert step(scheduler, view) == [leader]
    assert sibling.num_times_passed_over == 1
    step(scheduler, view)  # the leader finishes its prompt; the sibling shares nothing uncached any more
    assert sibling.status is SequenceStatus.RUNNING
    assert sibling.num_cached_prompt_tokens == 80


def test_held_requests_age_and_are_then_never_held():
    view = make_view(max_num_batched_tokens=48)
    scheduler = LPMScheduler(LPMSchedulerConfig(max_wait_steps=1))
    system_prompt = tokens(0, 80)
    leader = arrive(view, system_prompt + tokens(100, 4))
    sibling = arrive(view, system_prompt + tokens(200, 4))
    assert step(scheduler, view) == [leader]
    assert sibling.num_times_passed_over == 1
    assert step(scheduler, view) == [leader, sibling]  # aged: tried although the leader is still in prefill


def test_a_request_is_passed_over_at_most_max_wait_steps_times():
    view = make_view(max_num_seqs=1)
    scheduler = LPMScheduler(LPMSchedulerConfig(max_wait_steps=3))
    warm_cache(view, tokens(0, 16))
    starved = arrive(view, tokens(500, 20))
    admitted = []
    for later_arrival in range(5):
        hit = arrive(view, tokens(0, 16) + tokens(1000 + 10 * later_arrival, 4))  # always a better match
        admitted += step(scheduler, view)
        finish_running(view)
        if starved in admitted:
            break
    assert admitted[-1] is starved
    assert len(admitted) == 4
    assert starved.num_times_passed_over == 3
    assert hit in view.waiting and hit.num_times_passed_over == 0  # the aged request arrived first: FCFS order


def test_waiting_for_the_budget_alone_is_not_being_passed_over():
    view = make_view(max_num_seqs=1)
    scheduler = LPMScheduler(LPMSchedulerConfig(max_wait_steps=1))
    first, second = arrive(view, tokens(0, 20)), arrive(view, tokens(100, 20))
    assert step(scheduler, view) == [first]
    assert step(scheduler, view) == []  # the sequence limit keeps everyone out, as it would under FCFS
    assert second.num_times_passed_over == 0


def test_config_rejects_negative_bounds_and_unknown_keys():
    with pytest.raises(ValidationError):
        LPMSchedulerConfig(max_wait_steps=-1)
    with pytest.raises(ValidationError):
        LPMSchedulerConfig(hold_min_prefix=0)
    with pytest.raises(ValidationError):
        LPMSchedulerConfig(fcfs_treshold=10)
    assert LPMScheduler().config == LPMSchedulerConfig(fcfs_threshold=128, hold_min_prefix=32, max_wait_steps=64)


def test_lpm_registers_under_its_config_name_with_its_config_model():
    registry = Registry.from_plugins([importlib.import_module("infer.plugins.schedulers")])
    assert registry.load("scheduler", "lpm") is LPMScheduler
    assert registry.config_model("scheduler", "lpm") is LPMSchedulerConfig


def test_radix_lpm_config_selects_the_radix_cache_and_a_valid_lpm_section():
    config = yaml.safe_load((resources.files("infer.configs") / "radix_lpm.yaml").read_text())
    assert config["prefix_cache"] == {"name": "radix"}
    assert LPMSchedulerConfig(**config["scheduler"]) == LPMSchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048)
