"""One decoder layer's bf16 projections on infer's tile GEMM (``CpuKernels.linear_tiles``), cold weights (three
copies of the layer, taken in turn), at several row counts: this tree's build of the C kernels against another build
(``--against``, e.g. another checkout's), and against oneDNN's bf16 GEMM over the same weights unpacked for the call
(``--onednn``: what bf16 steps past ``TILE_MAX_ROWS`` run where the tiles are AVX512-BF16's dot products). The
contenders alternate, one layer each, ``--pairs`` times; printed: each one's median ms per layer and the median and
range of the per-pair ratios (other processes on a shared machine slow a pair's two halves alike more often than not).

    OMP_NUM_THREADS=2 python benchmarks/tile_gemm_layer.py --onednn
    OMP_NUM_THREADS=2 python benchmarks/tile_gemm_layer.py --against OTHER.so --rows 64 256
    PYTHONPATH=OTHER_CHECKOUT_PKG python -c "from infer.kernels.cpu import builder; from infer.host import cache_dir; \\
        print(builder.build(cache_dir() / 'kernels'))"      # another checkout's build, for --against
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from infer.kernels import cpu as cpu_kernels
from infer.model.quantization import bf16_linear, dense_buffer

# A layer's projections (out_features, in_features): Qwen3-1.7B's, and Qwen3-0.6B's.
LAYERS = {
    "qwen3-1.7b": {"qkv": (4096, 2048), "o": (2048, 2048), "gate_up": (12288, 2048), "down": (2048, 6144)},
    "qwen3-0.6b": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)},
}
COPIES = 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layer", choices=list(LAYERS), default="qwen3-1.7b")
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64, 128, 256, 512, 2048])
    parser.add_argument("--pairs", type=int, default=15)
    parser.add_argument("--against", type=Path, help="another build of the C kernels (.so)")
    parser.add_argument("--onednn", action="store_true", help="also oneDNN's GEMM over the tiles unpacked")
    args = parser.parse_args()
    kernels = cpu_kernels.load(True)
    if not kernels.tiles:
        raise SystemExit("needs AMX or AVX512-BF16: this CPU or build has no tile GEMM")
    shapes = LAYERS[args.layer]
    weights = [{name: torch.randn(shape).bfloat16() for name, shape in shapes.items()} for _ in range(COPIES)]
    tiles = [{name: cpu_kernels.pack_tiles(weight) for name, weight in copy.items()} for copy in weights]
    contenders = {"this build": lambda x, copy: [kernels.linear_tiles(x[n], t, None) for n, t in copy.items()]}
    if args.against:
        other = cpu_kernels.load_built(args.against)
        contenders[args.against.name] = lambda x, copy: [other.linear_tiles(x[n], t, None) for n, t in copy.items()]
    if args.onednn:
        buffer = dense_buffer(max(rows * columns for rows, columns in shapes.values()))
        contenders["oneDNN, unpacked"] = lambda x, copy: [
            bf16_linear(x[n], kernels.unpack_tiles(t, buffer)) for n, t in copy.items()
        ]
    print(f"{args.layer}'s projections, {kernels.tiles}, {torch.get_num_threads()} threads, bf16 rows in and out")
    names = list(contenders)
    print(
        "| rows | "
        + " | ".join(f"{name} ms" for name in names)
        + " | "
        + " | ".join(f"{name} / this build" for name in names[1:])
        + " |"
    )
    print("|---" * (2 * len(names)) + "|")
    for rows in args.rows:
        x = {name: torch.randn(rows, shape[1]).bfloat16() for name, shape in shapes.items()}
        times: dict[str, list[float]] = {name: [] for name in names}
        for pair in range(args.pairs + 1):  # the first round warms up
            for name, run in contenders.items():
                began = time.perf_counter()
                run(x, tiles[pair % COPIES])
                if pair:
                    times[name].append((time.perf_counter() - began) * 1e3)
        cells = [f"{statistics.median(times[name]):.2f}" for name in names]
        for name in names[1:]:
            ratios = sorted(a / b for a, b in zip(times[name], times[names[0]]))
            cells.append(f"{statistics.median(ratios):.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})")
        print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
