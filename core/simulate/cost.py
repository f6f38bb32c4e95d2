"""Cost models: how long one engine step takes, from its ``StepShape`` alone.

- ``MeasuredCost``: a linear model over the shape's features (a constant per step, per prefill token, per decode
  token, per sequence, per logits row, per key a decode row attends over, per query-key pair of a prefill chunk, per
  distinct KV block the decode rows read: a prefix shared by many rows stays in cache and costs less per key),
  fitted by non-negative least squares on relative error to real steps of this machine (``fit_measured``), stored
  as a small JSON file with the pool size the real engine had.
- ``RooflineCost``: an accelerator's peak FLOP/s and memory bandwidth over a model geometry (a HF ``config.json``):
  a step takes the longer of its FLOPs at peak and its bytes (weights once, KV read and written) at bandwidth, each
  at a stated efficiency, plus a fixed per-step overhead and, with tensor parallelism, two ring all-reduces per layer
  over the interconnect.
"""

from __future__ import annotations

import json
import platform
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from infer.scheduler import FEATURE_NAMES, StepShape

COST_FILE_VERSION = 2  # 2: the distinct decode context blocks feature
# Roofline assumptions (stated in docs/research.md): the share of peak a tuned engine reaches, its per-step host
# overhead (scheduling, launches; CUDA graphs in decode), one all-reduce's latency, and the memory kept for activations.
FLOPS_EFFICIENCY = 0.6
BANDWIDTH_EFFICIENCY = 0.8
STEP_OVERHEAD_S = 2e-3
ALLREDUCE_LATENCY_S = 8e-6
ACTIVATION_RESERVE = 0.05


class CostModelError(ValueError):
    """A cost model cannot be built (missing fit file, unknown accelerator or geometry); the message says what to do."""


class CostModel(ABC):
    """Prices one step; knows how large the KV pool of the priced deployment is."""

    name: str
    kv_bytes_per_token: float

    @abstractmethod
    def step_time(self, shape: StepShape) -> float:
        """Seconds the step takes."""

    @abstractmethod
    def kv_pool_tokens(self, block_size: int) -> int:
        """Token slots the deployment's KV pool holds."""

    @abstractmethod
    def describe(self) -> str:
        """One line for ``infer simulate``'s header."""


# -- measured ---------------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class MeasuredCost(CostModel):
    """A fit of real steps (``fit_measured``): seconds per unit of each ``FEATURE_NAMES`` feature."""

    coefficients: dict[str, float]
    kv_pool_slots: int  # token slots of the real engine's pool when the fit was measured
    kv_bytes_per_token: int = 0
    machine: str = ""
    engine: dict[str, Any] = field(default_factory=dict)
    quality: dict[str, float] = field(default_factory=dict)
    name: str = "measured"

    def step_time(self, shape: StepShape) -> float:
        coefficients = self._ordered
        return sum(c * x for c, x in zip(coefficients, shape.features()))

    @property
    def _ordered(self) -> tuple[float, ...]:
        return tuple(self.coefficients[name] for name in FEATURE_NAMES)

    def kv_pool_tokens(self, block_size: int) -> int:
        return self.kv_pool_slots

    def describe(self) -> str:
        per = ", ".join(f"{name} {value * 1e6:.3g} us" for name, value in self.coefficients.items() if value)
        error = self.quality.get("median_abs_relative_error")
        fit = f"; fit median |error| {error:.1%} over {self.quality.get('num_steps', 0):.0f} steps" if error else ""
        return f"measured cost on {self.machine or 'this machine'} ({per}{fit})"

    def to_dict(self) -> dict[str, Any]:
        return {"version": COST_FILE_VERSION, **asdict(self)}

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> MeasuredCost:
        if not path.is_file():
            raise CostModelError(
                f"no measured cost model at {path}; make one with `infer simulate CONFIG --fit` "
                f"(it runs real steps on this machine), or set simulate.cost=roofline"
            )
        data = json.loads(path.read_text())
        if data.pop("version", None) != COST_FILE_VERSION:
            raise CostModelError(f"{path} was written by another version of infer; fit it again with --fit")
        missing = [name for name in FEATURE_NAMES if name not in data.get("coefficients", {})]
        if missing:
            raise CostModelError(f"{path}: coefficients lack {', '.join(missing)}; fit it again with --fit")
        return cls(**data)


def default_cost_file(config) -> Path:
    """Where ``--fit`` writes (and ``measured`` reads) the fit for ``config``'s model, dtype, quantization, attention,
    block size and memory budget on this CPU: what a step's cost and the pool depend on, not the scheduling limits or
    the plugins (a fit serves every scheduler and prefix cache, and any ``max_num_seqs``)."""
    import hashlib

    from infer.host import cache_dir, cpu_signature

    model = config.model
    key = json.dumps(
        [
            cpu_signature(),
            model.path,
            model.dtype,
            model.quantization,
            model.max_model_len,
            config.cache.block_size,
            config.cache.memory_budget,
            config.cache.num_blocks,
            config.attention.name,
        ]
    )
    return cache_dir() / "simulate" / f"measured-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def fit_measured(
    steps: list[tuple[StepShape, float]], kv_pool_slots: int, kv_bytes_per_token: int, engine: dict[str, Any]
) -> MeasuredCost:
    """Non-negative least squares of step durations on the shape features, on relative error (each step weighted
    by its duration's inverse: a 10 ms decode step counts as much as a 1 s prefill), the steps with prefill tokens
    and the decode-only ones weighing the same in all (a run has far more decode steps, but its TTFTs are made of
    the few prefill ones)."""
    import numpy as np

    if len(steps) < len(FEATURE_NAMES):
        raise CostModelError(f"{len(steps)} steps are too few to fit {len(FEATURE_NAMES)} coefficients")
    features = np.array([shape.features() for shape, _ in steps], dtype=np.float64)
    durations = np.array([duration for _, duration in steps], dtype=np.float64)
    weights = 1.0 / np.maximum(durations, 1e-6)
    prefill = np.array([shape.num_prefill_tokens > 0 for shape, _ in steps])
    if 0 < prefill.sum() < len(steps):
        weights *= np.where(
            prefill, np.sqrt(len(steps) / (2 * prefill.sum())), np.sqrt(len(steps) / (2 * (~prefill).sum()))
        )
    solution = nonnegative_least_squares(features * weights[:, None], durations * weights)
    relative = np.abs(features @ solution - durations) / durations
    quality = {
        "num_steps": float(len(steps)),
        "median_abs_relative_error": float(np.median(relative)),
        "p90_abs_relative_error": float(np.quantile(relative, 0.9)),
        "total_time_relative_error": float((features @ solution).sum() / durations.sum() - 1),
    }
    return MeasuredCost(
        dict(zip(FEATURE_NAMES, map(float, solution))),
        kv_pool_slots,
        kv_bytes_per_token,
        machine_name(),
        engine,
        quality,
    )


def nonnegative_least_squares(matrix, target, sweeps: int = 5000):
    """argmin ||matrix @ x - target|| over x >= 0, by cyclic coordinate descent on the normal equations (columns
    scaled to unit norm first); exact enough for a handful of well-scaled features."""
    import numpy as np

    scale = np.linalg.norm(matrix, axis=0)
    scale[scale == 0] = 1.0
    scaled = matrix / scale
    gram, moment = scaled.T @ scaled, scaled.T @ target
    x = np.zeros(matrix.shape[1])
    for _ in range(sweeps):
        previous = x.copy()
        for j in range(len(x)):
            if gram[j, j] > 0:
                x[j] = max(0.0, x[j] - (gram[j] @ x - moment[j]) / gram[j, j])
        if np.max(np.abs(x - previous)) <= 1e-12 * max(1.0, np.max(np.abs(x))):
            break
    return x / scale


def machine_name() -> str:
    """The CPU's model name and core count (``/proc/cpuinfo``), for the fit file and reports."""
    import os

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.partition(':')[2].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return platform.processor() or platform.machine()


# -- roofline ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Accelerator:
    """One device's datasheet numbers (``configs/simulate/accelerators.yaml``)."""

    name: str
    peak_flops: float
    memory_bandwidth: float
    memory_bytes: float
    link_bandwidth: float
    description: str = ""
    flops_efficiency: float = FLOPS_EFFICIENCY
    bandwidth_efficiency: float = BANDWIDTH_EFFICIENCY
    step_overhead_s: float = STEP_OVERHEAD_S
    allreduce_latency_s: float = ALLREDUCE_LATENCY_S


@dataclass(frozen=True, slots=True)
class Geometry:
    """A decoder's shape, read from a HF ``config.json``."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @property
    def params_per_layer(self) -> int:
        attention = self.hidden_size * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        attention += self.num_heads * self.head_dim * self.hidden_size
        return attention + 3 * self.hidden_size * self.intermediate_size  # gated MLP: gate, up, down

    @property
    def num_params(self) -> int:
        """Weights a step reads: every layer and the output head (the embedding is only gathered)."""
        return self.num_layers * self.params_per_layer + self.vocab_size * self.hidden_size

    @classmethod
    def from_hf_config(cls, data: dict[str, Any], name: str) -> Geometry:
        heads = data["num_attention_heads"]
        return cls(
            name=name,
            num_layers=data["num_hidden_layers"],
            hidden_size=data["hidden_size"],
            intermediate_size=data["intermediate_size"],
            num_heads=heads,
            num_kv_heads=data.get("num_key_value_heads", heads),
            head_dim=data.get("head_dim") or data["hidden_size"] // heads,
            vocab_size=data["vocab_size"],
        )


@dataclass(frozen=True, slots=True)
class RooflineCost(CostModel):
    """A step's time on ``tensor_parallel_size`` accelerators: max(FLOPs / achievable FLOP/s, bytes / achievable
    bandwidth) + per-step overhead + all-reduces."""

    accelerator: Accelerator
    geometry: Geometry
    tensor_parallel_size: int = 1
    weight_bytes_per_param: float = 2.0
    kv_bytes_per_element: float = 2.0
    memory_utilization: float = 0.9
    name: str = "roofline"

    @property
    def kv_bytes_per_token(self) -> float:
        """All ranks together; KV heads are replicated where there are fewer than ranks (vLLM's rule)."""
        g = self.geometry
        heads = max(g.num_kv_heads, self.tensor_parallel_size)
        return 2 * g.num_layers * heads * g.head_dim * self.kv_bytes_per_element

    @property
    def weight_bytes(self) -> float:
        return self.geometry.num_params * self.weight_bytes_per_param

    def kv_pool_tokens(self, block_size: int) -> int:
        memory = self.accelerator.memory_bytes * self.tensor_parallel_size
        available = memory * (self.memory_utilization - ACTIVATION_RESERVE) - self.weight_bytes
        if available <= 0:
            raise CostModelError(
                f"{self.geometry.name} needs {self.weight_bytes / 1e9:.0f} GB of weights, more than "
                f"{self.tensor_parallel_size} x {self.accelerator.name} hold at memory_utilization "
                f"{self.memory_utilization}; raise simulate.tensor_parallel_size"
            )
        return int(available // self.kv_bytes_per_token)

    def step_time(self, shape: StepShape) -> float:
        g, a, tp = self.geometry, self.accelerator, self.tensor_parallel_size
        tokens = shape.num_prefill_tokens + shape.num_decode_tokens
        attended = shape.decode_context_tokens + shape.prefill_attention_pairs
        flops = (
            2 * tokens * g.num_layers * g.params_per_layer
            + 2 * shape.num_logit_rows * g.hidden_size * g.vocab_size
            + 4 * g.num_layers * g.num_heads * g.head_dim * attended
        )
        kv_bytes = (shape.decode_context_tokens + tokens) * self.kv_bytes_per_token
        compute_s = flops / (tp * a.peak_flops * a.flops_efficiency)
        memory_s = (self.weight_bytes + kv_bytes) / (tp * a.memory_bandwidth * a.bandwidth_efficiency)
        return max(compute_s, memory_s) + a.step_overhead_s + self.allreduce_time(tokens)

    def allreduce_time(self, tokens: int) -> float:
        """Two ring all-reduces per layer (after attention and after the MLP) of the step's activations."""
        tp = self.tensor_parallel_size
        if tp == 1 or tokens == 0:
            return 0.0
        size = tokens * self.geometry.hidden_size * self.weight_bytes_per_param
        one = 2 * (tp - 1) / tp * size / self.accelerator.link_bandwidth + self.accelerator.allreduce_latency_s
        return 2 * self.geometry.num_layers * one

    def describe(self) -> str:
        a = self.accelerator
        return (
            f"roofline cost: {self.geometry.name} ({self.geometry.num_params / 1e9:.1f}B params) on "
            f"{self.tensor_parallel_size} x {a.description or a.name} ({a.peak_flops / 1e12:.0f} TFLOP/s at "
            f"{a.flops_efficiency:.0%}, {a.memory_bandwidth / 1e12:.2f} TB/s at {a.bandwidth_efficiency:.0%}, "
            f"{a.step_overhead_s * 1e3:.1f} ms per step)"
        )


def _shipped(relative: str):
    import importlib.resources

    return importlib.resources.files("infer.configs") / "simulate" / relative


def load_accelerator(name: str) -> Accelerator:
    """A shipped accelerator (``h100``) or a YAML file with one mapping of ``Accelerator``'s fields."""
    import yaml

    path = Path(name)
    if path.is_file():
        data = yaml.safe_load(path.read_text())
        return _accelerator(data.pop("name", path.stem), data, str(path))
    shipped = yaml.safe_load(_shipped("accelerators.yaml").read_text())
    if name not in shipped:
        raise CostModelError(
            f"unknown accelerator {name!r}: shipped ones are {', '.join(shipped)}, or give a YAML "
            f"file with peak_flops, memory_bandwidth, memory_bytes and link_bandwidth"
        )
    return _accelerator(name, shipped[name], "accelerators.yaml")


def _accelerator(name: str, data: dict[str, Any], source: str) -> Accelerator:
    # YAML 1.1 reads 80.0e9 (no exponent sign) as a string: numbers are converted here.
    try:
        return Accelerator(
            name=name, **{key: value if key == "description" else float(value) for key, value in data.items()}
        )
    except (TypeError, ValueError) as error:
        raise CostModelError(f"{source}: accelerator {name!r}: {error}") from None


def load_geometry(name: str | None, model_path: str) -> Geometry:
    """A shipped geometry (``llama-3-70b``), a HF ``config.json`` (or a folder holding one), or, for None, the
    config of ``model.path``."""
    if name is None:
        from infer.model.loader import hf_model_dir

        path = hf_model_dir(model_path) / "config.json"
        return Geometry.from_hf_config(json.loads(path.read_text()), model_path)
    path = Path(name)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return Geometry.from_hf_config(
            json.loads(path.read_text()), path.parent.name if path.name == "config.json" else path.stem
        )
    shipped = _shipped(f"geometry/{name}.json")
    if not shipped.is_file():
        names = sorted(item.name.removesuffix(".json") for item in _shipped("geometry").iterdir())
        raise CostModelError(
            f"unknown geometry {name!r}: shipped ones are {', '.join(names)}, or give a path to a HF config.json"
        )
    return Geometry.from_hf_config(json.loads(shipped.read_text()), name)


def build_cost_model(config) -> CostModel:
    """The cost model ``config.simulate`` asks for."""
    sim = config.simulate
    if sim.cost == "measured":
        return MeasuredCost.load(Path(sim.cost_file) if sim.cost_file else default_cost_file(config))
    return RooflineCost(
        load_accelerator(sim.accelerator),
        load_geometry(sim.geometry, config.model.path),
        sim.tensor_parallel_size,
        sim.weight_bytes_per_param,
        sim.kv_bytes_per_element,
        sim.memory_utilization,
    )
