"""The project's own run of the conformance sweep: every registered implementation (the built-ins, and any installed
third-party plugin) through its kind's suite, plus the pieces that make the sweep trustworthy: it covers every
built-in, and ``--infer-impl`` narrows it to the names asked for.
"""

from __future__ import annotations

import pytest

from infer.registry import get_registry
from infer.testing.test_registered import (  # noqa: F401  (collected here as this module's tests)
    TestRegisteredAllocators,
    TestRegisteredAttentionBackends,
    TestRegisteredDrafters,
    TestRegisteredGuides,
    TestRegisteredPrefixCaches,
    TestRegisteredSchedulers,
)

pytest_plugins = ["pytester"]

BUILTINS = {
    "allocator": {"paged", "contiguous"},
    "prefix_cache": {"none", "hash", "radix"},
    "scheduler": {"fcfs", "lpm"},
    "attention": {"sdpa", "triton"},
    "drafter": {"none", "ngram"},
    "guide": {"none", "xgrammar", "llguidance"},
}


@pytest.mark.parametrize("kind", sorted(BUILTINS))
def test_sweep_covers_every_builtin(kind):
    # The sweep runs what the registry lists; a built-in missing from the entry points would silently go untested.
    missing = BUILTINS[kind] - set(get_registry().names(kind))
    assert not missing, f"built-in {kind} implementations not registered: {sorted(missing)}"


def collected_ids(pytester: pytest.Pytester, *args: str) -> list[str]:
    result = pytester.runpytest(
        "-p", "no:cacheprovider", "--collect-only", "-q", "--pyargs", "infer.testing.test_registered", *args
    )
    return [line for line in result.stdout.lines if "::" in line]


def test_infer_impl_limits_the_sweep_to_the_named_implementations(pytester):
    ids = collected_ids(pytester, "--infer-impl", "paged,sdpa")
    assert ids
    assert all("[paged" in test_id or "[sdpa" in test_id for test_id in ids), ids
    assert any("TestRegisteredAllocators" in test_id for test_id in ids)
    assert any("TestRegisteredAttentionBackends" in test_id for test_id in ids)


def test_infer_impl_kind_prefix_picks_one_kind(pytester):
    ids = collected_ids(pytester, "--infer-impl", "drafter:none")
    assert ids and all("TestRegisteredDrafters" in test_id and "[none" in test_id for test_id in ids), ids
