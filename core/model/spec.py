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


@dataclass(frozen=True)
class ExpertsSpec:
    """A mixture-of-experts feed-forward: a router scores ``num_experts`` gated MLPs per token and each token's output
    is the weighted sum of its ``top_k`` best (``infer.model.moe.MoE``).

    ``router``: how the scores become weights. ``softmax_topk`` (Qwen3-MoE): softmax in float32 over all experts,
    then the top ``top_k``, renormalized to sum to one when ``norm_topk_prob``; ``topk_softmax`` (gpt-oss): the top
    ``top_k`` raw scores, then softmax over those. ``sparse_layers``: the layers whose feed-forward is the experts;
    the others keep the dense MLP of ``DecoderSpec.intermediate_size``. ``bias``: the router and every expert's
    projections carry biases (gpt-oss).

    ``activation``: an expert's, on its gate and up halves. ``silu``: SwiGLU, ``silu(gate) * up``.
    ``clamped_swiglu`` (gpt-oss): gate clamped to at most ``swiglu_limit``, up to ``[-swiglu_limit,
    swiglu_limit]``, then ``(up + 1) * gate * sigmoid(swiglu_alpha * gate)``."""

    num_experts: int
    top_k: int
    intermediate_size: int
    sparse_layers: frozenset[int]
    norm_topk_prob: bool = False
    router: Literal["softmax_topk", "topk_softmax"] = "softmax_topk"
    bias: bool = False
    activation: Literal["silu", "clamped_swiglu"] = "silu"
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702

    def __post_init__(self):
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be between 1 and num_experts {self.num_experts}")


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
    experts: ExpertsSpec | None = None  # a mixture of experts in place of the MLP in its sparse layers (Qwen3-MoE)

    def __post_init__(self):
        if len(self.layer_attention) != self.num_layers or len(self.layer_rotary) != self.num_layers:
            raise ValueError(
                f"a decoder spec needs one attention and one RoPE table per layer ({self.num_layers}); "
                f"got {len(self.layer_attention)} and {len(self.layer_rotary)}"
            )
        if any(not 0 <= index < len(self.rotary) for index in self.layer_rotary):
            raise ValueError(f"layer_rotary indexes {len(self.rotary)} RoPE tables: {self.layer_rotary}")
        if any(table.rotary_dim > self.head_dim for table in self.rotary):
            raise ValueError(f"a RoPE table rotates more than head_dim {self.head_dim} features")

    def is_sparse(self, layer_index: int) -> bool:
        """Whether layer ``layer_index``'s feed-forward is a mixture of experts."""
        return self.experts is not None and layer_index in self.experts.sparse_layers

    def replace(self, **changes: Any) -> DecoderSpec:
        return dataclasses.replace(self, **changes)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: full attention)."""
        return tuple(layer.window for layer in self.layer_attention)
