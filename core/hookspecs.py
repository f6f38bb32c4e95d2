"""pluggy hook specifications: the plugin author's reference.

A plugin is a module listed under the entry-point group ``infer.plugins`` in its distribution's metadata::

    [project.entry-points."infer.plugins"]
    "my_dist.schedulers.sjf" = "my_dist.sjf"

The module implements any of these hooks with ``@infer.hookimpl``. Registration hooks receive a ``register``
callback: ``register(name, target, config=None, description="")`` where ``target`` is the class or a lazy
``"module:Class"`` string (imported only when a config selects it) and ``config`` is an optional pydantic model for
the component's config section (default: the class's ``config_model``). The class must subclass the kind's contract:
``infer.allocator.Allocator``, ``infer.prefix_cache.PrefixCache``, ``infer.scheduler.Scheduler``,
``infer.attention.AttentionBackend``, ``infer.drafter.Drafter``, ``infer.guide.Guide`` or, for a model family,
``infer.model.ModelArchitecture`` (which has no config section: the loader picks the family that serves a
checkpoint's ``model_type``; ``model.architecture`` names one explicitly) or, for a tool-call parser,
``infer.tool_parser.ToolParser`` (no config section either: ``server.tool_parser`` names one, or ``auto``).

Plugin API version: declare the version of these hooks and contracts your package is written to, as
``INFER_PLUGIN_API = 2`` in the entry-point module or in a package above it (``my_dist/__init__.py``); a package that
declares none is version 1. ``infer.PLUGIN_API_VERSION`` is the newest version this infer loads: it refuses a plugin
that declares a newer one, in one line saying to upgrade infer, and ``infer plugins`` shows each plugin's version.
Version 2 changed two contracts; code written to version 1 keeps working, with a ``DeprecationWarning``, until
version 3 drops it:

- a drafter is built as ``cls(config, context)`` (an ``infer.drafter.DrafterContext``): declare
  ``__init__(self, config=None, context=None)`` and call ``super().__init__(config, context)``. A drafter whose
  ``__init__`` takes only ``config`` is built as ``cls(config)``.
- the observer hooks ``engine_started``, ``step_finished`` and ``request_finished`` receive records (``stats``,
  ``config``, ``step_stats``, ``output``) instead of the engine; an implementation that names ``engine`` still gets
  it. An implementation that names an argument its hook does not pass is refused when it is loaded.
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
def register_models(register):
    """Register model families (contract ``infer.model.ModelArchitecture``; no config section: the loader picks the
    family whose ``model_types``/``architectures`` match a checkpoint's config, a third party's before infer's own,
    or the one ``model.architecture`` names)."""


@hookspec
def register_tool_parsers(register):
    """Register tool-call parsers (contract ``infer.tool_parser.ToolParser``; no config section: the server takes
    the one ``server.tool_parser`` names, or with ``auto`` the first, by ``auto_priority``, whose ``detects`` accepts
    the model's chat template)."""


@hookspec
def register_commands(cli):
    """Add subcommands to the ``infer`` click group (``cli.add_command(...)``). A command may not shadow a core one."""


@hookspec
def engine_started(stats, config, engine):
    """Observer: the engine has loaded the model and sized the KV pool. ``stats`` is the engine's running totals
    (``infer.outputs.EngineStats``, updated in place as it runs) and ``config`` the resolved ``InferConfig``.

    ``engine`` (the whole engine) is deprecated: observers receive records, not the engine. An implementation that
    still names it gets it, with a ``DeprecationWarning`` when it is registered; plugin API version 3 drops it."""


@hookspec
def step_finished(step_stats, engine):
    """Observer: one engine step finished. ``step_stats`` holds the step's counts and timing
    (``infer.outputs.StepStats``). Keep it cheap: it runs every step. ``engine`` is deprecated (see
    ``engine_started``)."""


@hookspec
def request_finished(output, engine):
    """Observer: a request finished (``output`` is the ``infer.outputs.RequestOutput`` returned to the caller).
    ``engine`` is deprecated (see ``engine_started``)."""
