"""Tensor parallelism on torch.distributed (gloo on a CPU, NCCL on CUDA): one model sharded over several processes.

Rank 0 is the engine: the scheduler, allocator, prefix cache, sampling and drafting run there once. Every rank
(rank 0 too) holds a shard of the model and its own KV pool over its own KV heads, with the same number of blocks,
so one block table addresses every rank's pool. A step is one broadcast of its plan (tokens, block tables, computed
and new token counts, the rows whose logits are needed) from rank 0; then every rank runs the same forward pass:

- Q/K/V and gate/up are column-parallel (a rank computes its heads and its slice of the MLP's width);
- the output and down projections are row-parallel: each rank's partial sums are added by one all-reduce each
  (``Attention``/``MLP`` call ``TensorParallelGroup.all_reduce``), so every rank holds the full hidden state after;
- the embedding is replicated (a lookup costs nothing; sharding it would add an all-reduce per step) and the output
  head is vocabulary-parallel: each rank computes its slice of the logits and rank 0 gathers them.

Heads are split by KV head, so a rank's query heads are exactly those reading its KV heads (GQA groups stay whole).
When the size does not divide the KV heads (the default model's 3 over 2 ranks) the split is uneven (2 and 1),
where vLLM refuses; with more ranks than KV heads each KV head is replicated on ``size / num_kv_heads`` ranks, which
split its group's query heads (vLLM's rule). Anything else is refused with the sizes that work.

Rank 0 starts the ranks of its host (``parallel.local_ranks``) with ``torch.multiprocessing`` (spawn); ranks on
other hosts run ``infer tp-worker CONFIG --rank R`` with the same config. They meet at
``parallel.master_addr:master_port`` (torch's TCP store), where each rank reports that its shard is loaded, or its
traceback. A rank that dies is noticed at the next collective (gloo's connection closes) or at once when it is local:
the engine raises ``TensorParallelError`` naming it, stops the others, and refuses further steps.
"""

from infer.distributed.group import TensorParallelError, TensorParallelGroup, backend_name
from infer.distributed.shards import ShardPlan, model_shard_plans, plan_shards
from infer.distributed.single import SingleProcess
from infer.distributed.wire import HEADER_SIZE, POOL, STEP, STOP, Channel, pack_step, unpack_step

__all__ = [
    "HEADER_SIZE",
    "POOL",
    "STEP",
    "STOP",
    "Channel",
    "ShardPlan",
    "SingleProcess",
    "TensorParallelError",
    "TensorParallelGroup",
    "backend_name",
    "model_shard_plans",
    "pack_step",
    "plan_shards",
    "unpack_step",
]
