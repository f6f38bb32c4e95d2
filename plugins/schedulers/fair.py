"""``scheduler: fair``: per-tenant fairness by virtual token counters (VTC, "Fairness in Serving Large Language
Models", Sheng et al., OSDI'24)."""

from __future__ import annotations

from pydantic import Field

from infer.scheduler import BudgetedScheduler, SchedulerConfig, SchedulerView, StepPlan
from infer.sequence import Sequence

DEFAULT_TENANT = ""  # requests that name no tenant share one


class FairSchedulerConfig(SchedulerConfig):
    name: str = "fair"
    prompt_token_weight: float = Field(1.0, ge=0, description="Counter charge per prompt token computed.")
    output_token_weight: float = Field(2.0, ge=0, description="Counter charge per output (decode) token computed.")


def tenant_of(seq: Sequence) -> str:
    return seq.params.tenant if seq.params.tenant is not None else DEFAULT_TENANT


class FairScheduler(BudgetedScheduler):
    """Serves tenants (``SamplingParams.tenant``; the server takes it from the request's ``user`` field or its API
    key) in proportion, whatever each sends: every tenant has a virtual token counter, charged
    ``prompt_token_weight`` per prompt token and ``output_token_weight`` per decode token its sequences compute
    (the paper's weights 1 and 2), and the waiting request admitted next is the oldest one of the tenant whose
    counter is lowest (ties: the older head request).

    A tenant that returns after having nothing queued has its counter lifted to the lowest counter among the tenants
    still active (the paper's rule), so idle time banks no credit; a tenant that never leaves keeps its share, so
    nothing starves: a flooding tenant's counter rises past every other's, and each waiting tenant's turn comes.
    Counters persist for the engine's life; only tenants with requests take part in the order.
    """

    config_model = FairSchedulerConfig
    config: FairSchedulerConfig

    def __init__(self, config: FairSchedulerConfig | None = None):
        super().__init__(config)
        self.counters: dict[str, float] = {}
        self._active: set[str] = set()

    def schedule(self, view: SchedulerView) -> StepPlan:
        self._lift_returning_tenants(view)
        plan = super().schedule(view)
        for seq, num_new in plan.scheduled:
            decoding = seq.num_tokens - seq.num_computed_tokens == 1
            weight = self.config.output_token_weight if decoding else self.config.prompt_token_weight
            self.counters[tenant_of(seq)] += weight * num_new
        return plan

    def _lift_returning_tenants(self, view: SchedulerView) -> None:
        active = {tenant_of(seq) for seq in (*view.waiting, *view.running)}
        staying = active & self._active
        floor = min((self.counters[tenant] for tenant in staying), default=None)
        for tenant in active - self._active:
            counter = self.counters.get(tenant, 0.0)
            self.counters[tenant] = counter if floor is None else max(counter, floor)
        self._active = active

    def order_waiting(self, view: SchedulerView) -> list[Sequence]:
        """Admission order if each admitted request were charged its prompt at once: repeatedly the head of the
        lowest-counter tenant's queue."""
        queues: dict[str, list[Sequence]] = {}
        for seq in view.waiting:
            queues.setdefault(tenant_of(seq), []).append(seq)
        counters = {tenant: self.counters[tenant] for tenant in queues}
        heads = dict.fromkeys(queues, 0)
        ordered: list[Sequence] = []
        while heads:
            tenant = min(heads, key=lambda name: (counters[name], queues[name][heads[name]].arrival_order))
            seq = queues[tenant][heads[tenant]]
            ordered.append(seq)
            counters[tenant] += self.config.prompt_token_weight * seq.num_uncomputed_tokens
            heads[tenant] += 1
            if heads[tenant] == len(queues[tenant]):
                del heads[tenant]
        return ordered
