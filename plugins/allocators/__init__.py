"""infer's built-in allocators: registered here, each as a lazy ``"module:Class"`` target, so that
listing them (``infer plugins``, ``infer --help``) imports none of their modules; a module loads when a config
selects it."""

from __future__ import annotations

from infer import hookimpl

INFER_PLUGIN_API = 2


@hookimpl
def register_allocators(register):
    register(
        "paged",
        "infer.plugins.allocators.paged:PagedAllocator",
        description="On-demand fixed-size blocks from a free list (PagedAttention)",
    )
    register(
        "contiguous",
        "infer.plugins.allocators.contiguous:ContiguousAllocator",
        description="Reserves max_model_len of contiguous blocks per request at admission (pre-paging baseline)",
    )
