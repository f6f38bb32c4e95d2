"""A GGUF file's quantized projections kept as its blocks (``model.quantization: gguf``).

The loader builds the model from the file's dequantized float weights (``infer.model.loader``); this module reads
the same file's ``Q4_0``, ``Q4_1``, ``Q8_0``, ``Q4_K``, ``Q6_K`` and ``MXFP4`` tensors again as raw blocks, for each of
the model's projections (our fused QKV and gate/up concatenate the file's rows, as the family's weight-name map says),
repacked for the block GEMV (``infer.kernels.cpu.blocks``). A fused projection whose parts are stored as both K
types (a ``Q4_K_M`` file gives half its layers' V ``Q6_K`` beside ``Q4_K`` Q and K) is kept as a ``k_mixed`` weight.
Rows are reordered where the file reorders them: ``convert_hf_to_gguf.py`` interleaves the rotary halves of Llama's
Q and K heads, and transformers undoes that for the float weights.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from torch import nn

from infer.kernels.cpu.blocks import K_KINDS, BlockWeight, pack_blocks, pack_mixed_kquants
from infer.model.gguf_file import GgufFile, GgufTensor

logger = logging.getLogger("infer")

# GGUF types kept as blocks, by the block GEMV's name for them.
BLOCK_TYPES = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q8_0": "q8_0", "Q4_K": "q4_k", "Q6_K": "q6_k", "MXFP4": "mxfp4"}
# HF tensors that a file of an architecture stores as several, by the HF name's part: the concatenation of the
# file's parts' rows is the HF tensor. llama.cpp splits gpt-oss's experts' interleaved gate/up into gate's rows and
# up's (infer's gate_up_proj holds gate's rows first), their biases likewise.
FILE_SPLITS = {"gpt-oss": {".gate_up_proj.": (".gate_proj.", ".up_proj.")}}  # (its only MLPs are experts)
# Architectures whose Q and K rows convert_hf_to_gguf.py permutes (transformers' LlamaTensorProcessor undoes it).
PERMUTED_ARCHITECTURES = ("llama", "mistral")


def gguf_header(path: Path) -> GgufFile:
    """The file's header, read once for both ``stores_blocks`` (``auto``'s choice) and ``read_projections`` (the
    packing) of one start; a replaced file (another size or mtime) is read again."""
    stat = Path(path).stat()
    return _read_header(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _read_header(path: str, size: int, mtime_ns: int) -> GgufFile:
    return GgufFile(path)


def stores_blocks(path: Path) -> bool:
    """Whether every projection of the GGUF file's layers (``blk.N.*`` weights of 2 dimensions, a mixture's stacked
    experts of 3; not a router, ``ffn_gate_inp``, which stays float in every mode) is of a ``BLOCK_TYPES`` type, so
    that ``model.quantization: gguf`` keeps all of them as blocks."""
    layers = [
        tensor
        for tensor in gguf_header(path).tensors.values()
        if tensor.name.startswith("blk.")
        and tensor.name.endswith(".weight")
        and len(tensor.shape) in (2, 3)
        and ".ffn_gate_inp" not in tensor.name
    ]
    return bool(layers) and all(tensor.type_name in BLOCK_TYPES for tensor in layers)


def read_projections(
    path: Path, model: nn.Module, within: str = "", only: tuple[str, ...] | None = None
) -> tuple[dict[str, BlockWeight], dict[str, str]]:
    """For each ``nn.Linear`` of ``model`` (its module name: ``layers.0.self_attn.qkv_proj``, ``lm_head``; those
    whose name starts with ``within``), the file's blocks where every tensor it concatenates is of one
    ``BLOCK_TYPES`` type, or each of a K type (with ``only``: of those block kinds); and, for the others, the GGUF
    type(s) they are stored as (``F32``, ``Q5_K``, ``Q4_K+Q8_0``, ...). A mixture's experts are their rows of the
    file's stacked tensors."""
    file = gguf_header(path)
    blocks: dict[str, BlockWeight] = {}
    others: dict[str, str] = {}
    for module_name, found, kinds in _projection_sources(file, model, within):
        types = sorted({tensor.type_name for tensor, _ in found})
        if not _kept_as_blocks(types, kinds, only):
            others[module_name] = "+".join(types)
            continue
        rows = [tensor_rows(file, tensor, expert, model.num_heads, model.num_kv_heads) for tensor, expert in found]
        if len(types) == 1:
            blocks[module_name] = pack_blocks(np.concatenate(rows), kinds[0], sum(len(part) for part in rows))
        else:
            blocks[module_name] = pack_mixed_kquants([(part, kind, len(part)) for part, kind in zip(rows, kinds)])
    return blocks, others


def read_table(path: Path) -> BlockWeight | None:
    """The file's token embedding table (``token_embd.weight``) as its blocks, where it stores it as a ``BLOCK_TYPES``
    type, else None (a float or other table, read as floats)."""
    file = gguf_header(path)
    tensor = file.tensors.get("token_embd.weight")
    kind = None if tensor is None else BLOCK_TYPES.get(tensor.type_name)
    if kind is None:
        return None
    rows = file.data(tensor)
    return pack_blocks(rows, kind, len(rows))


def projections_kept_as_blocks(path: Path, model: nn.Module, only: tuple[str, ...] | None = None) -> set[str]:
    """The module names of ``model``'s ``nn.Linear`` layers that ``read_projections`` keeps as the file's blocks."""
    file = gguf_header(path)
    return {
        module_name
        for module_name, found, kinds in _projection_sources(file, model)
        if _kept_as_blocks(sorted({tensor.type_name for tensor, _ in found}), kinds, only)
    }


def _projection_sources(file: GgufFile, model: nn.Module, within: str = ""):
    """For each ``nn.Linear`` of ``model`` whose name starts with ``within``: its name, the file's tensors it
    concatenates (each with its expert's index in a stacked tensor, else None), and their block kinds (None: a type
    ``BLOCK_TYPES`` lacks)."""
    names = tensor_name_map(file, model.num_layers)
    tensors = file.tensors
    for module_name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or not module_name.startswith(within):
            continue
        parts = [
            source
            for hf_name in model.weight_map.hf_names(f"{module_name}.weight")
            for source in gguf_sources(file, names, hf_name)
        ]
        if module_name == "lm_head" and "output.weight" not in tensors:  # tied to the token embedding
            parts = [("token_embd.weight", None)]
        found = [(tensors[part], expert) for part, expert in parts if part in tensors]
        if len(found) != len(parts):
            raise ValueError(
                f"{file.path.name}: no tensor {[part for part, _ in parts if part not in tensors]} for {module_name}"
            )
        yield module_name, found, [BLOCK_TYPES.get(tensor.type_name) for tensor, _ in found]


def _kept_as_blocks(types: list[str], kinds: list[str | None], only: tuple[str, ...] | None = None) -> bool:
    """Whether tensors of these GGUF types (block kinds) make one block weight: one type the kernels read, or K
    types only; with ``only``, of those kinds."""
    if only is not None and not all(kind in only for kind in kinds):
        return False
    return None not in kinds and (len(types) == 1 or all(kind in K_KINDS for kind in kinds))


def tensor_name_map(file: GgufFile, num_layers: int):
    """The gguf package's map from HF tensor names to this file's (``TensorNameMap``), for its architecture."""
    import gguf

    arch_id = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}.get(file.architecture)
    if arch_id is None:
        raise ValueError(f"{file.path.name}: GGUF architecture {file.architecture!r} is unknown to the gguf package")
    return _name_map(arch_id, num_layers)


@functools.lru_cache(maxsize=4)
def _name_map(arch_id, num_layers: int):
    """``gguf.get_tensor_name_map``, built once per architecture and depth: it lays out every alias of every tensor
    of every layer (about 0.1 s for 30 layers), and a load asks for it once per layer."""
    import gguf

    return gguf.get_tensor_name_map(arch_id, num_layers)


# An expert's index in a per-expert HF name (``model.layers.0.mlp.experts.3.gate_proj.weight``).
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def gguf_source(names, hf_name: str) -> tuple[str, int | None]:
    """The file's tensor that holds HF tensor ``hf_name``, and where that is one expert of a mixture's stacked
    tensor (``blk.0.ffn_gate_exps.weight``: the experts one after the other), the expert's index (else None)."""
    expert = None
    match = _EXPERT.search(hf_name)
    if match is not None:
        expert = int(match.group(1))
        hf_name = f"{hf_name[: match.start()]}.experts.{hf_name[match.end() :]}"
    name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise ValueError(f"the gguf package maps no GGUF tensor to {hf_name}")
    return name, expert


def gguf_sources(file: GgufFile, names, hf_name: str) -> list[tuple[str, int | None]]:
    """The file's tensors whose rows, concatenated, hold HF tensor ``hf_name`` (``gguf_source`` each; several where
    the file splits it, ``FILE_SPLITS``), each name as the file has it (a name the map gives bare, such as gpt-oss's
    ``attn_sinks``, with ``.weight`` where the file stores it so)."""
    parts = [hf_name]
    for whole, split in FILE_SPLITS.get(file.architecture, {}).items():
        if whole in hf_name:
            parts = [hf_name.replace(whole, part) for part in split]
    sources = []
    for part in parts:
        name, expert = gguf_source(names, part)
        if name not in file.tensors and f"{name}.weight" in file.tensors:
            name = f"{name}.weight"
        sources.append((name, expert))
    return sources


def tensor_rows(file: GgufFile, tensor: GgufTensor, expert: int | None, num_heads: int, num_kv_heads: int):
    """A tensor's bytes as rows (one per output feature; one expert's rows of a stacked tensor), Q and K rows back in
    HF's order where the file permuted them (``LlamaTensorProcessor._reverse_permute_weights``: whole rows move, so
    blocks stay intact)."""
    rows = file.data(tensor)
    if expert is not None:
        # an expert's rows: GGUF's shape is (columns, rows, experts); a stacked bias's, (entries, experts)
        count = tensor.shape[1] if len(tensor.shape) == 3 else 1
        rows = rows[expert * count : (expert + 1) * count]
    if file.architecture not in PERMUTED_ARCHITECTURES or not (".attn_q." in tensor.name or ".attn_k." in tensor.name):
        return rows
    heads = num_heads if ".attn_q." in tensor.name else num_kv_heads
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
