"""Weights kept as GGUF's blocks of 32 (``Q4_0``, ``Q4_1``, ``Q8_0``, ``MXFP4``) for the block GEMV
(``csrc/gemv_blocks.c``), and as its K-quant super-blocks of 256 (``Q4_K``, ``Q6_K``; ``csrc/gemv_kquants.c``).

A GGUF tensor stores each row as blocks of 32 weights: an fp16 scale ``d`` (``Q4_1``: and an fp16 minimum ``m``;
``MXFP4``: a byte, the exponent of a power of two) and 32 quants, 4-bit nibbles (byte ``j`` holds columns ``j`` and
``16 + j``; ``MXFP4``'s are e2m1 codes) or int8. ``pack_blocks`` repacks such
rows once at load into the layout the kernel streams: groups of four output rows, one record per 32 columns holding
the four rows' scales and then their quants, the nibbles rearranged so that one 64-byte load gives two rows whole
(the layout is described where the kernel reads it, at the top of ``gemv_blocks.c``). No float copy is kept.

A K-quant row stays a row: its super-blocks in turn, each repacked in place into as many bytes (the quants in the
order of the kernel's transposed activations, ``Q4_K``'s 6-bit scales re-encoded, ``Q6_K``'s scales even sub-blocks
first; ``gemv_kquants.c`` describes it). A fused projection whose parts the file stores as both K types (a
``Q4_K_M`` file's QKV where V is ``Q6_K``) is one ``k_mixed`` weight: a header naming the parts, then their rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from infer.host import streamed_empty

BLOCK = 32  # weights per block
SUPER_BLOCK = 256  # weights per K-quant super-block
# The block kinds by name, as the C side numbers them (``KIND_Q4_0`` ... in ``cpu_kernels.h``).
BLOCK_KINDS = {"q4_0": 3, "q4_1": 4, "q8_0": 5, "q4_k": 6, "q6_k": 7, "k_mixed": 8, "mxfp4": 9}
K_KINDS = ("q4_k", "q6_k")
# The kinds infer quantizes float weights to (K-quants come from a GGUF file).
QUANTIZED_KINDS = ("q4_0", "q4_1", "q8_0")
# Bytes of one GGUF block of each kind, and of the kernel's record: four rows' blocks, or one row's super-block.
GGUF_BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q8_0": 34, "q4_k": 144, "q6_k": 210, "mxfp4": 17}
RECORD_BYTES = {"q4_0": 72, "q4_1": 80, "q8_0": 136, "q4_k": 144, "q6_k": 210, "mxfp4": 68}
# Weights a record spans in a row, and output rows it holds.
BLOCK_COLUMNS = {"q4_0": BLOCK, "q4_1": BLOCK, "q8_0": BLOCK, "q4_k": SUPER_BLOCK, "q6_k": SUPER_BLOCK, "mxfp4": BLOCK}
GROUP_ROWS = {"q4_0": 4, "q4_1": 4, "q8_0": 4, "q4_k": 1, "q6_k": 1, "mxfp4": 4}
# Bytes of a block's scales before its quants, in GGUF's block and in the kernel's record (four rows').
SCALE_BYTES = {"q4_0": 2, "q4_1": 4, "q8_0": 2, "mxfp4": 1}
# MXFP4's e2m1 values by code (sign, two exponent bits, one mantissa bit), and their scales' exponent bias.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_BIAS = 127
# A k_mixed weight's header: int64 [parts, (kind, rows) per part], zero-padded to this many bytes.
MIXED_HEADER_BYTES = 128


def bytes_per_weight(kind: str) -> float:
    """Bytes a weight of a block kind takes in the kernels' records (scales included)."""
    return RECORD_BYTES[kind] / (BLOCK_COLUMNS[kind] * GROUP_ROWS[kind])


@dataclass(frozen=True, slots=True)
class BlockWeight:
    """A linear layer's weight ``[out_features, in_features]`` in the block GEMV's layout: ``data`` is uint8
    ``[ceil(out_features / GROUP_ROWS[kind]), in_features / BLOCK_COLUMNS[kind], RECORD_BYTES[kind]]``; for
    ``k_mixed``, the header and then each part's such bytes, flat, and ``parts`` the header's ``(kind, rows)`` (read
    on every call, where parsing the header took longer than checking the rest)."""

    data: torch.Tensor
    kind: str
    out_features: int
    parts: tuple[tuple[str, int], ...] = ()

    @property
    def in_features(self) -> int:
        if self.kind == "k_mixed":
            row_bytes = sum(rows * RECORD_BYTES[kind] for kind, rows in self.parts)
            return (self.data.numel() - MIXED_HEADER_BYTES) // row_bytes * SUPER_BLOCK
        return self.data.shape[1] * BLOCK_COLUMNS[self.kind]

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def well_formed(weight: BlockWeight) -> bool:
    """Whether ``weight.data`` is laid out as its kind's kernel reads it (``pack_blocks``, ``pack_mixed_kquants``)."""
    data, kind = weight.data, weight.kind
    if data.dtype != torch.uint8 or not data.is_contiguous() or kind not in BLOCK_KINDS:
        return False
    if kind == "k_mixed":
        return data.dim() == 1 and bool(weight.parts) and sum(rows for _, rows in weight.parts) == weight.out_features
    rows = data.shape[0] * GROUP_ROWS[kind] if data.dim() == 3 else 0
    return data.dim() == 3 and data.shape[2] == RECORD_BYTES[kind] and rows >= weight.out_features


def gguf_rows(raw: torch.Tensor | np.ndarray, kind: str, out_features: int) -> torch.Tensor:
    """GGUF's bytes of a ``[out_features, k]`` tensor of ``kind`` as uint8 ``[out_features, k / 32, block bytes]``."""
    rows = torch.as_tensor(np.ascontiguousarray(raw)) if isinstance(raw, np.ndarray) else raw
    return rows.view(torch.uint8).reshape(out_features, -1, GGUF_BLOCK_BYTES[kind])


def pack_blocks(raw: torch.Tensor | np.ndarray, kind: str, out_features: int) -> BlockWeight:
    """A GGUF tensor's bytes (rows of blocks of ``kind``: ``q4_0``, ``q4_1``, ``q8_0`` or ``mxfp4``; or K-quant
    super-blocks) in the block GEMV's layout. Any ``out_features`` (the last group of four is padded with zero
    rows)."""
    if kind not in GGUF_BLOCK_BYTES:
        raise ValueError(f"unknown block kind {kind!r}; choose one of {', '.join(GGUF_BLOCK_BYTES)}")
    if kind in K_KINDS:
        return pack_kquants(raw, kind, out_features)
    blocks = gguf_rows(raw, kind, out_features)
    padded = -(-out_features // 4) * 4
    if padded != out_features:
        blocks = torch.cat([blocks, blocks.new_zeros(padded - out_features, *blocks.shape[1:])])
    groups = blocks.view(padded // 4, 4, blocks.shape[1], -1).permute(0, 2, 1, 3)  # [groups, blocks, 4, bytes]
    shape = groups.shape[:2]
    size = SCALE_BYTES[kind] // 2 if kind == "q4_1" else SCALE_BYTES[kind]  # one scale's bytes
    d = groups[..., 0:size].reshape(*shape, 4 * size)  # the four rows' scales
    scales = torch.cat([d, groups[..., 2:4].reshape(*shape, 8)], dim=-1) if kind == "q4_1" else d  # then m
    quants = groups[..., SCALE_BYTES[kind] :]
    if kind == "q8_0":  # int8 plus 128: unsigned, as VNNI's dot products take them
        quants = quants ^ 0x80
    else:  # nibbles of columns j and 16 + j -> rows 0 and 2 (1 and 3) of column j in one byte
        values = torch.cat([quants & 0x0F, quants >> 4], dim=-1)  # [groups, blocks, 4, 32]
        quants = values[:, :, 0:2] | (values[:, :, 2:4] << 4)
    quants = quants.reshape(*shape, -1)
    data = streamed_empty((*shape, scales.shape[-1] + quants.shape[-1]), torch.uint8)
    return BlockWeight(torch.cat([scales, quants], dim=-1, out=data), kind, out_features)


def mxfp4_gguf_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 as a safetensors checkpoint stores it (gpt-oss's ``_blocks`` ``[..., groups, 16]``, byte ``j`` holding
    columns ``2j`` (low nibble) and ``2j + 1``; ``_scales`` ``[..., groups]``) as GGUF's blocks ``[..., groups, 17]``:
    the scale byte, then byte ``j`` holding columns ``j`` and ``16 + j``."""
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # [..., groups, 32] in column order
    packed = codes[..., : BLOCK // 2] | (codes[..., BLOCK // 2 :] << 4)
    return torch.cat([scales.unsqueeze(-1), packed], dim=-1)


def quantize_blocks(weight: torch.Tensor, kind: str) -> BlockWeight:
    """A float weight ``[n, k]`` (``k % 32 == 0``) quantized as llama.cpp quantizes ``kind`` (``q4_0`` symmetric,
    ``q4_1`` with a minimum, ``q8_0``), in the block GEMV's layout."""
    if kind not in QUANTIZED_KINDS:
        raise ValueError(
            f"infer quantizes float weights as q4_0, q4_1 or q8_0, not {kind!r} (K-quants come from a GGUF file)"
        )
    out_features, in_features = weight.shape
    if in_features % BLOCK:
        raise ValueError(f"block quantization needs in_features % {BLOCK} == 0, got {tuple(weight.shape)}")
    rows = max(1, QUANTIZE_CHUNK // in_features)
    raw = torch.cat([gguf_blocks_of(part, kind) for part in weight.detach().split(rows)])
    return pack_blocks(raw, kind, out_features)


# Weights quantized per pass of ``gguf_blocks_of``: its float32 temporaries stay a few MB, in cache.
QUANTIZE_CHUNK = 1 << 20


def gguf_blocks_of(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """GGUF's bytes of a float ``[n, k]`` weight as ``kind`` (uint8 ``[n, k / 32, block bytes]``), the very bytes of
    llama.cpp's reference quantizers (and of the ``gguf`` package's): float32 arithmetic in their order, fp16 scales
    rounded to nearest even, scale 0 for a block of zeros."""
    blocks = weight.float().reshape(weight.shape[0], -1, BLOCK)
    if kind == "q4_0":  # the signed value of largest magnitude (the first such) is -8 d
        largest = blocks.gather(-1, blocks.abs().argmax(dim=-1, keepdim=True))
        d = largest / -8
        quants = torch.trunc(blocks * _inverse(d) + 8.5).clamp_(0, 15)
        scales = (d,)
    elif kind == "q4_1":  # min + d * q, q in 0..15
        low, high = blocks.amin(dim=-1, keepdim=True), blocks.amax(dim=-1, keepdim=True)
        d = (high - low) / 15
        quants = torch.trunc((blocks - low) * _inverse(d) + 0.5).clamp_(0, 15)
        scales = (d, low)
    else:  # q8_0: d = amax / 127, q rounded half away from zero
        d = blocks.abs().amax(dim=-1, keepdim=True) / 127
        scaled = blocks * _inverse(d)
        magnitude = scaled.abs()
        whole = magnitude.floor()
        quants = torch.sign(scaled) * (whole + torch.floor(2 * (magnitude - whole)))
        scales = (d,)
    halves = [scale.half().view(torch.uint8) for scale in scales]  # each [n, blocks, 2]
    if kind == "q8_0":
        return torch.cat([*halves, quants.to(torch.int8).view(torch.uint8)], dim=-1)
    nibbles = quants.to(torch.uint8)
    packed = nibbles[..., : BLOCK // 2] | (nibbles[..., BLOCK // 2 :] << 4)  # byte j: columns j and 16 + j
    return torch.cat([*halves, packed], dim=-1)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """1 / d, and 0 where d is 0 (a block of equal weights)."""
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def dequantize_blocks(weight: BlockWeight) -> torch.Tensor:
    """The float32 ``[out_features, in_features]`` weights a ``BlockWeight`` encodes."""
    if weight.kind in (*K_KINDS, "k_mixed"):
        return dequantize_kquants(weight)
    data, kind = weight.data, weight.kind
    groups, blocks, _ = data.shape
    scale_bytes = 4 * SCALE_BYTES[kind]
    quants = data[..., scale_bytes:]
    if kind == "mxfp4":
        pairs = quants.reshape(groups, blocks, 2, BLOCK)
        codes = torch.cat([pairs & 0x0F, pairs >> 4], dim=2).long()  # rows 0, 1, 2, 3
        exponents = data[..., :4].to(torch.int32) - E8M0_BIAS
        weights = torch.ldexp(torch.tensor(FP4_VALUES)[codes], exponents[..., None])
        return weights.permute(0, 2, 1, 3).reshape(groups * 4, blocks * BLOCK)[: weight.out_features]
    halves = data[..., :scale_bytes].contiguous().view(torch.float16).float()  # [groups, blocks, 4 or 8]
    d = halves[..., :4]
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


# ---- K-quant super-blocks -------------------------------------------------------------------------------------------


def _transposed_columns() -> np.ndarray:
    """For each byte of the kernel's transposed super-block of x (64u + 4 lane + c, lane = 8h + j), its column:
    32j + 8u + 4h + c."""
    position = np.arange(SUPER_BLOCK)
    u, lane, c = position // 64, position % 64 // 4, position % 4
    return 32 * (lane % 8) + 8 * u + 4 * (lane // 8) + c


COLUMN_AT = torch.from_numpy(_transposed_columns())  # [256]
# Q6_K's sub-blocks as the record stores their scales: the even ones, then the odd ones.
Q6_K_SCALE_ORDER = np.array([*range(0, 16, 2), *range(1, 16, 2)])


def _gguf_kquant_values(blocks: np.ndarray, kind: str) -> np.ndarray:
    """GGUF's quants of K-quant super-blocks ``[N, GGUF_BLOCK_BYTES[kind]]`` as uint8 ``[N, 256]`` in column order
    (``Q4_K``: 0-15; ``Q6_K``: 0-63, the stored ``q + 32``)."""
    count = len(blocks)
    if kind == "q4_k":
        qs = blocks[:, 16:144].reshape(count, 4, 1, 32)  # byte l of run c: sub-block 2c (low nibble), 2c + 1 (high)
        return np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(count, SUPER_BLOCK)
    low = blocks[:, 0:128].reshape(count, 2, 2, 32)  # [half, run, l]: columns 128 half + 32 (run + 2 shift) + l
    low = np.concatenate([low & 0x0F, low >> 4], axis=2)  # [half, t, l]
    high = blocks[:, 128:192].reshape(count, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    return (low | ((high & 3) << 4)).reshape(count, SUPER_BLOCK)


def _transposed(values: np.ndarray) -> np.ndarray:
    """Super-blocks' values ``[N, 256]`` in column order as ``[N, 4, 64]``: by the kernel's 64-byte steps of x, byte
    4 lane + c of step u holding column 32j + 8u + 4h + c (lane = 8h + j)."""
    return values.reshape(-1, 8, 4, 2, 4).transpose(0, 2, 3, 1, 4).reshape(-1, 4, 64)


def _gguf_q4_k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GGUF's 12 bytes of 6-bit scales and minima of ``Q4_K`` super-blocks ``[N, 12]`` as ``sc``, ``m`` ``[N, 8]``."""
    low, mid, high = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([low & 0x3F, (high & 0x0F) | ((low >> 6) << 4)], axis=1)
    m = np.concatenate([mid & 0x3F, (high >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc, m


def pack_kquants(raw: torch.Tensor | np.ndarray, kind: str, out_features: int) -> BlockWeight:
    """A GGUF ``Q4_K`` or ``Q6_K`` tensor's bytes, each super-block repacked in place into the kernel's record of as
    many bytes (``gemv_kquants.c``): ``[out_features, in_features / 256, RECORD_BYTES[kind]]``."""
    blocks = _byte_rows(raw, out_features).reshape(-1, GGUF_BLOCK_BYTES[kind])  # [N super-blocks, bytes]
    steps = _transposed(_gguf_kquant_values(blocks, kind))  # [N, 4, 64]
    quants = ((steps[:, 0:2] & 0x0F) | (steps[:, 2:4] << 4)).reshape(-1, 128)  # uint8: Q6_K's top bits shift out
    if kind == "q4_k":
        sc, m = _gguf_q4_k_scales(blocks[:, 4:16])
        high = (sc >> 4) | ((m >> 4) << 2)
        scales = [(sc & 0x0F) | ((m & 0x0F) << 4), high[:, :4] | (high[:, 4:] << 4)]
        record = [blocks[:, 0:4], *scales, quants]  # d, dmin, scales, quants
    else:
        top = steps >> 4
        high = top[:, 0] | (top[:, 1] << 2) | (top[:, 2] << 4) | (top[:, 3] << 6)
        record = [blocks[:, 208:210], blocks[:, 192:208][:, Q6_K_SCALE_ORDER], quants, high]  # d, sc, quants, high
    data = streamed_empty((len(blocks), RECORD_BYTES[kind]), torch.uint8)
    np.concatenate(record, axis=1, out=data.numpy())
    return BlockWeight(data.view(out_features, -1, RECORD_BYTES[kind]), kind, out_features)


def _byte_rows(raw: torch.Tensor | np.ndarray, out_features: int) -> np.ndarray:
    """A tensor's bytes as a uint8 array ``[out_features, bytes]`` (a read-only memory map stays one)."""
    if isinstance(raw, torch.Tensor):
        raw = raw.contiguous().view(torch.uint8).numpy()
    return np.ascontiguousarray(raw).view(np.uint8).reshape(out_features, -1)


def pack_mixed_kquants(parts: list[tuple[torch.Tensor | np.ndarray, str, int]]) -> BlockWeight:
    """A projection whose consecutive row ranges are stored as different K types: ``parts`` are each range's GGUF bytes,
    kind and rows, in order. One kind throughout gives that kind's weight; else a ``k_mixed`` one (runs of a kind
    merged)."""
    runs: list[list] = []
    for raw, kind, rows in parts:
        if kind not in K_KINDS:
            raise ValueError(f"a mixed weight takes the K kinds {', '.join(K_KINDS)}, got {kind!r}")
        data = _byte_rows(raw, rows)
        if runs and runs[-1][0] == kind:
            runs[-1][1].append(data)
        else:
            runs.append([kind, [data]])
    packed = [pack_kquants(np.concatenate(datas), kind, sum(len(data) for data in datas)) for kind, datas in runs]
    if len(packed) == 1:
        return packed[0]
    entries = [len(packed)] + [value for weight in packed for value in (BLOCK_KINDS[weight.kind], weight.out_features)]
    if len(entries) * 8 > MIXED_HEADER_BYTES:
        raise ValueError(f"a mixed weight holds at most {(MIXED_HEADER_BYTES // 8 - 1) // 2} runs, got {len(packed)}")
    header = torch.zeros(MIXED_HEADER_BYTES // 8, dtype=torch.int64)
    header[: len(entries)] = torch.tensor(entries)
    pieces = [header.view(torch.uint8), *(weight.data.reshape(-1) for weight in packed)]
    data = torch.cat(pieces, out=streamed_empty((sum(piece.numel() for piece in pieces),), torch.uint8))
    parts = tuple((weight.kind, weight.out_features) for weight in packed)
    return BlockWeight(data, "k_mixed", sum(weight.out_features for weight in packed), parts)


def dequantize_kquants(weight: BlockWeight) -> torch.Tensor:
    """The float32 weights of a ``q4_k``, ``q6_k`` or ``k_mixed`` ``BlockWeight``, computed as gguf's dequantizers
    compute them (bit for bit)."""
    if weight.kind == "k_mixed":
        supers, at, rows = weight.in_features // SUPER_BLOCK, MIXED_HEADER_BYTES, []
        for kind, count in weight.parts:
            size = count * supers * RECORD_BYTES[kind]
            part = weight.data[at : at + size].view(count, supers, RECORD_BYTES[kind])
            rows.append(dequantize_kquants(BlockWeight(part, kind, count)))
            at += size
        return torch.cat(rows)
    data, kind = weight.data, weight.kind
    quants = data[..., 16:144] if kind == "q4_k" else data[..., 18:146]
    values = torch.empty(*data.shape[:-1], SUPER_BLOCK, dtype=torch.uint8)
    values[..., COLUMN_AT[:128]] = quants & 0x0F
    values[..., COLUMN_AT[128:]] = quants >> 4
    if kind == "q4_k":
        d, dmin = (data[..., at : at + 2].contiguous().view(torch.float16).float() for at in (0, 2))
        low, packed_high = data[..., 4:12], data[..., 12:16]
        high = torch.cat([packed_high & 0x0F, packed_high >> 4], dim=-1)
        sc = (low & 0x0F) | ((high & 3) << 4)
        m = (low >> 4) | ((high >> 2) << 4)
        scale = (d * sc.float()).repeat_interleave(32, dim=-1)
        offset = (dmin * m.float()).repeat_interleave(32, dim=-1)
        weights = scale * values.float() - offset
    else:
        top = data[..., 146:210]
        for u in range(4):
            values[..., COLUMN_AT[64 * u : 64 * (u + 1)]] |= ((top >> (2 * u)) & 3) << 4
        d = data[..., 0:2].contiguous().view(torch.float16).float()
        sc = torch.empty(*data.shape[:-1], 16, dtype=torch.int8)
        sc[..., torch.from_numpy(Q6_K_SCALE_ORDER)] = data[..., 2:18].view(torch.int8)
        scale = (d * sc.float()).repeat_interleave(16, dim=-1)
        weights = scale * (values.to(torch.int8) - 32).float()
    return weights.reshape(weight.out_features, -1)
