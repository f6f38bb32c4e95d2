"""Weights laid out for the CPU kernels' GEMV: blocks of four output rows, each one sequential stream, in fp16, bf16
or int8 (with per-group scales beside them). ``infer.quantization`` packs its linears with these."""

from __future__ import annotations

import torch


def can_pack(out_features: int, in_features: int, group: int = 8) -> bool:
    """Whether ``pack_weights`` lays out this shape, with int8 scales per ``group`` weights of a row if given."""
    return out_features % 4 == 0 and in_features % 8 == 0 and group % 8 == 0 and in_features % group == 0


def pack_weights(weight: torch.Tensor) -> torch.Tensor:
    """A linear layer's weight ``[n, k]`` (fp16, bf16, or int8 to be scaled per output row) in ``linear``'s layout:
    blocks of four output rows, each ``[k / 8, 4, 8]`` (eight weights of each of the four rows per 64-byte line in
    fp16 and bf16, per 32 bytes in int8), so a block is one sequential stream. Needs ``n % 4 == 0`` and ``k % 8 == 0``
    (``can_pack``)."""
    out_features, in_features = weight.shape
    if weight.dtype not in (torch.float16, torch.bfloat16, torch.int8):
        raise ValueError(f"pack_weights takes fp16, bf16 or int8 weights, got {weight.dtype}")
    if not can_pack(out_features, in_features):
        raise ValueError(f"pack_weights needs out_features % 4 == 0 and in_features % 8 == 0, got "
                         f"{tuple(weight.shape)}")
    blocks = weight.detach().view(out_features // 4, 4, in_features // 8, 8)
    return blocks.permute(0, 2, 1, 3).contiguous()


def pack_scales(scales: torch.Tensor) -> torch.Tensor:
    """Int8 weights' scales ``[n, groups]`` (float32, one per ``k / groups`` consecutive weights of a row) in
    ``linear``'s layout: per block of four output rows, ``[groups, 4]``."""
    out_features, groups = scales.shape
    if scales.dtype != torch.float32 or out_features % 4:
        raise ValueError(f"pack_scales takes float32 scales [n, groups] with n % 4 == 0, got "
                         f"{scales.dtype} {tuple(scales.shape)}")
    return scales.view(out_features // 4, 4, groups).permute(0, 2, 1).contiguous()


def packed_shape(packed: torch.Tensor) -> tuple[int, int]:
    """``(out_features, in_features)`` of a weight packed by ``pack_weights``."""
    return packed.shape[0] * 4, packed.shape[1] * 8
