"""The drafter contract: what tokens to guess for speculative decoding."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    import torch
    from torch import nn

    from infer.attention import AttentionBackend, AttentionMetadata, LayerAttention
    from infer.outputs import StepOutput
    from infer.sequence import Sequence


class DrafterConfig(BaseModel):
    """Config section ``drafter``. Plugins subclass it to add their own keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = "none"
    num_speculative_tokens: int = Field(4, description="k: drafts proposed per sequence and step.")
    max_batch_size: int = Field(
        8,
        description="Drafting switches itself off while more sequences than this are "
        "running (verification stops being cheap).",
    )


class SampledDrafts(list):
    """Draft token ids that a drafter drew at random, with the distributions it drew them from.

    ``probs`` is ``[len(self), vocab]`` float32: row j is the q that token j was sampled from. For sampled requests
    the engine then accepts token j with probability min(1, p/q) and, on rejection, samples from
    normalize(max(0, p - q)), so the output follows the target's distribution. A plain list means one-hot q (a
    deterministic guess): the engine samples the target's token at each position and accepts while it agrees.
    """

    def __init__(self, token_ids: list[int], probs: torch.Tensor):
        super().__init__(token_ids)
        self.probs = probs


class DraftTree(list):
    """Draft token ids as a tree, for a greedy request: ``parents[i]`` is the index of draft ``i``'s parent, -1 for
    the sequence's last committed token (the root). Verification accepts the longest path from the root whose every
    draft equals the target's own choice after its parent, plus the target's next token; so at each depth several
    alternatives can be checked in one pass for the price of their rows.

    The shape is a caterpillar, what ``AttentionMetadata.own_keys`` can attend: the first drafts form a chain, the
    spine (``parents[i] == i - 1``), and every later draft is a leaf, a child of the root or of a spine draft, with no
    children of its own (an alternative to the spine's draft at its depth). A chain is the tree without leaves. The
    engine keeps only the spine where it cannot verify a tree (a sampled request, a structured-output one, an
    attention backend without ``draft_trees``), so a drafter should order each level's likeliest guess on the spine.
    """

    def __init__(self, token_ids: list[int], parents: list[int]):
        super().__init__(token_ids)
        self.parents = list(parents)
        self.depths = tree_depths(self.parents)

    @property
    def spine_length(self) -> int:
        return spine_length(self.parents)


def spine_length(parents: list[int]) -> int:
    """How many of a draft tree's first drafts each follow the one before (its spine)."""
    length = 0
    while length < len(parents) and parents[length] == length - 1:
        length += 1
    return length


def tree_depths(parents: list[int]) -> list[int]:
    """Each draft's depth in a caterpillar-shaped ``DraftTree`` (1: a child of the root); ``ValueError`` for any
    other shape."""
    spine = spine_length(parents)
    for index, parent in enumerate(parents[spine:], start=spine):
        if not -1 <= parent < spine:
            raise ValueError(
                f"draft {index} hangs off draft {parent}: a draft tree's leaves hang off the root (-1) or "
                f"a spine draft (0..{spine - 1}), parents {parents}"
            )
    return [index + 1 if index < spine else parent + 2 for index, parent in enumerate(parents)]


@dataclass(slots=True)
class RowsCalibration:
    """How many query rows of one sequence a step computes for about the price of one (a verification of drafts):
    ``free_rows``, the most rows whose step, and every smaller one's, measured at most ``ROW_MARGIN`` times a
    one-row step (``infer.execution.calibration``); the milliseconds per row count it came from."""

    free_rows: int
    signature: str
    times_ms: dict[int, float] = field(default_factory=dict)
    cached: bool = False

    def describe(self) -> str:
        where = "cached" if self.cached else "measured now"
        one = self.times_ms.get(1)
        cells = ", ".join(f"{rows}: {ms / one:.2f}x" for rows, ms in sorted(self.times_ms.items())) if one else ""
        return f"{self.free_rows} rows of a sequence for one decode step's time ({where}; {cells})"


class LayerExecutor(Protocol):
    """How layers run on the target's kernels and execution paths, as far as a drafter may use it (the execution
    layer's executor is one; a drafter receives it as ``DrafterContext.executor`` and never builds one)."""

    kernels: Any  # the ``infer.kernels.cpu.CpuKernels`` the target's steps run on, or None (torch's ops)
    fused_max_tokens: int  # steps of up to this many tokens may run their layers in one C call

    def step(
        self,
        rotary: Any,
        metadata: AttentionMetadata,
        kv_cache: torch.Tensor,
        attention: AttentionBackend,
        dtype: torch.dtype,
    ) -> Any:
        """The per-step object layers take (an ``infer.model.step.ForwardStep``) for ``metadata`` (already through
        ``attention.prepare``) over ``kv_cache``."""

    def prepare(self, module: nn.Module) -> None:
        """Prepare a decoder layer or a packed projection outside a model (a draft head's) for these kernels."""

    def fuses(self, layers: Sequence_[Any], step: Any) -> bool:
        """Whether this executor runs ``layers`` for ``step`` in one C call, attention included."""

    def count_fused(self) -> None:
        """Count a forward pass a drafter ran in one C call itself (a fused draft head) among the fused ones."""

    def for_another(self, model: nn.Module) -> LayerExecutor:
        """An executor with these kernels and paths for another model (a draft model), its weights prepared."""


class TargetModel(Protocol):
    """What a drafter may use of the target model (``infer.model.CausalLM`` is one): its shapes, its
    embedding, its decoder layers, its final norm and output head."""

    config: Any  # the HF config (hidden_size, intermediate_size, rms_norm_eps, ...)
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary: Any  # the rotary embedding a step (``LayerExecutor.step``) is built with
    layers: Any  # the decoder layers, in order
    activation_dtype: torch.dtype  # the hidden states' dtype (float32 on CPUs)
    embed_tokens: nn.Module  # token ids [tokens] -> embeddings [tokens, hidden]; ``embed`` widens them
    norm: nn.Module
    lm_head: nn.Module  # its weight: ``head_weight()``

    def head_weight(self) -> torch.Tensor:
        """The output head's weight ``[vocab, hidden]``, float32 even when the head is packed, or bf16 where all its
        values are bf16 values (``infer.model.quantization.narrow_float_tables``): widen the rows you take to
        ``activation_dtype``. A packed bf16 head gives it back as a copy: take it once."""

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[tokens, hidden]`` in ``activation_dtype``, scaled as the family scales them."""

    def run_layers(self, hidden: torch.Tensor, layers, step: Any) -> torch.Tensor:
        """``layers`` over ``hidden`` [tokens, hidden], then the final norm."""

    def compute_logits(self, hidden: torch.Tensor, argmax_rows: list[int] | None = None) -> torch.Tensor:
        """Output-head logits of final hidden states; ``argmax_rows`` are read only for their first maximum (the
        model may give them from its head's screen: ``infer.model.CausalLM.compute_logits``)."""


@dataclass(frozen=True)
class DrafterContext:
    """Everything of the engine a drafter may use, and nothing else (drafters never see the engine).

    ``target`` runs the target's parts; ``attention`` is the target's attention backend (a drafter layer with the
    target's shapes can use it as is) and ``executor`` runs layers on the target's kernels and execution paths
    (``executor.step(rotary, attention.prepare(metadata), kv_cache, attention, dtype)`` gives the per-step object
    layers take). Hidden states: a drafter that declares ``needs_hidden_states`` gets the target's final hidden
    state of every token in ``observe``. The callables are the engine's, bound to this target.
    """

    target: TargetModel
    model_name: str
    tokenizer: Any
    dtype: torch.dtype
    device: torch.device
    block_size: int
    seed: int
    quantization: str  # the target's weight packing (``model.quantization`` resolved): "none", "fp16", "int8", ...
    attention: AttentionBackend
    executor: LayerExecutor
    # () -> RowsCalibration: how many query rows of one sequence the target computes for about a decode step's time
    # on this machine (a verification of drafts is one row per draft plus one), measured once per machine and model
    # and cached.
    free_verify_rows: Callable[[], RowsCalibration]
    # (module, mode=None) -> module: ``module``'s linear layers packed as the target's are, or as ``mode`` (a
    # ``model.quantization`` value) says, in place; a model's output-head weight stays beside its packed copy.
    quantize: Callable[..., nn.Module]
    # (weight, mode=None) -> module: ``x @ weight.T`` as a module packed as the target's weights are, or as ``mode``.
    projection: Callable[..., nn.Module]
    # (path) -> (model, tokenizer): another model of the target's dtype and device, loaded as the target was.
    load_model: Callable[[str], tuple[Any, Any]]

    def build_attention(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        layers: Sequence_[LayerAttention] = (),
        sinks: Sequence_[torch.Tensor | None] | None = None,
    ) -> AttentionBackend:
        """An attention backend of the target's kind and block size for layers of other shapes (a draft model),
        told what each of its layers needs (``layers``, one per pool layer: a draft model's ``layer_attention``;
        empty: full attention in every layer) and their sink logits (``sinks``: its ``attention_sinks``)."""
        backend = type(self.attention)(
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_size=self.block_size,
            dtype=self.dtype,
            device=self.device,
            config=self.attention.config,
        )
        if layers:
            backend.set_layers(layers, sinks)
        return backend


class Drafter(ABC):
    """Proposes up to k draft tokens per running sequence; the engine verifies them with the target.

    ``propose`` is called after each step for sequences in decode; ``rollback`` tells the drafter that sequence
    ``seq`` now has ``num_tokens`` committed tokens (drafts past it were rejected) so it can drop its own state.
    ``release`` is called when a sequence finishes or is preempted. ``observe`` sees every target step.

    A drafter with its own KV (a draft model, an EAGLE head) keeps it in a pool of the target's block geometry,
    indexed by the sequences' own ``block_table``: the allocator and the prefix cache then serve both pools. It
    says how many bytes a token slot of that pool costs (``kv_bytes_per_token``), so the engine sizes the target
    pool and its own from one budget, and receives the block count in ``allocate_kv_cache``. Before ``propose`` the
    engine gives each sequence blocks for k more tokens, so guesses fed to the drafter have slots.
    """

    config_model: ClassVar[type[DrafterConfig]] = DrafterConfig
    # True: ``context`` (a ``DrafterContext``) is required, not optional.
    needs_target: ClassVar[bool] = False
    # True: ``observe`` receives the target's final hidden state of every token of every step.
    needs_hidden_states: ClassVar[bool] = False
    # False for a drafter that never proposes (``none``): the engine then calls none of its methods in a step.
    proposes: ClassVar[bool] = True
    # True for a drafter that never runs the target model (whose layers are sharded under tensor parallelism and run
    # only as a collective of every rank): the engine refuses the others with parallel.tensor_parallel_size > 1.
    works_with_tensor_parallel: ClassVar[bool] = False

    def __init__(self, config: DrafterConfig | None = None, context: DrafterContext | None = None):
        if context is None and self.needs_target:
            raise TypeError(f"{type(self).__name__} needs a DrafterContext (it declares needs_target)")
        self.config = config or self.config_model()
        self.context = context

    @abstractmethod
    def propose(self, sequences: list[Sequence], k: int) -> list[list[int]]:
        """At most ``k`` draft token ids for each sequence (an empty list: no guess); ``SampledDrafts`` for guesses
        drawn at random."""

    def observe(self, output: StepOutput) -> None:
        """Called after every target step, once its tokens are accepted. When ``needs_hidden_states`` is set,
        ``output.hidden_states[row.start + j]`` is the target's final hidden state at position
        ``row.first_position + j`` of ``row.seq``, for each ``row`` in ``output.token_rows``; rows past the sequence's
        ``num_computed_tokens`` belong to rejected drafts, and a sequence that finished in this step was already
        released."""

    def kv_bytes_per_token(self) -> int:
        """Bytes of the drafter's own KV per token slot (0: it keeps none)."""
        return 0

    def describe(self) -> str:
        """How it drafts, for ``infer run``'s summary of the execution (empty: nothing worth a line)."""
        return ""

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate the drafter's KV pool: ``num_blocks`` blocks of the target's block size (called once, when
        ``kv_bytes_per_token`` is not 0)."""

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """The sequence's committed length is now ``num_tokens``; forget draft-side state past it."""

    def release(self, seq: Sequence) -> None:
        """The sequence left the running set; drop any state kept for it."""
