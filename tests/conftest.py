"""Shared fixtures: every engine a test creates must be idle with all blocks accounted for when the test ends; the C
kernels built for this CPU and for another instruction set."""

from __future__ import annotations

import os
import shutil

import pytest

# Triton reads TRITON_INTERPRET once, at import: set it before any test imports triton, so that on a machine without
# CUDA the `triton` backend runs in the CPU interpreter everywhere in the session (kernel tests, conformance sweep).
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def engines_end_idle(monkeypatch):
    """Record every Engine built during the test; afterwards each must hold no block outside the prefix cache."""
    try:
        from infer.engine.engine import Engine
    except ImportError:  # pragma: no cover - engine not importable: nothing to check
        yield
        return
    created = []
    original_init = Engine.__init__

    def recording_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        created.append(self)

    monkeypatch.setattr(Engine, "__init__", recording_init)
    yield created
    for engine in created:
        if not engine.has_unfinished():
            engine.check_idle()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama (2 layers, hidden 64) with SmolLM2's tokenizer, saved as an HF folder."""
    from infer.testing.models import make_tiny_model_dir

    return str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"), seed=0))


@pytest.fixture(scope="session")
def bf16_valued_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with every weight matrix rounded to bf16 values (kept as float32), as a bf16 checkpoint's
    matrices are."""
    import shutil

    from safetensors.torch import load_file, save_file

    destination = tmp_path_factory.mktemp("tiny-bf16-valued")
    shutil.copytree(tiny_model_dir, destination, dirs_exist_ok=True)
    for path in destination.glob("*.safetensors"):
        tensors = load_file(path)
        save_file({name: t.bfloat16().float() if t.dim() == 2 else t for name, t in tensors.items()}, path)
    return str(destination)


@pytest.fixture(scope="session")
def kernels():
    """infer's C kernels built for this CPU, or a skip where they do not build (a module may define its own)."""
    from infer.kernels import cpu as cpu_kernels

    try:
        return cpu_kernels.load(True)
    except cpu_kernels.KernelBuildError as error:
        pytest.skip(f"the CPU kernels do not build here: {error}")


# The kernels' other instruction sets below this CPU's: the CPU flags a build of each needs, and the compiler flags
# that build it on a CPU with more.
OTHER_SIMD_BUILDS = {"avx2": ({"avx2", "fma", "f16c"}, ["-mno-avx512f"]), "portable": (set(), ["-mno-avx"])}


@pytest.fixture(scope="session")
def kernel_build(tmp_path_factory):
    """``kernel_build(flags)``: infer's C kernels built with these extra compiler flags (``-mno-...``, so their order
    does not matter) and loaded, once a session for each set: a build compiles the whole library, and the tests of one
    instruction set in every module share it. Raises ``KernelBuildError`` where they do not build."""
    from infer.kernels import cpu as cpu_kernels

    built = {}

    def build(flags: list[str]):
        key = tuple(sorted(flags))
        if key not in built:
            built[key] = cpu_kernels.load_built(cpu_kernels.build(tmp_path_factory.mktemp("kernels"), list(key)))
        return built[key]

    return build


def _other_simd_kernels(kernel_build, name: str):
    """The kernels built as ``name`` (``OTHER_SIMD_BUILDS``) through ``kernel_build``, or a skip naming the missing
    CPU flags or the build error."""
    from infer.host import cpu_flags
    from infer.kernels import cpu as cpu_kernels

    needed, flags = OTHER_SIMD_BUILDS[name]
    if needed - cpu_flags():
        pytest.skip(f"this CPU lacks {', '.join(sorted(needed - cpu_flags()))} for the {name} kernels")
    if "amx_tile" in cpu_flags():
        flags = [*flags, "-mno-amx-tile"]  # AMX is not tied to AVX: keep the build to the set named
    try:
        built = kernel_build(flags)
    except cpu_kernels.KernelBuildError as error:
        pytest.skip(f"infer's C kernels do not build here: {error}")
    assert built.simd == name
    return built


@pytest.fixture
def simd_build(kernel_build):
    """``simd_build(name)``: infer's C kernels built as ``avx2`` or ``portable`` (AVX-512, or all AVX, and AMX turned
    off), loaded; the test is skipped where this CPU lacks the instructions or the kernels do not build."""
    return lambda name: _other_simd_kernels(kernel_build, name)


@pytest.fixture(scope="session")
def portable_kernels(kernel_build):
    """The portable build (plain C throughout: all AVX and AMX off), the reference each SIMD build is held to."""
    built = _other_simd_kernels(kernel_build, "portable")
    assert not built.amx and built.block_gemm_designs == ("portable",)
    return built
