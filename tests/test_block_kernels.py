"""The block GEMV (``csrc/gemv_blocks.c``) over GGUF's ``Q4_0``, ``Q4_1`` and ``Q8_0`` blocks: its repacking keeps
gguf's weights bit for bit, its sums are float64's over the dequantized blocks and the int8 activations it computes
with, on odd shapes, and every SIMD build agrees with the portable C."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from infer.kernels import cpu as cpu_kernels
from infer.kernels.cpu.blocks import BLOCK_KINDS, dequantize_blocks, pack_blocks, quantize_blocks

KINDS = list(BLOCK_KINDS)
# k a multiple of 32 but not of 256 (Q4_K's super-blocks), and the model's; n odd, below and above a group of four.
SHAPES = [(13, 96), (1, 288), (67, 576), (4, 1536)]


@pytest.fixture(scope="module")
def kernels():
    if cpu_kernels.compiler() is None:
        pytest.skip("the CPU kernels need a C compiler")
    return cpu_kernels.load(True)


def gguf_tensor(kind: str, out_features: int, in_features: int, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    """A random weight quantized by gguf's reference quantizer: its bytes, and their float32 values."""
    generator = np.random.default_rng(seed)
    weight = (generator.standard_normal((out_features, in_features)) * 0.05).astype(np.float32)
    weight[:, :32] += 0.1  # a block with an offset, where Q4_1's minimum matters
    raw = quantize(weight, GGMLQuantizationType[kind.upper()])
    return raw, torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind.upper()]).copy())


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """The rows of x as the kernel multiplies them: per 32 columns, round(x * 127 / amax) (to nearest even, in
    float32) times amax / 127, in float64."""
    blocks = x.view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    inverse = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inverse)
    return (q.double() * (amax / 127.0).double()).view_as(x)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_pack_blocks_keeps_gguf_weights_bit_for_bit(kind, out_features, in_features):
    raw, expected = gguf_tensor(kind, out_features, in_features)
    packed = pack_blocks(raw, kind, out_features)
    assert packed.data.shape == (-(-out_features // 4), in_features // 32, {"q4_0": 72, "q4_1": 80, "q8_0": 136}[kind])
    assert (packed.out_features, packed.in_features) == (out_features, in_features)
    assert torch.equal(dequantize_blocks(packed), expected)


@pytest.mark.parametrize("kind", KINDS)
def test_quantize_blocks_is_llama_cpps_quantizer(kind):
    weight = torch.randn(12, 64, generator=torch.Generator().manual_seed(1))
    raw = quantize(weight.numpy(), GGMLQuantizationType[kind.upper()])
    assert torch.equal(quantize_blocks(weight, kind).data, pack_blocks(raw, kind, 12).data)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_block_gemv_is_float64_over_the_blocks_and_the_int8_activations(kernels, kind, out_features, in_features, bias):
    raw, weight = gguf_tensor(kind, out_features, in_features)
    packed = pack_blocks(raw, kind, out_features)
    bias_values = torch.randn(out_features) if bias else None
    for rows in range(1, 10):  # every count of a pass, and passes of several counts
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
        x[0, 32:64] = 0.0  # an all-zero block of x: scale 0
        exact = quantized_activations(x) @ weight.double().T
        if bias:
            exact += bias_values.double()
        out = kernels.linear_blocks(x, packed, bias_values)
        assert out.shape == (rows, out_features) and out.dtype == torch.float32
        torch.testing.assert_close(out.double(), exact, atol=1e-5, rtol=1e-5)
        # against the float rows: the int8 activations' error only (about 0.5% of a wide result, more of one row)
        plain = x.double() @ weight.double().T + (0 if bias_values is None else bias_values.double())
        assert float((out.double() - plain).norm() / plain.norm()) < 5e-2


def test_block_gemv_refuses_weights_it_cannot_read(kernels):
    raw, _ = gguf_tensor("q4_1", 8, 64)
    packed = pack_blocks(raw, "q4_1", 8)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.linear_blocks(torch.randn(2, 96), packed, None)
    with pytest.raises(ValueError, match="packed by pack_blocks"):
        kernels.linear_blocks(torch.randn(2, 64), type(packed)(packed.data, "q8_0", 8), None)


def without_amx() -> list[str]:
    from infer.host import cpu_flags

    return ["-mno-amx-tile"] if "amx_tile" in cpu_flags() else []


# The block GEMV's instruction paths, the CPU flags each needs and the flags that build it on a CPU with more:
# AVX-512 with VNNI's vpdpbusd or with vpmaddubsw, AVX2 with AVX-VNNI or with vpmaddubsw.
BLOCK_BUILDS = {
    "avx512_vnni": ({"avx512bw", "avx512_vnni"}, []),
    "avx512": ({"avx512bw"}, ["-mno-avx512vnni", "-mno-avxvnni"]),
    "avx2_vnni": ({"avx2", "fma", "f16c", "avx_vnni"}, ["-mno-avx512f"]),
    "avx2": ({"avx2", "fma", "f16c"}, ["-mno-avx512f", "-mno-avxvnni"]),
}


@pytest.fixture(scope="module")
def portable_kernels(tmp_path_factory):
    if cpu_kernels.compiler() is None:
        pytest.skip("the CPU kernels need a C compiler")
    built = cpu_kernels.load_built(cpu_kernels.build(tmp_path_factory.mktemp("portable"), ["-mno-avx", *without_amx()]))
    assert built.simd == "portable"
    return built


@pytest.mark.parametrize("build", list(BLOCK_BUILDS))
def test_each_simd_build_of_the_block_gemv_matches_the_portable_c(build, portable_kernels, tmp_path):
    from infer.host import cpu_flags

    needed, flags = BLOCK_BUILDS[build]
    missing = needed - cpu_flags()
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(sorted(missing))} for the {build} block GEMV")
    built = cpu_kernels.load_built(cpu_kernels.build(tmp_path, [*flags, *without_amx()]))
    assert built.simd == build.removesuffix("_vnni")
    for kind in KINDS:
        raw, _ = gguf_tensor(kind, 67, 288, seed=2)
        packed = pack_blocks(raw, kind, 67)
        for rows in (1, 2, 3, 4, 5, 8, 9, 17, 70):  # 70: two sweeps of 64 rows
            x = torch.randn(rows, 288, generator=torch.Generator().manual_seed(rows)) * 3
            torch.testing.assert_close(
                built.linear_blocks(x, packed, None),
                portable_kernels.linear_blocks(x, packed, None),
                atol=1e-5,
                rtol=1e-5,
            )
