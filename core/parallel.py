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

from __future__ import annotations

import datetime
import logging
import os
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING

import click
import torch
import torch.distributed as dist

from infer.host import cores_per_process

if TYPE_CHECKING:
    from infer.model import LlamaForCausalLM
    from infer.runner import ModelRunner
    from infer.sequence import Sequence

logger = logging.getLogger("infer.parallel")

# Message kinds of the header rank 0 broadcasts: [kind, argument, 0, 0].
STEP, POOL, STOP = 1, 2, 3
HEADER_SIZE = 4
_STORE_PREFIX = "infer/tp"


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed to start or died; the engine cannot run steps any more."""


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

    def describe(self) -> str:
        return (f"rank {self.rank}: query heads {_span(self.q_heads)}, KV heads {_span(self.kv_heads)}, MLP "
                f"columns {_span(self.intermediate)}, vocabulary {_span(self.vocab)}")


def _span(values: range) -> str:
    return f"{values.start}-{values.stop - 1}" if len(values) > 1 else str(values.start)


def _even_split(total: int, parts: int, index: int) -> range:
    """Part ``index`` of ``total`` split into ``parts`` contiguous parts, the first ``total % parts`` one larger."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (1 if index < extra else 0))


def plan_shards(num_heads: int, num_kv_heads: int, intermediate_size: int, vocab_size: int,
                world_size: int) -> list[ShardPlan]:
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
        q = [range((rank // replicas) * group + (rank % replicas) * per_rank,
                   (rank // replicas) * group + (rank % replicas + 1) * per_rank) for rank in range(world_size)]
    else:
        sizes = [size for size in range(1, 2 * num_heads + 1) if size <= num_kv_heads or (
            size % num_kv_heads == 0 and group % (size // num_kv_heads) == 0)]
        raise ValueError(f"parallel.tensor_parallel_size={world_size} cannot split the model's {num_heads} query "
                         f"heads over {num_kv_heads} KV heads (each rank must hold whole KV heads, or one KV head "
                         f"replicated on ranks that split its {group} query heads evenly); sizes that work: "
                         f"{', '.join(map(str, sizes))}")
    return [ShardPlan(rank, world_size, q[rank], kv[rank], _even_split(intermediate_size, world_size, rank),
                      range(rank * chunk, min(vocab_size, (rank + 1) * chunk)), chunk, vocab_size)
            for rank in range(world_size)]


def model_shard_plans(config, world_size: int) -> list[ShardPlan]:
    """``plan_shards`` for a HF model config."""
    num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return plan_shards(config.num_attention_heads, num_kv_heads, config.intermediate_size, config.vocab_size,
                       world_size)


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


@torch.no_grad()
def shard_model(model: LlamaForCausalLM, plan: ShardPlan, group: TensorParallelGroup) -> LlamaForCausalLM:
    """Keep ``plan``'s share of ``model``'s weights (in place, before quantization): each layer's heads and MLP
    columns, the output head's vocabulary rows (untied from the embedding, which stays whole)."""
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        q_rows, kv_rows = _head_rows(plan.q_heads, attn.head_dim), _head_rows(plan.kv_heads, attn.head_dim)
        attn.qkv_proj = _take_rows(attn.qkv_proj, torch.cat(
            [q_rows, attn.q_size + kv_rows, attn.q_size + attn.kv_size + kv_rows]))
        attn.o_proj = _take_columns(attn.o_proj, q_rows, keep_bias=plan.rank == 0)
        attn.num_heads, attn.num_kv_heads = len(plan.q_heads), len(plan.kv_heads)
        attn.q_size, attn.kv_size = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        columns = torch.arange(plan.intermediate.start, plan.intermediate.stop)
        width = mlp.gate_up_proj.out_features // 2
        mlp.gate_up_proj = _take_rows(mlp.gate_up_proj, torch.cat([columns, width + columns]))
        mlp.down_proj = _take_columns(mlp.down_proj, columns, keep_bias=plan.rank == 0)
        attn.tensor_parallel = mlp.tensor_parallel = group
    model.lm_head = _take_rows(model.lm_head, torch.arange(plan.vocab.start, plan.vocab.stop))
    model.tie_word_embeddings = False
    model.num_heads, model.num_kv_heads = len(plan.q_heads), len(plan.kv_heads)
    model.tensor_parallel = group
    return model


def _head_rows(heads: range, head_dim: int) -> torch.Tensor:
    return torch.arange(heads.start * head_dim, heads.stop * head_dim)


def _take_rows(linear: torch.nn.Linear, rows: torch.Tensor) -> torch.nn.Linear:
    """A linear layer computing only output features ``rows`` of ``linear`` (a column-parallel shard)."""
    from infer.model.layers import Linear

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
    from infer.model.layers import Linear

    weight = linear.weight
    bias = linear.bias is not None and keep_bias
    with torch.device(weight.device):
        shard = Linear(len(columns), linear.out_features, bias=bias, dtype=weight.dtype)
    shard.weight.copy_(weight.index_select(1, columns.to(weight.device)))
    if bias:
        shard.bias.copy_(linear.bias)
    return shard


# -- the step's plan on the wire ---------------------------------------------------------------------------------
def pack_step(scheduled: list[tuple[Sequence, int]], input_ids: torch.Tensor, indices: list[int]) -> torch.Tensor:
    """One int64 tensor with what a rank needs to run a step: counts, then each sequence's computed and new token
    counts, its block table, the logits rows, then the step's tokens."""
    tables = [seq.block_table for seq, _ in scheduled]
    values = [len(scheduled), len(indices)]
    values += [seq.num_computed_tokens for seq, _ in scheduled]
    values += [num_new for _, num_new in scheduled]
    values += [len(table) for table in tables]
    for table in tables:
        values += table
    values += indices
    return torch.cat([torch.tensor(values, dtype=torch.int64), input_ids.to("cpu", torch.int64)])


def unpack_step(payload: torch.Tensor) -> tuple[list[list[int]], list[int], list[int], list[int], torch.Tensor]:
    """``(block_tables, num_computed, num_new, indices, input_ids)`` from ``pack_step``'s tensor."""
    head = payload[:2].tolist()
    num_seqs, num_indices = head
    counts = payload[2: 2 + 3 * num_seqs].tolist()
    computed, new, lengths = counts[:num_seqs], counts[num_seqs: 2 * num_seqs], counts[2 * num_seqs:]
    offset = 2 + 3 * num_seqs
    flat = payload[offset: offset + sum(lengths) + num_indices].tolist()
    tables, position = [], 0
    for length in lengths:
        tables.append(flat[position: position + length])
        position += length
    indices = flat[position:]
    return tables, computed, new, indices, payload[offset + len(flat):]


class _Channel:
    """Rank 0's messages to the other ranks: a fixed-size header broadcast, then the step's payload."""

    def __init__(self, group: TensorParallelGroup, device: torch.device):
        self.group = group
        self.device = device  # where the collectives' tensors live (the CPU for gloo, the rank's GPU for NCCL)

    def send(self, kind: int, argument: int = 0, payload: torch.Tensor | None = None) -> None:
        header = torch.tensor([kind, argument, 0, 0], dtype=torch.int64, device=self.device)
        self.group.broadcast(header)
        if payload is not None:
            self.group.broadcast(payload.to(self.device))

    def receive(self) -> tuple[int, int, torch.Tensor | None]:
        header = self.group.broadcast(torch.empty(HEADER_SIZE, dtype=torch.int64, device=self.device))
        kind, argument = header[:2].tolist()
        if kind != STEP:
            return kind, argument, None
        payload = self.group.broadcast(torch.empty(argument, dtype=torch.int64, device=self.device))
        return kind, argument, payload.cpu()


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _timeout(config) -> datetime.timedelta:
    return datetime.timedelta(seconds=config.parallel.timeout_s)


def _rank_device(config, rank: int) -> torch.device:
    device = torch.device(config.model.resolved_device())
    if device.type == "cuda":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return device


def _threads_per_rank(config, local_ranks: int) -> int:
    if config.parallel.threads_per_rank is not None:
        return config.parallel.threads_per_rank
    return cores_per_process(local_ranks)


def _master_address(config, need_port: bool) -> tuple[str, int]:
    settings = config.parallel
    addr = settings.master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    port = settings.master_port
    if port is None and os.environ.get("MASTER_PORT"):
        port = int(os.environ["MASTER_PORT"])
    if port is None or port == 0:
        if need_port:
            raise ValueError("parallel.master_port (or $MASTER_PORT) must name a port when ranks run on other "
                             "hosts: every rank meets rank 0 there")
        port = 0  # rank 0's store binds a free one
    return addr, port


class TensorParallel:
    """Rank 0's side: starts the local ranks, meets the others, sends each step's plan, and stops them.

    ``launch`` first (the other ranks load their shards while rank 0 loads its own), then ``shard`` rank 0's
    model, then ``connect``; ``close`` stops every rank (idempotent)."""

    def __init__(self, config):
        settings = config.parallel
        self.config = config
        self.world_size = settings.tensor_parallel_size
        self.local_ranks = settings.local_ranks or self.world_size
        self.device = _rank_device(config, 0)
        self.threads = _threads_per_rank(config, self.local_ranks)
        self.plans: list[ShardPlan] = []
        self.group: TensorParallelGroup | None = None
        self.failed: TensorParallelError | None = None
        self.processes: dict[int, object] = {}
        self._connected = self._closed = False
        self._threads_before = torch.get_num_threads()

    @classmethod
    def launch(cls, config, hf_config) -> TensorParallel:
        """Open the meeting point and start ranks 1 .. local_ranks - 1 here (spawned processes). Raises
        ``ValueError`` before starting anything when ``hf_config``'s heads cannot be split over the ranks."""
        import torch.multiprocessing as mp

        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialized in this process (another tensor-parallel "
                               "engine still open?); close it first (Engine.close or LLM.close)")
        parallel = cls(config)
        parallel.plans = model_shard_plans(hf_config, parallel.world_size)
        parallel.group = TensorParallelGroup(parallel.plans[0])
        addr, port = _master_address(config, need_port=parallel.local_ranks < parallel.world_size)
        parallel.store = dist.TCPStore(addr, port, parallel.world_size, is_master=True, timeout=_timeout(config),
                                       wait_for_workers=False)
        parallel.address = (addr, parallel.store.port)
        torch.set_num_threads(parallel.threads)
        context = mp.get_context("spawn")
        data = config.to_dict()
        for rank in range(1, parallel.local_ranks):
            process = context.Process(target=run_worker, args=(data, rank, addr, parallel.store.port,
                                                               parallel.threads),
                                      name=f"infer-tp-rank-{rank}", daemon=True)
            process.start()
            parallel.processes[rank] = process
        logger.info("tensor parallel: %d ranks (%s), %d on this host, meeting at %s:%d, %d threads each",
                    parallel.world_size, _backend(parallel.device), parallel.local_ranks, addr, parallel.store.port,
                    parallel.threads)
        return parallel

    def shard(self, model: LlamaForCausalLM) -> LlamaForCausalLM:
        """Rank 0's shard of ``model``."""
        for plan in self.plans:
            logger.info("tensor parallel %s", plan.describe())
        return shard_model(model, self.plans[0], self.group)

    def connect(self) -> None:
        """Wait until every rank has loaded its shard (or failed: raise with its traceback), then form the
        process group."""
        deadline = time.monotonic() + self.config.parallel.timeout_s
        waiting = set(range(1, self.world_size))
        while waiting:
            for rank in sorted(waiting):
                if self.store.check([f"{_STORE_PREFIX}/error/{rank}"]):
                    detail = self.store.get(f"{_STORE_PREFIX}/error/{rank}").decode(errors="replace")
                    raise TensorParallelError(f"tensor-parallel rank {rank} failed to start:\n{detail.rstrip()}")
                if self.store.check([f"{_STORE_PREFIX}/ready/{rank}"]):
                    waiting.discard(rank)
                    continue
                process = self.processes.get(rank)
                if process is not None and process.exitcode is not None:
                    raise TensorParallelError(f"tensor-parallel rank {rank} exited ({_exit_reason(process.exitcode)})"
                                              f" before loading its shard; see its output above")
            if waiting and time.monotonic() > deadline:
                raise TensorParallelError(
                    f"tensor-parallel ranks {sorted(waiting)} did not join {self.address[0]}:{self.address[1]} "
                    f"within parallel.timeout_s={self.config.parallel.timeout_s:g} s; start them with "
                    f"`infer tp-worker CONFIG --rank R` on their hosts, with the same config")
            if waiting:
                time.sleep(0.05)
        dist.init_process_group(_backend(self.device), store=self.store, rank=0, world_size=self.world_size,
                                timeout=_timeout(self.config))
        self.channel = _Channel(self.group, self.device)
        self._connected = True

    # -- per step ------------------------------------------------------------------------------------------------
    def send_pool(self, num_blocks: int) -> None:
        """Every other rank allocates a zeroed KV pool of ``num_blocks`` over its KV heads (replacing its last)."""
        self._call(lambda: self.channel.send(POOL, num_blocks))

    def send_step(self, scheduled: list[tuple[Sequence, int]], input_ids: torch.Tensor, indices: list[int]) -> None:
        payload = pack_step(scheduled, input_ids, indices)
        self._call(lambda: self.channel.send(STEP, payload.numel(), payload))

    def _call(self, send) -> None:
        if self.failed is not None:
            raise self.failed
        try:
            send()
        except RuntimeError as error:
            raise self.failure(error) from error

    def failure(self, error: BaseException) -> TensorParallelError:
        """The error to raise for a failed collective: names the rank that died when it is local; stops the
        others. Later steps raise it again."""
        if self.failed is None:
            time.sleep(0.2)  # a killed rank's exit code lands a moment after its sockets close
            dead = [f"rank {rank} (pid {process.pid}) {_exit_reason(process.exitcode)}"
                    for rank, process in self.processes.items() if process.exitcode is not None]
            who = ("tensor-parallel " + ", ".join(dead)) if dead else "a tensor-parallel rank on another host failed"
            self.failed = TensorParallelError(f"{who}; the engine cannot run steps any more and stops the other "
                                              f"ranks ({_first_line(error)})")
            self.close()
        return self.failed

    @property
    def comm_time_s(self) -> float:
        return self.group.comm_time_s if self.group is not None else 0.0

    def kv_bytes_per_token(self, num_layers: int, head_dim: int, dtype: torch.dtype) -> list[int]:
        """Each rank's KV bytes per token (its KV heads)."""
        from infer.kv_pool import kv_bytes_per_token

        return [kv_bytes_per_token(num_layers, len(plan.kv_heads), head_dim, dtype) for plan in self.plans]

    def describe(self) -> str:
        return (f"tensor parallel {self.world_size} ranks ({_backend(self.device)}, {self.local_ranks} on this host, "
                f"{self.threads} threads each; sharded layers take the torch path)")

    def close(self) -> None:
        """Stop every rank: a STOP message when the group works, then join (kill after 10 s) the local ones."""
        if self._closed:
            return
        self._closed = True
        stopped = self._connected and self.failed is None  # told to stop; else they may wait for rank 0 forever
        if stopped:
            try:
                self.channel.send(STOP)
            except RuntimeError:
                pass
        for process in self.processes.values():
            process.join(timeout=10 if stopped else 0.5)
            if process.exitcode is None:
                process.kill()
                process.join(timeout=5)
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(self._threads_before)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _exit_reason(exitcode: int | None) -> str:
    if exitcode is None:
        return "is running"
    if exitcode < 0:
        import signal

        return f"was killed by signal {-exitcode} ({signal.Signals(-exitcode).name})"
    return f"exited with status {exitcode}"


# -- the other ranks -----------------------------------------------------------------------------------------------
def run_worker(config_data: dict, rank: int, addr: str, port: int, threads: int) -> None:
    """Rank ``rank`` (not 0): load its shard, report to the store, then run every step rank 0 sends until STOP.
    A spawned process's target, and ``infer tp-worker``'s body."""
    from infer.config import InferConfig

    config = InferConfig.from_dict(config_data)
    torch.set_num_threads(threads)
    world_size = config.parallel.tensor_parallel_size
    store = dist.TCPStore(addr, port, world_size, is_master=False, timeout=_timeout(config))
    try:
        runner = _build_rank(config, rank)
    except BaseException:
        store.set(f"{_STORE_PREFIX}/error/{rank}", traceback.format_exc())
        raise SystemExit(1) from None
    store.set(f"{_STORE_PREFIX}/ready/{rank}", "1")
    dist.init_process_group(_backend(runner.device), store=store, rank=rank, world_size=world_size,
                            timeout=_timeout(config))
    try:
        _serve_steps(runner)
    except RuntimeError as error:  # rank 0 or a peer is gone: nothing left to serve
        logger.error("tensor-parallel rank %d stops: %s", rank, _first_line(error))
        raise SystemExit(1) from None
    finally:
        dist.destroy_process_group()


def _build_rank(config, rank: int) -> ModelRunner:
    from infer.execution import build_model_stack
    from infer.loader import load_model, resolve_dtype
    from infer.registry import get_registry
    from infer.runner import ModelRunner

    device = _rank_device(config, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = resolve_dtype(config.model.dtype, device)
    torch.manual_seed(config.model.seed)
    loaded = load_model(config.model.path, dtype, device)
    plan = model_shard_plans(loaded.hf_config, config.parallel.tensor_parallel_size)[rank]
    stack = build_model_stack(get_registry(config.plugins.load), config, loaded.model, device, dtype,
                              shard=lambda model: shard_model(model, plan, TensorParallelGroup(plan)))
    return ModelRunner(stack.model, stack.attention, torch.empty(0, dtype=dtype, device=device), device,
                       stack.executor)


def _serve_steps(runner: ModelRunner) -> None:
    from infer.attention import AttentionMetadata

    model = runner.model
    channel = _Channel(model.tensor_parallel, runner.device if runner.device.type == "cuda" else torch.device("cpu"))
    while True:
        kind, argument, payload = channel.receive()
        if kind == STOP:
            return
        if kind == POOL:
            runner.kv_cache = None  # the old pool goes before the new one is allocated
            runner.kv_cache = runner.attention.allocate_kv_cache(model.num_layers, argument)
            continue
        tables, computed, new, indices, input_ids = unpack_step(payload)
        metadata = AttentionMetadata.build(tables, computed, new, runner.block_size, runner.device)
        runner.forward(input_ids.to(runner.device), metadata, indices)


@click.command("tp-worker", epilog="CONFIG is a YAML file or a shipped config name; OVERRIDES are key=value.")
@click.argument("config")
@click.argument("overrides", nargs=-1)
@click.option("--rank", type=int, required=True, help="This rank (1 .. parallel.tensor_parallel_size - 1).")
def tp_worker_command(config: str, overrides: tuple[str, ...], rank: int) -> None:
    """Run one tensor-parallel rank on this host for an engine on another (same CONFIG and OVERRIDES as rank 0's,
    whose parallel.master_addr and master_port, or $MASTER_ADDR and $MASTER_PORT, name where rank 0 listens).
    Exits when rank 0 stops."""
    from infer.config import load_config

    resolved = load_config(config, list(overrides))
    size = resolved.parallel.tensor_parallel_size
    if not 1 <= rank < size:
        raise click.BadParameter(f"must be 1 .. {size - 1} (parallel.tensor_parallel_size={size})",
                                 param_hint="--rank")
    addr, port = _master_address(resolved, need_port=True)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(name)s: %(message)s")
    run_worker(resolved.to_dict(), rank, addr, port, _threads_per_rank(resolved, 1))
