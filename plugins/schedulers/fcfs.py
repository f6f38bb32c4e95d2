"""``scheduler: fcfs``: first come, first served (the budget mechanics are the core's ``BudgetedScheduler``)."""

from __future__ import annotations

from infer import hookimpl
from infer.scheduler import BudgetedScheduler


class FCFSScheduler(BudgetedScheduler):
    """Admits waiting requests in arrival order (preempted ones first); preempts the most recently admitted."""


@hookimpl
def register_schedulers(register):
    register("fcfs", FCFSScheduler, description="First come, first served, with chunked prefill and preemption")
