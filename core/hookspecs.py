"""pluggy hook specifications: the plugin author's reference.

A plugin is a module listed under the entry-point group ``infer.plugins`` in its distribution's metadata::

    [project.entry-points."infer.plugins"]
    "my_dist.schedulers.sjf" = "my_dist.sjf"

The module implements any of these hooks with ``@infer.hookimpl``. Registration hooks receive a ``register``
callback: ``register(name, target, config=None, description="")`` where ``target`` is the class or a lazy
``"module:Class"`` string (imported only when a config selects it) and ``config`` is an optional pydantic model for
the component's config section (default: the class's ``config_model``). The class must subclass the kind's contract:
``infer.allocator.Allocator``, ``infer.prefix_cache.PrefixCache``, ``infer.scheduler.Scheduler``,
``infer.attention.AttentionBackend``, ``infer.drafter.Drafter`` or ``infer.guide.Guide``.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("infer")
hookimpl = pluggy.HookimplMarker("infer")


@hookspec
def register_allocators(register):
    """Register KV block allocators (config section ``allocator``; contract ``infer.allocator.Allocator``)."""


@hookspec
def register_prefix_caches(register):
    """Register prefix caches (config section ``prefix_cache``; contract ``infer.prefix_cache.PrefixCache``)."""


@hookspec
def register_schedulers(register):
    """Register schedulers (config section ``scheduler``; contract ``infer.scheduler.Scheduler``; most policies
    subclass ``infer.scheduler.BudgetedScheduler`` and override ``order_waiting``)."""


@hookspec
def register_attention_backends(register):
    """Register attention backends (config section ``attention``; contract ``infer.attention.AttentionBackend``)."""


@hookspec
def register_drafters(register):
    """Register speculative-decoding drafters (config section ``drafter``; contract ``infer.drafter.Drafter``)."""


@hookspec
def register_guides(register):
    """Register constrained-decoding guides (config section ``guide``; contract ``infer.guide.Guide``)."""


@hookspec
def register_commands(cli):
    """Add subcommands to the ``infer`` click group (``cli.add_command(...)``). A command may not shadow a core one."""


@hookspec
def engine_started(engine):
    """Observer: the engine has loaded the model and sized the KV pool. ``engine.stats`` and ``engine.config`` are
    available."""


@hookspec
def step_finished(engine, step_stats):
    """Observer: one engine step finished. ``step_stats`` holds the step's counts and timing (see
    ``infer.engine.engine.StepStats``). Keep it cheap: it runs every step."""


@hookspec
def request_finished(engine, output):
    """Observer: a request finished (``output`` is the ``infer.outputs.RequestOutput`` returned to the caller)."""
