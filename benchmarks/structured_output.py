"""Structured output's cost: the same 64-request workload with half the requests JSON-schema constrained and with
none constrained, per guide, side by side; per-step mask time at batch 1 and 64; schema compile time, cold and cached.

The workload: 32 requests of ``infer bench``'s ``chat`` workload (random-word prompts, greedy, fixed lengths) plus 32
chat requests asking for JSON under ``infer.bench.structured``'s schemas (nested objects, enums, arrays, bounded
numbers), greedy. The constrained run goes first and records each JSON answer's length; the unconstrained run asks
the same prompts for exactly those lengths (``ignore_eos``), so both runs generate the same number of tokens and the
ratio of their output tokens/s is the guide's cost. Runs alternate (``--repeats``), medians reported, all in one
process per guide (the machine is shared and noisy). Then jump-forward: 8 JSON requests with the grammar's forced
tokens drafted and not (``guide.jump_forward``), seconds and steps.

    python benchmarks/structured_output.py                     # both guides, float32, 3 repeats
    python benchmarks/structured_output.py --guides xgrammar --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from infer import LLM, SamplingParams
from infer.bench.structured import SCHEMAS, satisfies, structured_requests
from infer.bench.workloads import build_workload
from infer.guide import Constraint, constrain_logits


def run_once(llm: LLM, prompts: list, params: list[SamplingParams]) -> tuple[float, list]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return time.perf_counter() - start, outputs


def workload(llm: LLM, num_requests: int):
    """(prompts, constrained params, the constraints) for the JSON half, and (prompts, params) for the chat half."""
    chat = build_workload("chat", llm.tokenizer, num_requests=num_requests // 2, seed=0)
    chat_prompts = [request.prompt for request in chat.requests]
    chat_params = [request.params for request in chat.requests]
    json_requests = [r for r in structured_requests(4 * num_requests) if r.constraint.kind == "json_schema"]
    json_requests = json_requests[: num_requests - len(chat_prompts)]
    return chat_prompts, chat_params, json_requests


def measure_throughput(llm: LLM, num_requests: int, repeats: int) -> dict:
    chat_prompts, chat_params, json_requests = workload(llm, num_requests)
    prompts = chat_prompts + [r.messages for r in json_requests]
    constrained = chat_params + [
        SamplingParams(max_tokens=256, temperature=0.0, constraint=r.constraint) for r in json_requests
    ]
    engine, in_guide = llm.engine, [0.0]
    masks = engine._constrained_logits

    def timed_masks(output):
        start = time.perf_counter()
        try:
            return masks(output)
        finally:
            in_guide[0] += time.perf_counter() - start

    engine._constrained_logits = timed_masks  # the warm-up run also says how much of a run the masks take
    warm_seconds, first = run_once(llm, prompts, constrained)  # and gives the JSON answers' lengths
    engine._constrained_logits = masks
    bad = [
        o.outputs[0].text
        for o, r in zip(first[len(chat_prompts) :], json_requests)
        if satisfies(o.outputs[0].text, r.constraint)
    ]
    lengths = [len(o.outputs[0].token_ids) for o in first[len(chat_prompts) :]]
    unconstrained = chat_params + [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    num_tokens = sum(len(o.outputs[0].token_ids) for o in first)
    times = {"constrained": [], "unconstrained": []}
    for _ in range(repeats):
        for name, params in (("unconstrained", unconstrained), ("constrained", constrained)):
            seconds, outputs = run_once(llm, prompts, params)
            assert sum(len(o.outputs[0].token_ids) for o in outputs) == num_tokens
            times[name].append(seconds)
    rates = {name: num_tokens / statistics.median(values) for name, values in times.items()}
    pairs = [plain / guided for plain, guided in zip(times["unconstrained"], times["constrained"])]
    return {
        "output_tokens": num_tokens,
        "invalid": len(bad),
        **rates,
        "ratio": rates["constrained"] / rates["unconstrained"],
        "pairs": pairs,
        "mask_share": in_guide[0] / warm_seconds,
    }


def measure_masks(llm: LLM, batch: int, steps: int = 50) -> float:
    """Median seconds to build and apply the masks of ``batch`` constrained rows (fill from each matcher, then
    -inf into the logits, as the engine does: infer's CPU kernels where loaded), each matcher a few tokens into a
    JSON answer."""
    guide = llm.engine.guide
    compiled = guide.compile(Constraint(json_schema=SCHEMAS[0][1]))
    prefix = llm.tokenizer('{"name": "Ada", "age": ', add_special_tokens=False)["input_ids"]
    matchers = []
    for _ in range(batch):
        matcher = guide.matcher(compiled)
        matcher.accept(prefix)
        matchers.append(matcher)
    logits = torch.randn(batch, llm.engine.model.vocab_size)
    rows = [(matcher, index, []) for index, matcher in enumerate(matchers)]
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        constrain_logits(logits, rows, kernels=llm.engine.executor.kernels)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_jump_forward(llm: LLM, repeats: int, num_requests: int = 8) -> dict:
    """``num_requests`` JSON requests together (drafting stays on at this batch), with the grammar's forced tokens
    drafted and without (the engine's switch flipped between alternating runs): seconds and steps, medians."""
    requests = [r for r in structured_requests(4 * num_requests) if r.constraint.kind == "json_schema"]
    requests = requests[:num_requests]
    prompts = [r.messages for r in requests]
    params = [SamplingParams(max_tokens=256, temperature=0.0, constraint=r.constraint) for r in requests]
    engine, results = llm.engine, {True: [], False: []}
    tokens = {}
    for _ in range(repeats):
        for jump in (False, True):
            engine._jump_forward = jump
            steps = engine.stats.num_steps
            seconds, outputs = run_once(llm, prompts, params)
            results[jump].append((seconds, engine.stats.num_steps - steps))
            tokens[jump] = [o.outputs[0].token_ids for o in outputs]
    engine._jump_forward = True
    assert tokens[True] == tokens[False], "jump-forward changed an output"
    return {
        jump: (statistics.median(s for s, _ in runs), statistics.median(n for _, n in runs))
        for jump, runs in results.items()
    }


def measure_compile(llm: LLM) -> tuple[float, float]:
    guide = llm.engine.guide
    schema = {**SCHEMAS[3][1], "title": f"fresh-{time.time_ns()}"}  # never compiled before
    constraint = Constraint(json_schema=json.dumps(schema))
    start = time.perf_counter()
    guide.compile(constraint)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    guide.compile(constraint)
    return cold, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--guides", nargs="+", default=["xgrammar", "llguidance"])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    rows = []
    for guide in args.guides:
        llm = LLM(
            "baseline",
            guide={"name": guide},
            model={"dtype": args.dtype, "max_model_len": 1024},
            scheduler={"max_num_seqs": 64},
        )
        throughput = measure_throughput(llm, args.num_requests, args.repeats)
        cold, cached = measure_compile(llm)
        rows.append(
            (
                guide,
                throughput,
                measure_masks(llm, 1),
                measure_masks(llm, 64),
                cold,
                cached,
                measure_jump_forward(llm, args.repeats),
            )
        )
        del llm
    print(
        f"{args.num_requests} requests (half JSON-schema constrained), greedy, {args.dtype}, "
        f"{torch.get_num_threads()} threads, median of {args.repeats}"
    )
    print(
        "| guide | output tokens | invalid | unconstrained tok/s | constrained tok/s | ratio | mask batch 1 | "
        "mask batch 64 | compile cold | compile cached |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for guide, t, mask1, mask64, cold, cached, _ in rows:
        print(
            f"| {guide} | {t['output_tokens']} | {t['invalid']} | {t['unconstrained']:.1f} | "
            f"{t['constrained']:.1f} | {t['ratio']:.3f} | {mask1 * 1e3:.3f} ms | {mask64 * 1e3:.2f} ms | "
            f"{cold * 1e3:.1f} ms | {cached * 1e6:.0f} us |"
        )
    print("\nPer alternating pair, constrained rate / unconstrained rate; share of a constrained run in the masks")
    for guide, t, *_ in rows:
        print(f"- {guide}: {', '.join(f'{pair:.3f}' for pair in t['pairs'])}; masks {100 * t['mask_share']:.2f}%")
    print("\nJump-forward (8 JSON requests together, outputs identical): seconds and steps, off -> on")
    for guide, *_, jump in rows:
        (off_s, off_steps), (on_s, on_steps) = jump[False], jump[True]
        print(f"- {guide}: {off_s:.2f} s / {off_steps} steps -> {on_s:.2f} s / {on_steps} steps ({off_s / on_s:.2f}x)")


if __name__ == "__main__":
    main()
