"""Prefill attention per layer call on the paged pool: infer's flash attention (``infer_flash_attention``: AMX tiles
where the CPU has them and the head size is 64, else AVX512-BF16 dot products; ``--fma`` adds its float32-FMA mode)
against torch's path (``scaled_dot_product_attention`` in bf16 over the context gathered from the pool, as the
``cpu`` backend's ``prefill_kernel: torch`` runs it), alternating in one process. Prints a markdown table, median ms.

    OMP_NUM_THREADS=2 python benchmarks/flash_attention.py
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from infer.attention import gather_blocks
from infer.kernels import cpu as cpu_kernels
from infer.kernels.cpu import FlashChunks

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16  # the default model's layout
CASES = {
    "4 x 512 fresh": ([512] * 4, [512] * 4),
    "512 after 512 cached": ([512], [1024]),
    "1 x 512 fresh": ([512], [512]),
}


def make_case(lens: list[int], contexts: list[int]):
    generator = torch.Generator().manual_seed(0)
    num_blocks = sum(-(-context // BLOCK) for context in contexts) + 1
    kv = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=generator).to(torch.bfloat16)
    tables = torch.zeros(len(lens), max(-(-context // BLOCK) for context in contexts), dtype=torch.int32)
    order, at = torch.randperm(num_blocks - 1, generator=generator) + 1, 0
    for index, context in enumerate(contexts):
        used = -(-context // BLOCK)
        tables[index, :used] = order[at : at + used].int()
        at += used
    q = torch.randn(sum(lens), HEADS, HEAD_DIM, generator=generator)
    chunks = FlashChunks.of([(sum(lens[:index]), lens[index], contexts[index], index) for index in range(len(lens))])
    return q, kv, tables, chunks


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--fma", action="store_true", help="also time infer's float32-FMA mode")
    args = parser.parse_args()
    kernels = cpu_kernels.load(True)
    if not kernels.flash:
        raise SystemExit("infer's flash attention is not built here (it needs avx512_bf16)")
    scale = HEAD_DIM**-0.5
    arms = ["infer"] + (["infer, float32 FMAs"] if args.fma else []) + ["torch"]
    print(
        f"infer's flash attention on {'AMX tiles' if kernels.flash_amx else 'AVX512-BF16 dot products'}, "
        f"threads {torch.get_num_threads()}\n"
    )
    print("| case | " + " | ".join(arms) + " |")
    print("|---" * (len(arms) + 1) + "|")
    for name, (lens, contexts) in CASES.items():
        q, kv, tables, chunks = make_case(lens, contexts)
        out = torch.empty_like(q)
        calls = {
            "infer": lambda: kernels.flash_attention(q, kv, tables, chunks, scale, out, False),
            "infer, float32 FMAs": lambda: kernels.flash_attention(q, kv, tables, chunks, scale, out, True),
            "torch": lambda: torch_path(q, kv, tables, lens, contexts, scale),
        }
        times = {arm: [] for arm in arms}
        for arm in arms:
            calls[arm]()
        for _ in range(args.repeats):
            for arm in arms:
                began = time.perf_counter()
                calls[arm]()
                times[arm].append(time.perf_counter() - began)
        cells = [f"{sorted(times[arm])[len(times[arm]) // 2] * 1e3:.2f}" for arm in arms]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
