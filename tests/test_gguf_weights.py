"""A GGUF file's weights read by infer itself (``infer.model.gguf_weights.GgufTensors``), a tensor at a time: the
float values transformers' conversion gives, bit for bit (Llama's permuted Q and K rows, K-quants, a Qwen3-MoE file's
stacked experts), and with ``model.quantization: gguf`` each layer packed as the file's blocks as soon as it is
read."""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path

import numpy as np
import pytest
import test_gpt_oss  # its suites by module too
import test_model_families  # its suites by module: names imported here would be collected again
import torch
from test_block_quantization import KQUANT_FILE_TIME, relative_error, write_kquant_gguf
from torch import nn

from infer.kernels.cpu.blocks import dequantize_blocks
from infer.model.gguf_blocks import read_projections, stores_blocks
from infer.model.loader import (
    DEFAULT_MODEL,
    checkpoint_matrices,
    hf_checkpoint_dir,
    hf_model_dir,
    load_model,
    resolve_model_path,
)
from infer.model.quantization import PackedLinear

# A Qwen3-MoE file's shape, every layer sparse. Its experts' width is transformers' default moe_intermediate_size
# (768): transformers' GGUF config mapping does not read expert_feed_forward_length, and its conversion is the oracle.
# Its hidden size is one K-quant super-block (256 columns), for the layer whose experts are K-quants.
MOE_SHAPE = {
    "block_count": 2,
    "embedding_length": 256,
    "feed_forward_length": 128,
    "attention.head_count": 4,
    "attention.head_count_kv": 2,
    "attention.key_length": 16,
    "attention.value_length": 16,
    "context_length": 512,
    "expert_count": 8,
    "expert_used_count": 2,
}
MOE_WIDTH = 768
# A Gemma 3 file's shape: two sliding-window layers, K-quant attention (256 columns).
GEMMA3_SHAPE = {
    "block_count": 2,
    "embedding_length": 256,
    "feed_forward_length": 512,
    "attention.head_count": 4,
    "attention.head_count_kv": 2,
    "attention.key_length": 64,
    "attention.value_length": 64,
    "context_length": 512,
    "attention.sliding_window": 16,
}


@pytest.fixture(scope="module", autouse=True)
def kernels():
    from infer.kernels import cpu as cpu_kernels

    if cpu_kernels.compiler() is None:
        pytest.skip("the block kernels need a C compiler")
    return cpu_kernels.load(True)


def write_tiny_gguf(path, template, arch: str, metadata: dict, seed: int, tensors) -> None:
    """A GGUF file of architecture ``arch`` with ``metadata`` as its ``{arch}.*`` values (``tokenizer.*`` keys as they
    are; an int as uint32, a float as float32, a string; an epsilon and a RoPE base unless given) and the tokenizer of
    ``template``;
    ``tensors(add, vocab)`` adds its tensors,
    ``add(name, kind, *shape, std=0.1)`` a random one of GGUF type ``kind`` (K-quants by ``infer.testing.kquants``, a
    stacked tensor by rows; an ``F32`` norm around 1), or with ``values=`` those (float32 values, else the type's
    bytes)."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import quantize

    from infer.testing.kquants import QUANTIZERS

    reader = GGUFReader(template)
    writer = GGUFWriter(path, arch)
    for name, field in reader.fields.items():
        if name.startswith(("GGUF.", "llama.")) or name in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        writer.add_key_value(name, field.contents(), vtype, field.types[-1] if vtype == GGUFValueType.ARRAY else None)
    for name, value in {"attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 1_000_000.0, **metadata}.items():
        add_value = {int: writer.add_uint32, float: writer.add_float32, str: writer.add_string}[type(value)]
        add_value(name if name.startswith("tokenizer.") else f"{arch}.{name}", value)
    generator = np.random.default_rng(seed)

    def add(name: str, kind: str, *dims: int, std: float = 0.1, values: np.ndarray | None = None) -> None:
        if values is not None:  # float32 values, or a type's bytes
            if kind == "F32":
                writer.add_tensor(name, np.ascontiguousarray(values, dtype=np.float32))
            else:
                writer.add_tensor(name, values, raw_dtype=GGMLQuantizationType[kind])
            return
        weight = (generator.standard_normal(dims) * std).astype(np.float32)
        if kind == "F32":
            writer.add_tensor(name, weight + (1.0 if name.endswith("norm.weight") else 0.0))
            return
        qtype = GGMLQuantizationType[kind]
        if kind.lower() in QUANTIZERS:  # by rows, the experts' stacked back
            raw = QUANTIZERS[kind.lower()](weight.reshape(-1, dims[-1])).reshape(*dims[:-1], -1)
        else:
            raw = quantize(weight, qtype)
        writer.add_tensor(name, raw, raw_dtype=qtype)

    tensors(add, int(reader.fields["llama.vocab_size"].contents()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_attention(add, block: str, shape: dict[str, int], kinds: tuple[str, str, str, str]) -> None:
    """A layer's q/k norms and its Q, K, V and output projections, of GGUF types ``kinds`` in that order, random, in
    ``shape`` (a tiny file's metadata)."""
    hidden, head_dim = shape["embedding_length"], shape["attention.key_length"]
    heads, kv_heads = shape["attention.head_count"], shape["attention.head_count_kv"]
    for norm in ("attn_q_norm", "attn_k_norm"):
        add(f"{block}.{norm}.weight", "F32", head_dim)
    q, k, v, output = kinds
    add(f"{block}.attn_q.weight", q, heads * head_dim, hidden)
    add(f"{block}.attn_k.weight", k, kv_heads * head_dim, hidden)
    add(f"{block}.attn_v.weight", v, kv_heads * head_dim, hidden)
    add(f"{block}.attn_output.weight", output, hidden, heads * head_dim)


def write_moe_gguf(path, template) -> None:
    """A Qwen3-MoE GGUF file of random weights in MOE_SHAPE, its experts stacked as llama.cpp writes them (layer 0:
    gate and up ``Q4_0``, down ``Q8_0``; layer 1 as a ``Q4_K_M`` file stores them: gate and up ``Q4_K``, down
    ``Q6_K``), with the tokenizer of ``template``."""
    hidden, experts = MOE_SHAPE["embedding_length"], 8

    def tensors(add, vocab: int) -> None:
        add("token_embd.weight", "Q8_0", vocab, hidden, std=0.5)
        add("output.weight", "Q8_0", vocab, hidden)
        add("output_norm.weight", "F32", hidden)
        for layer in range(MOE_SHAPE["block_count"]):
            block = f"blk.{layer}"
            for norm in ("attn_norm", "ffn_norm"):
                add(f"{block}.{norm}.weight", "F32", hidden)
            add_attention(add, block, MOE_SHAPE, ("Q4_0", "Q4_0", "Q4_0", "Q8_0"))
            add(f"{block}.ffn_gate_inp.weight", "F32", experts, hidden, std=1.0)
            gate_up, down = ("Q4_0", "Q8_0") if layer == 0 else ("Q4_K", "Q6_K")
            add(f"{block}.ffn_gate_exps.weight", gate_up, experts, MOE_WIDTH, hidden)
            add(f"{block}.ffn_up_exps.weight", gate_up, experts, MOE_WIDTH, hidden)
            add(f"{block}.ffn_down_exps.weight", down, experts, hidden, MOE_WIDTH)

    write_tiny_gguf(path, template, "qwen3moe", MOE_SHAPE, 1, tensors)


def write_gemma3_gguf(path, template) -> None:
    """A Gemma 3 GGUF file of random weights in GEMMA3_SHAPE as llama.cpp writes one: four norms a layer and the q/k
    norms, each stored as ``1 + w``; the output head tied to the embedding; Q and K ``Q4_K``, V ``Q6_K``, gate and up
    ``Q4_0``, down ``Q8_0``; with the tokenizer of ``template``."""
    hidden, width = GEMMA3_SHAPE["embedding_length"], GEMMA3_SHAPE["feed_forward_length"]

    def tensors(add, vocab: int) -> None:
        add("token_embd.weight", "Q8_0", vocab, hidden, std=0.5)
        add("output_norm.weight", "F32", hidden)
        for layer in range(GEMMA3_SHAPE["block_count"]):
            block = f"blk.{layer}"
            for norm in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
                add(f"{block}.{norm}.weight", "F32", hidden)
            add_attention(add, block, GEMMA3_SHAPE, ("Q4_K", "Q4_K", "Q6_K", "Q4_K"))
            add(f"{block}.ffn_gate.weight", "Q4_0", width, hidden)
            add(f"{block}.ffn_up.weight", "Q4_0", width, hidden)
            add(f"{block}.ffn_down.weight", "Q8_0", hidden, width)

    write_tiny_gguf(path, template, "gemma3", GEMMA3_SHAPE, 2, tensors)


def shape_metadata(config) -> dict:
    """The metadata llama.cpp's converter writes for every architecture, from a HF config."""
    return {
        "context_length": config.max_position_embeddings,
        "embedding_length": config.hidden_size,
        "block_count": config.num_hidden_layers,
        "feed_forward_length": config.intermediate_size,
        "attention.head_count": config.num_attention_heads,
        "attention.head_count_kv": config.num_key_value_heads,
        "attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
    }


def write_converted_gguf(folder: Path, path, template, arch: str, metadata: dict, kind: str, extra=None) -> None:
    """The HF folder ``folder`` written as a GGUF file of ``arch`` as llama.cpp's converter writes it: each tensor
    under the gguf package's name for it, every matrix as ``kind`` (``F32``: the folder's values exactly), Gemma's norm
    weights as the ``1 + w`` applied; ``metadata`` as ``write_tiny_gguf`` takes it, ``extra(add)`` adds tensors of the
    converter's own; the tokenizer of ``template``."""
    import gguf
    from gguf.quants import quantize
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    arch_id = {name: value for value, name in gguf.MODEL_ARCH_NAMES.items()}[arch]
    names = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)

    def tensors(add, vocab: int) -> None:
        for name, tensor in load_file(folder / "model.safetensors").items():
            values = tensor.float().numpy()
            gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
            if arch == "gemma3" and name.endswith("norm.weight"):
                values = values + 1.0
            heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}.get(
                name.split(".")[-2]
            )
            if arch == "llama" and heads:  # llama.cpp's interleaved rotary pairs
                values = values.reshape(heads, 2, -1, values.shape[-1]).swapaxes(1, 2).reshape(values.shape)
            if kind == "F32" or values.ndim == 1:
                add(gguf_name, "F32", values=values)
            else:
                add(gguf_name, kind, values=quantize(values, gguf.GGMLQuantizationType[kind]))
        if extra is not None:
            extra(add)

    write_tiny_gguf(path, template, arch, metadata, 0, tensors)


def write_phi3_gguf(folder: Path, path, template, kind: str = "F32") -> None:
    """The HF Phi-3 folder ``folder`` as llama.cpp's converter writes it (``Phi3MiniModel``): fused QKV and gate/up as
    they are, the rotated dimensions a head as ``rope.dimension_count``, the sliding window, LongRoPE's original
    context and attention factor as metadata and its factors as the tensors ``rope_factors_long`` and
    ``rope_factors_short``."""
    import math

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    rope = config.rope_parameters
    head_dim = config.hidden_size // config.num_attention_heads
    original = rope["original_max_position_embeddings"]
    scale = config.max_position_embeddings / original
    metadata = {
        **shape_metadata(config),
        "rope.scaling.original_context_length": original,
        "rope.dimension_count": int(rope["partial_rotary_factor"] * head_dim),
        "attention.sliding_window": config.sliding_window or 0,
        "rope.freq_base": float(rope["rope_theta"]),
        "rope.scaling.attn_factor": math.sqrt(1 + math.log(scale) / math.log(original)),
    }

    def factors(add) -> None:
        add("rope_factors_long.weight", "F32", values=np.array(rope["long_factor"]))
        add("rope_factors_short.weight", "F32", values=np.array(rope["short_factor"]))

    write_converted_gguf(folder, path, template, "phi3", metadata, kind, factors)


def write_converted_gemma3_gguf(folder: Path, path, template) -> None:
    """The HF Gemma 3 folder ``folder`` as llama.cpp's converter writes it (``Gemma3Model``): the global layers' RoPE
    base and linear scaling as metadata (the sliding layers' base and the attention scale are not stored), norms as
    ``1 + w``, ``F32``."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    full = config.rope_parameters["full_attention"]
    metadata = {
        **shape_metadata(config),
        "attention.key_length": config.head_dim,
        "attention.value_length": config.head_dim,
        "rope.freq_base": float(full["rope_theta"]),
        "attention.sliding_window": config.sliding_window,
    }
    if full.get("rope_type") == "linear":
        metadata.update({"rope.scaling.type": "linear", "rope.scaling.factor": float(full["factor"])})
    write_converted_gguf(folder, path, template, "gemma3", metadata, "F32")


def fixed_file(directory, stem: str, write) -> str:
    """A GGUF file written by ``write``, named by its bytes' digest and dated at a fixed time, so that every run finds
    the cache's one HF folder for it (keyed by name, size and mtime) instead of converting another."""
    written = directory / f"{stem}.gguf"
    write(written, resolve_model_path(DEFAULT_MODEL))
    digest = hashlib.sha256(written.read_bytes()).hexdigest()[:12]
    path = written.rename(written.with_name(f"{stem}-{digest}.gguf"))
    os.utime(path, (KQUANT_FILE_TIME, KQUANT_FILE_TIME))
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The default model (Llama: Q and K permuted, ``Q4_1`` and ``Q8_0``), a tiny K-quant Llama file, tiny Qwen3-MoE
    and Gemma 3 files, and a tiny Phi-3 file in ``Q8_0``."""
    from infer.testing.model import save_tiny_model

    directory = tmp_path_factory.mktemp("gguf")
    phi3 = save_tiny_model(
        test_model_families.TestPhi3.hf_model_class, test_model_families.TestPhi3.tiny_config(), directory / "phi3"
    )
    return {
        "default": DEFAULT_MODEL,
        "kquants": fixed_file(directory, "tiny-q4_k_m", write_kquant_gguf),
        "moe": fixed_file(directory, "tiny-qwen3moe", write_moe_gguf),
        "gemma3": fixed_file(directory, "tiny-gemma3", write_gemma3_gguf),
        "phi3": fixed_file(
            directory, "tiny-phi3-q8_0", lambda out, template: write_phi3_gguf(phi3, out, template, "Q8_0")
        ),
    }


@pytest.mark.parametrize("name", ["default", "kquants", "moe", "gemma3", "phi3"])
def test_a_gguf_files_weights_read_directly_are_transformers_conversions_bit_for_bit(files, name):
    path = files[name]
    assert not any(hf_model_dir(path).glob("*.safetensors"))  # the folder infer reads holds no weights
    direct = dict(load_model(path, torch.float32, read_gguf=True).model.named_parameters())
    converted = dict(load_model(str(hf_checkpoint_dir(path)), torch.float32).model.named_parameters())
    assert direct.keys() == converted.keys()
    for parameter, values in direct.items():
        assert torch.equal(values, converted[parameter]), parameter


@pytest.mark.parametrize("name", ["kquants", "moe", "gemma3", "phi3"])
def test_gguf_mode_packs_each_layer_as_the_files_blocks_as_soon_as_it_is_read(files, name):
    """``keep_gguf_blocks``: when ``prepare_layer`` gets a layer its projections are the file's blocks already (the
    experts' their rows of the stacked tensors), whose values are the float model's weights; the load leaves no
    float projection in the layers."""
    path = files[name]
    seen = []

    def prepare(layer: nn.Module) -> None:
        seen.append(all(not isinstance(module, nn.Linear) for module in layer.modules()))

    packed = load_model(path, torch.float32, prepare_layer=prepare, keep_gguf_blocks=True).model
    assert seen == [True] * packed.num_layers
    float_model = load_model(path, torch.float32, read_gguf=True).model
    float_modules = dict(float_model.named_modules())
    _, requantized = read_projections(Path(path), float_model)  # stored as types the kernels do not read
    kinds = set()
    for module_name, module in packed.layers.named_modules(prefix="layers"):
        if isinstance(module, PackedLinear) and module_name not in requantized:
            kinds.add(module.blocks.kind)
            assert torch.equal(dequantize_blocks(module.blocks), float_modules[module_name].weight), module_name
    assert (
        kinds
        == {
            "kquants": {"k_mixed", "q4_k", "q6_k"},
            "moe": {"q4_0", "q8_0", "q4_k", "q6_k"},
            "gemma3": {"k_mixed", "q4_k", "q4_0", "q8_0"},
            "phi3": {"q8_0"},
        }[name]
    )
    # every projection stored as blocks (a router stays float in every mode): what auto keeps where the block GEMM
    # runs on AMX
    assert stores_blocks(Path(path))


@pytest.mark.parametrize("name", ["default", "kquants", "moe", "gemma3", "phi3"])
def test_a_load_keeping_the_files_blocks_keeps_its_tables_as_them(files, name):
    """The token embedding a file stores as blocks stays as them (``BlockEmbedding``: rows dequantized as looked up,
    never the whole table as floats), a tied head multiplying the same blocks and an untied one its own; every row
    looked up, scaled as the family scales it, and the head's weight are the float model's bit for bit."""
    from infer.model.gguf_blocks import read_table
    from infer.model.quantization import BlockEmbedding, model_weight_bytes

    path = files[name]
    packed = load_model(path, torch.float32, keep_gguf_blocks=True).model
    float_model = load_model(path, torch.float32, read_gguf=True).model
    table = read_table(resolve_model_path(path))
    assert isinstance(packed.embed_tokens, BlockEmbedding) == (table is not None)
    if table is None:  # a float table in this file: read as floats
        return
    vocab = float_model.embed_tokens.weight.shape[0]
    ids = torch.tensor([[0, 5, 5, 1, vocab - 1, 6], [3, 2, vocab - 2, 8, 9, 4]])  # repeats, both ends, one group twice
    assert torch.equal(packed.embed_tokens(ids), float_model.embed_tokens(ids))
    assert torch.equal(packed.embed(ids[0]), float_model.embed(ids[0]))
    assert isinstance(packed.lm_head, PackedLinear) and packed.lm_head.weight is None
    assert (packed.lm_head.blocks is packed.embed_tokens.blocks) == packed.tie_word_embeddings
    assert torch.equal(packed.head_weight(), float_model.head_weight())
    held = model_weight_bytes(packed)  # the shared blocks once
    assert held == model_weight_bytes(packed.layers) + sum(
        p.numel() * p.element_size() for p in packed.norm.parameters()
    ) + packed.embed_tokens.nbytes + (0 if packed.tie_word_embeddings else packed.lm_head.nbytes)


def test_the_start_estimate_takes_a_table_kept_as_blocks_at_their_bytes():
    """Where the load keeps a GGUF file's blocks (``keeps_blocks``), its ``Q8_0`` table costs 34 bytes a 32 weights
    and a tied head nothing more; read as floats, float32's 4 bytes a weight plus the head packed as the mode packs."""
    from infer.execution.paths import estimated_weight_bytes
    from infer.model.loader import CheckpointMatrices

    counts = CheckpointMatrices(table=64_000, table_dtype="Q8_0", matrices=10_000, tied=True, mxfp4=3_200)
    kept = estimated_weight_bytes(counts, "bf16", torch.float32, keeps_blocks=True)
    assert kept == 2 * 10_000 + 64_000 * 34 // 32 + 3_200 * 17 // 32
    read = estimated_weight_bytes(counts, "bf16", torch.float32, keeps_blocks=False)
    assert read == 2 * (10_000 + 3_200) + 4 * 64_000 + 2 * 64_000


def test_auto_keeps_blocks_only_where_it_reads_the_file_itself(files, monkeypatch, caplog):
    """Under ``auto`` a GGUF file read through transformers' conversion (any but gpt-oss) keeps nothing as blocks, so
    its start estimate takes its table as float32; a safetensors folder without MXFP4 experts is not said to have
    them."""
    from types import SimpleNamespace

    from infer.execution import paths

    def keeps(path: str) -> bool:
        return paths.keeps_checkpoint_blocks(
            SimpleNamespace(model=SimpleNamespace(quantization="auto", path=path)), "bf16", sharded=False
        )

    assert not keeps(files["moe"]) and not keeps(DEFAULT_MODEL)
    folder = str(hf_checkpoint_dir(files["phi3"]))  # a float safetensors folder
    assert keeps(folder) and not paths.keeps_checkpoint_blocks(
        SimpleNamespace(model=SimpleNamespace(quantization="bf16", path=folder)), "bf16", sharded=False
    )
    monkeypatch.setattr("infer.host.available_memory", lambda: 1)
    with caplog.at_level("WARNING", logger="infer.execution"):
        paths.warn_if_memory_is_short(folder, "bf16", torch.float32, keeps_blocks=True)
    (record,) = caplog.records
    assert "bf16 weights, more than" in record.message and "MXFP4" not in record.message


def test_a_moe_file_runs_its_experts_in_one_call_over_the_files_blocks(files, monkeypatch):
    """The Qwen3-MoE file with its blocks kept: steps run the experts in the one C call over the file's blocks
    (``Q4_0`` gate/up and ``Q8_0`` down in one layer, ``Q4_K`` and ``Q6_K`` in the other), with the logits of the
    experts run one by one through their projections (the same int8 arithmetic); both stay near the float model's
    (int8 activations, and routing that near-tied random scores may tip, move them by a few percent)."""
    from test_model import PagedPool

    from infer.model import moe as moe_module
    from infer.model.quantization import quantize_model

    path = files["moe"]

    def packed_model():
        return quantize_model(load_model(path, torch.float32, keep_gguf_blocks=True).model, "gguf", Path(path))

    in_one_call = packed_model()
    runner = PagedPool(in_one_call, kernels=True)
    assert [layer.mlp.packed.blocks for layer in in_one_call.layers] == [("q4_0", "q8_0"), ("q4_k", "q6_k")]
    monkeypatch.setattr(moe_module, "MOE_BLOCK_KINDS", ())
    one_by_one = packed_model()
    by_projections = PagedPool(one_by_one, kernels=True)
    assert all(layer.mlp.packed is None for layer in one_by_one.layers)
    reference = PagedPool(load_model(path, torch.float32).model)
    tokens = torch.randint(1000, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    for step in [{"a": tokens}] + [{"a": [token]} for token in (5, 17, 300)]:
        got, alone, exact = runner.step(step)["a"], by_projections.step(step)["a"], reference.step(step)["a"]
        # the activations computed in C and in torch may round one to neighbouring int8 steps: 5e-5 of a prefill's
        # logits here, where a misread group moves them by tenths
        assert relative_error(got, alone) < 2e-4
        assert relative_error(got, exact) < 0.15


def assert_file_gives_the_hf_logits(suite, tmp_path, stem: str, write) -> None:
    """``suite``'s tiny HF model written as a GGUF file by ``write(folder, out, template)`` and read into a float model
    through transformers' conversion and by infer itself: its logits are the HF model's within the suite's tolerance."""
    import transformers

    from infer.testing.model import save_tiny_model

    folder = save_tiny_model(suite.hf_model_class, suite.tiny_config(), tmp_path / "hf")
    path = fixed_file(tmp_path, stem, lambda out, template: write(folder, out, template))
    hf_model = getattr(transformers, suite.hf_model_class).from_pretrained(folder, dtype=torch.float32).eval()
    for read_gguf in (False, True):
        model = load_model(path, torch.float32, max_positions=suite.max_model_len, read_gguf=read_gguf).model
        error = suite.logit_errors(model, hf_model)
        assert error < suite.tolerance, (read_gguf, error)


def test_a_phi3_file_is_the_model_llama_cpp_converted_it_from(tmp_path):
    """A Phi-3 file (Phi-4-mini's RoPE: three quarters of each head rotated, LongRoPE, a sliding window) as llama.cpp
    writes it, read into a float model through transformers' conversion and by infer itself, gives the logits of the HF
    model it was written from: the rotated share, the window and LongRoPE's factors come from the file's metadata and
    its factor tensors."""
    assert_file_gives_the_hf_logits(test_model_families.TestPhi3(), tmp_path, "tiny-phi3", write_phi3_gguf)


class Gemma3AsLlamaCppConverts(test_model_families.TestGemma3):
    """Gemma 3's tiny model in the form llama.cpp's converter keeps whole: the layer types of the pattern of 6 (five
    sliding layers, one global), the attention scaled by head_dim, linear RoPE scaling on the global layer."""

    config_fields = {
        **{key: value for key, value in test_model_families.TestGemma3.config_fields.items() if key != "layer_types"},
        "num_hidden_layers": 6,
        "query_pre_attn_scalar": 16,
    }


def test_a_gemma3_file_is_the_model_llama_cpp_converted_it_from(tmp_path):
    """A Gemma 3 file as llama.cpp writes it (norms as ``1 + w``; the global layers' linear RoPE scaling as metadata;
    no sliding base nor attention scale), read through transformers' conversion and by infer itself, gives the logits
    of the HF model it was written from."""
    assert_file_gives_the_hf_logits(
        Gemma3AsLlamaCppConverts(), tmp_path, "tiny-gemma3-f32", write_converted_gemma3_gguf
    )


def test_a_gemma3_27b_file_scales_its_attention_by_hidden_over_heads(tmp_path):
    """The 62-layer Gemma 3 (27B) scales its queries by hidden / heads (168 in the real model), not head_dim: its file
    does not say so, and llama.cpp decides by the layer count as the HF config does by its value."""
    from transformers import AutoConfig

    shape = {**GEMMA3_SHAPE, "block_count": 62, "attention.key_length": 32, "attention.value_length": 32}

    def tensors(add, vocab: int) -> None:
        add("token_embd.weight", "F32", vocab, shape["embedding_length"])

    path = fixed_file(
        tmp_path, "tiny-gemma3-62", lambda out, template: write_tiny_gguf(out, template, "gemma3", shape, 3, tensors)
    )
    config = AutoConfig.from_pretrained(hf_model_dir(path))
    assert (config.head_dim, config.query_pre_attn_scalar) == (32, 256 // 4)


def write_converted_llama_gguf(folder: Path, path, template) -> None:
    """The HF Llama folder ``folder`` as llama.cpp's converter writes it (``LlamaModel``): Q and K rows permuted to
    interleaved pairs, Llama 3's RoPE scaling as the tensor ``rope_freqs`` of each pair's divisor (computed as the
    converter computes it), ``F32``."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    rope = config.rope_parameters
    metadata = {
        **shape_metadata(config),
        "rope.dimension_count": config.head_dim,
        "rope.freq_base": float(rope["rope_theta"]),
    }

    def rope_freqs(add) -> None:
        base, dim = rope["rope_theta"], config.head_dim
        freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        original = rope["original_max_position_embeddings"]
        divisors = []
        for freq in freqs.tolist():
            wavelength = 2 * math.pi / freq
            if wavelength < original / high:
                divisors.append(1.0)
            elif wavelength > original / low:
                divisors.append(factor)
            else:
                smooth = (original / wavelength - low) / (high - low)
                divisors.append(1.0 / ((1.0 - smooth) / factor + smooth))
        add("rope_freqs.weight", "F32", values=np.array(divisors))

    write_converted_gguf(folder, path, template, "llama", metadata, "F32", rope_freqs)


class Llama3Scaled(test_model_families.TestLlama):
    """A tiny Llama with Llama 3.2's RoPE scaling (one pair of head_dim 16's eight blended)."""

    config_fields = {
        **test_model_families.TestLlama.config_fields,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500_000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }


class Llama3Unpublished(Llama3Scaled):
    """Llama 3's RoPE scaling with parameters of no published model (three pairs of head_dim 32's sixteen blended):
    the config solves for them from the divisors."""

    config_fields = {
        **test_model_families.TestLlama.config_fields,
        "head_dim": 32,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500_000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 16.0,
            "original_max_position_embeddings": 4096,
        },
    }


@pytest.mark.parametrize("suite_class", [Llama3Scaled, Llama3Unpublished], ids=["llama3.2", "unpublished"])
def test_a_llama3_file_is_the_model_llama_cpp_converted_it_from(tmp_path, suite_class):
    """A Llama 3 file as llama.cpp writes it (its RoPE scaling only as the divisors ``rope_freqs``), read through
    transformers' conversion and by infer itself, gives the logits of the HF model it was written from."""
    stem = f"tiny-llama3-{suite_class.__name__.lower()}"
    assert_file_gives_the_hf_logits(suite_class(), tmp_path, stem, write_converted_llama_gguf)


def test_generation_ends_where_llama_cpp_ends_it(tmp_path):
    """The tokens a GGUF file's generation ends at are llama.cpp's: the eos id the file names, its eot id where it names
    one, and every token of an end-of-turn text (the default model's ``<|im_end|>`` is its eos id; its
    ``<|endoftext|>`` ends generation too)."""
    import json

    assert load_model(DEFAULT_MODEL, torch.float32, read_gguf=True).eos_token_ids == [0, 2]
    shape = {**GEMMA3_SHAPE, "tokenizer.ggml.eot_token_id": 7}

    def tensors(add, vocab: int) -> None:
        add("token_embd.weight", "F32", vocab, shape["embedding_length"])

    path = fixed_file(
        tmp_path, "tiny-eot", lambda out, template: write_tiny_gguf(out, template, "gemma3", shape, 4, tensors)
    )
    generation = json.loads((hf_model_dir(path) / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [0, 2, 7]


class Qwen3Yarn(test_model_families.TestQwen3):
    """A tiny Qwen3 with YaRN scaling past an original context of 128 positions (Qwen's long-context setting)."""

    config_fields = {
        **test_model_families.TestQwen3.config_fields,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 1_000_000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
        },
    }


def write_converted_qwen3_gguf(folder: Path, path, template) -> None:
    """The HF Qwen3 folder ``folder`` as llama.cpp's converter writes it (``Qwen2Model``'s YaRN: the scaling's type,
    factor and original context as metadata), ``F32``."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    write_converted_gguf(folder, path, template, "qwen3", yarn_metadata(config), "F32")


def yarn_metadata(config) -> dict:
    """What llama.cpp's converter writes of a HF config with an explicit head width and YaRN scaling: the shape, the
    head width, the RoPE base and the scaling's type, factor and original context."""
    rope = config.rope_parameters
    return {
        **shape_metadata(config),
        "attention.key_length": config.head_dim,
        "attention.value_length": config.head_dim,
        "rope.freq_base": float(rope["rope_theta"]),
        "rope.scaling.type": "yarn",
        "rope.scaling.factor": float(rope["factor"]),
        "rope.scaling.original_context_length": rope["original_max_position_embeddings"],
    }


def test_a_qwen3_yarn_file_is_the_model_llama_cpp_converted_it_from(tmp_path):
    """A Qwen3 file with YaRN scaling as llama.cpp writes it (metadata only) gives the logits of the HF model it was
    written from, its prompts past the original context."""
    assert_file_gives_the_hf_logits(Qwen3Yarn(), tmp_path, "tiny-qwen3-yarn", write_converted_qwen3_gguf)


def write_converted_gpt_oss_gguf(folder: Path, path, template) -> None:
    """The gpt-oss folder ``folder`` (OpenAI's layout: MXFP4 experts, gate and up interleaved) as llama.cpp's converter
    writes it (``GptOssModel``): the experts' MXFP4 blocks repacked into GGUF's, gate's rows and up's split into
    ``ffn_gate_exps`` and ``ffn_up_exps`` (their biases likewise), the sinks as ``attn_sinks.weight``, the window and
    the experts' width as metadata, YaRN as the scaling's type, factor and original context; other tensors ``F32``."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from infer.testing.gguf_layouts import gpt_oss_tensors

    config = AutoConfig.from_pretrained(folder)
    metadata = {
        **yarn_metadata(config),
        "attention.sliding_window": config.sliding_window,
        "expert_count": config.num_local_experts,
        "expert_used_count": config.num_experts_per_tok,
        "expert_feed_forward_length": config.intermediate_size,
    }
    arch_id = {name: value for value, name in gguf.MODEL_ARCH_NAMES.items()}["gpt-oss"]
    names = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)

    def tensors(add, vocab: int) -> None:
        stored = load_file(folder / "model.safetensors")
        for name, tensor in stored.items():
            written = gpt_oss_tensors(name, stored.__getitem__)
            for hf_name, values, gguf_type in [(name, tensor.float().numpy(), "F32")] if written is None else written:
                add(names.get_name(hf_name, try_suffixes=(".weight", ".bias")), gguf_type, values=values)

    write_tiny_gguf(path, template, "gpt-oss", metadata, 0, tensors)


class GptOssAsLlamaCppConverts(test_gpt_oss.TestGptOss8Experts):
    """gpt-oss's tiny model with the clamp every gpt-oss checkpoint has (7), which llama.cpp takes as given: the file
    does not store it."""

    config_fields = {**test_gpt_oss.TestGptOss8Experts.config_fields, "swiglu_limit": 7.0}


def test_a_gpt_oss_file_is_the_model_llama_cpp_converted_it_from(tmp_path):
    """A gpt-oss file as llama.cpp writes it from OpenAI's layout (MXFP4 experts split into gate and up, the window
    and YaRN as metadata) is read by infer itself, whatever the packing (transformers' conversion leaves its experts
    out): the float model is the dequantized checkpoint's bit for bit and gives the HF model's logits; kept as blocks,
    each expert is the file's MXFP4, whose values are those weights."""
    import transformers

    from infer.kernels.cpu.blocks import dequantize_blocks

    suite = GptOssAsLlamaCppConverts()
    float_dir, mxfp4_dir = test_gpt_oss.save_mxfp4_checkpoints(tmp_path, (-7, -3), GptOssAsLlamaCppConverts)
    path = fixed_file(
        tmp_path, "tiny-gpt-oss", lambda out, template: write_converted_gpt_oss_gguf(mxfp4_dir, out, template)
    )
    config = suite.tiny_config()
    counts = checkpoint_matrices(Path(path))  # the start's estimate: the experts' weights apart
    experts = config.num_local_experts * 3 * config.hidden_size * config.intermediate_size
    assert counts.mxfp4 == config.num_hidden_layers * experts
    assert counts.matrices + counts.mxfp4 == checkpoint_matrices(float_dir).matrices
    model = load_model(path, torch.float32, max_positions=suite.max_model_len).model
    reference = load_model(str(float_dir), torch.float32, max_positions=suite.max_model_len).model
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    hf_model = transformers.GptOssForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()
    assert suite.logit_errors(model, hf_model) < suite.tolerance
    for keep in ("keep_gguf_blocks", "keep_checkpoint_blocks"):  # every projection as blocks, or the experts alone
        kept = load_model(path, torch.float32, max_positions=suite.max_model_len, **{keep: True}).model
        for ours, theirs in zip(kept.layers, reference.layers):
            assert isinstance(ours.self_attn.qkv_proj, PackedLinear) == (keep == "keep_gguf_blocks")
            for expert, float_expert in zip(ours.mlp.experts, theirs.mlp.experts):
                for name in ("gate_up_proj", "down_proj"):
                    packed = getattr(expert, name)
                    assert isinstance(packed, PackedLinear) and packed.blocks.kind == "mxfp4"
                    assert torch.equal(dequantize_blocks(packed.blocks), getattr(float_expert, name).weight)
    # the engine's defaults: the experts kept (the file's other projections are F32: bf16 or fp16 weights beside them)
    llm = suite.engine(path, model__dtype="auto", model__quantization="auto", execution__fused_max_tokens=8)
    kinds = {getattr(getattr(module, "blocks", None), "kind", None) for module in llm.engine.model.modules()}
    assert "mxfp4" in kinds, kinds
    outputs = suite.engine_greedy(llm, [list(range(100, 120))])
    assert len(outputs[0]) == suite.max_tokens
