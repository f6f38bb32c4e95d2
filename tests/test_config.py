"""Config loading: shipped presets, typed overrides, plugin-selected section models, errors reported all at once."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

import infer.config
from infer import hookimpl
from infer.allocator import Allocator
from infer.attention import AttentionBackend
from infer.config import (
    CacheConfig,
    ConfigError,
    InferConfig,
    ModelConfig,
    config_json_schema,
    load_config,
    shipped_configs,
)
from infer.drafter import Drafter
from infer.guide import Guide
from infer.prefix_cache import PrefixCache
from infer.registry import Registry
from infer.scheduler import BudgetedScheduler, SchedulerConfig


class FCFSConfig(SchedulerConfig):
    starvation_limit: int = 0


class LPMConfig(SchedulerConfig):
    waiting_threshold: int = 128


class FCFSStub(BudgetedScheduler):
    config_model = FCFSConfig


class LPMStub(BudgetedScheduler):
    config_model = LPMConfig


class AllocatorStub(Allocator):
    pass


class PrefixCacheStub(PrefixCache):
    pass


class AttentionStub(AttentionBackend):
    pass


class DrafterStub(Drafter):
    pass


class GuideStub(Guide):
    pass


class BuiltinsStub:
    """One implementation per kind under the default names, plus a second scheduler to switch to."""

    @hookimpl
    def register_allocators(self, register):
        register("paged", AllocatorStub)

    @hookimpl
    def register_prefix_caches(self, register):
        register("none", PrefixCacheStub)

    @hookimpl
    def register_schedulers(self, register):
        register("fcfs", FCFSStub)
        register("lpm", LPMStub)

    @hookimpl
    def register_attention_backends(self, register):
        register("sdpa", AttentionStub)

    @hookimpl
    def register_drafters(self, register):
        register("none", DrafterStub)

    @hookimpl
    def register_guides(self, register):
        register("none", GuideStub)


@pytest.fixture(scope="module")
def registry():
    return Registry.from_plugins([BuiltinsStub()])


def errors_of(source, overrides=(), registry=None) -> list[str]:
    with pytest.raises(ConfigError) as raised:
        load_config(source, overrides, registry=registry)
    assert str(raised.value) == "\n".join(raised.value.errors)
    return raised.value.errors


def test_defaults_select_each_kinds_default_plugin_with_its_own_model(registry):
    config = load_config(None, registry=registry)
    assert type(config.scheduler) is FCFSConfig
    assert [
        config.allocator.name,
        config.prefix_cache.name,
        config.scheduler.name,
        config.attention.name,
        config.drafter.name,
    ] == ["paged", "none", "fcfs", "auto", "none"]
    assert config.model == ModelConfig()
    assert config.model.path == "smollm2-135m-instruct"
    assert config.server.port == 8000
    assert config.plugins.load is None


def test_shipped_baseline_loads_by_name_with_or_without_suffix(registry):
    config = load_config("baseline", registry=registry)
    assert load_config("baseline.yaml", registry=registry) == config
    assert "baseline.yaml" in shipped_configs()
    assert (config.model.max_model_len, config.cache.block_size, config.cache.memory_budget) == (2048, 16, "auto")
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (64, 2048)


def test_yaml_file_and_dict_sources_agree(registry, tmp_path):
    path = tmp_path / "small.yaml"
    path.write_text("model:\n  max_model_len: 256\nscheduler:\n  name: lpm\n  waiting_threshold: 3\n")
    from_file = load_config(path, registry=registry)
    from_text_path = load_config(str(path), registry=registry)
    from_dict = load_config(
        {"model": {"max_model_len": 256}, "scheduler": {"name": "lpm", "waiting_threshold": 3}}, registry=registry
    )
    assert from_file == from_text_path == from_dict
    assert type(from_file.scheduler) is LPMConfig


def test_missing_source_lists_the_shipped_configs(registry):
    [error] = errors_of("no-such-config", registry=registry)
    assert "no file 'no-such-config'" in error
    assert "baseline.yaml" in error


def test_overrides_are_typed_by_yaml(registry):
    config = load_config(
        "baseline",
        [
            "scheduler.max_num_seqs=8",
            "model.compile=true",
            "cache.memory_budget=512MiB",
            "plugins.load=[infer-extra]",
            "server.api_key=null",
        ],
        registry=registry,
    )
    assert config.scheduler.max_num_seqs == 8
    assert config.model.compile is True
    assert config.cache.memory_budget == "512MiB"
    assert config.plugins.load == ["infer-extra"]
    assert config.server.api_key is None


def test_quoted_number_is_a_string_and_core_sections_refuse_it(registry):
    assert errors_of(None, ['model.seed="8"'], registry) == ["model.seed: Input should be a valid integer (got '8')"]


def test_misspelt_key_names_its_path_and_suggests_the_field(registry):
    errors = errors_of("baseline", ["scheduler.max_num_seq=8"], registry)
    assert errors == ['scheduler.max_num_seq: unknown key; did you mean "max_num_seqs"?']


def test_misspelt_section_suggests_the_section(registry):
    assert errors_of({"schedular": {}}, registry=registry) == ['schedular: unknown key; did you mean "scheduler"?']


def test_wrong_type_names_the_path_and_the_value(registry):
    [error] = errors_of("baseline", ["model.max_model_len=abc"], registry)
    assert error.startswith("model.max_model_len: ")
    assert "(got 'abc')" in error


def test_unknown_plugin_name_gives_the_registrys_message(registry):
    errors = errors_of("baseline", ["scheduler.name=lmp"], registry)
    assert errors == ['scheduler.name: unknown scheduler "lmp"; did you mean "lpm"? available: fcfs, lpm']


def test_every_error_is_reported_at_once(registry):
    errors = errors_of(
        "baseline",
        ["model.max_model_len=1", "cache.block_size=24", "scheduler.max_num_seq=8", "drafter.name=eagle", "+extra=1"],
        registry,
    )
    assert [error.split(":")[0] for error in errors] == [
        'override "+extra=1"',
        "model.max_model_len",
        "cache.block_size",
        "scheduler.max_num_seq",
        "drafter.name",
    ]


@pytest.mark.parametrize("override", ["+model.seed=1", "++model.seed=1", "~model.seed"])
def test_hydra_prefixes_are_rejected_with_a_hint(registry, override):
    [error] = errors_of(None, [override], registry)
    assert error.startswith(f'override "{override}": "+" (add) and "~" (delete) prefixes are not supported')


def test_override_without_a_value_is_rejected(registry):
    assert errors_of(None, ["model.seed"], registry) == [
        'override "model.seed": expected key=value, e.g. scheduler.max_num_seqs=8'
    ]


def test_switching_plugin_by_override_keeps_only_keys_the_new_model_knows(registry, tmp_path):
    path = tmp_path / "fcfs.yaml"
    path.write_text("scheduler:\n  name: fcfs\n  max_num_seqs: 4\n  starvation_limit: 9\n")
    config = load_config(path, ["scheduler.name=lpm", "scheduler.waiting_threshold=7"], registry=registry)
    assert config.scheduler == LPMConfig(name="lpm", max_num_seqs=4, waiting_threshold=7)


def test_naming_the_same_plugin_again_keeps_the_whole_section(registry):
    config = load_config(
        {"scheduler": {"name": "fcfs", "starvation_limit": 9}}, ["scheduler.name=FCFS"], registry=registry
    )
    assert config.scheduler == FCFSConfig(name="fcfs", starvation_limit=9)


def test_switching_to_an_unknown_plugin_reports_only_the_name(registry):
    errors = errors_of({"scheduler": {"name": "fcfs", "starvation_limit": 9}}, ["scheduler.name=nope"], registry)
    assert errors == ['scheduler.name: unknown scheduler "nope"; available: fcfs, lpm']


def test_interpolation_is_resolved_and_a_broken_one_names_its_key(registry):
    config = load_config({"model": {"path": "tiny"}, "server": {"host": "${model.path}"}}, registry=registry)
    assert config.server.host == "tiny"
    [error] = errors_of({"server": {"host": "${model.nope}"}}, registry=registry)
    assert error.startswith("server.host: Interpolation key 'model.nope' not found")


@pytest.mark.parametrize(
    ("budget", "free_bytes", "expected"),
    [
        ("2GiB", 0, 2 * 2**30),
        ("512MiB", 0, 512 * 2**20),
        ("1.5GB", 0, 1_500_000_000),
        ("4096", 0, 4096),
        (1024, 0, 1024),
        (0.5, 1000, 500),
        (1.0, 1000, 1000),
    ],
)
def test_memory_budget_forms(budget, free_bytes, expected):
    assert CacheConfig(memory_budget=budget).budget_bytes(free_bytes) == expected


def test_auto_memory_budget_is_what_weights_and_activations_need_plus_a_2_gib_pool():
    assert CacheConfig().memory_budget == "auto"
    assert CacheConfig().budget_bytes(free_bytes=10**12, needed_bytes=3 * 2**30) == 5 * 2**30


@pytest.mark.parametrize("budget", ["2 parsecs", "GiB", 1.5, 0.0, 0, -1, True])
def test_bad_memory_budget_is_reported_at_its_path(registry, budget):
    [error] = errors_of({"cache": {"memory_budget": budget}}, registry=registry)
    assert error.startswith("cache.memory_budget: ")


@pytest.mark.parametrize("block_size", [0, 3, 512])
def test_block_size_must_be_a_power_of_two_up_to_256(registry, block_size):
    [error] = errors_of({"cache": {"block_size": block_size}}, registry=registry)
    assert error == f"cache.block_size: must be a power of 2 from 1 to 256 (got {block_size})"


def test_resolved_yaml_loads_back_to_the_same_config(registry, tmp_path):
    config = load_config("baseline", ["scheduler.name=lpm", "cache.num_blocks=64"], registry=registry)
    path = tmp_path / "resolved.yaml"
    path.write_text(config.to_yaml())
    assert load_config(path, registry=registry) == config
    assert OmegaConf.create(config.to_yaml())["scheduler"]["waiting_threshold"] == 128


def test_config_is_frozen(registry):
    config = load_config(None, registry=registry)
    with pytest.raises(ValueError):
        config.model.seed = 3


def test_plugins_load_selects_the_registry(monkeypatch):
    requested = []

    def recording_get_registry(load=None):
        requested.append(load)
        return Registry.from_plugins([BuiltinsStub()])

    monkeypatch.setattr(infer.config, "get_registry", recording_get_registry)
    load_config({"plugins": {"load": ["infer-extra"]}})
    load_config({"plugins": {"load": ["infer-extra"]}}, ["plugins.load=[other]"])
    assert requested == [["infer-extra"], ["other"]]


def test_direct_construction_validates_plugin_sections_by_the_selected_model(monkeypatch, registry):
    monkeypatch.setattr(infer.config, "get_registry", lambda load=None: registry)
    config = InferConfig(scheduler={"name": "lpm", "waiting_threshold": 2})
    assert config.scheduler == LPMConfig(name="lpm", waiting_threshold=2)
    with pytest.raises(ValueError, match="scheduler.bogus: unknown key"):
        InferConfig(scheduler={"name": "lpm", "bogus": 1})


def test_json_schema_covers_every_registered_plugin_model(registry):
    schema = config_json_schema(registry)
    assert set(schema["properties"]) == set(InferConfig.model_fields)
    assert {"FCFSConfig", "LPMConfig", "CacheConfig"} <= set(schema["$defs"])
    assert "waiting_threshold" in schema["$defs"]["LPMConfig"]["properties"]


def test_attention_auto_takes_only_its_name_and_switching_to_it_drops_the_backends_keys(registry):
    errors = errors_of(None, ["attention.cascade=false"], registry)
    assert errors == ["attention.cascade: unknown key"]
    config = load_config({"attention": {"name": "sdpa", "cascade": False}}, ["attention.name=auto"], registry=registry)
    assert config.attention.name == "auto"


def test_execution_paths_end_with_torch_and_are_named_correctly(registry):
    assert load_config(None, ["execution.paths=[fused-layers,torch]"], registry=registry).execution.paths == [
        "fused-layers",
        "torch",
    ]
    errors = errors_of(None, ["execution.paths=[fused-stack]"], registry)
    assert errors == [
        "execution.paths: list each path once and end with torch, the path that accepts every step "
        "(got ['fused-stack'])"
    ]
    assert errors_of(None, ["execution.paths=[fused-stak,torch]"], registry)[0].startswith("execution.paths.0: ")
    assert errors_of(None, ["execution.fused_max_tokens=-1"], registry)[0].startswith("execution.fused_max_tokens")
