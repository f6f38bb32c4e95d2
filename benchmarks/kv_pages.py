"""Rounds of one chat-like batch in one engine: each round's wall time, output tok/s, the process's page faults and
its resident memory since the engine started. A CPU KV pool's pages are mapped in as its blocks are first written
(``infer.host.zeroed_pages``), so a round that writes blocks no round wrote before pays page faults (the kernel
zeroing 2 MiB pages; in a VM the host's first touch too), and resident memory shows how much of the pool the rounds
have touched. ``--prefault-blocks N`` writes the pool's first N blocks in every layer before the first round (the
blocks the ``paged`` allocator hands out first), as a pool zeroed at start would have them: the first round then
shows what is left of its extra time once the pool's first writes are out of it.

    OMP_NUM_THREADS=2 python benchmarks/kv_pages.py model.path=DIR model.max_model_len=1024 \\
        cache.memory_budget=10GiB --rounds 4 [--prefault-blocks 400]
"""

from __future__ import annotations

import argparse
import resource
import time

from infer import LLM, SamplingParams

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex".split()


def resident_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 2**20


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="config overrides (key=value)")
    parser.add_argument("--config", default="baseline")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prefault-blocks", type=int, default=0, help="write the pool's first N blocks first")
    args = parser.parse_args()

    llm = LLM(args.config, args.overrides)
    if args.prefault_blocks:
        pool = llm.engine.runner.kv_cache  # [layers, 2, blocks, block_size, kv_heads, head_dim]
        start = time.perf_counter()
        pool[:, :, : args.prefault_blocks].fill_(0)
        print(f"wrote the pool's first {args.prefault_blocks} blocks in {time.perf_counter() - start:.2f} s")
    # prompts of 40-49 words, 16-64 output tokens each (the chat workload's shape), greedy, lengths fixed
    prompts = [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(40 + i % 10)) for i in range(args.requests)]
    params = [
        SamplingParams(max_tokens=16 + (i * 7) % 49, temperature=0.0, ignore_eos=True) for i in range(args.requests)
    ]
    started = resident_mib()
    print("| round | wall s | output tok/s | minor faults | resident since the start |")
    print("|---|---|---|---|---|")
    for round_ in range(args.rounds):
        faults, start = minor_faults(), time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
        print(
            f"| {round_ + 1} | {wall:.2f} | {tokens / wall:.1f} | {minor_faults() - faults:,} | "
            f"+{resident_mib() - started:,.0f} MiB |",
            flush=True,
        )


if __name__ == "__main__":
    main()
