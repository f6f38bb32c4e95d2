"""MkDocs hook: lets mkdocstrings read the ``infer`` package's source statically.

The package ``infer`` lives in ``core/`` (pyproject's ``package-dir``), and griffe looks a package up by its folder
name, so no search path holds an ``infer/`` folder (and the ``infer`` console script beside ``mkdocs`` would be found
instead). This hook links ``build/api-src/infer`` to ``core/``, the one path mkdocs.yml gives the handler.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.plugins import event_priority

ROOT = Path(__file__).resolve().parents[2]
LINK = ROOT / "build" / "api-src" / "infer"


@event_priority(100)  # before mkdocstrings reads its paths, which drops a path that does not exist yet
def on_config(config: Any) -> Any:
    LINK.parent.mkdir(parents=True, exist_ok=True)
    if not LINK.is_symlink():
        LINK.symlink_to(ROOT / "core", target_is_directory=True)
    return config
