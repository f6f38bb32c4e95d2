"""The block GEMV (``csrc/gemv_blocks.c``, ``csrc/gemv_kquants.c``) over GGUF's ``Q4_0``, ``Q4_1``, ``Q8_0`` and
``MXFP4`` blocks and ``Q4_K``/``Q6_K`` super-blocks: its repacking keeps gguf's weights bit for bit, its sums are
float64's over the dequantized blocks and the int8 activations it computes with, on odd shapes, and every SIMD build
agrees with the portable C (and, for the K-quants, with float64)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from test_cpu_kernels import without_amx

from infer.kernels import cpu as cpu_kernels
from infer.kernels.cpu import abi, blocks
from infer.kernels.cpu.blocks import (
    K_KINDS,
    dequantize_blocks,
    pack_blocks,
    pack_mixed_kquants,
    quantize_blocks,
)
from infer.testing.kquants import QUANTIZERS

KINDS = ["q4_0", "q4_1", "q8_0"]  # the kinds infer quantizes float weights to
# The block GEMV's kinds of 32: MXFP4's blocks come from a checkpoint (gguf's quantizer makes them here).
GEMV_KINDS = [*KINDS, "mxfp4"]
# k a multiple of 32 but not of 256 (Q4_K's super-blocks), and the model's; n odd, below and above a group of four.
SHAPES = [(13, 96), (1, 288), (67, 576), (4, 1536)]
# One to eight super-blocks a row; n odd, below and above a pass of rows.
K_SHAPES = [(13, 256), (1, 512), (67, 768), (5, 2048)]


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


def kquant_tensor(kind: str, out_features: int, in_features: int, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    """A random weight quantized by infer.testing's K-quant quantizer: its GGUF bytes, and gguf's float32 values."""
    generator = np.random.default_rng(seed)
    weight = (generator.standard_normal((out_features, in_features)) * 0.05).astype(np.float32)
    weight[:, :32] += 0.1  # a sub-block with an offset, where Q4_K's minimum matters
    weight[:, 256:288] *= 8  # sub-blocks far apart in scale: the high bits of the 6-bit and int8 scales
    raw = QUANTIZERS[kind](weight)
    return raw, torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind.upper()]).copy())


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """The rows of x as the kernel multiplies them: per 32 columns, round(x * 127 / amax) (to nearest even, in
    float32) times amax / 127, in float64."""
    blocks = x.view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    inverse = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inverse)
    return (q.double() * (amax / 127.0).double()).view_as(x)


@pytest.mark.parametrize("kind", GEMV_KINDS)
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_pack_blocks_keeps_gguf_weights_bit_for_bit(kind, out_features, in_features):
    raw, expected = gguf_tensor(kind, out_features, in_features)
    packed = pack_blocks(raw, kind, out_features)
    record = {"q4_0": 72, "q4_1": 80, "q8_0": 136, "mxfp4": 68}[kind]
    assert packed.data.shape == (-(-out_features // 4), in_features // 32, record)
    assert (packed.out_features, packed.in_features) == (out_features, in_features)
    assert torch.equal(dequantize_blocks(packed), expected)


def awkward_weights() -> torch.Tensor:
    """Rows over twelve decades of scale, and rows whose blocks test the quantizers' edges: all zeros, all equal, a
    tie of largest magnitudes of both signs, halves that round away from zero, subnormal fp16 scales, scales past
    fp16's range, negative zeros, fp16 ties."""
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(21, 96, generator=generator) * torch.logspace(-6, 5, 21).unsqueeze(1)
    weight[0] = 0
    weight[1, :32] = 1.5
    weight[2, 5], weight[2, 6] = 7.0, -7.0
    weight[3] = torch.tensor([0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 126.5, -127.0] * 12)
    weight[4, :32] = torch.linspace(-1, 1, 32)
    weight[5] = torch.randn(96, generator=generator) * 1e-30
    # A block of negative zeros. (Not one of zeros of both signs: as q4_1's minimum, gguf's numpy takes -0.0 and
    # llama.cpp's C the first zero; the sign of a zero minimum changes no value.)
    weight[6, :32] = -0.0
    # Scales halfway between two halves (1 + 2^-11: ties go to the even 1.0): q4_1's minimum, q8_0's amax / 127 and
    # q4_0's largest / -8, one block each.
    tie = 1 + 2**-11
    weight[7, :32] = tie + torch.arange(32) / 4
    weight[7, 32:64], weight[7, 33] = 0.5, 127 * tie
    weight[7, 64:96], weight[7, 65] = 0.5, -8 * tie
    return weight


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_blocks_is_llama_cpps_quantizer(kernels, portable_kernels, kind, dtype, monkeypatch):
    """The very bytes of gguf's reference quantizers (llama.cpp's), in torch (also where rows go through in several
    chunks) and in C (this build's and the portable one's)."""
    weight = awkward_weights().to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy's overflow of the largest rows' fp16 scales
        raw = quantize(weight.float().numpy(), GGMLQuantizationType[kind.upper()])
    expected = pack_blocks(raw, kind, weight.shape[0]).data
    assert torch.equal(quantize_blocks(weight, kind).data, expected)
    monkeypatch.setattr(blocks, "QUANTIZE_CHUNK", 200)  # two rows a chunk
    assert torch.equal(quantize_blocks(weight, kind).data, expected)
    assert torch.equal(kernels.quantize_blocks(weight, kind).data, expected)
    assert torch.equal(portable_kernels.quantize_blocks(weight, kind).data, expected)
    monkeypatch.setattr(abi, "QUANTIZE_CHUNK", 200)  # C: one group of rows a call
    assert torch.equal(kernels.quantize_blocks(weight, kind).data, expected)


@pytest.mark.parametrize("kind", GEMV_KINDS)
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_block_gemv_is_float64_over_the_blocks_and_the_int8_activations(kernels, kind, out_features, in_features, bias):
    raw, weight = gguf_tensor(kind, out_features, in_features)
    packed = pack_blocks(raw, kind, out_features)
    bias_values = torch.randn(out_features, generator=torch.Generator().manual_seed(7)) if bias else None
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


@pytest.mark.parametrize("kind", K_KINDS)
def test_kquant_quantizer_writes_blocks_gguf_reads_as_the_weights(kind):
    generator = np.random.default_rng(3)
    weight = (generator.standard_normal((9, 512)) * 0.05).astype(np.float32)
    values = dequantize(QUANTIZERS[kind](weight), GGMLQuantizationType[kind.upper()])
    error = np.linalg.norm(values - weight) / np.linalg.norm(weight)
    assert 0 < error < {"q4_k": 0.09, "q6_k": 0.025}[kind]  # 4.5 and 6.6 bits a weight


@pytest.mark.parametrize("kind", K_KINDS)
@pytest.mark.parametrize(("out_features", "in_features"), K_SHAPES)
def test_pack_kquants_keeps_gguf_weights_bit_for_bit(kind, out_features, in_features):
    raw, expected = kquant_tensor(kind, out_features, in_features)
    packed = pack_blocks(raw, kind, out_features)
    assert packed.data.shape == (out_features, in_features // 256, {"q4_k": 144, "q6_k": 210}[kind])
    assert (packed.out_features, packed.in_features, packed.nbytes) == (out_features, in_features, raw.nbytes)
    assert torch.equal(dequantize_blocks(packed), expected)


@pytest.mark.parametrize("kind", K_KINDS)
def test_pack_kquants_keeps_any_bytes_of_the_format(kind):
    """Random bytes are valid super-blocks once their fp16 scales are finite: every bit of the quants and scales
    lands where gguf's dequantizer reads it."""
    generator = np.random.default_rng(4)
    size = {"q4_k": 144, "q6_k": 210}[kind]
    raw = generator.integers(0, 256, size=(7, 3, size), dtype=np.uint8)
    halves = (generator.standard_normal((7, 3, 2)) * 0.01).astype(np.float16).view(np.uint8)  # [7, 3, 4]
    if kind == "q4_k":
        raw[..., 0:4] = halves  # d, dmin
    else:
        raw[..., 208:210] = halves[..., :2]  # d
    raw = raw.reshape(7, -1)
    expected = dequantize(raw, GGMLQuantizationType[kind.upper()])
    assert torch.equal(dequantize_blocks(pack_blocks(raw, kind, 7)), torch.from_numpy(expected.copy()))


def mixed_tensor(seed: int = 0):
    """A projection of three parts stored as Q4_K, Q6_K and Q4_K (a Q4_K_M file's Q, V, and another Q4_K): the
    packed weight, and gguf's float32 values of the parts."""
    parts, values = [], []
    for index, (kind, rows) in enumerate([("q4_k", 5), ("q6_k", 11), ("q4_k", 3)]):
        raw, value = kquant_tensor(kind, rows, 768, seed + index)
        parts.append((raw, kind, rows))
        values.append(value)
    return pack_mixed_kquants(parts), torch.cat(values)


def test_mixed_kquants_keep_each_parts_weights():
    packed, expected = mixed_tensor()
    assert (packed.kind, packed.out_features, packed.in_features) == ("k_mixed", 19, 768)
    assert torch.equal(dequantize_blocks(packed), expected)
    raw, _ = kquant_tensor("q6_k", 4, 256)
    assert pack_mixed_kquants([(raw[:2], "q6_k", 2), (raw[2:], "q6_k", 2)]).kind == "q6_k"  # one kind: no header
    with pytest.raises(ValueError, match="K kinds"):
        pack_mixed_kquants([(raw, "q6_k", 4), (raw, "q8_0", 4)])


def assert_kquant_gemv_is_float64s(kernels, packed, weight: torch.Tensor, bias: torch.Tensor | None, rows_list):
    for rows in rows_list:
        x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows)) * 3
        x[0, 32:64] = 0.0  # an all-zero block of x: scale 0
        exact = quantized_activations(x) @ weight.double().T
        if bias is not None:
            exact += bias.double()
        out = kernels.linear_blocks(x, packed, bias)
        assert out.shape == (rows, weight.shape[0]) and out.dtype == torch.float32
        torch.testing.assert_close(out.double(), exact, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", K_KINDS)
@pytest.mark.parametrize(("out_features", "in_features"), K_SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_kquant_gemv_is_float64_over_the_super_blocks_and_the_int8_activations(
    kernels, kind, out_features, in_features, bias
):
    raw, weight = kquant_tensor(kind, out_features, in_features)
    packed = pack_blocks(raw, kind, out_features)
    bias_values = torch.randn(out_features, generator=torch.Generator().manual_seed(7)) if bias else None
    # every count of a pass, passes of several counts, two sweeps of 64 rows
    assert_kquant_gemv_is_float64s(kernels, packed, weight, bias_values, [*range(1, 10), 70])


def test_mixed_kquant_gemv_is_float64_over_each_part(kernels):
    packed, weight = mixed_tensor()
    assert_kquant_gemv_is_float64s(
        kernels, packed, weight, torch.randn(19, generator=torch.Generator().manual_seed(7)), [1, 2, 5, 9]
    )


def test_block_gemv_refuses_weights_it_cannot_read(kernels):
    raw, _ = gguf_tensor("q4_1", 8, 64)
    packed = pack_blocks(raw, "q4_1", 8)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.linear_blocks(torch.randn(2, 96), packed, None)
    with pytest.raises(ValueError, match="packed by pack_blocks"):
        kernels.linear_blocks(torch.randn(2, 64), type(packed)(packed.data, "q8_0", 8), None)
    raw, _ = kquant_tensor("q4_k", 8, 512)
    packed = pack_blocks(raw, "q4_k", 8)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.linear_blocks(torch.randn(2, 256), packed, None)
    with pytest.raises(ValueError, match="packed by pack_blocks"):
        kernels.linear_blocks(torch.randn(2, 512), type(packed)(packed.data, "q6_k", 8), None)


# The block GEMV's instruction paths, the CPU flags each needs and the flags that build it on a CPU with more:
# AVX-512 with VNNI's vpdpbusd or with vpmaddubsw, AVX2 with AVX-VNNI or with vpmaddubsw.
BLOCK_BUILDS = {
    "avx512_vnni": ({"avx512bw", "avx512_vnni"}, []),
    "avx512": ({"avx512bw"}, ["-mno-avx512vnni", "-mno-avxvnni"]),
    "avx2_vnni": ({"avx2", "fma", "f16c", "avx_vnni"}, ["-mno-avx512f"]),
    "avx2": ({"avx2", "fma", "f16c"}, ["-mno-avx512f", "-mno-avxvnni"]),
}


# Each build compiles the whole library: the builds without VNNI (vpmaddubsw's paths) run in CI's slow step.
BLOCK_BUILD_PARAMS = [
    pytest.param(build, marks=pytest.mark.slow) if build in ("avx512", "avx2") else build for build in BLOCK_BUILDS
]


@pytest.mark.parametrize("build", BLOCK_BUILD_PARAMS)
def test_each_simd_build_of_the_block_gemv_matches_the_portable_c(build, portable_kernels, kernel_build):
    from infer.host import cpu_flags

    needed, flags = BLOCK_BUILDS[build]
    missing = needed - cpu_flags()
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(sorted(missing))} for the {build} block GEMV")
    built = kernel_build([*flags, *without_amx()])
    assert built.simd == build.removesuffix("_vnni")
    for kind in GEMV_KINDS:
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
    rows_list = (1, 2, 3, 4, 5, 8, 9, 17, 70)
    for kind in K_KINDS:  # against float64, as the native build in the tests above
        raw, weight = kquant_tensor(kind, 67, 768, seed=2)
        assert_kquant_gemv_is_float64s(built, pack_blocks(raw, kind, 67), weight, None, rows_list)
    packed, weight = mixed_tensor(seed=2)
    assert_kquant_gemv_is_float64s(built, packed, weight, None, rows_list)
