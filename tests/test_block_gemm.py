"""The block GEMM (``csrc/gemm_blocks.c``) over GGUF's ``Q4_0``, ``Q4_1``, ``Q8_0`` and MXFP4 blocks and
``Q4_K``/``Q6_K`` super-blocks (alone and mixed in one weight), for steps of many rows: each design's sums are
float64's over the values it multiplies (the dequantized blocks and the int8 activations the GEMV computes with, or
both rounded to bf16 on AMX) on odd shapes, the int8 design's are the GEMVs' (K-quants' included), every SIMD build's
int8 products agree with the portable C (and its K-quants with float64), and a model's prefill and 32-row decode steps
give the GEMV's logits."""

from __future__ import annotations

import pytest
import torch
from test_block_kernels import (
    BLOCK_BUILD_PARAMS,
    BLOCK_BUILDS,
    GEMV_KINDS,
    KINDS,
    gguf_tensor,
    kquant_tensor,
    mixed_tensor,
    quantized_activations,
)
from test_cpu_kernels import without_amx

from infer.kernels import cpu as cpu_kernels
from infer.kernels.cpu.blocks import K_KINDS, dequantize_blocks, pack_blocks

# n odd and not a multiple of 16 or 32 (the designs' panels), k a multiple of 32 but not of 64 or 256; at 3040 x's
# 300 rows are two chunks, each running every panel of a thread's share (the next one dequantized alongside).
SHAPES = [(13, 96), (67, 288), (150, 576), (35, 1504), (99, 3040)]
# Rows below, at and past the designs' tiles of 16 and pairs of tiles, and a prefill-sized step.
ROWS = (1, 9, 16, 17, 33, 70, 300)
# K-quants: k one to twelve super-blocks (at 3072, 300 rows are two chunks of x); n odd and not a multiple of 16 or
# 32; and a mixed weight (19 x 768, its three parts in one panel).
K_CASES = [
    *[(kind, shape) for kind in K_KINDS for shape in [(13, 256), (67, 768), (35, 3072)]],
    ("k_mixed", (19, 768)),
]
K_ROWS = (1, 5, 16, 17, 33, 70, 300)


@pytest.fixture(scope="module")
def kernels():
    if cpu_kernels.compiler() is None:
        pytest.skip("the CPU kernels need a C compiler")
    return cpu_kernels.load(True)


def exact_product(design: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """In float64, what ``design`` multiplies: x rounded to bf16 times the weights rounded to bf16 (``amx-bf16``), or
    x's int8 blocks times the weights (the int8 designs and the GEMV)."""
    if design == "amx-bf16":
        exact = x.bfloat16().double() @ weight.bfloat16().double().T
    else:
        exact = quantized_activations(x) @ weight.double().T
    return exact if bias is None else exact + bias.double()


@pytest.mark.parametrize("kind", GEMV_KINDS)
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_block_gemm_is_float64_over_what_each_design_multiplies(kernels, kind, out_features, in_features):
    """Every design over every kind; MXFP4, which the AMX design does not read, on int8 whichever is asked."""
    raw, weight = gguf_tensor(kind, out_features, in_features)
    packed = pack_blocks(raw, kind, out_features)
    for asked in kernels.block_gemm_designs:
        design = "int8" if kind == "mxfp4" and asked == "amx-bf16" else asked
        for rows in ROWS:
            x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
            x[0, 32:64] = 0.0  # an all-zero block of x: scale 0
            bias = torch.randn(out_features) if rows % 2 else None
            out = kernels.gemm_blocks(x, packed, bias, asked)
            assert out.shape == (rows, out_features) and out.dtype == torch.float32
            torch.testing.assert_close(
                out.double(), exact_product(design, x, weight, bias), atol=1e-5, rtol=1e-5, msg=f"{design}, {rows} rows"
            )


@pytest.mark.parametrize("kind", GEMV_KINDS)
def test_int8_block_gemm_gives_the_block_gemvs_sums(kernels, kind):
    raw, _ = gguf_tensor(kind, 67, 1504, seed=3)
    packed = pack_blocks(raw, kind, 67)
    for rows in (9, 33, 70):
        x = torch.randn(rows, 1504, generator=torch.Generator().manual_seed(rows)) * 3
        # the same products summed in another order in float32: results of about 6 differ by ulps of it
        torch.testing.assert_close(
            kernels.gemm_blocks(x, packed, None, "int8"), kernels.linear_blocks(x, packed, None), atol=1e-4, rtol=1e-5
        )


@pytest.mark.parametrize(("kind", "int8_rows"), [("q4_0", 8), ("q4_1", 8), ("q8_0", 16)])
def test_block_gemm_takes_int8_for_few_rows_and_its_large_step_design_past_them(kernels, kind, int8_rows):
    """Q8_0 keeps the int8 design up to 16 rows; Q4 records, cheaper to dequantize, take the large-step design from
    the first row past the GEMV's pass of 8."""
    raw, _ = gguf_tensor(kind, 67, 288)
    packed = pack_blocks(raw, kind, 67)
    small_design = "int8" if "int8" in kernels.block_gemm_designs else kernels.block_gemm
    for rows, design in ((int8_rows, small_design), (int8_rows + 1, kernels.block_gemm)):
        x = torch.randn(rows, 288, generator=torch.Generator().manual_seed(rows))
        assert torch.equal(kernels.gemm_blocks(x, packed, None), kernels.gemm_blocks(x, packed, None, design)), rows


def test_mxfp4_block_gemm_takes_int8_for_every_step_where_it_runs(kernels):
    """MXFP4 blocks, which the AMX design does not read, multiply on the int8 design past the GEMV's pass on every
    CPU where it runs (the plain C build: the GEMV)."""
    raw, _ = gguf_tensor("mxfp4", 67, 288)
    packed = pack_blocks(raw, "mxfp4", 67)
    design = "int8" if "int8" in kernels.block_gemm_designs else "portable"
    for rows in (9, 17, 70):
        x = torch.randn(rows, 288, generator=torch.Generator().manual_seed(rows))
        assert torch.equal(kernels.gemm_blocks(x, packed, None), kernels.gemm_blocks(x, packed, None, design)), rows


def kquant_weight(kind: str, out_features: int, in_features: int, seed: int = 0):
    """A ``q4_k`` or ``q6_k`` weight of the shape, or (``k_mixed``) a Q4_K, Q6_K, Q4_K weight of 19 x 768: the packed
    weight and gguf's float32 values."""
    if kind == "k_mixed":
        return mixed_tensor(seed)
    raw, weight = kquant_tensor(kind, out_features, in_features, seed)
    return pack_blocks(raw, kind, out_features), weight


@pytest.mark.parametrize(("kind", "shape"), K_CASES)
def test_kquant_block_gemm_is_float64_over_what_each_design_multiplies(kernels, kind, shape):
    packed, weight = kquant_weight(kind, *shape)
    for design in kernels.block_gemm_designs:
        for rows in K_ROWS:
            x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows)) * 3
            x[0, 32:64] = 0.0  # an all-zero block of x: scale 0
            bias = torch.randn(weight.shape[0], generator=torch.Generator().manual_seed(7)) if rows % 2 else None
            out = kernels.gemm_blocks(x, packed, bias, design)
            assert out.shape == (rows, weight.shape[0]) and out.dtype == torch.float32
            torch.testing.assert_close(
                out.double(), exact_product(design, x, weight, bias), atol=2e-5, rtol=1e-5, msg=f"{design}, {rows} rows"
            )


@pytest.mark.parametrize("kind", [*K_KINDS, "k_mixed"])
def test_kquant_block_gemm_keeps_the_gemv_for_few_rows_and_takes_its_large_step_design_past_them(kernels, kind):
    """The K-quant GEMV up to 16 rows (12 in AVX2 builds), the large-step design from 17."""
    packed, weight = kquant_weight(kind, 67, 768, seed=1)
    for rows in (9, 12, 17, 40):
        x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows))
        expected = kernels.linear_blocks(x, packed, None) if rows <= 12 else None
        if expected is None:
            expected = kernels.gemm_blocks(x, packed, None, kernels.block_gemm)
        assert torch.equal(kernels.gemm_blocks(x, packed, None), expected), rows


@pytest.mark.parametrize("kind", [*K_KINDS, "k_mixed"])
def test_int8_block_gemm_over_kquants_gives_their_gemvs_sums(kernels, kind):
    """The int8 design unpacks K-quant records into its own layout (Q6_K's two scales a block of 32 included): the
    same int8 products as the K-quant GEMV, summed in another order."""
    if "int8" not in kernels.block_gemm_designs:
        pytest.skip(f"the int8 block GEMM does not run in this {kernels.simd} build")
    packed, weight = kquant_weight(kind, 67, 1536, seed=4) if kind != "k_mixed" else kquant_weight(kind, 19, 768)
    for rows in (9, 33, 70):
        x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows)) * 3
        torch.testing.assert_close(
            kernels.gemm_blocks(x, packed, None, "int8"), kernels.linear_blocks(x, packed, None), atol=1e-4, rtol=1e-5
        )


def test_block_gemm_refuses_what_it_cannot_multiply(kernels):
    raw, _ = gguf_tensor("q4_1", 8, 64)
    packed = pack_blocks(raw, "q4_1", 8)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.gemm_blocks(torch.randn(20, 96), packed, None)
    with pytest.raises(ValueError, match="does not run here"):
        kernels.gemm_blocks(torch.randn(20, 64), packed, None, "tiles")
    with pytest.raises(ValueError, match="packed by pack_blocks"):
        kernels.gemm_blocks(torch.randn(20, 64), type(packed)(packed.data, "q4_k", 8), None)


@pytest.mark.parametrize("build", BLOCK_BUILD_PARAMS)
def test_each_simd_build_of_the_int8_block_gemm_matches_the_portable_c(build, portable_kernels, kernel_build):
    from infer.host import cpu_flags

    needed, flags = BLOCK_BUILDS[build]
    missing = needed - cpu_flags()
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(sorted(missing))} for the {build} block GEMM")
    built = kernel_build([*flags, *without_amx()])
    assert built.simd == build.removesuffix("_vnni") and built.block_gemm == "int8"
    for kind in GEMV_KINDS:
        raw, _ = gguf_tensor(kind, 67, 288, seed=2)
        packed = pack_blocks(raw, kind, 67)
        bias = torch.randn(67)
        for rows in (9, 16, 17, 33, 70):
            x = torch.randn(rows, 288, generator=torch.Generator().manual_seed(rows)) * 3
            torch.testing.assert_close(
                built.gemm_blocks(x, packed, bias),
                portable_kernels.gemm_blocks(x, packed, bias),
                atol=1e-5,
                rtol=1e-5,
                msg=f"{kind}, {rows} rows",
            )
        x = torch.randn(33, 288, generator=torch.Generator().manual_seed(33)).bfloat16()  # widened in C
        for kernels in (built, portable_kernels):
            assert torch.equal(
                kernels.gemm_blocks(x, packed, bias), kernels.gemm_blocks(x.float(), packed, bias).bfloat16()
            )
    for kind in [*K_KINDS, "k_mixed"]:  # the K-quant GEMV and past 16 rows the int8 design, against float64
        packed, weight = kquant_weight(kind, 67, 768, seed=2)
        for rows in (9, 16, 17, 33, 70):
            x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows)) * 3
            torch.testing.assert_close(
                built.gemm_blocks(x, packed, None).double(),
                exact_product("int8", x, weight, None),
                atol=2e-5,
                rtol=1e-5,
                msg=f"{kind}, {rows} rows",
            )


class CountingGemm:
    """``kernels.gemm_blocks`` with one design, counting its calls."""

    def __init__(self, gemm, design: str):
        self.gemm, self.design, self.calls = gemm, design, 0

    def __call__(self, x, weight, bias, design=None):
        self.calls += 1
        return self.gemm(x, weight, bias, self.design)


def float64_product(x, weight, bias, design=None):
    """A block projection in float64 over the dequantized blocks and x as it is: the float model's product."""
    exact = torch.nn.functional.linear(x.double(), dequantize_blocks(weight).double())
    return (exact if bias is None else exact + bias.double()).float()


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm())


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_and_a_32_row_decode_step_give_the_gemvs_logits(kernels, tiny_model_dir, monkeypatch, kind):
    """A paged batch of 32 sequences, prefill then one decode token each (32 rows, past the GEMV's pass), with every
    block projection on the GEMM against the same steps with every projection on the GEMV, and on float64 over the
    dequantized blocks. The int8 design computes the GEMV's products (summed in another order, which can flip an
    int8 activation's rounding downstream: 0.2% apart at the logits where measured). AMX's bf16 tiles round x to
    bf16 where the GEMV rounds it to int8 per block: 2% from the GEMV, and closer to the float model than the GEMV
    (0.7% against 1.8%)."""
    from infer.model.loader import load_model
    from infer.model.quantization import PackedLinear, quantize_model
    from infer.testing.model import PagedRunner

    model = quantize_model(load_model(tiny_model_dir, torch.float32).model, kind)
    assert all(module.blocks is not None for module in model.modules() if isinstance(module, PackedLinear))
    generator = torch.Generator().manual_seed(0)
    prompts = {f"s{i}": torch.randint(0, 1000, (3 + i % 7,), generator=generator).tolist() for i in range(32)}
    gemm = kernels.gemm_blocks

    def run(projection, gemv=None) -> list[torch.Tensor]:
        with monkeypatch.context() as patch:
            patch.setattr(kernels, "gemm_blocks", projection)
            if gemv is not None:
                patch.setattr(kernels, "linear_blocks", gemv)
            runner = PagedRunner(model, kernels=True)
            runner.executor.bf16_gemm_inputs = False  # float32 rows between projections: each design's own rounding
            return run_prefill_and_decode(runner, prompts)

    float_model = run(float64_product, float64_product)
    expected = run(lambda x, weight, bias, design=None: kernels.linear_blocks(x, weight, bias))
    for design in [name for name in kernels.block_gemm_designs if name != "portable"]:
        counting = CountingGemm(gemm, design)
        actual = run(counting)
        assert counting.calls >= 2 * (4 * model.num_layers + 1), design  # every projection, both steps
        for step in range(2):
            error = relative_error(actual[step], expected[step])
            same = float((actual[step].argmax(dim=-1) == expected[step].argmax(dim=-1)).float().mean())
            where = f"{design}, step {step}: relative error {error:.2e}, {same:.0%} same tokens"
            if design == "int8":
                assert error < 5e-3 and same >= 31 / 32, where
            else:
                assert error < 3e-2 and same >= 0.9, where
                from_float = relative_error(actual[step], float_model[step])
                assert from_float < relative_error(expected[step], float_model[step]), f"{where}; {from_float:.2e}"


def run_prefill_and_decode(runner, prompts: dict[str, list[int]]) -> list[torch.Tensor]:
    """The last row's logits of every sequence after its prefill, then after one more token each (the same tokens
    whatever the prefill's logits, so that both runs compute the same step)."""
    prefill = runner.step(prompts)
    decode = runner.step({name: [(7 * len(tokens)) % 1000] for name, tokens in prompts.items()})
    return [torch.stack([logits[-1] for logits in prefill.values()]), torch.cat(list(decode.values()))]


def test_a_block_projection_takes_the_gemm_past_one_gemv_pass(kernels, monkeypatch):
    """A packed projection's inputs of up to one GEMV pass (and ``gemv_rows``) take the GEMV, larger ones the GEMM."""
    from infer.model import Linear
    from infer.model.quantization import PackedLinear

    linear = Linear(64, 40, bias=True)
    torch.nn.init.normal_(linear.weight, std=0.1)
    packed = PackedLinear(linear, "q4_1")
    packed.use_cpu_kernels(kernels, gemv_rows=64)
    calls = []
    monkeypatch.setattr(kernels, "gemm_blocks", lambda *args, **kwargs: calls.append("gemm") or torch.zeros(1))
    monkeypatch.setattr(kernels, "linear_blocks", lambda *args, **kwargs: calls.append("gemv") or torch.zeros(1))
    pass_rows = kernels.block_pass_rows
    for rows in (1, pass_rows, pass_rows + 1, 64):
        packed.block_linear(torch.randn(rows, 64))
    packed.use_cpu_kernels(kernels, gemv_rows=0)
    packed.block_linear(torch.randn(1, 64))
    assert calls == ["gemv", "gemv", "gemm", "gemm", "gemm"]


def amx_kernels(kernels):
    """``kernels``, or a skip where the block GEMM's AMX design (and so its dequantization to bf16) does not run."""
    if "amx-bf16" not in kernels.block_gemm_designs:
        pytest.skip(f"the block GEMM's AMX design needs AMX and AVX512-BF16; this {kernels.simd} build lacks them")
    return kernels


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_dequantized_to_bf16_are_each_weight_rounded_once(kernels, kind):
    amx = amx_kernels(kernels)
    buffer = torch.full((200 * 3040,), float("nan"), dtype=torch.bfloat16)  # reused, larger than any weight here
    for out_features, in_features in SHAPES:
        raw, weight = gguf_tensor(kind, out_features, in_features)
        packed = pack_blocks(raw, kind, out_features)
        assert torch.equal(amx.dequantize_blocks_bf16(packed), weight.bfloat16()), (out_features, in_features)
        assert torch.equal(amx.dequantize_blocks_bf16(packed, buffer), weight.bfloat16()), (out_features, in_features)


@pytest.mark.parametrize(("kind", "shape"), K_CASES)
def test_kquants_dequantized_to_bf16_are_each_weight_rounded_once(kernels, kind, shape):
    packed, weight = kquant_weight(kind, *shape)
    assert torch.equal(amx_kernels(kernels).dequantize_blocks_bf16(packed), weight.bfloat16())


@pytest.mark.parametrize(("kind", "shape"), [*[(kind, (67, 288)) for kind in KINDS], *K_CASES[1::3]])
def test_block_gemm_over_bf16_rows_gives_its_float32_sums_rounded_once(kernels, kind, shape):
    """bf16 rows in, bf16 rows out (a large step's between the GEMMs): every design multiplies what it does for the
    same rows widened, and rounds its sums once."""
    if kind in KINDS:
        raw, _ = gguf_tensor(kind, *shape)
        packed = pack_blocks(raw, kind, shape[0])
    else:
        packed, _ = kquant_weight(kind, *shape)
    bias = torch.randn(shape[0])
    for design in kernels.block_gemm_designs:
        for rows in (1, 9, 17, 33, 70):
            x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows)).bfloat16()
            out = kernels.gemm_blocks(x, packed, bias, design)
            assert out.dtype == torch.bfloat16, design
            expected = kernels.gemm_blocks(x.float(), packed, bias, design).bfloat16()
            assert torch.equal(out, expected), f"{design}, {rows} rows"


def test_a_block_projection_takes_onednn_over_the_dequantized_weight_for_large_steps(kernels, monkeypatch):
    """From ``DENSE_BLOCK_ROWS`` rows on, a block projection multiplies the weight dequantized to bf16 (the values
    the AMX design multiplies) through oneDNN, in the rows' dtype; below, the block GEMM."""
    from infer.model import Linear
    from infer.model.quantization import DENSE_BLOCK_ROWS, PackedLinear, bf16_gemm_available

    amx = amx_kernels(kernels)
    if not bf16_gemm_available():
        pytest.skip("oneDNN's bf16 GEMM needs AVX512-BF16 or AMX in torch's build")
    linear = Linear(96, 67, bias=True)  # infer's Linear leaves its parameters uninitialized
    generator = torch.Generator().manual_seed(0)
    torch.nn.init.normal_(linear.weight, std=0.1, generator=generator)
    torch.nn.init.normal_(linear.bias, generator=generator)
    packed = PackedLinear(linear, "q4_1")
    packed.kernels = amx  # a block weight keeps the kernels loaded when it was built, which another test may swap
    packed.use_cpu_kernels(amx, gemv_rows=8)
    weight = dequantize_blocks(packed.blocks).bfloat16().double()
    dense = []
    original = amx.dequantize_blocks_bf16
    monkeypatch.setattr(amx, "dequantize_blocks_bf16", lambda *args: dense.append(1) or original(*args))
    for rows, dtype in (
        (DENSE_BLOCK_ROWS - 1, torch.float32),
        (DENSE_BLOCK_ROWS, torch.float32),
        (DENSE_BLOCK_ROWS + 5, torch.bfloat16),
    ):
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).to(dtype)
        out = packed(x)
        assert out.dtype == dtype and len(dense) == (rows >= DENSE_BLOCK_ROWS), rows
        exact = x.bfloat16().double() @ weight.T + packed.bias.double()
        # bf16 sums (oneDNN rounds its output, a bf16 bias added) are within 2^-8 of each result
        tolerance = 1e-5 if rows < DENSE_BLOCK_ROWS and dtype == torch.float32 else 1.2e-2
        torch.testing.assert_close(out.double(), exact, atol=tolerance, rtol=tolerance, msg=f"{rows} rows")
        dense.clear()
