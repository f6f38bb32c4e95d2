"""A mixture-of-experts feed-forward (``MoE``): a router picks ``top_k`` of ``num_experts`` gated MLPs for each
token, and the token's output is their outputs weighted by the router.

A step's tokens are grouped by expert (``ExpertGroups``), so each expert that any token chose runs once over all of
its tokens: its weights are read from memory once per step, whatever the batch, and an expert no token chose is
not read at all. On a CPU a decode step is bound by those reads (the active experts' bytes), not by the FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from infer.kernels.cpu import MOE_BLOCK_KINDS, PackedExperts
from infer.kernels.cpu.packing import can_pack_tiles
from infer.model.layers import Linear, clamped_swiglu, gated_activation

# The most tokens an expert takes in the one C call over ``pack_weights``' layout (kernels without tiles, int8
# experts), whose GEMV streams its weights once and reuses them from L1 for passes of 8 rows (AVX-512): on 2 shared
# cores of a Xeon with AMX (qwen3-moe-3.3b's shape, bf16), batch 64 (8 tokens an expert on average) took 36-43 ms a
# layer with every expert in the call against 84 ms with those above one pass on the tile GEMM from Python, and batch
# 256 (32 an expert) 118 against 144 ms (``benchmarks/moe_layer.py``).
KERNEL_MAX_TOKENS = 64

if TYPE_CHECKING:
    from infer.distributed import TensorParallelGroup
    from infer.kernels.cpu import CpuKernels
    from infer.model.spec import DecoderSpec, ExpertsSpec
    from infer.model.step import ForwardStep


def call_max_block_tokens(kernels: CpuKernels, kinds: tuple[str, str], tokens: int) -> int:
    """The most tokens an expert kept as blocks of ``kinds`` (gate_up's, down's) takes in the one C call of a step of
    ``tokens`` routed pairs: all of them (the call multiplies an expert of more than one block-GEMV pass on the block
    GEMM's int8 design, or of a K-quant kind, more than 16 tokens, 12 in AVX2 builds: below, their GEMV is faster),
    except where the block GEMM runs on AMX's bf16 tiles: there an expert of more than one GEMV pass
    (``block_pass_rows``) multiplies faster through its own projections on that design, which reads every kind but
    MXFP4."""
    if kernels.block_gemm == "amx-bf16" and set(kinds) != {"mxfp4"}:
        return kernels.block_pass_rows
    return tokens


@dataclass(frozen=True, slots=True)
class Routing:
    """Each token's experts and their weights: ``experts`` ``[T, top_k]`` (int64), ``weights`` ``[T, top_k]``
    (float32)."""

    experts: torch.Tensor
    weights: torch.Tensor


@dataclass(frozen=True, slots=True)
class ExpertGroups:
    """A step's (token, expert) pairs sorted by expert: expert ``active[i]`` takes the tokens ``tokens[starts[i]:
    starts[i + 1]]`` with weights ``weights[starts[i]: starts[i + 1]]``; experts in ascending order, each one's tokens
    in ascending order (so every token sums its experts in the order transformers does)."""

    active: list[int]
    starts: list[int]
    tokens: torch.Tensor  # [T * top_k] int64: the token of each pair
    weights: torch.Tensor  # [T * top_k] float32: its routing weight

    @classmethod
    def of(cls, routing: Routing, num_experts: int) -> ExpertGroups:
        top_k = routing.experts.shape[1]
        flat = routing.experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=num_experts).tolist()
        active = [expert for expert, count in enumerate(counts) if count]
        starts = [0]
        for expert in active:
            starts.append(starts[-1] + counts[expert])
        return cls(active, starts, order // top_k, routing.weights.reshape(-1)[order])

    def count(self, index: int) -> int:
        """Tokens of the ``index``-th active expert."""
        return self.starts[index + 1] - self.starts[index]

    def pick(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The groups ``indices`` (of ``active``) as ``CpuKernels.moe_experts`` takes them: expert ids, starts,
        tokens and weights."""
        if len(indices) == len(self.active):
            tokens, weights = self.tokens, self.weights
        else:
            pairs = torch.cat([torch.arange(self.starts[index], self.starts[index + 1]) for index in indices])
            tokens, weights = self.tokens[pairs], self.weights[pairs]
        starts = torch.tensor([0, *accumulate(self.count(index) for index in indices)])
        return torch.tensor([self.active[index] for index in indices]), starts, tokens, weights


class Router(nn.Module):
    """The router's linear layer (``[num_experts, hidden]``, with a bias in gpt-oss). Not an ``nn.Linear``, so weight
    packing leaves it in the model's dtype: a rounded router score can change which experts a token takes, and the
    layer is small (one row per expert)."""

    def __init__(self, hidden_size: int, num_experts: int, dtype: torch.dtype, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(num_experts, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Router logits ``[T, num_experts]`` in float32."""
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias).float()


class Expert(nn.Module):
    """One expert: a gated MLP with gate and up fused into one projection, gate's rows first (as
    ``infer.model.MLP``): SwiGLU, or gpt-oss's clamped SwiGLU with biases (``ExpertsSpec``)."""

    def __init__(self, hidden_size: int, spec: ExpertsSpec, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * spec.intermediate_size, bias=spec.bias, dtype=dtype)
        self.down_proj = Linear(spec.intermediate_size, hidden_size, bias=spec.bias, dtype=dtype)
        self.activation = spec.activation
        self.limit, self.alpha = spec.swiglu_limit, spec.swiglu_alpha

    def forward(self, x: torch.Tensor, step: ForwardStep | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.activation == "clamped_swiglu":  # in float32 whatever the GEMMs' dtype, then back to it
            activated = clamped_swiglu(gate_up.float(), self.limit, self.alpha).to(gate_up.dtype)
        elif step is None:
            activated = gated_activation(gate_up, "silu")
        else:
            activated = step.ops.gated_activation(gate_up, "silu")
        return self.down_proj(activated)


class MoE(nn.Module):
    """The experts of one sparse layer and their router, configured by ``spec.experts`` (``ExpertsSpec``); replaces
    ``infer.model.MLP`` in the layers ``DecoderSpec.is_sparse`` names."""

    def __init__(self, spec: DecoderSpec, dtype: torch.dtype):
        super().__init__()
        experts = spec.experts
        self.spec = experts
        self.num_experts = experts.num_experts
        self.top_k = experts.top_k
        self.norm_topk_prob = experts.norm_topk_prob
        self.router = Router(spec.hidden_size, experts.num_experts, dtype, experts.bias)
        self.experts = nn.ModuleList(Expert(spec.hidden_size, experts, dtype) for _ in range(experts.num_experts))
        # The experts' packed weights for the kernels' one-call path (``use_cpu_kernels``).
        self.packed: PackedExperts | None = None
        # Sharded by ``infer.model.sharding.shard_model``: this rank's columns of every expert, the partial sums
        # all-reduced in float32.
        self.tensor_parallel: TensorParallelGroup | None = None

    def route(self, x: torch.Tensor) -> Routing:
        """Each token's ``top_k`` experts and their weights, as ``ExpertsSpec.router`` says: the best ``top_k``
        router scores (``topk_softmax``, gpt-oss) or the best ``top_k`` of the softmax over all experts
        (``softmax_topk``, Qwen3-MoE), weighted by ``weigh``."""
        logits = self.router(x)
        if self.spec.router == "topk_softmax":
            scores, experts = torch.topk(logits, self.top_k, dim=-1)
            return Routing(experts, torch.softmax(scores, dim=-1))
        probabilities = torch.softmax(logits, dim=-1)
        weights, experts = torch.topk(probabilities, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(experts, weights)

    def weigh(self, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The routing weights ``[T, top_k]`` (float32) of the chosen ``experts`` ``[T, top_k]`` under router logits
        ``[T, num_experts]``: softmax over the chosen scores (``topk_softmax``), or their share of the softmax over
        all experts, renormalized when ``norm_topk_prob`` (``softmax_topk``). What ``route`` gives for its own
        choices; a test replaying another model's choices weighs them with this."""
        if self.spec.router == "topk_softmax":
            return torch.softmax(logits.gather(1, experts), dim=-1)
        weights = torch.softmax(logits, dim=-1).gather(1, experts)
        return weights / weights.sum(dim=-1, keepdim=True) if self.norm_topk_prob else weights

    def forward(self, x: torch.Tensor, step: ForwardStep | None = None) -> torch.Tensor:
        """``x`` ``[T, hidden]`` (the normed hidden states) through each token's experts; float32 ``[T, hidden]``
        where the step runs on the CPU kernels (the next norm widens what it adds), else in ``x``'s dtype.

        On the kernels, every expert runs in one C call (``CpuKernels.moe_experts``) where the experts are on the
        tiles; over ``pack_weights``' layout, the experts that take up to ``KERNEL_MAX_TOKENS`` tokens do, and over
        GGUF's blocks every expert too, except where the block GEMM runs on AMX (``call_max_block_tokens``); the
        others (a prefill chunk's) expert by expert through their packed projections."""
        groups = ExpertGroups.of(self.route(x), self.num_experts)
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        kernels = None if step is None else step.ops.kernels
        rest = range(len(groups.active))
        if kernels is not None and self.packed is not None:
            most = (  # the tiles take any number
                groups.starts[-1]
                if self.packed.tiles
                else call_max_block_tokens(kernels, self.packed.blocks, groups.starts[-1])
                if self.packed.blocks
                else KERNEL_MAX_TOKENS
            )
            few = [index for index in rest if groups.count(index) <= most]
            rest = [index for index in rest if groups.count(index) > most]
            if few:
                kernels.moe_experts(x.float().contiguous(), self.packed, *groups.pick(few), out)
        for index in rest:
            start, end = groups.starts[index], groups.starts[index + 1]
            tokens = groups.tokens[start:end]
            expert_out = self.experts[groups.active[index]](x[tokens], step)
            out.index_add_(0, tokens, expert_out.float() * groups.weights[start:end, None])
        if self.tensor_parallel is not None:
            out = self.tensor_parallel.all_reduce(out)
        if x.dtype != torch.float32 and kernels is None:
            return out.to(x.dtype)
        return out

    def use_cpu_kernels(self, kernels: CpuKernels | None, gemv_rows: int = 0, tile_fma: bool = False) -> None:
        """Let each expert's packed projections take the kernels' GEMV for inputs of up to ``gemv_rows`` rows (see
        ``infer.model.quantization.PackedLinear``), and when every one has a packed copy, tabulate them for the
        C call (``self.packed``). bf16 experts on kernels with tiles keep the tiles' copy alone (the C call reads it
        for any number of tokens); experts kept as blocks of ``MOE_BLOCK_KINDS`` (gate_up of one kind, down of one)
        are read as they are; others get ``pack_weights``' copy beside their own. ``kernels`` None undoes it."""
        projections = [(expert.gate_up_proj, expert.down_proj) for expert in self.experts]
        tiles = (
            kernels is not None
            and kernels.tiles is not None
            and all(
                getattr(projection, "mode", None) == "bf16"
                and can_pack_tiles(projection.out_features, projection.in_features)
                for pair in projections
                for projection in pair
            )
        )
        for pair in projections:
            for projection in pair:
                if hasattr(projection, "use_cpu_kernels"):  # PackedLinear
                    projection.use_cpu_kernels(kernels, gemv_rows, tile_fma, streams=not tiles, tiles_only=tiles)
        self.packed = None
        gate_ups, downs = zip(*projections, strict=True)
        options = {  # biases and activation, the same for every layout
            "gate_up_bias": [projection.bias for projection in gate_ups] if self.spec.bias else None,
            "down_bias": [projection.bias for projection in downs] if self.spec.bias else None,
            "activation": self.spec.activation,
            "limit": self.spec.swiglu_limit,
            "alpha": self.spec.swiglu_alpha,
        }
        block_kinds = {  # each expert's gate_up and down block kinds, None for one not kept as blocks
            tuple(getattr(getattr(projection, "blocks", None), "kind", None) for projection in pair)
            for pair in projections
        }
        if kernels is not None and len(block_kinds) == 1 and set(*block_kinds) <= set(MOE_BLOCK_KINDS):
            self.packed = PackedExperts.of_blocks(
                [projection.blocks for projection in gate_ups], [projection.blocks for projection in downs], **options
            )
            return
        if tiles:
            self.packed = PackedExperts.of(
                [projection.tile_weight for projection in gate_ups],
                [projection.tile_weight for projection in downs],
                tiles=True,
                **options,
            )
            return
        if kernels is None or any(
            getattr(projection, "kernel_weight", None) is None for pair in projections for projection in pair
        ):
            return
        int8 = gate_ups[0].kernel_scales is not None
        self.packed = PackedExperts.of(
            [projection.kernel_weight for projection in gate_ups],
            [projection.kernel_weight for projection in downs],
            [projection.kernel_scales for projection in gate_ups] if int8 else None,
            [projection.kernel_scales for projection in downs] if int8 else None,
            **options,
        )
