"""``model.quantization``: packed fp16/int8/w8a8 weights give the float32 model's results within their precision, the
``auto`` rule picks them only where it should, and the engine runs, sizes its pool and drafts with them."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

from infer import LLM, SamplingParams
from infer.model import Linear, quantization
from infer.model.loader import load_model
from infer.model.quantization import (
    PackedLinear,
    dequantize_int8,
    fbgemm_available,
    int8_weights,
    model_weight_bytes,
    quantize_linears,
    quantize_model,
    resolve_quantization,
)

pytestmark = pytest.mark.skipif(not fbgemm_available(), reason="needs torch's fbgemm (x86 CPU build)")
CPU = torch.device("cpu")


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm())


@pytest.mark.parametrize(
    ("mode", "tolerance"), [("fp16", 1e-3), ("bf16", 1e-2), ("int8", 2e-2), ("int8_per_row", 2e-2), ("w8a8", 5e-2)]
)
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_float32_within_its_precision(mode, tolerance, bias):
    torch.manual_seed(0)
    linear = Linear(96, 160, bias=bias)
    torch.nn.init.normal_(linear.weight, std=0.1)
    if bias:
        torch.nn.init.normal_(linear.bias)
    packed = PackedLinear(linear, mode)
    for shape in [(1, 96), (7, 96), (2, 3, 96)]:
        x = torch.randn(shape)
        with torch.no_grad():
            expected = linear(x)
            actual = packed(x)
        assert actual.shape == expected.shape and actual.dtype == torch.float32
        assert 0 < relative_error(actual, expected) < tolerance
    assert packed.weight is None  # the float32 copy is dropped unless shared
    assert packed.nbytes < linear.weight.numel() * 4


@pytest.mark.parametrize("mode", ["fp16", "int8", "int8_per_row", "w8a8"])
def test_packed_linear_takes_the_bf16_rows_of_a_large_step_beside_bf16_weights(mode):
    """A large step over a bf16 model hands its projections bf16 rows (``StepOps.gemm_dtype``); a module packed
    otherwise (an EAGLE head beside that target) multiplies their float32 widening and answers in float32."""
    torch.manual_seed(0)
    linear = Linear(96, 160, bias=True)
    torch.nn.init.normal_(linear.weight, std=0.1)
    torch.nn.init.normal_(linear.bias)
    packed = PackedLinear(linear, mode)
    rows = torch.randn(300, 96).to(torch.bfloat16)
    with torch.no_grad():
        out = packed(rows)
        assert out.dtype == torch.float32
        assert torch.equal(out, packed(rows.float()))


@pytest.mark.parametrize("bias", [False, True])
def test_tile_fma_multiplies_float32_rows_by_the_bf16_weights_beyond_the_gemv(bias):
    """``tile_fma``: every input the GEMV does not take, whatever its rows, is float32 rows times the bf16 weights'
    values (the tiles' FMAs: float64's product up to the sums' order); the GEMV's rows are unchanged; oneDNN's copy is
    dropped and its bytes with it, and comes back when the kernels are undone."""
    from infer.kernels import cpu as cpu_kernels

    if cpu_kernels.compiler() is None:
        pytest.skip("the CPU kernels need a C compiler")
    kernels = cpu_kernels.load(True)
    if not (kernels.tile_fma and kernels.tiles):
        pytest.skip(f"the tiles' FMAs need an AVX-512 build with tiles (these: {kernels.simd}, {kernels.tiles})")
    torch.manual_seed(0)
    linear = Linear(96, 160, bias=bias)
    torch.nn.init.normal_(linear.weight, std=0.1)
    if bias:  # infer's Linear leaves its parameters uninitialized: whatever memory held, NaN included
        torch.nn.init.normal_(linear.bias)
    rounded = linear.weight.detach().bfloat16().double()
    bias_values = None if linear.bias is None else linear.bias.detach().double()
    plain, fma = PackedLinear(linear, "bf16"), PackedLinear(linear, "bf16")
    plain.use_cpu_kernels(kernels, 8)
    fma.use_cpu_kernels(kernels, 8, tile_fma=True)
    assert fma.tile_fma and not plain.tile_fma
    # One copy either way, the tiles: oneDNN's GEMM reads them unpacked for large steps without tile_fma.
    one_copy = PackedLinear(linear, "bf16").nbytes  # oneDNN's copy alone, before the kernels
    assert fma.packed is None and plain.packed is None and fma.nbytes == plain.nbytes == one_copy
    few = torch.randn(3, 96)
    with torch.no_grad():
        assert torch.equal(fma(few), plain(few))
        for rows in (9, 64, 300):  # 300: beyond TILE_MAX_ROWS, oneDNN's range without tile_fma (but on AMX)
            x = torch.randn(rows, 96)
            exact = torch.nn.functional.linear(x.double(), rounded, bias_values)
            torch.testing.assert_close(fma(x).double(), exact, atol=2e-5, rtol=1e-5)
        fma.use_cpu_kernels(None)
        x = torch.randn(300, 96)
        assert fma.packed is not None and not fma.tile_fma and fma.nbytes == PackedLinear(linear, "bf16").nbytes
        assert relative_error(fma(x), linear(x)) < 1e-2


def test_auto_packs_16_bit_weights_only_for_float32_reached_through_dtype_auto(monkeypatch):
    monkeypatch.setattr(quantization, "bf16_gemm_available", lambda: False)
    assert resolve_quantization("auto", "auto", torch.float32, CPU) == "fp16"
    monkeypatch.setattr(quantization, "bf16_gemm_available", lambda: True)  # AVX512-BF16 / AMX
    assert resolve_quantization("auto", "auto", torch.float32, CPU) == "bf16"
    assert resolve_quantization("auto", "float32", torch.float32, CPU) == "none"  # asked for exact float32
    assert resolve_quantization("auto", "auto", torch.bfloat16, CPU) == "none"  # a bfloat16 run (ARM, CUDA)
    assert resolve_quantization("auto", "auto", torch.float32, torch.device("cuda")) == "none"
    assert resolve_quantization("int8", "float32", torch.float32, CPU) == "int8"
    assert resolve_quantization("w8a8", "float32", torch.float32, CPU) == "w8a8"


@pytest.mark.parametrize(
    ("name", "dtype", "device", "message"),
    [
        ("int8", torch.bfloat16, CPU, "model.dtype=float32"),
        ("fp16", torch.float32, torch.device("cuda"), "fbgemm"),
        ("int4", torch.float32, CPU, "choose one of auto, none, fp16, bf16, int8, int8_per_row, w8a8"),
    ],
)
def test_unusable_quantization_is_refused_clearly(name, dtype, device, message):
    with pytest.raises(ValueError, match=message):
        resolve_quantization(name, "float32", dtype, device)


@pytest.mark.parametrize("mode", ["fp16", "bf16", "int8", "int8_per_row", "w8a8"])
def test_packed_model_logits_track_float32(tiny_model_dir, mode):
    from test_model import PagedPool, random_tokens

    model = load_model(tiny_model_dir, torch.float32).model
    packed = quantize_model(copy.deepcopy(model), mode)
    assert not any(isinstance(module, Linear) for module in packed.modules())
    assert packed.lm_head.weight is packed.embed_tokens.weight  # kept for drafters that slice the head
    # Layers shrink; the head's packed copy is counted beside the float32 table it shares with the embedding.
    assert model_weight_bytes(packed.layers) < model_weight_bytes(model.layers) * (0.3 if mode == "w8a8" else 0.6)
    assert model_weight_bytes(packed) > model_weight_bytes(model)
    tokens = random_tokens(24, seed=1, vocab_size=model.vocab_size)
    expected = PagedPool(model).step({"a": tokens})["a"]
    actual = PagedPool(packed).step({"a": tokens})["a"]
    assert (
        relative_error(actual, expected)
        < {"fp16": 2e-3, "bf16": 2e-2, "int8": 0.05, "int8_per_row": 0.05, "w8a8": 0.1}[mode]
    )


def test_int8_weights_times_their_scales_are_exact_in_fp16():
    """So fbgemm's fp16 GEMM (large steps) and the int8 GEMV (a few rows) multiply by the same weights."""
    torch.manual_seed(0)
    weight = torch.randn(64, 96) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different sizes
    weight[:, 32:64] *= 0.1  # and groups within a row (the smallest group's largest weight still above 1e-5)
    quantized, scales = int8_weights(weight)
    assert quantized.dtype == torch.int8 and scales.shape == (64, 3) and int(quantized.abs().max()) <= 127
    dequantized = dequantize_int8(quantized, scales)
    assert torch.equal(dequantized.half().float(), dequantized)
    step = scales.repeat_interleave(32, dim=1)
    assert bool(((weight - dequantized).abs() <= step / 2 + 1e-12).all())  # within half a step
    largest = weight.view(64, 3, 32).abs().amax(dim=2)
    assert bool((scales <= largest / 127 * (1 + 1 / 8)).all())  # at most 1/8 coarser than absmax / 127
    with pytest.raises(ValueError, match="% 32"):
        int8_weights(torch.randn(4, 48))
    quantized, scales = int8_weights(weight, group=96)  # one scale per row
    assert scales.shape == (64, 1) and torch.equal(
        dequantize_int8(quantized, scales).half().float(), dequantize_int8(quantized, scales)
    )


def test_int8_refuses_layers_it_cannot_group_clearly():
    with pytest.raises(ValueError, match="in_features % 32"):
        PackedLinear(Linear(48, 8), "int8")


def test_quantize_linears_with_none_changes_nothing():
    layer = torch.nn.Sequential(Linear(4, 4))
    assert isinstance(quantize_linears(layer, "none")[0], Linear)


@pytest.mark.parametrize("mode", ["fp16", "bf16", "int8", "int8_per_row"])
@pytest.mark.parametrize("drafter", ["none", "ngram", "model"])
def test_engine_runs_with_packed_weights(tiny_model_dir, drafter, mode):
    overrides = dict(
        model__path=tiny_model_dir,
        model__dtype="float32",
        model__quantization=mode,
        model__max_model_len=256,
        cache__num_blocks=128,
        drafter__name=drafter,
    )
    if drafter == "model":
        overrides["drafter__layers"] = 1
    llm = LLM("baseline", **overrides)
    assert llm.engine.quantization == mode
    outputs = llm.generate(
        ["The tide comes in and the tide goes out"] * 3, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    )
    assert [len(output.token_ids) for output in outputs] == [16] * 3
    assert outputs[0].token_ids == outputs[1].token_ids == outputs[2].token_ids


@pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="torch.compile on CPU needs a C++ compiler"
)
def test_compiled_feed_forward_gives_the_same_greedy_tokens(tiny_model_dir):
    settings = dict(model__path=tiny_model_dir, model__dtype="float32", model__max_model_len=256, cache__num_blocks=64)
    prompts = ["The tide comes in and the tide goes out", "One two three four"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = [output.token_ids for output in LLM("baseline", **settings).generate(prompts, params)]
    compiled = LLM("baseline", model__compile=True, **settings)
    assert all(hasattr(layer.feed_forward, "_torchdynamo_orig_callable") for layer in compiled.engine.model.layers)
    assert [output.token_ids for output in compiled.generate(prompts, params)] == expected


def test_packed_bf16_valued_tables_are_held_in_bf16_with_the_same_logits(tiny_model_dir, bf16_valued_model_dir):
    """A packed model whose embedding table (tied to the head) holds bf16 values keeps it in bf16, tied, half the
    bytes, and its logits are the float32 table's bit for bit; a table of other values stays float32."""
    from test_model import PagedPool, random_tokens

    model = load_model(bf16_valued_model_dir, torch.float32).model
    wide = copy.deepcopy(model)
    wide = quantize_linears(wide, "fp16", frozenset({id(wide.lm_head.weight)}))  # packed, the table as it was
    narrow = quantization.narrow_float_tables(copy.deepcopy(wide))
    table = narrow.embed_tokens.weight
    assert table.dtype == torch.bfloat16 and narrow.lm_head.weight is table
    assert torch.equal(table.float(), wide.embed_tokens.weight)
    assert model_weight_bytes(narrow) == model_weight_bytes(wide) - table.numel() * 2
    tokens = random_tokens(24, seed=1, vocab_size=model.vocab_size)
    assert torch.equal(PagedPool(narrow).step({"a": tokens})["a"], PagedPool(wide).step({"a": tokens})["a"])
    assert quantize_model(copy.deepcopy(model), "fp16").embed_tokens.weight.dtype == torch.bfloat16
    assert quantize_model(copy.deepcopy(model), "none").embed_tokens.weight.dtype == torch.float32
    random_valued = load_model(tiny_model_dir, torch.float32).model
    assert quantize_model(random_valued, "fp16").embed_tokens.weight.dtype == torch.float32


def test_bf16_held_tables_change_no_token_of_a_run_with_eagle_drafting(bf16_valued_model_dir, monkeypatch):
    """The engine over a packed bf16-valued checkpoint, with eagle drafting (which slices the head's rows) and a
    prompt through chunked prefill: the same greedy tokens with the tables held in bf16 as in float32."""
    from test_spec_decode import greedy, make_llm

    prompts = [list(range(100, 170)), [42] * 5, list(range(900, 930)) * 2]
    settings = {
        "model__quantization": "fp16",
        "drafter__name": "eagle",
        "drafter__head": "random",
        "scheduler__max_num_batched_tokens": 32,
    }

    def run() -> tuple[torch.dtype, list[list[int]]]:
        llm = make_llm(bf16_valued_model_dir, **settings)
        held = llm.engine.model.embed_tokens.weight.dtype
        return held, [output.token_ids for output in llm.generate(prompts, greedy(12))]

    held, narrow = run()
    monkeypatch.setattr(quantization, "narrow_float_tables", lambda model: model)
    held_wide, wide = run()
    assert (held, held_wide) == (torch.bfloat16, torch.float32) and narrow == wide


def bf16_checkpoint(destination, tied: bool) -> str:
    """A tiny model saved as a bf16 checkpoint (every tensor bf16), its head tied to the embedding or its own."""
    from infer.testing.model import save_in_bf16
    from infer.testing.models import make_tiny_model_dir

    return str(save_in_bf16(make_tiny_model_dir(destination, seed=3, num_hidden_layers=2, tie_word_embeddings=tied)))


@pytest.mark.parametrize("tied", [True, False])
def test_a_packed_load_holds_a_bf16_checkpoints_matrices_as_read(tmp_path, tiny_model_dir, tied):
    """``bf16_weights`` makes the checkpoint's bf16 tensors the model's tables (tied stays tied) and linear weights
    (fused ones concatenated), never a float32 copy; norms stay float32. Packed every way, its logits are those of
    the float32 load, bit for bit. A float32 checkpoint's weights stay float32."""
    from test_model import PagedPool, random_tokens

    model_dir = bf16_checkpoint(tmp_path / "tiny", tied)
    wide = load_model(model_dir, torch.float32).model
    held = load_model(model_dir, torch.float32, bf16_weights=True).model
    for name, parameter in wide.named_parameters():
        kept = held.get_parameter(name)
        assert kept.dtype == (torch.bfloat16 if parameter.dim() == 2 else torch.float32), name
        assert parameter.dtype == torch.float32 and torch.equal(kept.float(), parameter), name
    assert (held.lm_head.weight is held.embed_tokens.weight) == tied
    tokens = random_tokens(24, seed=1, vocab_size=wide.vocab_size)
    for mode in ("bf16", "q4_1", "fp16"):
        wide_logits, held_logits = (
            PagedPool(quantize_model(copy.deepcopy(model), mode)).step({"a": tokens})["a"] for model in (wide, held)
        )
        assert torch.equal(held_logits, wide_logits), mode
    float32 = load_model(tiny_model_dir, torch.float32, bf16_weights=True).model
    assert {parameter.dtype for parameter in float32.parameters()} == {torch.float32}


def test_a_bf16_output_head_is_held_once_and_given_back_exactly(tmp_path, kernels):
    """An untied bf16 head packed as bf16 keeps no weight beside its packed copy (one copy's bytes fewer than the
    head packed from float32, which keeps its weight); ``head_weight`` gives the checkpoint's tensor back from oneDNN's
    layout or the tiles, and eagle slices its rows from it. Blocks give back their values; fp16 keeps the weight; a
    tied head is the table."""
    from safetensors.torch import load_file

    from infer.kernels.cpu.blocks import dequantize_blocks
    from infer.plugins.drafters.eagle.head import draft_head_weight

    model_dir = bf16_checkpoint(tmp_path / "untied", tied=False)
    (checkpoint,) = (load_file(path)["lm_head.weight"] for path in (tmp_path / "untied").glob("*.safetensors"))
    model = quantize_model(load_model(model_dir, torch.float32, bf16_weights=True).model, "bf16")
    assert model.lm_head.weight is None and torch.equal(model.head_weight(), checkpoint)
    from_float32 = quantize_model(load_model(model_dir, torch.float32).model, "bf16")
    assert model_weight_bytes(model) == model_weight_bytes(from_float32) - checkpoint.numel() * 2
    model.use_cpu_kernels(kernels)  # tiles where the CPU has them: then the one copy
    assert torch.equal(model.head_weight(), checkpoint)
    ids = torch.tensor([5, 0, 77])
    assert torch.equal(draft_head_weight(model, ids), checkpoint[ids].float())
    fp16 = quantize_model(load_model(model_dir, torch.float32, bf16_weights=True).model, "fp16")
    assert fp16.lm_head.weight is not None and torch.equal(fp16.head_weight(), checkpoint)
    q4 = quantize_model(load_model(model_dir, torch.float32, bf16_weights=True).model, "q4_1")
    assert q4.lm_head.weight is None and torch.equal(q4.head_weight(), dequantize_blocks(q4.lm_head.blocks))
    assert relative_error(q4.head_weight(), checkpoint.float()) < 0.1  # 4-bit blocks of the checkpoint's head
    tied = load_model(bf16_checkpoint(tmp_path / "tied", tied=True), torch.float32, bf16_weights=True).model
    tied = quantize_model(tied, "bf16")
    assert tied.head_weight() is tied.embed_tokens.weight


@pytest.mark.parametrize("tied", [True, False])
def test_the_start_estimate_of_packed_weights_is_what_the_packed_model_holds(tmp_path, tied):
    """``packed_weight_bytes`` over the checkpoint's headers (``checkpoint_matrices``) against the packed model's
    bytes: within the norms' share (left out) for bf16 and q4_1."""
    from pathlib import Path

    from infer.model.loader import checkpoint_matrices
    from infer.model.quantization import packed_weight_bytes

    model_dir = bf16_checkpoint(tmp_path / "tiny", tied)
    counts = checkpoint_matrices(Path(model_dir))
    assert (counts.table_dtype, counts.tied) == ("BF16", tied)
    for mode in ("bf16", "q4_1"):
        model = quantize_model(load_model(model_dir, torch.float32, bf16_weights=True).model, mode)
        held = model_weight_bytes(model)
        estimate = packed_weight_bytes(mode, counts.matrices, counts.table, 2, counts.tied)
        assert 0.97 * held <= estimate <= held, (mode, estimate, held)
    assert packed_weight_bytes("fp16", counts.matrices, counts.table, 2, counts.tied) is None
    if tied:  # a tied checkpoint that also carries the head's copy (the load ignores it) counts alike
        from safetensors.torch import load_file, save_file

        (path,) = Path(model_dir).glob("*.safetensors")
        tensors = load_file(path)
        save_file({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"].clone()}, path)
        assert checkpoint_matrices(Path(model_dir)) == counts


def test_a_start_says_when_the_weights_will_not_fit_the_memory_available(tmp_path, monkeypatch, caplog):
    """One warning line before the weights are read, naming the estimate, the memory available and what q4 weights
    would take; none where they fit."""
    from infer.execution import paths

    model_dir = bf16_checkpoint(tmp_path / "tiny", tied=False)
    monkeypatch.setattr("infer.host.available_memory", lambda: 1 << 20)
    with caplog.at_level("WARNING", logger="infer.execution"):
        paths.warn_if_memory_is_short(model_dir, "bf16", torch.float32)
    (record,) = caplog.records
    assert "weights take about" in record.message and "as bf16 weights" in record.message
    assert "model.quantization=q4 would hold about" in record.message
    caplog.clear()
    monkeypatch.setattr("infer.host.available_memory", lambda: 1 << 40)
    with caplog.at_level("WARNING", logger="infer.execution"):
        paths.warn_if_memory_is_short(model_dir, "bf16", torch.float32)
    assert not caplog.records
    # A mode it does not estimate (fp16, the int8 modes, a GGUF file's blocks) reads no header.
    monkeypatch.setattr("infer.host.available_memory", lambda: 1 << 20)
    monkeypatch.setattr("infer.model.loader.checkpoint_matrices", lambda *args: pytest.fail("headers read"))
    for mode in ("fp16", "int8", "gguf"):
        paths.warn_if_memory_is_short(model_dir, mode, torch.float32)
    assert not caplog.records
