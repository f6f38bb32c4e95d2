"""HF checkpoint names and infer's decoder: ``WeightMap`` (which HF tensors fill each of our parameters, and how they
are converted; every model family's is one, ``infer.model.architecture.ModelArchitecture``) and the load."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from infer.kernels.cpu.blocks import BlockWeight

# Our fused parameters and the HF tensors they concatenate, in order (rows of the fused weight).
FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
# Tensors some HF checkpoints carry that hold nothing we load (recomputed RoPE tables).
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightMap:
    """A checkpoint's tensor names against our parameters' (Llama's by default: separate q/k/v and gate/up tensors
    concatenated into our fused projections)."""

    # Our parameters that concatenate several HF tensors (a checkpoint that already fuses them maps one to one).
    fused_projections: ClassVar[Mapping[str, tuple[str, ...]]] = FUSED_PROJECTIONS
    # Our module names within a layer whose HF name differs (``"post_attention_layernorm": "pre_feedforward_..."``).
    renamed: ClassVar[Mapping[str, str]] = {}

    @classmethod
    def hf_names(cls, name: str) -> list[str]:
        """The HF tensor names whose concatenation fills our parameter ``name``."""
        if name.startswith("lm_head."):
            return [name]
        for ours, theirs in cls.renamed.items():
            if f".{ours}." in name:
                name = name.replace(f".{ours}.", f".{theirs}.")
                break
        for fused, parts in cls.fused_projections.items():
            if f".{fused}." in name:
                return [f"model.{name.replace(fused, part)}" for part in parts]
        return [f"model.{name}"]

    @classmethod
    def checkpoint_tensors(cls, state_dict: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """The tensors of ``state_dict`` under the names ``hf_names`` gives, for a state dict that names or groups
        them otherwise (transformers' in-memory model stacking a mixture's experts); the default keeps it."""
        return state_dict

    @classmethod
    def convert_weight(cls, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor as our parameter ``name`` holds it (after concatenation); the default keeps it."""
        return tensor


@torch.no_grad()
def load_hf_state_dict(
    model: nn.Module,
    state_dict: Mapping[str, torch.Tensor],
    weight_map: type[WeightMap] = WeightMap,
    prepare_layer: Callable[[nn.Module], object] | None = None,
    bf16_weights: bool = False,
    keep_blocks: bool = False,
) -> None:
    """Copy HF-named weights into ``model``'s parameters as ``weight_map`` says (concatenating what our layout fuses),
    converting dtype and device. Raises ``ValueError`` naming any missing or unexpected tensors.

    ``prepare_layer`` is called with each decoder layer (``model.layers[i]``) as soon as its parameters are filled,
    in order: the engine packs a layer there, so one layer's float weights are alive at a time, not the model's
    (with a lazy ``state_dict``, ``read_safetensors``', the checkpoint is read a tensor at a time too).
    ``bf16_weights``: a bf16 checkpoint's matrices, every linear layer's weight and the vocabulary tables, are held as
    its bf16 tensors, never widened to float32 (2.5 GB apiece for the Qwen3-8B shape's table and untied head), for a
    model packed before it runs: packing reads them as they are (``infer.model.quantization``), and holds the tables
    so (``narrow_float_tables``). Other parameters (norms, biases, a router) are float32 as the model was built.
    ``keep_blocks``: a linear layer whose weight the checkpoint stores as blocks the kernels read (a source with
    ``block_weight``, ``BlockSource``: gpt-oss's MXFP4 experts) becomes a ``PackedLinear`` of those blocks before its
    layer is prepared, its weight never read into floats."""
    # A source whose every lookup is a new tensor (``GgufTensors``) lends it to the parameter instead of a copy: the
    # load then holds one float copy of a tensor at a time, not two (1.2 GB apiece for a 2,048-wide vocabulary table).
    from infer.model.quantization import pack_as_blocks

    lends = bool(getattr(state_dict, "fresh_tensors", False))
    state_dict = weight_map.checkpoint_tensors(state_dict)
    block_weight = getattr(state_dict, "block_weight", None) if keep_blocks else None
    kept: dict[str, BlockWeight] = {}  # linear layers (module names) of the current layer kept as blocks
    used: set[str] = set()
    missing: list[str] = []
    # Names, not parameters: a reference to each would keep alive the float weights a prepared layer let go.
    names = [name for name, _ in model.named_parameters()]
    layer: int | None = None
    for name in names:
        index = _layer_index(name)
        if layer is not None and index != layer:
            pack_as_blocks(model, kept)
            kept.clear()
            if prepare_layer is not None:
                prepare_layer(model.layers[layer])
        layer = index
        sources = weight_map.hf_names(name)
        blocks = block_weight(sources[0]) if block_weight is not None and len(sources) == 1 else None
        if blocks is not None and _is_linear_weight(model, name):
            kept[name.removesuffix(".weight")] = blocks
            used.update(sources)
        elif all(source in state_dict for source in sources):
            parts = [state_dict[source] for source in sources]
            if not (bf16_weights and _hold_bf16(model, name, parts, weight_map)):
                _fill(model.get_parameter(name), name, parts, weight_map, lends)
            used.update(sources)
        else:
            missing.extend(source for source in sources if source not in state_dict)
    pack_as_blocks(model, kept)
    if prepare_layer is not None and layer is not None:
        prepare_layer(model.layers[layer])
    tied = bool(getattr(model, "tie_word_embeddings", False))
    unexpected = [name for name in state_dict if name not in used and not _is_ignorable(name, tied)]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not fit the model config: missing {missing}, unexpected {unexpected}")


class BlockSource(Protocol):
    """A checkpoint source that gives some tensors as the block kernels' weights too (``load_hf_state_dict``'s
    ``keep_blocks``): ``block_weight(hf_name)`` is the tensor's blocks, or None where it is not stored as blocks."""

    def block_weight(self, hf_name: str) -> BlockWeight | None: ...


def _is_linear_weight(model: nn.Module, name: str) -> bool:
    owner, _, attribute = name.rpartition(".")
    return attribute == "weight" and isinstance(model.get_submodule(owner), nn.Linear)


def _layer_index(name: str) -> int | None:
    """The decoder layer a parameter name is under (``layers.3.mlp...`` -> 3), else None."""
    if not name.startswith("layers."):
        return None
    return int(name.split(".", 2)[1])


# Our parameters that are vocabulary tables (``bf16_weights`` holds them as the checkpoint's bf16, as it does every
# linear layer's weight).
TABLES = ("embed_tokens.weight", "lm_head.weight")


def _hold_bf16(model: nn.Module, name: str, parts: list[torch.Tensor], weight_map: type[WeightMap]) -> bool:
    """Make the checkpoint's bf16 tensors (concatenated where our layout fuses them) the matrix ``name``, in every
    module holding it (a tied head too), and say whether it did: only a vocabulary table or a linear layer's weight
    whose tensors are all bf16 and, converted by the family's map, still bf16 and of the parameter's shape."""
    parameter = model.get_parameter(name)
    owner_name = name.rpartition(".")[0]
    matrix = name in TABLES or _is_linear_weight(model, name)
    if not matrix or any(part.dtype != torch.bfloat16 for part in parts):
        return False
    # One tensor is copied: the checkpoint's is a view of the file's mapping, which would stay mapped (and the pages
    # read so far counted as the process's) as long as it lives. A concatenation is a new tensor already.
    held = torch.cat(parts) if len(parts) > 1 else torch.empty_like(parts[0]).copy_(parts[0])
    held = weight_map.convert_weight(name, held)
    if held.dtype != torch.bfloat16 or held.shape != parameter.shape:
        return False
    held = nn.Parameter(held.to(parameter.device), requires_grad=False)
    owners = model.modules() if name in TABLES else [model.get_submodule(owner_name)]
    for module in owners:
        if getattr(module, "weight", None) is parameter:
            module.weight = held
    return True


def _fill(
    parameter: torch.Tensor, name: str, parts: list[torch.Tensor], weight_map: type[WeightMap], lends: bool = False
) -> None:
    """``parameter`` from its checkpoint tensors, concatenated by rows. Where the map converts nothing, each part is
    copied straight into its rows: no concatenated copy (of a checkpoint of 1.7B bf16 weights, 2.2 s of a start).
    ``lends``: a single part of the parameter's dtype, shape and layout becomes its storage, uncopied."""
    converts = weight_map.convert_weight.__func__ is not WeightMap.convert_weight.__func__
    part = parts[0]
    if lends and len(parts) == 1 and not converts and part.dtype == parameter.dtype and part.device == parameter.device:
        if part.shape == parameter.shape and part.is_contiguous():
            parameter.data = part
            return
    rows = sum(part.shape[0] for part in parts)
    if converts or not parts[0].dim() or rows != parameter.shape[0]:  # (a wrong shape: copy_ names it)
        parameter.copy_(weight_map.convert_weight(name, parts[0] if len(parts) == 1 else torch.cat(parts)))
        return
    start = 0
    for part in parts:
        parameter[start : start + part.shape[0]].copy_(part)
        start += part.shape[0]


def _is_ignorable(hf_name: str, tied: bool) -> bool:
    # Tied checkpoints may still carry an lm_head copy of the embedding.
    return hf_name.endswith(_IGNORED_HF_SUFFIXES) or (tied and hf_name == "lm_head.weight")
