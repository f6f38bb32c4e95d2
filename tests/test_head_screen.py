"""The output head's screen for greedy rows (``infer.model.head_screen``): its first maximum per row is the bf16
head's, in the C kernels of each instruction set, over each layout of the exact weights, and in the engine."""

from __future__ import annotations

import pytest
import torch

from infer import LLM, SamplingParams
from infer.kernels.cpu.packing import pack_tiles, pack_weights
from infer.model.head_screen import HeadScreen
from infer.model.layers import Linear
from infer.model.quantization import PackedLinear

VOCAB, HIDDEN = 2048, 128


def near_tie_head(seed: int = 0) -> torch.Tensor:
    """A bf16 head ``[VOCAB, HIDDEN]`` whose rows come in pairs a bf16 step or two apart in a few weights: the two
    logits of a pair differ by far less than the int8 copy's error, so only the exact logits tell them apart."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator) * 0.05
    weight[1::2] = weight[0::2]
    nudged = torch.randint(0, HIDDEN, (VOCAB // 2, 4), generator=generator)
    for pair, columns in enumerate(nudged):
        row = weight[2 * pair + 1]
        row[columns] += torch.randn(4, generator=generator) * 0.002
    return weight.bfloat16()


def screened_head(kernels, weight: torch.Tensor) -> tuple[PackedLinear, HeadScreen]:
    linear = Linear(HIDDEN, VOCAB, bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight.float())
    head = PackedLinear(linear, "bf16")
    head.use_cpu_kernels(kernels, gemv_rows=8)
    return head, HeadScreen(head, kernels)


def hidden_rows(count: int, weight: torch.Tensor, seed: int) -> torch.Tensor:
    """Rows of x that put one of the near-tied pairs on top of each row: a pair's shared row plus noise."""
    generator = torch.Generator().manual_seed(seed)
    pairs = torch.randint(0, VOCAB // 2, (count,), generator=generator)
    return (weight[2 * pairs].float() * 40 + torch.randn(count, HIDDEN, generator=generator)).contiguous()


def test_screened_rows_choose_the_tokens_the_bf16_head_chooses(kernels):
    weight = near_tie_head()
    head, screen = screened_head(kernels, weight)
    x = hidden_rows(64, weight, seed=1)
    reference = (x.double() @ weight.double().T).argmax(dim=1)
    chosen = torch.cat([screen.logits(x[i : i + 4]).argmax(dim=1) for i in range(0, 64, 4)])
    assert torch.equal(chosen, reference)
    approximate = kernels.linear(x, screen.weight, screen.scales, None)
    assert not torch.equal(approximate.argmax(dim=1), reference), "the int8 copy alone should miss some near ties"
    counts = kernels.screen_rows(x, approximate.clone(), screen.bounds, screen.exact, screen.cap)
    assert (counts >= 2).all() and counts.float().mean() < 0.02 * VOCAB  # a few candidates: the bound is useful
    assert screen.rows_screened == 64 and screen.rows_to_full_head == 0


def test_each_tokens_bound_is_its_largest_error_with_little_headroom(kernels):
    """One-hot rows of x read the int8 copy's weights one at a time (the sums have one term: no rounding), so their
    errors are the copy's own: each token's largest must lie within its bound and near it (a bound too small by a
    tenth fails)."""
    weight = near_tie_head(seed=3)
    _, screen = screened_head(kernels, weight)
    ones = torch.eye(HIDDEN)
    copy = kernels.linear(ones, screen.weight, screen.scales, None)  # [HIDDEN, VOCAB]: scale_j * q_ji
    largest = (copy.double() - weight.double().T).abs().amax(dim=0)
    bounds = screen.bounds.double()
    assert (largest <= bounds).all()
    assert (largest >= 0.9 * bounds).all()
    x = torch.randn(16, HIDDEN) * 3
    error = (kernels.linear(x, screen.weight, screen.scales, None).double() - x.double() @ weight.double().T).abs()
    assert (error <= bounds[None, :] * x.abs().sum(dim=1, keepdim=True).double()).all()


@pytest.mark.parametrize("layout", ["rows", "tiles", "blocks of four"])
def test_the_candidates_logits_are_exact_from_each_layout_of_the_head(kernels, layout):
    weight = near_tie_head(seed=5)
    _, screen = screened_head(kernels, weight)
    exact_weights = {"rows": weight, "tiles": pack_tiles(weight), "blocks of four": pack_weights(weight)}[layout]
    x = hidden_rows(8, weight, seed=6)
    logits = kernels.linear(x, screen.weight, screen.scales, None)
    approximate = logits.clone()
    counts = kernels.screen_rows(x, logits, screen.bounds, exact_weights, screen.cap)
    exact = (x.double() @ weight.double().T).float()
    changed = logits != approximate
    assert changed.sum(dim=1).tolist() == counts.tolist()
    torch.testing.assert_close(logits[changed], exact[changed], rtol=1e-5, atol=1e-5)
    assert torch.equal(logits.argmax(dim=1), exact.argmax(dim=1))


@pytest.mark.parametrize("build", ["avx2", "portable"])
def test_each_simd_build_chooses_the_tokens_the_bf16_head_chooses(kernels, simd_build, build):
    other = simd_build(build)
    weight = near_tie_head(seed=11)
    quantized, scales, bounds, norms = other.screen_quantize(weight, 1e-3)
    expected = kernels.screen_quantize(weight, 1e-3)
    assert torch.equal(quantized, expected[0]) and torch.equal(scales, expected[1])
    torch.testing.assert_close(bounds, expected[2], rtol=1e-4, atol=0)  # float32 differences, fused or not
    assert torch.equal(norms, expected[3])
    _, screen = screened_head(other, weight)
    x = hidden_rows(12, weight, seed=12)
    chosen = torch.cat([screen.logits(x[i : i + screen.max_rows]).argmax(dim=1) for i in range(0, 12, screen.max_rows)])
    assert torch.equal(chosen, (x.double() @ weight.double().T).argmax(dim=1))


def test_the_portable_build_screens_as_the_vector_one(kernels, simd_build):
    portable = simd_build("portable")
    weight = near_tie_head(seed=7)
    _, screen = screened_head(kernels, weight)
    x = hidden_rows(8, weight, seed=8)
    approximate = kernels.linear(x, screen.weight, screen.scales, None)
    vector, plain = approximate.clone(), approximate.clone()
    counts = kernels.screen_rows(x, vector, screen.bounds, weight, screen.cap)
    assert torch.equal(portable.screen_rows(x, plain, screen.bounds, weight, screen.cap), counts)
    torch.testing.assert_close(plain, vector, rtol=1e-6, atol=1e-6)
    assert torch.equal(plain.argmax(dim=1), vector.argmax(dim=1))


def test_the_vnni_gemv_stays_within_its_rounding_steps(kernels):
    """The int8 copy times x rounded to int16 (AVX512-VNNI): each logit within steps[r] * extra[j] of the copy times
    x exactly, steps[r] no smaller than the rounding of any element of row r, and the screen over it choosing the
    bf16 head's tokens for rows with an outlier element (a real model's hidden state: one element 40x the rest)."""
    if not kernels.screen_vnni:
        pytest.skip(f"this CPU's build has no AVX512-VNNI ({kernels.simd}); the screen multiplies x as it is")
    weight = near_tie_head(seed=13)
    _, screen = screened_head(kernels, weight)
    x = hidden_rows(8, weight, seed=14)
    x[:, 3] = 40 * x.abs().amax()
    logits, steps = kernels.screen_gemv(x, screen.weight, screen.scales)
    copy = kernels.linear(torch.eye(HIDDEN), screen.weight, screen.scales, None).double()  # [HIDDEN, VOCAB]
    norms = copy.abs().sum(dim=0)
    assert (screen.extra.double() >= norms).all() and (screen.extra.double() <= norms * (1 + 2e-5)).all()
    exact_copy = x.double() @ copy
    assert ((logits.double() - exact_copy).abs() <= steps.double()[:, None] * screen.extra.double()[None, :]).all()
    unit = x.abs().amax(dim=1, keepdim=True).double() / 32767
    rounded = torch.round(x.double() / unit) * unit
    assert ((rounded - x.double()).abs().amax(dim=1) <= steps.double()).all() and (steps > 0).all()
    reference = (x.double() @ weight.double().T).argmax(dim=1)
    assert torch.equal(screen.logits(x).argmax(dim=1), reference)
    assert screen.rows_screened == 8 and screen.rows_to_full_head == 0


def test_a_row_the_screen_cannot_settle_takes_the_full_head(kernels):
    weight = near_tie_head(seed=9)
    head, screen = screened_head(kernels, weight)
    x = torch.zeros(2, HIDDEN)  # every logit 0 within a bound of 0: every token a candidate, past the cap
    x[1] = hidden_rows(1, weight, seed=10)[0]
    logits = screen.logits(x)
    assert screen.rows_to_full_head == 1 and screen.rows_screened == 1
    assert torch.equal(logits[0], head(x[:1])[0].float())
    assert logits[1].argmax() == (x[1].double() @ weight.double().T).argmax()


def test_the_screen_refuses_a_head_it_cannot_read(kernels):
    weight = near_tie_head()
    linear = Linear(HIDDEN, VOCAB, bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight.float())
    with pytest.raises(ValueError, match="bf16 head packed for the CPU kernels"):
        HeadScreen(PackedLinear(linear, "bf16"), kernels)  # no kernels yet: no packed copy to read exactly
    head, _ = screened_head(kernels, weight)
    with pytest.raises(ValueError, match="bf16 rows"):
        HeadScreen(head, kernels, table=weight.float())


def test_greedy_requests_decode_the_same_tokens_through_the_screen(bf16_valued_model_dir):
    """Greedy requests alone (every step screened), then beside ones the screen must leave to the full head
    (logprobs, a pending min_tokens ban, a logit bias, sampling; their steps read the full head): every output equals
    the engine's without the screen."""
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    others = [
        SamplingParams(max_tokens=24, temperature=0.0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.0, min_tokens=8),
        SamplingParams(max_tokens=24, temperature=0.0, logit_bias={11: 5.0}, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True),
    ]
    prompts = [f"Write about lighthouse number {i}." for i in range(6)]
    results = {}
    for screen in (True, False):
        llm = LLM(
            model={"path": bf16_valued_model_dir, "quantization": "bf16", "max_model_len": 256},
            cache={"num_blocks": 64},
            # fixed paths: a calibration measured on a busy machine may choose others for the second engine
            execution={"head_screen": screen, "fused_max_tokens": 16, "large_gemm": "bf16"},
        )
        alone = llm.generate(prompts[:3], greedy)
        model_screen = llm.engine.runner.model.head_screen
        if screen and llm.engine.executor.kernels is None:
            pytest.skip("infer's CPU kernels do not run here: no screen")
        screened = model_screen.rows_screened if screen else 0
        mixed = llm.generate(prompts, [greedy, greedy, *others])
        results[screen] = [(out.outputs[0].token_ids, out.outputs[0].logprobs) for out in alone + mixed]
        if screen:
            assert screened >= 3 * 24 and model_screen.rows_to_full_head == 0
        else:
            assert model_screen is None
    assert results[True] == results[False]


def test_only_rows_read_for_their_first_maximum_are_screened():
    from infer.execution.runner import ModelRunner
    from infer.outputs import BatchRows
    from infer.sequence import Sequence

    def row(start: int, count: int, params: SamplingParams, generated: int = 10) -> BatchRows:
        seq = Sequence("r", [1, 2, 3], params)
        return BatchRows(seq, start, count, seq.num_prompt_tokens + generated)

    rows = [
        row(0, 2, SamplingParams(temperature=0.0)),
        row(2, 1, SamplingParams(temperature=0.0, logprobs=0)),
        row(3, 1, SamplingParams(temperature=0.0, logit_bias={5: 1.0})),
        row(4, 1, SamplingParams(temperature=0.7)),
        row(5, 1, SamplingParams(temperature=0.0, max_tokens=32, min_tokens=20)),
        row(6, 1, SamplingParams(temperature=0.0, min_tokens=10)),
        row(7, 1, SamplingParams(temperature=0.0)),
    ]
    rows[-1].seq.matcher = object()  # a grammar masks the row
    assert ModelRunner.argmax_rows(rows) == [0, 1, 6]


def test_a_draft_model_guesses_through_its_own_screened_head(bf16_valued_model_dir):
    """A draft model identical to the target, both bf16 on the kernels: its guesses (its head's screened argmax)
    are the target's, and the output is the target's alone."""
    prompts = [f"Tell me about bridge number {i}." for i in range(3)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    common = {"model": {"path": bf16_valued_model_dir, "quantization": "bf16", "max_model_len": 256}}
    common["execution"] = {"fused_max_tokens": 16, "large_gemm": "bf16"}  # the same paths in both engines
    alone = LLM(**common, cache={"num_blocks": 64})
    expected = [out.outputs[0].token_ids for out in alone.generate(prompts, params)]
    if alone.engine.runner.model.head_screen is None:
        pytest.skip("no head screen here: infer's CPU kernels do not run")
    drafting = LLM(**common, cache={"num_blocks": 64}, drafter={"name": "model", "path": bf16_valued_model_dir})
    outputs = [out.outputs[0].token_ids for out in drafting.generate(prompts, params)]
    stats = drafting.engine.stats
    assert outputs == expected
    # Nearly every draft accepted (each verify pass also commits a token of its own): verification's steps of more
    # rows than the GEMV's round x to bf16 for the tiles, and a near tie of the random tiny model may split.
    assert stats.num_accepted_tokens - stats.num_verify_passes >= 0.9 * stats.num_draft_tokens > 0
    draft_screen = drafting.engine.drafter.draft.head_screen
    assert draft_screen is not None and draft_screen.rows_screened >= stats.num_draft_tokens


def test_a_head_with_a_nan_or_an_infinity_is_refused(kernels):
    for bad in (float("nan"), float("inf")):
        weight = near_tie_head()
        weight[77, 5] = bad
        linear = Linear(HIDDEN, VOCAB, bias=False)
        with torch.no_grad():
            linear.weight.copy_(weight.float())
        head = PackedLinear(linear, "bf16")
        head.use_cpu_kernels(kernels, gemv_rows=8)
        with pytest.raises(ValueError, match="finite head weights"):
            HeadScreen(head, kernels)
