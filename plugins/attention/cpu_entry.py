"""Registers attention backend ``cpu`` (infer's C paged attention; see ``cpu``).

Imports nothing heavy: the backend module (torch, the kernels) loads when a config selects it.
"""

from __future__ import annotations

from infer import hookimpl


@hookimpl
def register_attention_backends(register):
    register(
        "cpu",
        "infer.plugins.attention.cpu:CpuBackend",
        description="infer's C kernels: KV write and paged attention straight from the pool, float32 on a CPU; "
        "lets steps of a few tokens run all layers in one C call",
    )
