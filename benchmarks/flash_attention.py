"""Attention per layer call on the paged pool (bf16), at a model's head layout.

Prefill chunks: infer's flash attention (``infer_flash_attention``: AMX tiles where the CPU has them, else
AVX512-BF16 dot products; ``--fma`` adds its float32-FMA mode) against torch's path (``scaled_dot_product_attention``
in bf16 over the context gathered from the pool, as the ``cpu`` backend's ``prefill_kernel: torch`` runs it).
Decode steps (one query per sequence): the paged kernel on AVX512-BF16's dot products and in float32 arithmetic
(``decode_arithmetic`` bf16 and float32). ``--baseline PATH`` times a second build of the kernels (another
checkout's library) beside this one, the same calls. Arms alternate in one process; each cell is the median wall
time and the median CPU time of the calling thread (``time.thread_time``: with ``OMP_NUM_THREADS=1`` every
thread the call uses, and robust while other processes share the cores), in ms. Prints a markdown table.

    OMP_NUM_THREADS=2 python benchmarks/flash_attention.py
    OMP_NUM_THREADS=1 python benchmarks/flash_attention.py --heads 16 --kv-heads 8 --head-dim 128   # Qwen3-0.6B
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from infer.attention import gather_blocks
from infer.kernels import cpu as cpu_kernels
from infer.kernels.cpu import FlashChunks, KernelAttentionPlan

BLOCK = 16
# prefill: (query tokens, contexts) per chunk; decode: (sequences, context)
PREFILL_CASES = {
    "prefill 1 x 256 fresh": ([256], [256]),
    "prefill 1 x 512 fresh": ([512], [512]),
    "prefill 4 x 512 fresh": ([512] * 4, [512] * 4),
    "prefill 512 after 512 cached": ([512], [1024]),
    "prefill 40 x 50 fresh": ([50] * 40, [50] * 40),
}
DECODE_CASES = {"decode 64 x 128": (64, 128), "decode 16 x 1024": (16, 1024)}


def make_pool(contexts: list[int], kv_heads: int, head_dim: int, generator: torch.Generator):
    """A bf16 pool holding each context's blocks scattered in random order, and the block tables."""
    num_blocks = sum(-(-context // BLOCK) for context in contexts) + 1
    kv = torch.randn(2, num_blocks, BLOCK, kv_heads, head_dim, generator=generator).to(torch.bfloat16)
    tables = torch.zeros(len(contexts), max(-(-context // BLOCK) for context in contexts), dtype=torch.int32)
    order, at = torch.randperm(num_blocks - 1, generator=generator) + 1, 0
    for index, context in enumerate(contexts):
        used = -(-context // BLOCK)
        tables[index, :used] = order[at : at + used].int()
        at += used
    return kv, tables


def torch_path(q, kv, tables, lens, contexts, scale):
    out, start = torch.empty_like(q), 0
    for index, (length, context) in enumerate(zip(lens, contexts)):
        mask = None
        if context > length:
            allowed = torch.ones(length, context, dtype=torch.bool).tril(context - length)
            mask = torch.zeros(length, context, dtype=torch.bfloat16).masked_fill(~allowed, float("-inf"))
        keys, values = (
            side[:context].transpose(0, 1)[None]
            for side in gather_blocks(kv, tables[index, : -(-context // BLOCK)].long(), torch.bfloat16)
        )
        attended = F.scaled_dot_product_attention(
            q[start : start + length].to(torch.bfloat16).transpose(0, 1)[None],
            keys,
            values,
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        out[start : start + length] = attended[0].transpose(0, 1).float()
        start += length
    return out


def prefill_arms(builds: dict, args, lens: list[int], contexts: list[int]) -> dict:
    generator = torch.Generator().manual_seed(0)
    kv, tables = make_pool(contexts, args.kv_heads, args.head_dim, generator)
    q = torch.randn(sum(lens), args.heads, args.head_dim, generator=generator)
    chunks = FlashChunks.of([(sum(lens[:index]), lens[index], contexts[index], index) for index in range(len(lens))])
    out, scale = torch.empty_like(q), args.head_dim**-0.5
    arms = {}
    for label, kernels in builds.items():
        arms[f"{label}infer"] = lambda k=kernels: k.flash_attention(q, kv, tables, chunks, scale, out, False)
        if args.fma:
            arms[f"{label}infer, float32 FMAs"] = lambda k=kernels: k.flash_attention(
                q, kv, tables, chunks, scale, out, True
            )
    arms["torch"] = lambda: torch_path(q, kv, tables, lens, contexts, scale)
    return arms


def decode_arms(builds: dict, args, sequences: int, context: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    kv, tables = make_pool([context] * sequences, args.kv_heads, args.head_dim, generator)
    q = torch.randn(sequences, args.heads, args.head_dim, generator=generator)
    plan = KernelAttentionPlan(None, torch.arange(sequences), torch.full((sequences,), context), sequences, context)
    out, scale = torch.empty_like(q), args.head_dim**-0.5
    arms = {}
    for label, kernels in builds.items():
        for dots, how in ((True, "bf16 dots"), (False, "float32")):
            arms[f"{label}kernel, {how}"] = lambda k=kernels, d=dots: k.paged_attention(
                q, kv, tables, plan, scale, out, d
            )
    return arms


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def time_arms(arms: dict, repeats: int) -> dict[str, str]:
    """Each arm called once to warm up, then all in turn ``repeats`` times: median wall / CPU ms per arm."""
    wall, cpu = {arm: [] for arm in arms}, {arm: [] for arm in arms}
    for call in arms.values():
        call()
    for _ in range(repeats):
        for arm, call in arms.items():
            began, began_cpu = time.perf_counter(), time.thread_time()
            call()
            cpu[arm].append(time.thread_time() - began_cpu)
            wall[arm].append(time.perf_counter() - began)
    return {arm: f"{median(wall[arm]) * 1e3:.2f} / {median(cpu[arm]) * 1e3:.2f}" for arm in arms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--fma", action="store_true", help="also time infer's float32-FMA mode")
    parser.add_argument("--heads", type=int, default=9, help="query heads (default: SmolLM2-135M's 9)")
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--baseline", type=Path, help="a second build of the kernels (.so) timed beside this one")
    parser.add_argument("--only", choices=["prefill", "decode"], help="one kind of case")
    args = parser.parse_args()
    kernels = cpu_kernels.load(True)
    if not kernels.flash:
        raise SystemExit("infer's flash attention is not built here (it needs avx512_bf16)")
    builds = {"": kernels}
    if args.baseline:
        builds["baseline "] = cpu_kernels.load_built(args.baseline)
    print(
        f"infer's flash attention on {'AMX tiles' if kernels.flash_amx else 'AVX512-BF16 dot products'}, "
        f"{args.heads} query / {args.kv_heads} KV heads, head_dim {args.head_dim}, threads "
        f"{torch.get_num_threads()}; cells: wall / thread CPU ms, medians of {args.repeats}\n"
    )
    cases = []
    if args.only != "decode":
        cases += [(name, prefill_arms(builds, args, *case)) for name, case in PREFILL_CASES.items()]
    if args.only != "prefill":
        cases += [(name, decode_arms(builds, args, *case)) for name, case in DECODE_CASES.items()]
    header = None
    for name, arms in cases:
        if list(arms) != header:
            header = list(arms)
            print("\n| case | " + " | ".join(header) + " |")
            print("|---" * (len(header) + 1) + "|")
        cells = time_arms(arms, args.repeats)
        print(f"| {name} | " + " | ".join(cells[arm] for arm in header) + " |", flush=True)


if __name__ == "__main__":
    main()
