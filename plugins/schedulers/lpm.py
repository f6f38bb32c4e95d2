"""``scheduler: lpm``: longest cached prefix first (SGLang's LPM), with in-batch prefix holding and an aging bound."""

from __future__ import annotations

from pydantic import Field

from infer.scheduler import BudgetedScheduler, SchedulerConfig, SchedulerView, StepPlan
from infer.sequence import Sequence


class LPMSchedulerConfig(SchedulerConfig):
    name: str = "lpm"
    fcfs_threshold: int = Field(
        128, ge=0, description="Above this many waiting requests, order them FCFS (bounds the cost of prefix lookups)."
    )
    hold_min_prefix: int = Field(
        32, ge=1, description="Hold a request back when it shares this many uncached tokens with one admitted first."
    )
    max_wait_steps: int = Field(
        64, ge=0, description="Times a request may be passed over before it goes first (the starvation bound)."
    )


class LPMScheduler(BudgetedScheduler):
    """Admits the waiting request with the longest cached prefix first (ties: earlier arrival), as SGLang's ``lpm``.

    In-batch prefix holding: when waiting requests share a prefix of at least ``hold_min_prefix`` tokens beyond what
    the cache holds for them, only the first (in this order) is tried; the others are held back this step, to find
    that prefix cached once the first has computed it (the engine inserts full blocks after every step). A running
    request still in prefill counts as a first, since it is about to compute the prefix.

    Above ``fcfs_threshold`` waiting requests the order is FCFS (aged requests still first) and nobody is held
    (SGLang's 128 cut-over; it bounds the cost of prefix lookups, not waiting).

    Aging bound, exactly: a step *passes over* a waiting request when, at the end of the step, it is still waiting
    and either it was held or a request that arrived after it was admitted. A request passed over ``max_wait_steps``
    times is aged: from then on it is tried before every request that is not aged, and never held; aged requests go
    in arrival order. So an aged request waits only for aged requests that arrived before it, and for the budget,
    sequence limit and free blocks, which bind FCFS too. ``max_wait_steps: 0`` orders everything by arrival.
    """

    config_model = LPMSchedulerConfig
    config: LPMSchedulerConfig

    def __init__(self, config: LPMSchedulerConfig | None = None):
        super().__init__(config)
        self._held: set[Sequence] = set()

    def schedule(self, view: SchedulerView) -> StepPlan:
        candidates = self._ready_waiting(view)
        self._held = set()
        plan = super().schedule(view)
        self._count_passed_over(view, candidates)
        return plan

    def order_waiting(self, view: SchedulerView) -> list[Sequence]:
        candidates = self._ready_waiting(view)
        aged = sorted(
            (seq for seq in candidates if seq.num_times_passed_over >= self.config.max_wait_steps),
            key=lambda seq: seq.arrival_order,
        )
        others = [seq for seq in candidates if seq.num_times_passed_over < self.config.max_wait_steps]
        if len(view.waiting) > self.config.fcfs_threshold:
            return aged + others
        cached = {seq: view.cached_prefix_len(seq) for seq in others}
        others.sort(key=lambda seq: (-cached[seq], seq.arrival_order))
        leaders = [seq for seq in view.running if seq.is_prefill] + aged
        return aged + self._hold_shared_prefixes(others, cached, leaders)

    @staticmethod
    def _ready_waiting(view: SchedulerView) -> list[Sequence]:
        """Waiting sequences the policy chooses among (an n > 1 follower waits for its leader, not for the policy)."""
        return [seq for seq in view.waiting if view.is_ready(seq)]

    def _hold_shared_prefixes(
        self, ordered: list[Sequence], cached: dict[Sequence, int], leaders: list[Sequence]
    ) -> list[Sequence]:
        """``ordered`` without the requests that share ``hold_min_prefix`` uncached tokens with a leader or with a
        request kept before them; those are recorded in ``self._held``."""
        # Any shared prefix this long starts with the same hold_min_prefix tokens: bucket by them, compare within.
        leaders_by_start: dict[tuple[int, ...], list[list[int]]] = {}
        for leader in leaders:
            tokens = leader.token_ids
            leaders_by_start.setdefault(tuple(tokens[: self.config.hold_min_prefix]), []).append(tokens)
        kept = []
        for seq in ordered:
            tokens = seq.token_ids
            start = tuple(tokens[: self.config.hold_min_prefix])
            if self._shares_uncached_prefix(tokens, cached[seq], leaders_by_start.get(start, [])):
                self._held.add(seq)
                continue
            kept.append(seq)
            leaders_by_start.setdefault(start, []).append(tokens)
        return kept

    def _shares_uncached_prefix(self, tokens: list[int], num_cached: int, leaders: list[list[int]]) -> bool:
        length = num_cached + self.config.hold_min_prefix
        if length > len(tokens):
            return False
        prefix = tokens[:length]
        return any(leader[:length] == prefix for leader in leaders)

    def _count_passed_over(self, view: SchedulerView, candidates: list[Sequence]) -> None:
        still_waiting = set(view.waiting)
        admitted = [seq for seq in candidates if seq not in still_waiting]
        latest_admitted = max((seq.arrival_order for seq in admitted), default=-1)
        for seq in candidates:
            if seq in still_waiting and (seq in self._held or seq.arrival_order < latest_admitted):
                seq.num_times_passed_over += 1
