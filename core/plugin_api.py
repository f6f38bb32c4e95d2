"""The plugin API's versions, and the shim that keeps drafters written to version 1 working.

A plugin package declares the version it is written to as ``INFER_PLUGIN_API = 2`` in its entry-point module or in
a package above it; a package that declares none is version 1. The registry, which loads plugins, checks the
declaration against ``PLUGIN_API_VERSION`` and refuses a newer one in one line that says to upgrade infer.

- Version 1: the contracts before versioning. Drafters were built as ``cls(config)``; observer hooks received
  ``engine``.
- Version 2: drafters are built as ``cls(config, context)`` (``infer.drafter.DrafterContext``); observer hooks
  receive records (``stats``, ``config``, ``step_stats``, ``output``). A drafter whose ``__init__`` takes only the
  config is still built as ``cls(config)`` (``build_drafter``), and an observer that names ``engine`` still gets it
  (the registry warns when it registers one), each with a ``DeprecationWarning``. Version 3 drops both old forms.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from importlib.metadata import PackageNotFoundError, packages_distributions, version
from typing import TYPE_CHECKING, Any

from infer.registry import OLD_FORMS_DROPPED_IN, PLUGIN_API_VERSION, PluginDeprecationWarning, PluginError

if TYPE_CHECKING:
    from infer.drafter import Drafter, DrafterConfig, DrafterContext

__all__ = ["PLUGIN_API_VERSION", "build_drafter"]

DRAFTER_FORM = "__init__(self, config=None, context=None), calling super().__init__(config, context)"


def build_drafter(cls: type[Drafter], config: DrafterConfig | None, context: DrafterContext | None) -> Drafter:
    """``cls(config, context)``, how plugin API 2 builds a drafter; a class written to version 1, whose
    ``__init__`` takes only the config, as ``cls(config)`` with a ``DeprecationWarning``. ``PluginError`` when
    ``__init__`` takes neither."""
    arguments = _init_arguments(cls)
    if arguments == 2:
        return cls(config, context)
    label = _label(cls, config)
    if arguments == 1:
        warnings.warn(
            f"drafter {label}: __init__ takes only a config, the form of plugin API 1; drafters are built as "
            f"cls(config, context): declare {DRAFTER_FORM}. It is built as cls(config) until plugin API "
            f"{OLD_FORMS_DROPPED_IN}, which drops the old form",
            PluginDeprecationWarning,
            stacklevel=2,
        )
        return cls(config)
    raise PluginError(
        f"drafter {label} cannot be built: its __init__{inspect.signature(cls)} takes neither (config, context) nor "
        f"(config); since plugin API 2 drafters are built as cls(config, context): declare {DRAFTER_FORM} (see "
        f"infer.drafter.Drafter and infer.hookspecs)"
    )


@functools.cache
def _init_arguments(cls: type) -> int:
    """How many of (config, context) ``cls`` takes positionally: 2, 1 (plugin API 1's form) or 0."""
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # no signature to read: build it the current way
        return 2
    for count in (2, 1):
        try:
            signature.bind(*[None] * count)
        except TypeError:
            continue
        return count
    return 0


def _label(cls: type, config: Any) -> str:
    """``"repeat" (my_drafters.repeat:RepeatDrafter from my-drafters 0.1.0)``: the registered name, the class and
    the installed distribution that holds it."""
    name = getattr(config, "name", None)
    where = f"{cls.__module__}:{cls.__qualname__}"
    distributions = packages_distributions().get(cls.__module__.partition(".")[0])
    if distributions:
        try:
            where += f" from {distributions[0]} {version(distributions[0])}"
        except PackageNotFoundError:
            where += f" from {distributions[0]}"
    return f'"{name}" ({where})' if name else where
