"""One mixture-of-experts layer's time per step (ms, median) at batch 1, 16 and 64 on the shape of a CPU user's MoE
(``random_models.py``'s ``qwen3-moe-3.3b``: 32 experts of 2048 x 512, 4 routed per token), bf16 weights (``--weights``:
or GGUF's blocks, as ``model.quantization=q4`` packs them), against the floor of reading the step's active experts'
weights once at this machine's streaming rate.

- ``torch loop``: transformers' own ``Qwen3MoeSparseMoeBlock`` in bf16 (a loop over the active experts, torch's
  bf16 matmuls), the reference.
- ``grouped``: ``infer.model.moe.MoE`` packed as ``model.quantization`` packs it, expert by expert through
  each expert's packed projections on infer's kernels (GEMV, tile GEMM, block GEMV and GEMM) from Python.
- ``infer``: the same ``MoE`` as the engine runs it: every expert in one C call (``CpuKernels.moe_experts``) over
  the tiles' layout where the kernels have tiles (AMX or AVX512-BF16), else over ``pack_weights``' layout for the
  experts of few tokens and any others as ``grouped``; over blocks, every expert in the call (where the block GEMM
  runs on AMX, those of more than one block-GEMV pass of tokens as ``grouped``, but MXFP4 ones).
- ``pack_weights``: the C call over ``pack_weights``' layout (the kernels' path without tiles) on this machine.
- ``floor``: the active experts' bytes over the best rate at which infer's GEMV streamed a bf16 weight (one row of
  x) in reads sampled through the run.

Times are medians over the steps, with infer's best beside them: on a machine shared with other work the median
includes steps where the scheduler held one of the kernel's threads.

Each step takes the next of ``--layers`` distinct layers (random weights, random inputs), so the weights come from
memory, not from a cache that a smaller working set would fit.

``--cpu-time`` times by the calling thread's CPU time (run it with ``OMP_NUM_THREADS=1``): on a machine that other
jobs load, two threads' times are mostly one thread spinning while the scheduler holds the other. ``--switch``
instead times the tile kernel for one expert taking 1 to 64 tokens, on AMX's tiles and on float32 FMAs
(``moe_experts``' ``tile_rows``): where AMX starts to win is ``MOE_TILE_ROWS``.

    OMP_NUM_THREADS=2 python benchmarks/moe_layer.py
    OMP_NUM_THREADS=1 python benchmarks/moe_layer.py --cpu-time
    OMP_NUM_THREADS=1 python benchmarks/moe_layer.py --switch --cpu-time
    OMP_NUM_THREADS=2 python benchmarks/moe_layer.py --weights q4_1 --batches 1 16 64 128
    OMP_NUM_THREADS=2 python benchmarks/moe_layer.py --weights q4_k_m --batches 1 16 64
    OMP_NUM_THREADS=2 python benchmarks/moe_layer.py --weights mxfp4 --batches 1 16 64
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from infer.kernels import cpu as cpu_kernels
from infer.model.moe import ExpertGroups, MoE
from infer.model.ops import StepOps
from infer.model.quantization import quantize_linears

sys.path.insert(0, str(Path(__file__).parent))
from random_models import SHAPES  # noqa: E402


def cpu_name() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


class StreamingRate:
    """GB/s at which the kernels' GEMV reads a bf16 weight (one row of x), sampled through the run (``sample``) over
    ``count`` weights of ``megabytes`` taken in turn (together past the last-level cache). Short reads, best of many:
    on a shared machine a read that another process preempts measures the scheduler, not the memory."""

    def __init__(self, kernels, megabytes: float = 24, count: int = 16):
        k = 2048
        n = int(megabytes * 1e6 / (2 * k)) // 4 * 4
        self.kernels, self.x = kernels, torch.randn(1, k)
        self.weights = [cpu_kernels.pack_weights(torch.randn(n, k).to(torch.bfloat16)) for _ in range(count)]
        self.samples: list[float] = []

    def sample(self) -> None:
        packed = self.weights[len(self.samples) % len(self.weights)]
        seconds = timed(lambda: self.kernels.linear(self.x, packed, None, None))
        self.samples.append(packed.numel() * 2 / seconds / 1e9)

    @property
    def best(self) -> float:
        return max(self.samples)


class WithoutTiles:
    """The kernels as a build without tiles sees them: experts packed through this take ``pack_weights``' layout."""

    tiles = None

    def __init__(self, kernels):
        self.kernels = kernels

    def __getattr__(self, name):
        return getattr(self.kernels, name)


def switch_point(kernels, layers, counts: list[int], repeats: int = 12) -> None:
    """Median ms of the tile kernel over one expert taking ``count`` tokens (each call another layer's and expert's,
    so its weights come from memory), on AMX's tiles and on float32 FMAs."""
    hidden = layers[0].packed.hidden
    print("| tokens | FMAs ms | AMX ms | AMX / FMAs |")
    print("|---|---|---|---|")
    for count in counts:
        times = {"fma": [], "amx": []}
        x = torch.randn(count, hidden)
        for index in range(repeats * 2):
            layer = layers[index % len(layers)]
            path = "amx" if index % 2 else "fma"
            call = (
                torch.tensor([(index // len(layers)) % layer.packed.num_experts]),
                torch.tensor([0, count]),
                torch.arange(count),
                torch.rand(count),
            )
            out = torch.zeros(count, hidden)
            tile_rows = 1 if path == "amx" else 1 << 30
            times[path].append(timed(lambda: kernels.moe_experts(x, layer.packed, *call, out, tile_rows)) * 1e3)
        fma, amx = statistics.median(times["fma"]), statistics.median(times["amx"])
        print(f"| {count} | {fma:.3f} | {amx:.3f} | {amx / fma:.2f} |")


# The clock of ``timed``: wall time, or with ``--cpu-time`` the calling thread's CPU time (one thread,
# OMP_NUM_THREADS=1: on a machine other jobs share, the time the kernel ran rather than the time it waited).
CLOCK = {"clock": time.perf_counter}


def timed(call) -> float:
    clock = CLOCK["clock"]
    began = clock()
    call()
    return clock() - began


def build_layers(config, count: int, seed: int, weights: str = "bf16"):
    """``count`` pairs of (transformers' block in bf16, infer's MoE packed as ``weights``) with the same random
    weights."""
    import transformers

    from infer.plugins.models.qwen3_moe import Qwen3MoeArchitecture

    spec = Qwen3MoeArchitecture.decoder_spec(config)
    torch.manual_seed(seed)
    pairs = []
    for _ in range(count):
        hf_block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config)
        with torch.no_grad():
            for parameter in hf_block.parameters():
                parameter.normal_(0.0, 0.02)
        hf_block = hf_block.to(torch.bfloat16)
        ours = MoE(spec, torch.float32)
        stacked = hf_block.experts
        with torch.no_grad():
            ours.router.weight.copy_(hf_block.gate.weight.float())
            for index, expert in enumerate(ours.experts):
                expert.gate_up_proj.weight.copy_(stacked.gate_up_proj[index].float())
                expert.down_proj.weight.copy_(stacked.down_proj[index].float())
        if weights in EXPERT_KINDS:  # kinds infer takes from a file: each expert's projections given as blocks
            pairs.append((hf_block, quantize_linears(ours, "q8_0", blocks=block_experts(ours, *EXPERT_KINDS[weights]))))
        else:
            pairs.append((hf_block, quantize_linears(ours, weights)))
    return pairs


# Expert kinds that come from a file, not infer's quantizers: gate/up's kind and down's.
EXPERT_KINDS = {"q4_k_m": ("q4_k", "q6_k"), "mxfp4": ("mxfp4", "mxfp4")}


def block_experts(moe: MoE, gate_up_kind: str, down_kind: str) -> dict:
    """``moe``'s expert projections as blocks of these kinds by module name: K-quants by the reference quantizer of
    ``infer.testing.kquants`` (gate/up ``Q4_K``, down ``Q6_K``: a ``Q4_K_M`` file's experts), MXFP4 by the gguf
    package's (a gpt-oss checkpoint's)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from infer.kernels.cpu.blocks import pack_blocks
    from infer.testing.kquants import QUANTIZERS

    blocks = {}
    for index, expert in enumerate(moe.experts):
        for name, kind in (("gate_up_proj", gate_up_kind), ("down_proj", down_kind)):
            weight = getattr(expert, name).weight.detach().numpy()
            raw = QUANTIZERS[kind](weight) if kind in QUANTIZERS else quantize(weight, GGMLQuantizationType.MXFP4)
            blocks[f"experts.{index}.{name}"] = pack_blocks(raw, kind, weight.shape[0])
    return blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen3-moe-3.3b", choices=[name for name in SHAPES if "moe" in name])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--layers", type=int, default=8, help="distinct layers cycled through (weights from memory)")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--switch", action="store_true", help="time AMX against FMAs per expert's tokens instead")
    parser.add_argument(
        "--cpu-time", action="store_true", help="time by the calling thread's CPU time (run with OMP_NUM_THREADS=1)"
    )
    parser.add_argument(
        "--weights",
        default="bf16",
        choices=["bf16", "q4_0", "q4_1", "q8_0", "q4_k_m", "mxfp4"],
        help="the experts' weights: bf16, or quantized to GGUF's blocks (model.quantization=q4 is q4_1; q4_k_m: "
        "gate/up Q4_K and down Q6_K, as a Q4_K_M file stores them; mxfp4: as a gpt-oss checkpoint stores them)",
    )
    parser.add_argument(
        "--gemv-rows",
        type=int,
        default=16,
        help="experts' inputs of up to this many rows take the GEMV (the engine's fused_max_tokens)",
    )
    args = parser.parse_args()
    import transformers

    if args.cpu_time:
        CLOCK["clock"] = time.thread_time
    kernels = cpu_kernels.load(True)
    class_name, fields = SHAPES[args.shape]
    config = getattr(transformers, class_name).config_class(**fields)
    hidden, width = config.hidden_size, config.moe_intermediate_size
    pairs = build_layers(config, args.layers, seed=0, weights=args.weights)
    expert = pairs[0][1].experts[0]
    expert_bytes = expert.gate_up_proj.nbytes + expert.down_proj.nbytes
    if args.switch:
        if args.weights != "bf16":
            raise SystemExit("--switch times bf16 experts on the tiles")
        if not kernels.amx:
            raise SystemExit("--switch needs AMX's tiles (this CPU, build or OS has none)")
        for _, ours in pairs:
            ours.use_cpu_kernels(kernels, args.gemv_rows)
        with torch.inference_mode():
            switch_point(kernels, [ours for _, ours in pairs], [1, 4, 8, 12, 16, 24, 32, 48, 64])
        return
    # beside every layer, one packed in pack_weights' layout (the kernels' path without tiles)
    streamed = build_layers(config, args.layers, seed=0) if kernels.tiles and args.weights == "bf16" else None
    rate = StreamingRate(kernels)
    for _ in range(32):
        rate.sample()
    for _, ours in pairs:
        ours.use_cpu_kernels(kernels, args.gemv_rows)
    for _, ours in streamed or []:
        ours.use_cpu_kernels(WithoutTiles(kernels), args.gemv_rows)
    step = SimpleNamespace(ops=StepOps(None, None, kernels))
    print(
        f"{cpu_name()}, {torch.get_num_threads()} threads; {args.shape}: {config.num_experts} experts of "
        f"{hidden} x {width}, top {config.num_experts_per_tok}, {args.weights}"
    )
    rows = []
    generator = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for batch in args.batches:
            torch_ms, grouped_ms, infer_ms, streamed_ms, active = [], [], [], [], []
            for index in range(args.steps):
                # each variant on another layer than the one the last call read, so no call finds its experts in
                # the cache the previous one filled
                hf_block, ours = pairs[index % len(pairs)]
                grouped = pairs[(index + len(pairs) // 2) % len(pairs)][1]
                x = torch.randn(batch, hidden, generator=generator)
                groups = ExpertGroups.of(ours.route(x), ours.num_experts)
                active.append(len(groups.active))
                rate.sample()
                x16 = x.to(torch.bfloat16)[None]
                torch_ms.append(timed(lambda: hf_block(x16)) * 1e3)
                infer_ms.append(timed(lambda: ours(x, step)) * 1e3)
                packed, grouped.packed = grouped.packed, None
                grouped_ms.append(timed(lambda: grouped(x, step)) * 1e3)
                grouped.packed = packed
                if streamed:
                    other = streamed[(index + len(pairs) // 4) % len(pairs)][1]
                    streamed_ms.append(timed(lambda: other(x, step)) * 1e3)
            rows.append(
                (
                    batch,
                    statistics.median(active),
                    statistics.median(torch_ms),
                    statistics.median(grouped_ms),
                    statistics.median(infer_ms),
                    min(infer_ms),
                    statistics.median(streamed_ms) if streamed_ms else float("nan"),
                )
            )
    print(
        f"floor: the active experts' bytes at {rate.best:.1f} GB/s, the GEMV's best streaming rate of "
        f"{len(rate.samples)} samples (median {statistics.median(rate.samples):.1f})"
    )
    print(
        "| batch | active experts | floor ms | torch loop ms | grouped ms | pack_weights ms | infer ms (best) "
        "| infer / floor (best) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for batch, experts, torch_loop, grouped, infer, best, streamed_median in rows:
        floor = experts * expert_bytes / rate.best / 1e6
        print(
            f"| {batch} | {experts:.0f} | {floor:.2f} | {torch_loop:.2f} | {grouped:.2f} | {streamed_median:.2f} "
            f"| {infer:.2f} ({best:.2f}) | {infer / floor:.2f} ({best / floor:.2f}) |"
        )


if __name__ == "__main__":
    main()
