"""The execution layer: how one forward pass runs through the model's layers, decided in this one place.

The runner builds one ``ExecutionStep`` per step (what the model's ``infer.model.step.ForwardStep`` protocol asks: the
attention metadata its backend prepared, the pool, the backend, the small ops) and the layers read only that object:
``layer(hidden, residual, step)``. ``Executor.run_layers`` asks its execution paths in order whether they accept the
step and runs the first that does:

- ``fused-stack``: all layers in one C call, attention included (``infer.kernels.cpu.FusedStack``). Needs the CPU
  kernels (float32 on a CPU), packed projections (``model.quantization`` fp16 or int8), at most ``fused_max_tokens``
  tokens, and a backend whose ``fused_attention`` describes the step's attention as the kernels compute it (its
  attention is infer's C paged attention over the standard pool, so the stack may compute it itself).
- ``fused-layers``: each layer's dense parts as two C calls around the backend's own ``forward`` (``FusedLayer``):
  the same conditions but the backend's.
- ``torch``: layer by layer, op by op (``DecoderLayer.forward``); the small ops are the CPU kernels' where they run,
  and packed projections still pick the GEMV for inputs of up to ``fused_max_tokens`` rows. Accepts every step.

Why a few tokens go to C: at one to eight tokens a layer is ~15 small ops around four memory-bound matrix products,
and calling them one by one from Python costs about a third of the step; from about twelve tokens fbgemm's GEMM is
as fast (docs/performance.md; ``benchmarks/cpu_kernels.py --only steps``). The choice of every forward pass
and the reasons the earlier paths refused it are logged at debug level on ``infer.execution.paths``
(``infer run --explain`` shows them and a count per path).

``choose_attention`` resolves ``attention.name: auto``: the registered backend whose ``auto_priority`` is highest
where the model runs (``cpu``, infer's C kernels, for float32 on a CPU where they build; ``sdpa`` everywhere else).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from infer.attention import AttentionBackend, AttentionEnvironment, AttentionMetadata
from infer.execution.calibration import CANDIDATES as CALIBRATION_CANDIDATES
from infer.execution.calibration import DEFAULT_FUSED_MAX_TOKENS, Calibration, GemmChoice, calibrate, choose_gemm
from infer.host import reuse_freed_memory, trim_heap
from infer.kernels.cpu import FusedStack, KernelAttentionStep
from infer.model.ops import StepOps

if TYPE_CHECKING:
    from infer.kernels.cpu import CpuKernels
    from infer.model import CausalLM, DecoderLayer
    from infer.model.rotary import RotaryEmbedding

logger = logging.getLogger("infer.execution")

PATH_NAMES = ("fused-stack", "fused-layers", "torch")
_UNASKED = object()


@dataclass(slots=True, eq=False)
class ExecutionStep:
    """What every layer of one forward pass reads (``infer.model.step.ExecutionStep``), passed explicitly (no global
    context)."""

    metadata: AttentionMetadata  # what the backend's ``prepare`` returned
    kv_cache: torch.Tensor  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    attention: AttentionBackend
    ops: StepOps
    executor: Executor
    _fused_attention: object = _UNASKED  # the backend's ``fused_attention(metadata)``, asked once per step

    @property
    def positions(self) -> torch.Tensor:  # [T] int64
        return self.metadata.positions

    @property
    def num_tokens(self) -> int:
        return self.metadata.num_tokens

    @property
    def fused_attention(self) -> KernelAttentionStep | None:
        """The step's attention as the CPU kernels compute it inside a fused stack, or None (the backend keeps it)."""
        if self._fused_attention is _UNASKED:
            self._fused_attention = self.attention.fused_attention(self.metadata)
        return self._fused_attention

    def attend(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The backend's attention for one layer: writes this step's K/V into the layer's pool, then attends."""
        return self.attention.forward(layer_index, q, k, v, self.kv_cache[layer_index], self.metadata)

    def run_layers(self, layers: Sequence[DecoderLayer], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``layers`` over ``hidden`` ``[T, hidden]`` on the path the executor chooses: ``(delta, residual)`` for
        the final norm to add."""
        return self.executor.run_layers(layers, hidden, self)


class ExecutionPath(ABC):
    """One way to run a forward pass through a list of decoder layers."""

    name: ClassVar[str]

    @abstractmethod
    def refusal(self, layers: Sequence[DecoderLayer], step: ExecutionStep) -> str | None:
        """Why this path cannot run ``step`` through ``layers``; None when it can."""

    @abstractmethod
    def run(
        self, layers: Sequence[DecoderLayer], hidden: torch.Tensor, step: ExecutionStep
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``layers`` over embeddings ``hidden`` ``[T, hidden]``: the last layer's output and the residual stream."""


class TorchPath(ExecutionPath):
    """Layer by layer, op by op: every step, every backend, every device."""

    name = "torch"

    def refusal(self, layers, step) -> str | None:
        return None

    def run(self, layers, hidden, step) -> tuple[torch.Tensor, torch.Tensor]:
        residual = None
        for layer in layers:
            hidden, residual = layer(hidden, residual, step)
        return hidden, residual


class FusedLayersPath(ExecutionPath):
    """Steps of up to ``max_tokens`` tokens: each layer's dense parts in two C calls (``FusedLayer``) around the
    attention backend's ``forward``."""

    name = "fused-layers"

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens

    def refusal(self, layers, step) -> str | None:
        if step.ops.kernels is None:
            return "no CPU kernels in this step (they run float32 on a CPU; model.cpu_kernels)"
        if step.num_tokens > self.max_tokens and not (self.max_tokens > 0 and self.takes_large_steps(layers)):
            return f"{step.num_tokens} tokens > fused_max_tokens {self.max_tokens}"
        if layers and layers[0].self_attn.tensor_parallel is not None:
            return "tensor-parallel layers (an all-reduce follows the output and the down projection)"
        if not layers or any(layer.fused is None for layer in layers):
            if layers and not all(layer.kernel_shaped for layer in layers):
                return "layers the fused C layer does not compute (experts, another activation, norms of two eps)"
            return "projections not packed for the kernels (model.quantization fp16 or int8, shapes the GEMV takes)"
        return None

    def takes_large_steps(self, layers: Sequence[DecoderLayer]) -> bool:
        """Whether steps past ``max_tokens`` run here too: where every projection multiplies inputs of any rows on
        its tiles (AMX's, or float32 FMAs: ``PackedLinear.tiles_only``), the C calls run the very GEMM the torch path
        would, and the norms, RoPE and activation around it in C instead of a dozen torch ops a layer (the
        Qwen3-0.6B shape's prefill step of 40 prompts of 50 tokens spent 16% of its time in those op by op;
        docs/performance.md)."""
        return bool(layers) and all(layer.fused is not None and layer.fuses_any_step for layer in layers)

    def run(self, layers, hidden, step) -> tuple[torch.Tensor, torch.Tensor]:
        residual, delta = hidden, None  # the embedding is the residual stream; the first layer adds nothing
        tokens = hidden.shape[0]
        rotary = step.ops.rotary
        for layer in layers:
            qkv = layer.fused.attention_input(residual, delta, step.positions, rotary.cos, rotary.sin)
            attn = layer.self_attn
            q, k, v = qkv.view(tokens, -1, attn.head_dim).split(
                [attn.num_heads, attn.num_kv_heads, attn.num_kv_heads], dim=1
            )
            out = step.attend(attn.layer_index, q, k, v)
            # contiguous(): a no-op for the built-in backends; the C side reads plain rows whatever a plugin returns.
            delta = layer.fused.feed_forward(out.reshape(tokens, attn.q_size).contiguous(), residual)
        return delta, residual


class FusedStackPath(FusedLayersPath):
    """Steps of up to ``max_tokens`` tokens: all layers in one C call, attention included (``FusedStack``), with a
    backend whose ``fused_attention`` describes the step's attention."""

    name = "fused-stack"

    def __init__(self, max_tokens: int):
        super().__init__(max_tokens)
        self._stacks: dict[tuple[int, ...], FusedStack] = {}  # by the layers' ids: built once per list of layers

    def takes_large_steps(self, layers: Sequence[DecoderLayer]) -> bool:
        """Never: a large prefill's attention goes faster through the backend's own kernels (infer's flash attention)
        than inside the one call."""
        return False

    def refusal(self, layers, step) -> str | None:
        reason = super().refusal(layers, step)
        if reason is None and step.fused_attention is None:
            reason = f"attention backend {type(step.attention).__name__} keeps attention to itself"
        return reason

    def run(self, layers, hidden, step) -> tuple[torch.Tensor, torch.Tensor]:
        key = tuple(map(id, layers))
        stack = self._stacks.get(key)
        if stack is None:
            stack = self._stacks[key] = FusedStack(
                step.ops.kernels, [layer.fused for layer in layers], [layer.self_attn.layer_index for layer in layers]
            )
        rotary = step.ops.rotary
        delta = stack.run(hidden, step.positions, rotary.cos, rotary.sin, step.kv_cache, step.fused_attention)
        return delta, hidden


class Executor:
    """Chooses and runs each forward pass's execution path (the first of ``paths`` that accepts it) and counts the
    choices. ``Executor()`` runs everything op by op in torch."""

    def __init__(
        self,
        paths: Sequence[ExecutionPath] | None = None,
        kernels: CpuKernels | None = None,
        fused_max_tokens: int = 0,
        bf16_gemm_inputs: bool = False,
        gemm: GemmChoice | None = None,
    ):
        self.paths = list(paths) if paths else [TorchPath()]
        if not isinstance(self.paths[-1], TorchPath):
            raise ValueError("the last execution path must be torch, which accepts every step")
        self.kernels = kernels
        self.fused_max_tokens = fused_max_tokens
        # Every projection takes bf16 rows at large steps (bf16 weights, or blocks on AMX): those steps pass bf16 rows
        # between them (``StepOps``).
        self.bf16_gemm_inputs = bf16_gemm_inputs
        self.gemm = gemm  # bf16 weights: what their large steps multiply on (``execution.large_gemm``)
        self.counts: Counter[str] = Counter()

    @property
    def float_gemms(self) -> bool:
        """bf16 weights' large steps run on the tiles' float32 FMAs (``gemm`` chose float32)."""
        return self.gemm is not None and self.gemm.name == "float32"

    @classmethod
    def for_model(
        cls,
        model: CausalLM,
        kernels: CpuKernels | None,
        paths: Sequence[str] = PATH_NAMES,
        fused_max_tokens: int = 8,
        gemm: GemmChoice | None = None,
    ) -> Executor:
        """The executor for ``model``: with ``kernels``, its weights prepared for them and the fused paths named in
        ``paths`` (in that order) before torch; without, torch alone. ``gemm`` float32: bf16 weights' steps of more
        rows than the GEMV takes multiply on the tile kernel's float32 FMAs (``execution.large_gemm``), so large
        steps pass float32 rows between the projections."""
        float_gemms = gemm is not None and gemm.name == "float32"
        model.use_cpu_kernels(kernels, fused_max_tokens, float_gemms)
        if kernels is None:
            return cls()
        known = {"fused-stack": FusedStackPath, "fused-layers": FusedLayersPath}
        unknown = [name for name in paths if name not in PATH_NAMES]
        if unknown:
            raise ValueError(f"unknown execution paths {unknown}; choose from {', '.join(PATH_NAMES)}")
        chosen = [known[name](fused_max_tokens) for name in paths if name in known]
        return cls(
            [*chosen, TorchPath()], kernels, fused_max_tokens, _bf16_rows(model, kernels) and not float_gemms, gemm
        )

    def for_another(self, model: CausalLM) -> Executor:
        """An executor with these kernels and paths for another model (a draft model), its weights prepared (on the
        tiles' float32 FMAs where this one's are)."""
        return Executor.for_model(
            model, self.kernels, [path.name for path in self.paths], self.fused_max_tokens, self.gemm
        )

    def set_fused_max_tokens(self, model: CausalLM, max_tokens: int) -> None:
        """Let steps of up to ``max_tokens`` tokens take the fused paths and ``model``'s GEMV (weights already
        prepared by ``for_model``)."""
        from infer.model.quantization import PackedLinear

        self.fused_max_tokens = max_tokens
        for path in self.paths:
            if isinstance(path, FusedLayersPath):
                path.max_tokens = max_tokens
        for module in model.modules():
            if isinstance(module, PackedLinear):
                module.use_cpu_kernels(module.kernels, max_tokens)

    def prepare(self, module: torch.nn.Module) -> None:
        """Prepare a decoder layer or a packed projection outside a model (an EAGLE head's) for these kernels, as
        ``for_model`` does: small steps take the GEMV (a projection outside the packing modes stays as it is)."""
        if hasattr(module, "use_cpu_kernels"):
            module.use_cpu_kernels(self.kernels, self.fused_max_tokens, self.float_gemms)

    def step(
        self,
        rotary: RotaryEmbedding,
        metadata: AttentionMetadata,
        kv_cache: torch.Tensor,
        attention: AttentionBackend,
        dtype: torch.dtype,
    ) -> ExecutionStep:
        """The per-step object for ``metadata`` (already through ``attention.prepare``); the small ops run on the
        kernels for float32 on a CPU."""
        usable = self.kernels is not None and dtype == torch.float32 and metadata.positions.device.type == "cpu"
        large = self.bf16_gemm_inputs and metadata.num_tokens > self.fused_max_tokens
        ops = StepOps(rotary, metadata.positions, self.kernels if usable else None, torch.bfloat16 if large else None)
        return ExecutionStep(metadata, kv_cache, attention, ops, self)

    def fuses(self, layers: Sequence[DecoderLayer], step: ExecutionStep) -> bool:
        """Whether ``step`` runs ``layers`` in one C call, attention included (the fused-stack path)."""
        return self.choose(layers, step).name == FusedStackPath.name

    def count_fused(self) -> None:
        """Count a forward pass run in one C call outside the paths (a fused draft head) as the fused stack's."""
        self.counts[FusedStackPath.name] += 1

    def choose(self, layers: Sequence[DecoderLayer], step: ExecutionStep) -> ExecutionPath:
        """The first path that accepts ``step``; logs the choice and why the earlier ones refused."""
        refusals = []
        for path in self.paths:
            reason = path.refusal(layers, step)
            if reason is None:
                if logger.isEnabledFor(logging.DEBUG):
                    why = "; ".join(refusals) or "first path"
                    logger.debug(
                        "%d tokens, %d sequences, %d layers -> %s (%s)",
                        step.num_tokens,
                        step.metadata.num_seqs,
                        len(layers),
                        path.name,
                        why,
                    )
                return path
            refusals.append(f"{path.name}: {reason}")
        raise AssertionError("the torch path accepts every step")

    def run_layers(
        self, layers: Sequence[DecoderLayer], hidden: torch.Tensor, step: ExecutionStep
    ) -> tuple[torch.Tensor, torch.Tensor]:
        path = self.choose(layers, step)
        self.counts[path.name] += 1
        return path.run(layers, hidden, step)

    def describe(self) -> str:
        """The paths in the order they are asked, and how many forward passes each ran."""
        order = " > ".join(path.name for path in self.paths)
        counts = ", ".join(f"{path.name} {self.counts[path.name]}" for path in self.paths)
        return f"execution paths {order}; forward passes: {counts}"


def _bf16_rows(model: CausalLM, kernels: CpuKernels) -> bool:
    """Whether every projection of ``model``'s layers takes bf16 rows as they are at large steps, none sharded (whose
    all-reduce would then sum bf16 rows): packed as bf16 (``model.quantization: bf16``), or as blocks where the block
    GEMM runs on AMX, which rounds its rows to bf16 anyway (``gemm_blocks``' ``amx-bf16`` design)."""
    from infer.model.quantization import PackedLinear

    projections = [
        module
        for layer in model.layers
        for module in layer.modules()
        if isinstance(module, (torch.nn.Linear, PackedLinear))
    ]  # a mixture's experts too
    amx_blocks = kernels.block_gemm == "amx-bf16"
    return (
        bool(projections)
        and model.layers[0].self_attn.tensor_parallel is None
        and all(
            isinstance(module, PackedLinear) and (module.mode == "bf16" or (module.blocks is not None and amx_blocks))
            for module in projections
        )
    )


def choose_attention(
    name: str, registry, environment: AttentionEnvironment, needs: frozenset[str] = frozenset()
) -> str:
    """The attention backend ``attention.name`` selects: ``auto`` is the registered backend whose ``auto_priority``
    is highest in ``environment`` among those that implement ``needs`` (the model's layers' ``LayerAttention.needs``:
    "window", "sinks"; ties: the first name in order; a backend whose class cannot be imported is left out)."""
    if name != "auto":
        return name
    best, best_priority = None, None
    for candidate in registry.names("attention"):
        try:
            backend_class = registry.load("attention", candidate)
            priority = backend_class.auto_priority(environment) if needs <= backend_class.layer_features else None
        except Exception as error:  # a broken third-party backend must not stop auto from choosing another
            logger.debug("attention backend %s left out of auto: %s", candidate, error)
            continue
        if priority is not None and (best_priority is None or priority > best_priority):
            best, best_priority = candidate, priority
    if best is None:
        asked = f" with {' and '.join(sorted(needs))} attention (this model's layers need it)" if needs else ""
        raise ValueError(
            f"attention.name=auto found no registered attention backend that runs here{asked}; install one that "
            "does (infer plugins lists those registered)"
        )
    return best


def step_kernels(config, device: torch.device, dtype: torch.dtype) -> CpuKernels | None:
    """infer's CPU kernels where ``config``'s steps run on them (float32 on a CPU, not compiled by torch: compiled
    code fuses the small ops itself), loaded once (``model.cpu_kernels``); else None."""
    from infer.kernels import cpu as cpu_kernels

    usable = device.type == "cpu" and dtype == torch.float32 and not config.model.compile
    return cpu_kernels.load(config.model.cpu_kernels) if usable else None


def build_executor(
    model: CausalLM, config, device: torch.device, dtype: torch.dtype, quantization: str = "none"
) -> Executor:
    """How steps run through ``model`` for ``config`` (an ``InferConfig``): with infer's CPU kernels for float32 on
    a CPU (``step_kernels``), else torch's ops; bf16 weights' large steps on what ``execution.large_gemm`` chose
    (``executor.gemm``). Every tensor-parallel rank builds its own."""
    model_config, execution = config.model, config.execution
    if model_config.compile:
        model.compile_dense_parts()  # compiled code fuses the small ops itself: no kernels there
    kernels = step_kernels(config, device, dtype)
    # auto: prepared for the largest threshold calibration tries; ``build_model_stack`` sets the measured one.
    max_tokens = execution.fused_max_tokens
    max_tokens = (
        (max(CALIBRATION_CANDIDATES) if kernels is not None else DEFAULT_FUSED_MAX_TOKENS)
        if max_tokens == "auto"
        else max_tokens
    )
    gemm = None
    if kernels is not None and quantization == "bf16":
        gemm = choose_gemm(execution.large_gemm, model, kernels, execution.recalibrate)
    executor = Executor.for_model(model, kernels, execution.paths, max_tokens, gemm)
    if execution.head_screen:
        model.screen_head(kernels)
    return executor


def build_attention(
    registry,
    config,
    model: CausalLM,
    environment: AttentionEnvironment,
) -> tuple[str, AttentionBackend]:
    """The attention backend ``config.attention`` selects (``auto`` resolved by ``choose_attention``) over
    ``model``'s heads (a tensor-parallel rank's: its own), its ``auto`` settings resolved for ``environment`` by the
    backend itself (``AttentionBackend.resolve_config``), and its name."""
    configured = config.attention
    needs = frozenset().union(*(layer.needs for layer in model.layer_attention))
    name = choose_attention(configured.name, registry, environment, needs)
    backend_class = registry.load("attention", name)
    settings = configured if name == configured.name else registry.config_model("attention", name)()
    settings = backend_class.resolve_config(settings, environment)
    backend = backend_class(
        num_heads=model.num_heads,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        block_size=config.cache.block_size,
        dtype=environment.dtype,
        device=environment.device,
        config=settings,
    )
    backend.set_layers(model.layer_attention, model.attention_sinks)
    return name, backend


@dataclass(slots=True)
class ModelStack:
    """A loaded model made ready to run steps: its weights packed, its executor and its attention backend."""

    model: CausalLM
    quantization: str
    executor: Executor
    attention_name: str
    attention: AttentionBackend
    calibration: Calibration | None = None  # where ``execution.fused_max_tokens: auto`` came from
    reuses_freed_memory: bool = False  # ``execution.reuse_freed_memory`` applied (``infer.host.reuse_freed_memory``)


def model_quantization(config, device: torch.device, dtype: torch.dtype, sharded: bool = False) -> str:
    """How ``config``'s model is packed (``model.quantization`` resolved): known before its weights are read, so a
    load can pack each layer as it goes (``layer_preparer``)."""
    from infer.model.loader import resolve_model_path
    from infer.model.quantization import resolve_quantization

    path = resolve_model_path(config.model.path)
    kernels = step_kernels(config, device, dtype) if path.suffix == ".gguf" else None
    return resolve_quantization(  # auto keeps a GGUF file's blocks only on one rank: sharding splits rows
        config.model.quantization, config.model.dtype, dtype, device, None if sharded else path, kernels
    )


def packs_as_read(quantization: str) -> bool:
    """Whether a load packs each layer as it is read for ``quantization``: every mode but unpacked weights (``none``)
    and a GGUF file's blocks (``gguf``: ``load_model`` keeps each layer's as it reads the layer, where it reads the
    file itself, else they are read for the whole model after the load)."""
    return quantization not in ("none", "gguf")


def layer_preparer(quantization: str, shard_layer: Callable[[torch.nn.Module], object] | None = None):
    """What ``load_model`` calls on each layer as soon as it is read (``prepare_layer``): a tensor-parallel rank's
    share of it kept (``shard_layer``), then packed where ``packs_as_read``; None where there is nothing to do per
    layer. ``quantize_model`` packs what the layers leave (the output head, or the whole model where they are not
    packed as read) and skips what is packed, as ``shard_model`` skips the layers sharded."""
    from infer.model.quantization import quantize_linears

    packs = packs_as_read(quantization)
    if shard_layer is None and not packs:
        return None

    def prepare(layer: torch.nn.Module) -> None:
        if shard_layer is not None:
            shard_layer(layer)
        if packs:
            quantize_linears(layer, quantization)
        trim_heap()  # the layer's unpacked weights are freed: their pages go back, not held between packed ones

    return prepare


def load_for_stack(config, registry, device: torch.device, dtype: torch.dtype, shard_layer=None):
    """``config``'s model loaded as ``build_model_stack`` will pack it: each layer kept to a tensor-parallel rank's
    share (``shard_layer``) and packed as soon as it is read (``layer_preparer``), a bf16 checkpoint's matrices held as
    read where they are packed, and RoPE tables for ``model.max_model_len`` positions (LongRoPE chooses its factors
    from it, once for every request). A load then holds one layer's weights beside the layers already prepared."""
    from infer.model.loader import load_model

    quantization = model_quantization(config, device, dtype, sharded=shard_layer is not None)
    keeps_blocks = keeps_checkpoint_blocks(config, quantization, shard_layer is not None)
    if device.type == "cpu" and shard_layer is None:
        warn_if_memory_is_short(config.model.path, quantization, dtype, keeps_blocks)
    return load_model(
        config.model.path,
        dtype,
        device,
        max_positions=config.model.max_model_len,
        architecture=config.model.architecture,
        registry=registry,
        prepare_layer=layer_preparer(quantization, shard_layer),
        bf16_weights=packs_as_read(quantization),  # packing reads bf16 matrices as they are
        keep_gguf_blocks=quantization == "gguf" and shard_layer is None,  # ranks shard float layers first
        keep_checkpoint_blocks=keeps_blocks,
    )


def keeps_checkpoint_blocks(config, quantization: str, sharded: bool) -> bool:
    """Whether a load keeps the blocks a checkpoint stores (gpt-oss's MXFP4 experts: 4.25 bits a weight on the block
    kernels, where bf16 takes 16) as they are: under ``model.quantization: auto`` where it packs the model, on one
    rank, from a safetensors folder or a GGUF file infer reads itself there (``converts_wrongly``: gpt-oss; its
    tables too). Any other GGUF file is read through transformers' conversion, as floats. A mode named explicitly
    dequantizes them and packs them as it says."""
    from infer.model.gguf_weights import converts_wrongly, reads_directly
    from infer.model.loader import resolve_model_path

    if not (config.model.quantization == "auto" and packs_as_read(quantization) and not sharded):
        return False
    path = resolve_model_path(config.model.path)
    return path.suffix != ".gguf" or (converts_wrongly(path) and reads_directly(path))


def warn_if_memory_is_short(path: str, quantization: str, dtype: torch.dtype, keeps_blocks: bool = False) -> None:
    """Say in one line, before the weights are read, when the weights of ``path`` packed as ``quantization`` take more
    than the memory this machine has available (``MemAvailable``), and what ``q4`` weights would take: a start past
    it is killed by the kernel partway through the load, with nothing said. Estimated from the checkpoint's headers
    (``estimated_weight_bytes``); silent, the headers not read, where the mode is not estimated."""
    from infer.host import available_memory
    from infer.model.loader import checkpoint_matrices, resolve_model_path
    from infer.model.quantization import packed_bytes_per_weight, packed_weight_bytes

    if quantization != "none" and packed_bytes_per_weight(quantization) is None:
        return
    available = available_memory()
    if available is None:
        return
    counts = checkpoint_matrices(resolve_model_path(path))  # a folder's safetensors or a GGUF file's directory
    needed = estimated_weight_bytes(counts, quantization, dtype, keeps_blocks)
    if needed is None or needed <= available:
        return
    q4 = packed_weight_bytes("q4_1", counts.matrices + counts.mxfp4, counts.table, 2, counts.tied)
    hint = f"; model.quantization=q4 would hold about {q4 / 2**30:.1f} GiB" if q4 < needed else ""
    logger.warning(
        "model %s: its weights take about %.1f GiB as %s, more than the %.1f GiB this machine has available: the "
        "start may run out of memory%s",
        path,
        needed / 2**30,
        ("float weights" if quantization == "none" else f"{quantization} weights")
        + (" with MXFP4 experts" if keeps_blocks and counts.mxfp4 else ""),
        available / 2**30,
        hint,
    )


def estimated_weight_bytes(counts, quantization: str, dtype: torch.dtype, keeps_blocks: bool = False) -> int | None:
    """What a checkpoint's weights take packed as ``quantization`` (``none``: ``dtype``'s), from its headers' counts
    (``infer.model.loader.checkpoint_matrices``; ``packed_weight_bytes``): MXFP4 experts at their own 4.25 bits a
    weight where the load keeps them (``keeps_blocks``), else as the mode packs them, and there a GGUF file's table
    stored as blocks at their bytes (``BlockEmbedding``). None where the mode is not estimated."""
    from infer.kernels.cpu.blocks import bytes_per_weight
    from infer.model.gguf_blocks import BLOCK_TYPES
    from infer.model.quantization import packed_weight_bytes

    kept = counts.mxfp4 if keeps_blocks else 0  # weights that stay MXFP4, the others dequantized and packed
    matrices = counts.matrices + counts.mxfp4 - kept
    if quantization == "none":
        needed = dtype.itemsize * (matrices + counts.table)
    else:
        table_kind = BLOCK_TYPES.get(counts.table_dtype) if keeps_blocks else None
        table_bytes = 2 if counts.table_dtype == "BF16" else 4 if table_kind is None else bytes_per_weight(table_kind)
        tied = counts.tied and table_kind is None  # a kept table's head multiplies its blocks
        needed = packed_weight_bytes(quantization, matrices, counts.table, table_bytes, tied)
    if needed is None:
        return None
    return needed + int(kept * bytes_per_weight("mxfp4"))


def build_model_stack(
    registry, config, model: CausalLM, device: torch.device, dtype: torch.dtype, shard=None
) -> ModelStack:
    """``model`` sharded (``shard``: a tensor-parallel rank's ``shard(model)``), packed for ``model.quantization``,
    with its executor and attention backend: what the engine and every tensor-parallel rank build alike."""
    from infer.model.loader import resolve_model_path
    from infer.model.quantization import quantize_model

    reuses_freed_memory = device.type == "cpu" and config.execution.reuse_freed_memory and reuse_freed_memory()
    quantization = model_quantization(config, device, dtype, sharded=shard is not None)
    gguf = resolve_model_path(config.model.path) if quantization == "gguf" else None  # its blocks are kept
    model = quantize_model(model if shard is None else shard(model), quantization, gguf)
    executor = build_executor(model, config, device, dtype, quantization)
    environment = AttentionEnvironment(device, dtype, quantization, executor.kernels is not None, executor.float_gemms)
    name, attention = build_attention(registry, config, model, environment)
    calibration = None
    if config.execution.fused_max_tokens == "auto" and executor.kernels is not None:
        if shard is None and quantization != "none":
            calibration = calibrate(
                model, attention, executor, quantization, device, dtype, recalibrate=config.execution.recalibrate
            )
            executor.set_fused_max_tokens(model, calibration.fused_max_tokens)
        else:  # sharded layers never fuse (an all-reduce follows two of their projections), and unpacked float32
            # weights (quantization none) take neither the fused paths nor the GEMV: nothing to measure
            executor.set_fused_max_tokens(model, DEFAULT_FUSED_MAX_TOKENS)
    return ModelStack(model, quantization, executor, name, attention, calibration, reuses_freed_memory)
