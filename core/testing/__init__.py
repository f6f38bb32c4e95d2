"""Conformance suites for infer plugins, one base class per kind (needs ``infer[testing]``: pytest, hypothesis).

A plugin author's whole test file::

    from infer.testing import SchedulerConformance

    class TestSJF(SchedulerConformance):
        impl_name = "sjf"

Every registered implementation, built-in and third-party: ``pytest --pyargs infer.testing.test_registered``
(``infer plugins check``). The pytest plugin imports this package in every pytest run, so the suites (which import
hypothesis, and torch for attention) load only on first attribute access.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

SUITE_MODULES = {
    "AllocatorConformance": "infer.testing.allocator",
    "PrefixCacheConformance": "infer.testing.prefix_cache",
    "SchedulerConformance": "infer.testing.scheduler",
    "AttentionConformance": "infer.testing.attention",
    "DrafterConformance": "infer.testing.drafter",
    "GuideConformance": "infer.testing.guide",
    "ModelConformance": "infer.testing.model",
    "MoeConformance": "infer.testing.moe",
}

try:
    import pytest
except ImportError:  # infer.testing.models (tiny models, the HF reference) serves `infer bench` without pytest
    pass
else:
    # The suites' asserts live in this package, not in the plugin author's test file: pytest rewrites them only when
    # asked before they are imported (an editable install hides them from pytest's own detection).
    pytest.register_assert_rewrite("infer.testing.suite", *SUITE_MODULES.values())

__all__ = list(SUITE_MODULES)

if TYPE_CHECKING:
    from infer.testing.allocator import AllocatorConformance
    from infer.testing.attention import AttentionConformance
    from infer.testing.drafter import DrafterConformance
    from infer.testing.guide import GuideConformance
    from infer.testing.model import ModelConformance
    from infer.testing.moe import MoeConformance
    from infer.testing.prefix_cache import PrefixCacheConformance
    from infer.testing.scheduler import SchedulerConformance


def __getattr__(name: str):
    module = SUITE_MODULES.get(name)
    if module is None:
        raise AttributeError(f"module 'infer.testing' has no attribute {name!r}")
    return getattr(import_module(module), name)
