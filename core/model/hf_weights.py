"""HF checkpoint names and our fused layout: which HF tensors fill each of our parameters, and the load."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

# HF projections that our fused projections concatenate, in order (rows of the fused weight).
FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
# Tensors some HF checkpoints carry that hold nothing we load (recomputed RoPE tables).
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


@torch.no_grad()
def load_hf_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy HF-named weights into ``model``'s parameters (fusing Q/K/V and gate/up), converting dtype and device.
    Raises ``ValueError`` naming any missing or unexpected tensors."""
    used: set[str] = set()
    missing: list[str] = []
    for name, parameter in model.named_parameters():
        sources = hf_names(name)
        if all(source in state_dict for source in sources):
            parameter.copy_(torch.cat([state_dict[source] for source in sources]))
            used.update(sources)
        else:
            missing.extend(source for source in sources if source not in state_dict)
    tied = bool(getattr(model, "tie_word_embeddings", False))
    unexpected = [name for name in state_dict if name not in used and not _is_ignorable(name, tied)]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not fit the model config: missing {missing}, unexpected {unexpected}")


def hf_names(name: str) -> list[str]:
    """The HF tensor names whose concatenation fills our parameter ``name``."""
    if name.startswith("lm_head."):
        return [name]
    for fused, parts in FUSED_PROJECTIONS.items():
        if f".{fused}." in name:
            return [f"model.{name.replace(fused, part)}" for part in parts]
    return [f"model.{name}"]


def _is_ignorable(hf_name: str, tied: bool) -> bool:
    # Tied checkpoints may still carry an lm_head copy of the embedding.
    return hf_name.endswith(_IGNORED_HF_SUFFIXES) or (tied and hf_name == "lm_head.weight")
