"""A GGUF file's tensors under the HF names a model family reads (``GgufTensors``), each dequantized as it is looked
up: a load holds one tensor's float weights at a time, not a float copy of the whole model, and writes nothing to
disk.

Read so for the architectures whose GGUF tensors are the HF checkpoint's under the gguf package's standard names
(``DIRECT_ARCHITECTURES``), with what transformers' GGUF loader does to them: Llama's Q and K rows permuted back
(``gguf_blocks.tensor_rows``), a mixture's experts taken from the file's stacked tensors, Gemma 3's norm weights
stored as ``1 + w`` taken back to ``w``, gpt-oss's experts' gate and up rows taken from the two tensors the file
splits them into (``gguf_blocks.FILE_SPLITS``). A file of another architecture goes through transformers' conversion
to a HF folder (``infer.model.loader``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np
import torch

from infer.model.gguf_blocks import gguf_header, gguf_sources, tensor_name_map, tensor_rows

# GGUF architectures (``general.architecture``) read by ``GgufTensors``.
DIRECT_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma3", "phi3", "gpt-oss")
# Architectures whose files transformers' conversion does not convert (its gpt-oss tensor processor looks for expert
# tensors llama.cpp does not write, and leaves the experts random): read by ``GgufTensors`` for a float model too.
UNCONVERTED_ARCHITECTURES = ("gpt-oss",)
# Architectures whose files store every RMSNorm weight as the ``1 + w`` the model multiplies by: transformers'
# conversion (its ``Gemma2TensorProcessor``) subtracts the 1, in float32, from each tensor whose GGUF name holds
# ``norm.weight``.
NORM_OFFSET_ARCHITECTURES = ("gemma3",)
# A tensor's stored bytes dequantized at a time.
DEQUANTIZE_CHUNK_BYTES = 16 << 20


def reads_directly(path: Path) -> bool:
    """Whether the GGUF file's weights are read by ``GgufTensors`` (its architecture is in ``DIRECT_ARCHITECTURES``)."""
    return gguf_header(path).architecture in DIRECT_ARCHITECTURES


def converts_wrongly(path: Path) -> bool:
    """Whether transformers' conversion would leave the GGUF file's model incomplete (``UNCONVERTED_ARCHITECTURES``):
    such a file is read directly whatever the model's packing."""
    return gguf_header(path).architecture in UNCONVERTED_ARCHITECTURES


class GgufTensors(Mapping[str, torch.Tensor]):
    """The tensors of the GGUF file at ``path`` that the HF names ``hf_names`` map to (names the file lacks are not
    keys), as float32 tensors of the HF checkpoint's shapes, dequantized by the gguf package (transformers' values,
    bit for bit) when looked up. ``num_heads`` and ``num_kv_heads`` place Llama's permuted Q and K rows. Names in
    ``unread`` (the projections a load packs as the file's blocks) give an uninitialized tensor of their shape
    instead, read from nothing. Every lookup is a new tensor (``fresh_tensors``): a load keeps it as the parameter."""

    fresh_tensors = True

    def __init__(
        self,
        path: Path,
        hf_names: Iterable[str],
        num_layers: int,
        num_heads: int,
        num_kv_heads: int,
        unread: Iterable[str] = (),
    ):
        self.file = gguf_header(path)
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.unread = frozenset(unread)
        names = tensor_name_map(self.file, num_layers)
        self._sources: dict[str, list[tuple[str, int | None]]] = {}
        for hf_name in hf_names:
            try:
                sources = gguf_sources(self.file, names, hf_name)
            except ValueError:  # no GGUF name for it: a key this mapping lacks, as the file does
                continue
            if all(name in self.file.tensors for name, _ in sources):
                self._sources[hf_name] = sources
        if not self._sources:
            raise ValueError(f"{self.file.path.name}: none of its tensors has a name the model reads")

    def __getitem__(self, hf_name: str) -> torch.Tensor:
        sources = self._sources[hf_name]
        if hf_name in self.unread:  # packed from the file's blocks as soon as its layer is read; no page touched
            shapes = [self._shape(name, expert) for name, expert in sources]
            return torch.empty(sum(shape[0] for shape in shapes), *shapes[0][1:])
        parts = [self._part(name, expert) for name, expert in sources]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _shape(self, name: str, expert: int | None) -> tuple[int, ...]:
        """The HF shape of the file's tensor ``name`` (of an expert's share of a stacked one): rows first."""
        shape = self.file.tensors[name].shape
        return tuple(shape[::-1] if expert is None else shape[-2::-1])

    def _part(self, name: str, expert: int | None) -> torch.Tensor:
        """One of the file's tensors (an expert's rows of a stacked one) that a HF tensor concatenates."""
        from gguf import GGMLQuantizationType, dequantize

        tensor = self.file.tensors[name]
        shape = self._shape(name, expert)
        rows = tensor_rows(self.file, tensor, expert, self.num_heads, self.num_kv_heads)
        qtype = GGMLQuantizationType[tensor.type_name]
        out = np.empty((len(rows), int(np.prod(shape)) // len(rows)), dtype=np.float32)
        # in chunks of rows: the gguf package's dequantization makes temporaries several times its input's size
        step = max(1, DEQUANTIZE_CHUNK_BYTES // rows.shape[1])
        for start in range(0, len(rows), step):
            out[start : start + step] = dequantize(np.ascontiguousarray(rows[start : start + step]), qtype)
        if self.file.architecture in NORM_OFFSET_ARCHITECTURES and "norm.weight" in name:
            out -= np.float32(1.0)
        return torch.from_numpy(out.reshape(shape))

    def __iter__(self) -> Iterator[str]:
        return iter(self._sources)

    def __len__(self) -> int:
        return len(self._sources)
