"""``drafter: outside-repeat``: prompt lookup, in plugin API 1's form (``__init__(self, config)``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from infer.drafter import Drafter, DrafterConfig
from infer.sequence import Sequence


@dataclass
class _Index:
    """Where each pair of tokens of a sequence was last followed by another: pair -> the follower's index, over
    the first ``num_tokens`` tokens."""

    followers: dict[tuple[int, int], int] = field(default_factory=dict)
    num_tokens: int = 0


class RepeatDrafter(Drafter):
    """Proposes what followed the sequence's last two tokens the last time they appeared together."""

    def __init__(self, config: DrafterConfig):
        super().__init__(config)
        self._indexes: dict[str, _Index] = {}

    def propose(self, sequences: list[Sequence], k: int) -> list[list[int]]:
        return [self._propose(seq, k) for seq in sequences]

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        index = self._indexes.get(seq.seq_id)
        if index is not None and index.num_tokens > num_tokens:
            del self._indexes[seq.seq_id]  # it read tokens that are gone: rebuilt on the next proposal

    def release(self, seq: Sequence) -> None:
        self._indexes.pop(seq.seq_id, None)

    def _propose(self, seq: Sequence, k: int) -> list[int]:
        tokens = seq.token_ids
        if k <= 0 or len(tokens) < 3:
            return []
        index = self._indexes.setdefault(seq.seq_id, _Index())
        for position in range(max(index.num_tokens, 2), len(tokens)):
            index.followers[(tokens[position - 2], tokens[position - 1])] = position
        index.num_tokens = len(tokens)
        start = index.followers.get((tokens[-2], tokens[-1]))
        return [] if start is None else list(tokens[start : start + k])
