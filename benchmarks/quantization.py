"""Weight packing (``model.quantization``) on the default model: quality against float32, and speed, in one run.

Each mode generates greedy answers to the same chat prompts. Quality: for each answer, the tokens before its first
divergence from the exact float32 answer (``none``), summed over prompts, as a share of float32's tokens
("agreement"), and how many answers are identical. Speed: output tokens/s at batch 1 (one request at a time) and at
batch 16 (all prompts at once), with infer's CPU kernels where the mode takes them (fp16, bf16, int8). ``bfloat16`` is
torch's bfloat16 compute (``model.dtype=bfloat16``), for comparison; when it runs, a last table gives each mode's
agreement with its answers as well.

    OMP_NUM_THREADS=2 python benchmarks/quantization.py
    python benchmarks/quantization.py --modes none fp16 --max-tokens 64
"""

from __future__ import annotations

import argparse
import time

import torch

from infer import LLM, SamplingParams
from infer.prompts import BUILTIN_PROMPTS

EXTRA_PROMPTS = [
    "How do I make a paper airplane that flies far?",
    "Why do onions make people cry?",
    "What should I consider before adopting a rabbit?",
    "Tell me how a refrigerator keeps food cold.",
    "How do I politely decline an invitation to a party?",
    "What is the difference between baking soda and baking powder?",
    "How do noise-cancelling headphones work?",
    "How do I start learning to play the guitar?",
]
MODES = {
    "none": ["model.dtype=float32", "model.quantization=none"],
    "fp16": ["model.dtype=float32", "model.quantization=fp16"],
    "bf16": ["model.dtype=float32", "model.quantization=bf16"],
    # bf16's large steps each way (``execution.large_gemm``; ``bf16`` above takes what auto measured faster)
    "bf16_dot": ["model.dtype=float32", "model.quantization=bf16", "execution.large_gemm=bf16"],
    "bf16_fma": ["model.dtype=float32", "model.quantization=bf16", "execution.large_gemm=float32"],
    # bf16 with the decode attention's float32 arithmetic (``bf16`` above: its dot products where auto takes them)
    "bf16_f32_decode": [
        "model.dtype=float32",
        "model.quantization=bf16",
        "attention.name=cpu",
        "attention.decode_arithmetic=float32",
    ],
    "int8": ["model.dtype=float32", "model.quantization=int8"],
    "int8_per_row": ["model.dtype=float32", "model.quantization=int8_per_row"],
    "w8a8": ["model.dtype=float32", "model.quantization=w8a8"],
    # GGUF's blocks on the block GEMV: the default model's own Q4_1 file as it is, and float weights quantized so
    "gguf": ["model.dtype=float32", "model.quantization=gguf"],
    "q4_0": ["model.dtype=float32", "model.quantization=q4_0"],
    "q4_1": ["model.dtype=float32", "model.quantization=q4_1"],
    "q8_0": ["model.dtype=float32", "model.quantization=q8_0"],
    "bfloat16": ["model.dtype=bfloat16", "model.quantization=none"],
}


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch-1-prompts", type=int, default=4, help="prompts timed one at a time")
    return parser.parse_args()


def main() -> None:
    args = parse_arguments()
    prompts = [[{"role": "user", "content": text}] for text in BUILTIN_PROMPTS + EXTRA_PROMPTS]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    modes = ["none", *(mode for mode in args.modes if mode != "none")]
    rows, reference, answers_by_mode = [], None, {}
    for mode in modes:
        llm = LLM("baseline", dotlist=MODES[mode])
        llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
        began = time.perf_counter()
        outputs = [llm.generate([prompt], params)[0] for prompt in prompts[: args.batch_1_prompts]]
        single = sum(len(output.token_ids) for output in outputs) / (time.perf_counter() - began)
        began = time.perf_counter()
        outputs = llm.generate(prompts, params)
        batched = sum(len(output.token_ids) for output in outputs) / (time.perf_counter() - began)
        answers = answers_by_mode[mode] = [output.token_ids for output in outputs]
        reference = reference or answers
        rows.append((mode, *agreement(answers, reference), single, batched))
        print(table(rows), flush=True)
        print(flush=True)
        del llm
    if "bfloat16" in answers_by_mode:
        print("| weights | agreement with bfloat16 | identical answers |\n|---|---|---|")
        for mode, answers in answers_by_mode.items():
            agree, same, total = agreement(answers, answers_by_mode["bfloat16"])
            print(f"| {mode} | {agree:.1%} | {same}/{total} |")
        print()
    print(f"max_tokens={args.max_tokens}, threads {torch.get_num_threads()}")


def agreement(answers: list[list[int]], reference: list[list[int]]) -> tuple[float, int, int]:
    """(share of the reference's tokens before each answer's first divergence, identical answers, answers)."""
    agree = sum(common_prefix(a, b) for a, b in zip(answers, reference))
    return agree / sum(len(r) for r in reference), sum(a == b for a, b in zip(answers, reference)), len(reference)


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def table(rows) -> str:
    lines = [
        "| weights | agreement with float32 | identical answers | batch 1 tok/s | batch 16 tok/s |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {mode} | {agree:.1%} | {same}/{total} | {single:.1f} | {batched:.1f} |"
        for mode, agree, same, total, single, batched in rows
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
