"""Weights laid out for the CPU kernels' GEMV: blocks of four output rows, each one sequential stream, in fp16, bf16
or int8 (with per-group scales beside them), and for the tile GEMM; on huge pages where they span one
(``infer.host.streamed_empty``). ``infer.model.quantization`` packs its linears with these."""

from __future__ import annotations

import torch

from infer.host import streamed_empty


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
        raise ValueError(
            f"pack_weights needs out_features % 4 == 0 and in_features % 8 == 0, got {tuple(weight.shape)}"
        )
    blocks = weight.detach().view(out_features // 4, 4, in_features // 8, 8)
    packed = streamed_empty((out_features // 4, in_features // 8, 4, 8), weight.dtype)
    return packed.copy_(blocks.permute(0, 2, 1, 3))


def pack_scales(scales: torch.Tensor) -> torch.Tensor:
    """Int8 weights' scales ``[n, groups]`` (float32, one per ``k / groups`` consecutive weights of a row) in
    ``linear``'s layout: per block of four output rows, ``[groups, 4]``."""
    out_features, groups = scales.shape
    if scales.dtype != torch.float32 or out_features % 4:
        raise ValueError(
            f"pack_scales takes float32 scales [n, groups] with n % 4 == 0, got {scales.dtype} {tuple(scales.shape)}"
        )
    return scales.view(out_features // 4, 4, groups).permute(0, 2, 1).contiguous()


def packed_shape(packed: torch.Tensor) -> tuple[int, int]:
    """``(out_features, in_features)`` of a weight packed by ``pack_weights``."""
    return packed.shape[0] * 4, packed.shape[1] * 8


TILE = 32  # AMX's layout takes output columns and input columns in blocks of 32


def can_pack_tiles(out_features: int, in_features: int) -> bool:
    """Whether ``pack_tiles`` lays out this shape."""
    return out_features % TILE == 0 and in_features % TILE == 0


def pack_tiles(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 weight ``[n, k]`` in ``infer_linear_tiles``' layout for AMX's bf16 dot products: per block of 32
    output columns and per 32 input columns, two 16 x 16 B tiles (16 output columns each), row ``p`` holding the
    pairs ``(w[c, 2p], w[c, 2p + 1])`` of the tile's 16 columns ``c``: ``[n / 32, k / 32, 2, 16, 16, 2]``, each block
    one sequential stream. Needs ``n % 32 == 0`` and ``k % 32 == 0`` (``can_pack_tiles``)."""
    out_features, in_features = weight.shape
    if weight.dtype != torch.bfloat16 or not can_pack_tiles(out_features, in_features):
        raise ValueError(
            f"pack_tiles takes bf16 weights [n, k] with n % {TILE} == 0 and k % {TILE} == 0, got "
            f"{weight.dtype} {tuple(weight.shape)}"
        )
    # Each pair moves as one int32: the permuted copy then moves 4-byte elements, not 2-byte ones (2.5x faster).
    pairs = weight.detach().contiguous().view(torch.int32).reshape(out_features // TILE, 2, 16, in_features // TILE, 16)
    tiles = streamed_empty((out_features // TILE, in_features // TILE, 2, 16, 16, 2), torch.bfloat16)
    tiles.view(torch.int32).view(tiles.shape[:5]).copy_(pairs.permute(0, 3, 1, 4, 2))
    return tiles


def unpack_tiles(tiles: torch.Tensor) -> torch.Tensor:
    """The plain ``[n, k]`` weight that ``pack_tiles`` laid out."""
    out_features, in_features = tiles_shape(tiles)
    pairs = tiles.view(torch.int32).view(*tiles.shape[:5])  # pairs moved as int32, as pack_tiles moves them
    return pairs.permute(0, 2, 4, 1, 3).reshape(out_features, in_features // 2).view(torch.bfloat16)


def tiles_shape(tiles: torch.Tensor) -> tuple[int, int]:
    """``(out_features, in_features)`` of a weight packed by ``pack_tiles``."""
    return tiles.shape[0] * TILE, tiles.shape[1] * TILE
