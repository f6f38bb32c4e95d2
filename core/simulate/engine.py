"""``SimulatedEngine``: the real ``Engine`` on a simulated clock, its model replaced by a cost model.

What runs for real: ``Engine.step`` (schedule, accept, finish, preempt), ``add_request`` and its refusals, the
configured allocator, prefix cache and scheduler plugins (third-party ones included), the engine's draft acceptance
and rollback, every counter ``infer bench`` reports. What is simulated:

- the forward pass: ``_execute`` advances the clock by the cost model's price of the step's ``StepShape``;
- the sampled tokens (``_sample``): synthetic ids, each request's output as long as its ``max_tokens`` (the
  workload's output length), ending with an EOS unless it ignores EOS, so the stop conditions are the engine's own;
- drafts: with a drafter other than ``none``, each decoding sequence gets ``num_speculative_tokens`` placeholder
  drafts and each is accepted with probability ``simulate.acceptance_rate`` until the first rejection (the bonus
  token follows, as in real verification); the drafter's own forward is not priced;
- text: outputs carry token ids, not text (``output_text`` is empty unless a request has stop strings, which are
  matched on the synthetic tokens' real decoding).

Idle time passes at once: ``sleep`` moves the clock.
"""

from __future__ import annotations

import functools
import random
from typing import Any

from infer.drafter import Drafter
from infer.engine.engine import Engine
from infer.execution.kv_pool import plan_kv_pool
from infer.execution.runner import ModelRunner
from infer.guide import TokenizerInfo
from infer.outputs import StepOutput
from infer.scheduler import StepPlan
from infer.sequence import Sequence
from infer.simulate.cost import CostModel, build_cost_model

DRAFT_TOKEN_INDEX = 0  # the placeholder drafts are the first pool token; sampled tokens never use it


@functools.cache
def _tokenizer(path: str) -> tuple[Any, list[int]]:
    """``model.path``'s tokenizer and EOS ids, loaded once per process (an ablation builds an engine per
    combination)."""
    from infer.model.loader import load_tokenizer

    return load_tokenizer(path)[:2]


class SimulatedDrafter(Drafter):
    """``num_speculative_tokens`` placeholder drafts per decoding sequence (nothing with ``drafter: none``)."""

    def __init__(self, config, draft_token: int, enabled: bool):
        super().__init__(config)
        self.draft_token = draft_token
        self.proposes = enabled

    def propose(self, sequences: list[Sequence], k: int) -> list[list[int]]:
        return [[self.draft_token] * k for _ in sequences]


class SimulatedEngine(Engine):
    """An ``Engine`` whose steps cost what ``cost`` says and whose tokens are synthetic (see the module)."""

    def __init__(
        self, config, registry=None, cost: CostModel | None = None, tokenizer: tuple[Any, list[int]] | None = None
    ):
        """``cost``: default ``build_cost_model(config)``; ``tokenizer``: (tokenizer, EOS ids), default
        ``model.path``'s (the weights are never loaded)."""
        from infer.registry import get_registry

        self.config = config
        self.registry = registry or get_registry(config.plugins.load)
        self.cost = cost or build_cost_model(config)
        self.now = 0.0
        self.device = "simulated"
        self.dtype = config.model.dtype
        self.quantization = config.model.quantization
        self._rng = random.Random(config.model.seed)
        self._accept_rng = random.Random(config.simulate.seed)
        self.tokenizer, eos = tokenizer or _tokenizer(config.model.path)
        self.eos_token_ids = set(eos)
        self.vocab_size = len(self.tokenizer)
        self.max_token_bytes = max(len(token.encode()) for token in self.tokenizer.get_vocab())
        self.model_name = config.model.path
        self.max_model_len = config.model.max_model_len
        self.attention_name = config.attention.name
        block_size = config.cache.block_size
        num_blocks = config.cache.num_blocks or self.cost.kv_pool_tokens(block_size) // block_size + 1
        self.pool_plan = plan_kv_pool(
            budget_bytes=0,
            weight_bytes=0,
            activation_bytes=0,
            bytes_per_token=int(self.cost.kv_bytes_per_token),
            block_size=block_size,
            max_model_len=self.max_model_len,
            num_blocks_override=num_blocks,
        )
        self._token_pool = self._synthetic_tokens()
        self._init_scheduling(
            num_blocks,
            SimulatedDrafter(
                config.drafter, self._token_pool[DRAFT_TOKEN_INDEX], enabled=config.drafter.name != "none"
            ),
        )
        # Grammars need real logits: constrained requests are refused, naming the guides a real run offers.
        self.guide = self.registry.load("guide", "none")(
            TokenizerInfo(self.tokenizer, self.vocab_size, tuple(sorted(self.eos_token_ids)))
        )

    def _synthetic_tokens(self) -> list[int]:
        """Ordinary tokens to sample from: no EOS, no special token."""
        special = set(self.tokenizer.all_special_ids) | self.eos_token_ids
        return [token for token in range(min(self.vocab_size, 4096)) if token not in special][:1024]

    # -- the clock -----------------------------------------------------------------------------------------------
    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)

    def _wants_shapes(self) -> bool:
        return True  # the cost model prices every step's shape

    def describe_execution(self) -> str:
        return f"simulated: {self.cost.describe()}"

    # -- the simulated parts ------------------------------------------------------------------------------------
    def _execute(self, plan: StepPlan) -> StepOutput:
        self.now += self.cost.step_time(plan.shape())
        return StepOutput(logits=None, rows=ModelRunner.logits_rows(plan.scheduled)[1])

    def _sample(self, output: StepOutput) -> tuple[list[int], list[dict | None]]:
        tokens: list[int] = []
        rate = self.config.simulate.acceptance_rate
        for row in output.rows:
            seq = row.seq
            drafts = seq.draft_token_ids[: row.count - 1]
            accepted = 0
            while accepted < len(drafts) and self._accept_rng.random() < rate:
                accepted += 1
            tokens.extend(drafts[:accepted])
            tokens.append(self._next_token(seq, row.first_position + accepted))
            tokens.extend(self._next_token(seq, row.first_position + j) for j in range(accepted + 1, row.count))
        return tokens, [None] * len(tokens)

    def _next_token(self, seq: Sequence, position: int) -> int:
        """The token at ``position``: EOS when it is the request's last (unless it ignores EOS), else a synthetic id
        that is never the placeholder draft (so a rejected draft is a mismatch)."""
        if position - seq.num_prompt_tokens + 1 >= seq.params.max_tokens and not seq.params.ignore_eos:
            return min(self.eos_token_ids)
        pool = self._token_pool
        return pool[1 + (seq.seed + position * 7919) % (len(pool) - 1)]

    def output_text(self, seq: Sequence) -> str:
        return super().output_text(seq) if seq.params.stop else ""
