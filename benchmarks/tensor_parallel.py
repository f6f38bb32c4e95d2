"""Tensor parallelism's overhead on one box: TP=2 (one thread per rank) against TP=1 (two threads) on decode at batch
1 and 64, rank 0's time in collectives as a share of a step, and gloo's all-reduce latency on loopback; then what the
same collectives (count and bytes per step, taken from these runs) would cost over NVLink for Llama-3-8B and 70B on 2
and 8 GPUs.

Each case runs in its own engine, one after another in this process: TP=1 on the default path (fused C stack), TP=1
op by op (``execution.paths=[torch]``, the path a sharded layer takes: it all-reduces between its projections), TP=2.

    python benchmarks/tensor_parallel.py [--json tp.json] [--batches 1 64] [--tokens 48]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--tokens", type=int, default=48, help="decode steps timed per case")
    parser.add_argument("--json", help="write every number here")
    args = parser.parse_args()
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
