"""Building infer's CPU kernels (``csrc/cpu_kernels.c``) once per machine and loading them.

They are C, compiled with the system's C compiler (``gcc -O3 -march=native -fopenmp``) into the cache directory,
keyed by source, flags, compiler and CPU, and called through ctypes; OpenMP there is torch's own runtime, so both
share one thread pool.

``load(mode)`` gives the kernels or None: ``False`` never builds; ``"auto"`` builds when a compiler is found and
otherwise warns once (callers then run torch's ops); ``True`` raises when they cannot be built. (Booleans, not
on/off strings: YAML and OmegaConf read ``on``/``off`` as booleans.) The build is cached for the process: every
caller (the model, the ``cpu`` attention backend, drafters) gets the same object.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from importlib import resources
from collections.abc import Sequence
from pathlib import Path

from infer.kernels.cpu.abi import CpuKernels
from infer.host import cache_dir, cpu_signature

logger = logging.getLogger("infer.kernels.cpu")

FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


class KernelBuildError(RuntimeError):
    """The C kernels could not be compiled or loaded here; the message says why."""


def source() -> str:
    return resources.files("infer.kernels.cpu").joinpath("csrc", "cpu_kernels.c").read_text()


def compiler() -> str | None:
    """The C compiler to use: ``$CC``, else ``cc`` or ``gcc`` on the PATH."""
    candidates = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc"]
    for candidate in candidates:
        found = shutil.which(candidate)
        if found:
            return found
    return None


def build(directory: Path, extra_flags: Sequence[str] = ()) -> Path:
    """Compile the kernels into ``directory`` (once per source, flags and CPU) and return the library's path.
    ``extra_flags`` follow ``FLAGS``: ``["-mno-avx512f"]`` builds the AVX2 code on an AVX-512 CPU, ``["-mno-avx"]``
    the portable C (the tests compare them)."""
    cc = compiler()
    if cc is None:
        raise KernelBuildError("no C compiler found (set $CC, or install gcc)")
    text = source()
    flags = [*FLAGS, *extra_flags]
    key = hashlib.sha256("\n".join([text, *flags, cc, cpu_signature()]).encode()).hexdigest()[:16]
    target = directory / f"cpu_kernels-{key}.so"
    if target.is_file():
        return target
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory) as staging:
            source_path = Path(staging) / "cpu_kernels.c"
            source_path.write_text(text)
            built = Path(staging) / target.name
            result = subprocess.run([cc, *flags, "-o", str(built), str(source_path), "-lm"], capture_output=True,
                                    text=True)
            if result.returncode != 0:
                raise KernelBuildError(f"{cc} failed to compile the CPU kernels:\n{result.stderr.strip()}")
            os.replace(built, target)  # atomic: concurrent builders each publish a complete file
    except OSError as error:  # a cache folder that cannot be written, a compiler that cannot run
        raise KernelBuildError(f"could not build the CPU kernels in {directory}: {error}") from error
    return target


@functools.cache
def _load() -> CpuKernels:
    return load_built(build(cache_dir() / "kernels"))


def load_built(path: Path) -> CpuKernels:
    """The kernels in a library ``build`` made."""
    try:
        return CpuKernels(ctypes.CDLL(str(path)), path)
    except (OSError, AttributeError) as error:
        raise KernelBuildError(f"could not load the CPU kernels from {path}: {error}") from error


def load(mode: str | bool = "auto") -> CpuKernels | None:
    """The kernels for ``mode`` (``"auto"``, True, False); None when False, or when ``"auto"`` and they cannot be
    built here (warned once)."""
    if mode not in ("auto", True, False):
        raise ValueError(f"unknown CPU kernels mode {mode!r}; choose auto, true or false")
    if mode is False:
        return None
    try:
        return _load()
    except KernelBuildError as error:
        if mode is True:
            raise
        _warn_unavailable(str(error))
        return None


@functools.cache
def _warn_unavailable(reason: str) -> None:
    logger.warning("CPU kernels unavailable, using torch ops (slower): %s", reason)
