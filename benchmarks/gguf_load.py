"""A HF folder written as a GGUF file (``write``), and the peak memory and time of loading one as
``model.quantization=gguf`` keeps it (``measure``): infer reading the file itself, a tensor at a time, each layer
packed as the file's blocks as soon as it is read, against the same model from transformers' conversion of the file
(the whole model dequantized to float32 in memory and written to disk as a HF folder, then read as a float model and
packed; the conversion runs at the first start only, then its folder is in the cache), each in a fresh process.

``write`` keeps every 2-D weight but the token embedding as ``--type`` blocks (the embedding ``Q8_0``, norms and a
router ``F32``; experts stacked as llama.cpp stacks them; ``Q4_K_M``: ``Q4_K`` and ``Q6_K`` as llama.cpp's mix picks
them, quantized by ``infer.testing.kquants``), with the tokenizer and metadata of the default model's file
beside the folder's shape (``random_models.py``'s folders use that tokenizer). Architectures: Qwen3, Qwen3-MoE,
Gemma 3 (its norm weights stored as ``1 + w``, as llama.cpp's converter writes them) and gpt-oss from OpenAI's layout
(its MXFP4 experts kept as MXFP4, split into gate and up as llama.cpp's converter splits them; the window and YaRN as
metadata).

    python benchmarks/gguf_load.py write ~/models/qwen3-0.6b-random /tmp/qwen3-0.6b-q4_0.gguf
    python benchmarks/gguf_load.py measure /tmp/qwen3-0.6b-q4_0.gguf            # both starts
    python benchmarks/gguf_load.py measure /tmp/qwen3-moe-q4_0.gguf --direct-only
    python benchmarks/gguf_load.py write ~/models/gpt-oss-20b-random /tmp/gpt-oss-20b.gguf --type Q8_0
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# HF config keys written as the GGUF architecture's metadata (``{arch}.{key}``), by architecture.
SHAPE_KEYS = {
    "block_count": "num_hidden_layers",
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.value_length": "head_dim",
    "vocab_size": "vocab_size",
}
MOE_KEYS = {
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
}
GEMMA3_KEYS = {"attention.sliding_window": "sliding_window"}
GPT_OSS_KEYS = {
    "attention.sliding_window": "sliding_window",
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "intermediate_size",
}
ARCHITECTURES = {"qwen3": "qwen3", "qwen3_moe": "qwen3moe", "gemma3_text": "gemma3", "gpt_oss": "gpt-oss"}


# The tokenizer's per-token arrays, padded with unused tokens where the folder's vocabulary is larger than the default
# model's tokenizer (llama.cpp checks the embedding's rows against the token count).
VOCAB_PADDING = {
    "tokenizer.ggml.tokens": lambda index: f"[PAD{index}]",
    "tokenizer.ggml.token_type": lambda index: 5,  # gguf.TokenType.UNUSED
    "tokenizer.ggml.scores": lambda index: 0.0,
}


def write(folder: Path, out: Path, block_type: str) -> None:
    import gguf
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from safetensors import safe_open

    from infer.model.loader import DEFAULT_MODEL, resolve_model_path
    from infer.testing.gguf_layouts import gpt_oss_tensors

    config = json.loads((folder / "config.json").read_text())
    arch = ARCHITECTURES[config["model_type"]]
    template = GGUFReader(resolve_model_path(DEFAULT_MODEL))
    writer = GGUFWriter(out, arch)
    pads = config["vocab_size"] - len(template.fields["tokenizer.ggml.tokens"].contents())
    for name, field in template.fields.items():
        if name.startswith(("GGUF.", "llama.")) or name in ("general.architecture", "general.file_type"):
            continue
        vtype, contents = field.types[0], field.contents()
        if pads > 0 and name in VOCAB_PADDING:  # as llama.cpp's converter pads a vocabulary to the embedding's rows
            contents = contents + [VOCAB_PADDING[name](index) for index in range(pads)]
        writer.add_key_value(name, contents, vtype, field.types[-1] if vtype == GGUFValueType.ARRAY else None)
    config.setdefault("num_experts", config.get("num_local_experts"))
    extra = {"qwen3moe": MOE_KEYS, "gemma3": GEMMA3_KEYS, "gpt-oss": GPT_OSS_KEYS}.get(arch, {})
    for key, field in {**SHAPE_KEYS, **extra}.items():
        writer.add_uint32(f"{arch}.{key}", int(config[field]))
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", float(config["rms_norm_eps"]))
    rope = config.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # Gemma 3: per layer type; the file holds the full layers' base
    theta = rope.get("rope_theta", config.get("rope_theta", 1e6))
    writer.add_float32(f"{arch}.rope.freq_base", float(theta))
    if rope.get("rope_type") == "yarn":
        writer.add_string(f"{arch}.rope.scaling.type", "yarn")
        writer.add_float32(f"{arch}.rope.scaling.factor", float(rope["factor"]))
        writer.add_uint32(f"{arch}.rope.scaling.original_context_length", int(rope["original_max_position_embeddings"]))
    arch_id = {name: value for value, name in gguf.MODEL_ARCH_NAMES.items()}[arch]
    layers = config["num_hidden_layers"]
    names = gguf.get_tensor_name_map(arch_id, layers)

    def gguf_name(hf_name: str) -> str:
        return names.get_name(hf_name, try_suffixes=(".weight", ".bias"))

    files = [safe_open(path, "pt") for path in sorted(folder.glob("*.safetensors"))]
    tensors = {name: file for file in files for name in file.keys()}
    stacked = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
    per_expert = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}  # a checkpoint's per-expert tensors, to stack
    for name in sorted(tensors):
        written = gpt_oss_tensors(name, lambda name: tensors[name].get_tensor(name)) if arch == "gpt-oss" else None
        if written is not None:  # llama.cpp's own layout of this tensor
            for hf_name, values, gguf_type in written:
                raw_dtype = GGMLQuantizationType[gguf_type] if gguf_type != "F32" else None  # (F32: its values)
                writer.add_tensor(gguf_name(hf_name), values, raw_dtype=raw_dtype)
            continue
        tensor = tensors[name].get_tensor(name).float().numpy()
        match = per_expert.match(name)
        if match:
            gathered = experts.setdefault((match.group(1), match.group(3)), {})
            gathered[int(match.group(2))] = tensor
            if len(gathered) == config["num_experts"]:
                values = np.stack([gathered[index] for index in range(len(gathered))])
                add(writer, gguf_name(f"{match.group(1)}.{match.group(3)}.weight"), values, block_type, layers)
                gathered.clear()
            continue
        match = stacked.match(name)
        if (
            match
        ):  # transformers' stacked experts: [experts, 2 * width, hidden] (gate first) and [experts, hidden, width]
            parts = (
                {"gate_proj": tensor[:, : tensor.shape[1] // 2], "up_proj": tensor[:, tensor.shape[1] // 2 :]}
                if match.group(2) == "gate_up_proj"
                else {"down_proj": tensor}
            )
            for part, values in parts.items():
                add(writer, gguf_name(f"{match.group(1)}.{part}.weight"), values, block_type, layers)
            continue
        if arch == "gemma3" and tensor.ndim == 1:  # llama.cpp stores Gemma's norm weights as the 1 + w applied
            tensor = tensor + 1.0
        add(writer, gguf_name(name), tensor, block_type, layers)
        del tensor
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()


def add(writer, name: str, values: np.ndarray, block_type: str, layers: int) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from infer.testing.kquants import QUANTIZERS

    if values.ndim == 1 or name.endswith("ffn_gate_inp.weight"):
        writer.add_tensor(name, np.ascontiguousarray(values, dtype=np.float32))
        return
    kind = "Q8_0" if name == "token_embd.weight" else block_type
    if kind == "Q4_K_M":
        kind = q4_k_m_type(name, layers)
    qtype = GGMLQuantizationType[kind]
    values = np.ascontiguousarray(values, dtype=np.float32)
    if kind.lower() in QUANTIZERS:  # by rows (stacked experts' too)
        raw = QUANTIZERS[kind.lower()](values.reshape(-1, values.shape[-1])).reshape(*values.shape[:-1], -1)
    else:
        raw = quantize(values, qtype)
    writer.add_tensor(name, raw, raw_dtype=qtype)


def q4_k_m_type(name: str, layers: int) -> str:
    """The block type llama.cpp's ``Q4_K_M`` gives a tensor: ``Q6_K`` for the output head, and for V and down
    (experts' too) in the layers its ``use_more_bits`` picks (the first and last eighth, every third between);
    ``Q4_K`` for the rest."""
    if name == "output.weight":
        return "Q6_K"
    layer = re.match(r"blk\.(\d+)\.(attn_v|ffn_down)", name)
    if layer is None:
        return "Q4_K"
    index = int(layer.group(1))
    more_bits = index < layers // 8 or index >= 7 * layers // 8 or (index - layers // 8) % 3 == 2
    return "Q6_K" if more_bits else "Q4_K"


# Run in a fresh process: the load's time and the process's peak resident memory.
PROBE = """
import resource, sys, time, torch
from pathlib import Path
from infer.model.loader import hf_checkpoint_dir, load_model
from infer.model.quantization import quantize_model
began = time.perf_counter()
if sys.argv[2] == "direct":
    model = load_model(sys.argv[1], torch.float32, keep_gguf_blocks=True).model
else:  # the float model from transformers' folder, then its blocks
    model = load_model(str(hf_checkpoint_dir(sys.argv[1])), torch.float32).model
quantize_model(model, "gguf", Path(sys.argv[1]))
print(time.perf_counter() - began, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
"""


def measure(path: Path, direct_only: bool) -> None:
    print(f"{path.name}: {path.stat().st_size / 2**30:.2f} GiB")
    print("| start | time (s) | peak resident memory (GiB) |")
    print("|---|---|---|")
    for how in ("direct",) if direct_only else ("direct", "converted"):
        began = time.perf_counter()
        result = subprocess.run([sys.executable, "-c", PROBE, str(path), how], capture_output=True, text=True)
        if result.returncode != 0:
            print(f"| {how} | failed: {result.stderr.strip().splitlines()[-1]} | |")
            continue
        seconds, peak = map(float, result.stdout.split()[-2:])
        label = "infer reads the file (gguf)" if how == "direct" else "transformers' conversion"
        print(f"| {label} | {seconds:.1f} ({time.perf_counter() - began:.1f} with the process) | {peak:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    writing = commands.add_parser("write")
    writing.add_argument("folder", type=Path)
    writing.add_argument("out", type=Path)
    writing.add_argument("--type", default="Q4_0", choices=["Q4_0", "Q4_1", "Q8_0", "Q4_K_M"])
    measuring = commands.add_parser("measure")
    measuring.add_argument("file", type=Path)
    measuring.add_argument("--direct-only", action="store_true")
    args = parser.parse_args()
    if args.command == "write":
        write(args.folder.expanduser(), args.out.expanduser(), args.type)
    else:
        measure(args.file.expanduser(), args.direct_only)


if __name__ == "__main__":
    main()
