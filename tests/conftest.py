"""Shared fixtures: every engine a test creates must be idle with all blocks accounted for when the test ends."""

from __future__ import annotations

import os
import shutil

import pytest

# Triton reads TRITON_INTERPRET once, at import: set it before any test imports triton, so that on a machine without
# CUDA the `triton` backend runs in the CPU interpreter everywhere in the session (kernel tests, conformance sweep).
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def engines_end_idle(monkeypatch):
    """Record every Engine built during the test; afterwards each must hold no block outside the prefix cache."""
    try:
        from infer.engine.engine import Engine
    except ImportError:  # pragma: no cover - engine not importable: nothing to check
        yield
        return
    created = []
    original_init = Engine.__init__

    def recording_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        created.append(self)

    monkeypatch.setattr(Engine, "__init__", recording_init)
    yield created
    for engine in created:
        if not engine.has_unfinished():
            engine.check_idle()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama (2 layers, hidden 64) with SmolLM2's tokenizer, saved as an HF folder."""
    from infer.testing.models import make_tiny_model_dir

    return str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"), seed=0))
