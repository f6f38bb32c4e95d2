"""The attention-backend contract and the batch metadata every backend receives."""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict

from infer.host import zeroed_pages


class AttentionConfig(BaseModel):
    """Config section ``attention``. Plugins subclass it to add their own keys. ``name: auto`` (the default) lets the
    engine pick: the registered backend whose ``auto_priority`` is highest where the model runs (the built-ins:
    ``cpu`` for float32 on a CPU with infer's kernels, else ``sdpa``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = "auto"


@dataclass(frozen=True, slots=True)
class AttentionEnvironment:
    """What the engine knows, before it builds the attention backend, of where and how the model runs: what
    ``AttentionBackend.auto_priority`` and ``resolve_config`` decide from."""

    device: torch.device
    dtype: torch.dtype  # the activations' dtype
    quantization: str = "none"  # the weights' packing (``model.quantization`` resolved): "none", "fp16", "bf16", ...
    cpu_kernels: bool = False  # infer's C kernels are built and run this model's small ops (``infer.kernels.cpu``)
    float_gemms: bool = False  # bf16 weights' large steps multiply on float32 FMAs (``execution.large_gemm``)


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """What one layer's attention needs beyond causal attention over the heads' shape, as the model declares it
    (``infer.model.architecture``). The default is a Llama layer's: every earlier token, scale ``head_dim ** -0.5``.

    ``window``: sliding-window attention; the query at position ``p`` sees the keys at positions ``p - window + 1``
    to ``p`` (``window`` tokens, itself included: transformers' mask ``kv_idx > q_idx - window``). ``scale``: the
    softmax scale (None: ``head_dim ** -0.5``). ``sinks``: attention sinks (gpt-oss): a learned logit ``sink[h]`` per
    query head joins each row's softmax denominator and takes probability without adding a value,
    ``out = sum_j exp(s_j - m) v_j / (exp(sink[h] - m) + sum_j exp(s_j - m))`` with ``m`` the largest of the scores
    and the sink. The logits are weights: the model hands them to ``AttentionBackend.set_layers``."""

    window: int | None = None
    scale: float | None = None
    sinks: bool = False

    def __post_init__(self):
        if self.window is not None and self.window < 1:
            raise ValueError(f"a sliding window must hold at least one token, got {self.window}")

    @property
    def needs(self) -> frozenset[str]:
        """The ``AttentionBackend.layer_features`` this layer asks of a backend."""
        return frozenset(name for name, asked in (("window", self.window is not None), ("sinks", self.sinks)) if asked)


FULL_ATTENTION = LayerAttention()


class BackendUnavailableError(RuntimeError):
    """The backend cannot run here (no CUDA, unsupported dtype or head size); the message says what to use."""


@dataclass(slots=True)
class AttentionMetadata:
    """One step's flattened, unpadded batch: B sequences, T tokens in all.

    Sequence ``i`` owns query tokens ``query_start_loc[i]:query_start_loc[i+1]`` at positions
    ``seq_lens[i] - query_len_i ... seq_lens[i] - 1``; each attends to every position ``<=`` its own in its sequence
    (bottom-right causal), reading cached positions through ``block_tables[i]``.

    Draft trees (``own_keys`` not None; only for backends that declare ``draft_trees``): a sequence's last tokens may
    be a tree of drafts (``infer.drafter.DraftTree``) in a caterpillar's shape, a spine of drafts each after the one
    before it and leaves hanging off the spine. Token ``t``'s K/V are always written at its own slot
    (``slot_mapping[t]``, the next token index of the sequence), but a leaf sits at the position of the spine draft it
    stands beside (``positions[t]``, which RoPE uses): it attends to every position ``<=`` its own, the last of them,
    its own position, read from the sequence's token index ``own_keys[t]`` (its own slot) instead of from the spine.
    ``own_keys[t]`` is -1 for every other token.
    """

    positions: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32, context length after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0 (the null block)
    slot_mapping: torch.Tensor  # [T] int64, -1 = padding (not written)
    max_query_len: int
    max_seq_len: int
    # Host copies for backends that loop on the CPU side.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    own_keys: torch.Tensor | None = None  # [T] int64: draft trees' leaves (see above); None when the step has none

    @classmethod
    def build(
        cls,
        block_tables: list[list[int]],
        num_cached: list[int],
        num_new: list[int],
        block_size: int,
        device: torch.device | str = "cpu",
        draft_depths: list[list[int] | None] | None = None,
    ) -> AttentionMetadata:
        """Metadata for sequences with ``num_cached[i]`` tokens already in the pool computing ``num_new[i]`` more,
        their K/V stored through ``block_tables[i]`` (what the engine's runner builds each step). ``draft_depths[i]``
        (None: a chain, or no drafts): the depth in its draft tree of each draft among sequence ``i``'s last new
        tokens (1 for a child of the last committed token), which places the tree's leaves."""
        width = max(len(table) for table in block_tables)
        tables = torch.tensor([table + [0] * (width - len(table)) for table in block_tables], dtype=torch.int32)
        # Plain lists, one tensor each: a tensor op per sequence (or even a few per step) costs more than the
        # arithmetic, at batch 1 (an EAGLE chain step) as at batch 64.
        span = [(table, range(c, c + n)) for table, c, n in zip(block_tables, num_cached, num_new)]
        positions = [p for _, run in span for p in run]
        slots = torch.tensor(
            [table[p // block_size] * block_size + p % block_size for table, run in span for p in run],
            dtype=torch.int64,
        )
        own_keys = None
        if draft_depths is not None and any(draft_depths):
            own_keys = [-1] * len(positions)
            for end, run, depths in zip(itertools.accumulate(num_new), span, draft_depths):
                if not depths:
                    continue
                root = run[1][-1] - len(depths)  # the last committed token's index
                for offset, depth in enumerate(depths):
                    token = end - len(depths) + offset
                    if root + depth != positions[token]:  # a leaf: beside the spine's draft at its depth
                        own_keys[token] = positions[token]
                        positions[token] = root + depth
            own_keys = torch.tensor(own_keys, dtype=torch.int64, device=device)
        seq_lens = [c + n for c, n in zip(num_cached, num_new)]
        query_start_loc = torch.tensor([0, *itertools.accumulate(num_new)], dtype=torch.int32)
        return cls(
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            query_start_loc=query_start_loc.to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=tables.to(device),
            slot_mapping=slots.to(device),
            max_query_len=max(num_new),
            max_seq_len=max(seq_lens),
            query_lens_cpu=list(num_new),
            seq_lens_cpu=seq_lens,
            own_keys=own_keys,
        )

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(ABC):
    """Reads and writes the paged KV pool for one model.

    Pool layout per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K then V); the engine allocates
    one tensor for all layers with ``allocate_kv_cache`` (``kv_cache_shape(num_layers, num_blocks)`` in
    ``kv_dtype``, the activations' dtype unless the backend stores K/V narrower) and passes ``kv_cache[layer]``.
    ``slot = block_table[pos // block_size] * block_size + pos % block_size``.
    """

    config_model: ClassVar[type[AttentionConfig]] = AttentionConfig
    # True for a backend that attends draft trees' leaves as ``AttentionMetadata.own_keys`` says; the engine drafts
    # chains only (a tree's spine) for every other.
    draft_trees: ClassVar[bool] = False
    # What a backend implements of ``LayerAttention`` beyond full causal attention: "window", "sinks". A model whose
    # layers need more is refused when the backend is built (``set_layers``), naming what is missing.
    layer_features: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def auto_priority(cls, environment: AttentionEnvironment) -> int | None:
        """How strongly ``attention.name: auto`` wants this backend in ``environment``: the registered backend with
        the highest number is built (ties: the first name in order); None (the default) means never by ``auto``.
        The built-ins: ``sdpa`` 1 everywhere, ``cpu`` 2 for float32 on a CPU with infer's kernels. Called before any
        backend is built, so it must not raise."""
        return None

    @classmethod
    def resolve_config(cls, config: AttentionConfig, environment: AttentionEnvironment) -> AttentionConfig:
        """``config`` with this backend's ``auto`` settings resolved for ``environment`` (a new model: configs are
        frozen). Called once before the backend is built; the default returns ``config`` unchanged."""
        return config

    def __init__(
        self,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        config: AttentionConfig | None = None,
    ):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.config = config or self.config_model()
        self.scale = head_dim**-0.5
        self.kv_dtype = dtype  # the pool's dtype; a backend may store K/V narrower (``cpu``: bfloat16)
        self.layers: tuple[LayerAttention, ...] = ()  # per pool layer (``set_layers``); () : every layer full
        self.sinks: tuple[torch.Tensor | None, ...] = ()  # per pool layer: its sink logits (``layer_sinks``)
        self.check_supported()

    def set_layers(self, layers: Sequence[LayerAttention], sinks: Sequence[torch.Tensor | None] | None = None) -> None:
        """Declare what each layer of the pool needs (``layers[i]`` for ``kv_cache[i]``), once, before any step.
        Raises ``BackendUnavailableError`` naming the features this backend lacks. A scale shared by every layer
        becomes ``self.scale``; layers of different scales need a backend that reads ``layer_scale``.

        ``sinks[i]``: the sink logits of layer ``i`` (``[num_heads]``, this backend's query heads: a
        tensor-parallel rank's own) where ``layers[i].sinks``, else None; the model's weights
        (``infer.model.CausalLM.attention_sinks``), so call this once they are final. They are kept as float32
        copies on the backend's device (``layer_sinks``); a backend that implements sinks reads them there."""
        layers = tuple(layers)
        missing = sorted(set().union(*(layer.needs for layer in layers)) - self.layer_features)
        if missing:
            raise BackendUnavailableError(
                f"attention backend {type(self).__name__} does not implement {' and '.join(missing)} attention, "
                f"which this model's layers need; use attention.name=auto, which picks a backend that does"
            )
        sinks = tuple(sinks) if sinks is not None else (None,) * len(layers)
        if len(sinks) != len(layers):
            raise ValueError(f"set_layers got sink logits for {len(sinks)} layers and {len(layers)} layers")
        for index, (layer, logits) in enumerate(zip(layers, sinks)):
            if layer.sinks != (logits is not None):
                raise ValueError(
                    f"layer {index} {'declares' if layer.sinks else 'does not declare'} attention sinks but "
                    f"set_layers got {'none' if logits is None else 'sink logits'} for it"
                )
            if logits is not None and tuple(logits.shape) != (self.num_heads,):
                raise ValueError(
                    f"layer {index}'s sink logits have shape {tuple(logits.shape)}; expected one per query head "
                    f"({self.num_heads},)"
                )
        scales = {layer.scale for layer in layers}
        if len(scales) == 1 and None not in scales:
            self.scale = scales.pop()
        self.layers = layers
        self.sinks = tuple(
            None if logits is None else logits.detach().to(self.device, torch.float32).contiguous() for logits in sinks
        )

    def layer_window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window (None: it sees every earlier token)."""
        return self.layers[layer].window if self.layers else None

    def layer_scale(self, layer: int) -> float:
        """Layer ``layer``'s softmax scale."""
        scale = self.layers[layer].scale if self.layers else None
        return self.scale if scale is None else scale

    def layer_sinks(self, layer: int) -> torch.Tensor | None:
        """Layer ``layer``'s sink logits, ``[num_heads]`` float32 on the device (None: the layer has no sinks)."""
        return self.sinks[layer] if self.sinks else None

    def check_supported(self) -> None:
        """Raise ``BackendUnavailableError`` with a clear message when this backend cannot run with these settings."""

    def kv_cache_shape(self, num_layers: int, num_blocks: int) -> tuple[int, ...]:
        return (num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def kv_bytes_per_token(self, num_layers: int) -> int:
        """Bytes one token's K and V take in a pool of ``num_layers`` layers of this backend's heads."""
        return 2 * num_layers * self.num_kv_heads * self.head_dim * torch.finfo(self.kv_dtype).bits // 8

    def allocate_kv_cache(self, num_layers: int, num_blocks: int) -> torch.Tensor:
        """A zeroed pool for ``num_layers`` layers of ``num_blocks`` blocks, in ``kv_dtype`` on the device; on a CPU
        over pages the kernel zeroes as blocks are first written (``infer.host.zeroed_pages``)."""
        if self.device.type == "cpu":
            return zeroed_pages(self.kv_cache_shape(num_layers, num_blocks), self.kv_dtype)
        return torch.zeros(self.kv_cache_shape(num_layers, num_blocks), dtype=self.kv_dtype, device=self.device)

    def prepare(self, metadata: AttentionMetadata) -> AttentionMetadata:
        """Called once per step before the layers run; backends may precompute per-step data here."""
        return metadata

    def fused_attention(self, metadata: AttentionMetadata) -> Any:
        """This step's attention as infer's CPU kernels compute it inside a fused stack of layers (an
        ``infer.kernels.cpu.KernelAttentionStep``), or None, the default: this backend keeps attention to itself and
        every layer calls ``forward``. Return one only when this backend's attention is exactly the kernels' paged
        attention over the standard pool layout (the built-in ``cpu``'s is): the execution layer may then run a step
        of a few tokens through all layers in one C call, attention included, without calling ``forward``.
        ``metadata`` is what ``prepare`` returned; called at most once per step."""
        return None

    def describe(self) -> str:
        """How this backend attends beyond its name, for ``infer run``'s summary of the execution (empty: nothing
        worth saying)."""
        return ""

    @abstractmethod
    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Write this step's K/V into the pool at ``metadata.slot_mapping``, then attend (see AttentionMetadata)."""


def write_kv(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, all_valid: bool = False
) -> None:
    """Store K/V of this step's tokens at their slots (slots < 0 are skipped). The reference every backend may use.

    ``all_valid`` says the caller knows no slot is negative (checked once per step): skips a check that costs two
    kernels and a host sync in every layer.
    """
    flat = kv_cache.view(2, -1, *kv_cache.shape[3:])  # [2, slots, kv_heads, head_dim]
    if not all_valid:
        valid = slot_mapping >= 0
        if not bool(valid.all()):
            slot_mapping, k, v = slot_mapping[valid], k[valid], v[valid]
    flat.index_copy_(1, slot_mapping, torch.stack((k, v)).to(kv_cache.dtype))


def gather_blocks(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """K and V stored in ``block_ids``, ``[len(block_ids) * block_size, kv_heads, head_dim]`` each, in ``dtype``;
    into ``out`` (``[2, len(block_ids), block_size, kv_heads, head_dim]``, the pool's dtype) when given."""
    # index_select on each contiguous half copies whole blocks; advanced indexing is several times slower on CPU.
    if out is None:
        return [kv_cache[half].index_select(0, block_ids).flatten(0, 1).to(dtype) for half in (0, 1)]
    return [torch.index_select(kv_cache[half], 0, block_ids, out=out[half]).flatten(0, 1) for half in (0, 1)]
