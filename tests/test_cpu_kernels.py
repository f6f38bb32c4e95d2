"""infer's C kernels for the CPU agree with torch's ops, and building them fails clearly or falls back."""

from __future__ import annotations

import ctypes
import logging
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from infer.kernels import cpu as cpu_kernels
from infer.kernels.cpu import KernelAttentionPlan, KernelBuildError, builder
from infer.model import RotaryEmbedding, apply_rotary, default_inverse_frequencies

# Widths on both sides of the 8-float vectors and the 64-float register tiles, and odd ones for the tail loops.
DIMS = [7, 64, 576, 131]
# The head sizes whose bf16 rows the attention kernels multiply as the pool holds them (SmolLM2's 64, Qwen3's and
# Llama 3's 128, Gemma 3's 256; cpu_kernels.DIRECT_HEAD_DIMS), each its own copy of the kernels.
HEAD_DIMS = list(cpu_kernels.DIRECT_HEAD_DIMS)


@pytest.fixture(scope="module")
def kernels():
    return cpu_kernels.load(True)


def randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("rows", [1, 5, 130])
def test_add_rms_norm_adds_in_place_and_normalizes(kernels, rows, dim):
    residual, delta, weight = randn(rows, dim, seed=1), randn(rows, dim, seed=2), randn(dim, seed=3)
    expected_sum = residual + delta
    out = kernels.add_rms_norm(residual, delta, weight, 1e-5)
    assert torch.equal(residual, expected_sum)
    torch.testing.assert_close(out, F.rms_norm(expected_sum, (dim,), weight, 1e-5), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        kernels.rms_norm(delta, weight, 1e-6), F.rms_norm(delta, (dim,), weight, 1e-6), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", DIMS)
def test_add_rms_norm_adds_a_bf16_delta_as_its_float32_widening(kernels, dim, out_dtype):
    """A bf16 GEMM's output added straight into the float32 residual: the same sum and norm as adding its float32
    copy (the widening is exact)."""
    residual, weight = randn(70, dim, seed=1), randn(dim, seed=3)
    delta = randn(70, dim, seed=2).to(torch.bfloat16)
    expected_residual = residual.clone()
    expected = kernels.add_rms_norm(expected_residual, delta.float(), weight, 1e-5, out_dtype)
    out = kernels.add_rms_norm(residual, delta, weight, 1e-5, out_dtype)
    assert torch.equal(residual, expected_residual) and torch.equal(out, expected)
    with pytest.raises(ValueError, match="residual's shape"):
        kernels.add_rms_norm(residual, delta[:, :-1], weight, 1e-5)


@pytest.mark.parametrize("dim", DIMS)
def test_norms_into_bf16_round_the_float32_result_to_nearest(kernels, dim):
    """A bf16 GEMM's input written by the norm: the float32 norm rounded once (ties to even, as torch rounds)."""
    residual, delta, weight = randn(70, dim, seed=1), randn(70, dim, seed=2), randn(dim, seed=3)
    expected = kernels.add_rms_norm(residual.clone(), delta, weight, 1e-5).to(torch.bfloat16)
    out = kernels.add_rms_norm(residual, delta, weight, 1e-5, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    assert torch.equal(
        kernels.rms_norm(delta, weight, 1e-5, torch.bfloat16), kernels.rms_norm(delta, weight, 1e-5).to(torch.bfloat16)
    )


@pytest.mark.parametrize("width", DIMS)
def test_silu_mul_over_bf16_rows_is_the_float32_result_rounded(kernels, width):
    gate_up = randn(70, 2 * width, seed=4, scale=8.0).to(torch.bfloat16)
    out = kernels.silu_mul(gate_up)
    assert out.dtype == torch.bfloat16
    expected = (F.silu(gate_up[:, :width].float()) * gate_up[:, width:].float()).to(torch.bfloat16)
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-6, rtol=8e-3)  # at most one bf16 step apart


@pytest.mark.parametrize("activation", ["silu_mul", "gelu_tanh_mul"])
@pytest.mark.parametrize("width", DIMS)
def test_a_gated_activation_over_bf16_rows_is_its_float32_kernels_result_rounded(kernels, activation, width):
    """bf16 in and out (between two bf16 GEMMs): the float32 kernel's value over the same rows, rounded once."""
    gate_up = randn(70, 2 * width, seed=4, scale=8.0).to(torch.bfloat16)
    gated = getattr(kernels, activation)
    out = gated(gate_up)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, gated(gate_up.float()).to(torch.bfloat16))


@pytest.mark.parametrize("width", DIMS)
def test_silu_mul_matches_torch_over_the_whole_range(kernels, width):
    gate_up = randn(9, 2 * width, seed=4, scale=8.0)
    gate_up[0, :width] = torch.linspace(-100.0, 100.0, width)  # far tails: exp underflows and overflows
    expected = F.silu(gate_up[:, :width]) * gate_up[:, width:]
    torch.testing.assert_close(kernels.silu_mul(gate_up), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim, rotary_dim", [(8, 8), (64, 64), (128, 128), (64, 48), (128, 96), (8, 4)])
def test_rope_rotates_q_and_k_in_place_and_leaves_v(kernels, head_dim, rotary_dim):
    """Each Q and K head's first ``rotary_dim`` values rotate (partial rotary: Phi-3's), the rest and V pass."""
    inverse = default_inverse_frequencies(10000.0, rotary_dim)
    rotary = RotaryEmbedding(inverse, 4096, torch.device("cpu"))
    num_heads, num_kv_heads = 6, 2
    qkv = randn(5, (num_heads + 2 * num_kv_heads) * head_dim, seed=5)
    positions = torch.tensor([0, 1, 77, 4095, 3])
    cos, sin = rotary(positions, torch.float32)
    rotated = num_heads + num_kv_heads
    expected = apply_rotary(qkv[:, : rotated * head_dim].view(5, rotated, head_dim), cos, sin)
    original = qkv.clone()
    kernels.rope_(qkv, positions, rotary.cos, rotary.sin, rotated, head_dim)
    torch.testing.assert_close(qkv[:, : rotated * head_dim].view(5, rotated, head_dim), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, rotated * head_dim :], original[:, rotated * head_dim :])


@pytest.mark.parametrize("tokens", [5, 70])
def test_rope_widened_is_the_bf16_rows_widened_then_rotated(kernels, tokens):
    """A bf16 QKV projection's output widened and rotated in one pass: exactly ``rope_`` over its float32 copy."""
    head_dim, num_heads, num_kv_heads = 64, 6, 2
    rotary = RotaryEmbedding(default_inverse_frequencies(10000.0, head_dim), 4096, torch.device("cpu"))
    qkv = randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, seed=6).to(torch.bfloat16)
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(7))
    expected = qkv.float()
    kernels.rope_(expected, positions, rotary.cos, rotary.sin, num_heads + num_kv_heads, head_dim)
    out = kernels.rope_widened(qkv, positions, rotary.cos, rotary.sin, num_heads + num_kv_heads, head_dim)
    assert out.dtype == torch.float32 and torch.equal(out, expected)
    with pytest.raises(ValueError, match="bfloat16"):
        kernels.rope_widened(qkv.float(), positions, rotary.cos, rotary.sin, num_heads, head_dim)
    partial = RotaryEmbedding(default_inverse_frequencies(10000.0, 48), 4096, torch.device("cpu"))
    expected = qkv.float()
    kernels.rope_(expected, positions, partial.cos, partial.sin, num_heads + num_kv_heads, head_dim)
    out = kernels.rope_widened(qkv, positions, partial.cos, partial.sin, num_heads + num_kv_heads, head_dim)
    assert torch.equal(out, expected)
    with pytest.raises(ValueError, match="tables"):
        kernels.rope_(expected, positions, partial.cos[:, :47], partial.sin[:, :47], num_heads, head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [5, 70])
def test_rope_norms_are_each_head_rms_normed_then_rotated(kernels, tokens, dtype):
    """Qwen3's q/k norms and RoPE in one pass: each Q head normed by q_norm, each K head by k_norm, then rotated;
    V untouched; bf16 rows (a bf16 GEMM's output) widened into a float32 copy, float32 rows changed in place."""
    head_dim, num_heads, num_kv_heads, eps = 64, 6, 2, 1e-6
    rotary = RotaryEmbedding(default_inverse_frequencies(10000.0, head_dim), 4096, torch.device("cpu"))
    qkv = randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, seed=6, scale=3.0).to(dtype)
    q_norm, k_norm = randn(head_dim, seed=8), randn(head_dim, seed=9)
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(7))
    wide = qkv.float()
    q = F.rms_norm(wide[:, : num_heads * head_dim].view(tokens, num_heads, head_dim), (head_dim,), q_norm, eps)
    k_heads = wide[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    k = F.rms_norm(k_heads.reshape(tokens, num_kv_heads, head_dim), (head_dim,), k_norm, eps)
    cos, sin = rotary(positions, torch.float32)
    expected = apply_rotary(torch.cat((q, k), dim=1), cos, sin)
    rotated = num_heads + num_kv_heads
    out = kernels.rope_norms(qkv, positions, rotary.cos, rotary.sin, num_heads, rotated, head_dim, q_norm, k_norm, eps)
    assert out.dtype == torch.float32 and (out is qkv) == (dtype == torch.float32)
    torch.testing.assert_close(
        out[:, : rotated * head_dim].view(tokens, rotated, head_dim), expected, atol=1e-5, rtol=1e-5
    )
    assert torch.equal(out[:, rotated * head_dim :], wide[:, rotated * head_dim :])
    with pytest.raises(ValueError, match="norm weights"):
        kernels.rope_norms(
            qkv, positions, rotary.cos, rotary.sin, num_heads, rotated, head_dim, q_norm[:8], k_norm, eps
        )


def test_write_kv_reads_strided_rows_and_skips_padding_slots(kernels):
    kv_cache = torch.zeros(2, 4, 2, 3, 8)  # 8 slots of 3 heads x 8
    qkv = randn(3, 5 * 3 * 8, seed=6)  # K and V are strided views into a wider row, as the model passes them
    k, v = qkv[:, 24:48].view(3, 3, 8), qkv[:, 72:96].view(3, 3, 8)
    kernels.write_kv(kv_cache, k, v, torch.tensor([5, -1, 0]))
    flat = kv_cache.view(2, 8, 3, 8)
    assert torch.equal(flat[0, [5, 0]], k[[0, 2]]) and torch.equal(flat[1, [5, 0]], v[[0, 2]])
    assert flat[:, [1, 2, 3, 4, 6, 7]].abs().sum() == 0


def test_kernels_refuse_tensors_they_cannot_read(kernels):
    kv_cache = torch.zeros(2, 4, 2, 3, 8)
    k = torch.zeros(3, 8, 3).transpose(1, 2)  # heads not contiguous within a row
    with pytest.raises(ValueError, match="contiguous heads"):
        kernels.write_kv(kv_cache, k, k, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="float32"):
        kernels.write_kv(kv_cache, k.double().contiguous(), k.contiguous(), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="contiguous float32"):
        kernels.silu_mul(torch.zeros(8, 4).t())
    with pytest.raises(ValueError, match="contiguous float32"):
        kernels.add_rms_norm(torch.zeros(2, 8), torch.zeros(2, 8, dtype=torch.float64), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="KV pool"):
        kernels.write_kv(kv_cache.transpose(3, 4), k.contiguous(), k.contiguous(), torch.tensor([0, 1, 2]))


def reference_attention(q, keys, values, scale):
    """q [heads, D] over keys/values [n, kv_heads, D], in float64."""
    per_kv = q.shape[0] // keys.shape[1]
    keys = keys.double().repeat_interleave(per_kv, dim=1).transpose(0, 1)  # [heads, n, D]
    values = values.double().repeat_interleave(per_kv, dim=1).transpose(0, 1)
    weights = torch.einsum("hd,hnd->hn", q.double(), keys).mul(scale).softmax(dim=-1)
    return torch.einsum("hn,hnd->hd", weights, values)


def close_to_reference(out, q, keys, values, scale, dots: bool) -> None:
    """``out`` (one query's heads) against ``reference_attention``: float32 arithmetic within float32 rounding; the
    dot products against the query rounded to bf16, within the probabilities' bf16 rounding (a misplaced column or
    key is off by the values' size, ~1)."""
    if dots:
        q = q.bfloat16().float()
    tolerance = 1e-2 if dots else 1e-5
    torch.testing.assert_close(
        out.double(), reference_attention(q, keys, values, scale), atol=tolerance, rtol=tolerance
    )


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_decode_attention_on_bf16_dot_products(kernels, head_dim):
    """``dots``: the queries and the probabilities rounded to bf16 and multiplied on AVX512-BF16's dot products over
    a bf16 pool, for key counts odd and even, on both sides of the 64-key chunks and the 4-key score groups: each
    query within the roundings of softmax attention, and not the float32 arithmetic's bits (the other path ran)."""
    dots_or_skip(kernels, True)
    num_heads, num_kv_heads, block_size, scale = 9, 3, 16, head_dim**-0.5
    lengths = [1, 2, 3, 5, 63, 64, 65, 127, 130, 301]
    tables, blocks = [], 1
    for length in lengths:
        count = math.ceil(length / block_size)
        tables.append(list(range(blocks, blocks + count))[::-1])
        blocks += count
    width = max(len(table) for table in tables)
    block_tables = torch.tensor([table + [0] * (width - len(table)) for table in tables], dtype=torch.int32)
    kv_cache = randn(2, blocks, block_size, num_kv_heads, head_dim, seed=31, scale=2.0).bfloat16()
    q = randn(len(lengths), num_heads, head_dim, seed=32)
    plan = KernelAttentionPlan(None, torch.arange(len(lengths)), torch.tensor(lengths), len(lengths), max(lengths))
    out = kernels.paged_attention(q, kv_cache, block_tables, plan, scale, torch.empty(q.shape), True)
    widened = kernels.paged_attention(q, kv_cache, block_tables, plan, scale, torch.empty(q.shape))
    for index, (length, table) in enumerate(zip(lengths, tables)):
        keys, values = (kv_cache[half, table].flatten(0, 1)[:length].float() for half in (0, 1))
        close_to_reference(out[index], q[index], keys, values, scale, True)
    assert not torch.equal(out[1:], widened[1:])  # (one key: both give its value row)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 72), (6, 1, 12), (2, 2, 128)])
@pytest.mark.parametrize("block_size", [1, 16])
def test_paged_attention_matches_softmax_over_each_context(kernels, num_heads, num_kv_heads, head_dim, block_size):
    # Contexts from 1 key to several blocks, lengths on both sides of the 8-key score groups.
    lengths = [1, 7, 8, 9, 33, 200]
    tables, blocks = [], 1
    for length in lengths:
        count = math.ceil(length / block_size)
        tables.append(list(range(blocks, blocks + count))[::-1])  # blocks out of order
        blocks += count
    width = max(len(table) for table in tables)
    block_tables = torch.tensor([table + [0] * (width - len(table)) for table in tables], dtype=torch.int32)
    kv_cache = randn(2, blocks, block_size, num_kv_heads, head_dim, seed=7, scale=2.0)
    # Queries as strided rows of a wider buffer, as the model passes them.
    q = randn(len(lengths), num_heads * head_dim + 5, seed=8)[:, : num_heads * head_dim].view(-1, num_heads, head_dim)
    plan = KernelAttentionPlan(None, torch.arange(len(lengths)), torch.tensor(lengths), len(lengths), max(lengths))
    scale = head_dim**-0.5
    out = kernels.paged_attention(q, kv_cache, block_tables, plan, scale, torch.empty(q.shape))
    for index, (length, table) in enumerate(zip(lengths, tables)):
        keys, values = (kv_cache[half, table].flatten(0, 1)[:length] for half in (0, 1))
        torch.testing.assert_close(
            out[index].double(), reference_attention(q[index], keys, values, scale), atol=1e-5, rtol=1e-5
        )


def test_paged_attention_fills_only_the_planned_rows(kernels):
    # Rows 0 and 2 of 3 are verification queries of one sequence (contexts 5 and 6); row 1 is left alone.
    kv_cache = randn(2, 3, 4, 1, 8, seed=9)
    block_tables = torch.tensor([[2, 1]], dtype=torch.int32)
    q = randn(3, 2, 8, seed=10)
    plan = KernelAttentionPlan(torch.tensor([0, 2]), torch.tensor([0, 0]), torch.tensor([5, 6]), 2, 6)
    out = kernels.paged_attention(q, kv_cache, block_tables, plan, 0.5, torch.full(q.shape, 7.0))
    assert torch.equal(out[1], torch.full((2, 8), 7.0))
    for row, length in ((0, 5), (2, 6)):
        keys, values = (kv_cache[half, [2, 1]].flatten(0, 1)[:length] for half in (0, 1))
        torch.testing.assert_close(
            out[row].double(), reference_attention(q[row], keys, values, 0.5), atol=1e-5, rtol=1e-5
        )


def dots_or_skip(kernels, dots: bool) -> None:
    if dots and not kernels.flash:
        pytest.skip(
            "the decode attention's bf16 dot products are built only where the CPU has avx512_bf16, which "
            "this one lacks"
        )


# (pool dtype, dots): float32 arithmetic over either pool, the dot products over a bf16 one
ARITHMETIC = [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)]


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize(("kv_dtype", "dots"), ARITHMETIC)
def test_paged_attention_gives_a_query_the_same_bits_alone_or_beside_others(kernels, kv_dtype, dots, head_dim):
    """A query's result depends on its own context only: verification rows of one sequence (which share work items),
    queries of other sequences, and contexts across several of the kernel's key chunks give each row exactly what it
    gets as the only query of its step, so a verified draft equals the decode row it stands for."""
    dots_or_skip(kernels, dots)
    num_heads, num_kv_heads, block_size, scale = 9, 3, 16, head_dim**-0.5
    kv_cache = randn(2, 48, block_size, num_kv_heads, head_dim, seed=11).to(kv_dtype)
    block_tables = torch.tensor([list(range(24))[::-1], list(range(24, 48))], dtype=torch.int32)
    # sequence 0: five verification rows ending at 300 keys; sequence 1: one decode row over 129 keys
    seqs, lengths = [0, 0, 0, 0, 0, 1], [296, 297, 298, 299, 300, 129]
    q = randn(len(seqs), num_heads, head_dim, seed=12)
    together = KernelAttentionPlan(None, torch.tensor(seqs), torch.tensor(lengths), len(seqs), max(lengths))
    out = kernels.paged_attention(q, kv_cache, block_tables, together, scale, torch.empty(q.shape), dots)
    for row, (seq, length) in enumerate(zip(seqs, lengths)):
        alone = KernelAttentionPlan(None, torch.tensor([seq]), torch.tensor([length]), 1, length)
        single = kernels.paged_attention(
            q[row : row + 1].contiguous(),
            kv_cache,
            block_tables,
            alone,
            scale,
            torch.empty(1, num_heads, head_dim),
            dots,
        )
        assert torch.equal(out[row], single[0])
        table = block_tables[seq].long()
        keys, values = (kv_cache[half, table].flatten(0, 1)[:length].float() for half in (0, 1))
        close_to_reference(out[row], q[row], keys, values, scale, dots)


def test_paged_attention_over_a_long_chunk_matches_each_query_alone(kernels):
    """A 512-token prefill chunk after 1,024 cached tokens holds more partial results than the kernel keeps at once
    (``DECODE_PARTIALS``, 4 << 20 floats), so it goes through in several runs of queries: every row still equals the
    same query alone, bit for bit."""
    num_heads, num_kv_heads, head_dim, block_size = 9, 3, 64, 16
    kv_cache = randn(2, 96, block_size, num_kv_heads, head_dim, seed=13)
    block_tables = torch.arange(96, dtype=torch.int32).flip(0).view(1, 96)
    lengths = list(range(1025, 1537))
    assert sum(num_heads * math.ceil(length / 64) * (head_dim + 2) for length in lengths) > 4 << 20
    q = randn(len(lengths), num_heads, head_dim, seed=14)
    plan = KernelAttentionPlan(
        None, torch.zeros(len(lengths), dtype=torch.int64), torch.tensor(lengths), len(lengths), max(lengths)
    )
    out = kernels.paged_attention(q, kv_cache, block_tables, plan, 0.125, torch.empty(q.shape))
    for row in (0, 200, 300, 511):
        alone = KernelAttentionPlan(None, torch.tensor([0]), torch.tensor([lengths[row]]), 1, lengths[row])
        single = kernels.paged_attention(
            q[row : row + 1].contiguous(), kv_cache, block_tables, alone, 0.125, torch.empty(1, num_heads, head_dim)
        )
        assert torch.equal(out[row], single[0])
        keys, values = (kv_cache[half, block_tables[0].long()].flatten(0, 1)[: lengths[row]] for half in (0, 1))
        torch.testing.assert_close(
            out[row].double(), reference_attention(q[row], keys, values, 0.125), atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("kv_dtype", "dots"), ARITHMETIC)
@pytest.mark.parametrize("root", [60, 126, 300])
def test_a_draft_trees_leaf_gets_the_bits_of_its_key_at_its_own_position(kernels, kv_dtype, dots, root, head_dim):
    """A draft tree's leaf reads its own K/V from the slot it was written to (past the spine) in place of its
    position's: exactly what a query at that position computes when the leaf's K/V sit there, bit for bit, beside the
    spine's rows and another sequence's (roots on both sides of the kernel's 64-key chunks)."""
    dots_or_skip(kernels, dots)
    num_heads, num_kv_heads, block_size, scale = 9, 3, 16, head_dim**-0.5
    kv_cache = randn(2, 64, block_size, num_kv_heads, head_dim, seed=21).to(kv_dtype)
    block_tables = torch.tensor([list(range(1, 32))[::-1], list(range(32, 63))], dtype=torch.int32)
    # sequence 0: the root, a spine of three drafts, leaves at depths 1, 2 and 4 (tokens root + 4 .. root + 6);
    # sequence 1: one decode row
    spine, leaves = [root + 1, root + 2, root + 3, root + 4], [(1, root + 5), (2, root + 6), (4, root + 7)]
    seqs = [0] * (len(spine) + len(leaves)) + [1]
    lengths = spine + [root + depth + 1 for depth, _ in leaves] + [77]
    own = [-1] * len(spine) + [token for _, token in leaves] + [-1]
    q = randn(len(seqs), num_heads, head_dim, seed=22)
    plan = KernelAttentionPlan(
        None, torch.tensor(seqs), torch.tensor(lengths), len(seqs), max(lengths), torch.tensor(own)
    )
    out = kernels.paged_attention(q, kv_cache, block_tables, plan, scale, torch.empty(q.shape), dots)
    slots = [int(block_tables[0, t // block_size]) * block_size + t % block_size for t in range(root + 8)]
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    for row in range(len(seqs)):
        moved = kv_cache.clone()  # the leaf's K/V at its own position, as a decode step there would hold them
        if own[row] >= 0:
            moved.view(2, -1, num_kv_heads, head_dim)[:, slots[lengths[row] - 1]] = flat[:, slots[own[row]]]
        alone = KernelAttentionPlan(None, torch.tensor([seqs[row]]), torch.tensor([lengths[row]]), 1, lengths[row])
        single = kernels.paged_attention(
            q[row : row + 1].contiguous(), moved, block_tables, alone, scale, torch.empty(1, num_heads, head_dim), dots
        )
        assert torch.equal(out[row], single[0]), row
        keys, values = (
            moved[half, block_tables[seqs[row]].long()].flatten(0, 1)[: lengths[row]].float() for half in (0, 1)
        )
        close_to_reference(out[row], q[row], keys, values, scale, dots)


def test_build_is_cached_per_source_and_reused(tmp_path, monkeypatch):
    # two small C files stand for the kernels: a build is compiled files and a link whatever they hold
    monkeypatch.setattr(
        builder, "sources", lambda: {"a.c": "int infer_a(void) { return 1; }", "b.c": "int infer_b(void) { return 2; }"}
    )
    first = cpu_kernels.build(tmp_path)
    library = ctypes.CDLL(str(first))  # each file compiled, both linked into one library
    assert (library.infer_a(), library.infer_b()) == (1, 2)
    stamp = first.stat().st_mtime_ns
    monkeypatch.setattr(builder.subprocess, "run", lambda *args, **kwargs: pytest.fail("rebuilt"))
    assert cpu_kernels.build(tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert [path.name for path in tmp_path.iterdir()] == [first.name]  # no staging folder left behind


def test_missing_compiler_fails_on_true_and_falls_back_on_auto(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("CC", "infer-no-such-compiler")
    monkeypatch.setenv("INFER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(builder, "_load", lambda: builder.build(tmp_path))
    builder._warn_unavailable.cache_clear()
    with pytest.raises(KernelBuildError, match="no C compiler found"):
        cpu_kernels.load(True)
    with caplog.at_level(logging.WARNING, logger="infer.kernels.cpu"):
        assert cpu_kernels.load("auto") is None
    assert "using torch ops" in caplog.text and "no C compiler found" in caplog.text
    assert cpu_kernels.load(False) is None
    with pytest.raises(ValueError, match="auto, true or false"):
        cpu_kernels.load("on")


def test_compiler_errors_are_reported(monkeypatch, tmp_path):
    monkeypatch.setattr(builder, "sources", lambda: {"cpu_kernels.c": "this is not C;"})
    with pytest.raises(KernelBuildError, match="failed to compile"):
        cpu_kernels.build(tmp_path)


@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (4, 32), (12, 1536)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 17])  # AVX2 passes of 3 and 2 rows, AVX-512's of 8 and the rest
@pytest.mark.parametrize("weights", ["fp16", "bf16", "int8 per 32", "int8 per 8", "int8 per row"])
def test_linear_matches_the_packed_weights(kernels, out_features, in_features, bias, rows, weights):
    """fp16 or bf16 weights, or int8 ones times a scale per group of a row, against float64 over the same
    weights."""
    weight = randn(out_features, in_features, seed=11, scale=0.1)
    scales = None
    if weights in ("fp16", "bf16"):
        weight = weight.to(torch.float16 if weights == "fp16" else torch.bfloat16)
        exact = weight.double()
    else:
        group = {"int8 per 32": 32, "int8 per 8": 8, "int8 per row": in_features}[weights]
        scales = randn(out_features, in_features // group, seed=15).abs() * 0.01 + 1e-3
        weight = torch.randint(
            -127, 128, (out_features, in_features), dtype=torch.int8, generator=torch.Generator().manual_seed(16)
        )
        exact = weight.double() * scales.double().repeat_interleave(group, dim=1)
    bias_values = randn(out_features, seed=12) if bias else None
    x = randn(rows, in_features, seed=13)
    expected = torch.nn.functional.linear(x.double(), exact, None if bias_values is None else bias_values.double())
    packed_scales = None if scales is None else cpu_kernels.pack_scales(scales)
    out = kernels.linear(x, cpu_kernels.pack_weights(weight), packed_scales, bias_values)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-5)


def test_pack_weights_lays_out_blocks_of_four_rows_and_refuses_other_shapes():
    for dtype in (torch.float16, torch.bfloat16, torch.int8):
        weight = torch.arange(8 * 16).view(8, 16).to(dtype)
        packed = cpu_kernels.pack_weights(weight)
        assert cpu_kernels.packed_shape(packed) == (8, 16) and packed.dtype == dtype
        # Block 1 (rows 4-7), second 8-column chunk: row 5's columns 8..15 sit at [1, 1, 1].
        assert torch.equal(packed[1, 1, 1], weight[5, 8:16])
    with pytest.raises(ValueError, match="% 4"):
        cpu_kernels.pack_weights(torch.zeros(6, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="% 8"):
        cpu_kernels.pack_weights(torch.zeros(8, 12, dtype=torch.float16))
    with pytest.raises(ValueError, match="fp16, bf16 or int8"):
        cpu_kernels.pack_weights(torch.zeros(8, 16))


def test_pack_scales_lays_out_each_blocks_groups():
    scales = torch.arange(8 * 3, dtype=torch.float32).view(8, 3)  # 8 rows, 3 groups of 32
    packed = cpu_kernels.pack_scales(scales)
    assert packed.shape == (2, 3, 4)
    assert torch.equal(packed[1, 2], scales[4:8, 2])  # block 1 (rows 4-7), group 2


def test_pack_tiles_lays_out_amx_b_tiles_and_refuses_other_shapes():
    weight = torch.arange(64 * 96).view(64, 96).to(torch.bfloat16)
    tiles = cpu_kernels.pack_tiles(weight)
    assert cpu_kernels.tiles_shape(tiles) == (64, 96) and torch.equal(cpu_kernels.unpack_tiles(tiles), weight)
    # Block 1 (columns 32-63), k tile 2 (64-95), its second tile (columns 48-63): row p = 3 holds the pairs
    # (w[c, 64 + 6], w[c, 64 + 7]) of each column c.
    assert torch.equal(tiles[1, 2, 1, 3], weight[48:64, 70:72])
    for shape in ((48, 64), (64, 48)):
        with pytest.raises(ValueError, match="% 32"):
            cpu_kernels.pack_tiles(torch.zeros(shape, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bf16"):
        cpu_kernels.pack_tiles(torch.zeros(64, 64))


def test_unpack_tiles_in_c_gives_the_plain_weight_into_a_buffer_and_refuses_what_it_cannot_hold(kernels):
    weight = randn(96, 160, seed=16).to(torch.bfloat16)
    tiles = cpu_kernels.pack_tiles(weight)
    assert torch.equal(kernels.unpack_tiles(tiles), weight)
    buffer = torch.full((96 * 160 + 7,), 3.0, dtype=torch.bfloat16)
    rows = kernels.unpack_tiles(tiles, buffer)
    assert torch.equal(rows, weight) and rows.data_ptr() == buffer.data_ptr() and buffer[-1] == 3.0
    with pytest.raises(ValueError, match="at least 15360"):
        kernels.unpack_tiles(tiles, torch.empty(96 * 160 - 1, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="packed by pack_tiles"):
        kernels.unpack_tiles(weight)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 9, 16, 17, 33, 70, 300])  # partial and whole 16/32-row tiles, two 256-row chunks
def test_linear_tiles_is_the_bf16_rounded_product_in_float32(kernels, rows, bias):
    """AMX's tiles or AVX512-BF16's dot products (plain C where the build has neither) against float64 over the same
    bf16 weights and the rows rounded to bf16: only the sums' order differs; bf16 rows in give bf16 rows out,
    rounded once."""
    weight = randn(96, 576, seed=21, scale=0.1).to(torch.bfloat16)
    bias_values = randn(96, seed=22) if bias else None
    x = randn(rows, 576, seed=23)
    exact = torch.nn.functional.linear(
        x.to(torch.bfloat16).double(), weight.double(), None if bias_values is None else bias_values.double()
    )
    tiles = cpu_kernels.pack_tiles(weight)
    out = kernels.linear_tiles(x, tiles, bias_values)
    assert out.dtype == torch.float32 and out.shape == (rows, 96)
    torch.testing.assert_close(out.double(), exact, atol=1e-4, rtol=1e-5)
    narrow = kernels.linear_tiles(x.to(torch.bfloat16), tiles, bias_values)
    assert narrow.dtype == torch.bfloat16
    torch.testing.assert_close(narrow.double(), exact, atol=1e-4, rtol=8e-3)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.linear_tiles(x[:, :64].contiguous(), tiles, None)
    with pytest.raises(ValueError, match="packed by pack_tiles"):
        kernels.linear_tiles(x, weight, None)


# Run in a fresh process per thread count: OpenMP reads OMP_NUM_THREADS once, at the kernels' first parallel region.
SHARED_ITEMS_SCRIPT = """
import sys, torch
from infer.kernels import cpu as cpu_kernels
kernels = cpu_kernels.load(True)
generator = torch.Generator().manual_seed(5)
weight = torch.randn(32 * 21, 3072, generator=generator) * 0.1
tiles, blocks = cpu_kernels.pack_tiles(weight.bfloat16()), kernels.quantize_blocks(weight, "q4_1")
products = {}
for rows in (40, 600):  # one pass of blocks; four chunks of x for either GEMM
    x = torch.randn(rows, 3072, generator=generator)
    products[f"tiles {rows}"] = kernels.linear_tiles(x, tiles, None)
    for design in kernels.block_gemm_designs:
        products[f"{design} {rows}"] = kernels.gemm_blocks(x, blocks, None, design)
# decode attention over 24 contexts of 1 to 1,500 keys, each sequence's blocks in order after the last one's, ten
# calls (items change hands at some of them)
lengths = torch.randint(1, 1500, (24,), generator=generator).tolist()
width = max(-(-n // 16) for n in lengths)
tables, start = [], 1
for n in lengths:
    tables.append([start + i for i in range(-(-n // 16))] + [0] * (width - -(-n // 16)))
    start += -(-n // 16)
kv = torch.randn(2, start, 16, 2, 64, generator=generator)
q = torch.randn(len(lengths), 6, 64, generator=generator)
plan = cpu_kernels.KernelAttentionPlan(
    None, torch.arange(len(lengths)), torch.tensor(lengths), len(lengths), max(lengths)
)
products["attention"] = torch.stack([
    kernels.paged_attention(q, kv, torch.tensor(tables, dtype=torch.int32), plan, 0.125, torch.empty(q.shape))
    for _ in range(10)
])
products["attention inputs"] = (q, kv, tables, lengths)
torch.save(products, sys.argv[1])
"""


def test_threads_taking_over_each_others_items_change_no_result(tmp_path):
    """The tile GEMM, the block GEMM and decode attention share their items among the threads as they finish (each
    its own share in order, then the others' from the back: ``item_share``). Seven threads on this machine's cores
    finish at different times and take over each other's items; each GEMM item is computed once, by whichever thread,
    with the same arithmetic, so the products are one thread's bit for bit. Attention's items are cut per thread
    count, so it is held to softmax attention in float64 instead."""
    products = {}
    for threads in (1, 7):
        path = tmp_path / f"{threads}.pt"
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        subprocess.run([sys.executable, "-c", SHARED_ITEMS_SCRIPT, str(path)], env=env, check=True, timeout=300)
        products[threads] = torch.load(path)
    assert products[1].keys() == products[7].keys() and "tiles 600" in products[1]
    for outputs in products.values():
        q, kv, tables, lengths = outputs.pop("attention inputs")
        for index, (length, table) in enumerate(zip(lengths, tables)):
            keys, values = (kv[half, table].flatten(0, 1)[:length] for half in (0, 1))
            exact = reference_attention(q[index], keys, values, 0.125).expand(10, -1, -1)
            torch.testing.assert_close(outputs["attention"][:, index].double(), exact, atol=1e-5, rtol=1e-5)
    del products[1]["attention"], products[7]["attention"]
    for name, product in products[1].items():
        assert torch.equal(products[7][name], product), name


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 17, 300])  # partial and whole 8-row passes, two 256-row chunks
def test_linear_tiles_with_fma_is_the_float32_rows_times_the_bf16_weights(kernels, rows, bias):
    """``fma``: float32 FMAs over the widened bf16 weights, the rows not rounded: float64's product of the same
    values up to the sums' order; bf16 rows in are widened exactly and come out rounded once. Needs an AVX-512
    build (skipped elsewhere, where asking for it is refused)."""
    weight = randn(96, 576, seed=21, scale=0.1).to(torch.bfloat16)
    tiles = cpu_kernels.pack_tiles(weight)
    x = randn(rows, 576, seed=23)
    if not kernels.tile_fma:
        with pytest.raises(ValueError, match="AVX-512 build"):
            kernels.linear_tiles(x, tiles, None, fma=True)
        pytest.skip(f"the tiles' float32 FMAs need an AVX-512 build; these kernels are {kernels.simd}")
    bias_values = randn(96, seed=22) if bias else None
    wide_bias = None if bias_values is None else bias_values.double()
    exact = torch.nn.functional.linear(x.double(), weight.double(), wide_bias)
    out = kernels.linear_tiles(x, tiles, bias_values, fma=True)
    assert out.dtype == torch.float32 and out.shape == (rows, 96)
    torch.testing.assert_close(out.double(), exact, atol=2e-5, rtol=1e-5)
    narrow_in = x.to(torch.bfloat16)
    narrow = kernels.linear_tiles(narrow_in, tiles, bias_values, fma=True)
    assert narrow.dtype == torch.bfloat16
    exact = torch.nn.functional.linear(narrow_in.double(), weight.double(), wide_bias)
    torch.testing.assert_close(narrow.double(), exact, atol=1e-4, rtol=8e-3)


def test_the_tile_gemm_is_the_fastest_this_cpu_has(kernels):
    """-march=native builds the AMX kernel where the CPU has AMX (used when Linux allows it), else the AVX512-BF16
    one where it has that; only a CPU with neither multiplies ``linear_tiles`` in plain C."""
    from infer.host import cpu_flags

    flags = cpu_flags()
    if {"amx_tile", "amx_bf16"} <= flags:
        assert kernels.tiles in ("AMX tiles", "AVX512-BF16")
    elif {"avx512f", "avx512_bf16"} <= flags:
        assert kernels.tiles == "AVX512-BF16" and not kernels.amx
    else:
        assert kernels.tiles is None and not kernels.amx


def test_fused_layer_multiplies_large_steps_on_the_tiles(kernels):
    """A fused layer whose bf16 weights come only as tiles (as a model packs them) against one over the GEMV's
    layout: steps of up to one GEMV pass take the tiles' GEMV, float32 rows times the bf16 weights, the GEMV's
    products up to the sums' order; larger ones the tiles (activations rounded to bf16, within bf16 of the float32
    GEMV; with the tiles' float32 FMAs, where built, the GEMV's float32 products up to the sums' order)."""
    from infer.kernels.cpu import FusedLayer

    hidden, intermediate, head_dim = 64, 128, 16
    shapes = [(hidden + 2 * 32, hidden), (hidden, hidden), (2 * intermediate, hidden), (hidden, intermediate)]
    plain = [randn(*shape, seed=30 + i, scale=0.1).to(torch.bfloat16) for i, shape in enumerate(shapes)]
    weights = [cpu_kernels.pack_weights(weight) for weight in plain]
    norms = (randn(hidden, seed=40).abs() + 0.5, randn(hidden, seed=41).abs() + 0.5)
    rest = ([None] * 4, [None] * 4, norms, 1e-5, hidden, (hidden + 64) // head_dim, head_dim)
    tiles = [cpu_kernels.pack_tiles(w) for w in plain]
    layers = [FusedLayer(kernels, weights, *rest), FusedLayer(kernels, [None] * 4, *rest, tiles)]
    if kernels.tile_fma:  # float32 FMAs on the same tiles: float32 rows times the bf16 weights, as the GEMV's
        layers.append(FusedLayer(kernels, [None] * 4, *rest, tiles, tiles_fma=True))
    for tokens in (1, kernels.pass_rows, kernels.pass_rows + 5):
        residual, attended = randn(tokens, hidden, seed=42), randn(tokens, hidden, seed=43)
        outs = []
        for layer in layers:
            stream = residual.clone()
            outs.append((layer.feed_forward(attended, stream), stream))
        (gemv, gemv_stream), (tiled, tiled_stream) = outs[:2]
        if tokens <= kernels.pass_rows and kernels.tile_fma:  # the tiles' GEMV, with or without tiles_fma
            for out, stream in outs[1:]:
                torch.testing.assert_close(out, gemv, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(stream, gemv_stream, atol=1e-5, rtol=1e-5)
                assert torch.equal(out, tiled) and torch.equal(stream, tiled_stream)
            continue
        torch.testing.assert_close(tiled, gemv, atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(tiled_stream, gemv_stream, atol=3e-2, rtol=3e-2)
        assert not torch.equal(tiled, gemv)  # the tiles did run
        for out, stream in outs[2:]:
            torch.testing.assert_close(out, gemv, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(stream, gemv_stream, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="packed by pack_tiles"):
        FusedLayer(kernels, weights, *rest, [cpu_kernels.pack_tiles(plain[1])] * 4)
    with pytest.raises(ValueError, match="packed by pack_tiles"):
        FusedLayer(kernels, [None] * 4, *rest)


def test_linear_refuses_int8_weights_without_their_scales(kernels):
    packed = cpu_kernels.pack_weights(torch.zeros(8, 64, dtype=torch.int8))
    x = torch.zeros(1, 64)
    with pytest.raises(ValueError, match="need their scales"):
        kernels.linear(x, packed, None, None)
    with pytest.raises(ValueError, match="packed by pack_scales"):
        kernels.linear(x, packed, torch.ones(8, 2), None)  # not in pack_scales' layout
    with pytest.raises(ValueError, match="packed by pack_scales"):
        kernels.linear(x, packed, cpu_kernels.pack_scales(torch.ones(8, 16)), None)  # groups of 4: not a multiple of 8
    kernels.linear(x, packed, cpu_kernels.pack_scales(torch.ones(8, 2)), None)
    with pytest.raises(ValueError, match="need their scales"):
        kernels.linear(
            x,
            cpu_kernels.pack_weights(torch.zeros(8, 64, dtype=torch.float16)),
            cpu_kernels.pack_scales(torch.ones(8, 2)),
            None,
        )


@pytest.mark.skipif("fbgemm" not in torch.backends.quantized.supported_engines, reason="needs fbgemm (x86)")
@pytest.mark.parametrize(("mode", "bytes_per_weight"), [("fp16", 2), ("bf16", 2), ("int8", 1), ("int8_per_row", 1)])
def test_packed_linear_takes_the_kernel_for_a_few_rows_only(kernels, mode, bytes_per_weight):
    """The kernels' copy (fp16 or bf16, or int8 with its scales) takes up to ``gemv_rows`` rows, the GEMM (fbgemm's,
    bf16: oneDNN's) the rest. bf16 where the kernels have tiles keeps one copy, in the tiles' layout: their GEMV
    (float32 rows) takes a few rows, the tiles more (on AMX every input)."""
    from infer.model.quantization import TILE_MAX_ROWS, PackedLinear

    gemv_rows = 8
    linear = torch.nn.Linear(576, 960, bias=True)
    packed = PackedLinear(linear, mode)
    rows = randn(gemv_rows + 1, 576, seed=14)
    huge = randn(TILE_MAX_ROWS + 1, 576, seed=15)
    before_bytes, expected, expected_huge = packed.nbytes, packed(rows), packed(huge)
    packed.use_cpu_kernels(kernels, gemv_rows)
    tiled = packed.tile_weight is not None
    # The kernels' copy counts; bf16 with tiles keeps it alone (oneDNN's copy goes).
    assert packed.nbytes == before_bytes + (0 if tiled else 960 * 576 * bytes_per_weight)
    assert (packed.packed is None) == tiled
    copy = packed.tile_weight if tiled else packed.kernel_weight
    assert copy.dtype == {"fp16": torch.float16, "bf16": torch.bfloat16}.get(mode, torch.int8)
    assert not tiled or packed.kernel_weight is None
    calls = []
    originals = {name: getattr(kernels, name) for name in ("linear", "linear_tiles")}
    for name, original in originals.items():
        setattr(kernels, name, lambda *args, name=name, original=original: calls.append(name) or original(*args))
    try:
        few = packed(rows[1 : gemv_rows + 1])
        large = packed(rows)  # one row more: fbgemm, as before (bf16 with tiles: the tiles)
        assert calls == (["linear_tiles"] * 2 if tiled else ["linear"])
        if tiled:  # the tiles, inputs rounded as oneDNN's, float32 out; their GEMV the float32 rows' product
            weight = cpu_kernels.unpack_tiles(packed.tile_weight).double()
            exact = rows.to(torch.bfloat16).double() @ weight.T + linear.bias.double()
            torch.testing.assert_close(large.double(), exact, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(large, expected, atol=1e-2, rtol=1e-2)  # oneDNN's sums come out in bf16
            if kernels.tile_fma:
                exact = rows[1 : gemv_rows + 1].double() @ weight.T + linear.bias.double()
                torch.testing.assert_close(few.double(), exact, atol=1e-5, rtol=1e-5)
            # Past TILE_MAX_ROWS: on AMX the tiles still; else oneDNN's GEMM over the tiles unpacked, as over
            # oneDNN's own copy without kernels.
            calls.clear()
            torch.testing.assert_close(packed(huge), expected_huge, atol=1e-2, rtol=1e-2)
            assert calls == (["linear_tiles"] if kernels.amx else [])
        else:
            assert torch.equal(large, expected)
    finally:
        for name in originals:
            delattr(kernels, name)
    # int8: the same weights on both paths (the scales make them exact in fp16), so only the sums' order differs;
    # bf16: the same weights, but the GEMM rounds its inputs to bf16 (8 bits) where the GEMV keeps float32's
    tolerance = 2e-2 if mode == "bf16" else 1e-4
    torch.testing.assert_close(few, expected[1:], atol=tolerance, rtol=tolerance)
    packed.use_cpu_kernels(None)
    assert packed.nbytes == before_bytes and packed.kernel_weight is None and packed.tile_weight is None
    odd = PackedLinear(torch.nn.Linear(32, 6), mode)  # shapes pack_weights cannot lay out stay on fbgemm
    odd.use_cpu_kernels(kernels, gemv_rows)
    assert odd.kernel_weight is None and odd.kernels is None


def test_an_unwritable_cache_folder_is_a_build_error(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    with pytest.raises(KernelBuildError, match="could not build the CPU kernels"):
        cpu_kernels.build(blocker / "kernels")


def test_fused_stack_refuses_layers_of_different_shapes():
    from infer.kernels.cpu import FusedLayer, FusedStack

    kernels = cpu_kernels.load(True)

    def layer(hidden: int) -> FusedLayer:
        weights = [
            cpu_kernels.pack_weights(torch.randn(n, k).half())
            for n, k in [(3 * hidden, hidden), (hidden, hidden), (8 * hidden, hidden), (hidden, 4 * hidden)]
        ]
        norms = (torch.ones(hidden), torch.ones(hidden))
        return FusedLayer(kernels, weights, [None] * 4, [None] * 4, norms, 1e-5, hidden, 2 * hidden // 8, 8)

    FusedStack(kernels, [layer(16), layer(16)], [0, 1])
    with pytest.raises(ValueError, match="one shape"):
        FusedStack(kernels, [layer(16), layer(32)], [0, 1])


@pytest.mark.parametrize("vocab", [49152, 100, 37])
def test_apply_bitmask_matches_torchs_and_touches_only_the_named_rows(kernels, vocab):
    from infer.guide import apply_bitmask

    generator = torch.Generator().manual_seed(vocab)
    words = -(-vocab // 32)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32, generator=generator)
    bitmask[0, : words // 2] = -1  # whole words allowed, and whole words forbidden
    bitmask[1, : words // 2] = 0
    logits = torch.randn(5, vocab, generator=generator)
    expected, actual = logits.clone(), logits.clone()
    apply_bitmask(expected, bitmask, [4, 0, 2])
    apply_bitmask(actual, bitmask, [4, 0, 2], kernels)
    assert torch.equal(actual, expected)
    assert torch.equal(actual[[1, 3]], logits[[1, 3]])
    with pytest.raises(ValueError, match="outside the logits"):
        kernels.apply_bitmask_(actual, bitmask, torch.tensor([0, 1, 5]))


def without_amx() -> list[str]:
    """The flag that keeps AMX out of a -march=native build, where the CPU has AMX (elsewhere a compiler may not know
    it, and -march=native leaves AMX off anyway)."""
    from infer.host import cpu_flags

    return ["-mno-amx-tile"] if "amx_tile" in cpu_flags() else []


# The instruction sets the C source has code for, the flags a build of each needs, and the extra compiler flags that
# build it on a CPU with more (the portable build turns AVX off, and with it AVX2, FMA, F16C and AVX-512;
# "avx512_bf16" is the AVX-512 build whose tile GEMM takes AVX512-BF16's dot products even on a CPU with AMX).
SIMD_BUILDS = {
    "avx512": ({"avx512f"}, []),
    "avx512_bf16": ({"avx512f", "avx512_bf16"}, without_amx()),
    "avx2": ({"avx2", "fma", "f16c"}, ["-mno-avx512f", *without_amx()]),
}


@pytest.mark.parametrize("simd", list(SIMD_BUILDS))
def test_each_simd_build_matches_the_portable_c(simd, portable_kernels, kernel_build):
    """The AVX-512 and AVX2 code of every kernel against the portable C on the same inputs, where this CPU has the
    flags (the other builds are skipped with the reason; CI machines differ)."""
    from infer.host import cpu_flags

    needed, flags = SIMD_BUILDS[simd]
    missing = needed - cpu_flags()
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(sorted(missing))} for the {simd} kernels")
    built = kernel_build(flags)
    assert built.simd == simd.removesuffix("_bf16")
    if simd == "avx512_bf16":
        assert built.tiles == "AVX512-BF16"
    close = lambda a, b: torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)  # noqa: E731  sums' order only
    for rows in (1, 3, 8, 11):
        x = randn(rows, 576, seed=rows)
        for dtype in (torch.float16, torch.bfloat16):
            packed = cpu_kernels.pack_weights(randn(64, 576, seed=2, scale=0.1).to(dtype))
            close(built.linear(x, packed, None, None), portable_kernels.linear(x, packed, None, None))
        for group in (32, 576):
            weight = torch.randint(-127, 128, (64, 576), dtype=torch.int8, generator=torch.Generator().manual_seed(3))
            scales = cpu_kernels.pack_scales(randn(64, 576 // group, seed=4).abs() * 0.01 + 1e-3)
            packed = cpu_kernels.pack_weights(weight)
            close(built.linear(x, packed, scales, None), portable_kernels.linear(x, packed, scales, None))
        tiles = cpu_kernels.pack_tiles(randn(96, 576, seed=2, scale=0.1).to(torch.bfloat16))
        for rows_in in (x, x.to(torch.bfloat16)):  # AMX's tiles or AVX512-BF16 where the build has them, else plain C
            outs = [
                kernels_.linear_tiles(rows_in, tiles, randn(96, seed=9)).float()
                for kernels_ in (built, portable_kernels)
            ]
            torch.testing.assert_close(*outs, atol=2e-5, rtol=2e-5 if rows_in.dtype == torch.float32 else 8e-3)
        close(built.rms_norm(x, randn(576, seed=5), 1e-5), portable_kernels.rms_norm(x, randn(576, seed=5), 1e-5))
        gate_up = randn(rows, 2 * 131, seed=6, scale=4.0)
        close(built.silu_mul(gate_up), portable_kernels.silu_mul(gate_up))
        narrow = gate_up.to(torch.bfloat16)  # bf16 rows between GEMMs: at most one bf16 step apart
        torch.testing.assert_close(
            built.silu_mul(narrow).float(), portable_kernels.silu_mul(narrow).float(), atol=1e-6, rtol=8e-3
        )
        torch.testing.assert_close(
            built.rms_norm(x, randn(576, seed=5), 1e-5, torch.bfloat16).float(),
            portable_kernels.rms_norm(x, randn(576, seed=5), 1e-5, torch.bfloat16).float(),
            atol=1e-6,
            rtol=8e-3,
        )
    num_heads, num_kv_heads, block_size, num_blocks = 9, 3, 16, 14
    block_tables = torch.tensor([[3, 1, 6, 0, 8, 9, 10], [2, 5, 7, 4, 11, 13, 12]], dtype=torch.int32)
    # three rows of sequence 1 (verification), over one or two key chunks, and a draft tree's leaf beside the second
    plan = KernelAttentionPlan(
        None,
        torch.tensor([0, 1, 1, 1, 1]),
        torch.tensor([37, 64, 100, 101, 100]),
        5,
        101,
        torch.tensor([-1, -1, -1, -1, 105]),
    )
    for head_dim in (64, 128):  # a bf16 pool's rows read in place by the AVX-512 kernels, one copy per head size
        pool = randn(2, num_blocks, block_size, num_kv_heads, head_dim, seed=7)
        q = randn(5, num_heads, head_dim, seed=8)
        for kv in (pool, pool.to(torch.bfloat16)):
            outs = [
                kernels_.paged_attention(q, kv, block_tables, plan, head_dim**-0.5, torch.zeros_like(q))
                for kernels_ in (built, portable_kernels)
            ]
            close(*outs)


@pytest.fixture(scope="module")
def kernels_without_amx(kernels, kernel_build):
    """The AVX512-BF16 build with AMX kept out, beside the tile kernels (skipped where the CPU or OS has no tiles)."""
    if not kernels.flash_amx:
        pytest.skip("this CPU (or this OS) gives no AMX tiles to infer's flash attention")
    built = kernel_build(without_amx())
    assert built.flash and not built.flash_amx
    return built


# Builds whose GEMV over the tiles' layout differs: this CPU's own (AMX where it has it), AVX-512 with AVX512-BF16's
# dot products and AMX kept out, and AVX-512 without AVX512-BF16 (the FMAs only; bf16-rounded rows in plain C).
TILE_GEMV_BUILDS = {
    "native": (set(), None),
    "avx512_bf16": ({"avx512f", "avx512_bf16"}, without_amx()),
    "avx512_no_bf16": ({"avx512f"}, ["-mno-avx512bf16", *without_amx()]),
}


@pytest.mark.parametrize("build", list(TILE_GEMV_BUILDS))
def test_tiles_gemv_is_the_float64_product_on_odd_shapes(build, kernels, kernel_build):
    """Up to one GEMV pass of rows over ``pack_tiles``' layout, on shapes of odd numbers of 32-column blocks and
    k tiles: float32 rows (``fma``) against float64's product of the same values, rows rounded to bf16 (the dot
    products, else plain C) against float64's product of the rounded values; up to the sums' order."""
    from infer.host import cpu_flags

    needed, flags = TILE_GEMV_BUILDS[build]
    if needed - cpu_flags():
        pytest.skip(f"this CPU lacks {', '.join(sorted(needed - cpu_flags()))} for the {build} kernels")
    built = kernels if flags is None else kernel_build(flags)
    for n, k in ((32, 32), (96, 160), (224, 1056)):
        weight = randn(n, k, seed=n + k, scale=0.1).to(torch.bfloat16)
        tiles, bias = cpu_kernels.pack_tiles(weight), randn(n, seed=k)
        for rows in range(1, built.pass_rows + 1):
            x = randn(rows, k, seed=rows)
            rounded = torch.nn.functional.linear(x.to(torch.bfloat16).double(), weight.double(), bias.double())
            out = built.linear_tiles(x, tiles, bias)
            torch.testing.assert_close(out.double(), rounded, atol=1e-5, rtol=1e-5)
            if built.tile_fma:
                exact = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
                out = built.linear_tiles(x, tiles, bias, fma=True)
                torch.testing.assert_close(out.double(), exact, atol=1e-5, rtol=1e-5)
                narrow = built.linear_tiles(x.to(torch.bfloat16), tiles, bias, fma=True)
                torch.testing.assert_close(narrow.double(), rounded, atol=1e-4, rtol=8e-3)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("block_size", [1, 16])
def test_flash_attention_on_amx_tiles_matches_its_avx512_bf16_dot_products(
    kernels, kernels_without_amx, block_size, head_dim
):
    """infer's flash attention in its bf16 mode multiplies on AMX tiles where the build and the OS allow (S^T = K Q^T
    and O^T = V^T P^T, a token per lane; beyond 64 dims the results pass through memory): every row within bf16's
    rounding of the probabilities of float64 causal attention over the bf16-rounded Q, K and V, and the same chunks
    on the AVX512-BF16 build's dot products (AMX kept out) within the same, for fresh prompts and cached prefixes,
    partial tiles of tokens and keys, grouped heads, float32 and bf16 pools, at each head size the tiles take. Runs
    where the CPU has AMX."""
    from infer.kernels.cpu import FlashChunks

    num_heads, num_kv_heads, scale = 6, 2, head_dim**-0.5
    # (query tokens, context): a fresh prompt, one after a cached prefix, a short one, partial tiles everywhere
    chunks = [(70, 70), (33, 100), (5, 5), (16, 47)]
    num_blocks = sum(-(-context // block_size) for _, context in chunks) + 1
    pool = randn(2, num_blocks, block_size, num_kv_heads, head_dim, seed=11)
    order = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(12)) + 1
    tables = torch.zeros(len(chunks), max(-(-context // block_size) for _, context in chunks), dtype=torch.int32)
    start = 0
    for index, (_, context) in enumerate(chunks):
        used = -(-context // block_size)
        tables[index, :used] = order[start : start + used].int()
        start += used
    q = randn(sum(tokens for tokens, _ in chunks), num_heads, head_dim, seed=13)
    starts = [sum(tokens for tokens, _ in chunks[:index]) for index in range(len(chunks))]
    plan = FlashChunks.of(
        [(at, tokens, context, index) for index, (at, (tokens, context)) in enumerate(zip(starts, chunks))]
    )
    rounded = q.bfloat16().float()
    for kv in (pool, pool.to(torch.bfloat16)):
        amx, dot = (
            built.flash_attention(q, kv, tables, plan, scale, torch.zeros_like(q))
            for built in (kernels, kernels_without_amx)
        )
        torch.testing.assert_close(amx, dot, atol=4e-3, rtol=1e-2)
        for index, (at, (tokens, context)) in enumerate(zip(starts, chunks)):
            keys, values = (kv[half, tables[index].long()].flatten(0, 1)[:context].bfloat16() for half in (0, 1))
            for row in range(tokens):
                seen = context - tokens + row + 1
                expected = reference_attention(rounded[at + row], keys[:seen], values[:seen], scale)
                torch.testing.assert_close(amx[at + row].double(), expected, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("cols", [1, 15, 16, 17, 63, 64, 65, 1000, 151936])
def test_argmax_rows_is_torchs_first_maximum_here_and_in_the_portable_c(kernels, portable_kernels, cols):
    """Ties (small integers), a row of -inf, NaNs (torch's max takes the first, above every number), +inf, a row of
    distinct values, and rows a stride apart (a slice of wider logits)."""
    generator = torch.Generator().manual_seed(cols)
    logits = torch.randint(-3, 4, (8, cols), generator=generator).float()
    logits[1] = -math.inf
    logits[2, cols // 2] = logits[2, -1] = math.nan
    logits[3, -1] = math.inf
    logits[4, 0] = math.nan
    logits[5] = torch.randn(cols, generator=generator)
    wide = torch.cat([logits, torch.full((8, 5), 9.0)], dim=1)[:, :cols]
    for rows in (logits, wide):
        expected = rows.max(dim=-1).indices
        for built in (kernels, portable_kernels):
            assert torch.equal(built.argmax_rows(rows), expected)


def test_sampler_on_the_kernels_picks_torchs_tokens(kernels):
    """Greedy rows take the kernels' argmax, sampled rows their own draw, banned tokens stay banned."""
    from infer import SamplingParams
    from infer.engine.sampler import Sampler, SampleRequest

    logits = randn(6, 1000, seed=3)
    logits[0, 7] = logits[0, 9] = 50.0  # a tie: the first
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=1)
    requests = [SampleRequest(greedy if row % 3 else sampled, row, seed=row) for row in range(6)]
    requests[0] = SampleRequest(greedy, 0, seed=0, banned_token_ids=(7,))
    tokens = Sampler(kernels).sample(logits, requests)
    assert tokens == Sampler().sample(logits, requests)
    assert tokens[0] == 9
    with pytest.raises(ValueError, match="float32"):
        kernels.argmax_rows(logits.to(torch.bfloat16))
