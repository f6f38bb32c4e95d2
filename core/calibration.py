"""Where few-token steps stop paying for the GEMV path: measured on this machine, not a constant tuned on one CPU.

A step of a few tokens (decode at a small batch, verification of drafts) runs fastest through infer's C kernels: a
streaming GEMV over the packed weights and, on the ``fused-stack`` path, every layer in one call. A large step runs
fastest on the GEMM library torch uses (fbgemm's fp16 GEMM for fp16 and int8 weights, oneDNN's bf16 GEMM on AMX
or AVX512-BF16 for bf16 ones). Where the two cross depends on the CPU (its vector width, its matrix units, its
cache, its cores' share of memory bandwidth) and on the model's shapes, so
``execution.fused_max_tokens: auto`` measures it: decode steps of 1 to 128 sequences (a 64-token context each) through
the model on the fused path and with every matrix product on the GEMM, alternately, ``REPEATS`` times each, the
fastest kept (other processes on a shared machine can only make a pass slower, and alternating spreads them over
both). The threshold is the largest step size up to which the fused path was never slower.

The result is cached per signature (the CPU's name and the vector flags that matter, torch's threads and version,
the model's shapes, weight packing and dtype, the kernels' build) under the cache dir,
``calibration/<signature>.json``; a config with ``execution.recalibrate: true`` measures again. ``infer run`` prints
what was chosen.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

logger = logging.getLogger("infer.execution")

CANDIDATES = (1, 2, 4, 8, 16, 32, 64, 128)
CONTEXT_TOKENS = 64
REPEATS = 7
# The flags that change which path is faster (the C kernels are built with -march=native).
VECTOR_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                "amx_bf16", "amx_int8", "asimd", "sve")
# Used where no calibration applies (no kernels, a sharded model) and in the docs' examples.
DEFAULT_FUSED_MAX_TOKENS = 8


@dataclass(slots=True)
class Calibration:
    """The measured threshold and what it came from: per step size, milliseconds fused and on the GEMM."""

    fused_max_tokens: int
    cpu: str
    signature: str
    times_ms: dict[int, tuple[float, float]] = field(default_factory=dict)
    cached: bool = False

    def describe(self) -> str:
        where = "cached calibration" if self.cached else "calibrated now"
        if not self.times_ms:
            return f"fused up to {self.fused_max_tokens} tokens ({where})"
        cells = ", ".join(f"{tokens}: {fused:.1f} vs {gemm:.1f} ms" for tokens, (fused, gemm) in
                          sorted(self.times_ms.items()))
        return f"fused up to {self.fused_max_tokens} tokens ({where} on {self.cpu}; fused vs GEMM {cells})"


def cpu_description() -> tuple[str, tuple[str, ...]]:
    """The CPU's model name and which of ``VECTOR_FLAGS`` it has."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and value.strip():
                name = value.strip()
            elif key in ("flags", "Features"):
                flags = set(value.split())
    except OSError:
        pass
    return name, tuple(flag for flag in VECTOR_FLAGS if flag in flags)


def signature(model, quantization: str, dtype: torch.dtype, kernels: str = "") -> tuple[str, str]:
    """(the CPU's name, a short hash of everything the threshold depends on). ``kernels`` names the kernels' build
    (its file, named by the source's and flags' hash): new kernels measure again."""
    name, flags = cpu_description()
    shapes = (model.num_layers, model.config.hidden_size, model.config.intermediate_size, model.num_heads,
              model.num_kv_heads, model.head_dim, model.vocab_size)
    key = json.dumps([name, flags, torch.get_num_threads(), torch.__version__, shapes, quantization, str(dtype),
                      kernels])
    return name, hashlib.sha256(key.encode()).hexdigest()[:16]


def calibration_path(digest: str) -> Path:
    from infer.host import cache_dir

    return cache_dir() / "calibration" / f"{digest}.json"


def threshold(times_ms: dict[int, tuple[float, float]]) -> int:
    """The largest step size up to which the fused path was never slower than the GEMM (0: not even at 1)."""
    best = 0
    for tokens in sorted(times_ms):
        fused, gemm = times_ms[tokens]
        if fused > gemm:
            break
        best = tokens
    return best


def load_cached(digest: str) -> Calibration | None:
    path = calibration_path(digest)
    try:
        data = json.loads(path.read_text())
        times = {int(tokens): (float(pair[0]), float(pair[1])) for tokens, pair in data["times_ms"].items()}
        return Calibration(int(data["fused_max_tokens"]), data["cpu"], digest, times, cached=True)
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None  # none yet, or unreadable: measure again


def save(calibration: Calibration) -> None:
    path = calibration_path(calibration.signature)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = asdict(calibration)
        data.pop("cached")
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(data, indent=1))
        temporary.replace(path)
    except OSError as error:  # a read-only cache dir costs the next start a calibration, nothing else
        logger.warning("could not cache the execution calibration at %s: %s", path, error)


def calibrate(model, attention, executor, quantization: str, device: torch.device, dtype: torch.dtype,
              recalibrate: bool = False) -> Calibration:
    """The cached calibration for this machine and model, or a new measurement (``recalibrate``: always)."""
    build = executor.kernels.path.name if executor.kernels is not None else ""
    cpu, digest = signature(model, quantization, dtype, build)
    if not recalibrate:
        cached = load_cached(digest)
        if cached is not None:
            return cached
    began = time.perf_counter()
    times = measure(model, attention, executor, device, dtype)
    calibration = Calibration(threshold(times), cpu, digest, times)
    save(calibration)
    logger.info("execution calibration (%.1f s): %s", time.perf_counter() - began, calibration.describe())
    return calibration


@torch.inference_mode()
def measure(model, attention, executor, device: torch.device, dtype: torch.dtype,
            candidates: tuple[int, ...] = CANDIDATES, repeats: int = REPEATS) -> dict[int, tuple[float, float]]:
    """Per step size: the fastest of ``repeats`` decode forward passes on the fused path and on the GEMM (ms)."""
    from infer.attention import AttentionMetadata

    block_size = attention.block_size
    blocks_per_seq = -(-(CONTEXT_TOKENS + 1) // block_size)
    largest = max(candidates)
    scratch = attention.allocate_kv_cache(model.num_layers, 1 + largest * blocks_per_seq)

    def forward(input_ids: torch.Tensor, metadata: AttentionMetadata, indices: torch.Tensor) -> None:
        """One pass as ``ModelRunner.forward`` makes it: the layers, then the logits of every row."""
        step = executor.step(model.rotary, attention.prepare(metadata), scratch, attention, dtype)
        model.compute_logits(model(input_ids, step).index_select(0, indices))

    tables = [list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)) for i in range(largest)]
    restore = executor.fused_max_tokens
    times: dict[int, tuple[float, float]] = {}
    try:
        for tokens in candidates:
            metadata = AttentionMetadata.build(tables[:tokens], [CONTEXT_TOKENS] * tokens, [1] * tokens, block_size,
                                               device)
            input_ids = torch.zeros(tokens, dtype=torch.int64, device=device)
            indices = torch.arange(tokens, device=device)
            best = {tokens: float("inf"), 0: float("inf")}
            for repeat in range(repeats + 1):
                for limit in (tokens, 0):
                    executor.set_fused_max_tokens(model, limit)
                    began = time.perf_counter()
                    forward(input_ids, metadata, indices)
                    if repeat:  # the first round warms up
                        best[limit] = min(best[limit], (time.perf_counter() - began) * 1e3)
            times[tokens] = (best[tokens], best[0])
    finally:
        executor.set_fused_max_tokens(model, restore)
        executor.counts.clear()
    return times
