"""Measuring a function's peak memory on the device it runs on (for sizing the KV pool)."""

from __future__ import annotations

import gc
import hashlib
import json
from collections.abc import Callable

import torch

from infer.execution.calibration import announce, read_cached, write_cached


def _rss_field(name: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(name):
                return int(line.split()[1]) * 1024
    return 0


def measure_peak_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Peak memory ``fn`` adds above what was in use before it ran.

    CUDA: the allocator's peak counter. CPU (Linux): the process's peak resident set (``VmHWM``), reset first through
    ``/proc/self/clear_refs``; where that is unavailable, 0 is returned and the budget leaves no activation headroom.
    """
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return max(torch.cuda.max_memory_allocated(device) - before, 0)
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        before = _rss_field("VmRSS:")
    except OSError:
        fn()
        return 0
    fn()
    return max(_rss_field("VmHWM:") - before, 0)


def cached_peak_bytes(key: list, measure: Callable[[], int], remeasure: bool = False) -> int:
    """``measure()``, kept under a hash of ``key`` (JSON; everything the peak depends on) in the calibration folder
    (``infer.execution.calibration``), so a later start with the same key reads it instead of running the step again
    (``remeasure``: always run it)."""
    digest = "peak-" + hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    cached = None if remeasure else read_cached(digest, lambda data: int(data["peak_bytes"]))
    if cached is not None:
        return cached
    announce("the peak memory of a worst-case step")
    peak = measure()
    write_cached(digest, {"key": key, "peak_bytes": peak})
    return peak
