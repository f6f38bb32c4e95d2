"""infer: an LLM inference engine built as a small core with swappable plugins.

Kept light on purpose (the pytest plugin imports it): heavy modules load on first attribute access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from infer.hookspecs import hookimpl

__version__ = "0.1.0"
__all__ = ["LLM", "PLUGIN_API_VERSION", "SamplingParams", "hookimpl", "__version__"]

if TYPE_CHECKING:
    from infer.llm import LLM
    from infer.plugin_api import PLUGIN_API_VERSION
    from infer.sampling_params import SamplingParams


def __getattr__(name: str):
    if name == "LLM":
        from infer.llm import LLM

        return LLM
    if name == "SamplingParams":
        from infer.sampling_params import SamplingParams

        return SamplingParams
    if name == "PLUGIN_API_VERSION":
        from infer.plugin_api import PLUGIN_API_VERSION

        return PLUGIN_API_VERSION
    raise AttributeError(f"module 'infer' has no attribute {name!r}")
