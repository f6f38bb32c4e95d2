"""``scheduler: hrrn``: highest response ratio next, ``(waited + service) / service``."""

from __future__ import annotations

from pydantic import Field

from infer.scheduler import BudgetedScheduler, SchedulerConfig, SchedulerView
from infer.sequence import Sequence


class HRRNSchedulerConfig(SchedulerConfig):
    name: str = "hrrn"
    prefill_token_cost: float = Field(
        0.02,
        ge=0,
        description="Service time of one prompt token still to compute, in decode steps (a request's "
        "service is its remaining output tokens plus this times its uncomputed prompt).",
    )


class HRRNScheduler(BudgetedScheduler):
    """Admits the waiting request with the highest response ratio ``1 + waited / service`` first (ties: the shorter
    service, then arrival order): short jobs go early as under shortest-job-first, and a long one's ratio keeps
    growing while it waits, so it cannot starve.

    ``service`` estimates the time the request needs once running: its remaining ``max_tokens`` (one decode step
    each) plus ``prefill_token_cost`` per prompt token still to compute. The ratio's order does not depend on the
    units of either, only on their proportion. Prefix hits are not looked up (the lookup per waiting request per step
    is what bounds LPM's queue; this order costs a sort).
    """

    config_model = HRRNSchedulerConfig
    config: HRRNSchedulerConfig

    def service(self, seq: Sequence) -> float:
        remaining_output = max(seq.params.max_tokens - seq.num_output_tokens, 1)
        return remaining_output + self.config.prefill_token_cost * seq.num_uncomputed_tokens

    def order_waiting(self, view: SchedulerView) -> list[Sequence]:
        def ratio(seq: Sequence) -> tuple[float, float, int]:
            service = self.service(seq)
            return -(view.now - seq.arrival_time) / service, service, seq.arrival_order

        return sorted(view.waiting, key=ratio)
