"""``scheduler: deadline``: earliest TTFT deadline first (``SamplingParams.ttft_slo_s`` after arrival)."""

from __future__ import annotations

from pydantic import Field

from infer.scheduler import BudgetedScheduler, SchedulerConfig, SchedulerView
from infer.sequence import Sequence


class DeadlineSchedulerConfig(SchedulerConfig):
    name: str = "deadline"
    default_ttft_slo_s: float = Field(10.0, gt=0, description="TTFT target of requests that set none (seconds).")


class DeadlineScheduler(BudgetedScheduler):
    """Admits waiting requests by deadline, ``arrival + ttft_slo_s`` (earliest first; ties: arrival order), the
    SLO-aware order: a request with a tight target overtakes relaxed ones that arrived earlier, exactly as far as
    its target is tighter.

    Every request has a deadline (``default_ttft_slo_s`` for those without a target), so nothing starves: a deadline
    is a fixed point in time, and only requests that arrive before it can overtake it. A preempted sequence's
    deadline has passed, so it is readmitted first. Missed deadlines are still served in order (no request is
    dropped); ``infer bench`` reports the share that met theirs.
    """

    config_model = DeadlineSchedulerConfig
    config: DeadlineSchedulerConfig

    def deadline(self, seq: Sequence) -> float:
        target = seq.params.ttft_slo_s
        return seq.arrival_time + (target if target is not None else self.config.default_ttft_slo_s)

    def order_waiting(self, view: SchedulerView) -> list[Sequence]:
        return sorted(view.waiting, key=lambda seq: (self.deadline(seq), seq.arrival_order))
