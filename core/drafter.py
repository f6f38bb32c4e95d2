"""The drafter contract: what tokens to guess for speculative decoding."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    import torch
    from torch import nn

    from infer.attention import AttentionBackend
    from infer.execution.calibration import RowsCalibration
    from infer.execution.paths import Executor, ForwardStep
    from infer.execution.runner import StepOutput
    from infer.sequence import Sequence


class DrafterConfig(BaseModel):
    """Config section ``drafter``. Plugins subclass it to add their own keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = "none"
    num_speculative_tokens: int = 4
    # Drafting switches itself off while more sequences than this are running (verification stops being cheap).
    max_batch_size: int = 8


class SampledDrafts(list):
    """Draft token ids that a drafter drew at random, with the distributions it drew them from.

    ``probs`` is ``[len(self), vocab]`` float32: row j is the q that token j was sampled from. For sampled requests
    the engine then accepts token j with probability min(1, p/q) and, on rejection, samples from
    normalize(max(0, p - q)), so the output follows the target's distribution. A plain list means one-hot q (a
    deterministic guess): the engine samples the target's token at each position and accepts while it agrees.
    """

    def __init__(self, token_ids: list[int], probs: "torch.Tensor"):
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
            raise ValueError(f"draft {index} hangs off draft {parent}: a draft tree's leaves hang off the root (-1) or "
                             f"a spine draft (0..{spine - 1}), parents {parents}")
    return [index + 1 if index < spine else parent + 2 for index, parent in enumerate(parents)]


class TargetModel(Protocol):
    """What a drafter may use of the target model (``infer.model.LlamaForCausalLM`` is one): its shapes, its
    embedding, its decoder layers, its final norm and output head."""

    config: Any  # the HF config (hidden_size, intermediate_size, rms_norm_eps, ...)
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary: Any  # the rotary embedding a ``ForwardStep`` is built with
    layers: Any  # the decoder layers, in order
    embed_tokens: "nn.Module"  # token ids [tokens] -> embeddings [tokens, hidden]
    norm: "nn.Module"
    lm_head: "nn.Module"  # ``lm_head.weight`` is float32 [vocab, hidden] even when the head is packed

    def run_layers(self, hidden: "torch.Tensor", layers, step: "ForwardStep") -> "torch.Tensor":
        """``layers`` over ``hidden`` [tokens, hidden], then the final norm."""

    def compute_logits(self, hidden: "torch.Tensor") -> "torch.Tensor":
        """Output-head logits of final hidden states."""


@dataclass(frozen=True)
class DrafterContext:
    """Everything of the engine a drafter may use, and nothing else (drafters never see the engine).

    ``target`` runs the target's parts; ``attention`` is the target's attention backend (a drafter layer with the
    target's shapes can use it as is) and ``executor`` runs layers on the target's kernels and execution paths
    (``executor.step(rotary, attention.prepare(metadata), kv_cache, attention, dtype)`` gives the ``ForwardStep``
    that layers take). Hidden states: a drafter that declares ``needs_hidden_states`` gets the target's final hidden
    state of every token in ``observe``.
    """

    target: TargetModel
    model_name: str
    tokenizer: Any
    dtype: "torch.dtype"
    device: "torch.device"
    block_size: int
    seed: int
    quantization: str  # the target's weight packing (``infer.model.quantization``): "none", "fp16", "int8", ...
    attention: "AttentionBackend"
    executor: "Executor"
    recalibrate: bool = False  # ``execution.recalibrate``: measure again rather than read cached calibrations

    def free_verify_rows(self) -> RowsCalibration:
        """How many query rows of one sequence the target computes for about a decode step's time on this machine
        (a verification of drafts is one row per draft plus one): measured once per machine and model, cached
        (``infer.execution.calibration.calibrate_rows``)."""
        from infer.execution.calibration import calibrate_rows

        return calibrate_rows(self.target, self.attention, self.executor, self.quantization, self.device,
                              self.dtype, self.recalibrate)

    def build_attention(self, num_heads: int, num_kv_heads: int, head_dim: int) -> "AttentionBackend":
        """An attention backend of the target's kind and block size for layers of other shapes (a draft model)."""
        return type(self.attention)(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                    block_size=self.block_size, dtype=self.dtype, device=self.device,
                                    config=self.attention.config)

    def quantize(self, module: "nn.Module", mode: str | None = None) -> "nn.Module":
        """Pack ``module``'s linear layers as the target's are, or as ``mode`` (an ``infer.model.quantization`` mode) says
        (in place; returns it). A model's output-head weight stays beside its packed copy, as the target's does."""
        from infer.model.quantization import quantize_linears

        head = getattr(module, "lm_head", None)
        shared = frozenset({id(head.weight)}) if head is not None else frozenset()
        return quantize_linears(module, mode or self.quantization, shared)

    def projection(self, weight: "torch.Tensor", mode: str | None = None) -> "nn.Module":
        """``x @ weight.T`` as a module packed as the target's weights are, or as ``mode`` says."""
        from infer.model.quantization import projection

        return projection(weight, mode or self.quantization)


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
    def propose(self, sequences: list["Sequence"], k: int) -> list[list[int]]:
        """At most ``k`` draft token ids for each sequence (an empty list: no guess); ``SampledDrafts`` for guesses
        drawn at random."""

    def observe(self, output: "StepOutput") -> None:
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

    def rollback(self, seq: "Sequence", num_tokens: int) -> None:
        """The sequence's committed length is now ``num_tokens``; forget draft-side state past it."""

    def release(self, seq: "Sequence") -> None:
        """The sequence left the running set; drop any state kept for it."""
