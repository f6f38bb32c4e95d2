"""Tensor parallelism's overhead on one box: TP=2 (one thread per rank) against TP=1 (two threads) on decode at batch
1 and 64, rank 0's time in collectives as a share of a step, and gloo's all-reduce latency on loopback; then what the
same collectives (count and bytes per step, taken from these runs) would cost over NVLink for Llama-3-8B and 70B on 2
and 8 GPUs.

Each case runs in its own engine, one after another in this process: TP=1 on the default path (fused C stack), TP=1
op by op (``execution.paths=[torch]``, the path a sharded layer takes: it all-reduces between its projections), TP=2.

    python benchmarks/tensor_parallel.py [--json tp.json] [--batches 1 64] [--tokens 48]

``--moe`` times one mixture-of-experts layer instead (``random_models.py``'s ``qwen3-moe-3.3b`` shape: 32 experts of
2048 x 512, top 4, bf16 weights on infer's kernels), each layout in its own spawned processes: whole on one rank (1
and 2 threads), split by expert columns over two ranks (what ``infer.model.sharding`` does: every rank reads half of
each active expert), and split by experts over two ranks (expert parallelism: each rank runs the active experts it
holds, 16 of the 32), one thread a rank, the outputs all-reduced. Every process writes 512 MB between calls (past
the last-level cache), so each call reads its experts from memory as a decode step through 48 layers does. Rank 0's
wall time per call (its median, and its best: on a shared machine the median includes calls where the scheduler held
a rank), and the CPU time per call of the busier rank's process (what the step waits for, less the time other
processes took the cores; with 2 threads, both threads' time).

    python benchmarks/tensor_parallel.py --moe [--batches 1 16] [--steps 48] [--layers 2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import queue
import subprocess
import time

import torch

from infer import LLM, SamplingParams
from infer.host import cpu_signature

CASES = [
    ("TP=1, 2 threads (fused C stack)", ["parallel.tensor_parallel_size=1"]),
    ("TP=1, 2 threads, torch path", ["parallel.tensor_parallel_size=1", "execution.paths=[torch]"]),
    ("TP=2, 1 thread per rank", ["parallel.tensor_parallel_size=2", "parallel.threads_per_rank=1"]),
]
# NVLink assumptions for the GPU estimate (H100 SXM, NCCL ring all-reduce): bus bandwidth achieved on large messages
# and the latency of one small all-reduce (a launch plus the ring's steps), both as NCCL's tests report them.
NVLINK_BUS_GBPS = 360.0
NVLINK_LATENCY_US = {2: 8.0, 8: 15.0}
GEOMETRIES = {"Llama-3-8B": (32, 4096), "Llama-3-70B": (80, 8192)}  # layers, hidden


def decode_case(overrides: list[str], batch: int, tokens: int) -> dict:
    """Decode throughput at ``batch`` sequences: each prompt prefilled first (one step each), then ``tokens``
    decode steps timed alone."""
    with LLM("baseline", dotlist=[*overrides, "model.max_model_len=512", f"scheduler.max_num_seqs={batch}"]) as llm:
        engine = llm.engine
        prompt = [1] + list(range(1000, 1031))  # 32 tokens
        for _ in range(batch):
            engine.add_request(prompt, SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True))
        while any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in [*engine.waiting, *engine.running]):
            engine.step()
        parallel = engine.ranks
        comm_before = parallel.comm_time_s
        reduces_before = parallel.group.num_all_reduces if parallel.sharded else 0
        steps_before, busy_before = engine.stats.num_steps, engine.stats.busy_time_s
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        wall = time.perf_counter() - start
        steps = engine.stats.num_steps - steps_before
        busy = engine.stats.busy_time_s - busy_before
        comm = (parallel.comm_time_s - comm_before) if parallel.sharded else 0.0
        return {
            "batch": batch,
            "steps": steps,
            "step_ms": 1000 * wall / steps,
            "tok_per_s": batch * steps / wall,
            "comm_share": comm / busy if busy else 0.0,
            "all_reduces_per_step": ((parallel.group.num_all_reduces - reduces_before) / steps)
            if parallel.sharded
            else 0.0,
            "execution": engine.describe_execution(),
            "num_layers": engine.model.num_layers,
            "hidden": engine.model.hidden_size,
        }


def gloo_latency(sizes: list[int], hidden: int, repeats: int = 300) -> dict[int, float]:
    """Microseconds per all-reduce of ``[rows, hidden]`` float32 between two spawned processes over loopback."""
    import torch.multiprocessing as mp

    from infer.host import free_port

    context = mp.get_context("spawn")
    results = context.Manager().dict()
    port = free_port()
    processes = [
        context.Process(target=_all_reduce_rank, args=(rank, port, sizes, hidden, repeats, results))
        for rank in range(2)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
    return dict(results)


def _all_reduce_rank(rank, port, sizes, hidden, repeats, results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120)
    )
    for rows in sizes:
        tensor = torch.zeros(rows, hidden)
        for _ in range(20):
            dist.all_reduce(tensor)
        start = time.perf_counter()
        for _ in range(repeats):
            dist.all_reduce(tensor)
        if rank == 0:
            results[rows] = 1e6 * (time.perf_counter() - start) / repeats
    dist.destroy_process_group()


def nvlink_estimate(batches: list[int], collectives_per_layer: float) -> list[dict]:
    """Communication per decode step over NVLink: ``collectives_per_layer`` ring all-reduces of ``[batch, hidden]``
    bf16 per layer (measured here: two), each ``latency + 2 (n-1)/n bytes / bus bandwidth``."""
    rows = []
    for name, (layers, hidden) in GEOMETRIES.items():
        for gpus, latency_us in NVLINK_LATENCY_US.items():
            for batch in [*batches, 8192]:
                size = batch * hidden * 2
                per_reduce_us = latency_us + 1e6 * 2 * (gpus - 1) / gpus * size / (NVLINK_BUS_GBPS * 1e9)
                rows.append(
                    {
                        "model": name,
                        "gpus": gpus,
                        "tokens": batch,
                        "comm_ms_per_step": layers * collectives_per_layer * per_reduce_us / 1000,
                    }
                )
    return rows


MOE_LAYOUTS = [
    ("TP=1, 1 thread", "whole", 1, 1),
    ("TP=1, 2 threads", "whole", 1, 2),
    ("TP=2 by expert columns, 1 thread per rank", "columns", 2, 1),
    ("TP=2 by experts, 1 thread per rank", "experts", 2, 1),
]  # name, layout, ranks, threads per rank


def moe_layer_times(layout: str, world_size: int, threads: int, args) -> dict:
    """Rank 0's median ms per layer call at each of ``args.batches`` with the layers split as ``layout`` over
    ``world_size`` spawned ranks (``_moe_layer_rank``)."""
    import torch.multiprocessing as mp

    from infer.host import free_port

    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    ranks = [
        context.Process(target=_moe_layer_rank, args=(rank, world_size, port, threads, layout, args, results))
        for rank in range(world_size)
    ]
    for process in ranks:
        process.start()
    while True:  # rank 0's numbers, or stop when a rank died (its traceback is above)
        try:
            found = results.get(timeout=5)
            break
        except queue.Empty:
            if any(process.exitcode not in (None, 0) for process in ranks):
                for process in ranks:
                    process.kill()
                raise SystemExit(f"a rank of the {layout} layout failed") from None
    for process in ranks:
        process.join()
    return found


def _moe_layer_rank(rank: int, world_size: int, port: int, threads: int, layout: str, args, results) -> None:
    import statistics
    from types import SimpleNamespace

    os.environ["OMP_NUM_THREADS"] = str(threads)  # the kernels' OpenMP, read when their library loads
    torch.set_num_threads(threads)
    import torch.distributed as dist

    from infer.distributed import TensorParallelGroup, plan_shards
    from infer.kernels import cpu as cpu_kernels
    from infer.model.moe import ExpertGroups
    from infer.model.ops import StepOps

    if world_size > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=600),
        )
    kernels = cpu_kernels.load(True)
    config = _moe_config(args.shape)
    plan = plan_shards(
        config.num_attention_heads,
        config.num_key_value_heads,
        config.intermediate_size,
        config.vocab_size,
        world_size,
    )[rank]
    layers = [_moe_layer(config, seed, layout, plan, kernels) for seed in range(args.layers)]
    group = TensorParallelGroup(plan) if world_size > 1 else None
    for layer in layers:
        layer.tensor_parallel = group if layout == "columns" else None
    mine = range(rank * config.num_experts // world_size, (rank + 1) * config.num_experts // world_size)
    half = config.num_experts // 2  # expert parallelism's split over two ranks, for the busier rank's share
    step = SimpleNamespace(ops=StepOps(None, None, kernels))
    generator = torch.Generator().manual_seed(1)  # every rank draws the same inputs, so routes alike
    scratch = torch.empty(128 * 2**20)  # 512 MB written between calls: the next call's experts come from memory

    def experts_call(moe, x):  # expert parallelism: this rank's active experts, whole
        groups = ExpertGroups.of(moe.route(x), moe.num_experts)
        out = torch.zeros(x.shape, dtype=torch.float32)
        held = [index for index, expert in enumerate(groups.active) if expert in mine]
        if held:
            kernels.moe_experts(x, moe.packed, *groups.pick(held), out)
        return group.all_reduce(out)

    found = {}
    with torch.inference_mode():
        for batch in args.batches:
            times, cpu_times, shares = [], [], []
            for index in range(args.steps):
                moe = layers[index % len(layers)]
                x = torch.randn(batch, config.hidden_size, generator=generator)
                scratch.fill_(index)
                if world_size > 1:
                    dist.barrier()
                began, cpu_began = time.perf_counter(), time.process_time()
                if layout == "experts":
                    experts_call(moe, x)
                else:
                    moe(x, step)
                times.append(1000 * (time.perf_counter() - began))
                cpu = torch.tensor([1000 * (time.process_time() - cpu_began)])
                if world_size > 1:  # the step waits for its busier rank
                    dist.all_reduce(cpu, op=dist.ReduceOp.MAX)
                cpu_times.append(cpu.item())
                active = moe.route(x).experts.unique()
                shares.append(max(int((active < half).sum()), int((active >= half).sum())) / len(active))
            found[batch] = {
                "ms": statistics.median(times),
                "best_ms": min(times),
                "cpu_ms": statistics.median(cpu_times),
                "busier_rank_share": statistics.mean(shares),
            }
    if world_size > 1:
        dist.destroy_process_group()
    if rank == 0:
        results.put(found)


def _moe_config(shape: str):
    import sys
    from pathlib import Path

    import transformers

    sys.path.insert(0, str(Path(__file__).parent))
    from random_models import SHAPES

    class_name, fields = SHAPES[shape]
    return getattr(transformers, class_name).config_class(**fields)


def _moe_layer(config, seed: int, layout: str, plan, kernels):
    """Layer ``seed``'s random weights (the same in every process), this rank's share as ``layout`` says, packed
    bf16 for the kernels."""
    from infer.model.moe import MoE
    from infer.model.quantization import quantize_linears
    from infer.model.sharding import shard_mixture
    from infer.plugins.models.qwen3_moe import Qwen3MoeArchitecture

    torch.manual_seed(seed)
    moe = MoE(Qwen3MoeArchitecture.decoder_spec(config), torch.float32)
    with torch.no_grad():
        for parameter in moe.parameters():
            parameter.normal_(0.0, 0.02)
    if layout == "columns":
        shard_mixture(moe, plan.expert_columns(config.moe_intermediate_size), plan.rank)
    moe = quantize_linears(moe, "bf16")
    moe.use_cpu_kernels(kernels, gemv_rows=16)
    return moe


def moe_main(args) -> None:
    model = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.split("Model name:")[-1].split("\n")[0]
    print(
        f"CPU: {model.strip()}; {os.cpu_count()} cores visible; load average {os.getloadavg()[0]:.1f}; "
        f"{args.shape}'s mixture layer, bf16, {args.layers} layers cycled"
    )
    rows = {}
    for name, layout, world_size, threads in MOE_LAYOUTS:
        rows[name] = moe_layer_times(layout, world_size, threads, args)
        for batch, row in rows[name].items():
            print(
                f"batch {batch:>3} | {name:<44} | {row['ms']:7.2f} ms (best {row['best_ms']:.2f}) | "
                f"busier rank's CPU {row['cpu_ms']:.2f} ms",
                flush=True,
            )
    shares = rows[MOE_LAYOUTS[-1][0]]
    for batch, row in shares.items():
        print(
            f"batch {batch:>3}: under expert parallelism the busier rank holds {row['busier_rank_share']:.0%} of a "
            f"step's active experts on average (column sharding: 50% of every one)"
        )
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"cpu": cpu_signature(), "moe_layer": rows}, handle, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="default: 1 64 (--moe: 1 16)")
    parser.add_argument("--tokens", type=int, default=48, help="decode steps timed per case")
    parser.add_argument("--json", help="write every number here")
    parser.add_argument("--moe", action="store_true", help="time one mixture-of-experts layer's layouts instead")
    parser.add_argument("--shape", default="qwen3-moe-3.3b", help="--moe: random_models.py's shape")
    parser.add_argument("--steps", type=int, default=48, help="--moe: layer calls timed per batch")
    parser.add_argument("--layers", type=int, default=2, help="--moe: distinct layers cycled through")
    args = parser.parse_args()
    if args.moe:
        args.batches = args.batches or [1, 16]
        moe_main(args)
        return
    args.batches = args.batches or [1, 64]
    print(f"CPU: {cpu_signature()}; {os.cpu_count()} cores visible; torch {torch.__version__}")
    results = []
    for batch in args.batches:
        for name, overrides in CASES:
            row = {"case": name, **decode_case(overrides, batch, args.tokens)}
            results.append(row)
            print(
                f"batch {batch:>3} | {name:<32} | {row['step_ms']:7.1f} ms/step | {row['tok_per_s']:7.1f} tok/s | "
                f"collectives {row['comm_share']:5.1%} of busy time, {row['all_reduces_per_step']:.0f} "
                f"all-reduces/step",
                flush=True,
            )
    hidden = results[0]["hidden"]
    latency = gloo_latency(args.batches, hidden)
    for rows, microseconds in sorted(latency.items()):
        print(f"gloo all-reduce [{rows}, {hidden}] float32, 2 ranks on loopback: {microseconds:.0f} us")
    layers = results[0]["num_layers"]
    measured = [row["all_reduces_per_step"] for row in results if row["all_reduces_per_step"]]
    per_layer = (measured[0] / layers) if measured else 2.0
    estimate = nvlink_estimate(args.batches, per_layer)
    print(
        f"NVLink estimate ({per_layer:.0f} all-reduces per layer per step, bf16, {NVLINK_BUS_GBPS:.0f} GB/s bus "
        f"bandwidth, latency {NVLINK_LATENCY_US} us):"
    )
    for row in estimate:
        print(
            f"  {row['model']:<12} {row['gpus']} GPUs, {row['tokens']:>5} tokens/step: "
            f"{row['comm_ms_per_step']:.2f} ms/step"
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(
                {"cpu": cpu_signature(), "decode": results, "gloo_us": latency, "nvlink": estimate}, handle, indent=2
            )


if __name__ == "__main__":
    main()
