"""Decoder layers over a few tokens as C calls: ``FusedLayer`` (a layer's dense parts, two calls around the attention
backend's) and ``FusedStack`` (consecutive layers, attention included, in one call). The execution layer
(``infer.execution.paths``) chooses when a step runs through them."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from infer.kernels.cpu.abi import (
    ACTIVATIONS,
    WEIGHT_KINDS,
    AttentionStepStruct,
    CpuKernels,
    DraftHeadStruct,
    KernelAttentionPlan,
    LayerStruct,
    address,
    check_block_tables,
    check_flat,
    check_packed,
    check_pool,
    check_slots,
    scale_groups,
)
from infer.kernels.cpu.blocks import BLOCK_KINDS, BlockWeight
from infer.kernels.cpu.packing import packed_shape, tiles_shape

if TYPE_CHECKING:
    from infer.attention import AttentionMetadata


class FusedLayer:
    """A decoder layer's dense parts for a few tokens (decode at small batches, verification) as two C calls around
    attention: norm, QKV projection, the q/k head norms where the family has them, RoPE; then output projection
    (normed, with Gemma 3's output norms), norm, gate/up, SwiGLU's or GeGLU's activation, down (normed, with
    them). Holds references to the tensors whose memory the C side reads."""

    def __init__(
        self,
        kernels: CpuKernels,
        weights: list[torch.Tensor | BlockWeight],
        scales: list[torch.Tensor | None],
        biases: list[torch.Tensor | None],
        norms: tuple[torch.Tensor, torch.Tensor],
        eps: float,
        q_width: int,
        rotated_heads: int,
        head_dim: int,
        tiles: list[torch.Tensor | None] | None = None,
        tiles_fma: bool = False,
        head_norms: tuple[torch.Tensor, torch.Tensor] | None = None,
        output_norms: tuple[torch.Tensor, torch.Tensor] | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        rotary_dim: int | None = None,
        activation: str = "silu",
    ):
        """``weights``/``scales``/``biases``: packed by ``pack_weights`` (fp16, bf16, or int8 with scales packed by
        ``pack_scales``, else None) or GGUF's blocks (``BlockWeight``, no scales), and float32 (or None) for the QKV,
        output, gate/up and down projections, in that order; ``norms``: the input and post-attention RMSNorm weights;
        ``tiles``: bf16 weights may come packed by ``pack_tiles`` instead (their ``weights`` entry None) or beside
        them, and every step then multiplies on the tiles (``linear_tiles``: its GEMV with float32 FMAs for up to one
        GEMV pass, ``pass_rows``; more on ``kernels.tiles``, AMX tiles or AVX512-BF16, or with ``tiles_fma`` float32
        FMAs, ``linear_tiles``' ``fma``); ``head_norms``: Qwen3's (and Gemma 3's) per-head RMSNorm weights ``(q_norm,
        k_norm)``, float32 ``[head_dim]`` each, applied to every Q head and every K head before RoPE (None: a Llama
        layer, none); ``output_norms``: Gemma 3's RMSNorm weights ``(attention output, MLP output)``, float32
        ``[hidden]`` each, applied to the output projection's and the down projection's results before they join the
        residual stream (None: none); ``rotary``: the layer's own ``(cos, sin)`` tables (``RotaryEmbedding``'s,
        float32 ``[positions, rotary_dim]``) instead of the step's (Gemma 3's global layers; None: the step's);
        ``rotary_dim``: how many of each head's values rotate (Phi-4-mini's 3/4 of the head; None: all);
        ``activation``: the gated MLP's, ``silu`` (SwiGLU) or ``gelu_tanh`` (GeGLU)."""
        tiles = tiles or [None] * 4
        head_norms = _check_head_norms(head_norms, head_dim)
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even and in (0, head_dim = {head_dim}], got {rotary_dim}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"the fused layer's activation is one of {', '.join(ACTIVATIONS)}, got {activation!r}")
        output_norms = _check_vectors("output_norms", ("attention output", "MLP output"), output_norms)
        rotary = _check_vectors("rotary", ("cos", "sin"), rotary)
        for weight, scale, tile in zip(weights, scales, tiles):
            if weight is None:
                if tile is None or tile.dtype != torch.bfloat16 or tile.dim() != 6 or scale is not None:
                    raise ValueError("a projection without GEMV weights needs its bf16 weight packed by pack_tiles")
                continue
            if isinstance(weight, BlockWeight):
                if scale is not None or tile is not None:
                    raise ValueError("a projection kept as blocks takes no scales or tiles")
                continue
            check_packed(weight, scale)
            if tile is not None and (tile.dtype != torch.bfloat16 or tiles_shape(tile) != packed_shape(weight)):
                raise ValueError("a projection's tiles must be its bf16 weight packed by pack_tiles")
        self._keep = [*weights, *scales, *biases, *norms, *tiles, *head_norms, *output_norms, *rotary]
        shapes = [tiles_shape(tile) if weight is None else weight_shape(weight) for weight, tile in zip(weights, tiles)]
        (qkv_width, _), (hidden, _), _, (_, intermediate) = shapes
        if output_norms[0] is not None and any(norm.numel() != hidden for norm in output_norms):
            raise ValueError(f"output_norms must be [hidden] = [{hidden}] each")
        if rotary[0] is not None and any(table.dim() != 2 or table.shape[1] != rotary_dim for table in rotary):
            raise ValueError(f"rotary's tables must be [positions, rotary_dim] = [*, {rotary_dim}]")
        groups = [scale_groups(scale) for scale in scales]
        kinds = [WEIGHT_KINDS[torch.bfloat16] if weight is None else weight_kind(weight) for weight in weights]
        stored = [weight.data if isinstance(weight, BlockWeight) else weight for weight in weights]
        self.struct = LayerStruct(
            *(address(tensor) for tensor in (*stored, *scales, *biases, *norms)),
            eps,
            hidden,
            qkv_width,
            q_width,
            intermediate,
            rotated_heads,
            head_dim,
            *groups,
            *kinds,
            *(address(tile) for tile in tiles),
            tiles_fma,
            *(address(norm) for norm in head_norms),
            *(address(tensor) for tensor in (*output_norms, *rotary)),
            rotary_dim,
            ACTIVATIONS[activation],
        )
        self.hidden = hidden
        self.qkv_width = qkv_width
        self._attention_input = kernels._layer_attention_input
        self._feed_forward = kernels._layer_feed_forward

    def attention_input(
        self,
        residual: torch.Tensor,
        delta: torch.Tensor | None,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """For ``T`` tokens: ``residual += delta`` (``[T, hidden]`` each, in place; no add when None), RMSNorm, QKV
        projection, each Q and K head's RMSNorm (with ``head_norms``), RoPE at ``positions`` with
        ``RotaryEmbedding``'s tables (the layer's own ``rotary`` where it has them): returns the rotated
        ``[T, qkv_width]``."""
        tokens = residual.shape[0]
        qkv = torch.empty((tokens, self.qkv_width), dtype=torch.float32)
        self._attention_input(
            ctypes.byref(self.struct),
            tokens,
            residual.data_ptr(),
            address(delta),
            positions.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            qkv.data_ptr(),
        )
        return qkv

    def feed_forward(self, attended: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """From attention's output ``[T, q_width]``: ``residual +=`` its projection (in place; normed first with
        ``output_norms``), then the MLP of the sum's norm (normed with ``output_norms``), returned as the layer's
        delta ``[T, hidden]``."""
        tokens = residual.shape[0]
        delta = torch.empty((tokens, self.hidden), dtype=torch.float32)
        self._feed_forward(
            ctypes.byref(self.struct), tokens, attended.data_ptr(), residual.data_ptr(), delta.data_ptr()
        )
        return delta


def _check_vectors(
    argument: str,
    names: tuple[str, str],
    pair: tuple[torch.Tensor, torch.Tensor] | None,
    shape: tuple[int, ...] | None = None,
    shape_name: str = "",
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``pair`` as the C side reads it (``(None, None)``: none): two contiguous float32 CPU tensors (of ``shape``
    where given, named ``shape_name`` in the error), or ValueError saying what is wrong."""
    if pair is None:
        return None, None
    if len(pair) != 2:
        raise ValueError(f"{argument} must be ({', '.join(names)}), got {len(pair)} tensors")
    for name, tensor in zip(names, pair):
        if (
            tensor.dtype != torch.float32
            or tensor.device.type != "cpu"
            or not tensor.is_contiguous()
            or (shape is not None and tuple(tensor.shape) != shape)
        ):
            wanted = "" if shape is None else f" [{shape_name}] = {list(shape)}"
            raise ValueError(
                f"{argument}' {name} must be a contiguous float32 CPU tensor{wanted}, got {tensor.dtype} "
                f"{tuple(tensor.shape)} on {tensor.device}"
            )
    return pair[0], pair[1]


def _check_head_norms(
    head_norms: tuple[torch.Tensor, torch.Tensor] | None, head_dim: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(q_norm, k_norm)`` as the C side reads them (``(None, None)``: none), or ValueError saying what is wrong."""
    return _check_vectors("head_norms", ("q_norm", "k_norm"), head_norms, (head_dim,), "head_dim")


def weight_shape(weight: torch.Tensor | BlockWeight) -> tuple[int, int]:
    """``(out_features, in_features)`` of a weight packed by ``pack_weights`` or kept as blocks."""
    return (weight.out_features, weight.in_features) if isinstance(weight, BlockWeight) else packed_shape(weight)


def weight_kind(weight: torch.Tensor | BlockWeight) -> int:
    """How the C side reads a weight (``KIND_*``): by its dtype, or its block kind."""
    return BLOCK_KINDS[weight.kind] if isinstance(weight, BlockWeight) else WEIGHT_KINDS[weight.dtype]


class FusedStack:
    """Consecutive decoder layers (``FusedLayer`` each) over a few tokens in one C call, attention included (infer's
    paged attention over the standard pool layout: the execution layer runs it only with a backend that declares
    ``fused_attention``). A step of a few tokens is otherwise ~5 calls from Python per layer, and that glue
    measured about a fifth of a decode step at batch 1 (docs/performance.md)."""

    def __init__(self, kernels: CpuKernels, layers: list[FusedLayer], kv_layers: list[int]):
        """``kv_layers[i]``: the index of layer ``i``'s pool in the KV cache."""
        if len({(layer.hidden, layer.qkv_width, layer.struct.q_width) for layer in layers}) > 1:
            raise ValueError("a fused stack needs layers of one shape")
        self.layers = (LayerStruct * len(layers))(*(layer.struct for layer in layers))
        self.kv_layers = torch.tensor(kv_layers, dtype=torch.int64)
        self._keep = layers
        self._run = kernels._layers_few

    def run(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        step: KernelAttentionStep,
    ) -> torch.Tensor:
        """The layers over embeddings ``hidden`` ``[T, hidden]``, which become the residual stream (in place);
        returns the last layer's output ``[T, hidden]`` (the final norm adds the two). ``kv_cache``: all layers'
        pools ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]`` (float32 or bfloat16)."""
        check_flat(hidden)
        check_pool(kv_cache)
        step.check()
        delta = torch.empty_like(hidden)
        self._run(
            self.layers,
            self.kv_layers.data_ptr(),
            len(self.layers),
            hidden.shape[0],
            hidden.data_ptr(),
            delta.data_ptr(),
            positions.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            kv_cache.data_ptr(),
            kv_cache.stride(0),
            ctypes.byref(step.struct(kv_cache)),
        )
        return delta


class FusedDraftHead:
    """An EAGLE draft head's step over a few pairs in one C call (``infer_draft_head_step``): the norms of the token
    embeddings and target features, the fc over both, the head's decoder layer with its attention, the final norm of
    each sequence's last row, the draft-vocabulary logits, their largest few and their softmax probabilities. A chain
    step is otherwise about twenty calls from Python around ~0.3 ms of C (docs/performance.md)."""

    def __init__(
        self,
        kernels: CpuKernels,
        layer: FusedLayer,
        norms: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        eps: float,
        fc: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None],
        out: tuple[torch.Tensor, torch.Tensor | None],
    ):
        """``norms``: the embedding, feature and final RMSNorm weights (float32); ``fc``: the packed weight
        ``[hidden, 2 * hidden]``, its scales and float32 bias (or None); ``out``: the packed draft-vocabulary weight
        ``[vocab, hidden]`` and its scales (``pack_weights``/``pack_scales``)."""
        for weight, scales in (fc[:2], out):
            check_packed(weight, scales)
        (hidden, pair_width), (vocab, out_width) = packed_shape(fc[0]), packed_shape(out[0])
        if pair_width != 2 * hidden or out_width != hidden or layer.hidden != hidden:
            raise ValueError(
                f"a draft head needs fc [hidden, 2 * hidden] and output [vocab, hidden] around a layer "
                f"of hidden size {layer.hidden}, got fc {packed_shape(fc[0])} and output "
                f"{(vocab, out_width)}"
            )
        for tensor in (*norms, *(bias for bias in fc[2:] if bias is not None)):
            check_flat(tensor)
        self.struct = DraftHeadStruct(
            *(address(norm) for norm in norms),
            eps,
            address(fc[0]),
            address(fc[1]),
            address(fc[2]),
            scale_groups(fc[1]),
            WEIGHT_KINDS[fc[0].dtype],
            address(out[0]),
            address(out[1]),
            scale_groups(out[1]),
            WEIGHT_KINDS[out[0].dtype],
            vocab,
            hidden,
        )
        self.layer = layer
        self.hidden = hidden
        self._keep = [*norms, *fc, *out]
        self._run = kernels._draft_head_step

    def run(
        self,
        embeds: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        step: KernelAttentionStep,
        last_rows: Sequence[int],
        width: int = 1,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The head over pairs ``embeds``/``features`` ``[T, hidden]`` at ``positions``, writing its K/V into its
        one-layer pool ``kv_cache`` ``[1, 2, num_blocks, block_size, kv_heads, head_dim]``: for the rows
        ``last_rows`` (one a sequence), the predicted features ``[S, hidden]``, the draft-vocabulary indices of the
        ``width`` likeliest guesses, likeliest first (int64 ``[S, width]``), and their probabilities under the head
        (float32 ``[S, width]``)."""
        for tensor in (embeds, features):
            check_flat(tensor)
        if embeds.shape != features.shape or embeds.shape[1] != self.hidden:
            raise ValueError(
                f"a draft step needs embeddings and features [T, {self.hidden}], got "
                f"{tuple(embeds.shape)} and {tuple(features.shape)}"
            )
        check_pool(kv_cache)
        step.check()
        seqs = len(last_rows)
        if seqs and not 0 <= min(last_rows) <= max(last_rows) < embeds.shape[0]:
            raise ValueError(f"last_rows {list(last_rows)} are not rows of a step of {embeds.shape[0]} tokens")
        rows = torch.tensor(last_rows, dtype=torch.int64)
        predicted = torch.empty((seqs, self.hidden), dtype=torch.float32)
        guesses = torch.empty((seqs, width), dtype=torch.int64)
        confidence = torch.empty((seqs, width), dtype=torch.float32)
        self._run(
            ctypes.byref(self.struct),
            ctypes.byref(self.layer.struct),
            embeds.shape[0],
            embeds.data_ptr(),
            features.data_ptr(),
            positions.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            kv_cache.data_ptr(),
            ctypes.byref(step.struct(kv_cache)),
            rows.data_ptr(),
            seqs,
            predicted.data_ptr(),
            width,
            guesses.data_ptr(),
            confidence.data_ptr(),
        )
        return predicted, guesses, confidence


@dataclass(slots=True)
class KernelAttentionStep:
    """A step's attention as the kernels run it inside ``FusedStack``: every token is a query of
    ``plan``, its K/V written at ``slots`` (int64, negative: skipped), contexts read through ``block_tables``;
    ``dots``: on the dot products over a bf16 pool (``CpuKernels.paged_attention``'s ``dots``); ``windows``: each
    pool layer's sliding window (int64, contiguous, 0: none; ``CpuKernels.paged_attention``'s ``window``), or None
    when no layer has one; ``sinks``: each pool layer's attention sinks (float32 ``[layers, heads]``, contiguous,
    -inf: none; ``CpuKernels.paged_attention``'s ``sinks``), or None when no layer has them."""

    plan: KernelAttentionPlan
    block_tables: torch.Tensor
    slots: torch.Tensor
    num_heads: int
    scale: float
    dots: bool = False
    windows: torch.Tensor | None = None
    sinks: torch.Tensor | None = None

    @classmethod
    def from_metadata(
        cls,
        metadata: AttentionMetadata,
        num_heads: int,
        scale: float,
        dots: bool = False,
        plan: KernelAttentionPlan | None = None,
        windows: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> KernelAttentionStep:
        """The step's attention from the core metadata every backend receives (the model's shapes beside it);
        ``plan``: the step's every-token plan where the caller already built one (built here otherwise)."""
        if plan is None or plan.rows is not None:  # none, or only some tokens'
            plan = KernelAttentionPlan.every_token(metadata)
        return cls(plan, metadata.block_tables, metadata.slot_mapping, num_heads, scale, dots, windows, sinks)

    def struct(self, kv_cache: torch.Tensor) -> AttentionStepStruct:
        """The C side's view of this step over the pools ``kv_cache`` (``[..., num_blocks, block_size, kv_heads,
        head_dim]``)."""
        num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape[-4:]
        plan = self.plan
        return AttentionStepStruct(
            self.block_tables.data_ptr(),
            self.block_tables.stride(0),
            self.slots.data_ptr(),
            address(plan.rows),
            plan.seq_of_query.data_ptr(),
            plan.context_lens.data_ptr(),
            plan.num_queries,
            plan.max_context,
            self.num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            num_blocks,
            self.scale,
            kv_cache.dtype == torch.bfloat16,
            address(plan.own_keys),
            self.dots,
            address(self.windows),
            address(self.sinks),
        )

    def check(self) -> None:
        check_block_tables(self.block_tables)
        check_slots(self.slots)
        if self.windows is not None and (self.windows.dtype != torch.int64 or not self.windows.is_contiguous()):
            raise ValueError("a fused step's windows are contiguous int64, one per pool layer")
        if self.sinks is not None and (
            self.sinks.dtype != torch.float32
            or not self.sinks.is_contiguous()
            or self.sinks.shape[-1] != self.num_heads
        ):
            raise ValueError("a fused step's sinks are contiguous float32 [pool layers, num_heads]")
