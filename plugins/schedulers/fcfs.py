"""``scheduler: fcfs``: first come, first served (the budget mechanics are the core's ``BudgetedScheduler``)."""

from __future__ import annotations

from infer.scheduler import BudgetedScheduler


class FCFSScheduler(BudgetedScheduler):
    """Admits waiting requests in arrival order (preempted ones first); preempts the most recently admitted."""
