"""Sharding a model's weights for tensor parallelism: a rank keeps its plan's heads, MLP and expert columns and
vocabulary."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from infer.distributed import ShardPlan, TensorParallelGroup
from infer.model.layers import Linear
from infer.model.moe import MoE

if TYPE_CHECKING:
    from infer.model.decoder import MLP, CausalLM, DecoderLayer
    from infer.model.moe import Expert


@torch.no_grad()
def shard_model(model: CausalLM, plan: ShardPlan, group: TensorParallelGroup) -> CausalLM:
    """Keep ``plan``'s share of ``model``'s weights (in place, before quantization): each layer's (``shard_layer``;
    a layer already sharded as it was read is left as it is), the output head's vocabulary rows (untied from the
    embedding, which stays whole)."""
    for layer in model.layers:
        if not layer.sharded:
            shard_layer(layer, plan, group)
    model.lm_head = _take_rows(model.lm_head, torch.arange(plan.vocab.start, plan.vocab.stop))
    model.tie_word_embeddings = False
    model.num_heads, model.num_kv_heads = len(plan.q_heads), len(plan.kv_heads)
    model.tensor_parallel = group
    return model


@torch.no_grad()
def shard_layer(layer: DecoderLayer, plan: ShardPlan, group: TensorParallelGroup) -> DecoderLayer:
    """Keep ``plan``'s share of one decoder layer (in place, before quantization: a load can shard each layer as soon
    as it is read): its heads and MLP columns. A mixture of experts keeps every expert and its whole router, with the
    rank's columns of each expert (``ShardPlan.expert_columns``): every rank routes each token alike, and the layer's
    output is a partial sum all-reduced as a dense MLP's."""
    attn, mlp = layer.self_attn, layer.mlp
    q_rows, kv_rows = _head_rows(plan.q_heads, attn.head_dim), _head_rows(plan.kv_heads, attn.head_dim)
    attn.qkv_proj = _take_rows(
        attn.qkv_proj, torch.cat([q_rows, attn.q_size + kv_rows, attn.q_size + attn.kv_size + kv_rows])
    )
    attn.o_proj = _take_columns(attn.o_proj, q_rows, keep_bias=plan.rank == 0)
    if attn.sinks is not None:
        attn.sinks = torch.nn.Parameter(attn.sinks[plan.q_heads.start : plan.q_heads.stop], requires_grad=False)
    attn.num_heads, attn.num_kv_heads = len(plan.q_heads), len(plan.kv_heads)
    attn.q_size, attn.kv_size = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
    if isinstance(mlp, MoE):
        shard_mixture(mlp, plan.expert_columns(mlp.spec.intermediate_size), plan.rank)
    else:
        _shard_gated(mlp, plan.intermediate, plan.rank)
    attn.tensor_parallel = mlp.tensor_parallel = group
    layer.sharded = True
    return layer


@torch.no_grad()
def shard_mixture(moe: MoE, columns: range, rank: int) -> MoE:
    """Keep ``columns`` of every expert of ``moe`` (in place, before quantization; ``ShardPlan.expert_columns``),
    the router whole; the down biases are added on rank 0. Its output is then this rank's partial sum."""
    for expert in moe.experts:
        _shard_gated(expert, columns, rank, zero_bias=True)
    return moe


def _shard_gated(mlp: MLP | Expert, columns: range, rank: int, zero_bias: bool = False) -> None:
    """Keep ``columns`` of a gated MLP's intermediate width: those rows of gate's and of up's (one fused
    projection, gate's rows first), those input columns of down, whose bias is added on rank 0. ``zero_bias``: the
    other ranks keep a zeroed down bias instead of none (the expert kernel's table takes every expert's two biases
    or neither)."""
    indices = torch.arange(columns.start, columns.stop)
    width = mlp.gate_up_proj.out_features // 2
    mlp.gate_up_proj = _take_rows(mlp.gate_up_proj, torch.cat([indices, width + indices]))
    down = _take_columns(mlp.down_proj, indices, keep_bias=rank == 0 or zero_bias)
    if rank != 0 and down.bias is not None:
        down.bias.zero_()
    mlp.down_proj = down


def _head_rows(heads: range, head_dim: int) -> torch.Tensor:
    return torch.arange(heads.start * head_dim, heads.stop * head_dim)


def _take_rows(linear: torch.nn.Linear, rows: torch.Tensor) -> torch.nn.Linear:
    """A linear layer computing only output features ``rows`` of ``linear`` (a column-parallel shard)."""
    weight = linear.weight
    with torch.device(weight.device):
        shard = Linear(linear.in_features, len(rows), bias=linear.bias is not None, dtype=weight.dtype)
    shard.weight.copy_(weight.index_select(0, rows.to(weight.device)))
    if linear.bias is not None:
        shard.bias.copy_(linear.bias.index_select(0, rows.to(weight.device)))
    return shard


def _take_columns(linear: torch.nn.Linear, columns: torch.Tensor, keep_bias: bool) -> torch.nn.Linear:
    """A linear layer over input features ``columns`` of ``linear`` (a row-parallel shard: its outputs are partial
    sums; the bias is added on one rank only)."""
    weight = linear.weight
    bias = linear.bias is not None and keep_bias
    with torch.device(weight.device):
        shard = Linear(len(columns), linear.out_features, bias=bias, dtype=weight.dtype)
    shard.weight.copy_(weight.index_select(1, columns.to(weight.device)))
    if bias:
        shard.bias.copy_(linear.bias)
    return shard
