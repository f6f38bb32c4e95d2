"""``drafter: ngram``: prompt lookup. Find the most recent earlier occurrence of the sequence's last n tokens
(n from ``max_n`` down to ``min_n``) and propose the tokens that followed it."""

from __future__ import annotations

from pydantic import Field

from infer.drafter import Drafter, DrafterConfig


class NgramDrafterConfig(DrafterConfig):
    name: str = "ngram"
    min_n: int = Field(1, ge=1, description="Shortest suffix to look up.")
    max_n: int = Field(4, ge=1, description="Longest suffix to look up (tried first).")
    lookback: int = Field(2048, ge=16, description="Search only this many most recent tokens.")


class NgramDrafter(Drafter):
    """Stateless and deterministic: proposals depend only on the sequence's committed tokens."""

    config_model = NgramDrafterConfig
    works_with_tensor_parallel = True  # reads token ids only

    def propose(self, sequences, k):
        return [self.propose_one(seq.token_ids[-self.config.lookback :], k) for seq in sequences]

    def propose_one(self, tokens: list[int], k: int) -> list[int]:
        for n in range(min(self.config.max_n, len(tokens) - 1), self.config.min_n - 1, -1):
            start = self._last_earlier_occurrence(tokens, n)
            if start is not None:
                return tokens[start + n : start + n + k]
        return []

    @staticmethod
    def _last_earlier_occurrence(tokens: list[int], n: int) -> int | None:
        """Start of the latest occurrence of the last ``n`` tokens that is followed by at least one token."""
        suffix = tokens[-n:]
        first = suffix[0]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start] == first and tokens[start : start + n] == suffix:
                return start
        return None
