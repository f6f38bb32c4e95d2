"""GGUF's block formats as packed weights: ``model.quantization`` ``q4_0``/``q4_1``/``q8_0`` (``q4``, ``q8``) quantize a
float checkpoint, ``gguf`` keeps a GGUF file's own blocks (the default model's ``Q4_1`` projections and ``Q8_0``
output head; a tiny model's ``Q4_K``/``Q6_K`` ones, as a ``Q4_K_M`` file mixes them) and answers as the dequantized
float model does, within the int8 activations' rounding."""

from __future__ import annotations

import copy
import hashlib
import logging
import os

import numpy as np
import pytest
import torch
from test_gguf_file import write_tensors

from infer import LLM, SamplingParams
from infer.kernels.cpu.blocks import dequantize_blocks
from infer.model import Linear
from infer.model.loader import DEFAULT_MODEL, load_model, resolve_model_path
from infer.model.quantization import BLOCK_MODES, PackedLinear, model_weight_bytes, quantize_model, resolve_quantization

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def kernels():
    from infer.kernels import cpu as cpu_kernels

    if cpu_kernels.compiler() is None:
        pytest.skip("the block GEMV needs the CPU kernels (a C compiler)")
    return cpu_kernels.load(True)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm())


@pytest.mark.parametrize(("mode", "tolerance", "bits"), [("q4_0", 0.15, 4.5), ("q4_1", 0.12, 5.0), ("q8_0", 0.02, 8.5)])
def test_block_modes_track_float32_within_their_bits(mode, tolerance, bits):
    torch.manual_seed(0)
    linear = Linear(96, 150, bias=True)
    torch.nn.init.normal_(linear.weight, std=0.1)
    torch.nn.init.normal_(linear.bias)
    packed = PackedLinear(linear, mode)
    assert packed.kernels is not None and packed.weight is None
    # 38 groups of four rows (the last padded) of 3 records: bits / 8 bytes a weight, and the float32 bias
    assert packed.nbytes == 38 * 4 * 96 * bits / 8 + 150 * 4
    for shape in [(1, 96), (7, 96), (2, 3, 96), (70, 96)]:
        x = torch.randn(shape)
        with torch.no_grad():
            expected, actual = linear(x), packed(x)
        assert actual.shape == expected.shape and actual.dtype == torch.float32
        assert 0 < relative_error(actual, expected) < tolerance
        exact = torch.nn.functional.linear(x.double(), dequantize_blocks(packed.blocks).double(), linear.bias.double())
        assert relative_error(actual.double(), exact) < 2e-2  # the int8 activations' rounding only


def test_short_names_and_gguf_resolve():
    assert resolve_quantization("q4", "float32", torch.float32, CPU) == "q4_1"
    assert resolve_quantization("q8", "auto", torch.float32, CPU) == "q8_0"
    assert resolve_quantization("gguf", "auto", torch.float32, CPU) == "gguf"
    assert set(BLOCK_MODES) == {"q4_0", "q4_1", "q8_0", "q4_k", "q6_k", "k_mixed", "mxfp4"}
    with pytest.raises(ValueError, match="unknown model.quantization"):
        resolve_quantization("q4_k", "auto", torch.float32, CPU)  # K-quants come from a GGUF file only


def test_gguf_mode_refuses_a_float_checkpoint_clearly(tiny_model_dir):
    model = load_model(tiny_model_dir, torch.float32).model
    with pytest.raises(ValueError, match="q4 or q8"):
        quantize_model(model, "gguf", resolve_model_path(tiny_model_dir))


@pytest.fixture(scope="module")
def default_model():
    return load_model(DEFAULT_MODEL, torch.float32).model


def test_gguf_keeps_the_files_blocks_which_are_the_float_models_weights(default_model):
    """Every projection of the default model's file is kept as its blocks (Q4_1; the tied output head Q8_0, the
    token embedding's), Q and K rows in HF's order: the blocks dequantize to exactly the float weights transformers
    gave the float model. About 5/32 of float32's bytes in the layers."""
    packed = quantize_model(copy.deepcopy(default_model), "gguf", resolve_model_path(DEFAULT_MODEL))
    float_modules = dict(default_model.named_modules())
    kinds = {}
    for name, module in packed.named_modules():
        if isinstance(module, PackedLinear):
            kinds[module.mode] = kinds.get(module.mode, 0) + 1
            assert module.blocks is not None, name
            assert torch.equal(dequantize_blocks(module.blocks), float_modules[name].weight.float()), name
    assert kinds == {"q4_1": 4 * default_model.num_layers, "q8_0": 1}
    # The tied head is the table; its blocks give back the same values (so it keeps no reference of its own).
    assert packed.lm_head.blocks.kind == "q8_0" and packed.head_weight() is packed.embed_tokens.weight
    assert packed.lm_head.weight is None and torch.equal(packed.lm_head.full_weight(), packed.embed_tokens.weight)
    assert model_weight_bytes(packed.layers) < model_weight_bytes(default_model.layers) * 0.17


@pytest.mark.slow  # 128 positions, each a whole prompt through two models; the other gguf tests stay by default
def test_gguf_greedy_tokens_agree_with_the_dequantized_float_model(default_model):
    """The default model's own Q4_1 blocks against the same values dequantized to float32: the only difference is
    the block GEMV's int8 activations (llama.cpp's arithmetic). Fed the float model's greedy answers (so one
    divergence does not change every later token), the packed model picks the same next token at 122 of 128
    positions where this was measured (q8_0 blocks re-quantized from the float weights: 123, fp16: 128); at least
    90% is asserted. Left to run free, answers part earlier (first divergences at tokens 0, 0, 4 and 17 of 24)."""
    from test_model import PagedPool

    tokenizer = load_model(DEFAULT_MODEL, torch.float32).tokenizer
    packed = quantize_model(copy.deepcopy(default_model), "gguf", resolve_model_path(DEFAULT_MODEL))
    agree = total = 0
    for text in (
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "How do I boil an egg?",
        "Explain gravity to a child.",
    ):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        tokens = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        for _ in range(32):  # the float model's greedy answer
            tokens.append(int(PagedPool(default_model).step({"a": tokens})["a"][-1].argmax()))
        answer = torch.tensor(tokens[len(tokens) - 32 :])
        chosen = PagedPool(packed).step({"a": tokens})["a"][len(tokens) - 33 : -1].argmax(dim=-1)
        agree += int((chosen == answer).sum())
        total += len(answer)
    assert agree >= 0.9 * total, f"{agree}/{total}"


def test_engine_runs_the_gguf_files_blocks():
    llm = LLM(
        "baseline", model__dtype="float32", model__quantization="gguf", model__max_model_len=512, cache__num_blocks=64
    )
    assert llm.engine.quantization == "gguf"
    outputs = llm.generate(
        [[{"role": "user", "content": "What is the capital of France?"}]] * 2,
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
    )
    assert [len(output.token_ids) for output in outputs] == [12, 12]
    assert outputs[0].token_ids == outputs[1].token_ids


@pytest.mark.parametrize("mode", ["q4", "q8"])
@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_engine_runs_with_block_weights(tiny_model_dir, mode, drafter):
    llm = LLM(
        "baseline",
        model__path=tiny_model_dir,
        model__dtype="float32",
        model__quantization=mode,
        model__max_model_len=256,
        cache__num_blocks=128,
        drafter__name=drafter,
    )
    assert llm.engine.quantization == {"q4": "q4_1", "q8": "q8_0"}[mode]
    assert all(module.blocks is not None for module in llm.engine.model.modules() if isinstance(module, PackedLinear))
    outputs = llm.generate(
        ["The tide comes in and the tide goes out"] * 3, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    )
    assert [len(output.token_ids) for output in outputs] == [16] * 3
    assert outputs[0].token_ids == outputs[1].token_ids == outputs[2].token_ids


@pytest.mark.parametrize("mode", ["q4_0", "q8"])
def test_block_weights_join_the_fused_one_call_stack_with_the_same_tokens(tiny_model_dir, mode):
    """Layers whose projections are all blocks run in the fused paths (the C layer calls the block GEMV), and give
    the op-by-op path's greedy tokens (the block GEMV's sums do not depend on how many rows a call takes)."""
    settings = dict(
        model__path=tiny_model_dir,
        model__dtype="float32",
        model__quantization=mode,
        model__max_model_len=256,
        cache__num_blocks=128,
        attention__name="cpu",
    )
    prompts = ["The tide comes in and the tide goes out", "One two three four", "A B C"]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    answers = {}
    for paths in (["fused-stack", "torch"], ["fused-layers", "torch"], ["torch"]):
        llm = LLM("baseline", execution__paths=paths, execution__fused_max_tokens=16, **settings)
        layers = llm.engine.model.layers
        assert all((layer.fused is not None) == (paths[0] != "torch") for layer in layers) or paths == ["torch"]
        answers[paths[0]] = [output.token_ids for output in llm.generate(prompts, params)]
        assert llm.engine.executor.counts[paths[0]] > 0, llm.engine.executor.counts
    assert answers["fused-stack"] == answers["fused-layers"] == answers["torch"]


# A tiny Llama stored as a Q4_K_M file stores it: Q4_K, with V and the down projection Q6_K (so the fused QKV mixes
# both), the tied token embedding Q6_K; and one up projection Q8_0 beside its Q4_K gate, which the block kernels do
# not take together.
TINY_SHAPE = {
    "llama.block_count": 2,
    "llama.embedding_length": 256,
    "llama.feed_forward_length": 512,
    "llama.attention.head_count": 4,
    "llama.attention.head_count_kv": 2,
    "llama.rope.dimension_count": 64,
    "llama.context_length": 2048,
}


KQUANT_FILE_TIME = 1_767_225_600  # a fixed mtime for kquant_gguf's file


def write_kquant_gguf(path, template) -> None:
    """A GGUF file of random weights in TINY_SHAPE with the tokenizer (and the rest of the metadata) of ``template``."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import quantize

    from infer.testing.kquants import QUANTIZERS

    reader = GGUFReader(template)
    writer = GGUFWriter(path, "llama")
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type", *TINY_SHAPE):
            continue
        vtype = field.types[0]
        writer.add_key_value(name, field.contents(), vtype, field.types[-1] if vtype == GGUFValueType.ARRAY else None)
    for name, value in TINY_SHAPE.items():
        writer.add_uint32(name, value)
    generator = np.random.default_rng(0)

    def add(name: str, kind: str, rows: int, columns: int, std: float = 0.05) -> None:
        weight = (generator.standard_normal((rows, columns)) * std).astype(np.float32)
        if kind == "f32":  # a norm's weight
            writer.add_tensor(name, weight[0] + 1.0)
            return
        quantized = QUANTIZERS[kind](weight) if kind in QUANTIZERS else quantize(weight, GGMLQuantizationType.Q8_0)
        writer.add_tensor(name, quantized, raw_dtype=GGMLQuantizationType[kind.upper()])

    hidden, width = TINY_SHAPE["llama.embedding_length"], TINY_SHAPE["llama.feed_forward_length"]
    heads, kv_heads = TINY_SHAPE["llama.attention.head_count"], TINY_SHAPE["llama.attention.head_count_kv"]
    head_dim = TINY_SHAPE["llama.rope.dimension_count"]
    add("token_embd.weight", "q6_k", int(reader.fields["llama.vocab_size"].contents()), hidden, std=0.5)
    add("output_norm.weight", "f32", 1, hidden)
    for layer in range(TINY_SHAPE["llama.block_count"]):
        block = f"blk.{layer}"
        add(f"{block}.attn_norm.weight", "f32", 1, hidden)
        add(f"{block}.ffn_norm.weight", "f32", 1, hidden)
        add(f"{block}.attn_q.weight", "q4_k", heads * head_dim, hidden)
        add(f"{block}.attn_k.weight", "q4_k", kv_heads * head_dim, hidden)
        add(f"{block}.attn_v.weight", "q6_k", kv_heads * head_dim, hidden)
        add(f"{block}.attn_output.weight", "q4_k", hidden, heads * head_dim)
        add(f"{block}.ffn_gate.weight", "q4_k", width, hidden)
        add(f"{block}.ffn_up.weight", "q4_k" if layer == 0 else "q8_0", width, hidden)
        add(f"{block}.ffn_down.weight", "q6_k", hidden, width)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory):
    """The file, named by its bytes' digest and dated at a fixed time: the loader keys the HF folder it converts a
    GGUF file into (in the user's cache) by name, size and mtime, so every run that writes the same bytes finds the
    one folder instead of converting (and leaving) another."""
    written = tmp_path_factory.mktemp("kquants") / "tiny-q4_k_m.gguf"
    write_kquant_gguf(written, resolve_model_path(DEFAULT_MODEL))
    digest = hashlib.sha256(written.read_bytes()).hexdigest()[:12]
    path = written.rename(written.with_name(f"tiny-q4_k_m-{digest}.gguf"))
    os.utime(path, (KQUANT_FILE_TIME, KQUANT_FILE_TIME))
    return path


@pytest.fixture(scope="module")
def kquant_models(kquant_gguf):
    """The tiny file's float model (transformers' dequantized weights), and the same with its blocks kept."""
    float_model = load_model(str(kquant_gguf), torch.float32).model
    return float_model, quantize_model(copy.deepcopy(float_model), "gguf", kquant_gguf)


def test_gguf_keeps_k_quant_blocks_which_are_the_float_models_weights(kquant_gguf, kquant_models, caplog):
    float_model, packed = kquant_models
    float_modules = dict(float_model.named_modules())
    kinds = {}
    for name, module in packed.named_modules():
        if isinstance(module, PackedLinear):
            kinds[name] = module.blocks.kind
            if module.blocks.kind != "q8_0":
                assert torch.equal(dequantize_blocks(module.blocks), float_modules[name].weight.float()), name
    assert kinds == {
        "layers.0.self_attn.qkv_proj": "k_mixed",  # Q and K Q4_K, V Q6_K
        "layers.0.self_attn.o_proj": "q4_k",
        "layers.0.mlp.gate_up_proj": "q4_k",
        "layers.0.mlp.down_proj": "q6_k",
        "layers.1.self_attn.qkv_proj": "k_mixed",
        "layers.1.self_attn.o_proj": "q4_k",
        "layers.1.mlp.gate_up_proj": "q8_0",  # Q4_K beside Q8_0: dequantized, packed as q8_0
        "layers.1.mlp.down_proj": "q6_k",
        "lm_head": "q6_k",  # the tied token embedding's
    }
    with caplog.at_level(logging.WARNING, logger="infer"):
        quantize_model(copy.deepcopy(float_model), "gguf", kquant_gguf)
    assert "Q4_K+Q8_0: 1 (layers.1.mlp.gate_up_proj)" in caplog.text
    assert "Q4_K:" not in caplog.text and "Q6_K" not in caplog.text


@pytest.mark.parametrize("paths", [(), ("fused-stack", "torch"), ("fused-layers", "torch")])
def test_k_quant_logits_match_the_dequantized_float_models(kquant_models, paths):
    """The packed model's logits against the float model's over the same (dequantized) weights, a prompt and then
    single-token steps: op by op, and in the fused C layers (where the mixed QKV's parts run in one call). The
    difference is the int8 activations' rounding."""
    from test_model import PagedPool

    float_model, packed = kquant_models
    tokens = torch.randint(1000, (28,), generator=torch.Generator().manual_seed(0)).tolist()
    logits = {}
    for name, runner in [
        ("float", PagedPool(float_model)),
        ("packed", PagedPool(packed, kernels=True, paths=paths) if paths else PagedPool(packed)),
    ]:
        steps = [runner.step({"a": tokens[:20]})["a"]]
        steps += [runner.step({"a": [token]})["a"] for token in tokens[20:]]  # decode steps: the fused paths' own
        logits[name] = torch.cat(steps)
        if paths and name == "packed":
            assert runner.executor.counts[paths[0]] == 8, runner.executor.counts
    assert relative_error(logits["packed"], logits["float"]) < 2.5e-2
    assert (logits["packed"].argmax(dim=-1) == logits["float"].argmax(dim=-1)).float().mean() >= 0.9


def test_engine_runs_a_k_quant_gguf_file(kquant_gguf):
    llm = LLM(
        "baseline",
        model__path=str(kquant_gguf),
        model__dtype="float32",
        model__quantization="gguf",
        model__max_model_len=256,
        cache__num_blocks=64,
    )
    assert {module.blocks.kind for module in llm.engine.model.modules() if isinstance(module, PackedLinear)} == {
        "k_mixed",
        "q4_k",
        "q6_k",
        "q8_0",
    }
    outputs = llm.generate(
        ["The tide comes in and the tide goes out"] * 2, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    )
    assert [len(output.token_ids) for output in outputs] == [8, 8]
    assert outputs[0].token_ids == outputs[1].token_ids


@pytest.mark.parametrize("path", ["fused-stack", "fused-layers"])
def test_k_quant_prompt_in_the_fused_c_layers_takes_the_block_gemm_as_op_by_op(kquant_models, path):
    """A 20-token prompt (past the 16 rows K-quants keep on their GEMV) through the fused C layers, their token limit
    raised past it: each K-quant projection there takes the block GEMM as op by op does (AMX's bf16 tiles where they
    run), so both give the same logits up to attention's summation order, and stay the float model's. Op by op takes
    the same limit, so that its rows between the projections stay float32 as the C layers' do."""
    from test_model import PagedPool

    float_model, packed = kquant_models
    tokens = torch.randint(1000, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    reference = PagedPool(packed, kernels=True, paths=("torch",))
    reference.executor.set_fused_max_tokens(packed, 32)
    op_by_op = reference.step({"a": tokens})["a"]
    runner = PagedPool(packed, kernels=True, paths=(path, "torch"))
    runner.executor.set_fused_max_tokens(packed, 32)
    fused = runner.step({"a": tokens})["a"]
    assert runner.executor.counts[path] == 1, runner.executor.counts
    assert relative_error(fused, op_by_op) < 1e-3
    assert relative_error(fused, PagedPool(float_model).step({"a": tokens})["a"]) < 2.5e-2


def write_gguf(path, types: dict[str, str]):
    """A GGUF file holding one 8 x 256 tensor per name, stored as the named GGUF type (``F32``, ``Q8_0``, ...)."""
    return write_tensors(path, "llama", [(name, type_name, (8, 256)) for name, type_name in types.items()])


def test_auto_keeps_a_gguf_files_blocks_where_the_block_gemm_runs_on_amx(monkeypatch, tmp_path):
    """``model.quantization: auto`` keeps a GGUF file's blocks where every projection of its layers is stored as
    blocks and the block GEMM runs on AMX beside oneDNN's bf16 GEMM; a float file, a folder, other CPUs and an explicit
    float32 keep what they had."""
    from types import SimpleNamespace

    from infer.model import quantization

    monkeypatch.setattr(quantization, "bf16_gemm_available", lambda: True)
    amx, int8 = SimpleNamespace(block_gemm="amx-bf16"), SimpleNamespace(block_gemm="int8")
    blocks = write_gguf(tmp_path / "blocks.gguf", {"blk.0.attn_q.weight": "Q4_0", "blk.0.ffn_down.weight": "Q8_0"})
    mixed = write_gguf(tmp_path / "mixed.gguf", {"blk.0.attn_q.weight": "Q8_0", "blk.0.ffn_down.weight": "F32"})
    default = resolve_model_path(DEFAULT_MODEL)  # Q4_1 projections
    for path in (blocks, default):
        assert resolve_quantization("auto", "auto", torch.float32, CPU, path, amx) == "gguf", path
        assert resolve_quantization("auto", "auto", torch.float32, CPU, path, int8) == "bf16", path
        assert resolve_quantization("auto", "auto", torch.float32, CPU, path, None) == "bf16", path
        assert resolve_quantization("auto", "float32", torch.float32, CPU, path, amx) == "none", path
    assert resolve_quantization("auto", "auto", torch.float32, CPU, mixed, amx) == "bf16"
    assert resolve_quantization("auto", "auto", torch.float32, CPU, tmp_path, amx) == "bf16"  # not a .gguf file
    monkeypatch.setattr(quantization, "bf16_gemm_available", lambda: False)
    assert resolve_quantization("auto", "auto", torch.float32, CPU, default, amx) == "fp16"


def test_weights_beside_a_gguf_files_blocks_are_packed_as_q8_0():
    """A drafter's own weights beside a ``gguf`` target (an EAGLE head, a draft model) have no blocks in the file:
    they are packed as ``q8_0``, as the file's projections stored otherwise are."""
    from infer.model.quantization import projection, quantize_linears

    torch.manual_seed(0)
    module = torch.nn.Sequential(Linear(64, 40, bias=False))
    assert quantize_linears(module, "gguf")[0].mode == "q8_0"
    assert projection(torch.randn(40, 64), "gguf").mode == "q8_0"
