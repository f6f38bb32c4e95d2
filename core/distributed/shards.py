"""Shard plans: which query heads, KV heads, MLP columns and vocabulary rows each tensor-parallel rank holds."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """What one rank holds: global query heads ``q_heads``, KV heads ``kv_heads``, MLP columns ``intermediate``,
    vocabulary rows ``vocab`` (every rank's slice padded to ``vocab_chunk`` for the gather)."""

    rank: int
    world_size: int
    q_heads: range
    kv_heads: range
    intermediate: range
    vocab: range
    vocab_chunk: int
    vocab_size: int

    def expert_columns(self, intermediate_size: int) -> range:
        """This rank's columns of each expert ``intermediate_size`` wide: an even split as ``intermediate``'s, in
        whole blocks of the largest of 32, 16, 8 or 4 columns that divides the width and leaves every rank a block,
        so each rank's gate, up and down weights keep the packed layouts' shapes (AMX tiles take 32 columns, the
        GEMV's rows 4 and its inputs 8)."""
        unit = next(
            (
                size
                for size in (32, 16, 8, 4)
                if intermediate_size % size == 0 and intermediate_size // size >= self.world_size
            ),
            1,
        )
        blocks = _even_split(intermediate_size // unit, self.world_size, self.rank)
        return range(blocks.start * unit, blocks.stop * unit)

    def describe(self) -> str:
        return (
            f"rank {self.rank}: query heads {_span(self.q_heads)}, KV heads {_span(self.kv_heads)}, MLP "
            f"columns {_span(self.intermediate)}, vocabulary {_span(self.vocab)}"
        )


def _span(values: range) -> str:
    return f"{values.start}-{values.stop - 1}" if len(values) > 1 else str(values.start)


def _even_split(total: int, parts: int, index: int) -> range:
    """Part ``index`` of ``total`` split into ``parts`` contiguous parts, the first ``total % parts`` one larger."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (1 if index < extra else 0))


def plan_shards(
    num_heads: int, num_kv_heads: int, intermediate_size: int, vocab_size: int, world_size: int
) -> list[ShardPlan]:
    """Every rank's ``ShardPlan``; raises ``ValueError`` naming the sizes that work when heads cannot be split."""
    group = num_heads // num_kv_heads
    chunk = -(-vocab_size // world_size)
    if world_size <= num_kv_heads:
        kv = [_even_split(num_kv_heads, world_size, rank) for rank in range(world_size)]
        q = [range(heads.start * group, heads.stop * group) for heads in kv]
    elif world_size % num_kv_heads == 0 and group % (world_size // num_kv_heads) == 0:
        replicas = world_size // num_kv_heads
        per_rank = group // replicas
        kv = [range(rank // replicas, rank // replicas + 1) for rank in range(world_size)]
        q = [
            range(
                (rank // replicas) * group + (rank % replicas) * per_rank,
                (rank // replicas) * group + (rank % replicas + 1) * per_rank,
            )
            for rank in range(world_size)
        ]
    else:
        sizes = [
            size
            for size in range(1, 2 * num_heads + 1)
            if size <= num_kv_heads or (size % num_kv_heads == 0 and group % (size // num_kv_heads) == 0)
        ]
        raise ValueError(
            f"parallel.tensor_parallel_size={world_size} cannot split the model's {num_heads} query "
            f"heads over {num_kv_heads} KV heads (each rank must hold whole KV heads, or one KV head "
            f"replicated on ranks that split its {group} query heads evenly); sizes that work: "
            f"{', '.join(map(str, sizes))}"
        )
    return [
        ShardPlan(
            rank,
            world_size,
            q[rank],
            kv[rank],
            _even_split(intermediate_size, world_size, rank),
            range(rank * chunk, min(vocab_size, (rank + 1) * chunk)),
            chunk,
            vocab_size,
        )
        for rank in range(world_size)
    ]


def model_shard_plans(config, world_size: int) -> list[ShardPlan]:
    """``plan_shards`` for a HF model config."""
    num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return plan_shards(
        config.num_attention_heads, num_kv_heads, config.intermediate_size, config.vocab_size, world_size
    )
