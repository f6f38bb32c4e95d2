"""Structured output on the default model: every constrained output satisfies its constraint, with each built-in
guide, greedy and sampled; drafting (ngram, eagle) leaves constrained greedy outputs unchanged; a configured guide
leaves unconstrained outputs token-identical; n > 1, preemption and prefix-cache hits keep working."""

from __future__ import annotations

import pytest

from infer import LLM, SamplingParams
from infer.bench.structured import satisfies, structured_requests
from infer.guide import Constraint

GUIDES = ["xgrammar", "llguidance"]
BASE = {"model__dtype": "float32", "model__max_model_len": 1024, "cache__num_blocks": 320}
REQUESTS = structured_requests(50)
PROMPTS = [
    [{"role": "user", "content": text}]
    for text in ["What is the capital of France?", "Name three fruits.", "Write a haiku about rain.", "Count to five."]
]

_engines: dict[tuple, LLM] = {}
_greedy: dict[str, list[list[int]]] = {}


def engine(**overrides) -> LLM:
    """One engine alive at a time (each holds the model and a KV pool); the same settings reuse it."""
    key = tuple(sorted({**BASE, **overrides}.items()))
    if key not in _engines:
        _engines.clear()
        _engines[key] = LLM("baseline", **dict(key))
    return _engines[key]


def params(request_index: int, temperature: float, constraint: Constraint | None, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=256, temperature=temperature, seed=request_index, constraint=constraint, **extra)


def constrained_greedy(guide: str) -> list[list[int]]:
    """The undrafted greedy outputs of REQUESTS under ``guide`` (computed once)."""
    if guide not in _greedy:
        outputs = engine(guide__name=guide).generate(
            [r.messages for r in REQUESTS], [params(i, 0.0, r.constraint) for i, r in enumerate(REQUESTS)]
        )
        _greedy[guide] = [output.outputs[0].token_ids for output in outputs]
    return _greedy[guide]


def assert_all_satisfy(outputs, requests) -> None:
    problems = [
        (output.outputs[0].text, output.outputs[0].finish_reason, satisfies(output.outputs[0].text, request.constraint))
        for output, request in zip(outputs, requests)
        if output.outputs[0].finish_reason != "stop" or satisfies(output.outputs[0].text, request.constraint)
    ]
    assert not problems, f"{len(problems)} of {len(requests)} outputs fail their constraint: {problems[:3]}"


# Every guide's greedy outputs (the drafting tests' reference) and, of the pairs of two guides, one each in the default
# run: sampling with llguidance, eagle drafting with llguidance, ngram drafting and jump-forward with xgrammar; the
# other of each pair in the slow run.
SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    ("guide", "temperature"),
    [("xgrammar", 0.0), pytest.param("xgrammar", 0.8, marks=SLOW), ("llguidance", 0.0), ("llguidance", 0.8)],
)
def test_fifty_varied_constrained_outputs_all_satisfy_their_constraints(guide, temperature):
    llm = engine(guide__name=guide)
    outputs = llm.generate(
        [r.messages for r in REQUESTS], [params(i, temperature, r.constraint) for i, r in enumerate(REQUESTS)]
    )
    assert_all_satisfy(outputs, REQUESTS)
    if temperature == 0.0:
        _greedy.setdefault(guide, [output.outputs[0].token_ids for output in outputs])


@pytest.mark.parametrize(
    ("guide", "drafter"),
    [
        ("xgrammar", "ngram"),
        pytest.param("xgrammar", "eagle", marks=SLOW),
        pytest.param("llguidance", "ngram", marks=SLOW),
        ("llguidance", "eagle"),
    ],
)
@pytest.mark.parametrize("num_requests", [16, pytest.param(50, marks=SLOW)])
def test_drafting_leaves_constrained_greedy_outputs_unchanged(guide, drafter, num_requests):
    """Drafts the grammar forbids are rejected and the matcher rolls back with the KV: token-identical outputs."""
    requests = REQUESTS[:num_requests]
    reference = constrained_greedy(guide)[:num_requests]
    settings = {"drafter__name": drafter, "drafter__max_batch_size": 64}
    if drafter == "eagle":
        settings["drafter__min_confidence"] = 0.0  # full chains: more drafts for the grammar to refuse
        settings["drafter__tree_budget"] = 4  # drafts at every batch size (auto shares measured rows among them)
    llm = engine(guide__name=guide, **settings)
    before = llm.engine.stats.num_draft_tokens
    outputs = llm.generate(
        [r.messages for r in requests], [params(i, 0.0, r.constraint) for i, r in enumerate(requests)]
    )
    assert llm.engine.stats.num_draft_tokens > before, "nothing was drafted"
    mismatched = [i for i, output in enumerate(outputs) if output.outputs[0].token_ids != reference[i]]
    assert not mismatched, f"drafted outputs differ from undrafted ones for requests {mismatched}"
    sampled = llm.generate(
        [r.messages for r in requests], [params(i, 0.8, r.constraint) for i, r in enumerate(requests)]
    )
    assert_all_satisfy(sampled, requests)  # rejection sampling over masked target distributions


def test_a_configured_guide_leaves_unconstrained_rows_token_identical():
    """Mixed in one batch with constrained requests, unconstrained ones get exactly what they get with no guide."""
    plain = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * len(PROMPTS)
    reference = [o.outputs[0].token_ids for o in engine(guide__name="none").generate(PROMPTS, plain)]
    mixed_prompts = PROMPTS + [r.messages for r in REQUESTS[:4]]
    mixed_params = plain + [params(i, 0.0, r.constraint) for i, r in enumerate(REQUESTS[:4])]
    for guide in GUIDES:
        outputs = engine(guide__name=guide).generate(mixed_prompts, mixed_params)
        assert [o.outputs[0].token_ids for o in outputs[: len(PROMPTS)]] == reference, guide
        assert_all_satisfy(outputs[len(PROMPTS) :], REQUESTS[:4])


@pytest.mark.slow  # three samples of six requests through a preempting pool; the constraints' other tests stay
def test_samples_preemption_and_prefix_hits_keep_constraints():
    """n = 3 samples per request over a pool small enough to preempt, with hash prefix caching: every sample
    satisfies its constraint, and greedy outputs equal those of a roomy pool."""
    requests = REQUESTS[:6]
    llm = engine(
        guide__name="xgrammar",
        prefix_cache__name="hash",
        cache__num_blocks=40,
        model__max_model_len=320,
        scheduler__max_num_seqs=16,
    )
    sampled = llm.generate(
        [r.messages for r in requests], [params(i, 0.8, r.constraint, n=3) for i, r in enumerate(requests)]
    )
    for output, request in zip(sampled, requests):
        assert len(output.outputs) == 3
        for sample in output.outputs:
            assert sample.finish_reason == "stop" and satisfies(sample.text, request.constraint) is None, sample.text
    greedy = llm.generate(
        [r.messages for r in requests], [params(i, 0.0, r.constraint) for i, r in enumerate(requests)]
    )
    assert llm.engine.stats.num_preemptions > 0, "the pool was roomy enough not to preempt"
    assert llm.engine.prefix_cache.stats.hit_tokens > 0
    assert [o.outputs[0].token_ids for o in greedy] == constrained_greedy("xgrammar")[:6]


def test_constraint_errors_name_the_field_and_spare_the_others():
    llm = engine(guide__name="xgrammar")
    bad = SamplingParams(max_tokens=8, constraint={"json_schema": {"type": "nonsense"}})
    good = SamplingParams(max_tokens=4, temperature=0.0)
    refused, served = llm.generate(PROMPTS[:2], [bad, good])
    assert refused.finish_reason == "error" and "invalid json_schema constraint" in refused.error
    assert len(served.outputs[0].token_ids) == 4
    none = engine(guide__name="none").generate(PROMPTS[:1], [params(0, 0.0, Constraint(regex="[0-9]+"))])[0]
    assert none.finish_reason == "error" and "guide.name=xgrammar" in none.error


@pytest.mark.parametrize("guide", ["xgrammar", pytest.param("llguidance", marks=SLOW)])
def test_jump_forward_drafts_the_forced_tokens_and_changes_nothing(guide):
    """With no drafter, the tokens a grammar forces (a JSON key after the brace) are drafted and verified: fewer
    steps, the same tokens as with guide.jump_forward off."""
    requests = [r for r in REQUESTS if r.constraint.kind == "json_schema"][:6]
    prompts = [r.messages for r in requests]
    greedy = [params(i, 0.0, r.constraint) for i, r in enumerate(requests)]
    plain = engine(guide__name=guide, guide__jump_forward=False)
    reference = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy)]
    steps_without = plain.engine.stats.num_steps
    assert plain.engine.stats.num_draft_tokens == 0
    jumping = engine(guide__name=guide)
    outputs = jumping.generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    stats = jumping.engine.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > stats.num_verify_passes
    assert stats.num_steps < steps_without
