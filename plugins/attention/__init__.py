"""infer's built-in attention backends: registered here, each as a lazy ``"module:Class"`` target, so that
listing them (``infer plugins``, ``infer --help``) imports none of their modules; a module loads when a config
selects it."""

from __future__ import annotations

from infer import hookimpl

INFER_PLUGIN_API = 2


@hookimpl
def register_attention_backends(register):
    register(
        "sdpa",
        "infer.plugins.attention.sdpa:SdpaBackend",
        description="torch scaled_dot_product_attention over the paged pool, cascade attention for shared "
        "prefixes; reference backend, any device",
    )
    register(
        "cpu",
        "infer.plugins.attention.cpu:CpuBackend",
        description="infer's C kernels: KV write and paged attention straight from the pool, float32 on a CPU; "
        "lets steps of a few tokens run all layers in one C call",
    )
    register(
        "triton",
        "infer.plugins.attention.triton_backend:TritonBackend",
        description="paged attention in Triton: mixed varlen batches, GQA, split-KV decode (CUDA; CPU via "
        "TRITON_INTERPRET=1)",
    )
