"""A tensor-parallel rank's collectives over torch.distributed (gloo on a CPU, NCCL on CUDA)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from infer.distributed.shards import ShardPlan


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed to start or died; the engine cannot run steps any more."""


class TensorParallelGroup:
    """This rank's collectives over torch.distributed's default group, and the time spent in them."""

    def __init__(self, plan: ShardPlan):
        self.plan = plan
        self.rank = plan.rank
        self.world_size = plan.world_size
        self.reset_counters()

    def reset_counters(self) -> None:
        self.comm_time_s = 0.0
        self.num_all_reduces = 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the ranks, in place."""
        start = time.perf_counter()
        dist.all_reduce(tensor)
        self.comm_time_s += time.perf_counter() - start
        self.num_all_reduces += 1
        return tensor

    def gather_vocabulary(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Each rank's logits over its vocabulary slice, ``[N, len(plan.vocab)]``, concatenated on rank 0
        (``[N, vocab]``); None on the other ranks."""
        start = time.perf_counter()
        chunk = self.plan.vocab_chunk
        if logits.shape[1] < chunk:
            logits = torch.nn.functional.pad(logits, (0, chunk - logits.shape[1]))
        logits = logits.contiguous()
        pieces = [torch.empty_like(logits) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(logits, pieces, dst=0)
        self.comm_time_s += time.perf_counter() - start
        if pieces is None:
            return None
        return torch.cat(pieces, dim=1)[:, : self.plan.vocab_size]

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        dist.broadcast(tensor, src=0)
        self.comm_time_s += time.perf_counter() - start
        return tensor


def backend_name(device: torch.device) -> str:
    """torch.distributed's backend for collectives on ``device``."""
    return "nccl" if device.type == "cuda" else "gloo"
