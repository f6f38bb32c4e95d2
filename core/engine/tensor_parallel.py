"""Rank 0's side of tensor parallelism (``infer.distributed``): starts the ranks, meets them, sends each step's plan,
and the other ranks' loop that runs what it sends."""

from __future__ import annotations

import datetime
import logging
import os
import time
import traceback
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from infer.distributed import (
    POOL,
    STEP,
    STOP,
    Channel,
    ShardPlan,
    TensorParallelError,
    TensorParallelGroup,
    backend_name,
    model_shard_plans,
    pack_step,
    unpack_step,
)
from infer.host import cores_per_process
from infer.model.sharding import shard_layer, shard_model

if TYPE_CHECKING:
    from infer.attention import AttentionBackend
    from infer.execution.runner import ModelRunner
    from infer.model.decoder import CausalLM, DecoderLayer
    from infer.sequence import Sequence

logger = logging.getLogger("infer.parallel")

_STORE_PREFIX = "infer/tp"


def _timeout(config) -> datetime.timedelta:
    return datetime.timedelta(seconds=config.parallel.timeout_s)


def _rank_device(config, rank: int) -> torch.device:
    device = torch.device(config.model.resolved_device())
    if device.type == "cuda":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return device


def threads_per_rank(config, local_ranks: int) -> int:
    if config.parallel.threads_per_rank is not None:
        return config.parallel.threads_per_rank
    return cores_per_process(local_ranks)


def master_address(config, need_port: bool) -> tuple[str, int]:
    settings = config.parallel
    addr = settings.master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    port = settings.master_port
    if port is None and os.environ.get("MASTER_PORT"):
        port = int(os.environ["MASTER_PORT"])
    if port is None or port == 0:
        if need_port:
            raise ValueError(
                "parallel.master_port (or $MASTER_PORT) must name a port when ranks run on other "
                "hosts: every rank meets rank 0 there"
            )
        port = 0  # rank 0's store binds a free one
    return addr, port


class TensorParallel:
    """Rank 0's side: starts the local ranks, meets the others, sends each step's plan, and stops them.
    ``infer.distributed.SingleProcess`` answers the same for an engine in one process.

    ``launch`` first (the other ranks load their shards while rank 0 loads its own), then ``shard`` rank 0's
    model, then ``connect``; ``close`` stops every rank (idempotent)."""

    sharded = True

    def __init__(self, config):
        settings = config.parallel
        self.config = config
        self.world_size = settings.tensor_parallel_size
        self.local_ranks = settings.local_ranks or self.world_size
        self.device = _rank_device(config, 0)
        self.threads = threads_per_rank(config, self.local_ranks)
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
            raise RuntimeError(
                "torch.distributed is already initialized in this process (another tensor-parallel "
                "engine still open?); close it first (Engine.close or LLM.close)"
            )
        parallel = cls(config)
        parallel.plans = model_shard_plans(hf_config, parallel.world_size)
        parallel.group = TensorParallelGroup(parallel.plans[0])
        addr, port = master_address(config, need_port=parallel.local_ranks < parallel.world_size)
        parallel.store = dist.TCPStore(
            addr, port, parallel.world_size, is_master=True, timeout=_timeout(config), wait_for_workers=False
        )
        parallel.address = (addr, parallel.store.port)
        torch.set_num_threads(parallel.threads)
        context = mp.get_context("spawn")
        data = config.to_dict()
        for rank in range(1, parallel.local_ranks):
            process = context.Process(
                target=run_worker,
                args=(data, rank, addr, parallel.store.port, parallel.threads),
                name=f"infer-tp-rank-{rank}",
                daemon=True,
            )
            process.start()
            parallel.processes[rank] = process
        logger.info(
            "tensor parallel: %d ranks (%s), %d on this host, meeting at %s:%d, %d threads each",
            parallel.world_size,
            backend_name(parallel.device),
            parallel.local_ranks,
            addr,
            parallel.store.port,
            parallel.threads,
        )
        return parallel

    def shard_layer(self, layer: DecoderLayer) -> DecoderLayer:
        """Rank 0's share of one decoder layer, kept as soon as the layer is read."""
        return shard_layer(layer, self.plans[0], self.group)

    def shard(self, model: CausalLM) -> CausalLM:
        """Rank 0's shard of ``model`` (its layers sharded as they were read)."""
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
                    raise TensorParallelError(
                        f"tensor-parallel rank {rank} exited ({_exit_reason(process.exitcode)})"
                        f" before loading its shard; see its output above"
                    )
            if waiting and time.monotonic() > deadline:
                raise TensorParallelError(
                    f"tensor-parallel ranks {sorted(waiting)} did not join {self.address[0]}:{self.address[1]} "
                    f"within parallel.timeout_s={self.config.parallel.timeout_s:g} s; start them with "
                    f"`infer tp-worker CONFIG --rank R` on their hosts, with the same config"
                )
            if waiting:
                time.sleep(0.05)
        dist.init_process_group(
            backend_name(self.device),
            store=self.store,
            rank=0,
            world_size=self.world_size,
            timeout=_timeout(self.config),
        )
        self.channel = Channel(self.group, self.device)
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
            dead = [
                f"rank {rank} (pid {process.pid}) {_exit_reason(process.exitcode)}"
                for rank, process in self.processes.items()
                if process.exitcode is not None
            ]
            who = ("tensor-parallel " + ", ".join(dead)) if dead else "a tensor-parallel rank on another host failed"
            self.failed = TensorParallelError(
                f"{who}; the engine cannot run steps any more and stops the other ranks ({_first_line(error)})"
            )
            self.close()
        return self.failed

    @property
    def comm_time_s(self) -> float:
        return self.group.comm_time_s if self.group is not None else 0.0

    def reset_counters(self) -> None:
        self.group.reset_counters()

    def kv_bytes_per_token(self, attention: AttentionBackend, num_layers: int) -> list[int]:
        """Each rank's KV bytes per token: ``num_layers`` layers of its own KV heads in ``attention``'s pool dtype
        (rank 0's backend)."""
        per_head = attention.kv_bytes_per_token(num_layers) // attention.num_kv_heads
        return [per_head * len(plan.kv_heads) for plan in self.plans]

    def describe(self) -> str:
        return (
            f"tensor parallel {self.world_size} ranks ({backend_name(self.device)}, {self.local_ranks} on this "
            f"host, {self.threads} threads each; sharded layers take the torch path)"
        )

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
    dist.init_process_group(
        backend_name(runner.device), store=store, rank=rank, world_size=world_size, timeout=_timeout(config)
    )
    try:
        _serve_steps(runner)
    except RuntimeError as error:  # rank 0 or a peer is gone: nothing left to serve
        logger.error("tensor-parallel rank %d stops: %s", rank, _first_line(error))
        raise SystemExit(1) from None
    finally:
        dist.destroy_process_group()


def _build_rank(config, rank: int) -> ModelRunner:
    from transformers import AutoConfig

    from infer.execution.paths import build_model_stack, load_for_stack
    from infer.execution.runner import ModelRunner
    from infer.model.loader import hf_model_dir, resolve_dtype
    from infer.registry import get_registry

    device = _rank_device(config, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = resolve_dtype(config.model.dtype, device)
    torch.manual_seed(config.model.seed)
    registry = get_registry(config.plugins.load)
    hf_config = AutoConfig.from_pretrained(hf_model_dir(config.model.path))
    plan = model_shard_plans(hf_config, config.parallel.tensor_parallel_size)[rank]
    group = TensorParallelGroup(plan)
    loaded = load_for_stack(config, registry, device, dtype, lambda layer: shard_layer(layer, plan, group))
    stack = build_model_stack(
        registry, config, loaded.model, device, dtype, shard=lambda model: shard_model(model, plan, group)
    )
    return ModelRunner(stack.model, stack.attention, torch.empty(0, dtype=dtype, device=device), device, stack.executor)


def _serve_steps(runner: ModelRunner) -> None:
    from infer.attention import AttentionMetadata

    model = runner.model
    channel = Channel(model.tensor_parallel, runner.device if runner.device.type == "cuda" else torch.device("cpu"))
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
