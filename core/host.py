"""What this host is (its CPU's feature flags) and where infer keeps files on it (the cache directory).

Imports nothing of infer's: the loader, the CPU kernels' build and the execution layer all ask it.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path


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


def cores_per_process(num_processes: int) -> int:
    """This process's cores shared evenly among ``num_processes`` processes (at least one each)."""
    return max(1, len(os.sched_getaffinity(0)) // num_processes)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (a replica's, a test's rank 0's; another process may still take it)."""
    import socket

    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]
