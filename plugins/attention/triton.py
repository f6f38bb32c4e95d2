"""Registers attention backend ``triton`` (paged attention kernels in Triton; see ``triton_backend``).

Imports nothing heavy: the backend module (torch) loads when a config selects ``attention.name=triton``, and the
kernels module (triton) only once the backend has checked it can run here.
"""

from __future__ import annotations

from infer import hookimpl


@hookimpl
def register_attention_backends(register):
    register(
        "triton",
        "infer.plugins.attention.triton_backend:TritonBackend",
        description="paged attention in Triton: mixed varlen batches, GQA, split-KV decode (CUDA; CPU via "
        "TRITON_INTERPRET=1)",
    )
