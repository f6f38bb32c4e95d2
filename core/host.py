"""What this host is (its CPU's feature flags), where infer keeps files on it (the cache directory), and how it
maps large memory (the KV pool, the weights the kernels stream) on huge pages.

Imports nothing of infer's: the loader, the CPU kernels' build and the execution layer all ask it.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# glibc's mallopt parameters (malloc.h) and the values ``reuse_freed_memory`` sets
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
HEAP_MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts on 64-bit
HEAP_TRIM_THRESHOLD = 1 << 30


def cache_dir() -> Path:
    """Where fetched and converted models and built kernels live: ``$INFER_CACHE_DIR``, else the user cache dir
    (``~/.cache/infer``)."""
    override = os.environ.get("INFER_CACHE_DIR")
    if override:
        return Path(override).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("infer"))


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (x86 ``/proc/cpuinfo`` "flags", aarch64 "Features"); empty where unreadable."""
    line = _cpu_flags_line()
    return frozenset(line.partition(":")[2].split())


def cpu_signature() -> str:
    """What code compiled with ``-march=native`` depends on: the machine and its CPU flags (a cached build must not
    move between CPUs)."""
    return f"{platform.machine()} {_cpu_flags_line()}"


@functools.cache
def _cpu_flags_line() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


@functools.cache
def reuse_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for the next allocations instead of handing it back to the kernel:
    blocks under ``HEAP_MMAP_THRESHOLD`` (32 MiB) come from the heap rather than from a fresh ``mmap`` each, and up
    to ``HEAP_TRIM_THRESHOLD`` (1 GiB) of free memory at the heap's top stays mapped. By default glibc maps large
    blocks afresh and returns them on free, so every step's activations of a few MiB (a prefill chunk's) are
    faulted in page by page again: ~99,000 page faults in a 4 x 512-token prefill step, about a fifth of its time.
    Process-wide and once; True where applied (glibc on Linux), False elsewhere (another libc, or none found)."""
    if platform.system() != "Linux":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; musl's stub returns 0
    return bool(mallopt(_M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, HEAP_TRIM_THRESHOLD)
    )


def available_memory() -> int | None:
    """Bytes the kernel reckons it can give without swapping (``MemAvailable``: free memory and the page cache it
    can take back), or None where /proc/meminfo does not say."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def trim_heap() -> None:
    """Hand the free pages inside glibc's heap back to the kernel (``malloc_trim``); nothing under another libc. A
    load frees each layer's unpacked weights as soon as it packs the layer, and the holes they leave between the
    packed copies stay mapped otherwise: 0.46 GiB of the Qwen3-8B shape's start with ``q4`` weights."""
    if platform.system() != "Linux":
        return
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


HUGE_PAGE = 2 << 20  # a transparent huge page on x86-64 and most aarch64 kernels


def zeroed_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor of ``shape`` over its own anonymous memory mapping, whose pages the kernel zeroes as they
    are first written: nothing is written at allocation (``torch.zeros`` of a 10 GiB KV pool writes all of it, about
    3 s), and a pool's pages become resident as its blocks are first used. The mapping is advised for transparent
    huge pages where the kernel offers them on request (``/sys/kernel/mm/transparent_hugepage/enabled``: madvise),
    and a tensor of at least a huge page starts on a huge page's boundary (the mapping one huge page longer, its
    head never touched), so a first write faults in 2 MiB at once and the tensor's every whole 2 MiB is one TLB
    entry. It is unmapped when the tensor and its views are gone."""
    import mmap

    import torch

    count = math.prod(shape)
    if count == 0 or not hasattr(mmap, "MAP_ANONYMOUS"):  # (a platform without anonymous mappings: plain zeros)
        return torch.zeros(shape, dtype=dtype)
    nbytes = count * dtype.itemsize
    slack = HUGE_PAGE if nbytes >= HUGE_PAGE else 0
    mapping = mmap.mmap(-1, nbytes + slack, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    offset = -ctypes.addressof(ctypes.c_char.from_buffer(mapping)) % HUGE_PAGE if slack else 0
    return torch.frombuffer(mapping, dtype=dtype, count=count, offset=offset).view(shape)


def streamed_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor for weights that the kernels read whole at every step (packed projections, an
    output head's copies): from ``zeroed_pages`` when it spans a huge page, so the stream crosses a 2 MiB page where
    it would cross 512 of 4 KiB, each a TLB miss and, in a virtual machine, a two-level page walk; smaller ones from
    torch's allocator. On 2 cores of an Intel Xeon with AMX under a hypervisor the bf16 GEMV over Qwen3-0.6B's qkv
    projection read 22.7 GB/s of 4 KiB pages and 28.7 GB/s of huge pages (docs/performance.md)."""
    import torch

    if math.prod(shape) * dtype.itemsize < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype)
    return zeroed_pages(shape, dtype)


def cores_per_process(num_processes: int) -> int:
    """This process's cores shared evenly among ``num_processes`` processes (at least one each)."""
    return max(1, len(os.sched_getaffinity(0)) // num_processes)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (a replica's, a test's rank 0's; another process may still take it)."""
    import socket

    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]
