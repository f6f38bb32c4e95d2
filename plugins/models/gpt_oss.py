"""gpt-oss (gpt-oss-20b, gpt-oss-120b): biases on the Q/K/V and output projections, a learned sink logit per query
head in every layer's softmax, layers alternating between a sliding window (128 tokens in the released models) and
full attention as ``layer_types`` says, YaRN RoPE (factor 32 over 4,096 positions, the ramp not truncated), and a
mixture of experts in every layer: a router with a bias whose top ``num_experts_per_tok`` raw scores are softmaxed,
and experts whose gate is clamped to at most ``swiglu_limit``, whose up is clamped to ``[-limit, limit]``, giving
``(up + 1) * gate * sigmoid(swiglu_alpha * gate)``, with biases on both projections.

Checkpoints stack each layer's experts: ``mlp.experts.gate_up_proj`` ``[experts, hidden, 2 * width]`` (multiplied
from the left, gate and up interleaved: gate the even columns, up the odd ones), ``mlp.experts.down_proj``
``[experts, width, hidden]`` and their ``_bias`` tensors. ``split_experts`` presents them as one expert's
``[out, in]`` weights with gate's rows first, converted when the loader reads each one. OpenAI's released checkpoints
store the expert weights in MXFP4 (``_blocks``: two 4-bit e2m1 values a byte; ``_scales``: a power of two for each
32 values); those are dequantized to bfloat16 as each expert is read, exactly (every MXFP4 value is a bfloat16), or,
where the load keeps blocks (``model.quantization: auto``), given as the block kernels' ``mxfp4`` weights
(``ExpertTensors.block_weight``), never dequantized."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from functools import partial
from typing import Any

import torch

from infer.attention import LayerAttention
from infer.kernels.cpu.blocks import E8M0_BIAS, FP4_VALUES, BlockWeight, mxfp4_gguf_blocks, pack_blocks
from infer.model import DecoderSpec, ModelArchitecture
from infer.model.spec import ExpertsSpec

EXPERTS = "mlp.experts."
# The stacked expert tensors of a layer, by their name after ``mlp.experts.``.
STACKED_KINDS = (
    "gate_up_proj",
    "gate_up_proj_bias",
    "down_proj",
    "down_proj_bias",
    "gate_up_proj_blocks",
    "down_proj_blocks",
)


class GptOssArchitecture(ModelArchitecture):
    """gpt-oss checkpoints (``GptOssForCausalLM``, ``model_type`` gpt_oss)."""

    model_types = ("gpt_oss",)
    architectures = ("GptOssForCausalLM",)

    @classmethod
    def decoder_spec(cls, hf_config: Any, max_positions: int | None = None) -> DecoderSpec:
        spec = super().decoder_spec(hf_config, max_positions)
        layers = tuple(
            LayerAttention(window=layer.window, scale=layer.scale, sinks=True) for layer in spec.layer_attention
        )
        return spec.replace(layer_attention=layers, experts=experts_spec(hf_config))

    @classmethod
    def checkpoint_tensors(cls, state_dict: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        return split_experts(state_dict)


def experts_spec(hf_config: Any) -> ExpertsSpec:
    """gpt-oss's experts: in every layer, top-k on the raw router scores then softmax over those, biases, the clamped
    SwiGLU (``swiglu_alpha`` is 1.702 where the config predates the field)."""
    return ExpertsSpec(
        num_experts=hf_config.num_local_experts,
        top_k=hf_config.num_experts_per_tok,
        intermediate_size=hf_config.intermediate_size,
        sparse_layers=frozenset(range(hf_config.num_hidden_layers)),
        router="topk_softmax",
        bias=True,
        activation="clamped_swiglu",
        swiglu_limit=float(hf_config.swiglu_limit),
        swiglu_alpha=float(getattr(hf_config, "swiglu_alpha", 1.702)),
    )


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """MXFP4 values as ``dtype``: ``blocks`` ``[..., groups, 16]`` uint8 (each byte two e2m1 values, the low nibble
    first), ``scales`` ``[..., groups]`` uint8 (each group's power of two, biased by 127); ``[..., groups * 32]``."""
    table = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()  # [..., groups, 32]
    exponents = scales.to(torch.int32).unsqueeze(-1) - E8M0_BIAS
    return torch.ldexp(table[codes], exponents).flatten(-2).to(dtype)


def gate_first(tensor: torch.Tensor) -> torch.Tensor:
    """Rows (or entries) interleaved gate, up, gate, up, ... reordered to all gate's then all up's."""
    return torch.cat((tensor[0::2], tensor[1::2]))


class ExpertTensors(Mapping):
    """A checkpoint's tensors with each stacked expert tensor presented as one tensor per expert under the names
    ``hf_names`` gives infer's experts (``...mlp.experts.3.gate_up_proj.weight``); an expert's tensor is converted
    when it is read, so loading holds one expert's converted weights at a time beside the model. An MXFP4 expert
    weight is also given as its blocks (``block_weight``: ``infer.model.hf_weights.BlockSource``)."""

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor | Callable[[], torch.Tensor]],
        blocks: Mapping[str, Callable[[], BlockWeight]] | None = None,
    ):
        self.tensors = tensors
        self.blocks = blocks or {}

    def block_weight(self, name: str) -> BlockWeight | None:
        """The weight ``name`` as the block kernels' ``mxfp4`` blocks, where the checkpoint stores it in MXFP4."""
        make = self.blocks.get(name)
        return None if make is None else make()

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self.tensors[name]
        return tensor() if callable(tensor) else tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


def split_experts(state_dict: Mapping[str, torch.Tensor]) -> ExpertTensors:
    """``state_dict`` with gpt-oss's stacked expert tensors (float, or MXFP4 ``_blocks`` with their ``_scales``)
    presented per expert in infer's layout: ``[out, in]`` weights, gate's rows and bias entries before up's. MXFP4
    blocks without their scales are left as they are, so the load names them as unexpected."""
    tensors: dict[str, torch.Tensor | Callable[[], torch.Tensor]] = {}
    blocks: dict[str, Callable[[], BlockWeight]] = {}
    for name in state_dict:  # a tensor is looked up only where it is a stacked one: others are read when loaded
        prefix, found, kind = name.rpartition(EXPERTS)
        if found and kind.endswith("_scales") and name.removesuffix("_scales") + "_blocks" in state_dict:
            continue  # read with its blocks
        if not found or kind not in STACKED_KINDS:
            tensors[name] = partial(state_dict.__getitem__, name)
            continue
        tensor = state_dict[name]
        scales = state_dict.get(name.removesuffix("_blocks") + "_scales") if kind.endswith("_blocks") else None
        convert = expert_converter(kind, tensor, scales)
        if convert is None:
            tensors[name] = tensor
            continue
        projection = kind.removesuffix("_blocks").removesuffix("_bias")
        parameter = "bias" if kind.endswith("_bias") else "weight"
        for expert in range(tensor.shape[0]):
            expert_name = f"{prefix}{EXPERTS}{expert}.{projection}.{parameter}"
            tensors[expert_name] = partial(convert, expert)
            if scales is not None:
                blocks[expert_name] = partial(mxfp4_expert, projection, tensor, scales, expert)
    return ExpertTensors(tensors, blocks)


def mxfp4_expert(projection: str, stacked: torch.Tensor, scales: torch.Tensor, expert: int) -> BlockWeight:
    """One expert's MXFP4 ``projection`` (``gate_up_proj``: gate's rows first) as the block kernels' ``mxfp4`` weight,
    from the checkpoint's stacked ``_blocks`` ``[experts, out, groups, 16]`` and ``_scales`` ``[experts, out,
    groups]``: the blocks run along the input, so reordering rows moves whole blocks."""
    rows, row_scales = stacked[expert], scales[expert]
    if projection == "gate_up_proj":
        rows, row_scales = gate_first(rows), gate_first(row_scales)
    return pack_blocks(mxfp4_gguf_blocks(rows, row_scales), "mxfp4", rows.shape[0])


def expert_converter(
    kind: str, stacked: torch.Tensor, scales: torch.Tensor | None
) -> Callable[[int], torch.Tensor] | None:
    """How one expert's tensor in infer's layout comes out of the ``stacked`` tensor named ``...mlp.experts.<kind>``
    (with ``scales``: MXFP4 blocks), or None where ``kind`` is not a stacked expert tensor infer reads."""
    match kind:
        case "gate_up_proj":
            return lambda expert: gate_first(stacked[expert].T)
        case "gate_up_proj_bias":
            return lambda expert: gate_first(stacked[expert])
        case "down_proj":
            return lambda expert: stacked[expert].T
        case "down_proj_bias":
            return lambda expert: stacked[expert]
        case "gate_up_proj_blocks" if scales is not None:
            return lambda expert: gate_first(dequantize_mxfp4(stacked[expert], scales[expert]))
        case "down_proj_blocks" if scales is not None:
            return lambda expert: dequantize_mxfp4(stacked[expert], scales[expert])
    return None
