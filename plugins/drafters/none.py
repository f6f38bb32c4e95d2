"""``drafter: none``: no speculative decoding."""

from __future__ import annotations

from infer import hookimpl
from infer.drafter import Drafter


class NoDrafter(Drafter):
    """Proposes nothing; every step decodes one token per sequence."""

    proposes = False
    works_with_tensor_parallel = True

    def propose(self, sequences, k):
        return [[] for _ in sequences]


@hookimpl
def register_drafters(register):
    register("none", NoDrafter, description="No speculative decoding")
