"""The drafter contract: what tokens to guess for speculative decoding."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from infer.sequence import Sequence


class DrafterConfig(BaseModel):
    """Config section ``drafter``. Plugins subclass it to add their own keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = "none"
    num_speculative_tokens: int = 4
    # Drafting switches itself off while more sequences than this are running (verification stops being cheap).
    max_batch_size: int = 8


class Drafter(ABC):
    """Proposes up to k draft tokens per running sequence; the engine verifies them with the target.

    ``propose`` is called after each step for sequences in decode; ``rollback`` tells the drafter that sequence
    ``seq`` now has ``num_tokens`` committed tokens (drafts past it were rejected) so it can drop its own state.
    ``release`` is called when a sequence finishes or is preempted.
    """

    config_model: ClassVar[type[DrafterConfig]] = DrafterConfig
    needs_hidden_states: ClassVar[bool] = False

    def __init__(self, config: DrafterConfig | None = None, **context):
        self.config = config or self.config_model()
        self.context = context

    @abstractmethod
    def propose(self, sequences: list["Sequence"], k: int) -> list[list[int]]:
        """At most ``k`` draft token ids for each sequence (an empty list: no guess)."""

    def rollback(self, seq: "Sequence", num_tokens: int) -> None:
        """The sequence's committed length is now ``num_tokens``; forget draft-side state past it."""

    def release(self, seq: "Sequence") -> None:
        """The sequence left the running set; drop any state kept for it."""
