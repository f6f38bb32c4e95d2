"""The plugin registry: discovery, attribution, name rules, lazy loading, errors a user sees."""

from __future__ import annotations

import importlib.util
import warnings
from importlib.metadata import entry_points, version

import click
import pytest

from infer import hookimpl
from infer.allocator import Allocator, AllocatorConfig
from infer.registry import (
    KIND_INFO,
    KINDS,
    Distribution,
    DuplicatePluginError,
    PluginError,
    PluginWarning,
    Registry,
    UnknownPluginError,
    allowed_distributions,
    get_registry,
)
from infer.scheduler import BudgetedScheduler, SchedulerConfig

INFER = Distribution("infer", "0.1.0")
DUP = Distribution("infer-dup", "0.1.0")


class PagedStub(Allocator):
    """Stands in for a real allocator: the registry only checks the class hierarchy."""


class BuddyConfig(AllocatorConfig):
    min_order: int = 0


class FCFSStub(BudgetedScheduler):
    pass


class LPMStub(BudgetedScheduler):
    pass


class AllocatorPlugin:
    @hookimpl
    def register_allocators(self, register):
        register("paged", PagedStub, description="free list")


class DuplicateAllocatorPlugin:
    @hookimpl
    def register_allocators(self, register):
        register("Paged", PagedStub)


class SchedulerPlugin:
    @hookimpl
    def register_schedulers(self, register):
        register("fcfs", FCFSStub)
        register("lpm", LPMStub)


def registry_with(register_allocators) -> Registry:
    """A registry whose only plugin runs ``register_allocators(register)``."""

    class Plugin:
        pass

    Plugin.register_allocators = staticmethod(hookimpl(register_allocators))
    return Registry.from_plugins([Plugin])


def test_registration_records_name_target_and_providing_distribution():
    registry = Registry.from_plugins([(AllocatorPlugin(), Distribution("infer-extra", "1.2.0"))])
    spec = registry.spec("allocator", "paged")
    assert (spec.kind, spec.name, spec.target, spec.description) == ("allocator", "paged", PagedStub, "free list")
    assert (spec.distribution, spec.version) == ("infer-extra", "1.2.0")
    assert registry.names("allocator") == ["paged"]
    assert registry.names("scheduler") == []


def test_names_are_normalized_and_listed_sorted():
    registry = registry_with(lambda register: [register(" Zeta ", PagedStub), register("alpha", PagedStub)])
    assert registry.names("allocator") == ["alpha", "zeta"]
    assert registry.spec("allocator", "ZETA").name == "zeta"


@pytest.mark.parametrize("bad_name", ["2fast", "with space", "a" * 33, ""])
def test_malformed_name_is_rejected(bad_name):
    with pytest.raises(PluginError, match="invalid name"):
        registry_with(lambda register: register(bad_name, PagedStub))


def test_duplicate_name_is_an_error_naming_both_distributions():
    with pytest.raises(DuplicatePluginError) as raised:
        Registry.from_plugins([(DuplicateAllocatorPlugin(), DUP), (AllocatorPlugin(), INFER)])
    assert str(raised.value) == 'allocator "paged" registered twice: by infer-dup 0.1.0 and by infer 0.1.0'


def test_unknown_name_suggests_the_closest_and_lists_all():
    registry = Registry.from_plugins([SchedulerPlugin()])
    with pytest.raises(UnknownPluginError) as raised:
        registry.spec("scheduler", "lmp")
    assert str(raised.value) == 'unknown scheduler "lmp"; did you mean "lpm"? available: fcfs, lpm'


def test_unknown_name_without_a_close_match_only_lists_available():
    registry = Registry.from_plugins([SchedulerPlugin()])
    with pytest.raises(UnknownPluginError) as raised:
        registry.load("scheduler", "round-robin")
    assert str(raised.value) == 'unknown scheduler "round-robin"; available: fcfs, lpm'


def test_unknown_kind_is_rejected():
    with pytest.raises(ValueError, match="unknown plugin kind"):
        Registry.from_plugins([]).names("schedulers")


def test_string_target_is_imported_only_on_load_and_its_import_error_is_shown():
    registry = registry_with(lambda register: register("lazy", "infer_no_such_module.deep:Allocator"))
    assert registry.names("allocator") == ["lazy"]
    with pytest.raises(
        PluginError, match="cannot import its class infer_no_such_module.deep:Allocator.*ModuleNotFoundError"
    ):
        registry.load("allocator", "lazy")


def test_string_target_loads_the_class():
    registry = registry_with(lambda register: register("paged", f"{__name__}:PagedStub"))
    assert registry.load("allocator", "paged") is PagedStub


def test_load_rejects_a_class_outside_the_kinds_contract():
    registry = registry_with(lambda register: register("wrong", FCFSStub))
    with pytest.raises(PluginError, match=r"is not a subclass of infer\.allocator\.Allocator"):
        registry.load("allocator", "wrong")


def test_config_model_defaults_to_the_classes_config_model():
    registry = registry_with(lambda register: register("paged", PagedStub))
    assert registry.config_model("allocator", "paged") is AllocatorConfig


def test_registered_config_model_wins_and_may_be_a_path():
    registry = registry_with(
        lambda register: [
            register("buddy", PagedStub, config=BuddyConfig),
            register("lazy", PagedStub, config=f"{__name__}:BuddyConfig"),
        ]
    )
    assert registry.config_model("allocator", "buddy") is BuddyConfig
    assert registry.config_model("allocator", "lazy") is BuddyConfig


def test_config_model_must_extend_the_kinds_base_config():
    registry = registry_with(lambda register: register("paged", PagedStub, config=SchedulerConfig))
    with pytest.raises(PluginError, match=r"not a subclass of infer\.allocator\.AllocatorConfig"):
        registry.config_model("allocator", "paged")


def test_target_must_be_a_class_or_path():
    with pytest.raises(PluginError, match="target must be a class"):
        registry_with(lambda register: register("paged", object()))


def test_plugin_whose_hook_raises_becomes_a_warning_and_is_named_on_unknown_names():
    def explode(register):
        raise RuntimeError("no GPU driver")

    with pytest.warns(PluginWarning, match="no GPU driver"):
        registry = registry_with(explode)
    assert [b.error for b in registry.broken] == ["RuntimeError: no GPU driver"]
    with pytest.raises(UnknownPluginError, match="failed to load.*no GPU driver"):
        registry.spec("allocator", "paged")


def test_misspelt_hook_name_is_an_error():
    class Misspelt:
        @hookimpl
        def register_alocators(self, register):
            register("paged", PagedStub)

    with pytest.raises(PluginError, match="register_alocators"):
        Registry.from_plugins([Misspelt()])


def test_lifecycle_hooks_reach_every_observer():
    seen = []

    class Observer:
        @hookimpl
        def engine_started(self, stats, config):
            seen.append((stats, config))

    registry = Registry.from_plugins([Observer()])
    registry.hook.engine_started(stats="the stats", config="the config", engine="the engine")
    assert seen == [("the stats", "the config")]


def test_plugin_commands_are_collected_once_and_attributed():
    calls = []

    class Commands:
        @hookimpl
        def register_commands(self, cli):
            calls.append(cli)
            cli.add_command(click.Command("hello", callback=lambda: None))

    registry = Registry.from_plugins([(Commands(), DUP)])
    commands = registry.plugin_commands()
    assert registry.plugin_commands() is commands
    assert len(calls) == 1
    assert commands["hello"].command.name == "hello"
    assert commands["hello"].distribution == DUP


def test_two_plugins_adding_one_command_name_is_an_error():
    class First:
        @hookimpl
        def register_commands(self, cli):
            cli.add_command(click.Command("hello"))

    class Second(First):
        pass

    registry = Registry.from_plugins([(First(), INFER), (Second(), DUP)])
    with pytest.raises(DuplicatePluginError, match='command "hello" registered twice: by infer-dup 0.1.0 and by infer'):
        registry.plugin_commands()


@pytest.mark.parametrize(
    ("load", "environment", "expected"),
    [
        (None, "", None),
        (None, "all", None),
        (None, "none", frozenset()),
        (None, "Infer_Dup, other", frozenset({"infer-dup", "other"})),
        (["a", "b"], "", frozenset({"a", "b"})),
        (["a", "b"], "b,c", frozenset({"b"})),
    ],
)
def test_allowed_distributions_intersects_config_and_environment(load, environment, expected):
    assert allowed_distributions(load, environment) == expected


def test_get_registry_is_cached_per_load_and_environment(monkeypatch):
    monkeypatch.setenv("INFER_PLUGINS", "none")
    first = get_registry(["x"])
    assert get_registry(("x",)) is first
    assert get_registry() is not first
    monkeypatch.setenv("INFER_PLUGINS", "all")
    assert get_registry(["x"]) is not first


# Built-in entry points are named infer.<kind, plural>[.<package>]: one per plugin package, whose __init__ registers
# every implementation in it.
ENTRY_POINT_KINDS = {
    "allocators": "allocator",
    "prefix_cache": "prefix_cache",
    "schedulers": "scheduler",
    "attention": "attention",
    "drafters": "drafter",
    "guides": "guide",
    "models": "model",
    "tool_parsers": "tool_parser",
}


def test_builtin_entry_points_are_plugin_packages_that_register_their_kind():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        registry = Registry.from_entry_points(allowed=frozenset())
    assert not registry.broken and not caught
    builtin = [entry_point for entry_point in entry_points(group="infer.plugins") if entry_point.dist.name == "infer"]
    for entry_point in builtin:
        kind = ENTRY_POINT_KINDS[entry_point.name.split(".")[1]]
        assert importlib.util.find_spec(entry_point.value).submodule_search_locations, entry_point  # a package
        names = []
        getattr(entry_point.load(), KIND_INFO[kind].hook)(lambda name, *args, **kwargs: names.append(name))
        assert names, f"{entry_point.name} registers no {kind}"
        for name in names:
            assert (registry.spec(kind, name).distribution, registry.spec(kind, name).version) == (
                "infer",
                version("infer"),
            )
    assert {ENTRY_POINT_KINDS[entry_point.name.split(".")[1]] for entry_point in builtin} == set(KINDS)
