"""A GGUF file's tensors under the HF names a model family reads (``GgufTensors``), each dequantized as it is looked
up: a load holds one tensor's float weights at a time, not a float copy of the whole model, and writes nothing to
disk.

Read so for the architectures whose GGUF tensors are the HF checkpoint's under the gguf package's standard names
(``DIRECT_ARCHITECTURES``), with what transformers' GGUF loader does to them: Llama's Q and K rows permuted back
(``gguf_blocks.tensor_rows``), a mixture's experts taken from the file's stacked tensors. A file of another
architecture goes through transformers' conversion to a HF folder (``infer.model.loader``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np
import torch

from infer.model.gguf_blocks import _header, gguf_source, tensor_name_map, tensor_rows

# GGUF architectures (``general.architecture``) read by ``GgufTensors``.
DIRECT_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe")


def reads_directly(path: Path) -> bool:
    """Whether the GGUF file's weights are read by ``GgufTensors`` (its architecture is in ``DIRECT_ARCHITECTURES``)."""
    return _header(path).architecture in DIRECT_ARCHITECTURES


class GgufTensors(Mapping[str, torch.Tensor]):
    """The tensors of the GGUF file at ``path`` that the HF names ``hf_names`` map to (names the file lacks are not
    keys), as float32 tensors of the HF checkpoint's shapes, dequantized by the gguf package (transformers' values,
    bit for bit) when looked up. ``num_heads`` and ``num_kv_heads`` place Llama's permuted Q and K rows."""

    def __init__(self, path: Path, hf_names: Iterable[str], num_layers: int, num_heads: int, num_kv_heads: int):
        self.file = _header(path)
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        names = tensor_name_map(self.file, num_layers)
        self._sources: dict[str, tuple[str, int | None]] = {}
        for hf_name in hf_names:
            try:
                source = gguf_source(names, hf_name)
            except ValueError:  # no GGUF name for it: a key this mapping lacks, as the file does
                continue
            if source[0] in self.file.tensors:
                self._sources[hf_name] = source
        if not self._sources:
            raise ValueError(f"{self.file.path.name}: none of its tensors has a name the model reads")

    def __getitem__(self, hf_name: str) -> torch.Tensor:
        from gguf import GGMLQuantizationType, dequantize

        name, expert = self._sources[hf_name]
        tensor = self.file.tensors[name]
        rows = tensor_rows(self.file, tensor, expert, self.num_heads, self.num_kv_heads)
        values = dequantize(np.ascontiguousarray(rows), GGMLQuantizationType[tensor.type_name])
        if not values.flags.writeable or values.dtype != np.float32:  # F32: a view of the file's map; copied
            values = np.array(values, dtype=np.float32)
        shape = tensor.shape[::-1] if expert is None else tensor.shape[1::-1]  # HF's order: rows first
        return torch.from_numpy(values.reshape(shape))

    def __iter__(self) -> Iterator[str]:
        return iter(self._sources)

    def __len__(self) -> int:
        return len(self._sources)
