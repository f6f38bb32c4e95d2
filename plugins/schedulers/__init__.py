"""infer's built-in schedulers: registered here, each as a lazy ``"module:Class"`` target, so that
listing them (``infer plugins``, ``infer --help``) imports none of their modules; a module loads when a config
selects it."""

from __future__ import annotations

from infer import hookimpl

INFER_PLUGIN_API = 2


@hookimpl
def register_schedulers(register):
    register(
        "fcfs",
        "infer.plugins.schedulers.fcfs:FCFSScheduler",
        description="First come, first served, with chunked prefill and preemption",
    )
    register(
        "lpm",
        "infer.plugins.schedulers.lpm:LPMScheduler",
        description="Longest cached prefix first, FCFS above 128 waiting, in-batch prefix holding, aging bound",
    )
    register(
        "priority",
        "infer.plugins.schedulers.priority:PriorityScheduler",
        description="Lowest priority value first, aging by waiting time, lowest priority preempted first",
    )
    register(
        "hrrn",
        "infer.plugins.schedulers.hrrn:HRRNScheduler",
        description="Highest response ratio next: (waited + service) / service",
    )
    register(
        "fair",
        "infer.plugins.schedulers.fair:FairScheduler",
        description="Per-tenant fairness by virtual token counters (VTC, OSDI'24)",
    )
    register(
        "deadline",
        "infer.plugins.schedulers.deadline:DeadlineScheduler",
        description="Earliest TTFT deadline (arrival + ttft_slo_s) first",
    )
