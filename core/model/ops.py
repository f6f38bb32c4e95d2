"""``StepOps``: how one forward pass runs its small ops, torch's or infer's CPU kernels'."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from infer.model.layers import RMSNorm, gated_activation, silu_and_mul
from infer.model.rotary import RotaryEmbedding, apply_rotary

if TYPE_CHECKING:
    from infer.kernels.cpu import CpuKernels


class StepOps:
    """The small ops of one forward pass (RMSNorm with the residual add before it, RoPE, SiLU-and-multiply): torch's
    ops, or infer's CPU kernels (float32 on a CPU), which do each in one pass. The execution layer builds one per
    step (``infer.execution.paths``); the layers call it instead of the torch functions.

    ``gemm_dtype`` bfloat16 (the execution layer's choice for a large step over bf16 weights, or block weights whose
    GEMM runs on AMX, with the kernels): the norms before a projection write bf16 rows and SiLU-and-multiply runs bf16
    to bf16, so the bf16 GEMMs take their inputs and give their outputs without a float32 round trip; a projection's
    bf16 output comes back to float32
    where float32 is read, inside the kernel that reads it (RoPE widens QKV as it rotates, the RMSNorm a layer's
    output as it adds it to the residual). The values are those of rounding each GEMM's input to bf16, which the
    GEMM does anyway (the attention's output is rounded before the output projection, ``gemm_rows``)."""

    def __init__(
        self,
        rotary: RotaryEmbedding,
        positions: torch.Tensor,
        kernels: CpuKernels | None = None,
        gemm_dtype: torch.dtype | None = None,
    ):
        self.kernels = kernels
        self.rotary = rotary
        self.positions = positions
        self.gemm_dtype = gemm_dtype if kernels is not None else None
        # cos/sin at this step's positions, by table and dtype: indexed once a step, whatever the layers that read them
        self._tables: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def table(self, rotary: RotaryEmbedding, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``rotary``'s cos and signed sin at this step's positions in ``dtype`` (``RotaryEmbedding.forward``)."""
        key = (id(rotary), dtype)
        if key not in self._tables:
            self._tables[key] = rotary(self.positions, dtype)
        return self._tables[key]

    def rotate(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding | None = None,
        head_norms: tuple[RMSNorm, RMSNorm, int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(qkv, heads)``: the QKV projection's output ``[T, width]`` in float32 (widened where this step narrows
        GEMM inputs), and its first ``num_heads`` heads rotated, ``[T, num_heads, head_dim]`` (with the
        kernels: rotated in place, a view of the returned ``qkv``; a bf16 output widened and rotated in one pass).
        ``rotary``: a layer's own table instead of the step's. ``head_norms`` ``(q_norm, k_norm, q_heads)``: each
        head RMSNormed before its rotation (``head_norms``), in the same pass with the kernels. A table narrower
        than the heads (partial rotary) rotates each head's first ``rotary_dim`` values, on the kernels too, but
        with head norms in torch."""
        table = rotary or self.rotary
        partial = table.rotary_dim != head_dim
        if self.kernels is None or (partial and head_norms is not None):
            if head_norms is not None:
                q_norm, k_norm, q_heads = head_norms
                qkv = self.head_norms(qkv, q_norm, k_norm, q_heads, num_heads - q_heads)
            if self.gemm_dtype is not None and qkv.dtype == self.gemm_dtype:
                qkv = qkv.float()
            cos, sin = self.table(table, qkv.dtype)
            heads = qkv[:, : num_heads * head_dim].view(qkv.shape[0], num_heads, head_dim)
            return qkv, apply_rotary(heads, cos, sin)
        narrowed = self.gemm_dtype is not None and qkv.dtype == self.gemm_dtype  # set only with the kernels
        if head_norms is not None and head_norms[0].eps == head_norms[1].eps:
            q_norm, k_norm, q_heads = head_norms
            qkv = self.kernels.rope_norms(
                qkv if narrowed else qkv.float(), self.positions, table.cos, table.sin, q_heads, num_heads,
                head_dim, q_norm.weight, k_norm.weight, q_norm.eps,
            )  # fmt: skip
        else:
            if head_norms is not None:
                q_norm, k_norm, q_heads = head_norms
                qkv = self.head_norms(qkv, q_norm, k_norm, q_heads, num_heads - q_heads)
                narrowed = False
            if narrowed:
                qkv = self.kernels.rope_widened(qkv, self.positions, table.cos, table.sin, num_heads, head_dim)
            else:
                self.kernels.rope_(qkv, self.positions, table.cos, table.sin, num_heads, head_dim)
        return qkv, qkv[:, : num_heads * head_dim].view(qkv.shape[0], num_heads, head_dim)

    def norm(
        self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None = None, gemm_input: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(s), s)`` for ``s = residual + x`` (``s = x`` without a residual). The kernels add in place into
        ``residual``. ``gemm_input``: the normed rows feed a projection, so they come in ``gemm_dtype`` when set."""
        if self.kernels is None:
            if residual is None:
                return norm(x), x
            residual = residual + x
            return norm(residual), residual
        out_dtype = self.gemm_dtype if gemm_input and self.gemm_dtype is not None else torch.float32
        if residual is None:
            x = x.float()  # a bf16 GEMM's output normed on its own (Gemma's output norms) is widened first
            return self.kernels.rms_norm(x, norm.weight, norm.eps, out_dtype), x
        # a bf16 GEMM's output is widened inside the kernel as it is added
        return self.kernels.add_rms_norm(residual, x, norm.weight, norm.eps, out_dtype), residual

    def gemm_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as a projection's input: in ``gemm_dtype`` where set (attention's float32 output rounded once, so
        the output projection gives bf16 rows, which the next norm widens as it adds them), else as it is."""
        return x if self.gemm_dtype is None else x.to(self.gemm_dtype)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up`` ``[T, 2 * width]``, gate first."""
        return silu_and_mul(gate_up) if self.kernels is None else self.kernels.silu_mul(gate_up)

    def gated_activation(self, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        """``act(gate) * up`` for ``gate_up`` ``[T, 2 * width]`` (``infer.model.layers.gated_activation``); SwiGLU
        and GeGLU, over float32 rows or a bf16 GEMM's bf16 rows, on the kernels where they run."""
        if activation == "silu":
            return self.silu_mul(gate_up)
        if activation == "gelu_tanh" and self.kernels is not None and gate_up.dtype in (torch.float32, torch.bfloat16):
            return self.kernels.gelu_tanh_mul(gate_up)
        return gated_activation(gate_up, activation)

    def head_norms(
        self, qkv: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm, num_heads: int, num_kv_heads: int
    ) -> torch.Tensor:
        """``qkv`` ``[T, width]`` with each of its first ``num_heads`` heads normed by ``q_norm`` and each of the
        next ``num_kv_heads`` by ``k_norm`` (RMSNorm over the head), values unchanged: Qwen3's and Gemma 3's q/k
        norms, before RoPE. Float32 out where this step narrows GEMM outputs."""
        if self.gemm_dtype is not None and qkv.dtype == self.gemm_dtype:
            qkv = qkv.float()
        tokens, head_dim = qkv.shape[0], q_norm.weight.shape[0]
        q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
        q = qkv[:, :q_end].reshape(tokens * num_heads, head_dim)
        k = qkv[:, q_end:k_end].reshape(tokens * num_kv_heads, head_dim)
        if self.kernels is None:
            q, k = q_norm(q), k_norm(k)
        else:
            q = self.kernels.rms_norm(q.contiguous(), q_norm.weight, q_norm.eps, torch.float32)
            k = self.kernels.rms_norm(k.contiguous(), k_norm.weight, k_norm.eps, torch.float32)
        return torch.cat((q.view(tokens, q_end), k.view(tokens, k_end - q_end), qkv[:, k_end:]), dim=1)
