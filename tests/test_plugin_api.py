"""The plugin API version: what a plugin declares, what ``infer plugins`` shows, what a too-new plugin gets, and how
code written to version 1 (drafters taking only a config, observers taking the engine) keeps working."""

from __future__ import annotations

import inspect
import json
import sys
import types
import warnings

import pytest
from click.testing import CliRunner

import infer
import infer.cli
from infer import hookimpl
from infer.drafter import Drafter, DrafterConfig
from infer.plugin_api import PLUGIN_API_VERSION, build_drafter
from infer.registry import Distribution, PluginError, PluginWarning, Registry, UnknownPluginError
from infer.scheduler import BudgetedScheduler

FUTURE = Distribution("infer-future", "3.0")
OLD = Distribution("infer-old", "0.9")
NEW = Distribution("infer-new", "1.0")


class FCFSStub(BudgetedScheduler):
    pass


def plugin_module(name: str, source: str, **attributes) -> types.ModuleType:
    """A plugin module ``name`` made of ``source`` (hooks), with ``attributes`` set on it."""
    module = types.ModuleType(name)
    module.__dict__.update(attributes, hookimpl=hookimpl, FCFSStub=FCFSStub)
    exec(source, module.__dict__)
    return module


SCHEDULER_HOOK = "@hookimpl\ndef register_schedulers(register):\n    register('{name}', FCFSStub)\n"


def scheduler_plugin(module_name: str, scheduler_name: str, **attributes) -> types.ModuleType:
    return plugin_module(module_name, SCHEDULER_HOOK.format(name=scheduler_name), **attributes)


def without_warnings(build):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = build()
    assert not caught, [str(w.message) for w in caught]
    return result


# -- the version ----------------------------------------------------------------------------------------------------
def test_this_release_is_plugin_api_2():
    assert infer.PLUGIN_API_VERSION == PLUGIN_API_VERSION == 2


def test_a_plugin_without_a_declaration_is_version_1_and_a_declared_one_its_own():
    registry = Registry.from_plugins(
        [scheduler_plugin("old_sched", "old"), scheduler_plugin("new_sched", "new", INFER_PLUGIN_API=2)]
    )
    assert (registry.spec("scheduler", "old").plugin_api, registry.spec("scheduler", "new").plugin_api) == (1, 2)


def test_the_declaration_may_sit_in_a_package_above_the_entry_point_module(monkeypatch):
    package = types.ModuleType("declaring_dist")
    package.INFER_PLUGIN_API = 2
    monkeypatch.setitem(sys.modules, "declaring_dist", package)
    registry = Registry.from_plugins([scheduler_plugin("declaring_dist.schedulers", "sub")])
    assert registry.spec("scheduler", "sub").plugin_api == 2


def test_every_builtin_plugin_declares_this_version():
    registry = without_warnings(lambda: Registry.from_entry_points(allowed=frozenset()))
    specs = [spec for kind in infer.registry.KINDS for spec in registry.specs(kind)]
    assert specs and {spec.plugin_api for spec in specs} == {PLUGIN_API_VERSION}


def test_infer_plugins_shows_each_plugins_version(monkeypatch):
    registry = Registry.from_plugins(
        [(scheduler_plugin("old_sched", "old"), OLD), (scheduler_plugin("new_sched", "newer", INFER_PLUGIN_API=2), NEW)]
    )
    monkeypatch.setattr(infer.cli, "get_registry", lambda load=None: registry)
    lines = CliRunner().invoke(infer.cli.main, ["plugins"]).output.splitlines()
    assert lines[lines.index("scheduler") + 1 : lines.index("attention")] == [
        "  newer  infer-new 1.0  API 2",
        "  old    infer-old 0.9  API 1",
    ]
    listing = json.loads(CliRunner().invoke(infer.cli.main, ["plugins", "--json"]).output)
    assert {plugin["name"]: plugin["plugin_api"] for plugin in listing["plugins"]} == {"newer": 2, "old": 1}


# -- a plugin newer than infer --------------------------------------------------------------------------------------
TOO_NEW = (
    "plugin infer-future:future_sched (infer-future 3.0) is written to plugin API 3 (INFER_PLUGIN_API = 3) but "
    "this infer supports plugin API 2 at most: upgrade infer, or install a release of infer-future written to "
    "plugin API 2"
)


def test_a_plugin_declaring_a_newer_version_is_refused_in_one_line():
    with pytest.raises(PluginError) as raised:
        Registry.from_plugins([(scheduler_plugin("future_sched", "future", INFER_PLUGIN_API=3), FUTURE)])
    assert str(raised.value) == TOO_NEW


def entry_point(name: str, module: types.ModuleType, dist: Distribution) -> types.SimpleNamespace:
    return types.SimpleNamespace(name=name, dist=dist, load=lambda: module)


def test_an_installed_plugin_declaring_a_newer_version_is_not_loaded_and_says_why(monkeypatch):
    future = entry_point("future_sched", scheduler_plugin("future_sched", "future", INFER_PLUGIN_API=3), FUTURE)
    monkeypatch.setattr(infer.registry, "entry_points", lambda group: [future])
    with pytest.warns(PluginWarning) as warned:
        registry = Registry.from_entry_points()
    assert str(warned[0].message) == (
        f"plugin infer-future:future_sched from infer-future 3.0 was not loaded "
        f"(PluginError: {TOO_NEW}); configs that select what it provides will fail"
    )
    assert [broken.error for broken in registry.broken] == [f"PluginError: {TOO_NEW}"]
    with pytest.raises(UnknownPluginError, match="upgrade infer"):
        registry.spec("scheduler", "future")


@pytest.mark.parametrize("declared", ["2", 0, True, 2.0])
def test_a_declaration_that_is_not_a_version_is_refused(declared):
    with pytest.raises(PluginError, match=r"declares INFER_PLUGIN_API = .*an int from 1 to 2"):
        Registry.from_plugins([scheduler_plugin("odd_sched", "odd", INFER_PLUGIN_API=declared)])


# -- drafters: plugin API 1 built them as cls(config) ---------------------------------------------------------------
class CurrentDrafter(Drafter):
    def propose(self, sequences, k):
        return [[] for _ in sequences]


class ConfigOnlyDrafter(CurrentDrafter):
    def __init__(self, config):
        super().__init__(config)


class NoArgumentsDrafter(CurrentDrafter):
    def __init__(self):
        super().__init__()


def test_a_current_drafter_gets_its_context_without_a_warning():
    context = object()
    drafter = without_warnings(lambda: build_drafter(CurrentDrafter, DrafterConfig(name="current"), context))
    assert drafter.context is context


def test_a_drafter_taking_only_a_config_is_built_with_a_deprecation_warning():
    config = DrafterConfig(name="old")
    with pytest.warns(DeprecationWarning) as warned:
        drafter = build_drafter(ConfigOnlyDrafter, config, object())
    assert isinstance(drafter, ConfigOnlyDrafter) and drafter.config is config and drafter.context is None
    assert [str(w.message) for w in warned] == [
        f'drafter "old" ({__name__}:ConfigOnlyDrafter): __init__ takes only a config, the form of plugin API 1; '
        "drafters are built as cls(config, context): declare __init__(self, config=None, context=None), calling "
        "super().__init__(config, context). It is built as cls(config) until plugin API 3, which drops the old form"
    ]


def test_the_message_names_the_installed_distribution_that_holds_the_drafter():
    from infer.plugins.drafters.ngram import NgramDrafter

    class OldNgram(NgramDrafter):
        def __init__(self, config):
            super().__init__(config)

    OldNgram.__module__ = NgramDrafter.__module__
    with pytest.warns(
        DeprecationWarning,
        match=r'^drafter "ngram" \(infer\.plugins\.drafters\.ngram:.*OldNgram from '
        r"infer \d",
    ):
        build_drafter(OldNgram, DrafterConfig(name="ngram"), None)


def test_a_drafters_signature_is_read_once_per_class(monkeypatch):
    class Once(ConfigOnlyDrafter):
        pass

    calls = []
    signature = inspect.signature
    monkeypatch.setattr(inspect, "signature", lambda target: calls.append(target) or signature(target))
    with pytest.warns(DeprecationWarning):
        build_drafter(Once, None, None)
    with pytest.warns(DeprecationWarning):
        build_drafter(Once, None, None)
    assert calls.count(Once) == 1


def test_a_drafter_built_neither_way_is_refused_in_one_line():
    with pytest.raises(PluginError) as raised:
        build_drafter(NoArgumentsDrafter, DrafterConfig(name="broken"), None)
    assert str(raised.value) == (
        f'drafter "broken" ({__name__}:NoArgumentsDrafter) cannot be built: its __init__() takes neither (config, '
        "context) nor (config); since plugin API 2 drafters are built as cls(config, context): declare "
        "__init__(self, config=None, context=None), calling super().__init__(config, context) (see "
        "infer.drafter.Drafter and infer.hookspecs)"
    )


# -- observers: plugin API 1 passed them the engine -----------------------------------------------------------------
class EngineObserver:
    def __init__(self):
        self.seen = []

    @hookimpl
    def engine_started(self, engine):
        self.seen.append(("started", engine))

    @hookimpl
    def step_finished(self, engine, step_stats):
        self.seen.append(("step", engine, step_stats))


class RecordObserver:
    @hookimpl
    def engine_started(self, stats, config):
        pass

    @hookimpl
    def request_finished(self, output):
        pass


def test_an_observer_taking_the_engine_gets_it_with_one_deprecation_warning_at_registration():
    observer = EngineObserver()
    with pytest.warns(DeprecationWarning) as warned:
        registry = Registry.from_plugins([(observer, OLD)])
    assert [str(w.message) for w in warned] == [
        "plugin infer-old:EngineObserver (infer-old 0.9): observer hooks that take engine (plugin API 1's form): "
        "engine_started, step_finished; take the records instead: engine_started(stats, config), "
        "step_finished(step_stats); plugin API 3 no longer passes engine"
    ]
    registry.hook.engine_started(stats="stats", config="config", engine="the engine")
    registry.hook.step_finished(step_stats="step", engine="the engine")
    assert observer.seen == [("started", "the engine"), ("step", "the engine", "step")]


def test_an_observer_taking_records_registers_without_a_warning():
    without_warnings(lambda: Registry.from_plugins([RecordObserver()]))


class MisnamedObserver:
    @hookimpl
    def step_finished(self, stats):
        pass


MISNAMED = (
    "plugin infer-old:MisnamedObserver (infer-old 0.9): its step_finished(stats) takes stats, which "
    "step_finished does not pass; step_finished passes step_stats (see infer.hookspecs)"
)


def test_a_hook_taking_an_argument_its_hook_does_not_pass_is_refused_in_one_line():
    with pytest.raises(PluginError) as raised:
        Registry.from_plugins([(MisnamedObserver(), OLD)])
    assert str(raised.value) == MISNAMED


def test_an_installed_plugin_with_such_a_hook_is_not_loaded_and_says_why(monkeypatch):
    misnamed = entry_point("MisnamedObserver", MisnamedObserver(), OLD)
    monkeypatch.setattr(infer.registry, "entry_points", lambda group: [misnamed])
    with pytest.warns(PluginWarning):
        registry = Registry.from_entry_points()
    assert [broken.error for broken in registry.broken] == [f"PluginError: {MISNAMED}"]


def test_an_attention_backend_declaring_version_1s_fused_cpu_attention_is_warned_about_on_load():
    import torch

    from infer.attention import AttentionBackend

    class OldFused(AttentionBackend):
        fused_cpu_attention = True

        def forward(self, layer, q, k, v, kv_cache, metadata):
            raise NotImplementedError

    class Plugin:
        @hookimpl
        def register_attention_backends(self, register):
            register("old-fused", OldFused)

    registry = Registry.from_plugins([(Plugin(), OLD)])
    with pytest.warns(DeprecationWarning, match="declares fused_cpu_attention .*fused_attention"):
        assert registry.load("attention", "old-fused") is OldFused
    backend = OldFused(num_heads=2, num_kv_heads=1, head_dim=4, block_size=4, dtype=torch.float32, device="cpu")
    assert backend.fused_attention(None) is None  # its forward runs in every layer: still correct
