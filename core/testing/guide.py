"""Conformance suite for guides (contract: ``infer.guide.Guide`` and its ``Matcher``).

Guides are built over the default model's real tokenizer (SmolLM2's 49,152 tokens; fetched and converted once), so
masks are checked against the vocabulary a request would really see. The constraints cover every kind a guide
declares in ``supported_kinds``; kinds it does not serve must be refused with a ``GuideError``.

A plugin author's whole test file::

    from infer.testing import GuideConformance

    class TestMyGuide(GuideConformance):
        impl_name = "my-guide"
"""

from __future__ import annotations

import random
from collections.abc import Callable
from functools import cache
from typing import ClassVar

import pytest
import torch

from infer.guide import Constraint, Guide, GuideError, Matcher, TokenizerInfo, allocate_bitmask, unpack_bitmask
from infer.testing.suite import ConformanceSuite

GuideFactory = Callable[[], Guide]
STOP_TOKEN = 2  # SmolLM2's <|im_end|>, the engine's end of sequence for the default model

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    },
    "required": ["name", "age", "role"],
}
# (constraint, texts it accepts whole) per kind; JSON texts are checked by walking instead (whitespace varies).
EXAMPLES: dict[str, tuple[Constraint, list[str]]] = {
    "json_schema": (Constraint(json_schema=PERSON_SCHEMA), []),
    "json_object": (Constraint(json_object=True), []),
    "regex": (Constraint(regex=r"[0-9]{3}-[0-9]{4}"), ["555-1234", "000-0000"]),
    "choice": (Constraint(choice=("yes", "no", "maybe")), ["yes", "no", "maybe"]),
}
INVALID = {
    "json_schema": Constraint(json_schema={"type": "nonsense"}),
    "regex": Constraint(regex="([a-z"),
}


@cache
def default_tokenizer_info() -> TokenizerInfo:
    from transformers import AutoTokenizer

    from infer.model.loader import DEFAULT_MODEL, hf_model_dir

    tokenizer = AutoTokenizer.from_pretrained(hf_model_dir(DEFAULT_MODEL))
    return TokenizerInfo(tokenizer, len(tokenizer), (STOP_TOKEN,))


def allowed_tokens(matcher: Matcher, vocab_size: int) -> torch.Tensor:
    """The ids ``matcher`` allows next, sorted."""
    bitmask = allocate_bitmask(1, vocab_size)
    bitmask.zero_()
    matcher.fill_bitmask(bitmask, 0)
    return unpack_bitmask(bitmask, vocab_size)[0].nonzero().flatten()


class GuideConformance(ConformanceSuite):
    """The guide contract over the default model's tokenizer.

    ``walk_steps`` bounds each random walk through a grammar (tokens chosen at random among those allowed).
    """

    kind = "guide"
    walk_steps: ClassVar[int] = 40

    @pytest.fixture
    def guide_factory(self) -> GuideFactory:
        """Makes a guide over the default tokenizer. Override to construct yours directly."""
        return self.make_guide_factory(self.impl_name)

    def make_guide_factory(self, name: str | None) -> GuideFactory:
        implementation = self.load_implementation(name)
        config = self.implementation_config(name)

        def make() -> Guide:
            try:
                return implementation(default_tokenizer_info(), config)
            except GuideError as error:  # its library is not installed: say which extra would run the suite
                pytest.skip(f"{name}: {error}")

        return make

    @pytest.fixture
    def guide(self, guide_factory) -> Guide:
        return guide_factory()

    def served(self, guide: Guide, kind: str) -> Constraint:
        if kind not in guide.supported_kinds:
            pytest.skip(f"the guide does not serve {kind} constraints (supported_kinds)")
        return EXAMPLES[kind][0]

    def vocab_size(self, guide: Guide) -> int:
        return guide.tokenizer.vocab_size

    # -- the mask and the matcher agree --------------------------------------------------------------------------
    @pytest.mark.parametrize("kind", sorted(EXAMPLES))
    def test_never_allows_a_dead_end(self, guide, kind):
        """Along random walks, the mask is never empty, every token sampled from it is accepted, a token outside
        it is refused without changing the state, and only the stop token terminates."""
        constraint = self.served(guide, kind)
        vocab_size = self.vocab_size(guide)
        for seed in range(3):
            rng = random.Random(seed)
            matcher = guide.matcher(guide.compile(constraint))
            for step in range(self.walk_steps):
                allowed = allowed_tokens(matcher, vocab_size)
                assert len(allowed) > 0, f"{kind}: the mask allows nothing after {step} tokens (a dead end)"
                allowed_set = set(allowed.tolist())
                # Inside a JSON string nearly every token is allowed: look for one outside among a few hundred.
                forbidden = next((t for t in rng.sample(range(vocab_size), 512) if t not in allowed_set), None)
                if forbidden is not None:
                    assert matcher.accept([forbidden]) == 0, (
                        f"{kind}: token {forbidden} is outside the mask but accepted"
                    )
                    assert allowed_tokens(matcher, vocab_size).tolist() == allowed.tolist(), (
                        f"{kind}: refusing token {forbidden} changed the state"
                    )
                token = int(allowed[rng.randrange(len(allowed))])
                assert matcher.accept([token]) == 1, f"{kind}: token {token} is in the mask but refused"
                if matcher.is_terminated():
                    assert token == STOP_TOKEN, f"{kind}: terminated on token {token}, not the stop token"
                    break

    @pytest.mark.parametrize("kind", ["regex", "choice"])
    def test_accepting_a_valid_string_then_the_stop_token_terminates(self, guide, kind):
        constraint, texts = EXAMPLES[kind]
        self.served(guide, kind)
        tokenizer = guide.tokenizer.tokenizer
        for text in texts:
            matcher = guide.matcher(guide.compile(constraint))
            token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            assert matcher.accept(token_ids) == len(token_ids), f"{kind}: {text!r} is not accepted whole"
            assert not matcher.is_terminated(), f"{kind}: terminated before the stop token"
            assert allowed_tokens(matcher, self.vocab_size(guide)).tolist() == [STOP_TOKEN], (
                f"{kind}: after the whole of {text!r} more than the stop token is allowed"
            )
            assert matcher.accept([STOP_TOKEN]) == 1 and matcher.is_terminated()

    @pytest.mark.parametrize("kind", sorted(EXAMPLES))
    def test_rollback_restores_exactly(self, guide, kind):
        """After a walk of 12 tokens, rolling back n gives the mask seen n tokens earlier, for every n."""
        constraint = self.served(guide, kind)
        vocab_size = self.vocab_size(guide)
        rng = random.Random(7)
        matcher = guide.matcher(guide.compile(constraint))
        masks, tokens = [], []
        for _ in range(12):
            allowed = allowed_tokens(matcher, vocab_size)
            choices = [t for t in allowed.tolist() if t != STOP_TOKEN] or allowed.tolist()
            token = choices[rng.randrange(len(choices))]
            if token == STOP_TOKEN:
                break
            masks.append(allowed.tolist())
            tokens.append(token)
            assert matcher.accept([token]) == 1
        for back in range(1, len(tokens) + 1):
            matcher.rollback(1)
            assert allowed_tokens(matcher, vocab_size).tolist() == masks[-back], (
                f"{kind}: the mask after rolling back {back} tokens differs from the one seen before them"
            )
        assert matcher.accept(tokens) == len(tokens), f"{kind}: the same tokens are refused after the rollback"

    @pytest.mark.parametrize("kind", sorted(EXAMPLES))
    def test_same_state_same_mask(self, guide, kind):
        """Two matchers of one compiled constraint fed the same tokens allow the same tokens, step by step."""
        constraint = self.served(guide, kind)
        vocab_size = self.vocab_size(guide)
        compiled = guide.compile(constraint)
        first, second = guide.matcher(compiled), guide.matcher(compiled)
        rng = random.Random(3)
        for _ in range(10):
            allowed = allowed_tokens(first, vocab_size)
            assert allowed_tokens(second, vocab_size).tolist() == allowed.tolist()
            token = int(allowed[rng.randrange(len(allowed))])
            if token == STOP_TOKEN:
                break
            assert first.accept([token]) == 1 and second.accept([token]) == 1

    # -- compilation ---------------------------------------------------------------------------------------------
    def test_compile_is_cached_by_constraint(self, guide):
        kind = next(iter(sorted(guide.supported_kinds & set(EXAMPLES))), None)
        if kind is None:
            pytest.skip("the guide serves no constraint kind")
        constraint = EXAMPLES[kind][0]
        compiled = guide.compile(constraint)
        again = guide.compile(Constraint.from_dict({kind: constraint.value}))
        assert again is compiled and guide.num_compiled == 1

    @pytest.mark.parametrize("kind", sorted(INVALID))
    def test_an_invalid_constraint_raises_guide_error(self, guide, kind):
        self.served(guide, kind)
        with pytest.raises(GuideError, match="invalid"):
            guide.compile(INVALID[kind])

    def test_an_unserved_kind_is_refused_with_guide_error(self, guide):
        unserved = sorted(set(EXAMPLES) - guide.supported_kinds)
        if not unserved:
            pytest.skip("the guide serves every kind")
        with pytest.raises(GuideError, match=unserved[0]):
            guide.compile(EXAMPLES[unserved[0]][0])
