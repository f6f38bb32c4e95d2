"""Small numpy quantizers for GGUF's ``Q4_K`` and ``Q6_K`` super-blocks, for tests and benchmarks.

The gguf package dequantizes these types but does not quantize them (llama.cpp's quantizers search each sub-block's
scale in C). These take the plain choice: a sub-block's range over its levels, the super-block's largest scale
over the 6-bit (``Q4_K``) or int8 (``Q6_K``) range, then rounding. They write valid GGUF bytes, in the file's own
layout, which ``gguf.quants.dequantize`` reads; their error is a little above llama.cpp's.
"""

from __future__ import annotations

import numpy as np

SUPER_BLOCK = 256


def _divide(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    """numerator / denominator, 0 where the denominator is 0."""
    out = np.zeros(np.broadcast(numerator, denominator).shape)
    return np.divide(numerator, denominator, out=out, where=denominator != 0)


def _super_blocks(weight: np.ndarray) -> np.ndarray:
    rows, columns = weight.shape
    if columns % SUPER_BLOCK:
        raise ValueError(f"K-quants need in_features % {SUPER_BLOCK} == 0, got {weight.shape}")
    return np.asarray(weight, dtype=np.float32).reshape(rows, columns // SUPER_BLOCK, SUPER_BLOCK)


def quantize_q4_k(weight: np.ndarray) -> np.ndarray:
    """A float ``[n, k]`` weight as ``Q4_K`` bytes ``[n, k / 256 * 144]``: per sub-block of 32 a scale and a minimum
    (weight = d * sc * q - dmin * m, q in 0-15), 6-bit multiples of the super-block's fp16 d and dmin."""
    blocks = _super_blocks(weight)
    rows, supers, _ = blocks.shape
    sub = blocks.reshape(rows, supers, 8, 32)
    low, high = np.minimum(sub.min(axis=-1), 0.0), np.maximum(sub.max(axis=-1), 0.0)  # [n, s, 8]
    scale, minimum = (high - low) / 15, -low
    d = (scale.max(axis=-1) / 63).astype(np.float16)
    dmin = (minimum.max(axis=-1) / 63).astype(np.float16)
    sc = np.clip(np.round(_divide(scale, d.astype(np.float32)[..., None])), 0, 63).astype(np.uint8)
    m = np.clip(np.round(_divide(minimum, dmin.astype(np.float32)[..., None])), 0, 63).astype(np.uint8)
    step = d.astype(np.float32)[..., None] * sc  # [n, s, 8]
    offset = dmin.astype(np.float32)[..., None] * m
    q = np.clip(np.round(_divide(sub + offset[..., None], step[..., None])), 0, 15).astype(np.uint8)
    scales = np.concatenate(  # sc[0-3], m[0-3] in the low 6 bits; sc[4-7], m[4-7] split as GGUF does
        [
            sc[..., :4] | ((sc[..., 4:] >> 4) << 6),
            m[..., :4] | ((m[..., 4:] >> 4) << 6),
            (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4),
        ],
        axis=-1,
    )
    pairs = q.reshape(rows, supers, 4, 2, 32)  # byte l of chunk c: sub-block 2c's low nibble, 2c + 1's high
    quants = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(rows, supers, 128)
    halves = [value.view(np.uint8).reshape(rows, supers, 2) for value in (d, dmin)]
    raw = np.concatenate([*halves, scales, quants], axis=-1)
    return raw.reshape(rows, -1)


def quantize_q6_k(weight: np.ndarray) -> np.ndarray:
    """A float ``[n, k]`` weight as ``Q6_K`` bytes ``[n, k / 256 * 210]``: per sub-block of 16 a signed int8 multiple of
    the super-block's fp16 d (weight = d * sc * (q - 32), q in 0-63), the sub-block's largest magnitude at -32."""
    blocks = _super_blocks(weight)
    rows, supers, _ = blocks.shape
    sub = blocks.reshape(rows, supers, 16, 16)
    extreme = np.take_along_axis(sub, np.abs(sub).argmax(axis=-1)[..., None], axis=-1)[..., 0]  # [n, s, 16]
    scale = extreme / -32
    d = (np.abs(scale).max(axis=-1) / 127).astype(np.float16)
    sc = np.clip(np.round(_divide(scale, d.astype(np.float32)[..., None])), -127, 127).astype(np.int8)
    step = d.astype(np.float32)[..., None] * sc
    q = (np.clip(np.round(_divide(sub, step[..., None])), -32, 31) + 32).astype(np.uint8).reshape(rows, supers, 256)
    # columns 128 h + 32 t + l: low 4 bits at ql[64 h + 32 (t % 2) + l] (t >= 2: the high nibble), top 2 at
    # qh[32 h + l] bits 2t
    grouped = q.reshape(rows, supers, 2, 4, 32)  # [h, t, l]
    low, top = grouped & 0x0F, grouped >> 4
    ql = (low[..., 0:2, :] | (low[..., 2:4, :] << 4)).reshape(rows, supers, 128)
    qh = (top[..., 0, :] | (top[..., 1, :] << 2) | (top[..., 2, :] << 4) | (top[..., 3, :] << 6)).reshape(
        rows, supers, 64
    )
    raw = np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8).reshape(rows, supers, 2)], axis=-1)
    return raw.reshape(rows, -1)


QUANTIZERS = {"q4_k": quantize_q4_k, "q6_k": quantize_q6_k}
