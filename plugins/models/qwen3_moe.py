"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k head norms, explicit ``head_dim``) with a
mixture of experts in place of the MLP in the sparse layers: every ``decoder_sparse_step``-th layer except those in
``mlp_only_layers`` (all of them in the released models). The router is a linear layer without bias; a token's
expert weights are the softmax in float32 over all experts, its top ``num_experts_per_tok``, renormalized when
``norm_topk_prob``; the experts are SwiGLU MLPs of ``moe_intermediate_size``; no shared expert.

Checkpoints name each expert's tensors ``mlp.experts.N.{gate,up,down}_proj.weight`` and the router ``mlp.gate``;
transformers' in-memory model stacks the experts instead (``mlp.experts.gate_up_proj`` ``[experts, 2 * width,
hidden]``, ``mlp.experts.down_proj`` ``[experts, hidden, width]``), which ``split_stacked_experts`` takes apart."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from infer.model import DecoderSpec, ModelArchitecture
from infer.model.hf_weights import FUSED_PROJECTIONS
from infer.model.spec import ExpertsSpec


class Qwen3MoeArchitecture(ModelArchitecture):
    """Qwen3-MoE checkpoints (``Qwen3MoeForCausalLM``)."""

    model_types = ("qwen3_moe",)
    architectures = ("Qwen3MoeForCausalLM",)
    # An expert's gate and up projections fill its fused gate_up_proj, as a dense MLP's do.
    fused_projections = {**FUSED_PROJECTIONS, "gate_up_proj": ("gate_proj", "up_proj")}
    renamed = {"mlp.router": "mlp.gate"}

    @classmethod
    def decoder_spec(cls, hf_config: Any, max_positions: int | None = None) -> DecoderSpec:
        spec = super().decoder_spec(hf_config, max_positions).replace(head_norms=True)
        return spec.replace(experts=experts_spec(hf_config)) if hf_config.num_experts else spec

    @classmethod
    def checkpoint_tensors(cls, state_dict: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        return split_stacked_experts(state_dict)


def experts_spec(hf_config: Any) -> ExpertsSpec:
    """Qwen3-MoE's experts and which layers are sparse (transformers' rule: ``(i + 1) % decoder_sparse_step == 0``
    and ``i`` not in ``mlp_only_layers``)."""
    step = hf_config.decoder_sparse_step
    dense = set(hf_config.mlp_only_layers or ())
    sparse = frozenset(
        index for index in range(hf_config.num_hidden_layers) if index not in dense and (index + 1) % step == 0
    )
    return ExpertsSpec(
        num_experts=hf_config.num_experts,
        top_k=hf_config.num_experts_per_tok,
        intermediate_size=hf_config.moe_intermediate_size,
        sparse_layers=sparse,
        norm_topk_prob=bool(hf_config.norm_topk_prob),
    )


def split_stacked_experts(state_dict: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """``state_dict`` with transformers' stacked expert tensors split into a checkpoint's per-expert names; one with
    none (a checkpoint's own per-expert names, a GGUF file's ``GgufTensors``) as it is, still read a tensor at a
    time."""
    stacked = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
    if not any(name.endswith(stacked) for name in state_dict):
        return state_dict
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            for expert, gate_up in enumerate(tensor):
                gate, up = gate_up.chunk(2)
                out[f"{prefix}{expert}.gate_proj.weight"], out[f"{prefix}{expert}.up_proj.weight"] = gate, up
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for expert, down in enumerate(tensor):
                out[f"{prefix}{expert}.down_proj.weight"] = down
        else:
            out[name] = tensor
    return out
