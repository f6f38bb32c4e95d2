"""The scheduling policies beyond FCFS and LPM (priority, hrrn, fair, deadline) and the preemption policies, over a
real allocator and KV cache manager: who is admitted first, who is preempted, and that waiting ages."""

from __future__ import annotations

import itertools
from collections import deque

import pytest

from infer.kv_cache_manager import KVCacheManager
from infer.plugins.allocators.paged import PagedAllocator
from infer.plugins.prefix_cache.none import NoPrefixCache
from infer.plugins.schedulers.deadline import DeadlineScheduler, DeadlineSchedulerConfig
from infer.plugins.schedulers.fair import FairScheduler, FairSchedulerConfig
from infer.plugins.schedulers.fcfs import FCFSScheduler
from infer.plugins.schedulers.hrrn import HRRNScheduler, HRRNSchedulerConfig
from infer.plugins.schedulers.priority import PriorityScheduler, PrioritySchedulerConfig
from infer.sampling_params import SamplingParams, SamplingParamsError
from infer.scheduler import SchedulerConfig, SchedulerView
from infer.sequence import Sequence, SequenceQueues

BLOCK_SIZE = 4
_ids = itertools.count()


class TestView(SchedulerView):
    """A scheduler's view that keeps its KV manager at hand, for the steps these tests play themselves."""

    __test__ = False

    def __init__(self, waiting, running, kv, *args, **kwargs):
        super().__init__(waiting, running, kv, *args, **kwargs)
        self.kv = kv


def make_view(num_blocks=256, max_num_seqs=16, max_num_batched_tokens=512, now=0.0):
    allocator = PagedAllocator(num_blocks=num_blocks, block_size=BLOCK_SIZE, max_model_len=256)
    kv = KVCacheManager(allocator, NoPrefixCache(allocator, BLOCK_SIZE), max_model_len=256)
    return TestView(deque(), [], kv, max_num_seqs, max_num_batched_tokens, max_model_len=256, now=now)


def arrive(view, prompt_len=8, arrival_time=0.0, **params):
    params.setdefault("max_tokens", 8)
    seq = Sequence(
        f"seq-{next(_ids)}",
        [1 + next(_ids) % 500 for _ in range(prompt_len)],
        SamplingParams(**params),
        arrival_time=arrival_time,
    )
    view.waiting.append(seq)
    return seq


def admitted_order(scheduler, view):
    """Admit one sequence per step until none waits; returns them in admission order."""
    order = []
    while view.waiting:
        plan = scheduler.schedule(view)
        order.extend(seq for seq, _ in plan.scheduled if seq not in order)
        for seq in list(view.running):
            view.kv.free(seq)
            SequenceQueues(view.waiting, view.running).finish(seq)
    return order


def one_at_a_time(config_class, **fields):
    return config_class(max_num_seqs=1, **fields)


def test_priority_admits_the_lowest_value_first_then_arrival_order():
    view = make_view()
    low, urgent, normal, urgent_later = (
        arrive(view, priority=2),
        arrive(view, priority=0),
        arrive(view, priority=1),
        arrive(view, priority=0),
    )
    order = admitted_order(PriorityScheduler(one_at_a_time(PrioritySchedulerConfig)), view)
    assert order == [urgent, urgent_later, normal, low]


def test_priority_ages_a_waiting_request_past_newer_favored_ones():
    """With aging_s 10, priority 1 that has waited 15 s (effective -0.5) goes before priority 0 that just came."""
    view = make_view(now=20.0)
    old_low = arrive(view, priority=1, arrival_time=5.0)
    new_urgent = arrive(view, priority=0, arrival_time=19.9)
    scheduler = PriorityScheduler(one_at_a_time(PrioritySchedulerConfig, aging_s=10.0))
    assert admitted_order(scheduler, view) == [old_low, new_urgent]
    view = make_view(now=20.0)
    recent_low = arrive(view, priority=1, arrival_time=15.0)  # waited 5 s: effective 0.5
    new_urgent = arrive(view, priority=0, arrival_time=19.9)
    assert admitted_order(scheduler, view) == [new_urgent, recent_low]


def test_priority_preempts_the_lowest_priority_first():
    # 3 running sequences of 4 blocks each in a pool of 12 usable blocks: the next block must come from a victim.
    view = make_view(num_blocks=13)
    scheduler = PriorityScheduler(PrioritySchedulerConfig())
    sequences = [arrive(view, prompt_len=16, priority=p) for p in (0, 2)]
    scheduler.schedule(view)
    sequences.append(arrive(view, prompt_len=16, priority=1))
    scheduler.schedule(view)
    assert view.running == sequences  # admitted p0, p2, then p1: the newest is not the lowest priority
    for seq in sequences:
        seq.num_computed_tokens = 16
        seq.output_token_ids.append(3)
    plan = scheduler.schedule(view)
    assert plan.preempted[0] is sequences[1], "the priority-2 sequence goes, though it was not admitted last"


def test_fewest_computed_preemption_policy():
    view = make_view(num_blocks=13)
    scheduler = FCFSScheduler(SchedulerConfig(preemption="fewest_computed"))
    sequences = [arrive(view, prompt_len=16) for _ in range(3)]
    scheduler.schedule(view)
    for seq, computed in zip(sequences, (16, 8, 16)):
        seq.num_computed_tokens = computed
        if computed == 16:
            seq.output_token_ids.append(3)
    plan = scheduler.schedule(view)
    assert plan.preempted[0] is sequences[1], "the one with 8 computed tokens loses least"
    assert FCFSScheduler(SchedulerConfig()).config.preemption == "newest"


def test_hrrn_prefers_short_jobs_at_equal_wait_and_long_waits_over_short_jobs():
    view = make_view(now=10.0)
    long_job = arrive(view, max_tokens=200, arrival_time=9.0)
    short_job = arrive(view, max_tokens=10, arrival_time=9.0)
    scheduler = HRRNScheduler(one_at_a_time(HRRNSchedulerConfig))
    assert admitted_order(scheduler, view) == [short_job, long_job]
    view = make_view(now=100.0)
    patient_long = arrive(view, max_tokens=200, arrival_time=0.0)  # ratio 1 + 100/200 = 1.5
    fresh_short = arrive(view, max_tokens=10, arrival_time=99.0)  # ratio 1 + 1/10 = 1.1
    assert admitted_order(scheduler, view) == [patient_long, fresh_short]


def test_fair_alternates_tenants_whatever_each_sends():
    view = make_view()
    flood = [arrive(view, tenant="flood") for _ in range(6)]
    polite = [arrive(view, tenant="polite") for _ in range(2)]
    order = admitted_order(FairScheduler(one_at_a_time(FairSchedulerConfig)), view)
    assert order[:4] == [flood[0], polite[0], flood[1], polite[1]]
    assert order[4:] == flood[2:]


def test_fair_counters_charge_prompt_and_output_tokens_and_lift_a_returning_tenant():
    view = make_view()
    scheduler = FairScheduler(FairSchedulerConfig(prompt_token_weight=1.0, output_token_weight=2.0))
    busy = arrive(view, prompt_len=8, tenant="busy")
    scheduler.schedule(view)
    assert scheduler.counters == {"busy": 8.0}
    busy.num_computed_tokens = 8
    busy.output_token_ids.append(3)
    scheduler.schedule(view)  # a decode step: 1 output token
    assert scheduler.counters["busy"] == 10.0
    arrive(view, tenant="newcomer")
    scheduler.schedule(view)  # joins at the lowest active counter, not at 0 (no credit banked while away)
    assert scheduler.counters["newcomer"] >= 10.0


def test_deadline_serves_the_tightest_target_first_and_defaults_the_rest():
    view = make_view(now=1.0)
    relaxed = arrive(view, arrival_time=0.0, ttft_slo_s=5.0)
    no_target = arrive(view, arrival_time=0.0)  # default_ttft_slo_s 2 here: deadline 2
    tight_later = arrive(view, arrival_time=0.5, ttft_slo_s=0.5)  # deadline 1
    scheduler = DeadlineScheduler(one_at_a_time(DeadlineSchedulerConfig, default_ttft_slo_s=2.0))
    assert admitted_order(scheduler, view) == [tight_later, no_target, relaxed]


@pytest.mark.parametrize(
    "field, value", [("priority", 1.5), ("priority", True), ("ttft_slo_s", 0), ("ttft_slo_s", float("nan"))]
)
def test_scheduling_fields_are_validated(field, value):
    with pytest.raises(SamplingParamsError) as error:
        SamplingParams(**{field: value})
    assert error.value.field == field
