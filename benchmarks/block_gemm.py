"""GGUF's block weights (q4_0, q4_1, q8_0) against the float formats (bf16, fp16) on one projection at a time, at
decode and prefill row counts, as ``PackedLinear`` runs each (the GEMV up to one of its passes, then the block GEMM,
the tiles or fbgemm), and the block GEMM's designs side by side, K-quants (q4_k, q6_k) too.

Weights: the default model's projections (SmolLM2-135M: QKV 960 x 576, output 576 x 576, gate/up 3072 x 576, down 576 x
1536) and Qwen3-0.6B's (QKV 4096 x 1024, output 1024 x 2048, gate/up 6144 x 1024, down 1024 x 3072), random values; the
K-quants (quantized by ``infer.testing.kquants``) on the shapes whose k is a multiple of 256. Per shape and row count,
every arm is called in turn, ``--repeats`` rounds, and each arm's fastest call is kept (a busy machine only slows
calls); ``--clock cpu`` times thread CPU time instead of wall time (one thread: a call descheduled by other jobs does
not count). Prints two markdown tables, milliseconds per call: the formats as the engine runs them, and for each block
kind its GEMV, every GEMM design this build runs (``CpuKernels.block_gemm_designs``) and the GEMM's default at that many
rows (what a block projection takes past one GEMV pass), and where the AMX design runs, the weight dequantized to bf16
alone (``dequantize_blocks_bf16``) and then multiplied by oneDNN's bf16 GEMM (what a block projection takes from
``DENSE_BLOCK_ROWS`` rows there). ``--bf16-rows`` passes the GEMMs bf16 rows, as a large step's are between its
projections where every one takes them (the GEMVs keep float32). ``--kernels PATH`` runs the block formats on another
build of the kernels (``python -c "from infer.kernels import cpu; from pathlib import Path;
print(cpu.build(Path('/tmp/avx2'), ['-mno-avx512f']))"`` builds the AVX2 code on an AVX-512 CPU); the float formats keep
torch's own kernels (oneDNN and fbgemm pick their code from the CPU, not from these flags).

    OMP_NUM_THREADS=2 python benchmarks/block_gemm.py
    OMP_NUM_THREADS=1 python benchmarks/block_gemm.py --clock cpu --rows 16 64 --repeats 40
    OMP_NUM_THREADS=1 python benchmarks/block_gemm.py --clock cpu --rows 16 64 256 --shapes 'qwen3-0.6b down 1024x3072'
    OMP_NUM_THREADS=1 python benchmarks/block_gemm.py --clock cpu --bf16-rows --rows 256 512 1024 2048 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from infer.kernels import cpu as cpu_kernels
from infer.kernels.cpu.blocks import K_KINDS, BlockWeight, pack_blocks
from infer.model import Linear
from infer.model.quantization import PackedLinear
from infer.testing.kquants import QUANTIZERS

SHAPES = {
    "qkv 960x576": (960, 576),
    "o 576x576": (576, 576),
    "gate_up 3072x576": (3072, 576),
    "down 576x1536": (576, 1536),
    "qwen3-0.6b qkv 4096x1024": (4096, 1024),
    "qwen3-0.6b o 1024x2048": (1024, 2048),
    "qwen3-0.6b gate_up 6144x1024": (6144, 1024),
    "qwen3-0.6b down 1024x3072": (1024, 3072),
}
BLOCK_KINDS = ("q4_0", "q4_1", "q8_0")
FLOAT_MODES = ("bf16", "fp16")


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 16, 64, 512])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--bf16-rows", action="store_true", help="bf16 rows into the GEMMs (the GEMVs take float32)")
    parser.add_argument("--kernels", type=Path, help="a build of the C kernels (.so) for the block formats")
    return parser.parse_args()


def projections(kernels, block_kernels, shape: tuple[int, int]) -> tuple[dict[str, PackedLinear], dict]:
    """One weight of ``shape`` packed in every format, each taking the GEMV for up to one of its passes (the block
    formats on ``block_kernels``); and its K-quant blocks (none where k is not a multiple of 256)."""
    linear = Linear(shape[1], shape[0], bias=False)
    torch.nn.init.normal_(linear.weight, std=0.05)
    kquants: dict[str, BlockWeight] = {}
    if shape[1] % 256 == 0:
        for kind in K_KINDS:
            kquants[kind] = pack_blocks(QUANTIZERS[kind](linear.weight.detach().numpy()), kind, shape[0])
    packed = {}
    for mode in (*BLOCK_KINDS, *FLOAT_MODES):
        module = PackedLinear(linear, mode)
        if mode in BLOCK_KINDS:
            module.kernels = block_kernels  # a block weight keeps the kernels it was built with
            module.use_cpu_kernels(block_kernels, block_kernels.block_pass_rows)
        else:
            module.use_cpu_kernels(kernels, kernels.pass_rows)
        packed[mode] = module
    return packed, kquants


def fastest_ms(arms: dict[str, object], repeats: int, clock) -> dict[str, float]:
    """Each arm's fastest call over ``repeats`` rounds that call every arm in turn (after one warm-up round)."""
    best = dict.fromkeys(arms, float("inf"))
    for round_index in range(repeats + 1):
        for name, call in arms.items():
            began = clock()
            call()
            if round_index:
                best[name] = min(best[name], (clock() - began) * 1e3)
    return best


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


@torch.inference_mode()
def main() -> None:
    args = parse_arguments()
    kernels = cpu_kernels.load(True)
    block_kernels = cpu_kernels.load_built(args.kernels) if args.kernels else kernels
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    designs = [name for name in block_kernels.block_gemm_designs if name != "portable"]
    dense = ["dequantize", "dequantized + oneDNN"] if "amx-bf16" in designs else []
    print(
        f"{cpu_name()}; block kernels {block_kernels.simd}, block GEMM {block_kernels.block_gemm} (runs "
        f"{', '.join(designs)}); "
        f"threads {torch.get_num_threads()}; {args.clock} clock; load average {os.getloadavg()[0]:.1f} at the start"
    )
    engine_rows, design_rows = [], []
    for shape_name in args.shapes:
        packed, kquants = projections(kernels, block_kernels, SHAPES[shape_name])
        weights = {**{kind: packed[kind].blocks for kind in BLOCK_KINDS}, **kquants}
        for rows in args.rows:
            x_gemv = torch.randn(rows, SHAPES[shape_name][1])
            x = x_gemv.bfloat16() if args.bf16_rows and rows > block_kernels.block_pass_rows else x_gemv
            arms = {mode: (lambda module=module: module(x)) for mode, module in packed.items()}
            for kind, blocks in weights.items():
                arms[f"{kind} gemv"] = lambda blocks=blocks: block_kernels.linear_blocks(x_gemv, blocks, None)
                if dense:
                    buffer = torch.empty(blocks.out_features * blocks.in_features, dtype=torch.bfloat16)
                    arms[f"{kind} dequantize"] = lambda blocks=blocks, buffer=buffer: (
                        block_kernels.dequantize_blocks_bf16(blocks, buffer)
                    )
                    arms[f"{kind} dequantized + oneDNN"] = lambda blocks=blocks, buffer=buffer: (
                        torch.nn.functional.linear(x.bfloat16(), block_kernels.dequantize_blocks_bf16(blocks, buffer))
                    )
                arms[f"{kind} default"] = lambda blocks=blocks: block_kernels.gemm_blocks(x, blocks, None)
                for design in designs:
                    arms[f"{kind} {design}"] = lambda blocks=blocks, design=design: block_kernels.gemm_blocks(
                        x, blocks, None, design
                    )
            best = fastest_ms(arms, args.repeats, clock)
            path = "GEMV" if rows <= block_kernels.block_pass_rows else "GEMM"
            cells = " | ".join(f"{best[mode]:.3f}" for mode in (*BLOCK_KINDS, *FLOAT_MODES))
            engine_rows.append(f"| {shape_name} | {rows} | {path} | {cells} |")
            for kind in weights:
                cells = " | ".join(f"{best[f'{kind} {arm}']:.3f}" for arm in ("gemv", *designs, "default", *dense))
                design_rows.append(f"| {shape_name} | {rows} | {kind} | {cells} |")
    print("\n| projection | rows | blocks on | " + " | ".join((*BLOCK_KINDS, *FLOAT_MODES)) + " |")
    print("|---" * (3 + len(BLOCK_KINDS) + len(FLOAT_MODES)) + "|")
    print("\n".join(engine_rows))
    print(
        "\n| projection | rows | kind | GEMV | "
        + " | ".join(f"GEMM {design}" for design in designs)
        + " | GEMM default |"
        + "".join(f" {arm} |" for arm in dense)
    )
    print("|---" * (5 + len(designs) + len(dense)) + "|")
    print("\n".join(design_rows))
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
