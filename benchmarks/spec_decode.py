"""Speculative decoding on the default model: each drafter side by side with no drafter, in one run.

Workloads: ``copy`` prompts repeat or edit a given passage (what prompt lookup is for); ``chat`` prompts are open
questions written for this benchmark, on topics and in phrasings absent from ``infer train-eagle``'s built-in
training prompts. Each (drafter, workload) pair runs at every batch size, as waves of that many requests, greedy;
drafting stays on at every batch size here (``drafter.max_batch_size`` is raised to the largest batch).

Per row: tokens per verify pass (the bonus token included), output tokens/s end to end (prefill included), its ratio
to no drafter on the same workload and batch, the decode rate of one request (1 / time per output token after the
first, prefill excluded: what llama.cpp reports as generation speed), and how many outputs equal no drafter's token for
token (in bfloat16 a different batch shape can
flip a near-tie; float32 is exact). Prints a markdown table.

    python benchmarks/spec_decode.py                                       # default dtype, batch 1, 4 and 16
    python benchmarks/spec_decode.py --dtype float32 --batch-sizes 1 --max-tokens 64
    python benchmarks/spec_decode.py --drafters none eagle --batch-sizes 1 --interleave   # side by side, per wave
    python benchmarks/spec_decode.py --drafters none eagle eagle@head_quantization=target,min_confidence=0.6 \
        --batch-sizes 1 --interleave                      # variants: drafter.KEY=VALUE overrides after the @

On a CPU shared with other processes, one thread per process (``OMP_NUM_THREADS=1``) avoids OpenMP threads waiting
on descheduled siblings, which on 2 busy cores made every step several times slower.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

from infer import LLM, SamplingParams

PASSAGE = (
    "The old lighthouse stood at the edge of the cliff, its white paint peeling in long strips. Every night "
    "the keeper climbed the one hundred and twelve steps to light the lamp, and every morning he wrote the "
    "weather in a thick leather book. Ships passed safely for forty years, and nobody in the village could "
    "remember a single wreck on the rocks below."
)
CODE = (
    "def average(values):\n    total = 0\n    for value in values:\n        total = total + value\n"
    "    return total / len(values)\n"
)
COPY_PROMPTS = [
    f"Repeat the following passage exactly, word for word:\n\n{PASSAGE}",
    (
        f"Rewrite the following passage, replacing the word 'keeper' with 'guardian' and changing nothing else:\n\n"
        f"{PASSAGE}"
    ),
    f"Copy this Python function and add a docstring to it, keeping the code the same:\n\n{CODE}",
    f"Here is a paragraph:\n\n{PASSAGE}\n\nWrite the same paragraph again, but in the present tense.",
    f"Correct any mistakes in this text and return the full corrected text:\n\n{PASSAGE.replace('the', 'teh', 3)}",
    f"Quote the first two sentences of this passage, then explain them briefly:\n\n{PASSAGE}",
    f"Rename the function below to compute_mean and return the whole function:\n\n{CODE}",
    f"Repeat this text twice:\n\n{PASSAGE[:180]}",
]
CHAT_PROMPTS = [
    "How do I make a paper airplane that flies far?",
    "What's a good name for a pet goldfish, and why?",
    "Can you suggest a simple workout for someone who sits all day?",
    "Why do onions make people cry?",
    "What should I consider before adopting a rabbit?",
    "How can I keep my houseplants alive while I'm on vacation?",
    "Tell me how a refrigerator keeps food cold.",
    "What are some fun things to do on a rainy afternoon with kids?",
    "How do I politely decline an invitation to a party?",
    "Why is the sky orange at sunset?",
    "Give me tips for writing a birthday card to my grandmother.",
    "What is the difference between baking soda and baking powder?",
    "How do noise-cancelling headphones work?",
    "Suggest a name and a motto for a neighborhood book club.",
    "What makes a good cup of hot chocolate?",
    "How do I start learning to play the guitar?",
]
DRAFTERS = {
    "none": {"drafter.name": "none"},
    "ngram": {"drafter.name": "ngram"},
    "eagle": {"drafter.name": "eagle"},
    "model": {"drafter.name": "model"},
}
PLAN = [("copy", "none"), ("copy", "ngram"), ("chat", "none"), ("chat", "eagle"), ("chat", "model")]


def drafter_name(spec: str) -> str:
    """The drafter of a ``--drafters`` entry: ``NAME`` or ``NAME@KEY=VALUE,...``."""
    return spec.partition("@")[0]


def drafter_overrides(spec: str) -> dict[str, str]:
    """The config overrides of a ``--drafters`` entry: its drafter's, then ``drafter.KEY=VALUE`` per pair."""
    name, _, options = spec.partition("@")
    if name not in DRAFTERS:
        raise SystemExit(f"unknown drafter {name!r} in {spec!r}; choose one of {', '.join(DRAFTERS)}")
    overrides = dict(DRAFTERS[name])
    for option in filter(None, options.split(",")):
        key, equals, value = option.partition("=")
        if not equals or not key:
            raise SystemExit(f"drafter option {option!r} in {spec!r} is not KEY=VALUE")
        overrides[f"drafter.{key}"] = value
    return overrides


def workloads_of(spec: str) -> list[str]:
    return [workload for workload, name in PLAN if name == drafter_name(spec)]


@dataclass(slots=True)
class Result:
    workload: str
    drafter: str
    batch_size: int
    output_tokens: int
    seconds: float
    tokens_per_pass: float
    decode_seconds: float  # each request's time from its first token to its last, summed
    token_ids: list[list[int]]

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def decode_tokens_per_second(self) -> float:
        """Output tokens after each request's first, per second of that request's decoding."""
        return (self.output_tokens - len(self.token_ids)) / self.decode_seconds


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="auto: the engine's default (on an AVX2 CPU, float32 with fp16-packed weights)",
    )
    parser.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none", "fp16", "int8", "int8_per_row", "w8a8"],
        help="model.quantization (auto: fp16-packed weights on an x86 CPU in float32)",
    )
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument(
        "--num-prompts",
        type=int,
        default=8,
        help="prompts per workload at batch 1 (more at larger batches: one full wave at least)",
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4, help="drafts per verify pass")
    parser.add_argument("--model-layers", type=int, default=8, help="self-speculative draft depth (drafter: model)")
    parser.add_argument(
        "--drafters",
        nargs="+",
        default=[drafter for _, drafter in PLAN],
        help="subset of none ngram eagle model; NAME@KEY=VALUE,... adds a variant with those "
        "drafter.KEY overrides (eagle@min_confidence=0.6)",
    )
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="build every drafter's engine first and run each wave on all of them in turn (ratios "
        "that hold on a noisy machine; more memory: one engine per drafter at once)",
    )
    return parser.parse_args()


def prompts_for(workload: str, count: int) -> list[list[dict]]:
    texts = COPY_PROMPTS if workload == "copy" else CHAT_PROMPTS
    return [[{"role": "user", "content": texts[i % len(texts)]}] for i in range(count)]


def build_llm(drafter: str, args) -> LLM:
    overrides = {
        "drafter.num_speculative_tokens": args.k,
        "drafter.max_batch_size": max(args.batch_sizes),
        "model.dtype": args.dtype,
        "model.quantization": args.quantization,
        "scheduler.max_num_seqs": max(args.batch_sizes),
    }
    if drafter_name(drafter) == "model":
        overrides["drafter.layers"] = args.model_layers
    overrides.update(drafter_overrides(drafter))
    llm = LLM("baseline", dotlist=[f"{key}={value}" for key, value in overrides.items()])
    llm.generate(prompts_for("chat", 1), SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
    return llm


def run_drafter(drafter: str, workloads: list[str], args) -> list[Result]:
    llm = build_llm(drafter, args)
    return [
        run_workload({drafter: llm}, workload, batch_size, args)[0]
        for workload in workloads
        for batch_size in args.batch_sizes
    ]


def run_interleaved(args) -> list[Result]:
    """Every drafter's engine built up front; each wave of requests runs on all of them in turn (the order rotating
    from one wave to the next), so a machine that slows down or speeds up mid-run weighs on every drafter alike."""
    drafters = list(dict.fromkeys(args.drafters))
    llms = {drafter: build_llm(drafter, args) for drafter in drafters}
    results: list[Result] = []
    for workload in dict.fromkeys(workload for drafter in drafters for workload in workloads_of(drafter)):
        engines = {drafter: llms[drafter] for drafter in drafters if workload in workloads_of(drafter)}
        for batch_size in args.batch_sizes:
            results.extend(run_workload(engines, workload, batch_size, args))
        print(table(results), flush=True)
        print(flush=True)
    return results


def run_workload(llms: dict[str, LLM], workload: str, batch_size: int, args) -> list[Result]:
    """The workload's waves of ``batch_size`` requests on each engine of ``llms`` (by drafter); one result each."""
    prompts = prompts_for(workload, max(args.num_prompts, batch_size))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    names = list(llms)
    outputs: dict[str, list] = {name: [] for name in names}
    seconds = dict.fromkeys(names, 0.0)
    for wave, start in enumerate(range(0, len(prompts), batch_size)):
        for name in names[wave % len(names) :] + names[: wave % len(names)]:
            began = time.perf_counter()
            outputs[name].extend(llms[name].generate(prompts[start : start + batch_size], params))
            seconds[name] += time.perf_counter() - began
    return [summarize(name, workload, batch_size, outputs[name], seconds[name]) for name in names]


def summarize(drafter: str, workload: str, batch_size: int, outputs: list, seconds: float) -> Result:
    passes = sum(output.metrics.num_verify_passes for output in outputs)
    accepted = sum(output.metrics.num_accepted_tokens for output in outputs)
    decode_seconds = sum(output.metrics.finish_time - output.metrics.first_token_time for output in outputs)
    return Result(
        workload,
        drafter,
        batch_size,
        sum(len(output.token_ids) for output in outputs),
        seconds,
        accepted / passes if passes else 1.0,
        decode_seconds,
        [output.token_ids for output in outputs],
    )


def table(results: list[Result]) -> str:
    baseline = {(r.workload, r.batch_size): r for r in results if r.drafter == "none"}
    lines = [
        "| workload | drafter | batch | tokens/pass | tok/s | vs none | decode tok/s per request | same output |",
        "|---|---|---|---|---|---|---|---|",
    ]
    order = list(DRAFTERS)
    for r in sorted(
        results, key=lambda r: (r.workload != "copy", r.batch_size, order.index(drafter_name(r.drafter)), r.drafter)
    ):
        base = baseline.get((r.workload, r.batch_size))
        ratio = f"{r.tokens_per_second / base.tokens_per_second:.2f}x" if base else "-"
        same = f"{sum(a == b for a, b in zip(r.token_ids, base.token_ids))}/{len(r.token_ids)}" if base else "-"
        lines.append(
            f"| {r.workload} | {r.drafter} | {r.batch_size} | {r.tokens_per_pass:.2f} | "
            f"{r.tokens_per_second:.1f} | {ratio} | {r.decode_tokens_per_second:.1f} | {same} |"
        )
    return "\n".join(lines)


def main() -> None:
    args = parse_arguments()
    torch.manual_seed(0)
    if args.interleave:
        run_interleaved(args)
    else:
        results: list[Result] = []
        for drafter in dict.fromkeys(args.drafters):
            results.extend(run_drafter(drafter, workloads_of(drafter), args))
            print(table(results), flush=True)
            print(flush=True)
    order = "interleaved" if args.interleave else "one drafter after another"
    print(
        f"{order}, dtype {args.dtype}, quantization {args.quantization}, k={args.k}, max_tokens={args.max_tokens}, "
        f"threads {torch.get_num_threads()}, "
        f"draft depth (model) {args.model_layers} layers"
    )


if __name__ == "__main__":
    main()
