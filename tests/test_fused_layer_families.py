"""The fused C decoder layer for the families beyond Llama, against transformers' order of operations in float64:
GeGLU with tanh-approximated GELU, Gemma 3's output norms (attention's and the MLP's results RMSNormed before they
join the residual stream), a layer's own RoPE table (Gemma 3's global layers) and partial rotary (Phi-4-mini rotates
3/4 of each head). Each is also checked to differ from what the Llama layer would compute, so a kernel that ignored
the option would fail."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from infer.kernels import cpu as cpu_kernels
from infer.kernels.cpu import FusedLayer
from infer.model import RotaryEmbedding, apply_rotary, default_inverse_frequencies

# INTERMEDIATE = 16 * 14 + 8: the activation's AVX-512 loop, its AVX2 remainder and (portable build) the scalar loop
HIDDEN, INTERMEDIATE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, EPS = 128, 232, 4, 2, 64, 1e-6
TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}


def randn(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def rotary_table(rotary_dim: int, base: float) -> RotaryEmbedding:
    return RotaryEmbedding(default_inverse_frequencies(base, rotary_dim), 2048, torch.device("cpu"))


class Layer:
    """A GQA layer's fp16 weights (their exact values in float64), norms and options, and its ``FusedLayer``."""

    def __init__(
        self,
        kernels,
        *,
        activation="silu",
        output_norms=False,
        head_norms=False,
        rotary=None,
        rotary_dim=HEAD_DIM,
        seed=0,
    ):
        q_width, kv_width = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
        qkv_width = q_width + 2 * kv_width
        shapes = [(qkv_width, HIDDEN), (HIDDEN, q_width), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
        weights = [randn(*shape, seed=seed + i, scale=0.1).half() for i, shape in enumerate(shapes)]
        self.exact = [weight.double() for weight in weights]
        # norm weights far from 1 (Gemma's are stored as 1 + w): a norm skipped or swapped for another shows
        self.norms = [randn(HIDDEN, seed=seed + 20 + i).abs() + 0.3 for i in range(4)]
        self.head_norms = (randn(HEAD_DIM, seed=seed + 30).abs() + 0.25, randn(HEAD_DIM, seed=seed + 31).abs() + 0.6)
        self.activation, self.rotary, self.rotary_dim = activation, rotary, rotary_dim
        self.output_norms, self.has_head_norms = output_norms, head_norms
        options = {"activation": activation, "rotary_dim": rotary_dim}
        if output_norms:
            options["output_norms"] = (self.norms[2], self.norms[3])
        if head_norms:
            options["head_norms"] = self.head_norms
        if rotary is not None:
            options["rotary"] = (rotary.cos, rotary.sin)
        self.fused = FusedLayer(
            kernels,
            [cpu_kernels.pack_weights(weight) for weight in weights],
            [None] * 4,
            [None] * 4,
            (self.norms[0], self.norms[1]),
            EPS,
            q_width,
            NUM_HEADS + NUM_KV_HEADS,
            HEAD_DIM,
            **options,
        )

    def attention_input(self, residual, positions, step_rotary):
        """transformers' attention input in float64: norm, QKV, q/k head norms, RoPE over the first rotary_dim of
        each Q and K head by the layer's table (the step's where it has none)."""
        tokens = residual.shape[0]
        normed = F.rms_norm(residual.double(), (HIDDEN,), self.norms[0].double(), EPS)
        q, k, v = (
            F.linear(normed, self.exact[0])
            .view(tokens, -1, HEAD_DIM)
            .split([NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS], dim=1)
        )
        if self.has_head_norms:
            q = F.rms_norm(q, (HEAD_DIM,), self.head_norms[0].double(), EPS)
            k = F.rms_norm(k, (HEAD_DIM,), self.head_norms[1].double(), EPS)
        cos, sin = (self.rotary or step_rotary)(positions, torch.float64)
        return torch.cat((apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v), dim=1).view(tokens, -1)

    def feed_forward(self, attended, residual):
        """transformers' second half in float64: ``(delta, residual)``."""
        projected = F.linear(attended.double(), self.exact[1])
        if self.output_norms:
            projected = F.rms_norm(projected, (HIDDEN,), self.norms[2].double(), EPS)
        residual = residual.double() + projected
        gate, up = F.linear(F.rms_norm(residual, (HIDDEN,), self.norms[1].double(), EPS), self.exact[2]).chunk(2, -1)
        activated = (F.gelu(gate, approximate="tanh") if self.activation == "gelu_tanh" else F.silu(gate)) * up
        delta = F.linear(activated, self.exact[3])
        if self.output_norms:
            delta = F.rms_norm(delta, (HIDDEN,), self.norms[3].double(), EPS)
        return delta, residual


def positions_for(tokens: int, seed: int) -> torch.Tensor:
    return torch.randperm(2047, generator=torch.Generator().manual_seed(seed))[:tokens] + 1  # none at 0: no rotation


@pytest.mark.parametrize("tokens", [1, 3, 9])
@pytest.mark.parametrize(
    "options",
    [
        {"activation": "gelu_tanh", "output_norms": True},  # Gemma 3's MLP half
        {"activation": "gelu_tanh"},
        {"output_norms": True},
    ],
    ids=["gemma", "geglu", "output-norms"],
)
def test_feed_forward_takes_geglu_and_output_norms(kernels, tokens, options):
    """The residual gets the normed output projection; the delta is the normed MLP output, GeGLU or SwiGLU; within
    float32 rounding of transformers' float64, and far from the Llama layer's result on the same weights."""
    layer = Layer(kernels, **options, seed=tokens)
    llama = Layer(kernels, seed=tokens)
    attended, residual = randn(tokens, NUM_HEADS * HEAD_DIM, seed=40), randn(tokens, HIDDEN, seed=41)
    expected, expected_residual = layer.feed_forward(attended, residual)
    llama_residual = residual.clone()
    delta = layer.fused.feed_forward(attended, residual)
    torch.testing.assert_close(residual.double(), expected_residual, **TOLERANCE)
    torch.testing.assert_close(delta.double(), expected, **TOLERANCE)
    assert (llama.fused.feed_forward(attended, llama_residual) - delta).abs().max() > 1e-2


def test_the_geglu_activation_is_gelus_tanh_form_at_every_magnitude(kernels):
    """``gelu_tanh_mul`` against torch's tanh GELU in float64 from -30 to 30 (both saturations: no inf or NaN from
    the exponential) over a width with every SIMD loop's remainder."""
    gate = torch.linspace(-30, 30, 7 * 203).view(7, 203)
    up = randn(7, 203, seed=5)
    out = kernels.gelu_tanh_mul(torch.cat((gate, up), dim=1))
    expected = F.gelu(gate.double(), approximate="tanh") * up.double()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens", [1, 5, 17])
@pytest.mark.parametrize("rotary_dim", [HEAD_DIM, 48, 16])
@pytest.mark.parametrize("head_norms", [False, True])
def test_attention_input_rotates_a_heads_first_rotary_dim_values(kernels, tokens, rotary_dim, head_norms):
    """Partial rotary (Phi-4-mini's 48 of 64): each Q and K head's first rotary_dim values rotate by a table of
    rotary_dim columns, the rest pass (normed, with head norms); V is untouched."""
    step_rotary = rotary_table(rotary_dim, 10_000.0)
    layer = Layer(kernels, rotary_dim=rotary_dim, head_norms=head_norms, seed=tokens)
    residual, positions = randn(tokens, HIDDEN, seed=50 + tokens), positions_for(tokens, seed=tokens)
    qkv = layer.fused.attention_input(residual.clone(), None, positions, step_rotary.cos, step_rotary.sin)
    torch.testing.assert_close(qkv.double(), layer.attention_input(residual, positions, step_rotary), **TOLERANCE)


@pytest.mark.parametrize("head_norms", [False, True])
def test_a_layer_with_its_own_rotary_table_rotates_by_it(kernels, head_norms):
    """Gemma 3's global layers: the layer's table (base 1e6, linear scaling's slower angles) is used, not the
    step's (base 1e4), which would give other Q and K values."""
    step_rotary = rotary_table(HEAD_DIM, 10_000.0)
    own = RotaryEmbedding(default_inverse_frequencies(1_000_000.0, HEAD_DIM) / 8.0, 2048, torch.device("cpu"))
    layer = Layer(kernels, rotary=own, head_norms=head_norms, seed=3)
    residual, positions = randn(4, HIDDEN, seed=60), positions_for(4, seed=60)
    qkv = layer.fused.attention_input(residual.clone(), None, positions, step_rotary.cos, step_rotary.sin)
    torch.testing.assert_close(qkv.double(), layer.attention_input(residual, positions, step_rotary), **TOLERANCE)
    layer.rotary = None  # what the step's table gives
    assert (qkv.double() - layer.attention_input(residual, positions, step_rotary)).abs().max() > 1e-2


def test_options_of_the_wrong_shape_are_refused(kernels):
    for options, problem in [
        ({"rotary_dim": 63}, "rotary_dim must be even"),
        ({"rotary_dim": 80}, r"rotary_dim must be even and in \(0, head_dim = 64\]"),
        ({"activation": "relu"}, "activation is one of silu, gelu_tanh, got 'relu'"),
    ]:
        with pytest.raises(ValueError, match=problem):
            Layer(kernels, **options)
    layer = Layer(kernels)
    base = (layer.norms[0], layer.norms[1])
    args = (kernels, [cpu_kernels.pack_weights(w.half()) for w in layer.exact], [None] * 4, [None] * 4, base)
    args += (EPS, NUM_HEADS * HEAD_DIM, NUM_HEADS + NUM_KV_HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match=r"output_norms must be \[hidden\] = \[128\]"):
        FusedLayer(*args, output_norms=(torch.ones(64), torch.ones(64)))
    with pytest.raises(ValueError, match="output_norms' MLP output must be a contiguous float32"):
        FusedLayer(*args, output_norms=(torch.ones(HIDDEN), torch.ones(HIDDEN, dtype=torch.float16)))
    with pytest.raises(ValueError, match=r"rotary's tables must be \[positions, rotary_dim\] = \[\*, 48\]"):
        table = rotary_table(HEAD_DIM, 10_000.0)
        FusedLayer(*args, rotary=(table.cos, table.sin), rotary_dim=48)


# The other instruction sets' code of the activation (its AVX2 and scalar loops) and RoPE.
@pytest.mark.parametrize("simd", ["avx2", "portable"])
def test_each_simd_build_computes_the_gemma_and_phi_layer_alike(simd, simd_build):
    built = simd_build(simd)
    step_rotary = rotary_table(48, 10_000.0)
    layer = Layer(built, activation="gelu_tanh", output_norms=True, head_norms=True, rotary_dim=48, seed=9)
    residual, positions = randn(3, HIDDEN, seed=70), positions_for(3, seed=70)
    qkv = layer.fused.attention_input(residual.clone(), None, positions, step_rotary.cos, step_rotary.sin)
    torch.testing.assert_close(qkv.double(), layer.attention_input(residual, positions, step_rotary), **TOLERANCE)
    attended = randn(3, NUM_HEADS * HEAD_DIM, seed=71)
    expected, _ = layer.feed_forward(attended, residual)
    torch.testing.assert_close(layer.fused.feed_forward(attended, residual).double(), expected, **TOLERANCE)
