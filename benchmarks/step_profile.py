"""Where one engine step's time goes on the default model: decode at batch 1, 16 and 64, prefill, and decode at
batch 64 on four shared 600-token prompts (radix prefix cache) with the CPU attention kernel, and with sdpa's torch
path with cascade attention on and off.

Wall-clock timers wrap the engine's parts (on the CPU every op is synchronous, so a part's time is its wall time):
scheduling, batch metadata (flattening plus the attention backend's per-step plan), the dense projections of the
layers, attention (KV write plus paged attention), the output head, sampling; the remainder is the rest of the
forward pass (embedding, RMSNorm, RoPE, SiLU, residual adds) plus Python glue. Steps of a few tokens run all layers
in one C call (the ``fused-stack`` execution path, ``FusedStack``): its time, projections, attention and small ops
together, is the "layers, one call" column; with a backend that keeps attention to itself they run each layer's dense
parts as two C calls (``fused-layers``, ``FusedLayer``), the "fused dense" column. Prints a markdown table,
milliseconds per step and shares.

``--clock cpu`` times every part by the calling thread's CPU time instead (``time.thread_time``: with
``OMP_NUM_THREADS=1`` the whole step, and robust while other processes share the cores); ``--kernels PATH`` runs the
engine on another build of the C kernels (another checkout's library of the same interface), for a before/after.

    OMP_NUM_THREADS=2 python benchmarks/step_profile.py
    python benchmarks/step_profile.py model.quantization=none       # any config override
    OMP_NUM_THREADS=1 python benchmarks/step_profile.py model.path=DIR --clock cpu --decode-batches 64 \
        --prefills 1x256 --no-shared-prefix                           # one thread, a model folder's steps
"""

from __future__ import annotations

import argparse
import gc
import time
from collections import defaultdict
from pathlib import Path

import torch
from drain import drain  # beside this script

from infer import LLM, SamplingParams
from infer.kernels.cpu import FusedLayer, FusedStack, builder, load_built
from infer.model.quantization import PackedLinear

clock = time.perf_counter  # --clock cpu: time.thread_time

PARTS = [
    "scheduling",
    "metadata",
    "layers, one call",
    "projections",
    "fused dense",
    "attention",
    "output head",
    "sampling",
    "other",
]


class Timers:
    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.depth = 0

    def wrap(self, owner, name: str, part: str) -> None:
        original = getattr(owner, name)
        timers = self

        def timed(*args, **kwargs):
            if timers.depth:  # nested inside a timed part: counted there
                return original(*args, **kwargs)
            timers.depth += 1
            began = clock()
            try:
                return original(*args, **kwargs)
            finally:
                timers.seconds[part] += clock() - began
                timers.depth -= 1

        setattr(owner, name, timed)


def instrument(llm: LLM) -> Timers:
    engine, timers = llm.engine, Timers()
    timers.wrap(engine.scheduler, "schedule", "scheduling")
    timers.wrap(engine.runner, "build_metadata", "metadata")
    timers.wrap(engine.runner.attention, "prepare", "metadata")
    timers.wrap(engine.runner.attention, "forward", "attention")
    timers.wrap(engine.model, "compute_logits", "output head")
    timers.wrap(FusedStack, "run", "layers, one call")  # the class: stacks are built on first use
    timers.wrap(engine.sampler, "sample", "sampling")
    timers.wrap(engine.sampler, "logprobs", "sampling")
    for layer in engine.model.layers:
        for module in layer.modules():
            if isinstance(module, (PackedLinear, torch.nn.Linear)):
                timers.wrap(module, "forward", "projections")
        if isinstance(layer.fused, FusedLayer):
            timers.wrap(layer.fused, "attention_input", "fused dense")
            timers.wrap(layer.fused, "feed_forward", "fused dense")
    return timers


def decode_case(llm: LLM, timers: Timers, batch: int, steps: int, repeats: int = 1) -> tuple[float, dict]:
    """Decode at ``batch`` sequences, each prompt a chat message of its sentence ``repeats`` times (1: about 40
    tokens with the template; 10: about 145)."""
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        sentence = f"Tell me a long story about lighthouse number {i}. "
        engine.add_request([{"role": "user", "content": (sentence * repeats).strip()}], params)
    return timed_decode(engine, timers, steps)


def timed_decode(engine, timers: Timers, steps: int) -> tuple[float, dict]:
    """Finish every prefill, take 3 warm-up decode steps, then time ``steps`` more; mean per step, then drain."""
    while any(seq.num_uncomputed_tokens > 1 for seq in engine.running) or engine.waiting:
        engine.step()  # prefill
    for _ in range(3):
        engine.step()
    timers.seconds.clear()
    began = clock()
    for _ in range(steps):
        engine.step()
    total = clock() - began
    parts = dict(timers.seconds)
    drain(engine)
    return total / steps, {part: value / steps for part, value in parts.items()}


def shared_prefix_decode_case(llm: LLM, timers: Timers, steps: int) -> tuple[float, dict]:
    """Decode at batch 64: 4 groups of 16 sequences whose prompts start with the same 600 tokens (held once by the
    radix cache), each followed by a question of its own."""
    engine = llm.engine
    generator = torch.Generator().manual_seed(1)
    params = SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True)
    for _ in range(4):
        system = torch.randint(1000, 20000, (600,), generator=generator).tolist()
        for _ in range(16):
            engine.add_request(system + torch.randint(1000, 20000, (30,), generator=generator).tolist(), params)
    return timed_decode(engine, timers, steps)


def prefill_case(llm: LLM, timers: Timers, batch: int, length: int, repeats: int) -> tuple[float, dict]:
    engine = llm.engine
    generator = torch.Generator().manual_seed(0)
    totals, parts = 0.0, defaultdict(float)
    for _ in range(repeats):
        for _ in range(batch):
            prompt = torch.randint(1000, 20000, (length,), generator=generator).tolist()
            engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
        timers.seconds.clear()
        began = clock()
        engine.step()
        totals += clock() - began
        for part, value in timers.seconds.items():
            parts[part] += value
        drain(engine)
    return totals / repeats, {part: value / repeats for part, value in parts.items()}


def row(label: str, total: float, parts: dict, tokens: int) -> str:
    parts = dict(parts)
    parts["other"] = max(0.0, total - sum(parts.values()))
    cells = [f"{parts.get(part, 0.0) * 1e3:.1f} ({parts.get(part, 0.0) / total:.0%})" for part in PARTS]
    return f"| {label} | {total * 1e3:.1f} | {tokens / total:,.0f} | " + " | ".join(cells) + " |"


def main() -> None:
    global clock
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="wall time or this thread's CPU time")
    parser.add_argument("--kernels", type=Path, help="a build of the C kernels (.so) to run instead of this tree's")
    parser.add_argument("--decode-batches", type=int, nargs="*", default=[1, 16, 64])
    parser.add_argument("--prefills", nargs="*", default=["1x512", "4x512"], help="prompts x tokens, one step each")
    parser.add_argument("--no-shared-prefix", action="store_true", help="skip the shared-prefix decode rows")
    parser.add_argument(
        "--prompt-repeats", type=int, default=1, help="decode rows' prompts: their sentence this many times"
    )
    args = parser.parse_args()
    if args.clock == "cpu":
        clock = time.thread_time
    if args.kernels:  # every caller of infer.kernels.cpu.load gets this build
        kernels = load_built(args.kernels)
        builder._load = lambda: kernels
    llm = LLM("baseline", dotlist=args.overrides)
    llm.generate(["warm up"], SamplingParams(max_tokens=4, temperature=0.0))
    timers = instrument(llm)
    lines = ["| step | ms | tok/s | " + " | ".join(PARTS) + " |", "|---" * (len(PARTS) + 3) + "|"]
    for batch in args.decode_batches:
        total, parts = decode_case(llm, timers, batch, args.steps, args.prompt_repeats)
        lines.append(row(f"decode, batch {batch}", total, parts, batch))
        print(lines[-1], flush=True)
    for prefill in args.prefills:
        batch, length = (int(number) for number in prefill.split("x"))
        total, parts = prefill_case(llm, timers, batch, length, repeats=3)
        lines.append(row(f"prefill {batch} x {length}", total, parts, batch * length))
        print(lines[-1], flush=True)
    variants = (
        {}
        if args.no_shared_prefix
        else {
            "CPU kernel": ["attention.name=cpu"],
            "torch, cascade on": ["attention.name=sdpa"],
            "torch, cascade off": ["attention.name=sdpa", "attention.cascade=false"],
        }
    )
    for label, overrides in variants.items():
        shared = LLM("radix_lpm", dotlist=[*args.overrides, *overrides])
        total, parts = shared_prefix_decode_case(shared, instrument(shared), args.steps)
        lines.append(row(f"decode, batch 64 on 4 shared 600-token prefixes, {label}", total, parts, 64))
        print(lines[-1], flush=True)
        del shared
        gc.collect()
    engine = llm.engine
    print(
        f"\n{engine.model_name}, dtype {str(engine.dtype).removeprefix('torch.')}, quantization "
        f"{engine.quantization}, attention {type(engine.attention).__name__} ({engine.attention.describe()}), "
        f"threads {torch.get_num_threads()}, {args.clock} time\n"
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
