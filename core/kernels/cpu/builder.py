"""Building infer's CPU kernels (the C files of ``csrc/``) once per machine and loading them.

They are C: one file per operation (``gemv.c``, ``paged_attention.c``, ...), the vector helpers of each instruction
set in ``isa_*.h``, and the library's interface, every struct and function ``abi`` binds, in ``cpu_kernels.h``.
The system's C compiler (``gcc -O3 -march=native -fopenmp``) builds all of them into one library in the cache
directory, one compiler process per file on each core the process may use, then one link; the library is keyed by
every source and header, the flags, the compiler and the CPU. It is called through ctypes, and OpenMP there is
torch's own runtime, so both share one thread pool.

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
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path

from infer.host import cache_dir, cpu_signature
from infer.kernels.cpu.abi import CpuKernels

logger = logging.getLogger("infer.kernels.cpu")

FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


class KernelBuildError(RuntimeError):
    """The C kernels could not be compiled or loaded here; the message says why."""


def sources() -> dict[str, str]:
    """Every C source and header of the kernels, by file name (sorted): what one build compiles and its key covers."""
    folder = resources.files("infer.kernels.cpu").joinpath("csrc")
    return {
        entry.name: entry.read_text()
        for entry in sorted(folder.iterdir(), key=lambda entry: entry.name)
        if entry.name.endswith((".c", ".h"))
    }


def source() -> str:
    """The kernels' sources as one text, each file after a ``/* ==== name ==== */`` line."""
    return "".join(f"/* ==== {name} ==== */\n{text}" for name, text in sources().items())


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
    files = sources()
    flags = [*FLAGS, *extra_flags]
    digest = hashlib.sha256()
    for name, text in files.items():  # each file's name and length too: no two sets of files hash alike
        digest.update(f"{name}\0{len(text)}\0{text}\0".encode())
    digest.update("\n".join([*flags, cc, cpu_signature()]).encode())
    target = directory / f"cpu_kernels-{digest.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    print(f"infer: building the C kernels for this CPU once (about 10 s): {target}", file=sys.stderr)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory) as staging:
            for name, text in files.items():  # the headers beside the .c files, which include them by name
                (Path(staging) / name).write_text(text)
            # the largest files first, so that the last to finish is a short one
            units = sorted((name for name in files if name.endswith(".c")), key=lambda name: -len(files[name]))
            objects = [str(Path(staging) / f"{name}.o") for name in units]
            compiles = [[cc, *flags, "-c", str(Path(staging) / name), "-o", obj] for name, obj in zip(units, objects)]
            built = Path(staging) / target.name
            with ThreadPoolExecutor(max_workers=len(os.sched_getaffinity(0))) as pool:
                results = list(pool.map(_run, compiles))
            if all(result.returncode == 0 for result in results):
                results = [_run([cc, *flags, "-o", str(built), *objects, "-lm"])]  # the link
            failed = [result.stderr.strip() for result in results if result.returncode != 0]
            if failed:
                raise KernelBuildError(f"{cc} failed to compile the CPU kernels:\n" + "\n".join(failed))
            os.replace(built, target)  # atomic: concurrent builders each publish a complete file
    except OSError as error:  # a cache folder that cannot be written, a compiler that cannot run
        raise KernelBuildError(f"could not build the CPU kernels in {directory}: {error}") from error
    return target


def _run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True)


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
