"""Registers attention backend ``sdpa`` (torch SDPA over the paged pool; see ``sdpa``).

Imports nothing heavy: the backend module (torch) loads when a config selects it, so ``infer --help`` and
``infer plugins`` start without torch.
"""

from __future__ import annotations

from infer import hookimpl


@hookimpl
def register_attention_backends(register):
    register(
        "sdpa",
        "infer.plugins.attention.sdpa:SdpaBackend",
        description="torch scaled_dot_product_attention over the paged pool, cascade attention for shared prefixes; "
        "reference backend, any device",
    )
