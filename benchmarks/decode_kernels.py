"""The two kernels of a decode step of many sequences, over memory as cold as the engine's: the bf16 tile GEMM
(``CpuKernels.linear_tiles``) over a stack of a model's layers' weights (more than the last-level cache, each call's
weights streamed from memory), and paged attention (``CpuKernels.paged_attention``) over a stack of layers' bf16
pools whose blocks are scattered at random, as a busy engine's are. The Qwen3-0.6B shape by default, or Qwen3-1.7B's
projections (``--shape``; both have the same attention layout). Milliseconds a call (a layer) or a stack of layers,
best of ``--repeats`` rounds; ``--baseline PATH.so`` (a build of the kernels from another checkout, same interface)
runs beside this tree's build in the same process, rounds alternating.

With ``OMP_NUM_THREADS=1`` every time is the thread's CPU time (``time.thread_time``: other processes' share of the
core does not count), else wall time.

    OMP_NUM_THREADS=1 python benchmarks/decode_kernels.py --baseline OTHER.so
    OMP_NUM_THREADS=1 python benchmarks/decode_kernels.py --rows 16 64 --contexts 145 --skip-gemm
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from infer.kernels import cpu as cpu_kernels
from infer.kernels.cpu import load_built
from infer.kernels.cpu.abi import KernelAttentionPlan

# The projections' (out_features, in_features) of a shape's layers, the output head last.
SHAPES = {
    "qwen3-0.6b": {
        "qkv": (4096, 1024),
        "o": (1024, 2048),
        "gate_up": (6144, 1024),
        "down": (1024, 3072),
        "head": (151936, 1024),
    },
    "qwen3-1.7b": {
        "qkv": (4096, 2048),
        "o": (2048, 2048),
        "gate_up": (12288, 2048),
        "down": (2048, 6144),
        "head": (151936, 2048),
    },
}
# Both shapes' layers and attention layout.
LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 28, 16, 8, 128, 16


def timed(call, clock) -> float:
    began = clock()
    call()
    return clock() - began


def best_of(builds: dict, run, repeats: int, clock) -> dict[str, float]:
    """Each build's best time of ``run(kernels)`` over ``repeats`` rounds, the builds alternating within a round."""
    for kernels in builds.values():
        run(kernels)  # warm: each build's code paged in, its buffers allocated
    best = dict.fromkeys(builds, float("inf"))
    for _ in range(repeats):
        for name, kernels in builds.items():
            best[name] = min(best[name], timed(lambda: run(kernels), clock))
    return best


def gemm_rows(builds: dict, shape: str, rows: list[int], repeats: int, clock) -> None:
    print("| projection | rows | " + " | ".join(f"{name} ms" for name in builds) + " | GB/s of weights | TFLOP/s |")
    print("|---" * (len(builds) + 4) + "|")
    for name, (n, k) in SHAPES[shape].items():
        count = 1 if name == "head" else LAYERS
        stack = [cpu_kernels.pack_tiles(torch.randn(n, k).to(torch.bfloat16)) for _ in range(count)]
        for m in rows:
            x = torch.randn(m, k)

            def run(kernels, x=x, stack=stack):
                for weight in stack:
                    kernels.linear_tiles(x, weight, None)

            best = {build: seconds / count for build, seconds in best_of(builds, run, repeats, clock).items()}
            ours = best["this tree"]
            cells = " | ".join(f"{seconds * 1e3:.3f}" for seconds in best.values())
            print(f"| {name} | {m} | {cells} | {n * k * 2 / ours / 1e9:.1f} | {2 * m * n * k / ours / 1e12:.2f} |")


def attention_contexts(builds: dict, sequences: int, contexts: list[int], repeats: int, clock, in_order: bool) -> None:
    placed = "in order" if in_order else "scattered at random"
    heads = f"{HEADS} query / {KV_HEADS} KV heads of {HEAD_DIM}"
    print(f"\n{sequences} sequences, {LAYERS} layers' pools, {heads}, blocks {placed}")
    print("| keys | " + " | ".join(f"{name} ms" for name in builds) + " | GB/s of K/V |")
    print("|---" * (len(builds) + 2) + "|")
    generator = torch.Generator().manual_seed(0)
    for context in contexts:
        per_sequence = -(-context // BLOCK)
        blocks = sequences * per_sequence + 1
        pools = [torch.randn(2, blocks, BLOCK, KV_HEADS, HEAD_DIM).to(torch.bfloat16) for _ in range(LAYERS)]
        order = torch.arange(blocks - 1) if in_order else torch.randperm(blocks - 1, generator=generator)
        tables = order[: sequences * per_sequence].view(sequences, per_sequence).to(torch.int32)
        q, out = torch.randn(sequences, HEADS, HEAD_DIM), torch.empty(sequences, HEADS, HEAD_DIM)
        plan = KernelAttentionPlan(
            rows=None,
            seq_of_query=torch.arange(sequences),
            context_lens=torch.full((sequences,), context, dtype=torch.int64),
            num_queries=sequences,
            max_context=context,
            own_keys=None,
        )

        def run(kernels, pools=pools, tables=tables, q=q, out=out, plan=plan):
            for pool in pools:
                kernels.paged_attention(q, pool, tables, plan, HEAD_DIM**-0.5, out, True)

        best = best_of(builds, run, repeats, clock)
        kv_bytes = LAYERS * sequences * context * KV_HEADS * HEAD_DIM * 2 * 2
        cells = " | ".join(f"{seconds * 1e3:.1f}" for seconds in best.values())
        print(f"| {context} | {cells} | {kv_bytes / best['this tree'] / 1e9:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, help="another build of the kernels (.so) to time beside this one")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b", help="the projections' shapes")
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--contexts", type=int, nargs="+", default=[40, 145, 600])
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--skip-gemm", action="store_true")
    parser.add_argument("--skip-attention", action="store_true")
    parser.add_argument(
        "--blocks-in-order",
        action="store_true",
        help="each sequence's blocks side by side, one sequence after another (a fresh engine's prompts)",
    )
    args = parser.parse_args()
    kernels = cpu_kernels.load(True)
    if not kernels.tiles:
        raise SystemExit("the tile GEMM needs AMX or AVX512-BF16: this CPU or build has neither")
    builds = {"this tree": kernels}
    if args.baseline:
        builds["baseline"] = load_built(args.baseline)
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    print(f"infer's tile kernel: {kernels.tiles}; {torch.get_num_threads()} thread(s), {clock.__name__}")
    if not args.skip_gemm:
        gemm_rows(builds, args.shape, args.rows, args.repeats, clock)
    if not args.skip_attention:
        attention_contexts(builds, args.sequences, args.contexts, args.repeats, clock, args.blocks_in_order)


if __name__ == "__main__":
    main()
