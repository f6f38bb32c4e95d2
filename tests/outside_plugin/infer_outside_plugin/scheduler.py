"""``scheduler: outside-longest``: the waiting request with the longest prompt is admitted first."""

from __future__ import annotations

from infer.scheduler import BudgetedScheduler, SchedulerView
from infer.sequence import Sequence


class LongestPromptFirstScheduler(BudgetedScheduler):
    """Longest prompt first (arrival order among equals). A short prompt may wait behind a stream of long ones."""

    starvation_free = False

    def order_waiting(self, view: SchedulerView) -> list[Sequence]:
        return sorted(view.waiting, key=lambda seq: len(seq.prompt_token_ids), reverse=True)
