"""A GGUF file's quantized projections kept as its blocks (``model.quantization: gguf``).

The loader builds the model from the file's dequantized float weights (``infer.model.loader``); this module reads
the same file's ``Q4_0``, ``Q4_1``, ``Q8_0``, ``Q4_K`` and ``Q6_K`` tensors again as raw blocks, for each of the
model's projections (our fused QKV and gate/up concatenate the file's rows, as the family's weight-name map says),
repacked for the block GEMV (``infer.kernels.cpu.blocks``). A fused projection whose parts are stored as both K
types (a ``Q4_K_M`` file gives half its layers' V ``Q6_K`` beside ``Q4_K`` Q and K) is kept as a ``k_mixed`` weight.
Rows are reordered where the file reorders them: ``convert_hf_to_gguf.py`` interleaves the rotary halves of Llama's
Q and K heads, and transformers undoes that for the float weights.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from torch import nn

from infer.kernels.cpu.blocks import K_KINDS, BlockWeight, pack_blocks, pack_mixed_kquants
from infer.model.gguf_file import GgufFile, GgufTensor

logger = logging.getLogger("infer")

# GGUF types kept as blocks, by the block GEMV's name for them.
BLOCK_TYPES = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q8_0": "q8_0", "Q4_K": "q4_k", "Q6_K": "q6_k"}
# Architectures whose Q and K rows convert_hf_to_gguf.py permutes (transformers' LlamaTensorProcessor undoes it).
PERMUTED_ARCHITECTURES = ("llama", "mistral")


def _header(path: Path) -> GgufFile:
    """The file's header, read once for both ``stores_blocks`` (``auto``'s choice) and ``read_projections`` (the
    packing) of one start; a replaced file (another size or mtime) is read again."""
    stat = Path(path).stat()
    return _read_header(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _read_header(path: str, size: int, mtime_ns: int) -> GgufFile:
    return GgufFile(path)


def stores_blocks(path: Path) -> bool:
    """Whether every 2-D weight of the GGUF file's layers (``blk.N.*``: the projections) is of a ``BLOCK_TYPES``
    type, so that ``model.quantization: gguf`` keeps all of them as blocks."""
    layers = [
        tensor
        for tensor in _header(path).tensors.values()
        if tensor.name.startswith("blk.") and tensor.name.endswith(".weight") and len(tensor.shape) == 2
    ]
    return bool(layers) and all(tensor.type_name in BLOCK_TYPES for tensor in layers)


def read_projections(path: Path, model: nn.Module) -> tuple[dict[str, BlockWeight], dict[str, str]]:
    """For each ``nn.Linear`` of ``model`` (its module name: ``layers.0.self_attn.qkv_proj``, ``lm_head``), the
    file's blocks where every tensor it concatenates is of one ``BLOCK_TYPES`` type, or each of a K type; and, for the
    others, the GGUF type(s) they are stored as (``F32``, ``Q5_K``, ``Q4_K+Q8_0``, ...)."""
    import gguf

    file = _header(path)
    architecture = file.architecture
    arch_id = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}.get(architecture)
    if arch_id is None:
        raise ValueError(f"{path.name}: GGUF architecture {architecture!r} is unknown to the gguf package")
    names = gguf.get_tensor_name_map(arch_id, model.num_layers)
    tensors = file.tensors
    permuted = architecture in PERMUTED_ARCHITECTURES
    blocks: dict[str, BlockWeight] = {}
    others: dict[str, str] = {}
    for module_name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        parts = [_gguf_name(names, hf_name) for hf_name in model.weight_map.hf_names(f"{module_name}.weight")]
        if module_name == "lm_head" and "output.weight" not in tensors:  # tied to the token embedding
            parts = ["token_embd.weight"]
        found = [tensors[part] for part in parts if part in tensors]
        if len(found) != len(parts):
            raise ValueError(
                f"{path.name}: no tensor {[part for part in parts if part not in tensors]} for {module_name}"
            )
        types = sorted({tensor.type_name for tensor in found})
        kinds = [BLOCK_TYPES.get(tensor.type_name) for tensor in found]
        if None in kinds or (len(types) > 1 and not all(kind in K_KINDS for kind in kinds)):
            others[module_name] = "+".join(types)
            continue
        rows = [_rows(file, tensor, permuted, model) for tensor in found]
        if len(types) == 1:
            blocks[module_name] = pack_blocks(np.concatenate(rows), kinds[0], sum(len(part) for part in rows))
        else:
            blocks[module_name] = pack_mixed_kquants([(part, kind, len(part)) for part, kind in zip(rows, kinds)])
    return blocks, others


def _gguf_name(names, hf_name: str) -> str:
    name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise ValueError(f"the gguf package maps no GGUF tensor to {hf_name}")
    return name


def _rows(file: GgufFile, tensor: GgufTensor, permuted: bool, model: nn.Module) -> np.ndarray:
    """A tensor's bytes as rows (one per output feature), Q and K rows back in HF's order where the file permuted
    them (``LlamaTensorProcessor._reverse_permute_weights``: whole rows move, so blocks stay intact)."""
    rows = file.data(tensor)
    if not permuted or not (".attn_q." in tensor.name or ".attn_k." in tensor.name):
        return rows
    heads = model.num_heads if ".attn_q." in tensor.name else model.num_kv_heads
    half = len(rows) // heads // 2
    return rows.reshape(heads, half, 2, -1).swapaxes(1, 2).reshape(len(rows), -1)


def warn_dequantized(path: Path, others: Mapping[str, str], mode: str) -> None:
    """One warning naming the GGUF types not kept as blocks and what they were packed as instead."""
    if not others:
        return
    by_type: dict[str, list[str]] = {}
    for module_name, types in others.items():
        by_type.setdefault(types, []).append(module_name)
    listed = "; ".join(
        f"{types}: {len(modules)} ({modules[0]}{', ...' if len(modules) > 1 else ''})"
        for types, modules in sorted(by_type.items())
    )
    logger.warning(
        "%s: projections stored as GGUF types the block kernels do not read are dequantized and packed as %s: %s",
        path.name,
        mode,
        listed,
    )
