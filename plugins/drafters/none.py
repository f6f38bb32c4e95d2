"""``drafter: none``: no speculative decoding."""

from __future__ import annotations

from infer.drafter import Drafter


class NoDrafter(Drafter):
    """Proposes nothing; every step decodes one token per sequence."""

    proposes = False
    works_with_tensor_parallel = True

    def propose(self, sequences, k):
        return [[] for _ in sequences]
