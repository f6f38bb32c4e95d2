"""A GGUF file's metadata and tensor directory, read in one pass over its header.

``gguf.GGUFReader`` builds a numpy view for every part of every metadata value: on a file with a tokenizer of 49,152
tokens and as many merges that is over a million views and seconds of startup. Keeping a file's blocks needs its
architecture and its tensors' types, shapes and bytes; this reads the header with ``struct`` from a read-only map
of the file, stepping over the arrays it does not keep, and a tensor's bytes are slices of the same map. The type
table (block size and bytes per block) is the gguf package's.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF metadata value types (gguf.GGUFValueType) of fixed size: struct format by type number.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class GgufFormatError(ValueError):
    """The file is not a GGUF file this reader understands; the message names the file and what is wrong."""


@dataclass(frozen=True, slots=True)
class GgufTensor:
    """One tensor of the directory: ``shape`` in GGUF's order (columns first, as ``gguf.ReaderTensor.shape``),
    ``type_name`` the GGML type's name (``Q4_K``, ``F32``), ``offset`` from the start of the file."""

    name: str
    shape: tuple[int, ...]
    type_name: str
    offset: int
    nbytes: int

    @property
    def rows(self) -> int:
        """Rows of the stored matrix: the product of every dimension but the first."""
        return int(np.prod(self.shape[1:], dtype=np.int64)) if len(self.shape) > 1 else 1


class GgufFile:
    """``metadata`` (the scalar and string values; arrays are skipped) and ``tensors`` by name, from one read of the
    header of the GGUF file at ``path``; ``data(tensor)`` maps a tensor's bytes, read-only, as ``[rows, bytes]``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if self.path.stat().st_size < 24:  # magic, version and two counts
            raise GgufFormatError(f"{self.path.name}: too short for a GGUF file ({self.path.stat().st_size} bytes)")
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._buffer = memoryview(self._map)
        self.metadata: dict[str, object] = {}
        self.tensors: dict[str, GgufTensor] = {}
        self._read()

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def data(self, tensor: GgufTensor) -> np.ndarray:
        if tensor.offset + tensor.nbytes > len(self._map):
            raise GgufFormatError(f"{self.path.name}: tensor {tensor.name} runs past the end of the file")
        return self._map[tensor.offset : tensor.offset + tensor.nbytes].reshape(tensor.rows, -1)

    def _read(self) -> None:
        self._at = 0
        if bytes(self._take(4)) != MAGIC:
            raise GgufFormatError(f"{self.path.name}: not a GGUF file (no GGUF magic at its start)")
        version, tensor_count, kv_count = self._unpack("<IQQ")
        if version not in (2, 3):
            raise GgufFormatError(
                f"{self.path.name}: GGUF version {version} (a big-endian file reads as a huge one); "
                "versions 2 and 3, little-endian, are read"
            )
        for _ in range(kv_count):
            key = self._string()
            self.metadata[key] = self._value(self._unpack("<I")[0])
        infos = []
        for _ in range(tensor_count):
            name = self._string()
            (dims,) = self._unpack("<I")
            shape = self._unpack(f"<{dims}Q")
            type_number, offset = self._unpack("<IQ")
            infos.append((name, shape, type_number, offset))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-self._at // alignment) * alignment
        for name, shape, type_number, offset in infos:
            try:
                kind = GGMLQuantizationType(type_number)
            except ValueError:
                raise GgufFormatError(f"{self.path.name}: tensor {name} has unknown GGML type {type_number}") from None
            block, block_bytes = GGML_QUANT_SIZES[kind]
            elements = int(np.prod(shape, dtype=np.int64))
            self.tensors[name] = GgufTensor(
                name, tuple(shape), kind.name, start + offset, elements // block * block_bytes
            )

    def _take(self, size: int) -> memoryview:
        if self._at + size > len(self._buffer):
            raise GgufFormatError(f"{self.path.name}: the file ends inside its header")
        view = self._buffer[self._at : self._at + size]
        self._at += size
        return view

    def _unpack(self, fmt: str) -> tuple:
        return struct.unpack(fmt, self._take(struct.calcsize(fmt)))

    def _string(self) -> str:
        (length,) = self._unpack("<Q")
        return bytes(self._take(length)).decode("utf-8", errors="replace")

    def _value(self, value_type: int) -> object:
        if value_type in _SCALARS:
            return self._unpack("<" + _SCALARS[value_type])[0]
        if value_type == _STRING:
            return self._string()
        if value_type != _ARRAY:
            raise GgufFormatError(f"{self.path.name}: unknown GGUF value type {value_type}")
        item_type, count = self._unpack("<IQ")
        if item_type in _SCALARS:  # stepped over whole
            self._take(count * struct.calcsize(_SCALARS[item_type]))
        else:  # strings (a tokenizer's vocabulary and merges) or nested arrays: one at a time
            for _ in range(count):
                self._value(item_type)
        return None
