"""The execution layer chooses each forward pass's path in one place, says why, and is the only place that does; the
core's modules import each other without a circle; ``sdpa`` is pure torch."""

from __future__ import annotations

import ast
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from infer import LLM, SamplingParams, hookimpl
from infer.attention import AttentionBackend, AttentionEnvironment
from infer.execution.paths import Executor, choose_attention
from infer.kernels import cpu as cpu_kernels
from infer.model.loader import load_model
from infer.model.quantization import PackedLinear, quantize_model
from infer.registry import get_registry

CORE = Path(__file__).resolve().parents[1] / "core"
PLUGINS = Path(__file__).resolve().parents[1] / "plugins"
HAS_COMPILER = cpu_kernels.compiler() is not None
needs_kernels = pytest.mark.skipif(not HAS_COMPILER, reason="the CPU kernels need a C compiler")
needs_fbgemm = pytest.mark.skipif(
    "fbgemm" not in torch.backends.quantized.supported_engines, reason="packed fp16 weights need fbgemm (x86)"
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(CORE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["infer", *parts])


def _imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The core modules ``path`` imports at run time, at module level or inside functions (``if TYPE_CHECKING:``
    blocks excluded: they never run)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            test = node.test
            if getattr(test, "id", None) == "TYPE_CHECKING" or getattr(test, "attr", None) == "TYPE_CHECKING":
                for child in node.orelse:
                    self.visit(child)
                return
            self.generic_visit(node)

        def visit_Import(self, node: ast.Import) -> None:
            found.update(alias.name for alias in node.names)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)

    Visitor().visit(ast.parse(path.read_text()))
    resolved = set()
    for module in found:
        while module and module not in modules:
            module = module.rpartition(".")[0]
        if module and module not in (name, "infer"):
            resolved.add(module)
    return resolved


def core_import_graph() -> dict[str, set[str]]:
    paths = {_module_name(path): path for path in CORE.rglob("*.py")}
    modules = set(paths)
    return {name: _imported_modules(path, modules) for name, path in paths.items()}


def test_the_model_and_the_kernels_know_nothing_of_the_execution_layer_or_the_loader():
    graph = core_import_graph()
    for module in ("infer.model.decoder", "infer.model.ops", "infer.kernels.cpu.fused", "infer.kernels.cpu.builder"):
        assert not graph[module] & {"infer.execution.paths", "infer.model.loader", "infer.engine.engine"}, module
    assert "infer.kernels.cpu" not in graph["infer.attention"]


def test_sdpa_has_no_reference_to_the_c_kernels():
    text = (PLUGINS / "attention" / "sdpa.py").read_text()
    tree = ast.parse(text)
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not any(module and "cpu_kernels" in module for module in imported)
    assert "kernels" not in {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}


def test_auto_attention_is_cpu_for_float32_on_a_cpu_with_the_kernels_and_sdpa_elsewhere():
    registry = get_registry()
    cpu, cuda = torch.device("cpu"), torch.device("cuda")

    def chosen(name, device, dtype, kernels):
        return choose_attention(name, registry, AttentionEnvironment(device, dtype, cpu_kernels=kernels))

    assert chosen("auto", cpu, torch.float32, True) == "cpu"
    assert chosen("auto", cpu, torch.float32, False) == "sdpa"  # no compiler, or model.cpu_kernels=false
    assert chosen("auto", cpu, torch.bfloat16, True) == "sdpa"
    assert chosen("auto", cuda, torch.float32, True) == "sdpa"
    assert chosen("triton", cpu, torch.float32, True) == "triton"  # a named backend is kept


def test_auto_attention_asks_every_registered_backend_so_a_third_party_one_can_win():
    from infer.registry import Registry

    class Everywhere(AttentionBackend):
        @classmethod
        def auto_priority(cls, environment):
            return 10

        def forward(self, layer, q, k, v, kv_cache, metadata):
            raise NotImplementedError

    class Plugin:
        @hookimpl
        def register_attention_backends(self, register):
            register("everywhere", Everywhere)

    import infer.plugins.attention

    registry = Registry.from_plugins([infer.plugins.attention, Plugin()])
    environment = AttentionEnvironment(torch.device("cpu"), torch.float32, cpu_kernels=True)
    assert choose_attention("auto", registry, environment) == "everywhere"


def test_auto_attention_leaves_out_backends_that_lack_what_the_layers_need():
    from infer.registry import Registry

    class FullOnly(AttentionBackend):
        @classmethod
        def auto_priority(cls, environment):
            return 10

        def forward(self, layer, q, k, v, kv_cache, metadata):
            raise NotImplementedError

    class Plugin:
        @hookimpl
        def register_attention_backends(self, register):
            register("full_only", FullOnly)

    import infer.plugins.attention

    registry = Registry.from_plugins([infer.plugins.attention, Plugin()])
    environment = AttentionEnvironment(torch.device("cpu"), torch.float32, cpu_kernels=True)
    assert choose_attention("auto", registry, environment) == "full_only"
    chosen = choose_attention("auto", registry, environment, frozenset({"window", "sinks"}))
    assert {"window", "sinks"} <= registry.load("attention", chosen).layer_features
    with pytest.raises(ValueError, match="no registered attention backend that runs here with nothing attention"):
        choose_attention("auto", registry, environment, frozenset({"nothing"}))


@pytest.mark.parametrize(
    ("quantization", "dtype"),
    [("none", "float32"), ("fp16", "float32"), ("int8", "float32"), ("bf16", "bfloat16")]
    + [(blocks, "bfloat16") for blocks in ("q4_0", "q4_1", "q8_0", "gguf")],
)
def test_cpu_attention_auto_keeps_kv_and_prefill_in_bf16_for_weights_no_finer_than_bf16(quantization, dtype):
    """bf16 weights and GGUF's 4- and 8-bit blocks get a bf16 pool and bf16 prefill attention (with bf16 decode dot
    products); exact and 16-bit-float or int8 weights keep float32; a setting given explicitly stays."""
    from infer.plugins.attention.cpu import CpuAttentionConfig, CpuBackend

    environment = AttentionEnvironment(torch.device("cpu"), torch.float32, quantization, cpu_kernels=True)
    resolved = CpuBackend.resolve_config(CpuAttentionConfig(), environment)
    assert (resolved.kv_dtype, resolved.prefill_dtype) == (dtype, dtype)
    assert resolved.decode_arithmetic == ("bf16" if dtype == "bfloat16" else "float32")
    kept = CpuBackend.resolve_config(CpuAttentionConfig(kv_dtype="float32"), environment)
    assert kept.kv_dtype == "float32"


def test_the_last_path_must_accept_every_step():
    from infer.execution.paths import FusedLayersPath

    with pytest.raises(ValueError, match="last execution path must be torch"):
        Executor([FusedLayersPath(8)])
    model = type("Model", (), {"use_cpu_kernels": lambda self, kernels, rows, tile_fma=False: None})()
    with pytest.raises(ValueError, match="unknown execution paths"):
        Executor.for_model(model, object(), ["fused-stak", "torch"])


def _decode_then_prefill_choices(tiny_model_dir, caplog, *overrides) -> tuple[LLM, list[str]]:
    llm = LLM(
        "baseline",
        dotlist=[
            f"model.path={tiny_model_dir}",
            "model.dtype=float32",
            "model.max_model_len=256",
            "model.quantization=fp16",
            "execution.fused_max_tokens=8",
            *overrides,
        ],
    )
    with caplog.at_level(logging.DEBUG, logger="infer.execution"):
        llm.generate(["a b c d e f g h i j k l m n o p"], SamplingParams(max_tokens=3, temperature=0.0))
    return llm, [record.getMessage() for record in caplog.records if record.name == "infer.execution"]


@needs_kernels
@needs_fbgemm
def test_each_forward_pass_logs_its_path_and_why_the_earlier_ones_refused(tiny_model_dir, caplog):
    llm, lines = _decode_then_prefill_choices(tiny_model_dir, caplog)
    assert llm.engine.attention_name == "cpu"
    prefill, *decodes = lines
    assert "-> torch" in prefill and "fused-stack: " in prefill and "> fused_max_tokens 8" in prefill
    assert decodes and all("1 tokens, 1 sequences, 2 layers -> fused-stack (first path)" in line for line in decodes)
    assert dict(llm.engine.executor.counts) == {"torch": 1, "fused-stack": len(decodes)}
    assert "forward passes: fused-stack 2, fused-layers 0, torch 1" in llm.engine.executor.describe()


@needs_kernels
@needs_fbgemm
def test_a_backend_that_keeps_attention_to_itself_gets_the_layer_by_layer_fused_path(tiny_model_dir, caplog):
    llm, lines = _decode_then_prefill_choices(tiny_model_dir, caplog, "attention.name=sdpa")
    assert all(
        "-> fused-layers (fused-stack: attention backend SdpaBackend keeps attention to itself)" in line
        for line in lines[1:]
    )


@needs_kernels
@needs_fbgemm
def test_paths_are_chosen_by_config(tiny_model_dir, caplog):
    llm, _ = _decode_then_prefill_choices(tiny_model_dir, caplog, "execution.fused_max_tokens=0")
    assert set(llm.engine.executor.counts) == {"torch"}
    llm, _ = _decode_then_prefill_choices(tiny_model_dir, caplog, "execution.paths=[fused-layers,torch]")
    assert set(llm.engine.executor.counts) == {"fused-layers", "torch"}


def test_unpacked_weights_run_op_by_op_and_say_so(tiny_model_dir, caplog):
    llm, lines = _decode_then_prefill_choices(tiny_model_dir, caplog, "model.quantization=none")
    assert set(llm.engine.executor.counts) == {"torch"}
    reason = "projections not packed" if HAS_COMPILER else "no CPU kernels in this step"
    assert lines[1:] and all(reason in line for line in lines[1:])  # the decodes (the prefill is too long anyway)


def test_infer_run_explain_prints_the_choices_and_their_count(tiny_model_dir, tmp_path):
    from click.testing import CliRunner

    from infer.cli import main

    result = CliRunner().invoke(
        main,
        [
            "run",
            "baseline",
            f"model.path={tiny_model_dir}",
            "model.dtype=float32",
            "model.max_model_len=256",
            "--explain",
            "--output",
            str(tmp_path / "o.jsonl"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "infer.execution: " in result.output and "-> torch" in result.output
    assert "execution paths " in result.output and "forward passes: " in result.output


# -- execution.fused_max_tokens: auto (infer.execution.calibration) ---------------------------------------------------
def test_the_threshold_is_the_step_up_to_which_the_fused_path_saves_the_most():
    from infer.execution.calibration import threshold

    assert threshold({1: (1.0, 2.0), 2: (1.0, 2.0), 4: (3.0, 2.0), 8: (1.0, 9.0)}) == 8  # a later win makes up
    assert threshold({1: (1.0, 2.0), 2: (1.0, 2.0), 4: (5.0, 2.0), 8: (1.0, 2.0)}) == 2  # ... or does not
    assert threshold({1: (3.0, 2.0), 2: (1.0, 2.0)}) == 0
    assert threshold({1: (1.0, 2.0), 32: (2.0, 2.0)}) == 32
    # a Zen 4 EPYC's: a near-tie at 8 tokens, the fused path ahead from 16 to 128
    zen4 = {
        1: (8.9, 14.6),
        2: (9.9, 14.7),
        4: (10.1, 14.9),
        8: (15.4, 15.2),
        16: (15.0, 19.5),
        32: (27.4, 32.2),
        64: (51.0, 55.7),
        128: (99.8, 104.2),
    }
    assert threshold(zen4) == 128


def test_the_first_loss_is_measured_again_before_it_caps_the_threshold():
    """A slow spell over one size's passes (the fused path losing at 4 tokens, winning at 8) is measured again and
    each path's faster time kept; a loss that stands ends the re-measuring, later losses are not measured again."""
    from infer.execution.calibration import confirm_first_loss, threshold

    first = {1: (1.0, 2.0), 4: (5.0, 3.0), 8: (2.0, 4.0), 16: (6.0, 5.0), 32: (9.0, 5.0)}
    again = {4: (2.5, 3.5), 16: (7.0, 5.5)}
    asked = []
    times = confirm_first_loss(first, lambda tokens: asked.append(tokens) or again[tokens])
    assert asked == [4, 16] and times[4] == (2.5, 3.0) and times[16] == (6.0, 5.0) and times[32] == first[32]
    assert times[4][0] < times[4][1] and threshold(times) == 8
    assert confirm_first_loss({1: (1.0, 2.0)}, lambda tokens: asked.append(tokens)) == {1: (1.0, 2.0)}
    assert asked == [4, 16]


def _auto_llm(tiny_model_dir, *overrides) -> LLM:
    return LLM(
        "baseline",
        dotlist=[
            f"model.path={tiny_model_dir}",
            "model.dtype=float32",
            "model.max_model_len=256",
            "model.quantization=fp16",
            "cache.num_blocks=64",
            *overrides,
        ],
    )


def _decode_at(llm: LLM, batch: int) -> dict[str, int]:
    """Execution-path counts of the decode steps of ``batch`` sequences (each one token a step)."""
    engine = llm.engine
    for i in range(batch):
        engine.add_request(list(range(10 + i, 20 + i)), SamplingParams(max_tokens=4, temperature=0.0))
    engine.step()  # the prefill, every prompt in one step
    engine.executor.counts.clear()
    while engine.has_unfinished():
        engine.step()
    for request_id in list(engine.requests):
        engine.release_request(request_id)
    return dict(engine.executor.counts)


@needs_kernels
@needs_fbgemm
def test_auto_takes_the_fused_path_exactly_up_to_the_calibrated_step_size(tiny_model_dir, tmp_path, monkeypatch):
    """A fake calibration (the fused path wins at 1 and 2 tokens, loses from 4): decode steps of 2 sequences take
    fused-stack, steps of 3 the GEMM; the result is cached per CPU signature and kernel build and read back, and
    recalibrate measures again."""
    from infer.execution import calibration

    monkeypatch.setattr(calibration, "calibration_path", lambda digest: tmp_path / f"{digest}.json")
    fake = {1: (1.0, 2.0), 2: (1.0, 2.0), 4: (3.0, 2.0), 8: (9.0, 4.0)}
    measured = []
    monkeypatch.setattr(calibration, "measure", lambda *args, **kwargs: measured.append(1) or fake)
    llm = _auto_llm(tiny_model_dir)
    assert llm.engine.executor.fused_max_tokens == 2 and measured == [1]
    assert "fused up to 2 tokens (calibrated now on " in llm.engine.describe_execution()
    assert _decode_at(llm, 2) == {"fused-stack": 3}
    assert _decode_at(llm, 3) == {"torch": 3}
    (cached,) = tmp_path.glob("*.json")  # (the pool is sized by num_blocks: no activation peak measured)
    again = _auto_llm(tiny_model_dir)
    assert measured == [1] and again.engine.calibration.cached and again.engine.executor.fused_max_tokens == 2
    assert "fused up to 2 tokens (cached calibration" in again.engine.describe_execution()
    _auto_llm(tiny_model_dir, "execution.recalibrate=true")
    assert measured == [1, 1]
    # Another build of the kernels (a changed source or flags: another file name) is measured anew.
    kernels = again.engine.executor.kernels
    monkeypatch.setattr(kernels, "path", kernels.path.with_name("cpu_kernels-0123456789abcdef.so"))
    assert not _auto_llm(tiny_model_dir).engine.calibration.cached and measured == [1, 1, 1]
    # A fixed number is no calibration, nor are unpacked float32 weights, which no threshold concerns.
    assert _auto_llm(tiny_model_dir, "execution.fused_max_tokens=5").engine.calibration is None
    unpacked = _auto_llm(tiny_model_dir, "model.quantization=none").engine
    assert unpacked.calibration is None and measured == [1, 1, 1]
    assert all(layer.fused is None for layer in unpacked.model.layers)


def test_the_activation_peak_is_measured_at_the_first_start_and_read_back_after(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    """The pool's headroom for activations comes from one profiled worst-case step, announced on stderr; a later
    start with the same model and settings reads the peak back (the same pool, no step, nothing said), while
    recalibrate or another token budget profiles again."""
    from infer.engine.engine import Engine
    from infer.execution import calibration

    monkeypatch.setattr(calibration, "calibration_path", lambda digest: tmp_path / f"{digest}.json")
    profiled = []
    original = Engine._profile_activations
    monkeypatch.setattr(Engine, "_profile_activations", lambda self: profiled.append(1) or original(self))

    def start(*overrides):
        return _auto_llm(tiny_model_dir, "cache.num_blocks=null", "cache.memory_budget=64MiB", *overrides).engine

    capsys.readouterr()
    first = start("execution.fused_max_tokens=4")
    assert profiled == [1] and len(list(tmp_path.glob("peak-*.json"))) == 1
    assert "infer: measuring the peak memory of a worst-case step on this CPU once" in capsys.readouterr().err
    again = start("execution.fused_max_tokens=4")
    assert profiled == [1] and again.pool_plan == first.pool_plan
    assert "infer: measuring" not in capsys.readouterr().err
    start("execution.fused_max_tokens=4", "execution.recalibrate=true")
    assert profiled == [1, 1]
    start("execution.fused_max_tokens=4", "scheduler.max_num_batched_tokens=128")
    assert profiled == [1, 1, 1] and len(list(tmp_path.glob("peak-*.json"))) == 2


@needs_kernels
@needs_fbgemm
def test_large_steps_over_bf16_weights_pass_bf16_rows_between_the_gemms(tiny_model_dir, monkeypatch):
    """With ``model.quantization: bf16`` a step above ``fused_max_tokens`` narrows its GEMM inputs (norms and SiLU
    write bf16 rows, QKV is widened for attention) and a step at or below it stays float32 on the fused path; the
    greedy tokens equal those of the same weights with every GEMM input rounded by the GEMM itself."""
    from infer.model.ops import StepOps

    seen = []
    original = StepOps.__init__
    monkeypatch.setattr(
        StepOps,
        "__init__",
        lambda self, *args, **kwargs: (original(self, *args, **kwargs), seen.append(self.gemm_dtype))[0],
    )
    prompt = "a b c d e f g h i j k l m n o p"
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm = _auto_llm(
        tiny_model_dir, "model.quantization=bf16", "execution.fused_max_tokens=8", "execution.large_gemm=bf16"
    )
    assert llm.engine.executor.bf16_gemm_inputs
    narrowed = llm.generate([prompt], params)[0].token_ids
    assert seen[0] is torch.bfloat16 and set(seen[1:]) == {None}  # the 16-token prefill, then decodes
    monkeypatch.setattr(llm.engine.executor, "bf16_gemm_inputs", False)
    assert llm.generate([prompt], params)[0].token_ids == narrowed
    assert not _auto_llm(tiny_model_dir, "model.quantization=fp16").engine.executor.bf16_gemm_inputs


@needs_kernels
@needs_fbgemm
def test_auto_large_gemm_takes_float32_where_it_was_measured_faster_at_every_size(
    tiny_model_dir, tmp_path, monkeypatch
):
    """``execution.large_gemm: auto`` with bf16 weights: a fake measurement where float32 wins by the margin at both
    sizes puts every projection's large steps on the tiles' float32 FMAs (float32 rows between them, in the fused
    layers too, a draft model's alike), cached and read back; a win short of the margin at one size keeps bf16; a
    configured choice measures nothing; other weights never ask. Skipped where the kernels have no FMA tiles."""
    from infer.execution import calibration

    if not (cpu_kernels.load(True).tile_fma and cpu_kernels.load(True).tiles):
        pytest.skip("the tiles' float32 FMAs need an AVX-512 build with tiles (AVX512-BF16 or AMX)")
    monkeypatch.setattr(calibration, "calibration_path", lambda digest: tmp_path / f"{digest}.json")
    fake = {64: (2.0, 1.0), 512: (10.0, 6.0)}
    measured = []
    monkeypatch.setattr(calibration, "measure_gemm", lambda *args, **kwargs: measured.append(1) or fake)
    bf16 = ("model.quantization=bf16", "execution.fused_max_tokens=8")
    llm = _auto_llm(tiny_model_dir, *bf16)
    engine = llm.engine
    assert engine.executor.gemm.name == "float32" and measured == [1]
    assert engine.executor.float_gemms and not engine.executor.bf16_gemm_inputs
    projections = [module for module in engine.model.modules() if isinstance(module, PackedLinear)]
    assert projections and all(module.tile_fma and module.packed is None for module in projections)
    assert all(layer.fused.struct.tiles_fma for layer in engine.model.layers)
    assert engine.attention.config.prefill_arithmetic == "float32"  # infer's flash attention on FMAs too
    assert engine.attention.config.decode_arithmetic == "float32" and not engine.attention.decode_dots  # and decode
    assert (
        "large GEMMs float32 (measured now; bf16 vs float32 64 rows 2.00 vs 1.00 ms, 512 rows 10.00 vs 6.00 "
        "ms)" in engine.describe_execution()
    )
    outputs = llm.generate(["a b c d e f g h i j k l m n o p"] * 2, SamplingParams(max_tokens=6, temperature=0.0))
    assert outputs[0].token_ids == outputs[1].token_ids and len(outputs[0].token_ids) == 6
    again = _auto_llm(tiny_model_dir, *bf16)
    assert measured == [1] and again.engine.executor.gemm.cached and again.engine.executor.gemm.name == "float32"
    draft = quantize_model(load_model(tiny_model_dir, torch.float32, torch.device("cpu")).model, "bf16")
    assert again.engine.executor.for_another(draft).float_gemms  # a draft model's executor, as a drafter makes it
    assert all(module.tile_fma for module in draft.modules() if isinstance(module, PackedLinear))
    fake[512] = (10.0, 9.5)  # faster, but not by GEMM_MARGIN
    kept = _auto_llm(tiny_model_dir, *bf16, "execution.recalibrate=true").engine
    assert kept.executor.gemm.name == "bf16" and kept.attention.config.prefill_arithmetic == "bf16"
    # decode and verification on the dot products where the build has them for the pool's heads
    dots = cpu_kernels.load(True).flash and kept.attention.head_dim == 64
    assert kept.attention.config.decode_arithmetic == "bf16" and kept.attention.decode_dots == dots
    assert ("bf16 decode on the dot products" in kept.describe_execution()) == dots
    assert measured == [1, 1]
    configured = _auto_llm(tiny_model_dir, *bf16, "execution.large_gemm=float32").engine
    assert configured.executor.gemm.name == "float32" and configured.executor.float_gemms and measured == [1, 1]
    assert "large GEMMs float32 (configured)" in configured.describe_execution()
    fp16 = _auto_llm(tiny_model_dir).engine
    assert fp16.executor.gemm is None  # fp16 weights: no such choice
    assert fp16.attention.config.decode_arithmetic == "float32" and not fp16.attention.decode_dots


@needs_kernels
@needs_fbgemm
def test_large_gemm_float32_prefill_matches_float32_over_the_rounded_weights(tiny_model_dir, bf16_valued_model_dir):
    """With ``large_gemm: float32`` (and float32 prefill attention) every product is float32 rows times the bf16
    weights: the greedy tokens of a prefill and decodes equal those of an exact float32 model whose weights were
    rounded to bf16 beforehand."""
    if not (cpu_kernels.load(True).tile_fma and cpu_kernels.load(True).tiles):
        pytest.skip("the tiles' float32 FMAs need an AVX-512 build with tiles (AVX512-BF16 or AMX)")
    prompts = [list(range(10, 50)), list(range(100, 137))]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    fma = LLM(
        "baseline",
        dotlist=[
            f"model.path={tiny_model_dir}",
            "model.dtype=float32",
            "model.max_model_len=256",
            "model.quantization=bf16",
            "cache.num_blocks=64",
            "execution.large_gemm=float32",
            "attention.name=cpu",
            "attention.prefill_dtype=float32",
            "attention.kv_dtype=float32",
        ],
    )
    exact = LLM(
        "baseline",
        dotlist=[
            f"model.path={bf16_valued_model_dir}",
            "model.dtype=float32",
            "model.max_model_len=256",
            "model.quantization=none",
            "cache.num_blocks=64",
        ],
    )
    assert [out.token_ids for out in fma.generate(prompts, params)] == [
        out.token_ids for out in exact.generate(prompts, params)
    ]


@needs_kernels
@needs_fbgemm
def test_a_real_calibration_times_both_paths_at_every_size(tiny_model_dir, tmp_path, monkeypatch):
    from infer.execution import calibration

    monkeypatch.setattr(calibration, "calibration_path", lambda digest: tmp_path / f"{digest}.json")
    llm = _auto_llm(tiny_model_dir)
    measured = llm.engine.calibration
    assert sorted(measured.times_ms) == list(calibration.CANDIDATES)
    assert all(fused > 0 and gemm > 0 for fused, gemm in measured.times_ms.values())
    assert measured.fused_max_tokens == calibration.threshold(measured.times_ms)
    assert llm.engine.executor.counts.total() == 0  # the calibration's passes are no steps
    kernels = llm.engine.executor.kernels
    if kernels.tile_fma and kernels.tiles:
        times = calibration.measure_gemm(64, 96, kernels, rows=(16, 300), repeats=2)
        assert sorted(times) == [16, 300] and all(bf16 > 0 and f32 > 0 for bf16, f32 in times.values())
    output = llm.generate([list(range(10, 30))], SamplingParams(max_tokens=6, temperature=0.0))[0]
    assert len(output.token_ids) == 6


class _FakeMachine:
    """A clock whose every reading moves on by the next of ``steps_ms`` (cycled), and ``/proc/stat`` times in which
    infer's ``threads`` and ``others`` other cores ran busy all along: a calibration's passes take what the test
    says, with no load put on the machine. The clock is read once as a ``Timer`` is made, then twice a pass: the
    steps alternate a gap and a pass's time."""

    def __init__(self, steps_ms: list[float], threads: int, others: float = 0.0):
        self.steps_ms, self.threads, self.others = steps_ms, threads, others
        self.readings, self.now, self.read = 0, 0.0, 0.0

    def clock(self) -> float:
        self.read = self.now
        self.now += self.steps_ms[self.readings % len(self.steps_ms)] / 1e3
        self.readings += 1
        return self.read

    def cpu_times(self) -> tuple[float, float]:
        """As at the clock's last reading."""
        return self.read * (self.threads + self.others), self.read * self.threads


def test_a_spread_between_repeats_or_other_processes_busy_marks_the_passes_disturbed(monkeypatch):
    """Repeats within a few percent and no other load: nothing to say. One step size whose median repeat took 3x its
    fastest (its slowest pass alone would not count), or other processes busy on one core of a machine whose cores
    infer's threads fill: disturbed, and the reason names the spread or the cores."""
    from infer.execution import calibration

    def timed(machine: _FakeMachine, passes: dict[object, int]) -> calibration.Timer:
        monkeypatch.setattr(calibration, "clock", machine.clock)
        monkeypatch.setattr(calibration, "cpu_times", machine.cpu_times)
        timer = calibration.Timer()
        for key, count in passes.items():
            for _ in range(count):
                timer.time(key, lambda: None)
        return timer

    quiet = timed(_FakeMachine([5.0, 100.0, 5.0, 103.0], threads=2, others=0.2), {1: 7, 2: 7})
    assert quiet.spread() == pytest.approx(1.03) and quiet.others_cores() == pytest.approx(0.2)
    assert calibration.disturbance(quiet, threads=2, cores=2) == ""
    one_slow_pass = timed(_FakeMachine([5.0, 100.0] * 6 + [5.0, 900.0], threads=2), {1: 7})
    assert one_slow_pass.spread() == pytest.approx(1.0) and calibration.disturbance(one_slow_pass, 2, 2) == ""
    slowed = timed(_FakeMachine([5.0, 100.0] * 3 + [5.0, 300.0] * 4, threads=2), {1: 7, 2: 7})
    assert slowed.spread() == pytest.approx(3.0)
    assert "a step's median repeat took 3.00x its fastest, over 1.5x" == calibration.disturbance(slowed, 2, 2)
    loaded = timed(_FakeMachine([5.0, 100.0], threads=2, others=1.0), {1: 7, 2: 7})
    assert loaded.spread() == pytest.approx(1.0)
    assert calibration.disturbance(loaded, threads=2, cores=2) == (
        "other processes kept 1.00 cores busy beside infer's 2 threads (0 cores free)"
    )
    assert calibration.disturbance(loaded, threads=2, cores=4) == ""  # two cores were free for them
    # under LOAD_MIN_SECONDS the ticks of /proc/stat cannot tell
    assert timed(_FakeMachine([1.0], threads=2, others=5.0), {1: 7}).others_cores() is None


def test_a_step_size_whose_repeats_spread_is_timed_again_and_judged_on_the_second_look():
    """A size whose repeats spread over DISTURBED_SPREAD is timed once more: its first repeats are forgotten (a steady
    second look leaves nothing to report), each path keeps its faster time, steady sizes are not timed again, and a
    size that spreads again stays disturbed."""
    from infer.execution import calibration

    def measured(rounds: dict[int, list[list[float]]]):
        timer, timed = calibration.Timer(), []

        def time_size(tokens: int) -> tuple[float, float]:
            fused, gemm = rounds[tokens].pop(0), rounds[tokens].pop(0)
            timed.append(tokens)
            timer.samples_ms.setdefault((tokens, tokens), []).extend(fused)
            timer.samples_ms.setdefault((tokens, 0), []).extend(gemm)
            return timer.fastest((tokens, tokens)), timer.fastest((tokens, 0))

        first = {tokens: time_size(tokens) for tokens in sorted(rounds)}
        return calibration.retime_unsteady(first, time_size, timer), timer, timed

    steady, spell, again = [10.0, 10.5, 10.2], [6.0, 6.0, 11.0, 11.0, 11.0], [9.0, 9.2, 9.1]
    times, timer, timed = measured({1: [steady, steady], 8: [spell, spell, again, again]})
    assert timed == [1, 8, 8] and times == {1: (10.0, 10.0), 8: (6.0, 6.0)}
    assert timer.samples_ms[(8, 8)] == again and calibration.disturbance(timer, threads=1, cores=1) == ""
    times, timer, timed = measured({8: [spell, steady, spell, steady]})
    assert timed == [8, 8] and times == {8: (6.0, 10.0)}
    assert calibration.disturbance(timer, threads=1, cores=1).startswith("a step's median repeat took 1.83x")


@needs_kernels
@needs_fbgemm
def test_a_disturbed_calibration_serves_its_run_and_is_measured_again_at_the_next_start(
    tiny_model_dir, tmp_path, monkeypatch, caplog
):
    """Real calibration passes timed by a fake clock: repeats spread 1-5x apart are used for the run (the threshold
    they give is the executor's) and not cached, with one warning that names the spread and says infer measures
    again; the next start measures again, and steady repeats are cached and read back. Steady repeats while other
    processes kept a core busy on a machine infer's threads fill are not cached either."""
    from functools import partial

    from infer.execution import calibration

    monkeypatch.setattr(calibration, "calibration_path", lambda digest: tmp_path / f"{digest}.json")
    measured = []
    real_measure = partial(calibration.measure, candidates=(1, 2, 4), repeats=5)
    monkeypatch.setattr(
        calibration, "measure", lambda *args, **kwargs: measured.append(1) or real_measure(*args, **kwargs)
    )

    def start(machine: _FakeMachine, *overrides: str):
        monkeypatch.setattr(calibration, "clock", machine.clock)
        monkeypatch.setattr(calibration, "cpu_times", machine.cpu_times)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="infer.execution"):
            engine = _auto_llm(tiny_model_dir, *overrides).engine
        return engine, [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]

    threads = torch.get_num_threads()
    # passes of 10, 40 and 25 ms in turn: each step size's repeats 2.5x apart at their median
    disturbed = _FakeMachine([1.0, 10.0, 1.0, 40.0, 1.0, 25.0], threads)
    engine, warnings = start(disturbed)
    times = engine.calibration.times_ms
    assert measured == [1] and not engine.calibration.cached and sorted(times) == [1, 2, 4]
    assert engine.executor.fused_max_tokens == engine.calibration.fused_max_tokens == calibration.threshold(times)
    assert list(tmp_path.glob("*.json")) == []
    (warning,) = warnings
    assert warning.startswith("the execution calibration measured on a busy machine (a step's median repeat took ")
    assert warning.endswith(
        "x its fastest, over 1.5x): used for this run, not cached; infer measures again at the next start"
    )
    engine, _ = start(_FakeMachine([1.0, 100.0], threads))
    assert measured == [1, 1] and not engine.calibration.cached
    assert all(pair == pytest.approx((100.0, 100.0)) for pair in engine.calibration.times_ms.values())
    assert len(list(tmp_path.glob("*.json"))) == 1
    engine, warnings = start(_FakeMachine([1.0, 100.0], threads))
    assert measured == [1, 1] and engine.calibration.cached and warnings == []
    free = max(0, os.cpu_count() - threads)  # other processes may use these freely
    engine, warnings = start(_FakeMachine([1.0, 100.0], threads, others=free + 1.0), "execution.recalibrate=true")
    assert measured == [1, 1, 1]
    assert warnings == [
        f"the execution calibration measured on a busy machine (other processes kept {free + 1.0:.2f} cores busy "
        f"beside infer's {threads} threads ({free} cores free)): used for this run, not cached; infer measures again "
        "at the next start"
    ]
    assert len(list(tmp_path.glob("*.json"))) == 1  # the steady measurement before it stays


@pytest.mark.parametrize("kind", ["gemm", "rows"])
def test_disturbed_gemm_and_rows_calibrations_are_not_cached(kind, tmp_path, monkeypatch, caplog):
    """``choose_gemm``'s and ``calibrate_rows``' measurements are kept or not by the same rule."""
    from infer.drafter import RowsCalibration
    from infer.execution import calibration

    monkeypatch.setattr(calibration, "calibration_path", lambda digest: tmp_path / f"{digest}.json")
    record = (
        calibration.GemmChoice("bf16", "gemm-0", {64: (1.0, 2.0)}, reason="measured")
        if kind == "gemm"
        else RowsCalibration(2, "rows-0", {1: 1.0, 2: 1.0})
    )
    for steps, kept in (([1.0, 10.0, 1.0, 30.0, 1.0, 30.0], False), ([1.0, 10.0], True)):
        machine = _FakeMachine(steps, threads=1)
        monkeypatch.setattr(calibration, "clock", machine.clock)
        monkeypatch.setattr(calibration, "cpu_times", machine.cpu_times)
        timer = calibration.Timer()
        for _ in range(3):
            timer.time(1, lambda: None)
        with caplog.at_level(logging.WARNING, logger="infer.execution"):
            calibration.keep(record, timer, f"the {kind} calibration")
        assert calibration.calibration_path(record.signature).is_file() == kept
    (warning,) = [record.getMessage() for record in caplog.records]
    assert warning.startswith(f"the {kind} calibration measured on a busy machine (a step's median repeat took 3.00x")


def test_free_rows_is_the_most_rows_within_the_margin_of_one():
    from infer.execution.calibration import free_rows

    assert free_rows({1: 10.0, 2: 9.8, 3: 10.4, 4: 10.45, 5: 11.0, 8: 10.0}) == 4  # 5 rows cost 1.1x: the end
    assert free_rows({1: 10.0, 2: 12.0, 3: 10.0}) == 1


@needs_kernels
def test_eagle_trees_hold_one_draft_fewer_than_the_rows_a_decode_step_verifies(tiny_model_dir, tmp_path, monkeypatch):
    """``tree_budget: auto`` takes the measured free rows (a fake measurement: 5 rows within 5% of one) less the
    root's row, capped by ``num_speculative_tokens``, and shares them among the sequences drafting in a step; the
    measurement is cached and read back, ``infer run`` names it, and a number or ``tree_width: 1`` (chains) measures
    nothing."""
    from infer.execution import calibration

    monkeypatch.setattr(calibration, "calibration_path", lambda digest: tmp_path / f"{digest}.json")
    measured, measure_rows = [], calibration.measure_rows
    fake = {1: 10.0, 2: 10.0, 3: 10.2, 4: 10.3, 5: 10.4, 6: 11.5, 7: 12.0, 8: 13.0}
    monkeypatch.setattr(calibration, "measure_rows", lambda *args, **kwargs: measured.append(1) or fake)
    # a fixed threshold: the rows' signature names it, and a calibration disturbed by other processes is not cached
    eagle = ["drafter.name=eagle", "drafter.head=random", "execution.fused_max_tokens=8"]
    llm = _auto_llm(tiny_model_dir, *eagle, "drafter.num_speculative_tokens=6")
    drafter = llm.engine.drafter
    assert drafter.tree_budget == 4 and measured == [1]
    assert "eagle trees of up to 4 drafts, 3 guesses a run" in llm.engine.describe_execution()
    # the 5 rows are shared by the sequences drafting in a step, one each for its own token
    assert [drafter.drafts_each(sequences, 6) for sequences in (1, 2, 3)] == [4, 1, 0]
    assert _auto_llm(tiny_model_dir, *eagle).engine.drafter.tree_budget == 4 and measured == [1]  # cached; k = 4
    assert _auto_llm(tiny_model_dir, *eagle, "drafter.num_speculative_tokens=2").engine.drafter.tree_budget == 2
    fixed = _auto_llm(tiny_model_dir, *eagle, "drafter.tree_budget=3").engine.drafter
    assert fixed.tree_budget == 3 and fixed.drafts_each(3, 4) == 3
    chains = _auto_llm(tiny_model_dir, *eagle, "drafter.tree_width=1").engine
    assert chains.drafter.tree_budget is None and "eagle chains of up to 4" in chains.describe_execution()
    assert measured == [1]
    times = measure_rows(
        llm.engine.model,
        llm.engine.attention,
        llm.engine.executor,
        llm.engine.device,
        llm.engine.dtype,
        candidates=(1, 3),
        repeats=1,
    )
    assert sorted(times) == [1, 3] and all(ms > 0 for ms in times.values())


_FAULTS_SCRIPT = """
import resource, sys, torch
from infer import LLM, SamplingParams
llm = LLM("baseline", dotlist=["execution.reuse_freed_memory=" + sys.argv[1]])
assert ("malloc keeps freed memory" in llm.engine.describe_execution()) == (sys.argv[1] == "true")
prompts = torch.randint(1000, 20000, (1, 512), generator=torch.Generator().manual_seed(0)).tolist()
params = SamplingParams(max_tokens=1, temperature=0.0)
llm.generate(prompts, params, use_tqdm=False)  # the first step sizes the heap
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(2):
    llm.generate(prompts, params, use_tqdm=False)
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 2)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="reuse_freed_memory tunes glibc's malloc")
@pytest.mark.slow  # two processes each load the default model and prefill 512 tokens again and again
def test_prefill_steps_reuse_freed_memory_instead_of_faulting_it_in_again():
    """A 512-token prompt on the default model, prefilled again and again: with glibc's thresholds each step's
    activations (a few MiB a tensor) are mapped afresh and faulted in page by page; with
    ``execution.reuse_freed_memory`` (the default) the freed blocks serve the next ones. Both runs start from
    glibc's starting thresholds (128 KiB) held fixed: left dynamic, glibc raises them to the largest mapped block
    freed so far, so the plain count would depend on what the process had freed before (from 0 to tens of thousands a
    2048-token step). On an AVX2 EPYC: 150,333 faults a generate vs 0."""
    glibc_start = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}

    def faults_per_generate(reuse: str) -> int:
        result = subprocess.run(
            [sys.executable, "-c", _FAULTS_SCRIPT, reuse],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, **glibc_start},
        )
        assert result.returncode == 0, result.stderr
        return int(result.stdout.split()[-1])

    plain, reused = faults_per_generate("false"), faults_per_generate("true")
    assert plain > 2_000 and reused * 5 < plain, (plain, reused)


@pytest.mark.parametrize("quantization", ["none", "bf16"])
def test_a_large_steps_logits_are_written_to_one_buffer_kept_for_the_next(bf16_valued_model_dir, quantization):
    """Logits past what malloc keeps for reuse go to the runner's buffer, the same memory every step, with the values
    a fresh tensor gets; small ones and very large ones (prompt logprobs) get their own."""
    from infer.execution.runner import LOGITS_BUFFER_ROWS
    from infer.host import HEAP_MMAP_THRESHOLD

    model_config = {"path": bf16_valued_model_dir, "quantization": quantization, "max_model_len": 64}
    llm = LLM(model=model_config, cache={"num_blocks": 8})
    runner = llm.engine.runner
    model = runner.model
    rows = -(-HEAP_MMAP_THRESHOLD // (4 * model.vocab_size))
    assert runner.logits_buffer(rows - 1) is None and runner.logits_buffer(LOGITS_BUFFER_ROWS + 1) is None
    hidden = torch.randn(rows, model.lm_head.in_features)
    first = model.compute_logits(hidden, None, runner.logits_buffer(rows))
    assert first.data_ptr() == runner.logits_held.data_ptr()
    torch.testing.assert_close(first, model.compute_logits(hidden), rtol=1e-6, atol=1e-6)
    more = torch.randn(rows + 8, model.lm_head.in_features)
    grown = model.compute_logits(more, None, runner.logits_buffer(rows + 8))  # the buffer grows to the larger step
    assert grown.data_ptr() == runner.logits_held.data_ptr() and runner.logits_held.shape[0] == rows + 8
    assert runner.logits_buffer(rows).data_ptr() == grown.data_ptr()
    torch.testing.assert_close(grown, model.compute_logits(more), rtol=1e-6, atol=1e-6)


@needs_kernels
def test_large_steps_over_weights_that_every_step_multiplies_on_tiles_take_the_fused_layers(
    bf16_valued_model_dir, caplog
):
    """Where every projection multiplies inputs of any rows on its tiles (AMX, or the tiles' float32 FMAs), a
    prefill above ``fused_max_tokens`` runs the layers' dense parts in the two C calls around the backend's
    attention, and its greedy tokens equal the op-by-op path's; ``fused_max_tokens: 0`` still keeps it op by op."""
    kernels = cpu_kernels.load(True)
    if not kernels.tiles:
        pytest.skip(f"no tile kernels in this {kernels.simd} build (AMX or AVX512-BF16)")
    if not kernels.amx and not kernels.tile_fma:
        pytest.skip("neither AMX nor the tiles' float32 FMAs: large steps stay on oneDNN")
    gemm = "execution.large_gemm=bf16" if kernels.amx else "execution.large_gemm=float32"
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = " ".join(f"w{i}" for i in range(40))
    tokens = {}
    for paths in ("[fused-stack,fused-layers,torch]", "[fused-stack,torch]"):
        llm = _auto_llm(
            bf16_valued_model_dir,
            "model.quantization=bf16",
            "execution.fused_max_tokens=8",
            gemm,
            f"execution.paths={paths}",
        )
        assert all(layer.fuses_any_step for layer in llm.engine.model.layers)
        with caplog.at_level(logging.DEBUG, logger="infer.execution"):
            caplog.clear()
            tokens[paths] = llm.generate([prompt], params)[0].token_ids
        prefill = next(record.getMessage() for record in caplog.records if record.name == "infer.execution")
        expected = "-> fused-layers" if "fused-layers" in paths else "-> torch"
        assert expected in prefill and "> fused_max_tokens 8" in prefill
    assert tokens["[fused-stack,fused-layers,torch]"] == tokens["[fused-stack,torch]"]
    never = _auto_llm(bf16_valued_model_dir, "model.quantization=bf16", "execution.fused_max_tokens=0", gemm)
    never.generate([prompt], params)
    assert set(never.engine.executor.counts) == {"torch"}
