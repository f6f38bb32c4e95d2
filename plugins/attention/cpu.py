"""``cpu``: paged attention in infer's C kernels (``infer.kernels.cpu``), float32 on a CPU.

Every query token, decode, verification or prefill chunk alike, attends straight from the pool through its
sequence's block table: no gather, no padding, one (query, KV head) pair per work item with the query heads of a KV
head together, an exact three-pass softmax. It reads a prefix shared by many sequences in place, so it needs no
cascade. Against ``sdpa``'s torch path per layer call it prefills chunks as fast or faster and decodes batches on
shared prefixes about as fast as cascade (docs/performance.md; ``benchmarks/flash_attention.py``).

With ``prefill_dtype: bfloat16`` the sequences that bring at least ``prefill_min_tokens`` query tokens to a step
(prefill chunks) are attended by a flash attention in bf16 instead (Q, K, V and the probabilities rounded to bf16,
scores and sums float32). ``auto`` (the default) does it where the model's weights are bf16 (``model.quantization:
bf16``, whose large steps already run at bf16 precision) or GGUF's 4- and 8-bit blocks (coarser still), and keeps
float32 everywhere else. Every other query stays
on the kernel. Which flash attention, ``prefill_kernel``: ``infer``'s own (``infer_flash_attention``: K/V packed
once per layer from the pool, an online softmax over tiles of 32 keys; AVX512-BF16 dot products, 512 fresh tokens
4.0-4.8 ms a layer against torch's 8.4 on an Intel Xeon without AMX; on AMX tiles where the CPU has them and the
head size is 64, 128 or 256, 16 tokens of one head as the lanes of every register, four 512-token prompts 5.4-6.2 ms
a layer against torch's 12.1-14.8 measured side by side on an AMX Xeon at head size 64, and a 512-token prompt of
Qwen3-0.6B's layout (head size 128) about half torch's time) or ``torch``'s (``scaled_dot_product_attention``
over the context gathered from the pool; oneDNN's AMX code where the CPU has AMX). ``auto``: infer's where the
kernels have it, except on an AMX CPU whose tiles infer's cannot use (another head size), where torch's is faster.
infer's runs on bf16 products or, with ``prefill_arithmetic: float32`` (what ``auto`` resolves to where the
projections' large GEMMs chose float32 FMAs, ``execution.large_gemm``), on float32 FMAs over the bf16 K/V, Q and the
probabilities unrounded: 512 fresh tokens 2.1-2.2 ms a layer against the dot products' 2.9-3.1 there.

Decode and verification queries are exactly the kernels', over the standard pool layout, so its
``fused_attention`` describes every step's attention as the kernels compute it: the execution layer may then run a step
of a few tokens through all layers in one C call, attention included, instead of calling ``forward`` per layer
(``infer.execution.paths``; a step that small computes its attention on the kernel whatever ``prefill_dtype`` says).
Over a bf16 pool, ``decode_arithmetic: bf16`` (what ``auto`` resolves to where the prefill arithmetic is bf16)
multiplies them on AVX512-BF16's dot products, the queries and probabilities rounded to bf16 as the flash attention
rounds them: on a Zen 4 EPYC the chat mix's decode attention took 0.91x the time of the float32 arithmetic over the
same pool.

Sliding-window layers (``LayerAttention.window``) are attended by the same kernels with the layer's window: the
decode kernel starts each query at the chunk of keys that holds its window's first, infer's flash attention packs
and reads a chunk's keys from its first row's window on, and torch's gathers the blocks from there with a banded
mask. The fused stack takes a window per pool layer. Blocks wholly before a window are never read.

Attention sinks (``LayerAttention.sinks``) change only each row's final normaliser: the kernels (paged, infer's
flash attention on dot products, FMAs or AMX tiles, and the fused stack, which takes a row of sinks per pool layer)
add ``exp(sink - m)`` to the softmax's running denominator once its keys are done, ``m`` the larger of the row's
maximum and the sink; torch's flash attention returns each row's log-sum-exp, and its output is rescaled by
``sigmoid(lse - sink)``, the same thing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from infer.attention import (
    AttentionBackend,
    AttentionConfig,
    AttentionEnvironment,
    AttentionMetadata,
    BackendUnavailableError,
    LayerAttention,
    gather_blocks,
)
from infer.host import cpu_flags
from infer.kernels import cpu as cpu_kernels
from infer.kernels.cpu import DIRECT_HEAD_DIMS, FlashChunks, KernelAttentionPlan, KernelAttentionStep

# Weights whose precision is bf16's or coarser (``model.quantization`` resolved): with them ``auto`` keeps K/V and
# prefill attention in bf16 as well.
BF16_ATTENTION_WEIGHTS = ("bf16", "q4_0", "q4_1", "q8_0", "gguf")


class CpuAttentionConfig(AttentionConfig):
    """Config section ``attention`` for ``name: cpu``."""

    name: str = "cpu"
    prefill_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="Sequences with at least prefill_min_tokens query tokens in a step: bfloat16 attends "
        "them with torch's flash attention in bf16 (fast where the CPU multiplies bf16 "
        "natively), float32 with the C kernel (exact). auto: bfloat16 when the model's weights "
        "are bf16 or 4- or 8-bit blocks (model.quantization bf16, gguf, q4, q8), else float32.",
    )
    prefill_min_tokens: int = Field(32, ge=1, description="Query tokens from which prefill_dtype applies.")
    prefill_kernel: Literal["auto", "infer", "torch"] = Field(
        "auto",
        description="Which flash attention computes prefill_dtype bfloat16: infer (the C kernels' own, on "
        "AMX tiles where the CPU has them and the head size is 64, 128 or 256, else AVX512-BF16 "
        "dot products), torch (scaled_dot_product_attention over the gathered context; oneDNN's AMX "
        "code where the CPU has AMX). auto: infer where the kernels have it, except on a CPU with "
        "AMX that infer's cannot use (then torch).",
    )
    prefill_arithmetic: Literal["auto", "bf16", "float32"] = Field(
        "auto",
        description="infer's flash attention (prefill_kernel infer): bf16 dot products (Q and the "
        "probabilities rounded to bf16) or float32 FMAs over the bf16 K/V (Q and the "
        "probabilities float32; faster where the CPU's float32 rate beats its bf16 dot "
        "products). auto: what execution.large_gemm chose for the projections.",
    )
    decode_arithmetic: Literal["auto", "bf16", "float32"] = Field(
        "auto",
        description="Decode and verification queries over a bfloat16 pool (head size 64, 128 or 256, "
        "kernels with AVX512-BF16): bf16 dot products (the queries and the probabilities rounded to bf16, "
        "scores and sums float32, as the flash attention) or float32 (the K/V widened, queries "
        "and probabilities float32). auto: bf16 where prefill_arithmetic resolves to bf16 "
        "(the projections' large steps are bf16 arithmetic), else float32.",
    )
    kv_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="The pool's dtype: bfloat16 halves its bytes (twice the tokens in a budget, half the "
        "bytes each decode step reads; K/V rounded to bf16 once, queries and sums float32), "
        "float32 keeps K/V exact. auto: bfloat16 when the model's weights are bf16 or 4- or "
        "8-bit blocks, else float32.",
    )


@dataclass(slots=True)
class PrefillQuery:
    """One sequence's query rows ``start:end`` attended by flash attention over its first ``context`` tokens, read
    from the pool's ``block_ids`` (from block ``first_block``: those a sliding window reaches); ``mask`` (additive,
    bf16, ``[rows, keys gathered]``) where a row does not see every gathered key up to its own position."""

    start: int
    end: int
    context: int
    block_ids: torch.Tensor  # int64, the sequence's blocks first_block .. ceil(context / block_size) - 1
    mask: torch.Tensor | None
    first_block: int = 0

    @classmethod
    def of(
        cls, metadata: AttentionMetadata, index: int, start: int, block_size: int, window: int | None
    ) -> PrefillQuery:
        """Sequence ``index``'s query rows, from token row ``start``, under a sliding ``window`` (None: full)."""
        query_len, context = metadata.query_lens_cpu[index], metadata.seq_lens_cpu[index]
        first_key = max(0, context - query_len - window + 1) if window else 0  # the first row's window
        first_block = first_key // block_size
        block_ids = metadata.block_tables[index, first_block : -(-context // block_size)].long()
        keys = context - first_block * block_size
        positions = torch.arange(context - query_len, context)[:, None]
        key_positions = torch.arange(first_block * block_size, context)[None, :]
        allowed = key_positions <= positions  # bottom-right causal
        if window:
            allowed &= key_positions > positions - window
        mask = None
        if keys > query_len or (window or keys) < keys:  # anything but plain causal over exactly the query rows
            mask = torch.zeros(query_len, keys, dtype=torch.bfloat16).masked_fill(~allowed, float("-inf"))
        return cls(start, start + query_len, context, block_ids, mask, first_block)


@dataclass(slots=True)
class CpuMetadata(AttentionMetadata):
    """``AttentionMetadata`` plus the kernel's plan (which row attends to how many tokens of which sequence; None
    when no row is the kernel's) and the sequences flash attention takes instead: infer's (``flash``) or torch's
    (``prefills``; ``window_prefills[w]``: the same for the layers of sliding window ``w``)."""

    plan: KernelAttentionPlan | None = None
    prefills: list[PrefillQuery] = field(default_factory=list)
    flash: FlashChunks | None = None
    window_prefills: dict[int, list[PrefillQuery]] = field(default_factory=dict)


class CpuBackend(AttentionBackend):
    """KV write and paged attention through the CPU kernels."""

    config_model = CpuAttentionConfig
    draft_trees = True
    layer_features = frozenset({"window", "sinks"})

    @classmethod
    def auto_priority(cls, environment: AttentionEnvironment) -> int | None:
        """Above ``sdpa`` for float32 on a CPU where infer's kernels run the model's small ops."""
        usable = environment.device.type == "cpu" and environment.dtype == torch.float32 and environment.cpu_kernels
        return 2 if usable else None

    @classmethod
    def resolve_config(cls, config: CpuAttentionConfig, environment: AttentionEnvironment) -> CpuAttentionConfig:
        """``prefill_dtype`` and ``kv_dtype`` auto: bfloat16 with bf16 weights (whose large steps run at bf16
        precision) or 4- and 8-bit blocks (coarser still), else float32; ``prefill_arithmetic`` auto: float32 where
        the projections' large steps run on float32 FMAs (``environment.float_gemms``), else bf16;
        ``decode_arithmetic`` auto: bf16 with those weights where the prefill arithmetic is bf16, else float32."""
        bf16_weights = environment.quantization in BF16_ATTENTION_WEIGHTS
        update = {
            key: "bfloat16" if bf16_weights else "float32"
            for key in ("prefill_dtype", "kv_dtype")
            if getattr(config, key) == "auto"
        }
        if config.prefill_arithmetic == "auto":
            update["prefill_arithmetic"] = "float32" if environment.float_gemms else "bf16"
        prefill_arithmetic = update.get("prefill_arithmetic", config.prefill_arithmetic)
        if config.decode_arithmetic == "auto":
            update["decode_arithmetic"] = "bf16" if bf16_weights and prefill_arithmetic == "bf16" else "float32"
        return config.model_copy(update=update) if update else config

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        try:
            self.kernels = cpu_kernels.load(True)
        except cpu_kernels.KernelBuildError as error:
            raise BackendUnavailableError(
                f"attention backend cpu needs infer's C kernels: {error}; use attention.name=sdpa"
            ) from error
        # None: every query on the kernel (float32). auto, where the engine has not resolved it, counts as float32.
        bf16 = self.config.prefill_dtype == "bfloat16"
        self.prefill_min_tokens: int | None = self.config.prefill_min_tokens if bf16 else None
        # infer's flash attention can multiply on AMX tiles here (what the C side picks for its bf16 mode)
        self._flash_on_tiles = self.kernels.flash_amx and self.head_dim in DIRECT_HEAD_DIMS
        # "infer" or "torch": whose flash attention takes those sequences (None: no sequence is taken)
        self.prefill_kernel: str | None = self._choose_prefill_kernel() if bf16 else None
        # infer's flash attention on float32 FMAs (auto, where the engine has not resolved it, counts as bf16)
        self.prefill_fma = self.prefill_kernel == "infer" and self.config.prefill_arithmetic == "float32"
        # its bf16 products on AMX tiles
        self.prefill_tiles = self.prefill_kernel == "infer" and not self.prefill_fma and self._flash_on_tiles
        if self.config.kv_dtype == "bfloat16":
            self.kv_dtype = torch.bfloat16
        # decode and verification on the dot products (auto, where the engine has not resolved it, counts as float32)
        self.decode_dots = (
            self.config.decode_arithmetic == "bf16"
            and self.kv_dtype == torch.bfloat16
            and self.kernels.flash
            and self.head_dim in DIRECT_HEAD_DIMS
        )
        # each pool layer's sliding window for the fused stack (0: none); None while no layer has one
        self.windows: torch.Tensor | None = None
        self.one_scale = True  # every layer's softmax scale is self.scale, the one the fused stack takes
        # each pool layer's sink logits for the fused stack ([layers, heads], -inf: none); None while no layer has any
        self.sink_table: torch.Tensor | None = None

    def set_layers(self, layers: Sequence[LayerAttention], sinks: Sequence[torch.Tensor | None] | None = None) -> None:
        """``AttentionBackend.set_layers``, and the windows, sinks and scale the fused stack reads."""
        super().set_layers(layers, sinks)
        windows = [self.layer_window(layer) or 0 for layer in range(len(self.layers))]
        self.windows = torch.tensor(windows, dtype=torch.int64) if any(windows) else None
        self.sink_table = None
        if any(logits is not None for logits in self.sinks):
            none = torch.full((self.num_heads,), float("-inf"))
            self.sink_table = torch.stack([none if logits is None else logits for logits in self.sinks]).contiguous()
        self.one_scale = all(self.layer_scale(layer) == self.scale for layer in range(len(self.layers)))

    def check_supported(self) -> None:
        if self.device.type != "cpu" or self.dtype != torch.float32:
            raise BackendUnavailableError(
                f"attention backend cpu runs float32 on a CPU, not {self.dtype} on "
                f"{self.device}; use attention.name=sdpa (or auto, which picks for you)"
            )

    def _choose_prefill_kernel(self) -> str:
        own = self.kernels.flash and self.head_dim % 64 == 0
        chosen = self.config.prefill_kernel
        if chosen == "infer" and not own:
            raise BackendUnavailableError(
                f"attention.prefill_kernel=infer needs infer's flash attention, built only where the CPU has "
                f"AVX512-BF16 and for a head size that is a multiple of 64 (this build: "
                f"{'has it' if self.kernels.flash else 'has none'}, head size {self.head_dim}); use "
                f"attention.prefill_kernel=torch or auto"
            )
        if chosen == "auto":  # on AMX infer's only where its products run on the tiles
            chosen = "infer" if own and ("amx_bf16" not in cpu_flags() or self._flash_on_tiles) else "torch"
        return chosen

    def prepare(self, metadata: AttentionMetadata) -> CpuMetadata:
        """The kernel's plan and the flash-attention sequences of the step, built once for all layers."""
        fields = {item.name: getattr(metadata, item.name) for item in dataclasses.fields(AttentionMetadata)}
        threshold = self.prefill_min_tokens
        if threshold is None or metadata.max_query_len < threshold:
            return CpuMetadata(**fields, plan=KernelAttentionPlan.every_token(metadata))
        every = KernelAttentionPlan.every_token(metadata)
        # sequences with a draft tree's leaves stay on the kernel, the one reader of own_keys
        trees = set() if metadata.own_keys is None else set(every.seq_of_query[metadata.own_keys >= 0].tolist())
        windows = sorted({layer.window for layer in self.layers if layer.window})
        prefills, window_prefills = [], {window: [] for window in windows}
        chunks, kernel_rows, start = [], [], 0
        for index, (query_len, context) in enumerate(zip(metadata.query_lens_cpu, metadata.seq_lens_cpu)):
            flash = query_len >= threshold and index not in trees
            if flash and self.prefill_kernel == "infer":
                chunks.append((start, query_len, context, index))
            elif flash:
                prefills.append(PrefillQuery.of(metadata, index, start, self.block_size, None))
                for window, queries in window_prefills.items():
                    queries.append(PrefillQuery.of(metadata, index, start, self.block_size, window))
            else:
                kernel_rows.extend(range(start, start + query_len))
            start += query_len
        plan = every.of_rows(kernel_rows) if kernel_rows else None
        return CpuMetadata(
            **fields,
            plan=plan,
            prefills=prefills,
            flash=FlashChunks.of(chunks) if chunks else None,
            window_prefills=window_prefills if prefills else {},
        )

    def fused_attention(self, metadata: AttentionMetadata) -> KernelAttentionStep | None:
        """Every query of the step on the kernel, as the fused stack computes it (decode and verification are
        exactly this backend's; a step small enough for the stack attends on the kernel whatever
        ``prefill_dtype`` says), each layer with its sliding window and sinks. None where the layers' softmax scales
        differ: the stack takes one scale."""
        if not self.one_scale:
            return None
        plan = metadata.plan if isinstance(metadata, CpuMetadata) else None
        return KernelAttentionStep.from_metadata(
            metadata, self.num_heads, self.scale, self.decode_dots, plan, self.windows, self.sink_table
        )

    def describe(self) -> str:
        """The bf16 prefill's flash attention and the decode arithmetic, where they are not float32's kernel."""
        parts = []
        if self.prefill_kernel:
            how = " (float32 FMAs)" if self.prefill_fma else " (AMX tiles)" if self.prefill_tiles else ""
            parts.append(f"bf16 prefill on {self.prefill_kernel}'s flash attention{how}")
        if self.decode_dots:
            parts.append("bf16 decode on the dot products")
        return ", ".join(parts)

    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Write this step's K/V into the pool at ``metadata.slot_mapping`` (padding slots skipped), then attend."""
        if not isinstance(metadata, CpuMetadata):
            metadata = self.prepare(metadata)
        self.kernels.write_kv(kv_cache, k, v, metadata.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype)
        window, scale, sinks = self.layer_window(layer), self.layer_scale(layer), self.layer_sinks(layer)
        if metadata.plan is not None:
            self.kernels.paged_attention(
                q, kv_cache, metadata.block_tables, metadata.plan, scale, out, self.decode_dots, window, sinks
            )
        if metadata.flash is not None:
            self.kernels.flash_attention(
                q, kv_cache, metadata.block_tables, metadata.flash, scale, out, self.prefill_fma, window, sinks
            )
        prefills = metadata.window_prefills[window] if window and metadata.prefills else metadata.prefills
        for prefill in prefills:
            rows = q[prefill.start : prefill.end]
            out[prefill.start : prefill.end] = self._flash(rows, kv_cache, prefill, scale, sinks)
        return out

    def _flash(
        self, q: torch.Tensor, kv_cache: torch.Tensor, prefill: PrefillQuery, scale: float, sinks: torch.Tensor | None
    ) -> torch.Tensor:
        """One sequence's query rows ``[n, heads, head_dim]`` by torch's flash attention in bf16 over its context
        (a bf16 pool is read as it is, a float32 one rounded); with ``sinks`` (``[heads]``) each row rescaled by
        ``sigmoid(lse - sink)`` from the log-sum-exp the CPU flash kernel returns."""
        # [1, heads, tokens, head_dim]: with three dimensions torch takes its math path (13x slower here)
        keys, values = (
            side[: prefill.context - prefill.first_block * self.block_size].transpose(0, 1)[None]
            for side in gather_blocks(kv_cache, prefill.block_ids, torch.bfloat16)
        )
        queries = q.to(torch.bfloat16).transpose(0, 1)[None]
        if sinks is None:
            attended = F.scaled_dot_product_attention(
                queries,
                keys,
                values,
                attn_mask=prefill.mask,
                is_causal=prefill.mask is None,
                scale=scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )
            return attended[0].transpose(0, 1).float()
        per_kv_head = self.num_heads // self.num_kv_heads
        keys, values = (side.repeat_interleave(per_kv_head, dim=1) for side in (keys, values))
        attended, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            queries, keys, values, is_causal=prefill.mask is None, attn_mask=prefill.mask, scale=scale
        )  # [1, heads, n, head_dim], [1, heads, n]
        attended = attended.float() * torch.sigmoid(lse - sinks[:, None]).unsqueeze(-1)
        return attended[0].transpose(0, 1)
