"""pytest11 plugin: markers and the ``infer_registry`` fixture. Imports nothing heavy."""

from __future__ import annotations


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running test (real model, benchmarks); deselect with -m 'not slow'")
    config.addinivalue_line("markers", "gpu: needs a CUDA device")
    config.addinivalue_line("markers", "infer_conformance: a test from an infer conformance suite")
