"""``DecoderSpec``: infer's decoder as a model family configures it, and ``RotaryTable``, one of its RoPE tables. A
family's ``infer.model.architecture.ModelArchitecture`` builds the spec from a HF config; ``infer.model.CausalLM``
builds the layers from it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import torch

from infer.attention import LayerAttention


@dataclass(frozen=True, eq=False)
class RotaryTable:
    """One RoPE table's rotation speeds ``[rotary_dim // 2]`` (float32) and the factor cos/sin are scaled by. A
    ``rotary_dim`` below ``head_dim`` rotates the first ``rotary_dim`` features of each head (partial rotary)."""

    inverse_frequencies: torch.Tensor
    scaling: float = 1.0

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inverse_frequencies.numel()


@dataclass(frozen=True, eq=False)
class DecoderSpec:
    """infer's decoder as a family configures it: what ``infer.model.CausalLM`` builds.

    Every layer is pre-norm attention then a gated MLP, with the residual stream beside the layers' outputs;
    ``layer_attention[i]`` and ``rotary[layer_rotary[i]]`` are layer ``i``'s attention and RoPE table."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_positions: int
    rotary: tuple[RotaryTable, ...]
    layer_rotary: tuple[int, ...]
    layer_attention: tuple[LayerAttention, ...]
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    output_bias: bool = False
    mlp_bias: bool = False
    activation: Literal["silu", "gelu_tanh"] = "silu"  # the gate's: SwiGLU or GeGLU (tanh-approximated GELU)
    head_norms: bool = False  # an RMSNorm over head_dim on every query and key head, before RoPE (Qwen3, Gemma 3)
    output_norms: bool = False  # norms on the attention's and the MLP's outputs before each residual add (Gemma 3)
    embedding_scale: float | None = None  # embeddings times this, rounded to the weights' dtype first (Gemma)

    def __post_init__(self):
        if len(self.layer_attention) != self.num_layers or len(self.layer_rotary) != self.num_layers:
            raise ValueError(f"a decoder spec needs one attention and one RoPE table per layer ({self.num_layers}); "
                             f"got {len(self.layer_attention)} and {len(self.layer_rotary)}")
        if any(not 0 <= index < len(self.rotary) for index in self.layer_rotary):
            raise ValueError(f"layer_rotary indexes {len(self.rotary)} RoPE tables: {self.layer_rotary}")
        if any(table.rotary_dim > self.head_dim for table in self.rotary):
            raise ValueError(f"a RoPE table rotates more than head_dim {self.head_dim} features")

    def replace(self, **changes: Any) -> DecoderSpec:
        return dataclasses.replace(self, **changes)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: full attention)."""
        return tuple(layer.window for layer in self.layer_attention)
