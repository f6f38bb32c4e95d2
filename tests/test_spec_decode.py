"""Speculative decoding with the ngram, model and eagle drafters: the output is exactly the target's.

Greedy outputs (float32) with every drafter equal the outputs without drafts in mixed batches (chunked prefills next
to verification), with a radix cache hit and under preemption, and so do seeded samples at temperature 0.8 (the
drafters here are deterministic). A draft model identical to the target has every draft accepted, random drafts
change nothing, and a drafter that samples its guesses leaves the target's token distribution intact.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from infer import LLM, SamplingParams
from infer.drafter import Drafter, DraftTree
from infer.engine.sampler import SampleRequest
from infer.engine.spec_decode import verify_sampled_drafts
from infer.registry import get_registry
from infer.testing import DrafterConformance
from infer.testing.drafter import with_kv_cache
from infer.testing.models import make_tiny_model_dir

MAX_TOKENS = 32


@pytest.fixture(scope="module")
def other_model_dir(tiny_model_dir, tmp_path_factory):
    """The target with noise on every weight (20% of their scale), saved with the same tokenizer: a draft model that
    agrees with the target only some of the time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.02)
    destination = tmp_path_factory.mktemp("tiny-draft")
    model.save_pretrained(destination)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(destination)
    return str(destination)


@pytest.fixture(params=["ngram", "model-self", "model-other", "eagle", "eagle-tree"])
def drafter(request, other_model_dir):
    """Config overrides selecting each drafter (the eagle head is untrained: output must not depend on it), eagle
    drafting chains and trees."""
    return {
        "ngram": {"drafter__name": "ngram"},
        "model-self": {"drafter__name": "model", "drafter__layers": 1},
        "model-other": {"drafter__name": "model", "drafter__path": other_model_dir},
        "eagle": {"drafter__name": "eagle", "drafter__head": "random", "drafter__tree_width": 1},
        "eagle-tree": {"drafter__name": "eagle", "drafter__head": "random", "drafter__tree_budget": 4},
    }[request.param]


def mixed_prompts(seed: int = 0) -> list[list[int]]:
    """Token-id prompts of very different lengths, some repeating a phrase (so prompt lookup finds matches)."""
    rng = random.Random(seed)
    phrase = [rng.randrange(100, 5000) for _ in range(6)]
    return [
        phrase * 4 + [7, 8],
        [rng.randrange(100, 5000) for _ in range(70)],
        phrase[:3] * 3,
        [rng.randrange(100, 5000) for _ in range(12)] + phrase * 2,
        [42] * 5,
    ]


def make_llm(model_dir: str, **overrides) -> LLM:
    settings = {
        "model__path": model_dir,
        "model__dtype": "float32",
        "model__max_model_len": 256,
        "cache__num_blocks": 128,
        **overrides,
    }
    return LLM("baseline", **settings)


def generate(model_dir: str, prompts, params, **overrides):
    """Output token ids per prompt, and the engine's stats."""
    llm = make_llm(model_dir, **overrides)
    return [output.token_ids for output in llm.generate(prompts, params)], llm.engine.stats


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def accepted_drafts(stats) -> int:
    """Drafts the target agreed with (each verify pass also commits one token of its own)."""
    return stats.num_accepted_tokens - stats.num_verify_passes


# -- the output is the target's -------------------------------------------------------------------------------------
def test_greedy_output_equals_no_draft_in_a_mixed_batch(tiny_model_dir, drafter):
    prompts = mixed_prompts()
    # A 32-token budget chunks the 70-token prompt over steps in which the others already verify drafts.
    expected, _ = generate(tiny_model_dir, prompts, greedy(), scheduler__max_num_batched_tokens=32)
    outputs, stats = generate(tiny_model_dir, prompts, greedy(), scheduler__max_num_batched_tokens=32, **drafter)
    assert outputs == expected
    assert stats.num_verify_passes > 0
    assert 0 < accepted_drafts(stats) < stats.num_draft_tokens, "drafts should be both accepted and rejected"


def test_greedy_output_equals_no_draft_with_a_radix_cache_hit(tiny_model_dir, drafter):
    shared = mixed_prompts()[1][:40]
    first_wave = [shared + [11, 12, 13], shared[:20] * 2]
    second_wave = [shared + [21, 22], shared + [31] * 6]
    expected, _ = generate(tiny_model_dir, second_wave, greedy())
    llm = make_llm(tiny_model_dir, prefix_cache__name="radix", scheduler__name="lpm", **drafter)
    llm.generate(first_wave, greedy())
    hits_before = llm.engine.stats.num_cached_prompt_tokens
    outputs = [output.token_ids for output in llm.generate(second_wave, greedy())]
    assert llm.engine.stats.num_cached_prompt_tokens - hits_before >= 2 * 32, "the second wave should hit the cache"
    assert outputs == expected


def test_greedy_output_equals_no_draft_under_preemption(tiny_model_dir, drafter):
    prompts = mixed_prompts()
    # 7 usable blocks of 16 tokens cannot hold five sequences growing to 40-100 tokens: some are preempted.
    settings = {"model__max_model_len": 112, "cache__num_blocks": 8}
    expected, _ = generate(tiny_model_dir, prompts, greedy(), **settings)
    outputs, stats = generate(tiny_model_dir, prompts, greedy(), **settings, **drafter)
    assert stats.num_preemptions > 0
    assert stats.num_verify_passes > 0
    assert outputs == expected


def test_seeded_sampling_equals_no_draft(tiny_model_dir, drafter):
    prompts = mixed_prompts(seed=3)
    # top_k=2 keeps the random model's samples repetitive enough for drafts to come true now and then.
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_k=2, seed=100 + i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    expected, _ = generate(tiny_model_dir, prompts, params)
    outputs, stats = generate(tiny_model_dir, prompts, params, **drafter)
    assert accepted_drafts(stats) > 0
    assert outputs == expected


# -- acceptance -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("identical", [{"drafter__path": "TARGET"}, {"drafter__layers": 2}], ids=["model", "self"])
def test_draft_identical_to_the_target_accepts_every_draft(tiny_model_dir, identical):
    # The tiny target has 2 layers, so its first 2 layers are the whole model. A drafter that forgot to feed its
    # last guess after a fully accepted pass would draft from a stale KV slot and see rejections.
    overrides = {key: tiny_model_dir if value == "TARGET" else value for key, value in identical.items()}
    prompts = mixed_prompts()
    expected, _ = generate(tiny_model_dir, prompts, greedy())
    outputs, stats = generate(tiny_model_dir, prompts, greedy(), drafter__name="model", **overrides)
    assert outputs == expected
    assert stats.num_draft_tokens > 0
    assert accepted_drafts(stats) == stats.num_draft_tokens
    assert stats.mean_accepted_per_pass > 4.5  # k = 4: five tokens a pass, fewer only where max_tokens cuts drafts


def test_steps_with_drafter_none_call_no_drafter_method(tiny_model_dir, monkeypatch):
    """``num_speculative_tokens`` defaults to 4, yet with ``drafter: none`` no step (prefill, decode, preemption,
    finishing) crosses into the drafter."""
    llm = make_llm(tiny_model_dir, model__max_model_len=112, cache__num_blocks=8)
    drafter = llm.engine.drafter
    assert llm.config.drafter.name == "none" and llm.config.drafter.num_speculative_tokens > 0
    calls = []
    for name in ("propose", "observe", "rollback", "release", "kv_bytes_per_token", "allocate_kv_cache"):
        monkeypatch.setattr(drafter, name, lambda *args, _name=name, **kwargs: calls.append(_name))
    llm.generate(mixed_prompts(), greedy())
    assert llm.engine.stats.num_preemptions > 0 and llm.engine.stats.num_output_tokens > 0
    assert calls == []


class RandomTokenDrafter(Drafter):
    """Guesses k random token ids."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.rng = random.Random(0)

    def propose(self, sequences, k):
        return [[self.rng.randrange(self.vocab_size) for _ in range(k)] for _ in sequences]


class OracleTreeDrafter(Drafter):
    """Knows each prompt's greedy continuation and drafts trees whose every accepted path ends in a leaf: the spine
    guesses right then wrong, with the right second guess on a leaf beside it (three tokens a pass), or the spine
    guesses wrong beside a right leaf (two tokens a pass), turn about."""

    def __init__(self, expected: dict[tuple[int, ...], list[int]], vocab_size: int):
        super().__init__()
        self.expected = expected
        self.vocab_size = vocab_size
        self.passes = 0

    def propose(self, sequences, k):
        proposals = []
        for seq in sequences:
            future = self.expected[tuple(seq.prompt_token_ids)][seq.num_output_tokens :]
            self.passes += 1
            if len(future) < 3 or k < 4:
                proposals.append([])
            elif self.passes % 2:
                proposals.append(
                    DraftTree([future[0], self.wrong(future[1]), self.wrong(future[0]), future[1]], [-1, 0, -1, 0])
                )
            else:
                proposals.append(DraftTree([self.wrong(future[0]), future[0]], [-1, -1]))
        return proposals

    def wrong(self, token: int) -> int:
        return (token + 1) % self.vocab_size


def test_a_draft_trees_accepted_leaf_leaves_the_output_unchanged(tiny_model_dir):
    """Every accepted path ends in a leaf, whose K/V the engine moves from its own slot (past the spine) to its
    position before the next step reads them: the output equals the target's alone, in a mixed batch with chunked
    prefills (a budget cut drops a tree's last drafts), and each pass commits more than one token."""
    prompts = mixed_prompts()
    settings = {"scheduler__max_num_batched_tokens": 32}
    expected, _ = generate(tiny_model_dir, prompts, greedy(), **settings)
    llm = make_llm(tiny_model_dir, **settings)
    assert llm.engine.speculation.move_kv is not None  # the cpu backend attends trees
    llm.engine.speculation.drafter = OracleTreeDrafter(
        {tuple(prompt): output for prompt, output in zip(prompts, expected)}, llm.engine.model.vocab_size
    )
    outputs = [output.token_ids for output in llm.generate(prompts, greedy())]
    assert outputs == expected
    assert llm.engine.stats.mean_accepted_per_pass > 2.2


def test_a_draft_trees_logprobs_are_those_of_the_rows_on_its_accepted_path(tiny_model_dir):
    """Each committed token's logprobs come from the row that chose it, a leaf's included: those without drafts,
    to the rounding of a matrix product over several rows instead of one."""
    prompts = mixed_prompts()[:3]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    expected = make_llm(tiny_model_dir).generate(prompts, params)
    llm = make_llm(tiny_model_dir)
    llm.engine.speculation.drafter = OracleTreeDrafter(
        {tuple(prompt): output.token_ids for prompt, output in zip(prompts, expected)}, llm.engine.model.vocab_size
    )
    outputs = llm.generate(prompts, params)
    assert llm.engine.stats.mean_accepted_per_pass > 2.2
    for got, want in zip(outputs, expected):
        assert got.token_ids == want.token_ids
        for mine, theirs in zip(got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
            assert mine["token_id"] == theirs["token_id"]
            assert [token for token, _ in mine["top"]] == [token for token, _ in theirs["top"]]
            assert mine["logprob"] == pytest.approx(theirs["logprob"], abs=1e-4)


def test_a_tree_is_cut_to_its_spine_where_it_cannot_be_verified(tiny_model_dir):
    """Sampled requests, and every request on a backend without ``draft_trees`` (sdpa), get the tree's spine only:
    the output stays the target's."""
    prompts = mixed_prompts()
    sampled = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_k=2, seed=7 + i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    for settings, params in (({"attention__name": "sdpa"}, greedy()), ({}, sampled)):
        expected, _ = generate(tiny_model_dir, prompts, params, **settings)
        llm = make_llm(tiny_model_dir, **settings)
        drafter = OracleTreeDrafter(
            {tuple(prompt): output for prompt, output in zip(prompts, expected)}, llm.engine.model.vocab_size
        )
        llm.engine.speculation.drafter = drafter
        parents = []
        llm.engine.speculation.accept = lambda seq, sampled_, seen=parents, accept=llm.engine.speculation.accept: (
            seen.append(seq.draft_parents) or accept(seq, sampled_)
        )
        outputs = [output.token_ids for output in llm.generate(prompts, params)]
        assert outputs == expected
        assert parents and all(tree is None for tree in parents)


def test_an_accepted_leaf_moves_its_kv_and_its_hidden_state_to_its_position():
    """``accept`` walks the tree to the leaf the target agrees with, asks for the leaf's K/V to be copied from its
    slot to its position's, and ``after_step`` puts its hidden state in the row a drafter reads for that position."""
    from types import SimpleNamespace

    from infer.engine.spec_decode import SpeculativeDecoder
    from infer.outputs import BatchRows, StepOutput
    from infer.sequence import Sequence

    observed, moves = [], []
    drafter = SimpleNamespace(observe=observed.append, propose=lambda sequences, k: [], kv_bytes_per_token=lambda: 0)
    config = SimpleNamespace(num_speculative_tokens=4, max_batch_size=8)
    stats = SimpleNamespace(num_verify_passes=0, num_accepted_tokens=0, num_draft_tokens=0)
    speculation = SpeculativeDecoder(drafter, config, kv=None, max_model_len=256, stats=stats)
    speculation.move_kv = lambda seq, source, target: moves.append((source, target))
    seq = Sequence("s", [1, 2, 3], greedy())
    seq.num_computed_tokens = 2  # token 2 (the root) is computed by this step with the drafts
    seq.draft_token_ids, seq.draft_parents = [10, 11, 12, 13], [-1, 0, -1, 0]  # spine 10, 11; leaves 12, 13
    # rows: root -> 10 (spine), after 10 -> 13 (the leaf beside 11), after the leaf -> 20 (the bonus)
    tokens, rows = speculation.accept(seq, [10, 13, 99, 98, 20])
    assert tokens == [10, 13, 20] and rows == [0, 1, 4]
    assert moves == [(3 + 3, 3 + 1)]  # the leaf's token index (3 committed + draft 3) -> position 3 + 1
    hidden = torch.arange(5.0).unsqueeze(1).repeat(1, 2)
    output = StepOutput(torch.zeros(5, 4), [], hidden, [BatchRows(seq, 0, 5, 2)])
    speculation.after_step(output, [])
    assert observed == [output] and hidden[2].tolist() == [4.0, 4.0]  # the leaf's row at its position's


def test_draft_trees_are_caterpillars():
    from infer.drafter import DraftTree, tree_depths

    assert tree_depths([-1, 0, 1]) == [1, 2, 3]  # a chain
    assert DraftTree([5, 6, 7, 8], [-1, 0, -1, 1]).depths == [1, 2, 1, 3]  # leaves beside the spine's drafts
    assert DraftTree([5, 6], [-1, 0]).spine_length == 2
    for parents in ([-1, -1, 1], [-1, 0, 2], [0]):  # a leaf's child, a parent after its child, no root
        with pytest.raises(ValueError, match="hang off the root"):
            tree_depths(parents)


def test_eagle_tree_growth_keeps_the_likeliest_paths():
    """EAGLE-2's reranking: of every guess, the ``budget`` with the largest path probability; the chain grows while
    its next guess could still rank among them."""
    from infer.plugins.drafters.eagle.drafter import TreeGrowth

    growth = TreeGrowth(3)
    assert growth.add([10, 11, 12], [0.6, 0.3, 0.1])  # 0.6 * 0.6 could beat 0.1
    assert not growth.add([20, 21, 22], [0.5, 0.2, 0.1])  # paths 0.3, 0.12, 0.06: the third best is 0.3
    tree = growth.tree()
    assert list(tree) == [10, 20, 11] and tree.parents == [-1, 0, -1]  # 0.6, 0.3 (spine), 0.3 (leaf at depth 1)


def test_random_drafts_leave_the_output_unchanged(tiny_model_dir):
    prompts = mixed_prompts()
    expected, _ = generate(tiny_model_dir, prompts, greedy())
    llm = make_llm(tiny_model_dir)
    llm.engine.speculation.drafter = RandomTokenDrafter(llm.engine.model.vocab_size)
    outputs = [output.token_ids for output in llm.generate(prompts, greedy())]
    assert outputs == expected
    assert llm.engine.stats.num_draft_tokens > 0


# -- a drafter that samples: verification with q --------------------------------------------------------------------
def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# Chi-square critical value for 15 degrees of freedom (16 tokens) at significance 0.001.
CRITICAL_15_DOF = 37.7


def shifted_by(probs: torch.Tensor, amount: float) -> torch.Tensor:
    """``probs`` with ``amount`` of mass moved from its likeliest token to its least likely one (a TV error)."""
    shifted = probs.clone()
    shifted[probs.argmax()] -= amount
    shifted[probs.argmin()] += amount
    return shifted


def test_rejection_sampler_follows_p_whatever_q():
    generator = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(16, generator=generator) * 1.5, 0)
    q = torch.softmax(torch.randn(16, generator=generator) * 1.5, 0)
    logits = torch.log(p).repeat(2, 1)  # temperature 1: the sampler's p is softmax(logits)
    params = SamplingParams(temperature=1.0)
    counts = torch.zeros(16)
    for seed in range(20000):
        draft = int(torch.multinomial(q, 1, generator=generator))
        requests = [SampleRequest(params, 10, seed), SampleRequest(params, 11, seed)]
        counts[verify_sampled_drafts(logits, requests, [draft], q[None])[0]] += 1
    assert chi_square(counts, p) < CRITICAL_15_DOF
    assert chi_square(counts, shifted_by(p, 0.02)) > CRITICAL_15_DOF, "20000 draws should expose a 2% error"
    assert chi_square(counts, q) > CRITICAL_15_DOF


@pytest.fixture(scope="module")
def small_vocab_models(tmp_path_factory):
    """A target and a different draft model over a 16-token vocabulary (one distribution is easy to tabulate)."""
    target = make_tiny_model_dir(tmp_path_factory.mktemp("tiny-v16"), seed=0, vocab_size=16)
    draft = make_tiny_model_dir(tmp_path_factory.mktemp("tiny-v16-draft"), seed=5, vocab_size=16)
    return str(target), str(draft)


def next_token_probs(model_dir: str, prefix: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return torch.softmax(model(torch.tensor([prefix])).logits[0, -1].float(), dim=-1)


def test_sampling_drafter_keeps_the_target_distribution(small_vocab_models):
    """The second output token comes out of verification (the first is the prefill's). Given the first token t0 it
    must follow the target's p(. | prompt, t0), so over all samples its counts must match the mixture of those
    conditionals over the observed t0 (chi-square at 0.001), while the draft model's own mixture must be rejected."""
    target_dir, draft_dir = small_vocab_models
    prompt = [3, 9, 4, 12, 7]
    num_samples = 6000
    llm = make_llm(
        target_dir,
        drafter__name="model",
        drafter__path=draft_dir,
        drafter__sampling=True,
        drafter__num_speculative_tokens=3,
        drafter__max_batch_size=512,
        scheduler__max_num_seqs=512,
        cache__num_blocks=2200,
    )
    params = [SamplingParams(max_tokens=4, temperature=1.0, seed=seed, ignore_eos=True) for seed in range(num_samples)]
    outputs = llm.generate([prompt] * num_samples, params)
    stats = llm.engine.stats
    assert 0 < accepted_drafts(stats) < stats.num_draft_tokens
    first = torch.tensor([output.token_ids[0] for output in outputs])
    second = torch.tensor([output.token_ids[1] for output in outputs])
    first_counts = torch.bincount(first, minlength=16).float()
    target_mixture = (
        sum(first_counts[t] * next_token_probs(target_dir, prompt + [t]) for t in range(16) if first_counts[t] > 0)
        / num_samples
    )
    draft_mixture = (
        sum(first_counts[t] * next_token_probs(draft_dir, prompt + [t]) for t in range(16) if first_counts[t] > 0)
        / num_samples
    )
    counts = torch.bincount(second, minlength=16).float()
    assert chi_square(counts, target_mixture) < CRITICAL_15_DOF
    assert chi_square(counts, shifted_by(target_mixture, 0.02)) > CRITICAL_15_DOF, "too few samples for a 2% error"
    assert chi_square(counts, draft_mixture) > CRITICAL_15_DOF


# -- the drafter conformance suite with a target engine -------------------------------------------------------------
@pytest.fixture(scope="module")
def vocab64_model_dir(tmp_path_factory):
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny-v64"), seed=2, vocab_size=64))


class EngineBackedConformance(DrafterConformance):
    """The suite's drafter gets a tiny target model (its documented way in): a context from an engine over it, and
    the end-to-end check inside that engine."""

    @pytest.fixture
    def target_model_dir(self, vocab64_model_dir):
        return vocab64_model_dir


class TestModelDrafterConformance(EngineBackedConformance):
    impl_name = "model"


class TestEagleDrafterConformance(EngineBackedConformance):
    impl_name = "eagle"

    @pytest.fixture
    def drafter_factory(self, drafter_context):
        from infer.registry import get_registry

        implementation = self.load_implementation("eagle")
        # a fixed tree budget: the tiny model's steps take a fraction of a millisecond, where measuring the rows a
        # step verifies for free is mostly noise (it may leave the suite's sequences none)
        config = get_registry().config_model("drafter", "eagle")(head="random", min_confidence=0.0, tree_budget=4)
        return lambda: with_kv_cache(implementation(config, drafter_context))

    def drafter_overrides(self, name: str) -> dict:
        return {"drafter.name": name, "drafter.head": "random", "drafter.min_confidence": 0.0, "drafter.tree_budget": 4}


def test_eagle_head_packing_follows_head_quantization():
    from types import SimpleNamespace

    from infer.plugins.drafters.eagle.drafter import head_packing

    on_kernels = SimpleNamespace(executor=SimpleNamespace(kernels=object()), quantization="bf16")
    assert head_packing("auto", on_kernels) == "int8_per_row"  # half the bytes a draft step streams
    assert head_packing("target", on_kernels) == "bf16"
    assert head_packing("fp16", on_kernels) == "fp16"
    # Without the kernels, or with projections they do not run (float32, w8a8): the target's packing.
    assert head_packing("auto", SimpleNamespace(executor=SimpleNamespace(kernels=None), quantization="bf16")) == "bf16"
    assert head_packing("auto", SimpleNamespace(executor=on_kernels.executor, quantization="none")) == "none"
    with pytest.raises(ValueError, match="choose auto, target or one of"):
        get_registry().config_model("drafter", "eagle")(head_quantization="int4")


@pytest.mark.parametrize("packing", ["int8_per_row", "fp16"])
def test_eagle_head_packed_apart_from_the_target_keeps_the_output(tiny_model_dir, packing):
    prompts = mixed_prompts()
    expected, _ = generate(tiny_model_dir, prompts, greedy(), scheduler__max_num_batched_tokens=32)
    llm = make_llm(
        tiny_model_dir,
        scheduler__max_num_batched_tokens=32,
        drafter__name="eagle",
        drafter__head="random",
        drafter__min_confidence=0.0,
        drafter__head_quantization=packing,
        drafter__tree_budget=4,
    )
    assert llm.engine.drafter.head.layer.mlp.down_proj.mode == packing
    outputs = [output.token_ids for output in llm.generate(prompts, greedy())]
    assert outputs == expected
    assert llm.engine.stats.num_verify_passes > 0


def test_eagle_fused_head_drafts_what_the_head_through_the_executor_drafts(tiny_model_dir, monkeypatch):
    """Where the head's layer and projections run on the CPU kernels' GEMV, a draft step is one C call
    (``FusedDraftHead``): it proposes exactly the drafts the same step through the executor's paths proposes, chains
    of several guesses included, and the output stays the target's."""
    from infer.kernels.cpu import FusedDraftHead
    from infer.plugins.drafters.eagle.drafter import EagleDrafter

    prompts = mixed_prompts()
    target = {"model__quantization": "fp16", "execution__fused_max_tokens": 8}  # the head on the GEMV beside it
    expected, _ = generate(tiny_model_dir, prompts, greedy(), **target)
    runs = []
    monkeypatch.setattr(FusedDraftHead, "run", _counted(FusedDraftHead.run, runs))

    def drafts_of():
        llm = make_llm(
            tiny_model_dir,
            drafter__name="eagle",
            drafter__head="random",
            drafter__head_quantization="int8_per_row",
            drafter__tree_budget=4,
            **target,
        )
        proposed = []
        drafter = llm.engine.drafter
        original = drafter.propose
        drafter.propose = lambda sequences, k: proposed.append(original(sequences, k)) or proposed[-1]
        outputs = [output.token_ids for output in llm.generate(prompts, greedy())]
        assert outputs == expected
        return proposed

    fused = drafts_of()
    assert runs, "the fused head never ran"
    count = len(runs)
    monkeypatch.setattr(EagleDrafter, "_takes_fused_head", lambda self, metadata, dtype: False)
    through_layers = drafts_of()
    assert len(runs) == count  # the second engine never took it
    assert through_layers == fused and any(len(chain) > 1 for step in fused for chain in step)


def _counted(function, calls: list):
    def wrapper(*args, **kwargs):
        calls.append(1)
        return function(*args, **kwargs)

    return wrapper


def test_eagle_confidence_threshold_shortens_chains_and_keeps_the_output(tiny_model_dir):
    prompts = mixed_prompts()
    expected, _ = generate(tiny_model_dir, prompts, greedy())
    eagle = {"drafter__name": "eagle", "drafter__head": "random", "drafter__tree_width": 1}
    _, full = generate(tiny_model_dir, prompts, greedy(), **eagle, drafter__min_confidence=0.0)
    outputs, short = generate(tiny_model_dir, prompts, greedy(), **eagle, drafter__min_confidence=1.0)
    assert outputs == expected
    # Every guess of an untrained head is doubtful: each chain ends after its first draft.
    assert short.num_draft_tokens == short.num_verify_passes > 0
    assert full.num_draft_tokens > full.num_verify_passes


# -- training and the shipped head ----------------------------------------------------------------------------------
def test_train_eagle_writes_a_head_the_drafter_uses(tiny_model_dir, tmp_path):
    from click.testing import CliRunner

    from infer.plugins.drafters.eagle.command import train_eagle_command

    out = tmp_path / "head"
    result = CliRunner().invoke(
        train_eagle_command,
        [
            "baseline",
            f"model.path={tiny_model_dir}",
            "model.dtype=float32",
            "model.max_model_len=256",
            "--out",
            str(out),
            "--num-prompts",
            "24",
            "--self-prompts",
            "8",
            "--max-tokens",
            "24",
            "--epochs",
            "1",
        ],
    )
    assert result.exit_code == 0, result.output
    assert (out / "head.safetensors").is_file()
    card = (out / "README.md").read_text()
    assert "tokens per verify pass" in card and "infer train-eagle" in card
    prompts = mixed_prompts()
    expected, _ = generate(tiny_model_dir, prompts, greedy())
    outputs, stats = generate(
        tiny_model_dir, prompts, greedy(), drafter__name="eagle", drafter__head=str(out), drafter__tree_budget=4
    )
    assert outputs == expected
    assert stats.num_verify_passes > 0


def test_self_written_prompts_continue_the_user_turn_and_keep_distinct_finished_requests(tiny_model_dir):
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from infer.plugins.drafters.eagle.training import self_written_prompts

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    template = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    user_prefix = tokenizer.encode(template[: template.index("hi")], add_special_tokens=False)
    calls = []

    def generate(prompts, params, use_tqdm):
        calls.append((prompts, params))
        replies = [
            ("How do tides work?", "stop"),
            ("How do tides work?", "stop"),
            ("A request cut off", "length"),
            ("  Name a bird.  ", "stop"),
            ("ok", "stop"),
        ]
        return [
            SimpleNamespace(text=text, finish_reason=reason, error=None, token_ids=[0] * (2 if text == "ok" else 5))
            for (text, reason), _ in zip(replies * len(prompts), prompts)
        ]

    llm = SimpleNamespace(engine=SimpleNamespace(tokenizer=tokenizer), generate=generate)
    prompts = self_written_prompts(llm, 3, seed=7)
    # Each sample continues the template exactly where a user's message begins, from a seed of its own.
    sent, params = calls[0]
    assert all(prompt == user_prefix for prompt in sent) and len(sent) >= 3
    assert len({p.seed for p in params}) == len(params) and all(p.temperature == 1.0 for p in params)
    # Kept: finished by the model, at least 4 tokens, stripped, each once.
    assert prompts == [
        [{"role": "user", "content": "How do tides work?"}],
        [{"role": "user", "content": "Name a bird."}],
    ]
    assert self_written_prompts(llm, 0, seed=7) == []


def test_feature_recorder_keeps_each_position_once_and_overwrites_after_preemption():
    from infer.outputs import BatchRows, StepOutput
    from infer.plugins.drafters.eagle.training import FeatureRecorder
    from infer.sequence import Sequence

    seq = Sequence(seq_id="r/0", prompt_token_ids=[1, 2, 3, 4], params=SamplingParams(max_tokens=4))
    recorder = FeatureRecorder()

    def step(first_position: int, rows: torch.Tensor) -> None:
        recorder.observe(
            StepOutput(
                logits=torch.zeros(1, 1),
                rows=[],
                hidden_states=rows,
                token_rows=[BatchRows(seq, 0, rows.shape[0], first_position)],
            )
        )

    step(0, torch.full((4, 2), 1.0))  # prefill
    step(4, torch.full((1, 2), 2.0))  # a decode
    step(2, torch.full((3, 2), 3.0))  # preempted, recomputed from position 2
    features = recorder.take("r/0", 5)
    assert features[:, 0].tolist() == [1.0, 1.0, 3.0, 3.0, 3.0] and features.dtype == torch.bfloat16
    assert not recorder.features and not recorder.lengths  # released


SHIPPED = Path(__file__).resolve().parents[1] / "plugins" / "drafters" / "eagle" / "heads" / "smollm2-135m-instruct"


def test_shipped_head_is_small_and_documented():
    from safetensors import safe_open

    head = SHIPPED / "head.safetensors"
    assert head.stat().st_size < 20 * 2**20
    with safe_open(str(head), framework="pt") as handle:
        metadata = handle.metadata()
    assert metadata["target"] == "smollm2-135m-instruct"
    card = (SHIPPED / "README.md").read_text()
    assert "tokens per verify pass" in card and "infer train-eagle" in card


@pytest.mark.slow
def test_flagship_config_runs_the_shipped_head_with_the_target_output():
    chats = [
        [{"role": "user", "content": text}]
        for text in ("What is the capital of Italy?", "Write two sentences about rivers.", "Name three colors.")
    ]
    params = SamplingParams(max_tokens=48, temperature=0.0)
    plain = LLM("radix_lpm_eagle", model__dtype="float32", drafter__name="none").generate(chats, params)
    llm = LLM("radix_lpm_eagle", model__dtype="float32")
    outputs = [llm.generate([chat], params)[0] for chat in chats]  # one at a time: where drafting pays on a CPU
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    stats = llm.engine.stats
    # trees of a few drafts (as many as a decode step's time verifies on this CPU), a path of them accepted
    assert stats.mean_accepted_per_pass > 1.3
    assert stats.num_draft_tokens <= llm.engine.drafter.tree_budget * stats.num_verify_passes
