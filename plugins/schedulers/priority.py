"""``scheduler: priority``: lower ``SamplingParams.priority`` first (vLLM's convention), aging so nothing starves."""

from __future__ import annotations

from pydantic import Field

from infer.scheduler import BudgetedScheduler, SchedulerConfig, SchedulerView
from infer.sequence import Sequence


class PrioritySchedulerConfig(SchedulerConfig):
    name: str = "priority"
    aging_s: float = Field(
        10.0,
        gt=0,
        description="Seconds of waiting worth one priority level: a request one "
        "level lower is served as if it had arrived this much later.",
    )


class PriorityScheduler(BudgetedScheduler):
    """Admits waiting requests by effective priority, ``priority - waited / aging_s`` (lowest first; ties: arrival
    order), and preempts the lowest-priority running sequence first (the largest ``priority``; among equals the
    config's ``preemption`` choice).

    Aging bounds waiting: two requests waiting side by side keep their order only while their priority gap outweighs
    their arrival gap, so a request ``d`` levels lower waits at most about ``d * aging_s`` seconds longer than it would
    under FCFS, however many favored requests keep arriving. Waiting requests never preempt running ones (the budgeted
    base's head-of-line rule); priority decides who is admitted and who gives way when blocks run out.
    """

    config_model = PrioritySchedulerConfig
    config: PrioritySchedulerConfig

    def order_waiting(self, view: SchedulerView) -> list[Sequence]:
        def effective(seq: Sequence) -> tuple[float, int]:
            return seq.params.priority - (view.now - seq.arrival_time) / self.config.aging_s, seq.arrival_order

        return sorted(view.waiting, key=effective)

    def pick_victim(self, view: SchedulerView, scheduled: dict[Sequence, int]) -> Sequence:
        lowest = max(seq.params.priority for seq in view.running)
        return self.preemption_choice([seq for seq in view.running if seq.params.priority == lowest])
