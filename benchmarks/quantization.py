"""Weight packing (``model.quantization``) on the default model: quality against float32, and speed, in one run.

Each mode generates greedy answers to the same chat prompts. Quality: for each answer, the tokens before its first
divergence from the exact float32 answer (``none``), summed over prompts, as a share of float32's tokens
("agreement"), and how many answers are identical. Speed: output tokens/s at batch 1 (one request at a time) and at
batch 16 (all prompts at once), with infer's CPU kernels where the mode takes them (fp16, bf16, int8). ``bfloat16`` is
torch's bfloat16 compute (``model.dtype=bfloat16``), for comparison; when it runs, a last table gives each mode's
agreement with its answers as well.

Perplexity: each mode's on ``benchmarks/data/perplexity.txt`` (about 1,600 words of plain English prose written for
infer, so no license binds it; 1,807 tokens, tokenized alike by transformers and llama.cpp) as llama.cpp's
``llama-perplexity`` computes it: the text cut into chunks of ``--context`` tokens, each computed from its start, and
the mean negative log-likelihood of every token in a chunk's second half given the chunk's tokens before it,
exponentiated. With ``--llama-perplexity PATH`` (a binary built from llama.cpp's source, or ``$LLAMA_PERPLEXITY``)
llama.cpp's own figure on the default model's GGUF file, the same text and context, is printed beside them.

    OMP_NUM_THREADS=2 python benchmarks/quantization.py
    python benchmarks/quantization.py --modes none fp16 --max-tokens 64
    python benchmarks/quantization.py --modes none gguf q4_0 --perplexity-only --llama-perplexity PATH
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import subprocess
import time
from pathlib import Path

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


TEXT = Path(__file__).with_name("data") / "perplexity.txt"


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch-1-prompts", type=int, default=4, help="prompts timed one at a time")
    parser.add_argument("--text", type=Path, default=TEXT, help="the text perplexity is measured on")
    parser.add_argument("--context", type=int, default=256, help="tokens per perplexity chunk")
    parser.add_argument("--perplexity-only", action="store_true", help="skip the answers and their speed")
    parser.add_argument(
        "--llama-perplexity",
        default=os.environ.get("LLAMA_PERPLEXITY"),
        help="llama.cpp's llama-perplexity binary (default: $LLAMA_PERPLEXITY): its figure on the same GGUF file",
    )
    parser.add_argument(
        "--llama-perplexity-args",
        default="",
        help='more llama-perplexity arguments, as shell words ("--no-repack": see docs/research.md)',
    )
    return parser.parse_args()


def main() -> None:
    args = parse_arguments()
    prompts = [[{"role": "user", "content": text}] for text in BUILTIN_PROMPTS + EXTRA_PROMPTS]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    modes = ["none", *(mode for mode in args.modes if mode != "none")]
    text = args.text.read_text()
    perplexities = {}
    rows, reference, answers_by_mode = [], None, {}
    for mode in modes:
        llm = LLM("baseline", dotlist=MODES[mode])
        perplexities[mode] = perplexity(llm, llm.engine.tokenizer(text)["input_ids"], args.context)
        if args.perplexity_only:
            continue
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
    print(f"| weights | perplexity ({args.text.name}, {args.context}-token chunks) |\n|---|---|")
    for mode, value in perplexities.items():
        print(f"| {mode} | {value:.4f} |")
    if args.llama_perplexity:
        from infer.model.loader import DEFAULT_MODEL, resolve_model_path

        gguf = resolve_model_path(DEFAULT_MODEL)
        extra = shlex.split(args.llama_perplexity_args)
        threads = torch.get_num_threads()
        value = llama_cpp_perplexity(args.llama_perplexity, gguf, args.text, args.context, threads, extra)
        print(f"| llama.cpp on {gguf.name} {' '.join(extra)} | {value:.4f} |")
    print()
    print(f"max_tokens={args.max_tokens}, threads {torch.get_num_threads()}")


def perplexity(llm: LLM, token_ids: list[int], context: int) -> float:
    """``llama-perplexity``'s figure for ``token_ids`` on ``llm``: chunks of ``context`` tokens, each scored from its
    start; every token after the chunk's first ``context // 2`` adds the negative log-probability the model gave it
    given the chunk's tokens before it."""
    first = context // 2
    chunks = [token_ids[start : start + context] for start in range(0, len(token_ids) - context + 1, context)]
    outputs = llm.generate(chunks, SamplingParams(max_tokens=0, prompt_logprobs=0))
    losses = [-entry["logprob"] for output in outputs for entry in output.prompt_logprobs[first + 1 :]]
    return math.exp(sum(losses) / len(losses))


def llama_cpp_perplexity(
    binary: str, gguf: Path, text: Path, context: int, threads: int, extra: list[str] | None = None
) -> float:
    """llama.cpp's ``llama-perplexity`` on ``gguf`` over ``text`` in chunks of ``context`` tokens (one chunk a
    batch), from its ``Final estimate: PPL = ...`` line."""
    command = [binary, "-m", str(gguf), "-f", str(text), "-c", str(context), "-b", str(context), "-t", str(threads)]
    command += extra or []
    finished = subprocess.run(command, capture_output=True, text=True, check=True)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", finished.stdout + finished.stderr)
    if found is None:
        raise RuntimeError(f"llama-perplexity printed no final estimate:\n{finished.stderr[-2000:]}")
    return float(found.group(1))


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
