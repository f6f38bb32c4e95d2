"""Conformance suite for speculative-decoding drafters (contract: ``infer.drafter.Drafter``).

Proposals are checked on ``infer.sequence.Sequence`` objects in decode state (prompts with repeats, so that
prompt-lookup drafters have something to find), each holding its own blocks so that a drafter with its own KV pool
(allocated with ``NUM_BLOCKS`` blocks) can write it.

A target model: override the ``target_model_dir`` fixture to return one (an HF folder, a GGUF file or an alias, with
at most ``vocab_size`` tokens; ``infer.testing.models.make_tiny_model_dir(folder, vocab_size=64)`` writes a small
one). The suite then builds the drafter as the engine does, ``Drafter(config, context)`` with the
``DrafterContext`` of an engine over that target, and runs the end-to-end check: greedy output with the drafter
inside a real engine equals the output without it (``drafter_overrides`` are the config keys that select the drafter
there). Without a target the drafter gets no context, a drafter that declares ``needs_target`` is skipped, and the
end-to-end check too.

A plugin author's whole test file::

    import pytest

    from infer.testing import DrafterConformance
    from infer.testing.models import make_tiny_model_dir

    class TestMyDrafter(DrafterConformance):
        impl_name = "mine"

        @pytest.fixture(scope="class")
        def target_model_dir(self, tmp_path_factory):
            return str(make_tiny_model_dir(tmp_path_factory.mktemp("target"), vocab_size=self.vocab_size))
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch

from infer.drafter import Drafter, DrafterContext, tree_depths
from infer.plugin_api import build_drafter
from infer.sampling_params import SamplingParams
from infer.sequence import Sequence, SequenceStatus
from infer.testing.suite import ConformanceSuite

DrafterFactory = Callable[[], Drafter]
# Generates greedy output token ids for prompt token ids, with (True) or without (False) the drafter under test.
EngineFactory = Callable[[bool], Callable[[list[list[int]]], list[list[int]]]]
# Every suite sequence holds this many blocks of its own: room for its tokens and drafts at any block size.
BLOCKS_PER_SEQUENCE = 64
MAX_SEQUENCES = 8
NUM_BLOCKS = 1 + BLOCKS_PER_SEQUENCE * MAX_SEQUENCES


def make_sequences(seed: int, count: int, vocab_size: int) -> list[Sequence]:
    """Sequences in decode state whose prompts repeat short phrases, and whose outputs start one again."""
    assert count <= MAX_SEQUENCES, f"the suite's block layout holds {MAX_SEQUENCES} sequences"
    generator = random.Random(seed)
    sequences = []
    for index in range(count):
        phrases = [[generator.randrange(vocab_size) for _ in range(generator.randint(2, 5))] for _ in range(3)]
        prompt = [token for _ in range(4) for token in generator.choice(phrases)]
        output = generator.choice(phrases)[: generator.randint(0, 3)]
        seq = Sequence(
            f"seq-{seed}-{index}",
            prompt,
            SamplingParams(max_tokens=64, temperature=0.0, seed=seed),
            output_token_ids=output,
            status=SequenceStatus.RUNNING,
        )
        seq.num_computed_tokens = seq.num_tokens - 1  # the last sampled token is the next one to compute
        seq.block_table = list(range(1 + index * BLOCKS_PER_SEQUENCE, 1 + (index + 1) * BLOCKS_PER_SEQUENCE))
        sequences.append(seq)
    return sequences


def with_kv_cache(drafter: Drafter) -> Drafter:
    """Give a drafter with its own KV its pool, as the engine does once the pool is sized."""
    if drafter.kv_bytes_per_token():
        drafter.allocate_kv_cache(NUM_BLOCKS)
    return drafter


def seed_everything(seed: int) -> None:
    """A drafter that samples may draw from Python's or torch's global generators; pin both."""
    random.seed(seed)
    torch.manual_seed(seed)


def target_engine_settings(model_dir: str) -> dict[str, Any]:
    """The engine the suite runs over a target model: float32, a short context, a small pool."""
    return {"model.path": model_dir, "model.dtype": "float32", "model.max_model_len": 256, "cache.num_blocks": 128}


def target_context(model_dir: str) -> DrafterContext:
    """The ``DrafterContext`` an engine over ``model_dir`` gives its drafter."""
    from infer import LLM

    settings = target_engine_settings(model_dir)
    return LLM("baseline", [f"{key}={value}" for key, value in settings.items()]).engine.drafter_context()


def engine_generator(model_dir: str, drafter_overrides: dict[str, Any], max_tokens: int = 24) -> EngineFactory:
    """``factory(use_drafter)``: greedy generation over ``model_dir`` with the drafter that ``drafter_overrides``
    select (True; it must verify drafts) or none (False)."""
    from infer import LLM

    def factory(use_drafter: bool) -> Callable[[list[list[int]]], list[list[int]]]:
        settings = {**target_engine_settings(model_dir), **(drafter_overrides if use_drafter else {})}
        llm = LLM("baseline", [f"{key}={value}" for key, value in settings.items()])

        def run(prompts: list[list[int]]) -> list[list[int]]:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            outputs = [output.token_ids for output in llm.generate(prompts, params)]
            assert llm.engine.stats.num_verify_passes > 0 or not use_drafter, "the drafter never proposed a draft"
            return outputs

        return run

    return factory


class DrafterConformance(ConformanceSuite):
    """The drafter contract: at most k valid tokens per sequence, deterministic, nothing shared between sequences;
    with a target model, the target's output unchanged inside the engine.

    ``vocab_size`` bounds the token ids the suite uses and the drafter may propose.
    """

    kind = "drafter"
    capability_flags = ("needs_target",)
    vocab_size: ClassVar[int] = 64
    num_speculative_tokens: ClassVar[int] = 4
    needs_target: ClassVar[bool] = False

    @pytest.fixture
    def target_model_dir(self) -> str | None:
        """A target model for the drafter (see the module); None: none."""
        return None

    @pytest.fixture
    def drafter_context(self, target_model_dir) -> DrafterContext | None:
        """The context the drafter is built with: an engine's over ``target_model_dir``, or None."""
        return None if target_model_dir is None else target_context(target_model_dir)

    @pytest.fixture
    def drafter_factory(self, drafter_context) -> DrafterFactory:
        """Makes a fresh drafter. Override to construct yours directly."""
        return self.make_drafter_factory(self.impl_name, drafter_context)

    @pytest.fixture
    def engine_factory(self, drafter_factory, target_model_dir) -> EngineFactory:
        """``engine_factory(use_drafter)`` returns a greedy ``generate(prompts) -> outputs`` inside an engine over
        ``target_model_dir``, with or without the drafter (``drafter_overrides``)."""
        if target_model_dir is None:
            pytest.skip(
                "no target model: override the target_model_dir fixture to check the target's output inside the engine"
            )
        return engine_generator(
            target_model_dir, self.drafter_overrides(getattr(drafter_factory, "name", self.impl_name))
        )

    def drafter_overrides(self, name: str) -> dict[str, Any]:
        """Config keys (dotted) that select drafter ``name`` in an engine."""
        return {"drafter.name": name}

    def make_drafter_factory(self, name: str | None, context: DrafterContext | None) -> DrafterFactory:
        implementation = self.load_implementation(name)
        if self.needs_target and context is None:
            pytest.skip(
                f"drafter {name!r} needs a target model (it declares needs_target): override the "
                f"target_model_dir fixture (a model with vocab_size={self.vocab_size} tokens at most)"
            )
        config = self.implementation_config(name, num_speculative_tokens=self.num_speculative_tokens)

        def factory() -> Drafter:
            return with_kv_cache(build_drafter(implementation, config, context))

        factory.name = name  # the engine_factory runs the same implementation
        return factory

    def propose(self, factory: DrafterFactory, sequences: list[Sequence], k: int, seed: int = 0) -> list[list[int]]:
        """Proposals of a fresh drafter under ``seed``."""
        seed_everything(seed)
        return self.checked_proposals(factory().propose(sequences, k), sequences, k)

    def checked_proposals(self, proposals: list[list[int]], sequences: list[Sequence], k: int) -> list[list[int]]:
        assert len(proposals) == len(sequences), f"{len(proposals)} proposal lists for {len(sequences)} sequences"
        for seq, tokens in zip(sequences, proposals):
            assert len(tokens) <= k, f"{len(tokens)} tokens proposed for {seq.seq_id} with k={k}"
            parents = getattr(tokens, "parents", None)
            if parents is not None:  # a DraftTree: a parent per draft, in a caterpillar's shape
                assert len(parents) == len(tokens), f"{len(parents)} parents for {len(tokens)} drafts"
                tree_depths(parents)
            for token in tokens:
                assert isinstance(token, int), f"proposed {token!r} ({type(token).__name__}), not an int token id"
                assert 0 <= token < self.vocab_size, f"proposed token {token} outside the vocabulary"
        return [list(tokens) for tokens in proposals]

    @pytest.mark.parametrize("k", [0, 1, 4])
    def test_proposes_at_most_k_valid_tokens_per_sequence(self, drafter_factory, k):
        self.propose(drafter_factory, make_sequences(1, 5, self.vocab_size), k)

    def test_same_seed_gives_the_same_proposals(self, drafter_factory):
        sequences = make_sequences(2, 4, self.vocab_size)
        first = self.propose(drafter_factory, sequences, 4, seed=3)
        assert self.propose(drafter_factory, sequences, 4, seed=3) == first

    def test_proposals_do_not_depend_on_the_rest_of_the_batch(self, drafter_factory):
        alone, *others = make_sequences(4, 4, self.vocab_size)
        (expected,) = self.propose(drafter_factory, [alone], 4)
        batched = self.propose(drafter_factory, [others[0], alone, *others[1:]], 4)
        assert batched[1] == expected, "a sequence's proposals changed when others were proposed alongside it"

    def test_rollback_forgets_rejected_drafts(self, drafter_factory):
        (seq,) = make_sequences(5, 1, self.vocab_size)
        seed_everything(0)
        drafter = drafter_factory()
        (before,) = self.checked_proposals(drafter.propose([seq], 4), [seq], 4)
        seq.output_token_ids.append((seq.token_ids[-1] + 1) % self.vocab_size)
        drafter.propose([seq], 4)
        seq.output_token_ids.pop()
        drafter.rollback(seq, seq.num_tokens)
        seed_everything(0)
        (after,) = self.checked_proposals(drafter.propose([seq], 4), [seq], 4)
        assert after == before, "proposals after a rollback differ from those made at the same length before"

    def test_released_state_does_not_leak_into_a_new_sequence(self, drafter_factory):
        old, new = make_sequences(6, 2, self.vocab_size)
        new.seq_id = old.seq_id  # an id reused after release must not find the old sequence's state
        (expected,) = self.propose(drafter_factory, [new], 4)
        seed_everything(0)
        drafter = drafter_factory()
        drafter.propose([old], 4)
        drafter.release(old)
        seed_everything(0)
        assert self.checked_proposals(drafter.propose([new], 4), [new], 4) == [expected]

    def test_target_output_unchanged(self, engine_factory):
        prompts = [seq.prompt_token_ids for seq in make_sequences(7, 3, self.vocab_size)]
        assert engine_factory(True)(prompts) == engine_factory(False)(prompts)
