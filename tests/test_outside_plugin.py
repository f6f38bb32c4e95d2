"""A plugin package written to plugin API 1 and frozen since (``tests/outside_plugin``) keeps working: each of its
plugins passes its kind's conformance suite, and an engine with all of them selected at once gives the built-ins'
output, with the PluginDeprecationWarnings that version 1's forms earn and nothing else.

The package is installed (``.ci/run``: ``pip install -e tests/outside_plugin --no-deps``) rather than registered
from here: loading it through its entry points is what a user's infer does, and the conformance suites find
implementations by name in the installed registry, as a plugin author's tests do.
"""

from __future__ import annotations

import warnings
from importlib.metadata import PackageNotFoundError, distribution

import pytest
from click.testing import CliRunner

from infer import SamplingParams
from infer.registry import PluginDeprecationWarning, PluginWarning, Registry, get_registry
from infer.testing import (
    AllocatorConformance,
    AttentionConformance,
    DrafterConformance,
    GuideConformance,
    PrefixCacheConformance,
    SchedulerConformance,
)

DISTRIBUTION = "infer-outside-plugin"
SELECTED = {
    "allocator": "outside-fifo",
    "prefix_cache": "outside-prefix",
    "scheduler": "outside-longest",
    "attention": "outside-reference",
    "drafter": "outside-repeat",
    "guide": "outside-choice",
}


def skip_reason() -> str | None:
    try:
        distribution(DISTRIBUTION)
    except PackageNotFoundError:
        return f"{DISTRIBUTION} is not installed: pip install -e tests/outside_plugin --no-deps"
    if "outside-fifo" not in get_registry().names("allocator"):
        return f"{DISTRIBUTION} is installed but not loaded (INFER_PLUGINS leaves it out)"
    return None


SKIP_REASON = skip_reason()
pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")


class TestOutsideAllocator(AllocatorConformance):
    impl_name = "outside-fifo"


class TestOutsidePrefixCache(PrefixCacheConformance):
    impl_name = "outside-prefix"
    allocator_name = "outside-fifo"


class TestOutsideScheduler(SchedulerConformance):
    impl_name = "outside-longest"
    allocator_name = "outside-fifo"
    hit_prefix_cache_name = "outside-prefix"


class TestOutsideAttention(AttentionConformance):
    impl_name = "outside-reference"


@pytest.mark.filterwarnings('ignore:drafter "outside-repeat".*plugin API 1:DeprecationWarning')
class TestOutsideDrafter(DrafterConformance):
    impl_name = "outside-repeat"


class TestOutsideGuide(GuideConformance):
    impl_name = "outside-choice"


# The drafter finds repeats to propose, and the third prompt waits (two run at once) for the prefix cache to serve it.
PREFIX = (
    "You are a careful assistant. Answer in one short sentence, and count slowly: one two three, one two "
    "three, one two three."
)
PROMPTS = [
    f"{PREFIX} What is the capital of France?",
    f"{PREFIX} Name a primary color.",
    f"{PREFIX} What is two plus two?",
]
# A fixed fused-path threshold: calibrating it would time forward passes of whichever attention backend is selected.
SETTINGS = [
    "model.dtype=float32",
    "model.max_model_len=256",
    "cache.num_blocks=64",
    "scheduler.max_num_seqs=2",
    "execution.fused_max_tokens=8",
]


def greedy_outputs(llm) -> list[list[int]]:
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    return [output.token_ids for output in llm.generate(PROMPTS, params)]


def test_an_engine_with_every_outside_plugin_gives_the_builtins_output():
    from infer_outside_plugin.observer import SEEN

    from infer import LLM

    builtins = LLM("baseline", SETTINGS, registry=Registry.from_entry_points(allowed=frozenset()))
    expected = greedy_outputs(builtins)
    SEEN.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        registry = Registry.from_entry_points(allowed=frozenset({DISTRIBUTION}))
        selected = [f"{kind}.name={name}" for kind, name in SELECTED.items()]
        llm = LLM("baseline", [*SETTINGS, *selected], registry=registry)
        outputs = greedy_outputs(llm)

    assert outputs == expected
    assert not registry.broken and not any(issubclass(w.category, PluginWarning) for w in caught)
    deprecations = sorted(str(w.message) for w in caught if "plugin API" in str(w.message))
    assert [w.category for w in caught if "plugin API" in str(w.message)] == [PluginDeprecationWarning] * 2
    assert deprecations[0].startswith(
        'drafter "outside-repeat" (infer_outside_plugin.drafter:RepeatDrafter from '
        f"{DISTRIBUTION} 0.1.0): __init__ takes only a config"
    )
    assert deprecations[1].startswith(
        f"plugin {DISTRIBUTION}:infer_outside_plugin.observer ({DISTRIBUTION} 0.1.0): observer hooks that take engine"
    )
    stats = llm.engine.stats
    assert stats.num_verify_passes > 0 and stats.num_cached_prompt_tokens > 0, "the drafter or the cache sat idle"
    assert (SEEN["engines"], SEEN["max_model_len"], SEEN["steps"], SEEN["requests"]) == (
        1,
        256,
        stats.num_steps,
        len(PROMPTS),
    ), "the observer's hooks did not see the run"


def test_its_command_runs():
    from infer.cli import main

    result = CliRunner().invoke(main, ["outside-hello"])
    assert (result.exit_code, result.output) == (0, "hello from infer-outside-plugin\n")


def test_its_plugins_are_listed_as_plugin_api_1():
    assert [get_registry().spec(kind, name).plugin_api for kind, name in SELECTED.items()] == [1] * len(SELECTED)
