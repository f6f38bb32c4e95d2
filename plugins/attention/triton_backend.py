"""Attention backend ``triton``: paged attention kernels written in Triton (CUDA; CPU under ``TRITON_INTERPRET=1``).

This module does not import Triton: the kernels module loads in the constructor, after ``check_supported`` has
confirmed Triton can run here, because Triton decides between GPU compilation and its CPU interpreter at import.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch
from pydantic import Field

from infer.attention import AttentionBackend, AttentionConfig, AttentionMetadata, BackendUnavailableError

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
SUPPORTED_BLOCK_SIZES = (1, 4, 8, 16, 32)
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Programs a decode launch should reach before splitting the KV axis stops paying: two per SM keeps every SM busy
# while one waits on memory. Without a GPU (interpreter) the number only decides when tests see the split path.
PROGRAMS_PER_SM = 2
INTERPRETER_TARGET_PROGRAMS = 8


class TritonAttentionConfig(AttentionConfig):
    """Config section ``attention`` for ``name: triton``."""

    name: str = "triton"
    max_kv_splits: int = Field(
        16, ge=1, description="most KV ranges one decode sequence is split into (flash-decoding); 1 turns it off"
    )
    min_tokens_per_split: int = Field(
        256, ge=1, description="shortest KV range worth its own program; shorter contexts are not split"
    )


class TritonBackend(AttentionBackend):
    """Paged attention for mixed prefill/decode/verification batches, with split-KV decoding for long contexts.

    Decode fast path: decode-only batches take the same kernel with the smallest query tile (16 rows, the minimum
    ``tl.dot`` accepts, holding one token's group of query heads) plus KV splitting when there are too few sequences
    to fill the GPU. A separate hand-tuned decode kernel is not written: without a GPU to measure it on, it could not
    be shown to help.

    Sliding-window layers run the same kernel with the layer's window: each program starts at its first query's
    first visible position, and the KV splits divide the window's range instead of the context. Layers with
    attention sinks add each head's sink to its rows' denominators where a row's softmax ends (the split merge, when
    the KV axis is split).
    """

    config_model = TritonAttentionConfig
    layer_features = frozenset({"window", "sinks"})

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        from infer.plugins.attention import triton_kernels

        self.kernels = triton_kernels
        self.queries_per_kv = self.num_heads // self.num_kv_heads
        self.target_programs = _target_programs(self.device)

    def check_supported(self) -> None:
        """Refuse to run without CUDA (unless interpreting), without Triton, or with shapes the kernels do not cover."""
        if not _interpreting() and not (self.device.type == "cuda" and torch.cuda.is_available()):
            raise BackendUnavailableError(
                "attention 'triton' needs a CUDA GPU; set TRITON_INTERPRET=1 to run it on the CPU "
                "(slow, for tests), or use attention.name=sdpa"
            )
        if importlib.util.find_spec("triton") is None:
            raise BackendUnavailableError(
                "attention 'triton' needs the triton package: pip install 'infer[triton]', or use attention.name=sdpa"
            )
        if _interpreting() and _triton_imported_for_gpu():
            raise BackendUnavailableError(
                "TRITON_INTERPRET=1 was set after triton was imported, too late to take effect; set it before the "
                "process starts (or before anything imports triton)"
            )
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            raise BackendUnavailableError(
                f"attention 'triton' supports head_dim {SUPPORTED_HEAD_DIMS}, this model has {self.head_dim}; "
                "use attention.name=sdpa"
            )
        if self.block_size not in SUPPORTED_BLOCK_SIZES:
            raise BackendUnavailableError(
                f"attention 'triton' supports cache.block_size {SUPPORTED_BLOCK_SIZES}, got {self.block_size}"
            )
        if self.dtype not in SUPPORTED_DTYPES:
            raise BackendUnavailableError(
                f"attention 'triton' supports dtypes float32, float16, bfloat16, got {self.dtype}; "
                "set model.dtype accordingly or use attention.name=sdpa"
            )
        if self.num_heads % self.num_kv_heads:
            raise BackendUnavailableError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Write this step's K/V into the pool, then attend (see ``AttentionBackend.forward``)."""
        self.kernels.store_kv(kv_cache, k, v, metadata.slot_mapping)
        block_m = self.rows_per_program(metadata)
        window = self.layer_window(layer)
        return self.kernels.paged_attention(
            q,
            kv_cache,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_tables,
            scale=self.layer_scale(layer),
            max_seq_len=metadata.max_seq_len,
            block_m=block_m,
            num_splits=self.num_kv_splits(metadata, block_m, window),
            window=window,
            max_query_len=metadata.max_query_len,
            sinks=self.layer_sinks(layer),
        )

    def rows_per_program(self, metadata: AttentionMetadata) -> int:
        """Query rows (tokens x heads of one KV group) per program: enough for the batch's longest query, within
        [16, 64]. 16 is the smallest ``tl.dot`` tile; 64 bounds registers while letting a prefill tile reuse each
        K/V tile for many queries."""
        wanted = _next_power_of_2(metadata.max_query_len * self.queries_per_kv)
        return max(_next_power_of_2(self.queries_per_kv), min(max(wanted, 16), 64))

    def num_kv_splits(self, metadata: AttentionMetadata, block_m: int, window: int | None = None) -> int:
        """How many programs share each sequence's KV range (a power of two; 1 = no split).

        Only when every sequence fits one query tile (decodes, short verification) and the batch alone launches
        fewer programs than the GPU wants; never below ``min_tokens_per_split`` positions per program (of the
        context, or of the ``window + query_len - 1`` positions a sliding window's tile reads).
        """
        if metadata.max_query_len > block_m // self.queries_per_kv:
            return 1
        programs = metadata.num_seqs * self.num_kv_heads
        span = metadata.max_seq_len
        if window:
            span = min(span, window + metadata.max_query_len - 1)
        splits = min(
            self.config.max_kv_splits,
            self.target_programs // programs,
            span // self.config.min_tokens_per_split,
        )
        return _previous_power_of_2(max(splits, 1))


def _interpreting() -> bool:
    """Whether Triton will run kernels in its CPU interpreter (it reads the variable as these values)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on")


def _triton_imported_for_gpu() -> bool:
    """Whether Triton is already loaded with its library functions compiled for a GPU rather than interpreted."""
    language = sys.modules.get("triton.language")
    return language is not None and type(language.zeros).__name__ != "InterpretedFunction"


def _target_programs(device: torch.device) -> int:
    if device.type == "cuda" and not _interpreting():
        return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_TARGET_PROGRAMS


def _next_power_of_2(value: int) -> int:
    return 1 << max(value - 1, 0).bit_length()


def _previous_power_of_2(value: int) -> int:
    return 1 << (value.bit_length() - 1)
