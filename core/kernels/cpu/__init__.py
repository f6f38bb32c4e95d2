"""infer's CPU kernels (C in ``csrc/``: a file per operation, their interface in ``csrc/cpu_kernels.h``): the small
float32 ops of a step fused, paged attention that reads K/V straight from the pool, a streaming GEMV over packed
fp16/bf16/int8 weights, and steps of a few tokens with all layers in one call.

In eager PyTorch a decode step at batch 1 is mostly dispatch: RMSNorm alone is about ten kernels, RoPE five,
SiLU-and-multiply three, and attention gathers every K/V block before it reads it. These kernels do each in one
pass; fbgemm's fp16 GEMM costs a fixed 20-45 us per call at one row, the GEMV none (measurements:
docs/performance.md and ``benchmarks/cpu_kernels.py``).

- ``builder``: compile once per machine into the cache directory, ``load(mode)``.
- ``abi``: the C signatures and ``CpuKernels``, one checked wrapper per kernel (``PackedExperts``: a mixture's
  experts as ``moe_experts`` reads them).
- ``packing``: the GEMV's weight layout, shared with ``infer.model.quantization``.
- ``fused``: ``FusedLayer`` and ``FusedStack``, whole layers over a few tokens; ``FusedDraftHead``, an EAGLE head's
  draft step.

Which step runs on which of them is decided in one place, ``infer.execution.paths``.
"""

from infer.kernels.cpu.abi import (
    ACTIVATIONS,
    DIRECT_HEAD_DIMS,
    MOE_BLOCK_KINDS,
    CpuKernels,
    FlashChunks,
    KernelAttentionPlan,
    PackedExperts,
)
from infer.kernels.cpu.builder import KernelBuildError, build, compiler, load, load_built, source
from infer.kernels.cpu.fused import FusedDraftHead, FusedLayer, FusedStack, KernelAttentionStep
from infer.kernels.cpu.packing import (
    can_pack,
    can_pack_tiles,
    pack_scales,
    pack_tiles,
    pack_weights,
    packed_shape,
    tiles_shape,
    unpack_tiles,
)

__all__ = [
    "ACTIVATIONS",
    "DIRECT_HEAD_DIMS",
    "MOE_BLOCK_KINDS",
    "CpuKernels",
    "FlashChunks",
    "FusedDraftHead",
    "FusedLayer",
    "FusedStack",
    "KernelAttentionPlan",
    "KernelAttentionStep",
    "KernelBuildError",
    "PackedExperts",
    "build",
    "can_pack",
    "can_pack_tiles",
    "compiler",
    "load",
    "load_built",
    "pack_scales",
    "pack_tiles",
    "pack_weights",
    "packed_shape",
    "source",
    "tiles_shape",
    "unpack_tiles",
]
