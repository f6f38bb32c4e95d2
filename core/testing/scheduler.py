"""Conformance suite for schedulers (contract: ``infer.scheduler.Scheduler``).

The scheduler plans steps over a real ``SchedulerView`` (a ``KVCacheManager`` over the registered ``paged`` allocator
and ``none`` prefix cache by default; ``hash`` where prefix hits must reach the scheduler), and a simulated model
carries each plan out: scheduled tokens become computed, a sequence that has computed all its tokens gets a fake
sampled token, and one at its ``max_tokens`` finishes and gives its blocks back. Every plan is checked against the
limits. The clock is the step number (``SchedulerView.now``; a request's ``arrival_time`` is its arrival step).
Workloads include requests sharing a prefix (cache hits: admitted sequences arrive with computed tokens) and
``n > 1`` samples (followers share their leader's computed prompt once ``view.is_ready`` says so).

A plugin author's whole test file::

    from infer.testing import SchedulerConformance

    class TestSJF(SchedulerConformance):
        impl_name = "sjf"
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import pytest
from hypothesis import given
from hypothesis import strategies as st

from infer.kv_cache_manager import KVCacheManager
from infer.registry import get_registry
from infer.sampling_params import SamplingParams
from infer.scheduler import Scheduler, SchedulerView, StepPlan
from infer.sequence import Sequence, SequenceQueues, SequenceStatus
from infer.testing.suite import ConformanceSuite

SAMPLED_TOKEN = 7  # what the simulated model "samples"; its value never matters to a scheduler


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a workload: it arrives before step ``arrival_step`` runs. Its first ``shared_prefix_len``
    prompt tokens are the same in every request (a system prompt); ``n`` samples share the whole prompt. ``priority``
    and ``tenant`` go to its ``SamplingParams``."""

    prompt_len: int
    max_tokens: int
    arrival_step: int = 0
    n: int = 1
    shared_prefix_len: int = 0
    priority: int = 0
    tenant: str | None = None


@dataclass(frozen=True, slots=True)
class Limits:
    """What the engine promises the scheduler and what every plan must respect."""

    num_blocks: int = 64
    block_size: int = 4
    max_model_len: int = 64
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 32


SchedulerFactory = Callable[[Limits], Scheduler]
KVCacheFactory = Callable[[Limits], KVCacheManager]


class SimulatedEngine:
    """The engine's step loop with the model replaced by bookkeeping, checking every plan the scheduler makes."""

    def __init__(self, scheduler: Scheduler, kv: KVCacheManager, limits: Limits):
        self.scheduler = scheduler
        self.kv = kv
        self.limits = limits
        self.queues = SequenceQueues()
        self.waiting, self.running = self.queues.waiting, self.queues.running
        self.finished: list[Sequence] = []
        self.num_scheduled_tokens = 0
        self.finish_step: dict[Sequence, int] = {}
        self.samples_of: dict[str, list[Sequence]] = {}
        self.view = SchedulerView(
            self.waiting, self.running, kv, limits.max_num_seqs, limits.max_num_batched_tokens, limits.max_model_len
        )

    def run(self, workload: list[Request]) -> list[Sequence]:
        """Serve ``workload`` to the end; fails when it takes more than ``step_bound`` steps. Returns every sample,
        request by request."""
        # Built in arrival order, as the engine builds them: ``arrival_order`` must follow arrival.
        by_arrival = sorted(range(len(workload)), key=lambda index: workload[index].arrival_step)
        built = {index: make_samples(index, workload[index]) for index in by_arrival}
        samples = [built[index] for index in range(len(workload))]
        sequences = [seq for request_samples in samples for seq in request_samples]
        self.samples_of = {request_samples[0].request_id: request_samples for request_samples in samples}
        bound = step_bound(workload)
        step = 0
        while len(self.finished) < len(sequences):
            assert step < bound, (
                f"{len(sequences) - len(self.finished)} of {len(sequences)} samples unfinished after {bound} steps "
                f"(waiting {[seq.seq_id for seq in self.waiting]}, running {[seq.seq_id for seq in self.running]})"
            )
            for request_samples, request in zip(samples, workload):
                if request.arrival_step == step:
                    self.queues.add(request_samples)
            self.view.now = float(step)
            self.step()
            step += 1
        self.check_all_blocks_returned()
        return sequences

    def step(self) -> StepPlan:
        plan = self.scheduler.schedule(self.view)
        check_plan(plan, self.view, self.limits)
        for seq, num_new_tokens in plan.scheduled:
            self.num_scheduled_tokens += num_new_tokens
            self.advance(seq, num_new_tokens)
        return plan

    def advance(self, seq: Sequence, num_new_tokens: int) -> None:
        seq.num_computed_tokens += num_new_tokens
        self.kv.commit(seq)
        if seq.num_computed_tokens < seq.num_tokens:
            return  # a prefill chunk: no logits sampled yet
        seq.output_token_ids.append(SAMPLED_TOKEN)
        if seq.num_output_tokens == seq.params.max_tokens:
            samples = self.samples_of[seq.request_id]
            self.kv.free_finished(seq, any(other in self.waiting for other in samples[1:]))
            self.queues.finish(seq)
            self.finished.append(seq)
            self.finish_step[seq] = int(self.view.now)
            if all(other.status is SequenceStatus.FINISHED for other in samples):
                self.kv.release_fork_pin(samples[0])

    def check_all_blocks_returned(self) -> None:
        allocator, cache = self.kv.allocator, self.kv.prefix_cache
        held = allocator.capacity - allocator.num_free - cache.num_cached_blocks
        assert held == 0, f"{held} blocks still held after every request finished"


def check_plan(plan: StepPlan, view: SchedulerView, limits: Limits) -> None:
    """One step's plan respects the budget, the sequence limit and the block tables it promised."""
    scheduled = [seq for seq, _ in plan.scheduled]
    assert plan.num_batched_tokens <= limits.max_num_batched_tokens, (
        f"plan schedules {plan.num_batched_tokens} tokens, over the budget of {limits.max_num_batched_tokens}"
    )
    assert len(view.running) <= limits.max_num_seqs, (
        f"{len(view.running)} sequences running, over max_num_seqs={limits.max_num_seqs}"
    )
    assert len({id(seq) for seq in scheduled}) == len(scheduled), "a sequence is scheduled twice in one step"
    for seq, num_new_tokens in plan.scheduled:
        check_scheduled_sequence(seq, num_new_tokens, view)
    for seq in plan.preempted:
        assert seq in view.waiting and seq not in scheduled, f"preempted {seq.seq_id} is not back in waiting"
        assert not seq.block_table, f"preempted {seq.seq_id} still holds blocks {seq.block_table}"


def check_scheduled_sequence(seq: Sequence, num_new_tokens: int, view: SchedulerView) -> None:
    assert seq in view.running and seq.status is SequenceStatus.RUNNING, f"{seq.seq_id} is scheduled but not running"
    assert num_new_tokens >= 1, f"{seq.seq_id} is scheduled for {num_new_tokens} tokens"
    assert seq.num_computed_tokens + num_new_tokens <= seq.num_tokens, (
        f"{seq.seq_id} is scheduled for {num_new_tokens} tokens but has only {seq.num_uncomputed_tokens} to compute"
    )
    num_slots = len(seq.block_table) * view.block_size
    assert num_slots >= seq.num_computed_tokens + num_new_tokens, (
        f"{seq.seq_id}: block table holds {num_slots} slots, the step writes up to "
        f"{seq.num_computed_tokens + num_new_tokens}"
    )


def make_samples(index: int, request: Request) -> list[Sequence]:
    """The request's ``n`` samples, the first the leader the others fork from. Past the shared prefix the prompt is
    the request's own."""
    shared = min(request.shared_prefix_len, request.prompt_len)
    prompt = [2000 + position for position in range(shared)]
    prompt += [(index * 31 + position) % 1000 + 1 for position in range(request.prompt_len - shared)]
    params = SamplingParams(
        max_tokens=request.max_tokens, temperature=0.0, n=request.n, priority=request.priority, tenant=request.tenant
    )
    samples: list[Sequence] = []
    for sample in range(request.n):
        samples.append(
            Sequence(
                f"seq-{index}/{sample}",
                list(prompt),
                params,
                request_id=f"request-{index}",
                sample_index=sample,
                fork_of=samples[0] if samples else None,
                arrival_time=float(request.arrival_step),
            )
        )
    return samples


def step_bound(workload: list[Request]) -> int:
    """Generous: every sample could be recomputed from scratch once per other sample, one token per step."""
    work = sum((request.prompt_len + request.max_tokens) * request.n for request in workload)
    num_samples = sum(request.n for request in workload)
    last_arrival = max((request.arrival_step for request in workload), default=0)
    return last_arrival + work * (num_samples + 1) + 16


def expected_outputs(workload: list[Request]) -> list[int]:
    return [request.max_tokens for request in workload for _ in range(request.n)]


@st.composite
def scenarios(draw: st.DrawFn, chunked_prefill: bool) -> tuple[Limits, list[Request]]:
    """Limits and a workload in which every request fits the pool alone (else no scheduler could finish it)."""
    block_size = draw(st.sampled_from([1, 4, 8]))
    max_model_len = 40
    budget = draw(st.integers(4, 48))
    max_prompt = 24 if chunked_prefill else min(24, budget)
    requests = draw(
        st.lists(
            st.builds(
                Request,
                st.integers(1, max_prompt),
                st.integers(1, 12),
                st.integers(0, 10),
                st.integers(1, 3),
                st.integers(0, max_prompt),
            ),
            min_size=1,
            max_size=8,
        )
    )
    largest = max(request.prompt_len + request.max_tokens for request in requests)
    num_blocks = 1 + draw(st.integers(-(-largest // block_size), 2 * max_model_len // block_size))
    limits = Limits(num_blocks, block_size, max_model_len, draw(st.integers(1, 6)), budget)
    return limits, requests


class SchedulerConformance(ConformanceSuite):
    """The scheduler contract, on a simulated engine.

    Capability flags:
    - ``supports_chunked_prefill``: a prompt longer than the token budget still runs (in chunks).
    - ``preempts_when_out_of_blocks``: when running sequences outgrow the pool, some are preempted (recompute).
    - ``starvation_free``: a request the policy disfavors (a long prompt, a lower priority, its own tenant) is still
      served while an overload of favored requests keeps arriving. Shortest-job-first, say, declares False.
    """

    kind = "scheduler"
    capability_flags = ("supports_chunked_prefill", "preempts_when_out_of_blocks", "starvation_free")
    supports_chunked_prefill: ClassVar[bool] = True
    preempts_when_out_of_blocks: ClassVar[bool] = True
    starvation_free: ClassVar[bool] = True
    allocator_name: ClassVar[str] = "paged"
    prefix_cache_name: ClassVar[str] = "none"
    hit_prefix_cache_name: ClassVar[str] = "hash"  # where the suite needs prefix hits

    @pytest.fixture
    def scheduler_factory(self) -> SchedulerFactory:
        """Makes a fresh scheduler for given limits. Override to construct yours directly."""
        return self.make_scheduler_factory(self.impl_name)

    @pytest.fixture
    def kv_cache_factory(self) -> KVCacheFactory:
        """Block tables over the registered ``allocator_name`` and ``prefix_cache_name``."""
        return self.make_kv_cache_factory(self.prefix_cache_name)

    def make_kv_cache_factory(self, prefix_cache_name: str) -> KVCacheFactory:
        registry = get_registry()
        allocator_class = registry.load("allocator", self.allocator_name)
        cache_class = registry.load("prefix_cache", prefix_cache_name)

        def make(limits: Limits) -> KVCacheManager:
            allocator = allocator_class(limits.num_blocks, limits.block_size, limits.max_model_len)
            return KVCacheManager(allocator, cache_class(allocator, limits.block_size), limits.max_model_len)

        return make

    @pytest.fixture(params=["own", "hits"])
    def any_cache_engine_factory(self, request, scheduler_factory) -> Callable[[Limits], SimulatedEngine]:
        """The suite's own prefix cache, then ``hit_prefix_cache_name`` (prefix hits reach the scheduler)."""
        name = self.prefix_cache_name if request.param == "own" else self.hit_prefix_cache_name
        kv_cache_factory = self.make_kv_cache_factory(name)
        return lambda limits: SimulatedEngine(scheduler_factory(limits), kv_cache_factory(limits), limits)

    @pytest.fixture
    def engine_factory(self, scheduler_factory, kv_cache_factory) -> Callable[[Limits], SimulatedEngine]:
        return lambda limits: SimulatedEngine(scheduler_factory(limits), kv_cache_factory(limits), limits)

    def make_scheduler_factory(self, name: str | None) -> SchedulerFactory:
        implementation = self.load_implementation(name)

        def make(limits: Limits) -> Scheduler:
            return implementation(
                self.implementation_config(
                    name, max_num_seqs=limits.max_num_seqs, max_num_batched_tokens=limits.max_num_batched_tokens
                )
            )

        return make

    def test_single_request_finishes(self, engine_factory):
        (seq,) = engine_factory(Limits()).run([Request(prompt_len=10, max_tokens=5)])
        assert seq.num_output_tokens == 5

    def test_budget_and_sequence_limit_hold_every_step(self, engine_factory):
        limits = Limits(max_num_seqs=3, max_num_batched_tokens=12)
        workload = [Request(prompt_len=3 + 2 * index, max_tokens=4 + index % 3) for index in range(10)]
        engine_factory(limits).run(workload)

    def test_late_arrivals_all_finish(self, engine_factory):
        workload = [Request(prompt_len=5 + index, max_tokens=6, arrival_step=3 * index) for index in range(8)]
        engine_factory(Limits(max_num_seqs=4, max_num_batched_tokens=16)).run(workload)

    def test_prompt_longer_than_the_budget_finishes(self, engine_factory):
        if not self.supports_chunked_prefill:
            pytest.skip("supports_chunked_prefill is False")
        limits = Limits(max_num_batched_tokens=8)
        sequences = engine_factory(limits).run([Request(prompt_len=30, max_tokens=3), Request(4, 8)])
        assert [seq.num_output_tokens for seq in sequences] == [3, 8]

    def test_tiny_pool_preempts_and_everyone_still_finishes(self, engine_factory):
        # Four requests of 6 blocks each over a pool of 9: they can all start, not all finish side by side.
        limits = Limits(num_blocks=10, block_size=4, max_num_seqs=4, max_num_batched_tokens=32)
        sequences = engine_factory(limits).run([Request(prompt_len=8, max_tokens=16) for _ in range(4)])
        assert all(seq.num_output_tokens == 16 for seq in sequences)
        if self.preempts_when_out_of_blocks:
            assert sum(seq.num_preemptions for seq in sequences) > 0, "no preemption although the pool ran out"

    def test_prefix_hits_reach_the_scheduler(self, scheduler_factory):
        """Requests whose first 16 tokens are cached arrive with them computed: the plan counts only what is left
        (a scheduler that plans the whole prompt writes past the sequence's tokens and blows the budget)."""
        limits = Limits(max_num_seqs=4, max_num_batched_tokens=24)
        engine = SimulatedEngine(
            scheduler_factory(limits), self.make_kv_cache_factory(self.hit_prefix_cache_name)(limits), limits
        )
        first = Request(prompt_len=20, max_tokens=4, shared_prefix_len=16)
        later = [
            Request(prompt_len=18 + index, max_tokens=3, arrival_step=40, shared_prefix_len=16) for index in range(3)
        ]
        sequences = engine.run([first, *later])
        assert [seq.num_output_tokens for seq in sequences] == expected_outputs([first, *later])
        hits = [seq.num_cached_prompt_tokens for seq in sequences[1:]]
        assert all(hit >= 16 for hit in hits), f"cached prompt tokens per later request: {hits}"

    @pytest.mark.parametrize("max_num_seqs", [8, 2])
    def test_samples_of_one_request_share_its_prompt(self, scheduler_factory, kv_cache_factory, max_num_seqs):
        """``n = 5`` samples of a 16-token prompt: followers are admitted once ``view.is_ready`` and compute only
        the prompt's last block; with ``max_num_seqs`` 2 the later ones start after the leader has finished (its
        prompt stays pinned for them, and is given back at the end)."""
        limits = Limits(max_num_seqs=max_num_seqs, max_num_batched_tokens=32)
        engine = SimulatedEngine(scheduler_factory(limits), kv_cache_factory(limits), limits)
        workload = [Request(prompt_len=16, max_tokens=4, n=5)]
        sequences = engine.run(workload)
        assert [seq.num_output_tokens for seq in sequences] == expected_outputs(workload)
        alone = 5 * (16 + 3)
        shared = 16 + 3 + 4 * (4 + 3)  # followers share 12 of the 16 prompt tokens (3 full blocks)
        assert engine.num_scheduled_tokens == shared, (
            f"{engine.num_scheduled_tokens} tokens computed for 5 samples ({shared} when followers wait for "
            f"view.is_ready and share the leader's prompt, {alone} when each computes it)"
        )

    def test_an_overload_of_favored_requests_does_not_starve_one(self, engine_factory):
        """60 short requests arrive every other step, more than two slots can serve, so a backlog builds; at step 10
        one request every policy here disfavors arrives (a 24-token prompt, priority 1, its own tenant): it must
        finish before the stream stops arriving, not only once the backlog has drained."""
        if not self.starvation_free:
            pytest.skip("starvation_free is False")
        limits = Limits(num_blocks=64, max_num_seqs=2, max_num_batched_tokens=16)
        stream = [Request(prompt_len=4, max_tokens=6, arrival_step=2 * index, tenant="stream") for index in range(60)]
        patient = Request(prompt_len=24, max_tokens=4, arrival_step=10, priority=1, tenant="patient")
        engine = engine_factory(limits)
        sequences = engine.run([*stream, patient])
        assert [seq.num_output_tokens for seq in sequences] == expected_outputs([*stream, patient])
        last_arrival = stream[-1].arrival_step
        served_by_then = engine.finished.index(sequences[-1])
        assert engine.finish_step[sequences[-1]] < last_arrival, (
            f"the disfavored request finished at step {engine.finish_step[sequences[-1]]}, after the last of the "
            f"stream arrived (step {last_arrival}; {served_by_then} stream requests were served before it)"
        )

    def test_random_workloads_finish_within_the_limits(self, any_cache_engine_factory):
        @self.hypothesis_settings
        @given(scenario=scenarios(chunked_prefill=self.supports_chunked_prefill))
        def serve_to_completion(scenario: tuple[Limits, list[Request]]) -> None:
            limits, workload = scenario
            sequences = any_cache_engine_factory(limits).run(workload)
            assert [seq.num_output_tokens for seq in sequences] == expected_outputs(workload)

        serve_to_completion()
