"""Where few-token steps stop paying for the GEMV path: measured on this machine, not a constant tuned on one CPU.

A step of a few tokens (decode at a small batch, verification of drafts) runs fastest through infer's C kernels: a
streaming GEMV over the packed weights and, on the ``fused-stack`` path, every layer in one call. A large step runs
fastest on the GEMM library torch uses (fbgemm's fp16 GEMM for fp16 and int8 weights, oneDNN's bf16 GEMM on AMX
or AVX512-BF16 for bf16 ones). Where the two cross depends on the CPU (its vector width, its matrix units, its
cache, its cores' share of memory bandwidth) and on the model's shapes, so
``execution.fused_max_tokens: auto`` measures it: decode steps of 1 to 128 sequences (a 64-token context each) through
the model on the fused path and with every matrix product on the GEMM, alternately, ``REPEATS`` times each, the
fastest kept (other processes on a shared machine can only make a pass slower, and alternating spreads them over
both). The first size where the fused path lost is measured a second time (``confirm_first_loss``: one slow
spell on a shared machine makes a size lose that wins on a second look). The threshold is the step size up to which
the fused path saves the most time over the measured sizes (``threshold``), so a near-tie at one size does not cap it
where the fused path wins above that size.

The result is cached per signature (the CPU's name and the vector flags that matter, torch's threads and version,
the model's shapes, weight packing and dtype, the kernels' build) under the cache dir,
``calibration/<signature>.json``; a config with ``execution.recalibrate: true`` measures again. ``infer run`` prints
what was chosen.

A second, smaller measurement, ``choose_gemm`` (``execution.large_gemm: auto``), decides how bf16 weights' steps
of more rows than the GEMV takes multiply: with bf16 arithmetic (infer's tile kernel on AMX tiles, or on AVX512-BF16
dot products up to ``TILE_MAX_ROWS`` rows and oneDNN's GEMM over the tiles unpacked beyond; inputs rounded to bf16)
or on the same tiles with float32 FMAs over the widened bf16 weights (float32 inputs): CPUs whose bf16 dot products
are slow (an Intel Xeon with AVX512-BF16 and no AMX) take the FMAs; figures in docs/performance.md. Cached the same
way, ``calibration/gemm-<signature>.json``.

A third, ``calibrate_rows``, asked for by a drafter that verifies trees (``eagle``'s ``tree_budget: auto``): how many
query rows of one sequence a step computes for about the time of one (within ``ROW_MARGIN``), at a context of
``ROW_CONTEXT`` tokens. The GEMV streams the weights once for several rows, so extra verification rows are nearly free
until its arithmetic catches up with the memory. Cached as ``calibration/rows-<signature>.json``.

A measurement taken while other processes loaded the machine is used for the run that made it and not cached
(``keep``): the next start measures again, and a warning on the ``infer.execution`` logger says why. Disturbed means a
step size whose median repeat took over ``DISTURBED_SPREAD`` times its fastest, or other processes busy on more cores
than infer's threads leave free (``disturbance``): a 1-token step measured at 150.7 ms on a loaded machine (15.8 ms
quiet) would otherwise have set the choice for every later run. A step size whose repeats spread so is timed once
more before that is judged (``retime_unsteady``): a cloud VM's slow spells pass in seconds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch

from infer.drafter import RowsCalibration

logger = logging.getLogger("infer.execution")

CANDIDATES = (1, 2, 4, 8, 16, 32, 64, 128)
CONTEXT_TOKENS = 64
REPEATS = 7
# The flags that change which path is faster (the C kernels are built with -march=native).
VECTOR_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "sve",
)
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
        cells = ", ".join(
            f"{tokens}: {fused:.1f} vs {gemm:.1f} ms" for tokens, (fused, gemm) in sorted(self.times_ms.items())
        )
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
    shapes = (
        model.num_layers,
        model.config.hidden_size,
        model.config.intermediate_size,
        model.num_heads,
        model.num_kv_heads,
        model.head_dim,
        model.vocab_size,
    )
    key = json.dumps(
        [name, flags, torch.get_num_threads(), torch.__version__, shapes, quantization, str(dtype), kernels]
    )
    return name, hashlib.sha256(key.encode()).hexdigest()[:16]


def calibration_path(digest: str) -> Path:
    return calibration_dir() / f"{digest}.json"


def calibration_dir() -> Path:
    from infer.host import cache_dir

    return cache_dir() / "calibration"


def threshold(times_ms: dict[int, tuple[float, float]]) -> int:
    """The step size up to which the fused path saves the most time, summed over the measured sizes up to it (GEMM
    minus fused, milliseconds); a tie goes to the larger size, and 0 where it saves nothing at any."""
    best, most, saved = 0, 0.0, 0.0
    for tokens in sorted(times_ms):
        fused, gemm = times_ms[tokens]
        saved += gemm - fused
        if saved > 0 and saved >= most:
            best, most = tokens, saved
    return best


def read_times(data: dict) -> dict[int, tuple[float, float]]:
    """A cached ``times_ms`` (JSON keys are strings) back as ints to pairs of floats."""
    return {int(size): (float(pair[0]), float(pair[1])) for size, pair in data["times_ms"].items()}


def read_cached(digest: str, build):
    """``build(data)`` of the cached file ``digest``, or None where there is none yet or it is unreadable (then
    measure again)."""
    try:
        return build(json.loads(calibration_path(digest).read_text()))
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None


def load_cached(digest: str) -> Calibration | None:
    return read_cached(
        digest,
        lambda data: Calibration(int(data["fused_max_tokens"]), data["cpu"], digest, read_times(data), cached=True),
    )


def announce(what: str) -> None:
    """One line on stderr before a measurement that a start makes once per machine and model (seconds to a minute),
    as the loader announces a conversion: a first start is not silent while it measures."""
    print(f"infer: measuring {what} on this CPU once (cached in {calibration_dir()})", file=sys.stderr)


def write_cached(digest: str, data: dict) -> None:
    """``data`` as the cached file ``digest``, replaced whole. A read-only cache dir costs the next start the
    measurement again, nothing else."""
    path = calibration_path(digest)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(data, indent=1, default=str))
        temporary.replace(path)
    except OSError as error:
        logger.warning("could not cache a measurement at %s: %s", path, error)


def save(calibration: Calibration | GemmChoice | RowsCalibration) -> None:
    data = asdict(calibration)
    data.pop("cached")
    write_cached(calibration.signature, data)


# A measurement is disturbed, used for the run that made it but not cached, where at some step size the median of
# its repeats took more than DISTURBED_SPREAD times the fastest, or where other processes kept more than
# DISTURBED_CORES cores busy beyond those infer's threads leave free. On the 2-core Xeon of docs/performance.md (the
# default model), quiet: the worst step size's median within 1.08-1.10x of its fastest in `measure`, 1.04-1.27x in
# `measure_rows` (passes of 10 ms), other processes on 0.0-0.35 cores; busy (other jobs on the machine): 1.9-148x,
# other processes on 1.3-1.7 cores. A median moves only when most repeats of a step were slowed, so one slow pass
# (the fastest is kept) does not count.
DISTURBED_SPREAD = 1.5
DISTURBED_CORES = 0.75
# Below this many seconds /proc/stat's 10 ms ticks say too little to judge other processes' load.
LOAD_MIN_SECONDS = 1.0


def clock() -> float:
    """Seconds on the clock that times the passes (``time.perf_counter``)."""
    return time.perf_counter()


def cpu_times() -> tuple[float, float] | None:
    """(seconds every core of the machine has run busy or been taken by the hypervisor for other guests, seconds this
    process has run on all its threads), from Linux's ``/proc/stat``; None elsewhere. The 1-minute load average is no
    measure of a few seconds' passes: it read 2.5 on a 2-core machine through a 3-second calibration in which other
    processes ran 0.0 cores, because the minute before had been busy."""
    try:
        ticks = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        per_second = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = ticks
    process = os.times()
    return (user + nice + system + irq + softirq + steal) / per_second, process.user + process.system


@dataclass(slots=True)
class Timer:
    """Times repeated passes and keeps every repeat's milliseconds per key (a step size and a path), so the fastest
    pass and the spread between repeats come from the same passes; and the machine's CPU time from its making, for
    the cores other processes kept busy meanwhile."""

    samples_ms: dict[object, list[float]] = field(default_factory=dict)
    started: tuple[float, tuple[float, float] | None] = field(default_factory=lambda: (clock(), cpu_times()))

    def time(self, key: object, run: Callable[[], object], keep: bool = True) -> None:
        """One pass of ``run``, its time kept under ``key`` (``keep`` false: a warm-up, not kept)."""
        began = clock()
        run()
        if keep:
            self.samples_ms.setdefault(key, []).append((clock() - began) * 1e3)

    def fastest(self, key: object) -> float:
        return min(self.samples_ms[key])

    def spreads(self) -> dict[object, float]:
        """Per key, its median repeat divided by its fastest."""
        return {key: statistics.median(times) / min(times) for key, times in self.samples_ms.items() if min(times) > 0}

    def spread(self) -> float:
        """The largest of ``spreads`` (1.0 where nothing was timed)."""
        return max(self.spreads().values(), default=1.0)

    def forget(self, keys: Iterable[object]) -> None:
        """Drop the repeats kept under ``keys``."""
        for key in keys:
            self.samples_ms.pop(key, None)

    def others_cores(self) -> float | None:
        """The cores other processes (and the hypervisor's other guests) kept busy on average since the timer was
        made; None without ``/proc/stat`` or under ``LOAD_MIN_SECONDS``."""
        began, before = self.started
        seconds, after = clock() - began, cpu_times()
        if before is None or after is None or seconds < LOAD_MIN_SECONDS:
            return None
        return max(0.0, (after[0] - before[0]) - (after[1] - before[1])) / seconds


def disturbance(timer: Timer, threads: int, cores: int | None = None) -> str:
    """Why ``timer``'s passes cannot stand for this machine ('' where nothing says so): a step size whose median
    repeat took over ``DISTURBED_SPREAD`` times its fastest, or other processes busy on more than ``DISTURBED_CORES``
    cores beyond the ``cores`` (the machine's) that infer's ``threads`` leave free."""
    reasons = []
    spread = timer.spread()
    if spread > DISTURBED_SPREAD:
        reasons.append(f"a step's median repeat took {spread:.2f}x its fastest, over {DISTURBED_SPREAD}x")
    others = timer.others_cores()
    free = max(0, (cores or os.cpu_count() or threads) - threads)
    if others is not None and others > free + DISTURBED_CORES:
        reasons.append(
            f"other processes kept {others:.2f} cores busy beside infer's {threads} threads ({free} cores free)"
        )
    return "; ".join(reasons)


def keep(calibration: Calibration | GemmChoice | RowsCalibration, timer: Timer, what: str) -> None:
    """Cache ``calibration`` unless ``timer`` says its passes were disturbed: then it serves this run only, the next
    start measures again, and one warning says why."""
    disturbed = disturbance(timer, torch.get_num_threads())
    if disturbed:
        logger.warning(
            "%s measured on a busy machine (%s): used for this run, not cached; infer measures again at the next start",
            what,
            disturbed,
        )
    else:
        save(calibration)


def calibrate(
    model, attention, executor, quantization: str, device: torch.device, dtype: torch.dtype, recalibrate: bool = False
) -> Calibration:
    """The cached calibration for this machine and model, or a new measurement (``recalibrate``: always)."""
    build = executor.kernels.path.name if executor.kernels is not None else ""
    build += ", float32 GEMMs" if executor.float_gemms else ""  # the torch path's large steps
    cpu, digest = signature(model, quantization, dtype, build)
    if not recalibrate:
        cached = load_cached(digest)
        if cached is not None:
            return cached
    announce("the execution paths' step times")
    began, timer = time.perf_counter(), Timer()
    times = measure(model, attention, executor, device, dtype, timer=timer)
    calibration = Calibration(threshold(times), cpu, digest, times)
    keep(calibration, timer, "the execution calibration")
    logger.info("execution calibration (%.1f s): %s", time.perf_counter() - began, calibration.describe())
    return calibration


def forward_pass(
    model,
    attention,
    executor,
    kv_cache: torch.Tensor,
    dtype: torch.dtype,
    input_ids: torch.Tensor,
    metadata,
    indices: torch.Tensor,
) -> None:
    """One timed pass as ``ModelRunner.forward`` makes it, over the scratch pool ``kv_cache``: the layers on the
    executor's path, then the logits of the rows at ``indices``."""
    step = executor.step(model.rotary, attention.prepare(metadata), kv_cache, attention, dtype)
    model.compute_logits(model(input_ids, step).index_select(0, indices))


@torch.inference_mode()
def measure(
    model,
    attention,
    executor,
    device: torch.device,
    dtype: torch.dtype,
    candidates: tuple[int, ...] = CANDIDATES,
    repeats: int = REPEATS,
    timer: Timer | None = None,
) -> dict[int, tuple[float, float]]:
    """Per step size: the fastest of ``repeats`` decode forward passes on the fused path and on the GEMM (ms), the
    first loss of the fused path confirmed (``confirm_first_loss``); every pass's time is kept in ``timer``."""
    from infer.attention import AttentionMetadata

    block_size = attention.block_size
    blocks_per_seq = -(-(CONTEXT_TOKENS + 1) // block_size)
    largest = max(candidates)
    scratch = attention.allocate_kv_cache(model.num_layers, 1 + largest * blocks_per_seq)
    tables = [list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)) for i in range(largest)]
    restore = executor.fused_max_tokens
    timer = Timer() if timer is None else timer

    def time_size(tokens: int) -> tuple[float, float]:
        metadata = AttentionMetadata.build(tables[:tokens], [CONTEXT_TOKENS] * tokens, [1] * tokens, block_size, device)
        input_ids = torch.zeros(tokens, dtype=torch.int64, device=device)
        indices = torch.arange(tokens, device=device)
        for repeat in range(repeats + 1):
            for limit in (tokens, 0):
                executor.set_fused_max_tokens(model, limit)
                run = partial(forward_pass, model, attention, executor, scratch, dtype, input_ids, metadata, indices)
                timer.time((tokens, limit), run, keep=repeat > 0)  # the first round warms up
        return timer.fastest((tokens, tokens)), timer.fastest((tokens, 0))

    try:
        times = confirm_first_loss({tokens: time_size(tokens) for tokens in candidates}, time_size)
        times = retime_unsteady(times, time_size, timer)
    finally:
        executor.set_fused_max_tokens(model, restore)
        executor.counts.clear()
    return times


def confirm_first_loss(
    times: dict[int, tuple[float, float]], time_size: Callable[[int], tuple[float, float]]
) -> dict[int, tuple[float, float]]:
    """``times`` with the first step size where the fused path lost measured again (``time_size``), each path's
    faster time kept, until a loss stands or none is left: a loss costs the threshold its savings, and a slow spell on a
    shared machine (other processes only ever slow a pass) can make one size lose that wins on a second look."""
    times = dict(times)
    for tokens in sorted(times):
        fused, gemm = times[tokens]
        if fused <= gemm:
            continue
        again = time_size(tokens)
        times[tokens] = (min(fused, again[0]), min(gemm, again[1]))
        if times[tokens][0] > times[tokens][1]:
            break
    return times


def retime_unsteady(
    times: dict[int, tuple[float, float]], time_size: Callable[[int], tuple[float, float]], timer: Timer
) -> dict[int, tuple[float, float]]:
    """``times`` with each step size whose repeats (``timer``'s keys ``(size, path)``) spread over
    ``DISTURBED_SPREAD`` timed once more: its first repeats are forgotten, so ``keep`` judges the second look, and
    each path keeps its faster time. On a quiet 2-core cloud VM (the Intel Xeon of docs/performance.md) a size's
    repeats ran a few passes in a row about 1.4x faster than the rest, both paths alike ([298, 282, 321, 317, 221,
    218, 218] ms, the Qwen3-0.6B shape's ``q4`` weights at 128 tokens), and four of six starts of the Qwen3 shapes
    on it spread 1.51-2.04x with no other process running. Each refusal costs the next start the whole calibration
    (46 s for the 1.7B shape's ``q4`` weights). A machine that stays busy spreads the second look too."""
    times = dict(times)
    unsteady = sorted({key[0] for key, spread in timer.spreads().items() if spread > DISTURBED_SPREAD})
    for tokens in unsteady:
        timer.forget([key for key in timer.samples_ms if key[0] == tokens])
        again = time_size(tokens)
        times[tokens] = (min(times[tokens][0], again[0]), min(times[tokens][1], again[1]))
    return times


# Rows ``choose_gemm`` times: a large decode step (against the bf16 tiles) and a prefill chunk (against oneDNN).
GEMM_ROWS = (64, 512)
# The FMAs must be at least this much faster at every size (a tie keeps the bf16 arithmetic the CPU was built for).
GEMM_MARGIN = 0.9


@dataclass(slots=True)
class GemmChoice:
    """How bf16 weights' large steps multiply, ``bf16`` or ``float32`` (the tiles' FMAs: ``PackedLinear``'s
    ``tile_fma``), and per rows the milliseconds it came from: bf16, float32 (none where configured or where the
    FMAs cannot run)."""

    name: str
    signature: str = ""
    times_ms: dict[int, tuple[float, float]] = field(default_factory=dict)
    cached: bool = False
    reason: str = "configured"

    def describe(self) -> str:
        if not self.times_ms:
            return f"large GEMMs {self.name} ({self.reason})"
        where = "cached" if self.cached else "measured now"
        cells = ", ".join(
            f"{rows} rows {bf16:.2f} vs {f32:.2f} ms" for rows, (bf16, f32) in sorted(self.times_ms.items())
        )
        return f"large GEMMs {self.name} ({where}; bf16 vs float32 {cells})"


def choose_gemm(setting: str, model, kernels, recalibrate: bool = False) -> GemmChoice:
    """``execution.large_gemm``: ``bf16`` or ``float32`` as configured, or for ``auto`` the cached measurement for
    this CPU and model shape, or a new one (``recalibrate``: always): float32 where it is faster than bf16 by
    ``GEMM_MARGIN`` at every size of ``GEMM_ROWS``. Without the tile kernel's FMAs (no AVX-512 build, or no tiles)
    only bf16 exists."""
    if not (kernels.tile_fma and kernels.tiles):
        if setting == "float32":
            raise ValueError(
                f"execution.large_gemm=float32 runs on infer's tile kernel with AVX-512 FMAs; these "
                f"kernels are a {kernels.simd} build (tiles: {kernels.tiles}); use auto or bf16"
            )
        return GemmChoice("bf16", reason="no float32 tile kernel in this build")
    if setting != "auto":
        return GemmChoice(setting)
    from infer.kernels.cpu import can_pack_tiles

    shape = (model.config.hidden_size, model.config.intermediate_size)
    if not can_pack_tiles(2 * shape[1], shape[0]):
        return GemmChoice("bf16", reason="the model's shapes do not fit the tiles")
    name, flags = cpu_description()
    key = json.dumps(["gemm", name, flags, torch.get_num_threads(), torch.__version__, shape, kernels.path.name])
    digest = "gemm-" + hashlib.sha256(key.encode()).hexdigest()[:16]
    cached = (
        None
        if recalibrate
        else read_cached(digest, lambda data: GemmChoice(str(data["name"]), digest, read_times(data), cached=True))
    )
    if cached is not None:
        return cached
    announce("the large GEMMs' arithmetic")
    timer = Timer()
    times = measure_gemm(*shape, kernels, timer=timer)
    faster = all(f32 < bf16 * GEMM_MARGIN for bf16, f32 in times.values())
    choice = GemmChoice("float32" if faster else "bf16", digest, times, reason="measured")
    keep(choice, timer, "the GEMM calibration")
    logger.info("GEMM calibration: %s", choice.describe())
    return choice


@torch.inference_mode()
def measure_gemm(
    hidden: int,
    intermediate: int,
    kernels,
    rows: tuple[int, ...] = GEMM_ROWS,
    repeats: int = REPEATS,
    timer: Timer | None = None,
) -> dict[int, tuple[float, float]]:
    """Per row count, the fastest of ``repeats`` gate/up projections (the model's largest; random weights, rounded
    to bf16 and packed for the tiles) with bf16 arithmetic as a ``PackedLinear`` runs it there (the tiles with float32
    rows up to ``TILE_MAX_ROWS`` and on AMX, oneDNN's GEMM with bf16 rows beyond over the tiles unpacked for the call)
    and on the tiles' float32 FMAs, alternately (ms); every pass's time is kept in ``timer``."""
    from infer.kernels.cpu import pack_tiles
    from infer.model.quantization import TILE_MAX_ROWS, bf16_linear, dense_buffer

    weight = (torch.randn(2 * intermediate, hidden) * 0.02).bfloat16()
    tiles = pack_tiles(weight)
    timer = Timer() if timer is None else timer
    times = {}
    for count in rows:
        x = torch.randn(count, hidden)
        x_bf16 = x.bfloat16()
        bf16 = (
            (lambda: kernels.linear_tiles(x, tiles, None))
            if count <= TILE_MAX_ROWS or kernels.amx
            else (lambda: bf16_linear(x_bf16, kernels.unpack_tiles(tiles, dense_buffer(weight.numel()))))
        )
        candidates = {"bf16": bf16, "float32": lambda: kernels.linear_tiles(x, tiles, None, fma=True)}
        for repeat in range(repeats + 1):
            for name, run in candidates.items():
                timer.time((count, name), run, keep=repeat > 0)  # the first round warms up
        times[count] = (timer.fastest((count, "bf16")), timer.fastest((count, "float32")))
    return times


# ``calibrate_rows``: the query rows of one sequence it times (a decode step, and verifications of drafts), over a
# context of ``ROW_CONTEXT`` tokens.
ROW_CANDIDATES = (1, 2, 3, 4, 5, 6, 7, 8)
ROW_CONTEXT = 128
# A step of more rows is "about one decode step" while it costs at most this many times one row's.
ROW_MARGIN = 1.05
# Passes per row count, the fastest kept: the counts' differences are a few percent, so one count's quiet spell
# must not stand alone (on the Zen 4 EPYC 7 passes once had one row at 7.66 ms and three at 8.07, 1.05x: two free
# rows; three calibrations after it had one row at 8.88-9.34 and four at 1.00-1.03x of it: four).
ROW_REPEATS = 2 * REPEATS


def free_rows(times_ms: dict[int, float], margin: float = ROW_MARGIN) -> int:
    """The most rows up to which every measured step cost at most ``margin`` times the one-row step."""
    best = 1
    for rows in sorted(times_ms):
        if times_ms[rows] > margin * times_ms[1]:
            break
        best = rows
    return best


def calibrate_rows(
    model, attention, executor, quantization: str, device: torch.device, dtype: torch.dtype, recalibrate: bool = False
) -> RowsCalibration:
    """The cached ``RowsCalibration`` for this machine and model, or a new measurement (``recalibrate``: always)."""
    build = executor.kernels.path.name if executor.kernels is not None else ""
    _, digest = signature(
        model,
        quantization,
        dtype,
        f"rows, {build}, {type(attention).__name__}, fused up to {executor.fused_max_tokens}",
    )
    digest = "rows-" + digest
    if not recalibrate:
        cached = read_cached(
            digest,
            lambda data: RowsCalibration(
                int(data["free_rows"]), digest, {int(rows): float(ms) for rows, ms in data["times_ms"].items()}, True
            ),
        )
        if cached is not None:
            return cached
    announce("the verification rows a draft tree takes")
    began, timer = time.perf_counter(), Timer()
    times = measure_rows(model, attention, executor, device, dtype, timer=timer)
    calibration = RowsCalibration(free_rows(times), digest, times)
    keep(calibration, timer, "the verification rows calibration")
    logger.info("verification rows calibration (%.1f s): %s", time.perf_counter() - began, calibration.describe())
    return calibration


@torch.inference_mode()
def measure_rows(
    model,
    attention,
    executor,
    device: torch.device,
    dtype: torch.dtype,
    candidates: tuple[int, ...] = ROW_CANDIDATES,
    repeats: int = ROW_REPEATS,
    timer: Timer | None = None,
) -> dict[int, float]:
    """Per row count, the fastest of ``repeats`` forward passes (the layers on the executor's own path, then the
    logits of every row) of one sequence computing that many tokens after ``ROW_CONTEXT`` cached ones, the counts
    alternating (ms); every pass's time is kept in ``timer``."""
    from infer.attention import AttentionMetadata

    block_size = attention.block_size
    blocks = -(-(ROW_CONTEXT + max(candidates)) // block_size)
    scratch = attention.allocate_kv_cache(model.num_layers, 1 + blocks)
    table = list(range(1, 1 + blocks))
    steps = {
        rows: (
            AttentionMetadata.build([table], [ROW_CONTEXT], [rows], block_size, device),
            torch.zeros(rows, dtype=torch.int64, device=device),
            torch.arange(rows, device=device),
        )
        for rows in candidates
    }
    timer = Timer() if timer is None else timer
    try:
        for repeat in range(repeats + 1):
            for rows, (metadata, input_ids, indices) in steps.items():
                run = partial(forward_pass, model, attention, executor, scratch, dtype, input_ids, metadata, indices)
                timer.time(rows, run, keep=repeat > 0)  # the first round warms up
    finally:
        executor.counts.clear()
    return {rows: timer.fastest(rows) for rows in candidates}
