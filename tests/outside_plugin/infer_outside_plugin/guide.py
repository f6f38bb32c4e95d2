"""``guide: outside-choice``: ``choice`` constraints, over each choice's own tokenization."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from infer.guide import Constraint, Guide, Matcher


class ChoiceMatcher(Matcher):
    """Where a sequence stands among the choices: the tokens accepted so far, a prefix of at least one choice's."""

    def __init__(self, choices: tuple[tuple[int, ...], ...], stop_tokens: tuple[int, ...]):
        self._choices = choices
        self._stop_tokens = stop_tokens
        self._accepted: list[int] = []

    def accept(self, token_ids: Sequence[int]) -> int:
        for count, token in enumerate(token_ids):
            if self.is_terminated() or token not in self._allowed():
                return count
            self._accepted.append(token)
        return len(token_ids)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = [0] * bitmask.shape[1]
        for token in self._allowed():
            words[token // 32] |= 1 << (token % 32)
        # The words are int32: a set sign bit reads as a negative number.
        bitmask[row] = torch.tensor(
            [word - (1 << 32) if word >= 1 << 31 else word for word in words], dtype=torch.int32
        )

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            del self._accepted[-num_tokens:]

    def is_terminated(self) -> bool:
        return bool(self._accepted) and self._accepted[-1] in self._stop_tokens

    def _allowed(self) -> set[int]:
        if self.is_terminated():
            return set(self._stop_tokens)
        accepted = tuple(self._accepted)
        allowed = {
            choice[len(accepted)]
            for choice in self._choices
            if len(choice) > len(accepted) and choice[: len(accepted)] == accepted
        }
        if accepted in self._choices:
            allowed.update(self._stop_tokens)
        return allowed


class ChoiceGuide(Guide):
    """Serves ``choice`` constraints only: the output is one of the choices, tokenized as the tokenizer would."""

    supported_kinds = frozenset({"choice"})

    def _compile(self, constraint: Constraint) -> Any:
        tokenizer = self.tokenizer.tokenizer
        return tuple(tuple(tokenizer(choice, add_special_tokens=False)["input_ids"]) for choice in constraint.choice)

    def matcher(self, compiled: Any) -> Matcher:
        return ChoiceMatcher(compiled, self.tokenizer.eos_token_ids)
