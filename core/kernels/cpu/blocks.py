"""Weights kept as GGUF's blocks of 32 (``Q4_0``, ``Q4_1``, ``Q8_0``) for the block GEMV (``csrc/gemv_blocks.c``).

A GGUF tensor stores each row as blocks of 32 weights: an fp16 scale ``d`` (``Q4_1``: and an fp16 minimum ``m``)
and 32 quants, 4-bit nibbles (byte ``j`` holds columns ``j`` and ``16 + j``) or int8. ``pack_blocks`` repacks such
rows once at load into the layout the kernel streams: groups of four output rows, one record per 32 columns holding
the four rows' scales and then their quants, the nibbles rearranged so that one 64-byte load gives two rows whole
(the layout is described where the kernel reads it, at the top of ``gemv_blocks.c``). No float copy is kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32  # weights per block
# The block kinds by name, as the C side numbers them (``KIND_Q4_0`` ... in ``cpu_kernels.h``).
BLOCK_KINDS = {"q4_0": 3, "q4_1": 4, "q8_0": 5}
# Bytes of one GGUF block of each kind, and of the kernel's record of four rows' blocks.
GGUF_BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q8_0": 34}
RECORD_BYTES = {"q4_0": 72, "q4_1": 80, "q8_0": 136}


@dataclass(frozen=True, slots=True)
class BlockWeight:
    """A linear layer's weight ``[out_features, in_features]`` in the block GEMV's layout: ``data`` is uint8
    ``[ceil(out_features / 4), in_features / 32, RECORD_BYTES[kind]]``."""

    data: torch.Tensor
    kind: str
    out_features: int

    @property
    def in_features(self) -> int:
        return self.data.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def gguf_rows(raw: torch.Tensor | np.ndarray, kind: str, out_features: int) -> torch.Tensor:
    """GGUF's bytes of a ``[out_features, k]`` tensor of ``kind`` as uint8 ``[out_features, k / 32, block bytes]``."""
    rows = torch.as_tensor(np.ascontiguousarray(raw)) if isinstance(raw, np.ndarray) else raw
    return rows.view(torch.uint8).reshape(out_features, -1, GGUF_BLOCK_BYTES[kind])


def pack_blocks(raw: torch.Tensor | np.ndarray, kind: str, out_features: int) -> BlockWeight:
    """A GGUF tensor's bytes (rows of blocks of ``kind``: ``q4_0``, ``q4_1`` or ``q8_0``) in the block GEMV's layout.
    Any ``out_features`` (the last group of four is padded with zero rows)."""
    if kind not in BLOCK_KINDS:
        raise ValueError(f"unknown block kind {kind!r}; choose one of {', '.join(BLOCK_KINDS)}")
    blocks = gguf_rows(raw, kind, out_features)
    padded = -(-out_features // 4) * 4
    if padded != out_features:
        blocks = torch.cat([blocks, blocks.new_zeros(padded - out_features, *blocks.shape[1:])])
    groups = blocks.view(padded // 4, 4, blocks.shape[1], -1).permute(0, 2, 1, 3)  # [groups, blocks, 4, bytes]
    shape = groups.shape[:2]
    d = groups[..., 0:2].reshape(*shape, 8)  # the four rows' fp16 scales
    scales = torch.cat([d, groups[..., 2:4].reshape(*shape, 8)], dim=-1) if kind == "q4_1" else d  # then m
    quants = groups[..., 4 if kind == "q4_1" else 2 :]
    if kind == "q8_0":  # int8 plus 128: unsigned, as VNNI's dot products take them
        quants = quants ^ 0x80
    else:  # nibbles of columns j and 16 + j -> rows 0 and 2 (1 and 3) of column j in one byte
        values = torch.cat([quants & 0x0F, quants >> 4], dim=-1)  # [groups, blocks, 4, 32]
        quants = values[:, :, 0:2] | (values[:, :, 2:4] << 4)
    return BlockWeight(torch.cat([scales, quants.reshape(*shape, -1)], dim=-1).contiguous(), kind, out_features)


def quantize_blocks(weight: torch.Tensor, kind: str) -> BlockWeight:
    """A float weight ``[n, k]`` (``k % 32 == 0``) quantized as llama.cpp quantizes ``kind`` (gguf's reference
    quantizers: ``q4_0`` symmetric, ``q4_1`` with a minimum, ``q8_0``), in the block GEMV's layout."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    out_features, in_features = weight.shape
    if in_features % BLOCK:
        raise ValueError(f"block quantization needs in_features % {BLOCK} == 0, got {tuple(weight.shape)}")
    raw = quantize(weight.detach().float().numpy(), GGMLQuantizationType[kind.upper()])
    return pack_blocks(raw, kind, out_features)


def dequantize_blocks(weight: BlockWeight) -> torch.Tensor:
    """The float32 ``[out_features, in_features]`` weights a ``BlockWeight`` encodes."""
    data, kind = weight.data, weight.kind
    groups, blocks, _ = data.shape
    scale_bytes = 16 if kind == "q4_1" else 8
    halves = data[..., :scale_bytes].contiguous().view(torch.float16).float()  # [groups, blocks, 4 or 8]
    d = halves[..., :4]
    quants = data[..., scale_bytes:]
    if kind == "q8_0":
        values = quants.reshape(groups, blocks, 4, BLOCK).float() - 128
    else:
        pairs = quants.reshape(groups, blocks, 2, BLOCK)
        values = torch.cat([pairs & 0x0F, pairs >> 4], dim=2).float()  # rows 0, 1, 2, 3
    weights = values * d[..., None]
    if kind == "q4_0":
        weights -= 8 * d[..., None]
    elif kind == "q4_1":
        weights += halves[..., 4:, None]
    return weights.permute(0, 2, 1, 3).reshape(groups * 4, blocks * BLOCK)[: weight.out_features]
