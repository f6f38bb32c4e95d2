"""The layer kinds of infer's decoder in plain torch: uninitialized linear and embedding layers, RMSNorm, and the
gated activations (SwiGLU's, GeGLU's, gpt-oss's clamped SwiGLU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Linear):
    """``nn.Linear`` whose weights start uninitialized: every one is overwritten from a checkpoint, and random
    initialization of a large model costs seconds."""

    def reset_parameters(self) -> None:
        pass

    def forward(self, x: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T + bias``; written to ``into`` (``[rows, out_features]``, contiguous) where it is given and
        the dtypes agree, so a caller can keep one buffer for a large result (the output head's logits)."""
        if into is None or not (x.dtype == self.weight.dtype == into.dtype) or x.dim() != 2:
            return super().forward(x)
        torch.matmul(x, self.weight.t(), out=into)
        return into if self.bias is None else into.add_(self.bias)


class Embedding(nn.Embedding):
    """``nn.Embedding`` whose weights start uninitialized (see ``Linear``)."""

    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and cast back before the weight (as HF does)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` ``[..., 2 * width]``, gate first (SwiGLU's activation, in torch)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gated_activation(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` for ``gate_up`` ``[..., 2 * width]``, gate first: ``silu`` (SwiGLU) or ``gelu_tanh``
    (GeGLU with tanh-approximated GELU, Gemma's)."""
    if activation == "silu":
        return silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def clamped_swiglu(gate_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's experts' activation for ``gate_up`` ``[..., 2 * width]``, gate first: gate clamped to at most
    ``limit``, up to ``[-limit, limit]``, then ``(up + 1) * gate * sigmoid(alpha * gate)`` (transformers' order of
    operations, so float32 results are bit-identical)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))
