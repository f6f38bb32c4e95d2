"""``scheduler: sjf``: shortest job first, judged by the prompt tokens still to compute.

Short prompts finish their prefill sooner, so admitting them first lowers the mean time to first token; a long prompt
may wait behind a stream of short ones (no aging bound: this is an example, not a production policy).
"""

from __future__ import annotations

from infer import hookimpl
from infer.scheduler import BudgetedScheduler, SchedulerConfig, SchedulerView
from infer.sequence import Sequence


class SJFSchedulerConfig(SchedulerConfig):
    """Config section ``scheduler`` for ``name: sjf``; nothing beyond the budget limits."""

    name: str = "sjf"


class SJFScheduler(BudgetedScheduler):
    """Admits waiting requests with the fewest uncached prompt tokens first (ties: arrival order).

    Only the order changes: token budget, sequence limit, chunked prefill and preemption stay the core's
    ``BudgetedScheduler`` mechanics.
    """

    config_model = SJFSchedulerConfig
    # A long prompt waits behind every shorter one: the scheduler suite's starvation check does not apply.
    starvation_free = False

    def order_waiting(self, view: SchedulerView) -> list[Sequence]:
        def remaining_work(seq: Sequence) -> tuple[int, int]:
            return seq.num_tokens - view.cached_prefix_len(seq), seq.arrival_order

        return sorted(view.waiting, key=remaining_work)


@hookimpl
def register_schedulers(register):
    register(
        "sjf",
        "infer_example_plugin.sjf:SJFScheduler",
        description="Shortest job first: fewest uncached prompt tokens admitted first",
    )
