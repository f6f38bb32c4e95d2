"""The engine config: YAML file (or shipped preset, or dict) → ``key=value`` overrides → validated, frozen models.

OmegaConf only merges, parses overrides and resolves interpolation; pydantic is the one schema. Each plugin section
(``allocator``, ``prefix_cache``, ``scheduler``, ``attention``, ``drafter``, ``guide``) is validated by the model its
selected plugin registered, so ``load_config(...).scheduler`` is an instance of that plugin's model. Every problem is
reported at once in a ``ConfigError``, one line each:
``scheduler.max_num_seq: unknown key; did you mean "max_num_seqs"?``.
"""

from __future__ import annotations

import difflib
import importlib.resources
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Union

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    SerializeAsAny,
    TypeAdapter,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from infer.allocator import AllocatorConfig
from infer.attention import AttentionConfig
from infer.drafter import DrafterConfig
from infer.guide import GuideConfig
from infer.prefix_cache import PrefixCacheConfig
from infer.registry import KIND_INFO, SECTION_KINDS, PluginError, Registry, get_registry, import_object, normalize_name
from infer.scheduler import SchedulerConfig

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

SHIPPED_CONFIGS = "infer.configs"
DEFAULT_PLUGINS = {
    "allocator": "paged",
    "prefix_cache": "none",
    "scheduler": "fcfs",
    "attention": "auto",
    "drafter": "none",
    "guide": "none",
}
# Kinds whose name may be "auto": the engine picks the plugin for the device and dtype (``infer.execution.paths``), and
# the section takes no keys but the name (name a plugin to set its keys).
AUTO_SELECTED = {"attention": AttentionConfig}
CORE_MODEL_CONFIG = ConfigDict(extra="forbid", frozen=True, strict=True)


class ConfigError(ValueError):
    """Everything wrong with a config, one line per problem (``.errors``), each starting with its dotted path."""

    def __init__(self, errors: Sequence[str]):
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))


class ModelConfig(BaseModel):
    """Section ``model``: which weights to run, and how."""

    model_config = CORE_MODEL_CONFIG
    path: str = Field(
        "smollm2-135m-instruct",
        description="The default model's alias, a Hugging Face folder (config and safetensors), or a .gguf file.",
    )
    architecture: str = Field(
        "auto",
        description="The model family that runs the checkpoint (a registered model "
        'plugin; infer plugins lists them). "auto": the one that serves '
        "the checkpoint's model_type.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="The activations' and the KV cache's dtype. auto: float32 on an x86 CPU, its weights "
        "packed by quantization auto in the 16-bit format that CPU multiplies fastest; bfloat16 on CUDA with bf16 and "
        "on CPUs with native bf16 (ARM); else float32. An explicit bfloat16 computes in bf16 throughout (torch's ops).",
    )
    max_model_len: int = Field(2048, ge=2, description="Longest prompt + output a request may reach, in tokens.")
    seed: int = Field(0, description="Seeds the samplers of requests that set no seed (reproducible runs).")
    device: str = Field("auto", description='"auto": cuda when available, else cpu.')
    quantization: Literal[
        "auto", "none", "fp16", "bf16", "int8", "int8_per_row", "w8a8", "q4", "q8", "q4_0", "q4_1", "q8_0", "gguf"
    ] = Field(
        "auto",
        description='Weights packed for CPU matmuls: "fp16" (half the bytes, near float32 results), "bf16" '
        "(a bf16 model's weights: the GEMV in float32 for a few tokens, oneDNN's bf16 GEMM on "
        'AMX/AVX512-BF16 for more), "int8" '
        "(weight-only int8, a scale per 32 weights: decode steps read about a quarter of "
        'float32\'s bytes through the CPU kernels; some greedy tokens differ), "int8_per_row" '
        '(one scale per row: faster at batch 1, further from float32), "w8a8" (fbgemm\'s int8 '
        'weights and per-call int8 activations; this small model\'s answers change), "q4_0", '
        '"q4_1", "q8_0" (GGUF\'s blocks of 32 with fp16 scales, 4.5 / 5 / 8.5 bits a weight, on '
        "the CPU kernels' block GEMV with int8 activations as llama.cpp for a few tokens, their "
        'block GEMM for more), "q4" and "q8" (q4_1 '
        'and q8_0), "gguf" (a GGUF model.path\'s own Q4_0/Q4_1/Q8_0/Q4_K/Q6_K tensors kept as they are, '
        'other projections as q8_0), "none". '
        '"auto": with dtype auto on an x86 CPU, gguf for a GGUF model.path whose projections are all '
        "blocks where the block GEMM runs on AMX, else bf16 where the CPU multiplies bf16 natively, "
        "else fp16, a checkpoint's MXFP4 experts (gpt-oss, safetensors or GGUF) kept as they are on the block "
        "kernels; none elsewhere.",
    )
    cpu_kernels: Literal["auto"] | bool = Field(
        "auto",
        description="Float32 on a CPU: run RMSNorm (with its residual add), RoPE and SiLU-and-multiply as "
        "infer's C kernels, compiled once with the system's C compiler; with fp16, bf16 or int8 "
        "weights also steps of up to execution.fused_max_tokens tokens (a GEMV over the packed "
        "weights, all layers in one call); attention auto then picks the cpu backend. auto: when a "
        "compiler is found (else torch's ops, with a warning); true: fail without one; false: "
        "torch's ops.",
    )
    compile: bool = Field(
        False,
        description="torch.compile each layer's feed-forward half (needs a C++ compiler "
        "on CPU; the first steps of each new batch shape compile for seconds). "
        "Measured no faster on an AVX2 CPU with packed weights, so off.",
    )

    def resolved_device(self) -> str:
        """The device to run on, with ``auto`` resolved (imports torch)."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


class ExecutionConfig(BaseModel):
    """Section ``execution``: how a step runs through the model (``infer.execution.paths``)."""

    model_config = CORE_MODEL_CONFIG
    paths: list[Literal["fused-stack", "fused-layers", "torch"]] = Field(
        ["fused-stack", "fused-layers", "torch"],
        description="Execution paths in the order each step asks them; the first that accepts runs it. fused-stack: "
        "all layers in one C call (CPU kernels, packed weights, attention cpu); fused-layers: two C "
        "calls per layer around the backend's attention, also for steps past fused_max_tokens where every "
        "projection multiplies on its tiles (AMX, or their float32 FMAs); torch: op by op, accepts every step "
        "(last).",
    )
    fused_max_tokens: int | Literal["auto"] = Field(
        "auto",
        description="Steps of at most this many tokens may take the fused paths and the GEMV (0: never). "
        "auto: where the GEMV stops being faster than the GEMM on this machine and model, "
        "measured once (a few seconds) and cached per CPU (infer.execution.calibration).",
    )
    recalibrate: bool = Field(
        False,
        description="With fused_max_tokens or large_gemm auto: measure again instead of "
        "reading the cached calibration.",
    )
    large_gemm: Literal["auto", "bf16", "float32"] = Field(
        "auto",
        description="With bf16 weights (model.quantization bf16): how steps of more rows than the GEMV takes "
        "multiply. bf16: infer's tile kernel, and past 256 rows oneDNN's bf16 GEMM over the weights unpacked "
        "for the call (inputs rounded to bf16). float32: the tile kernel with float32 FMAs over the same bf16 "
        "weights (float32 inputs). Either way the weights are held once. auto: float32 where measured faster on "
        "this CPU (cached).",
    )
    head_screen: bool = Field(
        True,
        description="With a bf16 output head on infer's CPU kernels: steps of a few greedy rows that ask for "
        "nothing but their token (no logprobs, logit_bias, grammar or pending min_tokens) read an int8 copy of "
        "the head (one byte a weight, held beside it) and compute only the tokens that could be the largest "
        "exactly: the same tokens, the head read at half the bytes (infer.model.head_screen). false: the bf16 "
        "head for every row.",
    )
    reuse_freed_memory: bool = Field(
        True,
        description="On a CPU: glibc's malloc keeps freed memory for the next step's tensors (blocks under 32 "
        "MiB from the heap, up to 1 GiB of free heap kept) instead of returning it to the kernel "
        "and faulting it in again page by page (infer.host.reuse_freed_memory; process-wide). "
        "false: glibc's defaults.",
    )

    @field_validator("fused_max_tokens")
    @classmethod
    def _check_fused_max_tokens(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 0:
            raise ValueError("must be 0 or more, or auto")
        return value

    @field_validator("paths")
    @classmethod
    def _check_paths(cls, value: list[str]) -> list[str]:
        if not value or value[-1] != "torch" or len(set(value)) != len(value):
            raise ValueError("list each path once and end with torch, the path that accepts every step")
        return value


# ``cache.memory_budget: auto``: the KV pool's share beside the weights and the activations.
AUTO_KV_POOL = "2GiB"


class CacheConfig(BaseModel):
    """Section ``cache``: KV pool geometry and size."""

    model_config = CORE_MODEL_CONFIG
    block_size: int = Field(16, description="Tokens per KV block; a power of 2 from 1 to 256.")
    memory_budget: str | float | int = Field(
        "auto",
        description="Memory for the weights, one worst-case step's activations and the KV pool together (the pool "
        'gets what is left): "12GiB", "512MiB", "1.5GB", bytes, or a float in (0, 1] = that fraction of the '
        "device memory free once the weights are loaded, plus theirs. auto: what the weights and the activations "
        "take, plus a 2 GiB pool.",
    )
    num_blocks: int | None = Field(None, ge=2, description="Force the pool size in blocks (tests); beats the budget.")

    @field_validator("block_size")
    @classmethod
    def _check_block_size(cls, value: int) -> int:
        if not 1 <= value <= 256 or value & (value - 1):
            raise ValueError("must be a power of 2 from 1 to 256")
        return value

    @field_validator("memory_budget", mode="before")
    @classmethod
    def _check_memory_budget(cls, value: Any) -> Any:
        if value != "auto":
            parse_memory_budget(value, free_bytes=1)
        return value

    def budget_bytes(self, free_bytes: int, needed_bytes: int = 0) -> int:
        """The budget in bytes, given the device's free memory (used when the budget is a fraction) and what the
        weights and one step's activations need (``auto`` adds ``AUTO_KV_POOL`` to it)."""
        if self.memory_budget == "auto":
            return needed_bytes + parse_memory_budget(AUTO_KV_POOL, free_bytes)
        return parse_memory_budget(self.memory_budget, free_bytes)


class PluginsConfig(BaseModel):
    """Section ``plugins``: ``load`` lists the third-party distributions to load (None = all; infer's always load)."""

    model_config = CORE_MODEL_CONFIG
    load: list[str] | None = Field(
        None,
        description="Third-party plugin distributions to load, as $INFER_PLUGINS=a,b "
        '(null: all; ["none"]: built-ins only).',
    )


class ServerConfig(BaseModel):
    """Section ``server``: the OpenAI-compatible HTTP server."""

    model_config = CORE_MODEL_CONFIG
    host: str = Field("127.0.0.1", description="Address infer serve binds (loopback by default).")
    port: int = Field(8000, ge=0, le=65535, description="Port infer serve binds.")
    api_key: str | None = Field(
        None,
        description="Bearer token the /v1 routes require (and /metrics, unless "
        "metrics_public); $INFER_API_KEY and --api-key take precedence.",
    )
    max_waiting: int = Field(256, ge=1, description="Requests queued beyond this are refused with 429 and Retry-After.")
    shutdown_timeout_s: float = Field(
        30.0,
        ge=0,
        description="On SIGTERM: in-flight requests may finish for three "
        "quarters of this, the rest are aborted, and the server exits within it.",
    )
    max_body_bytes: int = Field(
        4 * 2**20, ge=1024, description="Request bodies larger than this are refused with 413 before they are read."
    )
    allowed_hosts: list[str] | None = Field(
        None,
        description='Host headers the server answers (others get 400), e.g. ["infer.example.com"]; "*" any. '
        "null: the loopback names when bound to a loopback address (a web page cannot reach the "
        "server by DNS rebinding), any otherwise.",
    )
    metrics_public: bool = Field(
        False, description="Serve /metrics without the API key when one is set (it needs the key by default)."
    )
    metrics_vllm_names: bool = Field(
        False,
        description="/metrics also under vLLM's names (vllm:num_requests_running, "
        "vllm:time_to_first_token_seconds, ...) for its dashboards.",
    )
    tool_parser: str = Field(
        "auto",
        description="Reads the model's tool calls in chat completions (tool_choice "
        "auto): a registered tool_parser (infer plugins lists them: hermes, "
        "llama3_json), auto (the one whose format the chat template "
        "uses), or none (calls stay content).",
    )


class ParallelConfig(BaseModel):
    """Section ``parallel``: the model sharded over several processes (``infer.distributed``)."""

    model_config = CORE_MODEL_CONFIG
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="Ranks the model is sharded over (column-parallel QKV "
        "and gate/up, row-parallel output and down, each rank's "
        "KV pool its own KV heads); 1: one process.",
    )
    local_ranks: int | None = Field(
        None,
        ge=1,
        description="Ranks this host starts, 0 .. local_ranks - 1 (null: "
        "all of them); the rest join with infer tp-worker.",
    )
    master_addr: str | None = Field(
        None, description="Address rank 0 listens on for the others (null: $MASTER_ADDR, else 127.0.0.1)."
    )
    master_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Its port (null: $MASTER_PORT, else a free one, which needs every rank on this host).",
    )
    threads_per_rank: int | None = Field(
        None, ge=1, description="torch threads each rank runs (null: this host's cores shared evenly among its ranks)."
    )
    timeout_s: float = Field(
        600.0,
        gt=0,
        description="How long ranks wait for each other to start and for one "
        "collective (a dead local rank is noticed at once).",
    )
    data_parallel_size: int = Field(
        1,
        ge=1,
        description="infer serve: engine replicas, each its own process (and "
        "its tensor-parallel ranks), behind a router (section "
        "router); 1: one engine serves.",
    )

    @model_validator(mode="after")
    def _check_local_ranks(self) -> ParallelConfig:
        if self.local_ranks is not None and self.local_ranks > self.tensor_parallel_size:
            raise ValueError(f"local_ranks {self.local_ranks} exceeds tensor_parallel_size {self.tensor_parallel_size}")
        return self


class RouterConfig(BaseModel):
    """Section ``router``: how ``infer serve --data-parallel-size N`` and ``infer router`` spread requests over
    replicas (``infer.serve.router``)."""

    model_config = CORE_MODEL_CONFIG
    policy: Literal["prefix_affinity", "round_robin"] = Field(
        "prefix_affinity",
        description="prefix_affinity: the replica whose cache most likely holds the longest "
        "prefix of the prompt (the router's record of what it sent where), unless it "
        "is much busier than the idlest; round_robin: in turn.",
    )
    block_chars: int = Field(
        64,
        ge=1,
        description="prefix_affinity: characters per block of the router's record "
        "(about a KV block of 16 tokens of English).",
    )
    max_blocks_per_replica: int = Field(
        200_000,
        ge=1,
        description="prefix_affinity: blocks remembered per replica (least recently routed forgotten first).",
    )
    cache_threshold: float = Field(
        0.3,
        ge=0,
        le=1,
        description="prefix_affinity: below this share of the prompt matched, the idlest replica takes it.",
    )
    balance_abs_threshold: int = Field(
        8,
        ge=0,
        description="prefix_affinity: the matched replica is passed over "
        "when it has this many more requests in flight than the "
        "idlest...",
    )
    balance_rel_threshold: float = Field(1.5, ge=1, description="...and more than this many times as many.")
    health_interval_s: float = Field(1.0, gt=0, description="Seconds between health checks of each replica.")
    failure_threshold: int = Field(
        2,
        ge=1,
        description="Failed health checks in a row that take a replica out "
        "(a refused connection takes it out at once); one good "
        "check brings it back.",
    )
    startup_timeout_s: float = Field(
        600.0, gt=0, description="infer serve --data-parallel-size: how long the replicas may take to load."
    )


class SimulateConfig(BaseModel):
    """Section ``simulate``: how ``infer simulate`` prices a step instead of running the model (every other section
    means what it means in a real run). See ``infer.simulate``."""

    model_config = CORE_MODEL_CONFIG
    cost: Literal["measured", "roofline"] = Field(
        "measured",
        description="measured: a step's time from a fit of real steps on this machine (infer simulate "
        "--fit writes it); roofline: from an accelerator's peak FLOP/s and bandwidth.",
    )
    cost_file: str | None = Field(
        None,
        description="measured: the fitted file (default: the one --fit wrote for "
        "this CPU, model and dtype in the cache dir).",
    )
    accelerator: str = Field("h100", description="roofline: a shipped accelerator (a100, h100, h200) or a YAML file.")
    geometry: str | None = Field(
        None,
        description="roofline: the model's shape, a HF config.json path or a shipped "
        "name (llama-3-8b, llama-3-70b); null: model.path's config.",
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="roofline: accelerators the model is sharded over "
        "(compute, bandwidth and memory scale; all-reduces cost).",
    )
    weight_bytes_per_param: float = Field(2.0, gt=0, description="roofline: 2 for bf16 weights, 1 for fp8/int8.")
    kv_bytes_per_element: float = Field(2.0, gt=0, description="roofline: bytes of one K or V element in the pool.")
    memory_utilization: float = Field(
        0.9, gt=0, le=1, description="roofline: share of accelerator memory for weights and the KV pool."
    )
    acceptance_rate: float = Field(
        0.7, ge=0, le=1, description="With a drafter: the chance each draft token is accepted (then the next is tried)."
    )
    seed: int = Field(0, description="Seed of the simulated acceptance draws.")


CORE_SECTIONS: dict[str, type[BaseModel]] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "execution": ExecutionConfig,
    "server": ServerConfig,
    "plugins": PluginsConfig,
    "simulate": SimulateConfig,
    "parallel": ParallelConfig,
    "router": RouterConfig,
}


class InferConfig(BaseModel):
    """The whole engine config. Build it with ``load_config`` (files, presets, overrides) or ``InferConfig.from_dict``;
    both report every error at once. Plugin sections hold the selected plugin's own model."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    execution: ExecutionConfig = ExecutionConfig()
    allocator: SerializeAsAny[AllocatorConfig] = AllocatorConfig()
    prefix_cache: SerializeAsAny[PrefixCacheConfig] = PrefixCacheConfig()
    scheduler: SerializeAsAny[SchedulerConfig] = SchedulerConfig()
    attention: SerializeAsAny[AttentionConfig] = AttentionConfig()
    drafter: SerializeAsAny[DrafterConfig] = DrafterConfig()
    guide: SerializeAsAny[GuideConfig] = GuideConfig()
    server: ServerConfig = ServerConfig()
    plugins: PluginsConfig = PluginsConfig()
    simulate: SimulateConfig = SimulateConfig()
    parallel: ParallelConfig = ParallelConfig()
    router: RouterConfig = RouterConfig()

    @classmethod
    def from_dict(cls, data: Any, registry: Registry | None = None) -> InferConfig:
        """Validate plain data (no interpolation left); raises ``ConfigError`` listing every problem."""
        if not isinstance(data, Mapping):
            raise ConfigError([f"config: expected a mapping of sections (got {_show(data)})"])
        registry = registry or get_registry(_plugins_load(data))
        errors = _unknown_keys(data, list(cls.model_fields))
        sections = {}
        for name in cls.model_fields:  # absent sections too: they get the default plugin's own model
            try:
                sections[name] = _validate_section(name, data.get(name), registry)
            except ConfigError as error:
                errors.extend(error.errors)
        if errors:
            raise ConfigError(errors)
        return cls(**sections)

    @model_validator(mode="before")
    @classmethod
    def _select_plugin_models(cls, data: Any) -> Any:
        # Direct construction (InferConfig(scheduler={...})) validates plugin sections by the selected plugin too.
        if not isinstance(data, Mapping) or not any(isinstance(data.get(kind), Mapping) for kind in SECTION_KINDS):
            return data
        registry = get_registry(_plugins_load(data))
        return {
            key: _validate_section(key, value, registry)
            if key in SECTION_KINDS and isinstance(value, Mapping)
            else value
            for key, value in data.items()
        }

    def to_dict(self) -> dict[str, Any]:
        """Every section with defaults filled in, as plain JSON-compatible data."""
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        """The resolved config as YAML; loading it back gives an equal config."""
        return OmegaConf.to_yaml(OmegaConf.create(self.to_dict()))


def load_config(
    source: str | Path | Mapping[str, Any] | None = None,
    overrides: Sequence[str] = (),
    registry: Registry | None = None,
) -> InferConfig:
    """Load ``source`` (a YAML path, a shipped config name like ``baseline``, a dict, or None for defaults), apply
    ``key=value`` overrides (values typed by YAML: ``scheduler.max_num_seqs=8`` is an int) and validate.

    Overriding ``<kind>.name`` drops the file's keys in that section that the newly selected plugin's model does not
    know. Raises ``ConfigError`` with every problem found.
    """
    base = _load_source(source)
    errors: list[str] = []
    override_config = _parse_overrides(overrides, errors)
    registry = registry or get_registry(_select_plugins_load(base, override_config))
    _drop_switched_keys(base, override_config, registry)
    try:
        merged = OmegaConf.merge(base, override_config)
    except OmegaConfBaseException as error:
        raise ConfigError([*errors, _omegaconf_message(error)]) from error
    data = _resolve(merged, errors)
    try:
        config = InferConfig.from_dict(data, registry)
    except ConfigError as error:
        raise ConfigError([*errors, *error.errors]) from None
    if errors:
        raise ConfigError(errors)
    return config


def shipped_configs() -> list[str]:
    """Names of the configs shipped in ``infer.configs`` (``baseline.yaml``, ``ablations/....yaml``)."""
    root = importlib.resources.files(SHIPPED_CONFIGS)
    return sorted(_yaml_names(root, prefix=""))


def config_json_schema(registry: Registry | None = None) -> dict[str, Any]:
    """JSON Schema of the whole config; each plugin section is any of its registered plugins' models."""
    registry = registry or get_registry()
    fields: dict[str, Any] = {}
    for name, field in InferConfig.model_fields.items():
        if name in SECTION_KINDS:
            fields[name] = (_section_union(name, registry), Field(default={"name": DEFAULT_PLUGINS[name]}))
        else:
            fields[name] = (field.annotation, field)
    schema_model = create_model("InferConfig", __config__=ConfigDict(extra="forbid"), **fields)
    return schema_model.model_json_schema()


def parse_memory_budget(value: Any, free_bytes: int) -> int:
    """Bytes for a budget given as a size string, a byte count, or a fraction of ``free_bytes``."""
    if isinstance(value, bool):
        raise ValueError("expected a size like 2GiB, a byte count or a fraction in (0, 1]")
    if isinstance(value, float):
        if not 0 < value <= 1:
            raise ValueError('a float is a fraction of free device memory in (0, 1]; for a size write e.g. "2GiB"')
        return int(value * free_bytes)
    if isinstance(value, int):
        if value <= 0:
            raise ValueError("must be a positive number of bytes")
        return value
    if isinstance(value, str):
        return _parse_size(value)
    raise ValueError("expected a size like 2GiB, a byte count or a fraction in (0, 1]")


def _parse_size(text: str) -> int:
    """A size string in bytes, parsed by pydantic's ``ByteSize`` (decimal and binary units, any case)."""
    try:
        size = int(TypeAdapter(ByteSize).validate_python(text))
    except ValidationError:
        raise ValueError(
            "not a size: use a number with a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 2GiB"
        ) from None
    if size <= 0:
        raise ValueError("must be a positive size")
    return size


def _validate_section(name: str, value: Any, registry: Registry) -> BaseModel:
    if name in SECTION_KINDS:
        return _plugin_section(name, value, registry)
    return _core_section(name, value)


def _core_section(name: str, value: Any) -> BaseModel:
    model = CORE_SECTIONS[name]
    if isinstance(value, model):
        return value
    try:
        return model.model_validate({} if value is None else value)
    except ValidationError as error:
        raise ConfigError(_format_validation_error(error, name, model)) from error


def _plugin_section(kind: str, value: Any, registry: Registry) -> BaseModel:
    if isinstance(value, BaseModel):
        return value
    section = {} if value is None else value
    if not isinstance(section, Mapping):
        raise ConfigError([f"{kind}: expected a mapping with a name key (got {_show(section)})"])
    name = section.get("name", DEFAULT_PLUGINS[kind])
    if not isinstance(name, str):
        raise ConfigError([f"{kind}.name: expected a plugin name (got {_show(name)})"])
    try:
        model = _config_model(kind, name, registry)
    except PluginError as error:
        raise ConfigError([f"{kind}.name: {error}"]) from error
    try:
        return model.model_validate({**section, "name": normalize_name(name)})
    except ValidationError as error:
        raise ConfigError(_format_validation_error(error, kind, model)) from error


def _format_validation_error(error: ValidationError, prefix: str, model: type[BaseModel]) -> list[str]:
    return [_format_error_line(item, prefix, model) for item in error.errors()]


def _format_error_line(item: Mapping[str, Any], prefix: str, model: type[BaseModel]) -> str:
    location = tuple(item["loc"])
    path = ".".join([prefix, *map(str, location)])
    if item["type"] == "extra_forbidden":
        return f"{path}: unknown key{_did_you_mean(str(location[-1]), _field_names(model, location[:-1]))}"
    message = item["msg"].removeprefix("Value error, ")
    if item["type"] == "missing":
        return f"{path}: {message}"
    return f"{path}: {message} (got {_show(item['input'])})"


def _field_names(model: type[BaseModel], location: tuple[Any, ...]) -> list[str]:
    for key in location:
        field = model.model_fields.get(str(key))
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return []
        model = field.annotation
    return list(model.model_fields)


def _unknown_keys(data: Mapping[str, Any], known: list[str]) -> list[str]:
    return [f"{key}: unknown key{_did_you_mean(str(key), known)}" for key in data if key not in known]


def _did_you_mean(key: str, candidates: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    return f'; did you mean "{close[0]}"?' if close else ""


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _plugins_load(data: Mapping[str, Any]) -> list[str] | None:
    # Only a well-formed list limits loading; a malformed one is reported by the plugins section's validation.
    plugins = data.get("plugins")
    load = plugins.get("load") if isinstance(plugins, Mapping) else None
    return load if isinstance(load, list) and all(isinstance(name, str) for name in load) else None


def _select_plugins_load(base: DictConfig, override_config: DictConfig) -> list[str] | None:
    for config in (override_config, base):
        load = _plugins_load(_plain(config, resolve=False))
        if load is not None:
            return load
    return None


def _load_source(source: str | Path | Mapping[str, Any] | None) -> DictConfig:
    if source is None:
        return OmegaConf.create()
    if isinstance(source, Mapping):
        return _as_mapping(OmegaConf.create(dict(source)), "config")
    path = Path(source)
    if path.is_file():
        return _as_mapping(_parse_yaml(path.read_text(), str(path)), str(path))
    if isinstance(source, str):
        shipped = _find_shipped(source)
        if shipped is not None:
            return _as_mapping(_parse_yaml(shipped.read_text(), f"{SHIPPED_CONFIGS}/{shipped.name}"), source)
    raise ConfigError(
        [
            f"config: no file {str(source)!r} and no shipped config of that name "
            f"(shipped: {', '.join(shipped_configs()) or 'none'})"
        ]
    )


def _find_shipped(name: str) -> Traversable | None:
    file_name = name if name.endswith(".yaml") else f"{name}.yaml"
    resource = importlib.resources.files(SHIPPED_CONFIGS).joinpath(*file_name.split("/"))
    return resource if resource.is_file() else None


def _yaml_names(folder: Traversable, prefix: str) -> list[str]:
    names = []
    for entry in folder.iterdir():
        if entry.is_dir():
            names.extend(_yaml_names(entry, f"{prefix}{entry.name}/"))
        elif entry.name.endswith(".yaml"):
            names.append(prefix + entry.name)
    return names


def _parse_yaml(text: str, origin: str) -> DictConfig | ListConfig:
    try:
        return OmegaConf.create(text)
    except Exception as error:  # YAML syntax errors come from yaml, not OmegaConf
        raise ConfigError([f"{origin}: invalid YAML: {' '.join(str(error).split())}"]) from error


def _as_mapping(config: DictConfig | ListConfig, origin: str) -> DictConfig:
    if not isinstance(config, DictConfig):
        raise ConfigError([f"{origin}: expected a mapping of sections at the top level (got a list)"])
    return config


def _parse_overrides(overrides: Sequence[str], errors: list[str]) -> DictConfig:
    parsed = OmegaConf.create()
    for item in overrides:
        problem = _override_problem(item)
        if problem:
            errors.append(f'override "{item}": {problem}')
            continue
        try:
            parsed = OmegaConf.merge(parsed, OmegaConf.from_dotlist([item]))
        except OmegaConfBaseException as error:
            errors.append(f'override "{item}": {_omegaconf_message(error)}')
    return parsed


def _override_problem(item: str) -> str | None:
    key, separator, _ = item.partition("=")
    if key.startswith(("+", "~")):
        return (
            '"+" (add) and "~" (delete) prefixes are not supported; '
            f"write {key.lstrip('+~') or 'key'}=value (any key may be set without declaring it)"
        )
    if not separator or not key.strip():
        return "expected key=value, e.g. scheduler.max_num_seqs=8"
    return None


def _drop_switched_keys(base: DictConfig, override_config: DictConfig, registry: Registry) -> None:
    for kind in SECTION_KINDS:
        new_name = _section_name(override_config, kind)
        section = base.get(kind)
        if new_name is None or not isinstance(section, DictConfig):
            continue
        old_name = _section_name(base, kind) or DEFAULT_PLUGINS[kind]
        if normalize_name(old_name) == normalize_name(new_name):
            continue
        known = _known_fields(kind, new_name, registry)
        base[kind] = {key: value for key, value in _plain(section, resolve=False).items() if key in known}


def _section_name(config: DictConfig, kind: str) -> str | None:
    section = config.get(kind)
    name = section.get("name") if isinstance(section, DictConfig) else None
    return name if isinstance(name, str) else None


def _known_fields(kind: str, name: str, registry: Registry) -> set[str]:
    try:
        return set(_config_model(kind, name, registry).model_fields) - {"name"}
    except PluginError:
        return set()  # the unknown or broken name is reported by validation


def _resolve(config: DictConfig, errors: list[str]) -> dict[str, Any]:
    # Section by section, so one bad interpolation does not hide problems elsewhere.
    data = {}
    for key in _plain(config, resolve=False):
        try:
            data[key] = _plain(config[key])
        except OmegaConfBaseException as error:
            errors.append(_omegaconf_message(error))
    return data


def _plain(value: Any, resolve: bool = True) -> Any:
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=resolve, throw_on_missing=resolve)
    return value


def _omegaconf_message(error: OmegaConfBaseException) -> str:
    message = (getattr(error, "msg", None) or str(error)).splitlines()[0]
    key = getattr(error, "full_key", None)
    return f"{key}: {message}" if key else message


def _config_model(kind: str, name: str, registry: Registry) -> type[BaseModel]:
    """The model that validates section ``kind`` when it names ``name``."""
    if kind in AUTO_SELECTED and normalize_name(name) == "auto":
        return AUTO_SELECTED[kind]
    return registry.config_model(kind, name)


def _section_union(kind: str, registry: Registry) -> Any:
    models = [AUTO_SELECTED[kind]] if kind in AUTO_SELECTED else []
    for name in registry.names(kind):
        try:
            model = registry.config_model(kind, name)
        except PluginError:
            continue  # a broken plugin cannot describe its section
        if model not in models:
            models.append(model)
    # Union[...] over a tuple built at run time: the X | Y form has no spelling for it.
    return Union[tuple(models)] if models else import_object(KIND_INFO[kind].config_base)  # noqa: UP007
