"""``SingleProcess``: the ranks of a model that is not sharded."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from infer.attention import AttentionBackend
    from infer.sequence import Sequence


class SingleProcess:
    """The ranks of an engine whose model is not sharded, and of a runner built without ranks: this process alone.
    It answers what rank 0's ``infer.engine.tensor_parallel.TensorParallel`` answers, so the engine and the runner
    treat one process and several alike (no ``is None`` tests in a step)."""

    sharded = False
    world_size = local_ranks = 1
    comm_time_s = 0.0

    def connect(self) -> None:
        """Nothing to meet."""

    def reset_counters(self) -> None:
        """No collectives to count."""

    def send_pool(self, num_blocks: int) -> None:
        """No other rank holds a pool."""

    def send_step(self, scheduled: list[tuple[Sequence, int]], input_ids: torch.Tensor, indices: list[int]) -> None:
        """No other rank runs the step."""

    def kv_bytes_per_token(self, attention: AttentionBackend, num_layers: int) -> list[int]:
        """This one rank's KV bytes per token: ``num_layers`` layers of ``attention``'s heads."""
        return [attention.kv_bytes_per_token(num_layers)]

    def describe(self) -> str:
        return ""

    def close(self) -> None:
        """Nothing to stop."""
