"""The bf16 GEMV over ``pack_tiles``' layout (``CpuKernels.linear_tiles`` at up to ``pass_rows`` rows: float32 FMAs
over the widened weights, or AVX512-BF16's dot products over rows rounded to bf16) against the GEMV over
``pack_weights``' layout (``CpuKernels.linear`` on bf16 weights) on the Qwen3-0.6B projection shapes, weights read
from memory (each shape in enough copies to fill 256 MB, passed over in turn): GB/s of weights, best of
``--runs`` alternated runs. One thread (``OMP_NUM_THREADS=1``) is timed in the thread's CPU time
(``time.thread_time``), which a busy machine disturbs less; more threads in wall-clock time.

    OMP_NUM_THREADS=1 python benchmarks/tile_gemv.py
    OMP_NUM_THREADS=2 python benchmarks/tile_gemv.py --rows 1 8 [--small-pages]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from infer.kernels import cpu as cpu_kernels

# Qwen3-0.6B: hidden 1024, 16 query and 8 KV heads of 128, intermediate 3072, vocabulary 151,936.
SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072), "head": (151936, 1024)}
FILL_BYTES = 256 << 20


def best_gbps(call, copies: int, weight_bytes: int, clock, runs: int) -> float:
    call(0)
    seconds = []
    for _ in range(runs):
        began = clock()
        for copy in range(copies):
            call(copy)
        seconds.append(clock() - began)
    return copies * weight_bytes / min(seconds) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument(
        "--small-pages",
        action="store_true",
        help="copy the packed weights into torch's allocator (4 KiB pages where transparent huge pages are granted "
        "only on request) instead of the huge pages the packing puts them on",
    )
    args = parser.parse_args()
    kernels = cpu_kernels.load(True)
    threads = int(os.environ.get("OMP_NUM_THREADS", "0")) or os.cpu_count()
    clock = time.thread_time if threads == 1 else time.perf_counter
    print(f"{kernels.simd} build, tiles: {kernels.tiles}, {threads} thread(s), {clock.__name__}")
    print("| shape | rows | pack_weights GEMV | tiles GEMV, FMAs | tiles GEMV, bf16 dots |")
    print("|---|---|---|---|---|")
    for name in args.shapes:
        n, k = SHAPES[name]
        copies = max(1, FILL_BYTES // (n * k * 2))
        plain = [
            torch.randn(n, k, generator=torch.Generator().manual_seed(c)).to(torch.bfloat16) for c in range(copies)
        ]
        streams = [cpu_kernels.pack_weights(weight) for weight in plain]
        tiles = [cpu_kernels.pack_tiles(weight) for weight in plain]
        del plain
        if args.small_pages:
            streams, tiles = [weight.clone() for weight in streams], [weight.clone() for weight in tiles]
        for rows in args.rows:
            x = torch.randn(rows, k)
            calls = {
                "streams": lambda c: kernels.linear(x, streams[c], None, None),
                "fma": lambda c: kernels.linear_tiles(x, tiles[c], None, fma=True),
                "dots": lambda c: kernels.linear_tiles(x, tiles[c], None),
            }
            if kernels.tiles != "AMX tiles" and kernels.tiles != "AVX512-BF16":
                del calls["dots"]
            best = {key: 0.0 for key in calls}
            for _ in range(args.runs):  # alternated, so a busy spell falls on every kernel alike
                for key, call in calls.items():
                    best[key] = max(best[key], best_gbps(call, copies, n * k * 2, clock, 1))
            cells = [f"{best[key]:.1f}" if key in best else "-" for key in ("streams", "fma", "dots")]
            print(f"| {name} {n}x{k} | {rows} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
