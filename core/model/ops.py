"""``StepOps``: how one forward pass runs its small ops, torch's or infer's CPU kernels'."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from infer.model.layers import RMSNorm, silu_and_mul
from infer.model.rotary import RotaryEmbedding, apply_rotary

if TYPE_CHECKING:
    from infer.cpu_kernels import CpuKernels


class StepOps:
    """The small ops of one forward pass (RMSNorm with the residual add before it, RoPE, SiLU-and-multiply): torch's
    ops, or infer's CPU kernels (float32 on a CPU), which do each in one pass. The execution layer builds one per
    step (``infer.execution``); the layers call it instead of the torch functions."""

    def __init__(self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype,
                 kernels: CpuKernels | None = None):
        self.kernels = kernels
        self.rotary = rotary
        self.positions = positions
        if kernels is None:
            self.cos, self.sin = rotary(positions, dtype)

    def rotate(self, qkv: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
        """The first ``num_heads`` heads of ``qkv`` ``[T, width]`` rotated, ``[T, num_heads, head_dim]`` (with the
        kernels: rotated in place, a view of ``qkv``)."""
        heads = qkv[:, : num_heads * head_dim].view(qkv.shape[0], num_heads, head_dim)
        if self.kernels is None:
            return apply_rotary(heads, self.cos, self.sin)
        self.kernels.rope_(qkv, self.positions, self.rotary.cos, self.rotary.sin, num_heads, head_dim)
        return heads

    def norm(self, norm: RMSNorm, x: torch.Tensor,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(s), s)`` for ``s = residual + x`` (``s = x`` without a residual). The kernels add in place into
        ``residual``."""
        if residual is None:
            normed = norm(x) if self.kernels is None else self.kernels.rms_norm(x, norm.weight, norm.eps)
            return normed, x
        if self.kernels is None:
            residual = residual + x
            return norm(residual), residual
        return self.kernels.add_rms_norm(residual, x, norm.weight, norm.eps), residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up`` ``[T, 2 * width]``, gate first."""
        return silu_and_mul(gate_up) if self.kernels is None else self.kernels.silu_mul(gate_up)
