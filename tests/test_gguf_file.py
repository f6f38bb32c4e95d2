"""``infer.model.gguf_file``: the header reader that keeping a GGUF file's blocks uses, held to the gguf package's
reader on files its writer wrote (every metadata value type, string arrays, 3-D tensors, another alignment) and on
the default model's file, and refusing broken files with one line; the conversion of a file into a HF folder
parses it once."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from infer.model.gguf_file import GgufFile, GgufFormatError
from infer.model.loader import DEFAULT_MODEL, _gguf_parsed_once, resolve_model_path
from infer.testing.kquants import QUANTIZERS


def write_tensors(path, architecture: str, tensors, metadata=None):
    """A GGUF file of ``tensors`` (``(name, GGUF type name, shape)`` each, random values; K types quantized by
    ``infer.testing.kquants``) after the values ``metadata(writer)`` adds."""
    writer = gguf.GGUFWriter(path, architecture)
    if metadata is not None:
        metadata(writer)
    rng = np.random.default_rng(0)
    for name, type_name, shape in tensors:
        values = rng.standard_normal(shape).astype(np.float32)
        kind = gguf.GGMLQuantizationType[type_name]
        if kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, values)
        elif kind == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, values.astype(np.float16))
        elif type_name.lower() in QUANTIZERS:  # K types, which the gguf package does not quantize to
            writer.add_tensor(name, QUANTIZERS[type_name.lower()](values), raw_dtype=kind)
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def every_value_type(writer, alignment: int | None = None) -> None:
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint8("t.u8", 7)
    writer.add_int16("t.i16", -3)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int64("t.i64", -(1 << 40))
    writer.add_float32("t.f32", 0.5)
    writer.add_float64("t.f64", -2.25)
    writer.add_bool("t.bool", True)
    writer.add_string("t.name", "blocks é")
    writer.add_array("t.tokens", ["<s>", "héllo", "", "world"] * 50)
    writer.add_array("t.scores", [0.5, 1.5, -2.0])
    writer.add_array("t.nested", [[1, 2], [3]])


def write_file(path, alignment: int | None = None):
    tensors = [
        ("blk.0.attn_q.weight", "Q4_1", (16, 256)),
        ("blk.0.attn_v.weight", "Q6_K", (4, 512)),
        ("blk.0.ffn_up.weight", "Q8_0", (24, 64)),
        ("blk.0.attn_norm.weight", "F32", (64,)),
        ("blk.0.ffn_up_exps.weight", "Q4_0", (3, 8, 32)),
        ("token_embd.weight", "F16", (10, 32)),
    ]
    return write_tensors(path, "qwen3", tensors, lambda writer: every_value_type(writer, alignment))


def assert_reads_as_gguf_does(path):
    ours, theirs = GgufFile(path), gguf.GGUFReader(path)
    assert ours.architecture == theirs.fields["general.architecture"].contents()
    assert list(ours.tensors) == [tensor.name for tensor in theirs.tensors]
    for tensor in theirs.tensors:
        mine = ours.tensors[tensor.name]
        assert mine.type_name == tensor.tensor_type.name
        assert mine.shape == tuple(int(size) for size in tensor.shape)
        expected = np.asarray(tensor.data).view(np.uint8).reshape(mine.rows, -1)
        assert np.array_equal(ours.data(mine), expected), tensor.name
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):  # the reader's own header entries
            continue
        value = ours.metadata[key]
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            assert value is None  # arrays are stepped over
        else:
            assert value == field.contents(), key
    return ours


@pytest.mark.parametrize("alignment", [None, 64])
def test_reads_the_metadata_and_tensors_the_gguf_package_reads(tmp_path, alignment):
    ours = assert_reads_as_gguf_does(write_file(tmp_path / "file.gguf", alignment))
    assert ours.metadata["t.name"] == "blocks é" and ours.metadata["t.u32"] == 4_000_000_000
    assert ours.tensors["blk.0.ffn_up_exps.weight"].rows == 24


def test_reads_the_default_models_file_as_the_gguf_package_does():
    assert_reads_as_gguf_does(resolve_model_path(DEFAULT_MODEL))


def test_broken_files_are_refused_with_one_line(tmp_path):
    good = write_file(tmp_path / "good.gguf").read_bytes()
    cases = {
        "empty.gguf": (b"", "too short"),
        "text.gguf": (b"this is not a model file at all", "not a GGUF file"),
        "cut.gguf": (good[:200], "ends inside its header"),
        "version.gguf": (good[:4] + (9).to_bytes(4, "little") + good[8:], "GGUF version 9"),
        "big-endian.gguf": (good[:4] + (3).to_bytes(4, "big") + good[8:], "little-endian"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(GgufFormatError, match=message) as error:
            GgufFile(path)
        assert "\n" not in str(error.value) and name in str(error.value)
    cut = tmp_path / "data-cut.gguf"
    cut.write_bytes(good[:-100])
    file = GgufFile(cut)
    with pytest.raises(GgufFormatError, match="runs past the end of the file"):
        file.data(file.tensors["token_embd.weight"])


def test_a_conversion_parses_a_file_once_and_leaves_the_gguf_package_as_it_was(tmp_path):
    """transformers asks ``gguf.GGUFReader`` for the same file three times while converting it (config, tokenizer,
    weights) and ``gguf.get_tensor_name_map`` once per module: within the conversion both answer from the first call,
    and afterwards, on an error too, gguf's own are back."""
    path = write_file(tmp_path / "model.gguf")
    own = gguf.GGUFReader, gguf.get_tensor_name_map
    with pytest.raises(RuntimeError, match="conversion failed"):
        with _gguf_parsed_once():
            first = gguf.GGUFReader(path)
            assert isinstance(first, own[0]) and gguf.GGUFReader(str(path)) is first
            assert gguf.GGUFReader(write_file(tmp_path / "other.gguf")) is not first
            names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, 2)
            assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, 2) is names
            raise RuntimeError("conversion failed")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == own
