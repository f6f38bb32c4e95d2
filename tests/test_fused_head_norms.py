"""Qwen3's per-head q/k RMSNorm inside the fused C decoder layer: ``FusedLayer(head_norms=(q_norm, k_norm))`` norms
every query head by q_norm and every key head by k_norm, over head_dim, after the QKV projection and before RoPE, as
transformers does; ``FusedStack`` runs the same attention input; a layer without them is the Llama layer, unchanged."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from infer.kernels import cpu as cpu_kernels
from infer.kernels.cpu import FusedLayer, FusedStack, KernelAttentionPlan, KernelAttentionStep
from infer.model import RotaryEmbedding, apply_rotary, default_inverse_frequencies

HIDDEN, INTERMEDIATE, NUM_HEADS, NUM_KV_HEADS, EPS = 192, 256, 4, 2, 1e-6
WEIGHT_KINDS = ["fp16", "bf16", "int8"]


def randn(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def packed(out_features: int, in_features: int, kind: str, seed: int):
    """A projection's weight in ``kind`` as the kernels take it (packed weight, packed scales or None) and the exact
    values it stands for, float64 ``[out_features, in_features]``."""
    if kind == "int8":
        group = 32
        weight = torch.randint(
            -127, 128, (out_features, in_features), dtype=torch.int8, generator=torch.Generator().manual_seed(seed)
        )
        scales = randn(out_features, in_features // group, seed=seed + 1).abs() * 1e-3 + 1e-4
        exact = weight.double() * scales.double().repeat_interleave(group, dim=1)
        return cpu_kernels.pack_weights(weight), cpu_kernels.pack_scales(scales), exact
    weight = randn(out_features, in_features, seed=seed, scale=0.1).to(
        {"fp16": torch.float16, "bf16": torch.bfloat16}[kind]
    )
    return cpu_kernels.pack_weights(weight), None, weight.double()


@dataclass
class Layer:
    """A small GQA layer as the kernels run it (``fused``) and the float64 values a torch reference reads."""

    fused: FusedLayer
    projections: list[tuple]  # ``packed``'s (weight, scales, exact) of the QKV, output, gate/up, down projections
    qkv_bias: torch.Tensor | None
    input_norm: torch.Tensor
    head_norms: tuple[torch.Tensor, torch.Tensor] | None
    head_dim: int

    @property
    def qkv(self) -> torch.Tensor:
        """The QKV projection's exact weight, float64 ``[(NUM_HEADS + 2 * NUM_KV_HEADS) * head_dim, HIDDEN]``."""
        return self.projections[0][2]


def make_layer(kernels, kind: str, head_dim: int, bias: bool = False, head_norms: bool = True, seed: int = 0) -> Layer:
    q_width, kv_width = NUM_HEADS * head_dim, NUM_KV_HEADS * head_dim
    shapes = [(q_width + 2 * kv_width, HIDDEN), (HIDDEN, q_width), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
    projections = [packed(*shape, kind, seed=seed + 10 * i) for i, shape in enumerate(shapes)]
    biases = [randn(q_width + 2 * kv_width, seed=seed + 50) if bias else None, None, None, None]
    norms = (randn(HIDDEN, seed=seed + 60).abs() + 0.5, randn(HIDDEN, seed=seed + 61).abs() + 0.5)
    # q and k weights far from 1 and from each other: a norm in the wrong place or with the other's weight shows
    weights = (randn(head_dim, seed=seed + 62).abs() + 0.25, randn(head_dim, seed=seed + 63).abs() * 2 + 0.1)
    fused = FusedLayer(
        kernels,
        [weight for weight, _, _ in projections],
        [scales for _, scales, _ in projections],
        biases,
        norms,
        EPS,
        q_width,
        NUM_HEADS + NUM_KV_HEADS,
        head_dim,
        head_norms=weights if head_norms else None,
    )
    return Layer(fused, projections, biases[0], norms[0], weights if head_norms else None, head_dim)


def rotary_for(head_dim: int) -> RotaryEmbedding:
    return RotaryEmbedding(default_inverse_frequencies(1000000.0, head_dim), 4096, torch.device("cpu"))


def reference_attention_input(
    layer: Layer,
    residual: torch.Tensor,
    positions: torch.Tensor,
    rotary: RotaryEmbedding,
    norm_after_rope: bool = False,
) -> torch.Tensor:
    """transformers' Qwen3 attention input in float64: RMSNorm, QKV linear (+ bias), q_norm over each query head and
    k_norm over each key head, RoPE; ``norm_after_rope``: the two last steps swapped (wrong)."""
    tokens, head_dim = residual.shape[0], layer.head_dim
    normed = F.rms_norm(residual.double(), (HIDDEN,), layer.input_norm.double(), EPS)
    qkv = F.linear(normed, layer.qkv, None if layer.qkv_bias is None else layer.qkv_bias.double())
    q, k, v = qkv.view(tokens, -1, head_dim).split([NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS], dim=1)
    cos, sin = rotary(positions, torch.float64)

    def head_norm(x, weight):
        return x if weight is None else F.rms_norm(x, (head_dim,), weight.double(), EPS)

    q_norm, k_norm = layer.head_norms or (None, None)
    if norm_after_rope:
        q, k = head_norm(apply_rotary(q, cos, sin), q_norm), head_norm(apply_rotary(k, cos, sin), k_norm)
    else:
        q, k = apply_rotary(head_norm(q, q_norm), cos, sin), apply_rotary(head_norm(k, k_norm), cos, sin)
    return torch.cat((q, k, v), dim=1).view(tokens, -1)


def positions_for(tokens: int, seed: int) -> torch.Tensor:
    return torch.randperm(4095, generator=torch.Generator().manual_seed(seed))[:tokens] + 1  # none at 0: no rotation


@pytest.mark.parametrize("kind", WEIGHT_KINDS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("tokens", range(1, 10))
def test_attention_input_norms_each_q_and_k_head_before_rope(kernels, tokens, head_dim, kind):
    """Against transformers' order in float64: within float32 rounding for 1 to 9 tokens (AVX-512's 8-row GEMV pass
    and past it), GQA, both head sizes and every weight kind; V is not normed; the residual add happens in place."""
    layer = make_layer(kernels, kind, head_dim, bias=tokens % 2 == 1, seed=tokens)
    rotary = rotary_for(head_dim)
    residual, delta = randn(tokens, HIDDEN, seed=100 + tokens), randn(tokens, HIDDEN, seed=200 + tokens)
    positions = positions_for(tokens, seed=tokens)
    expected_residual = residual + delta
    qkv = layer.fused.attention_input(residual, delta, positions, rotary.cos, rotary.sin)
    assert torch.equal(residual, expected_residual)
    torch.testing.assert_close(
        qkv.double(), reference_attention_input(layer, expected_residual, positions, rotary), atol=1e-4, rtol=1e-4
    )


@pytest.mark.parametrize("head_dim", [64, 128])
def test_head_norms_after_rope_instead_would_be_caught(kernels, head_dim):
    """RoPE keeps each head's RMS, so norming after it differs only through the weights: the wrong order's result is
    far from the kernel's, beyond any tolerance above, for every Q and K head (V is the same in both)."""
    layer = make_layer(kernels, "fp16", head_dim)
    rotary = rotary_for(head_dim)
    residual, positions = randn(5, HIDDEN, seed=7), positions_for(5, seed=7)
    qkv = layer.fused.attention_input(residual.clone(), None, positions, rotary.cos, rotary.sin).double()
    wrong = reference_attention_input(layer, residual, positions, rotary, norm_after_rope=True)
    torch.testing.assert_close(qkv, reference_attention_input(layer, residual, positions, rotary), atol=1e-4, rtol=1e-4)
    heads, wrong_heads = qkv.view(5, -1, head_dim), wrong.view(5, -1, head_dim)
    rotated = NUM_HEADS + NUM_KV_HEADS
    gaps = (heads[:, :rotated] - wrong_heads[:, :rotated]).abs().amax(dim=-1)
    assert gaps.min() > 1e-2, gaps
    torch.testing.assert_close(heads[:, rotated:], wrong_heads[:, rotated:], atol=1e-4, rtol=1e-4)


def test_a_layer_without_head_norms_is_the_llama_layer_bit_for_bit(kernels):
    """No head_norms: the norm, the GEMV and RoPE exactly as the kernels compute them one by one."""
    layer = make_layer(kernels, "int8", 64, bias=True, head_norms=False)
    rotary = rotary_for(64)
    residual, delta, positions = randn(3, HIDDEN, seed=8), randn(3, HIDDEN, seed=9), positions_for(3, seed=8)
    qkv = layer.fused.attention_input(residual.clone(), delta, positions, rotary.cos, rotary.sin)
    normed = kernels.add_rms_norm(residual, delta, layer.input_norm, EPS)
    weight, scales, _ = layer.projections[0]
    expected = kernels.linear(normed, weight, scales, layer.qkv_bias)
    kernels.rope_(expected, positions, rotary.cos, rotary.sin, NUM_HEADS + NUM_KV_HEADS, 64)
    assert torch.equal(qkv, expected)
    torch.testing.assert_close(
        qkv.double(), reference_attention_input(layer, residual, positions, rotary), atol=1e-4, rtol=1e-4
    )


def test_head_norms_of_the_wrong_shape_or_dtype_are_refused(kernels):
    layer = make_layer(kernels, "fp16", 64, head_norms=False)
    weights, scales = [weight for weight, _, _ in layer.projections], [scales for _, scales, _ in layer.projections]
    args = (
        kernels,
        weights,
        scales,
        [None] * 4,
        (torch.ones(HIDDEN), torch.ones(HIDDEN)),
        EPS,
        NUM_HEADS * 64,
        NUM_HEADS + NUM_KV_HEADS,
        64,
    )
    FusedLayer(*args, head_norms=(torch.ones(64), torch.ones(64)))
    for head_norms, problem in [
        ((torch.ones(128), torch.ones(64)), r"q_norm .*\[64\].*\(128,\)"),
        ((torch.ones(64), torch.ones(64, dtype=torch.bfloat16)), "k_norm .*bfloat16"),
        ((torch.ones(64, 2)[:, 0], torch.ones(64)), "q_norm .*contiguous"),
        ((torch.ones(64),), r"\(q_norm, k_norm\)"),
    ]:
        with pytest.raises(ValueError, match=problem):
            FusedLayer(*args, head_norms=head_norms)


# The other instruction sets' code of the head norms: plain C the compiler vectorizes, and dot()'s AVX2 and scalar
# parts.
@pytest.mark.parametrize("simd", ["avx2", "portable"])
def test_each_simd_build_norms_the_heads_alike(simd, simd_build):
    built = simd_build(simd)
    for head_dim in (64, 128):
        rotary = rotary_for(head_dim)
        for tokens in (1, 9):
            layer = make_layer(built, "int8", head_dim, bias=True, seed=tokens)
            residual, positions = randn(tokens, HIDDEN, seed=tokens), positions_for(tokens, seed=tokens)
            qkv = layer.fused.attention_input(residual.clone(), None, positions, rotary.cos, rotary.sin)
            torch.testing.assert_close(
                qkv.double(), reference_attention_input(layer, residual, positions, rotary), atol=1e-4, rtol=1e-4
            )


def reference_stack(
    layers: list[Layer], kernels, hidden, positions, rotary, kv_cache, block_tables, seq_of_token, slots, scale
):
    """The layers one by one: FusedLayer's two calls (its attention input checked against transformers' order)
    around each token's attention over its sequence's first ``position + 1`` keys in float64, the K/V written into
    ``kv_cache`` first. Returns (delta, residual)."""
    residual, delta = hidden.clone(), None
    head_dim, tokens = layers[0].head_dim, hidden.shape[0]
    q_width, kv_width = NUM_HEADS * head_dim, NUM_KV_HEADS * head_dim
    for index, layer in enumerate(layers):
        qkv = layer.fused.attention_input(residual, delta, positions, rotary.cos, rotary.sin)
        torch.testing.assert_close(
            qkv.double(), reference_attention_input(layer, residual, positions, rotary), atol=1e-4, rtol=1e-4
        )  # the head norms are transformers', not only the stack's
        pool = kv_cache[index].view(2, -1, NUM_KV_HEADS, head_dim)
        pool[0, slots] = qkv[:, q_width : q_width + kv_width].view(tokens, NUM_KV_HEADS, head_dim)
        pool[1, slots] = qkv[:, q_width + kv_width :].view(tokens, NUM_KV_HEADS, head_dim)
        attended = torch.empty(tokens, q_width)
        for token in range(tokens):
            table = block_tables[seq_of_token[token]].long()
            keys, values = (
                kv_cache[index, half, table].flatten(0, 1)[: int(positions[token]) + 1].double() for half in (0, 1)
            )
            q = qkv[token, :q_width].view(NUM_HEADS, head_dim).double()
            weights = (
                torch.einsum("hd,hnd->hn", q, keys.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1).transpose(0, 1))
                .mul(scale)
                .softmax(dim=-1)
            )
            out = torch.einsum(
                "hn,hnd->hd", weights, values.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1).transpose(0, 1)
            )
            attended[token] = out.flatten().float()
        delta = layer.fused.feed_forward(attended, residual)
    return delta, residual


@pytest.mark.parametrize("kind", WEIGHT_KINDS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fused_stack_with_head_norms_matches_its_layers_around_reference_attention(kernels, kind, head_dim):
    """Two Qwen3-style layers in one C call, attention included (a decode row and three verification rows of
    another sequence over cached contexts): the residual stream, the output and every K/V written equal the layers
    run one by one around float64 attention, within float32 rounding."""
    layers = [make_layer(kernels, kind, head_dim, seed=seed) for seed in (1, 2)]
    rotary = rotary_for(head_dim)
    block_size, num_blocks = 16, 9
    block_tables = torch.tensor([[3, 1, 6, 0], [2, 5, 7, 4]], dtype=torch.int32)
    seq_of_token, positions = [0, 1, 1, 1], torch.tensor([40, 17, 18, 19])
    slots = torch.tensor(
        [
            int(block_tables[seq, int(position) // block_size]) * block_size + int(position) % block_size
            for seq, position in zip(seq_of_token, positions)
        ]
    )
    kv_cache = randn(2, 2, num_blocks, block_size, NUM_KV_HEADS, head_dim, seed=3)
    hidden = randn(4, HIDDEN, seed=4)
    scale = 1 / math.sqrt(head_dim)
    expected_cache = kv_cache.clone()
    expected, expected_residual = reference_stack(
        layers, kernels, hidden, positions, rotary, expected_cache, block_tables, seq_of_token, slots, scale
    )
    plan = KernelAttentionPlan(None, torch.tensor(seq_of_token), positions + 1, 4, int(positions.max()) + 1)
    step = KernelAttentionStep(plan, block_tables, slots, NUM_HEADS, scale)
    stack = FusedStack(kernels, [layer.fused for layer in layers], [0, 1])
    delta = stack.run(hidden, positions, rotary.cos, rotary.sin, kv_cache, step)
    torch.testing.assert_close(kv_cache, expected_cache, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden, expected_residual, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(delta, expected, atol=1e-4, rtol=1e-4)
