"""The plugin registry: finds plugin modules, collects what they register, and loads components by name.

Plugin modules are listed under the entry-point group ``infer.plugins`` (infer registers its own built-ins the same
way). Each module implements registration hooks from ``infer.hookspecs``; every call of its ``register`` callback is
recorded as a ``PluginSpec`` attributed to the module's distribution. Classes given as ``"module:Class"`` strings are
imported only when a config selects them, so listing plugins never imports torch.

Registering a module checks it against the plugin API (``infer.plugin_api`` says what each version changed): the
version it declares (refused when newer than ``PLUGIN_API_VERSION``) and the arguments its hooks take (refused when
its hook does not pass one; a ``DeprecationWarning`` for an observer that still takes ``engine``).

Environment:
    ``INFER_PLUGINS``: ``all`` (default), ``none`` or a comma list of distribution names; third-party distributions
    outside it are not loaded (infer's own always are).
    ``INFER_TRACE_PLUGINS=1``: trace every hook call on stderr.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pluggy

from infer import hookspecs

if TYPE_CHECKING:
    import click
    from pydantic import BaseModel

PROJECT = "infer"
ENTRY_POINT_GROUP = "infer.plugins"
NAME_PATTERN = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
# The plugin API version this infer implements, and the module attribute a plugin package declares the version it is
# written to with (in its entry-point module or a package above it; none declared: version 1).
PLUGIN_API_VERSION = 2
API_DECLARATION = "INFER_PLUGIN_API"
# What observer hooks still pass to implementations written to plugin API 1, and the version that drops version 1's
# forms (this argument, and drafters built from a config alone).
DEPRECATED_HOOK_ARGUMENT = "engine"
OLD_FORMS_DROPPED_IN = 3


@dataclass(frozen=True, slots=True)
class KindInfo:
    """One plugin kind: its registration hook and its contracts, as ``"module:Class"`` strings.

    The contracts are imported lazily because ``infer.attention`` imports torch.
    """

    hook: str
    contract: str
    config_base: str | None  # None: the kind has no config section (``model``)


KIND_INFO: dict[str, KindInfo] = {
    "allocator": KindInfo("register_allocators", "infer.allocator:Allocator", "infer.allocator:AllocatorConfig"),
    "prefix_cache": KindInfo(
        "register_prefix_caches", "infer.prefix_cache:PrefixCache", "infer.prefix_cache:PrefixCacheConfig"
    ),
    "scheduler": KindInfo("register_schedulers", "infer.scheduler:Scheduler", "infer.scheduler:SchedulerConfig"),
    "attention": KindInfo(
        "register_attention_backends", "infer.attention:AttentionBackend", "infer.attention:AttentionConfig"
    ),
    "drafter": KindInfo("register_drafters", "infer.drafter:Drafter", "infer.drafter:DrafterConfig"),
    "guide": KindInfo("register_guides", "infer.guide:Guide", "infer.guide:GuideConfig"),
    "model": KindInfo("register_models", "infer.model.architecture:ModelArchitecture", None),
    "tool_parser": KindInfo("register_tool_parsers", "infer.tool_parser:ToolParser", None),
}
KINDS: tuple[str, ...] = tuple(KIND_INFO)
# The kinds a config section selects by name (``scheduler.name: lpm``); a model family is picked by the checkpoint.
SECTION_KINDS: tuple[str, ...] = tuple(kind for kind, info in KIND_INFO.items() if info.config_base is not None)


class PluginError(ValueError):
    """A plugin is broken or misused: bad registration, failed import, wrong base class, shadowed command."""


class DuplicatePluginError(PluginError):
    """Two registrations claimed the same name for one kind."""


class UnknownPluginError(PluginError):
    """A config or caller asked for a name no plugin registered."""


class PluginWarning(UserWarning):
    """A plugin module could not be loaded; it fails only if a config selects what it would have registered."""


class PluginDeprecationWarning(DeprecationWarning):
    """A plugin uses a form of the plugin API that a later version drops (the message names the new form). Shown
    by default, unlike other ``DeprecationWarning``s: it is addressed to whoever runs infer with the plugin."""


warnings.filterwarnings("default", category=PluginDeprecationWarning)


@dataclass(frozen=True, slots=True)
class Distribution:
    """The installed package that provides a plugin."""

    name: str
    version: str

    def __str__(self) -> str:
        return f"{self.name} {self.version}"


LOCAL = Distribution("local", "0")


@dataclass(frozen=True, slots=True)
class PluginSpec:
    """One registration: ``target`` is the class or its ``"module:Class"`` path; ``config`` the section model (a
    class, a ``"module:Class"`` path, or None for the class's own ``config_model``); ``plugin_api`` the plugin API
    version the registering module declares (``infer.plugin_api``)."""

    kind: str
    name: str
    target: type | str
    config: type[BaseModel] | str | None
    description: str
    distribution: str
    version: str
    plugin_api: int = 1


@dataclass(frozen=True, slots=True)
class BrokenPlugin:
    """A plugin module that failed to import or to register; shown by ``infer plugins`` and unknown-name errors."""

    plugin: str
    distribution: str
    version: str
    error: str


@dataclass(frozen=True, slots=True)
class PluginCommand:
    """A CLI command added by a plugin's ``register_commands`` hook."""

    command: click.Command
    distribution: Distribution


def normalize_name(name: str) -> str:
    """The canonical form of a plugin name: stripped and lower-cased."""
    return name.strip().lower()


def normalize_distribution(name: str) -> str:
    """PEP 503 form, so ``INFER_PLUGINS=Infer_Dup`` matches ``infer-dup``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def import_object(path: str) -> Any:
    """Import ``"package.module:attribute"`` (the attribute may be dotted)."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ValueError(f'"{path}" is not a "module:attribute" path')
    target = importlib.import_module(module_name)
    for part in attribute.split("."):
        target = getattr(target, part)
    return target


def unknown_name_message(kind: str, name: str, names: Sequence[str]) -> str:
    """``unknown scheduler "lmp"; did you mean "lpm"? available: fcfs, lpm``."""
    close = difflib.get_close_matches(normalize_name(name), names, n=1, cutoff=0.6)
    hint = f'did you mean "{close[0]}"? ' if close else ""
    return f'unknown {kind} "{name}"; {hint}available: {", ".join(names) or "(none)"}'


def _check_kind(kind: str) -> KindInfo:
    if kind not in KIND_INFO:
        raise ValueError(f'unknown plugin kind "{kind}"; kinds: {", ".join(KINDS)}')
    return KIND_INFO[kind]


def _call_hookimpl(impl: pluggy.HookImpl, **kwargs: Any) -> None:
    # pluggy lets an implementation accept a subset of the spec's arguments.
    impl.function(*(kwargs[argument] for argument in impl.argnames))


class Registry:
    """What every loaded plugin registered, by kind and name. Build one with ``get_registry`` (installed plugins) or
    ``Registry.from_plugins`` (plugin modules or objects given directly, for tests)."""

    def __init__(
        self,
        plugin_manager: pluggy.PluginManager,
        distributions: Mapping[str, Distribution],
        broken: Iterable[BrokenPlugin] = (),
    ):
        self._plugin_manager = plugin_manager
        self._distributions = dict(distributions)
        self.broken: list[BrokenPlugin] = list(broken)
        self._specs: dict[str, dict[str, PluginSpec]] = {kind: {} for kind in KINDS}
        self._classes: dict[tuple[str, str], type] = {}
        self._commands: dict[str, PluginCommand] | None = None
        for kind in KINDS:
            self._collect(kind)

    @classmethod
    def from_plugins(cls, plugins: Iterable[object | tuple[object, Distribution]]) -> Registry:
        """A registry over the given plugin modules or objects; a ``(plugin, Distribution)`` pair sets who provides
        it (default ``local 0``). Registration errors raise instead of warning."""
        plugin_manager = new_plugin_manager()
        distributions = {}
        for item in plugins:
            plugin, distribution = item if isinstance(item, tuple) else (item, LOCAL)
            plugin_name = f"{distribution.name}:{getattr(plugin, '__name__', type(plugin).__name__)}"
            register_plugin(plugin_manager, plugin_name, plugin, distribution)
            distributions[plugin_name] = distribution
        return cls(plugin_manager, distributions)

    @classmethod
    def from_entry_points(cls, allowed: frozenset[str] | None = None) -> Registry:
        """A registry over the ``infer.plugins`` entry points; ``allowed`` limits third-party distributions (by
        normalized name, None = all). A module that fails to import or register becomes a ``PluginWarning``."""
        plugin_manager = new_plugin_manager()
        distributions: dict[str, Distribution] = {}
        broken = []
        for entry_point in entry_points(group=ENTRY_POINT_GROUP):
            distribution = _distribution_of(entry_point)
            if not _is_allowed(distribution, allowed):
                continue
            plugin_name = f"{distribution.name}:{entry_point.name}"
            try:
                register_plugin(plugin_manager, plugin_name, entry_point.load(), distribution)
            except Exception as error:  # a third-party module can fail in any way; it must not take infer down
                broken.append(_warn_broken(plugin_name, distribution, error))
                continue
            distributions[plugin_name] = distribution
        return cls(plugin_manager, distributions, broken)

    @property
    def hook(self) -> pluggy.HookRelay:
        """Lifecycle hooks for observers: ``registry.hook.engine_started(engine=...)``, ``step_finished``,
        ``request_finished``."""
        return self._plugin_manager.hook

    def names(self, kind: str) -> list[str]:
        """Registered names of ``kind``, sorted."""
        _check_kind(kind)
        return sorted(self._specs[kind])

    def specs(self, kind: str) -> list[PluginSpec]:
        """Registrations of ``kind``, sorted by name."""
        return [self._specs[kind][name] for name in self.names(kind)]

    def spec(self, kind: str, name: str) -> PluginSpec:
        """The registration of ``name``; ``UnknownPluginError`` with a did-you-mean hint when there is none."""
        _check_kind(kind)
        spec = self._specs[kind].get(normalize_name(name))
        if spec is None:
            raise UnknownPluginError(self._unknown_message(kind, name))
        return spec

    def load(self, kind: str, name: str) -> type:
        """The class registered as ``name``, imported now if it was registered as a path."""
        spec = self.spec(kind, name)
        key = (kind, spec.name)
        if key not in self._classes:
            target = self._resolve(spec, spec.target, "class")
            self._classes[key] = self._checked_subclass(spec, target, KIND_INFO[kind].contract)
        return self._classes[key]

    def config_model(self, kind: str, name: str) -> type[BaseModel]:
        """The pydantic model for ``name``'s config section: its registered ``config`` or its class's
        ``config_model``; always a subclass of the kind's base config (e.g. ``infer.scheduler.SchedulerConfig``)."""
        spec = self.spec(kind, name)
        if KIND_INFO[kind].config_base is None:
            raise PluginError(f"{kind} plugins have no config section")
        if spec.config is None:
            model = self.load(kind, name).config_model
        else:
            model = self._resolve(spec, spec.config, "config")
        return self._checked_subclass(spec, model, KIND_INFO[kind].config_base)

    def plugin_commands(self) -> dict[str, PluginCommand]:
        """Commands added through ``register_commands``, by name; each plugin's hook runs once per registry."""
        if self._commands is None:
            self._commands = self._collect_commands()
        return self._commands

    def _register_callback(self, kind: str, distribution: Distribution, api_version: int) -> Callable[..., None]:
        def register(
            name: str, target: type | str, config: type[BaseModel] | str | None = None, description: str = ""
        ) -> None:
            self._add(_make_spec(kind, name, target, config, description, distribution, api_version))

        return register

    def _add(self, spec: PluginSpec) -> None:
        existing = self._specs[spec.kind].get(spec.name)
        if existing is not None:
            raise DuplicatePluginError(
                f'{spec.kind} "{spec.name}" registered twice: by {spec.distribution} {spec.version} '
                f"and by {existing.distribution} {existing.version}"
            )
        self._specs[spec.kind][spec.name] = spec

    def _collect(self, kind: str) -> None:
        caller = getattr(self._plugin_manager.hook, KIND_INFO[kind].hook)
        for impl in self._ordered(caller.get_hookimpls()):
            distribution = self._distributions[impl.plugin_name]
            register = self._register_callback(kind, distribution, declared_api_version(impl.plugin))
            self._run_hookimpl(impl, distribution, register=register)

    def _collect_commands(self) -> dict[str, PluginCommand]:
        import click

        commands: dict[str, PluginCommand] = {}
        for impl in self._ordered(self._plugin_manager.hook.register_commands.get_hookimpls()):
            distribution = self._distributions[impl.plugin_name]
            scratch = click.Group()  # a group per plugin, so every command is attributed to its distribution
            self._run_hookimpl(impl, distribution, cli=scratch)
            for name, command in scratch.commands.items():
                if name in commands:
                    raise DuplicatePluginError(
                        f'command "{name}" registered twice: by {distribution} and by {commands[name].distribution}'
                    )
                commands[name] = PluginCommand(command, distribution)
        return commands

    def _run_hookimpl(self, impl: pluggy.HookImpl, distribution: Distribution, **kwargs: Any) -> None:
        try:
            _call_hookimpl(impl, **kwargs)
        except PluginError:
            raise  # a contract violation (duplicate or malformed registration) is the author's bug to fix now
        except Exception as error:  # the plugin's own code failed: it counts as broken, not fatal
            self.broken.append(_warn_broken(impl.plugin_name, distribution, error))

    def _ordered(self, impls: list[pluggy.HookImpl]) -> list[pluggy.HookImpl]:
        # infer's own first, then third parties by name: duplicate errors and listings come out the same every run.
        def order(impl: pluggy.HookImpl) -> tuple[bool, str, str]:
            distribution = self._distributions[impl.plugin_name]
            return distribution.name != PROJECT, distribution.name, impl.plugin_name

        return sorted(impls, key=order)

    def _unknown_message(self, kind: str, name: str) -> str:
        message = unknown_name_message(kind, name, self.names(kind))
        if self.broken:
            failures = "; ".join(f"{b.plugin} ({b.distribution} {b.version}): {b.error}" for b in self.broken)
            message += f" (plugin modules that failed to load: {failures})"
        return message

    def _resolve(self, spec: PluginSpec, target: Any, what: str) -> Any:
        if not isinstance(target, str):
            return target
        try:
            return import_object(target)
        except Exception as error:  # show the original import error where the config selects the plugin
            raise PluginError(
                f'{spec.kind} "{spec.name}" from {spec.distribution} {spec.version}: cannot import its {what} '
                f"{target}: {type(error).__name__}: {error}"
            ) from error

    def _checked_subclass(self, spec: PluginSpec, target: Any, base_path: str) -> type:
        base = import_object(base_path)
        if not (isinstance(target, type) and issubclass(target, base)):
            raise PluginError(
                f'{spec.kind} "{spec.name}" from {spec.distribution} {spec.version}: {target!r} is not a subclass '
                f"of {base.__module__}.{base.__qualname__}"
            )
        if getattr(target, "fused_cpu_attention", False) and target.fused_attention is base.fused_attention:
            warnings.warn(
                f'{spec.kind} "{spec.name}" from {spec.distribution} {spec.version}: declares fused_cpu_attention '
                f"(plugin API 1), which the fused CPU path no longer reads: it asks fused_attention(metadata) "
                f"(infer.attention.AttentionBackend), so this backend's forward runs in every layer; return an "
                f"infer.kernels.cpu.KernelAttentionStep from fused_attention to join the fused path",
                PluginDeprecationWarning,
                stacklevel=2,
            )
        return target


def _make_spec(
    kind: str, name: Any, target: Any, config: Any, description: Any, distribution: Distribution, api_version: int
) -> PluginSpec:
    where = f"{kind} registered by {distribution}"
    if not isinstance(name, str) or not NAME_PATTERN.match(normalize_name(name)):
        raise PluginError(f"{where}: invalid name {name!r} (expected {NAME_PATTERN.pattern} after lower-casing)")
    if not isinstance(target, (str, type)):
        raise PluginError(f'{where} as "{name}": target must be a class or a "module:Class" string, got {target!r}')
    if not (config is None or isinstance(config, (str, type))):
        raise PluginError(f'{where} as "{name}": config must be a model class or "module:Class", got {config!r}')
    return PluginSpec(
        kind,
        normalize_name(name),
        target,
        config,
        str(description),
        distribution.name,
        distribution.version,
        api_version,
    )


def new_plugin_manager() -> pluggy.PluginManager:
    """A plugin manager with infer's hookspecs (tracing on stderr when ``INFER_TRACE_PLUGINS=1``)."""
    plugin_manager = pluggy.PluginManager(PROJECT)
    plugin_manager.add_hookspecs(hookspecs)
    if os.environ.get("INFER_TRACE_PLUGINS") == "1":
        plugin_manager.trace.root.setwriter(sys.stderr.write)
        plugin_manager.enable_tracing()
    return plugin_manager


def register_plugin(
    plugin_manager: pluggy.PluginManager, plugin_name: str, plugin: object, distribution: Distribution = LOCAL
) -> None:
    """Register one plugin and check it at once, so that a plugin API newer than infer's, a hook argument infer
    does not pass or a misspelt hook name is blamed on this plugin, in one line (``PluginError``). An observer that
    takes ``engine`` is registered with a ``DeprecationWarning``."""
    where = f"plugin {plugin_name} ({distribution})"
    _check_api_version(declared_api_version(plugin), where, distribution)
    hooks = _implemented_hooks(plugin_manager, plugin, plugin_name)
    _check_hook_arguments(hooks, where)
    try:
        plugin_manager.register(plugin, name=plugin_name)
        plugin_manager.check_pending()
    except (ValueError, pluggy.PluginValidationError) as error:
        if plugin_manager.is_registered(plugin):
            plugin_manager.unregister(plugin)
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]  # pluggy's span several
        raise PluginError(f"plugin {plugin_name}: {'; '.join(lines)}") from error
    _warn_deprecated_hook_arguments(hooks, where)


def declared_api_version(plugin: object) -> Any:
    """What ``plugin`` declares as ``INFER_PLUGIN_API``: its own attribute, else that of the nearest package above the
    module it comes from; 1 when none does."""
    value = getattr(plugin, API_DECLARATION, None)
    module_name = plugin.__name__ if isinstance(plugin, ModuleType) else getattr(plugin, "__module__", "")
    while value is None and module_name:
        value = getattr(sys.modules.get(module_name), API_DECLARATION, None)
        module_name = module_name.rpartition(".")[0]
    return 1 if value is None else value


def _check_api_version(value: Any, where: str, distribution: Distribution) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PluginError(
            f"{where} declares {API_DECLARATION} = {value!r}: the plugin API version it is written to "
            f"is an int from 1 to {PLUGIN_API_VERSION}"
        )
    if value > PLUGIN_API_VERSION:
        raise PluginError(
            f"{where} is written to plugin API {value} ({API_DECLARATION} = {value}) but this infer "
            f"supports plugin API {PLUGIN_API_VERSION} at most: upgrade infer, or install a release of "
            f"{distribution.name} written to plugin API {PLUGIN_API_VERSION}"
        )


def _implemented_hooks(
    plugin_manager: pluggy.PluginManager, plugin: object, plugin_name: str
) -> list[tuple[str, tuple[str, ...], tuple[str, ...]]]:
    """(hook, the arguments the plugin's implementation takes, the arguments infer passes) for each of infer's hooks
    the plugin implements, found as pluggy finds them."""
    hooks = []
    for attribute in dir(plugin):
        options = plugin_manager.parse_hookimpl_opts(plugin, attribute)
        if options is None:
            continue
        hook = options.get("specname") or attribute
        caller = getattr(plugin_manager.hook, hook, None)
        if caller is not None and caller.spec is not None:  # an unknown hook is check_pending's to name
            implementation = pluggy.HookImpl(plugin, plugin_name, getattr(plugin, attribute), options)
            hooks.append((hook, tuple(implementation.argnames), tuple(caller.spec.argnames)))
    return hooks


def _check_hook_arguments(hooks: Sequence[tuple[str, Sequence[str], Sequence[str]]], where: str) -> None:
    for hook, arguments, passed in hooks:
        unknown = [argument for argument in arguments if argument not in passed]
        if unknown:
            current = [argument for argument in passed if argument != DEPRECATED_HOOK_ARGUMENT]
            raise PluginError(
                f"{where}: its {hook}({', '.join(arguments)}) takes {', '.join(unknown)}, which "
                f"{hook} does not pass; {hook} passes {', '.join(current) or 'nothing'} (see "
                "infer.hookspecs)"
            )


def _warn_deprecated_hook_arguments(hooks: Sequence[tuple[str, Sequence[str], Sequence[str]]], where: str) -> None:
    """One warning naming every hook that takes ``engine`` and the records to take instead."""
    deprecated = [(hook, passed) for hook, arguments, passed in hooks if DEPRECATED_HOOK_ARGUMENT in arguments]
    if not deprecated:
        return
    records = ", ".join(
        f"{hook}({', '.join(a for a in passed if a != DEPRECATED_HOOK_ARGUMENT)})" for hook, passed in deprecated
    )
    warnings.warn(
        f"{where}: observer hooks that take {DEPRECATED_HOOK_ARGUMENT} (plugin API 1's form): "
        f"{', '.join(hook for hook, _ in deprecated)}; take the records instead: {records}; plugin API "
        f"{OLD_FORMS_DROPPED_IN} no longer passes {DEPRECATED_HOOK_ARGUMENT}",
        PluginDeprecationWarning,
        stacklevel=4,
    )


def _distribution_of(entry_point: Any) -> Distribution:
    distribution = entry_point.dist
    if distribution is None:
        return Distribution("unknown", "?")
    return Distribution(distribution.name, distribution.version)


def _is_allowed(distribution: Distribution, allowed: frozenset[str] | None) -> bool:
    if distribution.name == PROJECT or allowed is None:
        return True
    return normalize_distribution(distribution.name) in allowed


def _warn_broken(plugin_name: str, distribution: Distribution, error: Exception) -> BrokenPlugin:
    broken = BrokenPlugin(plugin_name, distribution.name, distribution.version, f"{type(error).__name__}: {error}")
    warnings.warn(
        f"plugin {plugin_name} from {distribution} was not loaded ({broken.error}); "
        "configs that select what it provides will fail",
        PluginWarning,
        stacklevel=3,
    )
    return broken


def allowed_distributions(load: Sequence[str] | None, environment: str) -> frozenset[str] | None:
    """Third-party distributions allowed by both ``plugins.load`` and ``INFER_PLUGINS`` (None = no limit)."""
    limits = [_parse_environment(environment)]
    if load is not None:
        limits.append(frozenset(normalize_distribution(name) for name in load))
    chosen = [limit for limit in limits if limit is not None]
    return frozenset.intersection(*chosen) if chosen else None


def _parse_environment(value: str) -> frozenset[str] | None:
    value = value.strip().lower()
    if value in ("", "all"):
        return None
    if value == "none":
        return frozenset()
    return frozenset(normalize_distribution(name.strip()) for name in value.split(",") if name.strip())


def get_registry(load: Sequence[str] | None = None) -> Registry:
    """The registry of installed plugins, limited by ``load`` (the config's ``plugins.load``) and ``INFER_PLUGINS``.

    Cached per ``load`` value and ``INFER_PLUGINS`` value, so plugin modules are imported once per process.
    """
    key = None if load is None else tuple(load)
    return _cached_registry(key, os.environ.get("INFER_PLUGINS", ""))


@functools.cache
def _cached_registry(load: tuple[str, ...] | None, environment: str) -> Registry:
    return Registry.from_entry_points(allowed_distributions(load, environment))
