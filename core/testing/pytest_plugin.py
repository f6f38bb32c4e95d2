"""pytest11 plugin (entry point ``infer``): markers, ``--infer-impl``, the ``infer_registry`` fixture, and the hook
that turns a suite's ``expected_failures`` into strict xfails.

pytest loads it in every run of every environment where infer is installed, so it imports nothing heavy (no torch,
no hypothesis); the suites themselves load only when a test module imports them.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("infer", "infer conformance suites")
    group.addoption(
        "--infer-impl",
        action="append",
        default=[],
        metavar="NAME",
        help="run the registered-implementations sweep only for these names (NAME or KIND:NAME; repeat the option "
        "or separate with commas)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: long-running test (real model, benchmarks); deselect with -m 'not slow'")
    config.addinivalue_line("markers", "gpu: needs a CUDA device")
    config.addinivalue_line(
        "markers",
        "infer_conformance(kind=None, impl=None): a test from an infer conformance suite (the sweep "
        "records which implementation it runs)",
    )


@pytest.fixture(scope="session")
def infer_registry():
    """The registry of installed plugins (``infer.registry.get_registry()``)."""
    from infer.registry import get_registry

    return get_registry()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        mark_expected_failure(item)
    deselect_unselected_implementations(config, items)


def mark_expected_failure(item: pytest.Item) -> None:
    """Apply ``xfail(strict=True)`` when the item's class lists its test in ``expected_failures``."""
    test_class = getattr(item, "cls", None)
    expected = getattr(test_class, "expected_failures", None)
    if not expected:
        return
    check_expected_failure_names(test_class, expected)
    reason = expected.get(getattr(item, "originalname", item.name))
    if reason is not None:
        item.add_marker(pytest.mark.xfail(reason=reason, strict=True))


def check_expected_failure_names(test_class: type, expected: dict[str, str]) -> None:
    # A misspelt name would silently leave the known failure failing, or hide nothing; say so at collection.
    unknown = [name for name in expected if not (name.startswith("test") and callable(getattr(test_class, name, None)))]
    if unknown:
        raise pytest.UsageError(
            f"{test_class.__qualname__}.expected_failures names no test of the suite: {', '.join(sorted(unknown))}"
        )


def deselect_unselected_implementations(config: pytest.Config, items: list[pytest.Item]) -> None:
    selected = {name.strip() for option in config.getoption("infer_impl") for name in option.split(",") if name.strip()}
    if not selected:
        return
    kept, deselected = [], []
    for item in items:
        (kept if is_selected(item, selected) else deselected).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


def is_selected(item: pytest.Item, selected: set[str]) -> bool:
    """Sweep items run when their implementation is named (alone or as ``kind:name``); other tests always run."""
    for marker in item.iter_markers("infer_conformance"):
        name = marker.kwargs.get("impl")
        if name is not None:
            return name in selected or f"{marker.kwargs.get('kind')}:{name}" in selected
    return True
