"""The sweep: every registered implementation of every kind, built-in and third-party, through its suite.

Run it with ``pytest --pyargs infer.testing.test_registered`` (``infer plugins check`` wraps it); narrow it with
``--infer-impl NAME`` or ``-k``. Each class overrides its suite's factory fixture with one parametrized over the
registry's names; the override lives inside the class, where a module-level fixture would be shadowed by the base
class's own fixture method.
"""

from __future__ import annotations

import pytest

from infer.registry import get_registry
from infer.testing.allocator import AllocatorConformance
from infer.testing.attention import AttentionConformance
from infer.testing.drafter import DrafterConformance
from infer.testing.guide import GuideConformance
from infer.testing.prefix_cache import PrefixCacheConformance
from infer.testing.scheduler import SchedulerConformance


def registered(kind: str) -> list:
    """One fixture parameter per registered name, marked so ``--infer-impl`` can select it."""
    return [
        pytest.param(name, id=name, marks=pytest.mark.infer_conformance(kind=kind, impl=name))
        for name in get_registry().names(kind)
    ]


class TestRegisteredAllocators(AllocatorConformance):
    @pytest.fixture(params=registered("allocator"))
    def allocator_factory(self, request):
        return self.make_allocator_factory(request.param)


class TestRegisteredPrefixCaches(PrefixCacheConformance):
    @pytest.fixture(params=registered("prefix_cache"))
    def prefix_cache_factory(self, request):
        return self.make_prefix_cache_factory(request.param)


class TestRegisteredSchedulers(SchedulerConformance):
    @pytest.fixture(params=registered("scheduler"))
    def scheduler_factory(self, request):
        return self.make_scheduler_factory(request.param)


class TestRegisteredAttentionBackends(AttentionConformance):
    @pytest.fixture(params=registered("attention"))
    def attention_factory(self, request):
        return self.make_attention_factory(request.param)


class TestRegisteredDrafters(DrafterConformance):
    @pytest.fixture(params=registered("drafter"))
    def drafter_factory(self, request, drafter_context):
        return self.make_drafter_factory(request.param, drafter_context)


class TestRegisteredGuides(GuideConformance):
    @pytest.fixture(params=registered("guide"))
    def guide_factory(self, request):
        return self.make_guide_factory(request.param)
