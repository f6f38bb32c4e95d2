"""One decoder layer's projections on infer's GEMMs for steps of many rows, cold weights (copies of the layer, taken in
turn, ``--weights-bytes`` of them in all: more than the last-level cache holds), at several row counts: bf16 weights
on the tile GEMM (``CpuKernels.linear_tiles``) or, with ``--weights q4_1``, block weights on the block GEMM
(``CpuKernels.gemm_blocks``). This tree's build of the C kernels against another build (``--against``, e.g. another
checkout's), and for bf16 against oneDNN's bf16 GEMM over the same weights unpacked for the call (``--onednn``: what
bf16 steps past ``TILE_MAX_ROWS`` run where the tiles are AVX512-BF16's dot products). The contenders alternate, one
layer each, each on the least recently used copy, ``--pairs`` times; printed: each one's median ms per layer and the
median and range of the per-pair ratios (other processes on a shared machine slow a pair's two halves alike more
often than not).

    OMP_NUM_THREADS=2 python benchmarks/tile_gemm_layer.py --onednn
    OMP_NUM_THREADS=2 python benchmarks/tile_gemm_layer.py --against OTHER.so --rows 64 256
    OMP_NUM_THREADS=2 python benchmarks/tile_gemm_layer.py --weights q4_1 --layer smollm2-135m --against OTHER.so
    PYTHONPATH=OTHER_CHECKOUT_PKG python -c "from infer.kernels.cpu import builder; from infer.host import cache_dir; \\
        print(builder.build(cache_dir() / 'kernels'))"      # another checkout's build, for --against
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import torch

from infer.kernels import cpu as cpu_kernels
from infer.model.quantization import bf16_linear, dense_buffer

# A layer's projections (out_features, in_features): Qwen3-1.7B's, Qwen3-0.6B's and the default model's.
LAYERS = {
    "qwen3-1.7b": {"qkv": (4096, 2048), "o": (2048, 2048), "gate_up": (12288, 2048), "down": (2048, 6144)},
    "qwen3-0.6b": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)},
    "smollm2-135m": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)},
}


def packed_bytes(weight) -> int:
    data = weight if isinstance(weight, torch.Tensor) else weight.data
    return data.numel() * data.element_size()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layer", choices=list(LAYERS), default="qwen3-1.7b")
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64, 128, 256, 512, 2048])
    parser.add_argument("--pairs", type=int, default=15)
    parser.add_argument("--against", type=Path, help="another build of the C kernels (.so)")
    parser.add_argument("--onednn", action="store_true", help="also oneDNN's GEMM over the tiles unpacked (bf16)")
    parser.add_argument("--weights", choices=["bf16", "q4_1"], default="bf16")
    parser.add_argument("--weights-bytes", type=int, default=2**30, help="the layer's copies' bytes, all together")
    args = parser.parse_args()
    kernels = cpu_kernels.load(True)
    if args.weights == "bf16" and not kernels.tiles:
        raise SystemExit("needs AMX or AVX512-BF16: this CPU or build has no tile GEMM")
    shapes = LAYERS[args.layer]
    weights = {name: torch.randn(shape) * 0.1 for name, shape in shapes.items()}
    if args.weights == "bf16":
        layer = {name: cpu_kernels.pack_tiles(weight.bfloat16()) for name, weight in weights.items()}
        multiply, clone = "linear_tiles", torch.Tensor.clone
    else:
        layer = {name: kernels.quantize_blocks(weight, "q4_1") for name, weight in weights.items()}
        multiply, clone = "gemm_blocks", lambda w: dataclasses.replace(w, data=w.data.clone())
    layer_bytes = sum(packed_bytes(weight) for weight in layer.values())
    copies = [layer] + [
        {name: clone(weight) for name, weight in layer.items()} for _ in range(args.weights_bytes // layer_bytes)
    ]
    builds = {"this build": kernels}
    if args.against:
        builds[args.against.name] = cpu_kernels.load_built(args.against)
    contenders = {
        name: lambda x, copy, build=build: [getattr(build, multiply)(x[n], w, None) for n, w in copy.items()]
        for name, build in builds.items()
    }
    if args.onednn and args.weights == "bf16":
        buffer = dense_buffer(max(rows * columns for rows, columns in shapes.values()))
        contenders["oneDNN, unpacked"] = lambda x, copy: [
            bf16_linear(x[n], kernels.unpack_tiles(t, buffer)) for n, t in copy.items()
        ]
    print(
        f"{args.layer}'s projections, {args.weights} weights ({multiply}), {torch.get_num_threads()} threads, bf16 rows"
    )
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
            for index, (name, run) in enumerate(contenders.items()):
                began = time.perf_counter()
                run(x, copies[(pair * len(contenders) + index) % len(copies)])  # each the least recently used
                if pair:
                    times[name].append((time.perf_counter() - began) * 1e3)
        cells = [f"{statistics.median(times[name]):.2f}" for name in names]
        for name in names[1:]:
            ratios = sorted(a / b for a, b in zip(times[name], times[names[0]]))
            cells.append(f"{statistics.median(ratios):.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})")
        print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
