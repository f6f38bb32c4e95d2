"""``ForwardStep``: what a model's layers read of one forward pass, declared here so the model depends on no layer
above it. The execution layer builds the object (``infer.execution.paths.ExecutionStep``) and decides how the layers
run; the layers only read it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from infer.attention import AttentionMetadata
    from infer.model.ops import StepOps


class ForwardStep(Protocol):
    """One forward pass's per-step state, passed explicitly to every layer (no global context)."""

    metadata: AttentionMetadata  # what the attention backend's ``prepare`` returned
    kv_cache: torch.Tensor  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    ops: StepOps  # the small ops, torch's or the CPU kernels'

    @property
    def positions(self) -> torch.Tensor:  # [T] int64
        ...

    @property
    def num_tokens(self) -> int: ...

    def attend(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention backend's attention for one layer: writes this step's K/V into the layer's pool, then
        attends."""
        ...

    def run_layers(self, layers: Sequence, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``layers`` over ``hidden`` ``[T, hidden]`` on the path the execution layer chooses: ``(delta,
        residual)`` for the final norm to add."""
        ...
