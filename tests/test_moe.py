"""Mixture-of-experts families through the model plugin suite against HF transformers: Qwen3-MoE with 8 experts
(top-2) and 16 experts (top-4), dense and sparse layers mixed, and a model whose router sends every token to one
expert."""

from __future__ import annotations

import pytest
import torch

from infer.testing import MoeConformance
from infer.testing.model import save_tiny_model

QWEN3_MOE = {
    "head_dim": 16,
    "moe_intermediate_size": 32,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
}


class TestQwen3Moe8Experts(MoeConformance):
    impl_name = "qwen3_moe"
    hf_model_class = "Qwen3MoeForCausalLM"
    # layer 1 dense (mlp_only_layers), layers 0 and 2 sparse
    config_fields = {
        **QWEN3_MOE,
        "num_hidden_layers": 3,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "mlp_only_layers": [1],
    }


class TestQwen3Moe16Experts(MoeConformance):
    impl_name = "qwen3_moe"
    hf_model_class = "Qwen3MoeForCausalLM"
    # decoder_sparse_step 2: layer 1 sparse, layer 0 dense; weights not renormalized over the top 4
    config_fields = {
        **QWEN3_MOE,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "norm_topk_prob": False,
        "decoder_sparse_step": 2,
    }

    @pytest.mark.slow  # the family's drafting: TestQwen3Moe8Experts in the default run
    def test_greedy_with_drafted_tokens_matches_hf(self, model_dir, hf_model):
        super().test_greedy_with_drafted_tokens_matches_hf(model_dir, hf_model)


class TestQwen3MoeOneExpertTakesEveryToken(MoeConformance):
    """Every token's first choice is expert ``FAVOURITE``: one expert gets the whole batch, the others a few tokens
    each."""

    impl_name = "qwen3_moe"
    hf_model_class = "Qwen3MoeForCausalLM"
    config_fields = {**QWEN3_MOE, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True}
    FAVOURITE = 3

    @pytest.mark.slow  # the family's drafting: TestQwen3Moe8Experts in the default run
    def test_greedy_with_drafted_tokens_matches_hf(self, model_dir, hf_model):
        super().test_greedy_with_drafted_tokens_matches_hf(model_dir, hf_model)

    @pytest.fixture(scope="class")
    @classmethod
    def model_dir(cls, tmp_path_factory):
        """The tiny model with a large positive first feature in every embedding and routers whose
        ``FAVOURITE`` row reads only that feature: its score beats every other expert's for every token."""
        from safetensors.torch import load_file, save_file

        model_dir = save_tiny_model(cls.hf_model_class, cls.tiny_config(), tmp_path_factory.mktemp("favourite"))
        path = model_dir / "model.safetensors"
        tensors = load_file(path)
        tensors["model.embed_tokens.weight"][:, 0] = 8.0
        for name, weight in tensors.items():
            if name.endswith("mlp.gate.weight"):
                weight[:, 0] = 0.0
                weight[cls.FAVOURITE] = 0.0
                weight[cls.FAVOURITE, 0] = 10.0
            if name.endswith("post_attention_layernorm.weight"):
                weight[0] = weight[0].abs()
        save_file(tensors, path, metadata={"format": "pt"})
        return model_dir

    def test_the_favourite_expert_takes_every_token(self, model_dir):
        from infer.model.moe import MoE
        from infer.testing.model import PagedRunner, random_prompt

        model = self.load(model_dir)
        chosen = []
        for layer in model.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.register_forward_pre_hook(lambda module, args: chosen.append(module.route(args[0]).experts))
        PagedRunner(model).step({"a": random_prompt(40, seed=1), "b": random_prompt(7, seed=2)})
        assert chosen and all((experts == self.FAVOURITE).any(dim=1).all() for experts in chosen)
        others = torch.cat(chosen)[:, 1:].unique()
        assert len(others) > 1  # the second choice still spreads over the rest


def test_transformers_stacked_experts_load_as_the_checkpoint_does():
    import transformers

    from infer.plugins.models.qwen3_moe import Qwen3MoeArchitecture

    config = TestQwen3Moe8Experts.tiny_config()
    torch.manual_seed(0)
    hf_model = transformers.Qwen3MoeForCausalLM(config)
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in hf_model.state_dict())
    model = Qwen3MoeArchitecture.from_hf(hf_model)
    expert = model.layers[0].mlp.experts[5]
    stacked = hf_model.model.layers[0].mlp.experts
    assert torch.equal(expert.gate_up_proj.weight, stacked.gate_up_proj[5])
    assert torch.equal(expert.down_proj.weight, stacked.down_proj[5])


# -- the experts on infer's CPU kernels --------------------------------------------------------------------------------


class CountingKernels:
    """The CPU kernels, counting the calls of ``moe_experts`` and keeping the tokens each call's experts took."""

    def __init__(self, kernels):
        self.kernels, self.moe_calls, self.call_tokens = kernels, 0, []

    def __getattr__(self, name):
        return getattr(self.kernels, name)

    def moe_experts(self, *args):
        self.moe_calls += 1
        starts = args[3]
        self.call_tokens.append(sorted((starts[1:] - starts[:-1]).tolist()))
        return self.kernels.moe_experts(*args)


# gpt-oss's experts: biases, the clamped SwiGLU (a limit the tests' activations pass), top-k then softmax
GPT_OSS_EXPERTS = {"router": "topk_softmax", "bias": True, "activation": "clamped_swiglu", "swiglu_limit": 1.0}


def packed_moe(mode: str, num_experts: int = 8, top_k: int = 2, hidden: int = 64, width: int = 32, **kind):
    """A random ``MoE`` packed as ``mode`` (a block mode: kept as GGUF's blocks; ``GATE_UP/DOWN`` of K-quant kinds:
    its experts quantized to those blocks as a ``Q4_K_M`` file stores them, 256 x 256), and a float32 one whose
    weights are the packed weights' values; ``kind``: ``ExpertsSpec`` fields beyond the shapes
    (``GPT_OSS_EXPERTS``)."""
    from types import SimpleNamespace

    from infer.kernels.cpu.blocks import dequantize_blocks
    from infer.model.moe import MoE
    from infer.model.quantization import BLOCK_MODES, quantize_linears
    from infer.model.spec import ExpertsSpec

    kinds = mode.split("/") if "/" in mode else [mode, mode] if mode == "mxfp4" else None
    if "/" in mode:
        hidden = width = 256  # a K-quant super-block of 256 columns, in and out
    experts = ExpertsSpec(num_experts, top_k, width, frozenset({0}), True, **kind)
    spec = SimpleNamespace(hidden_size=hidden, experts=experts)
    torch.manual_seed(0)
    reference = MoE(spec, torch.float32)
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.normal_(0.0, 0.2)
    moe = MoE(spec, torch.float32)
    moe.load_state_dict(reference.state_dict())
    if kinds:
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize

        from infer.kernels.cpu.blocks import pack_blocks, quantize_blocks
        from infer.testing.kquants import QUANTIZERS

        blocks = {}
        for index, expert in enumerate(reference.experts):
            for name, block_kind in zip(("gate_up_proj", "down_proj"), kinds, strict=True):
                weight = getattr(expert, name).weight.detach()
                if block_kind in QUANTIZERS:  # K-quants: infer.testing's quantizer
                    raw = QUANTIZERS[block_kind](weight.numpy())
                elif block_kind == "mxfp4":  # a checkpoint's kind: gguf's quantizer
                    raw = quantize(weight.numpy(), GGMLQuantizationType.MXFP4)
                else:
                    raw = None
                blocks[f"experts.{index}.{name}"] = (
                    quantize_blocks(weight, block_kind) if raw is None else pack_blocks(raw, block_kind, len(weight))
                )
        quantize_linears(moe, "q8_0", blocks=blocks)  # every expert projection given; the router is not a Linear
        mode = kinds[0]
    else:
        quantize_linears(moe, mode)
    with torch.no_grad():
        for ours, theirs in zip(moe.experts, reference.experts, strict=True):
            for name in ("gate_up_proj", "down_proj"):
                packed = getattr(ours, name)
                if mode in BLOCK_MODES:
                    weight = dequantize_blocks(packed.blocks)
                elif mode == "bf16":
                    weight = packed.bf16_weight()
                else:  # int8: its scaled weights, exactly
                    weight = torch.ops.quantized.linear_unpack_fp16(packed.packed)[0]
                getattr(theirs, name).weight.copy_(weight.float())
    return moe, reference


def kernel_step(kernels):
    from types import SimpleNamespace

    from infer.model.ops import StepOps

    return SimpleNamespace(ops=StepOps(None, None, kernels))


@pytest.fixture(scope="module")
def kernels():
    from infer.kernels import cpu as cpu_kernels

    loaded = cpu_kernels.load("auto")
    if loaded is None:
        pytest.skip("infer's CPU kernels do not build here")
    return loaded


@pytest.mark.parametrize("kind", [{}, GPT_OSS_EXPERTS], ids=["swiglu", "gpt_oss"])
@pytest.mark.parametrize("mode", ["fp16", "bf16", "int8"])
def test_the_experts_on_the_kernels_equal_float32_experts_with_the_same_weights(kernels, mode, kind, monkeypatch):
    from infer.kernels.cpu import abi

    # bf16 experts on the tiles: float32 FMAs for every expert (AMX's bf16 rows are held to their own reference below)
    monkeypatch.setattr(abi, "MOE_TILE_ROWS", 1 << 30)
    moe, reference = packed_moe(mode, **kind)
    moe.use_cpu_kernels(kernels, gemv_rows=8)
    counting = CountingKernels(kernels)
    for rows in (1, 6, 40):
        x = torch.randn(rows, 64)
        got, want = moe(x, kernel_step(counting)), reference(x)
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (rows, (got - want).abs().max())
    assert counting.moe_calls == 3


def test_one_expert_taking_every_token_on_the_kernel_equals_expert_by_expert(kernels):
    from infer.model.moe import ExpertGroups, Routing

    moe, reference = packed_moe("fp16")
    moe.use_cpu_kernels(kernels, gemv_rows=8)
    rows = 40
    x = torch.randn(rows, 64)
    second = torch.tensor([5 if token % 8 else 1 for token in range(rows)])
    experts = torch.stack([torch.full((rows,), 3), second], dim=1)
    routing = Routing(experts, torch.rand(rows, 2))
    groups = ExpertGroups.of(routing, moe.num_experts)
    assert [groups.count(index) for index in range(len(groups.active))] == [5, 40, 35]
    got = torch.zeros(rows, 64)
    kernels.moe_experts(x, moe.packed, *groups.pick(list(range(3))), got)
    want = torch.zeros(rows, 64)
    for token in range(rows):
        for slot in range(2):
            expert = reference.experts[int(experts[token, slot])]
            want[token] += routing.weights[token, slot] * expert(x[token : token + 1])[0]
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (got - want).abs().max()


def test_experts_with_more_tokens_than_the_kernel_takes_run_expert_by_expert(kernels, monkeypatch):
    from infer.model import moe as moe_module

    monkeypatch.setattr(moe_module, "KERNEL_MAX_TOKENS", 4)
    moe, reference = packed_moe("fp16", num_experts=4, top_k=2)
    moe.use_cpu_kernels(kernels, gemv_rows=8)
    counting = CountingKernels(kernels)
    x = torch.randn(24, 64)  # 48 pairs over 4 experts: most take more than 4 tokens
    got = moe(x, kernel_step(counting))
    assert torch.allclose(got, reference(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("build", ["avx2", "portable"])
def test_the_expert_kernel_on_each_simd_build_matches_this_cpus(kernels, build, simd_build):
    """The kernel's AVX2 code and its portable C against the build this CPU runs (where it has the flags), every
    weight storage (bf16 on the tiles where this CPU's kernels have them, and in ``pack_weights``' layout as the
    other build packs it), experts taking 1 to 17 tokens (several GEMV passes; past the K-quant GEMV's 16 rows, the
    block GEMM's int8 design)."""
    from infer.model.moe import ExpertGroups, Routing

    other = simd_build(build)
    experts = torch.tensor([[0, 6]] * 11 + [[2, 6]] + [[4, 6]] * 5)  # expert 0: 11 tokens, 2: one, 4: five, 6: all
    groups = ExpertGroups.of(Routing(experts, torch.rand(17, 2)), 8)
    for mode, packer in (("fp16", kernels), ("bf16", kernels), ("bf16", other), ("int8", kernels)) + tuple(
        (blocks, kernels) for blocks in EXPERT_BLOCKS
    ):
        moe, _ = packed_moe(mode)
        moe.use_cpu_kernels(packer, gemv_rows=8)
        hidden = moe.experts[0].gate_up_proj.in_features
        x = torch.randn(17, hidden, generator=torch.Generator().manual_seed(1))
        outs = [torch.zeros(17, hidden), torch.zeros(17, hidden)]
        for built, out in zip((kernels, other), outs, strict=True):
            built.moe_experts(x, moe.packed, *groups.pick([0, 1, 2, 3]), out, 1 << 30)  # the tiles: FMAs, as elsewhere
        # blocks: sums in another order may round an activation to the next int8 step (about 0.2% of a result)
        atol = 2e-2 * float(outs[0].abs().max()) if mode in EXPERT_BLOCKS else 2e-5
        torch.testing.assert_close(*outs, atol=atol, rtol=2e-5)


def expert_activation(spec, gate_up: torch.Tensor) -> torch.Tensor:
    """An expert's activation of its gate and up sums ``gate_up`` (gate's first), as ``spec`` names it."""
    gate, up = gate_up.chunk(2)
    if spec.activation == "clamped_swiglu":
        gate, up = gate.clamp(max=spec.swiglu_limit), up.clamp(-spec.swiglu_limit, spec.swiglu_limit)
        return (up + 1) * gate * torch.sigmoid(spec.swiglu_alpha * gate)
    return torch.nn.functional.silu(gate) * up


def expert_reference(reference, x, routing, rounded: set[int] = frozenset()):
    """The layer in float64 over ``reference``'s weights (the packed ones' values) for a given routing; experts in
    ``rounded`` take their rows and their activations rounded to bf16, as AMX's tiles multiply them."""
    spec = reference.spec

    def bf16(t):
        return t.float().to(torch.bfloat16).double()

    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for token in range(x.shape[0]):
        for slot in range(routing.experts.shape[1]):
            index = int(routing.experts[token, slot])
            expert = reference.experts[index]
            row = bf16(x[token]) if index in rounded else x[token].double()
            gate_up = expert.gate_up_proj.weight.double() @ row
            if expert.gate_up_proj.bias is not None:
                gate_up += expert.gate_up_proj.bias.double()
            activated = expert_activation(spec, gate_up)
            if index in rounded:
                activated = bf16(activated)
            down = expert.down_proj.weight.double() @ activated
            if expert.down_proj.bias is not None:
                down += expert.down_proj.bias.double()
            out[token] += float(routing.weights[token, slot]) * down
    return out


def routings(num_experts: int):
    """Routings that exercise the tile kernel's cases: an odd number of tokens over six of the experts (the last two
    take none), one expert taking every token, and one token."""
    from infer.model.moe import Routing

    generator = torch.Generator().manual_seed(3)
    spread = torch.stack(
        [torch.randint(0, 3, (37,), generator=generator), torch.randint(3, 6, (37,), generator=generator)], 1
    )
    favourite = torch.stack([torch.full((33,), 5), torch.randint(0, 5, (33,), generator=generator)], 1)
    single = torch.tensor([[7, 2]])
    assert int(spread.max()) < num_experts - 2
    return [Routing(experts, torch.rand(experts.shape, generator=generator)) for experts in (spread, favourite, single)]


@pytest.mark.parametrize("tile_rows", [1, 8, 1 << 30], ids=["amx", "both", "fma"])
@pytest.mark.parametrize("kind", [{}, GPT_OSS_EXPERTS], ids=["swiglu", "gpt_oss"])
def test_experts_on_the_tiles_equal_the_float64_reference(kernels, kind, tile_rows):
    """bf16 experts in pack_tiles' layout, one C call: experts of at least ``tile_rows`` tokens on AMX's tiles equal
    the float64 layer over bf16-rounded rows and activations; the others (float32 FMAs) the float64 layer itself."""
    from infer.model.moe import ExpertGroups

    if kernels.tiles is None:
        pytest.skip("this CPU's kernels have no tiles (AMX or AVX512-BF16): bf16 experts stay in pack_weights' layout")
    if tile_rows < 1 << 30 and not kernels.amx:
        pytest.skip("AMX's tiles are not available here (the CPU, the build or the OS): experts run on FMAs")
    moe, reference = packed_moe("bf16", **kind)
    moe.use_cpu_kernels(kernels, gemv_rows=8)
    assert moe.packed.tiles
    for routing in routings(moe.num_experts):
        x = torch.randn(routing.experts.shape[0], 64)
        groups = ExpertGroups.of(routing, moe.num_experts)
        rounded = {groups.active[index] for index in range(len(groups.active)) if groups.count(index) >= tile_rows}
        got = torch.zeros(x.shape)
        kernels.moe_experts(x, moe.packed, *groups.pick(list(range(len(groups.active)))), got, tile_rows)
        want = expert_reference(reference, x, routing, rounded)
        torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)
        if rounded:  # and bf16's rounding keeps AMX's layer near the exact one
            exact = expert_reference(reference, x, routing)
            assert (got.double() - exact).abs().max() <= 0.03 * exact.abs().max()


def test_bf16_experts_on_the_tiles_keep_one_copy_and_run_in_one_call(kernels):
    """With tiles, every expert (more tokens than KERNEL_MAX_TOKENS too) runs in the one C call over the tiles' copy,
    the only copy each projection keeps; without the kernels, oneDNN's copy comes back from the tiles."""
    from infer.model import moe as moe_module

    if kernels.tiles is None:
        pytest.skip("this CPU's kernels have no tiles (AMX or AVX512-BF16): bf16 experts stay in pack_weights' layout")
    moe, reference = packed_moe("bf16", num_experts=4, top_k=2)
    plain_bytes = sum(projection.nbytes for expert in moe.experts for projection in expert.children())
    moe.use_cpu_kernels(kernels, gemv_rows=8)
    projections = [projection for expert in moe.experts for projection in (expert.gate_up_proj, expert.down_proj)]
    assert all(p.tile_weight is not None and p.kernel_weight is None and p.packed is None for p in projections)
    assert sum(projection.nbytes for projection in projections) == plain_bytes
    counting = CountingKernels(kernels)
    x = torch.randn(moe_module.KERNEL_MAX_TOKENS + 11, 64)  # 150 pairs over 4 experts: some take more than 64
    got = moe(x, kernel_step(counting))
    assert counting.moe_calls == 1
    assert (got - reference(x)).abs().max() <= 0.03 * reference(x).abs().max()
    moe.use_cpu_kernels(None)
    assert all(p.packed is not None and p.tile_weight is None for p in projections)
    assert (moe(x) - reference(x)).abs().max() <= 0.03 * reference(x).abs().max()


@torch.no_grad()
def block_expert_reference(reference, x, routing):
    """The layer in float64 over ``reference``'s weights (the blocks' values) as the block kernels compute it: each
    row of x, and each activation row, quantized per 32 columns to int8 (``quantized_activations``)."""
    from test_block_kernels import quantized_activations

    spec = reference.spec
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for token in range(x.shape[0]):
        row = quantized_activations(x[token : token + 1])[0]
        for slot in range(routing.experts.shape[1]):
            expert = reference.experts[int(routing.experts[token, slot])]
            gate_up = expert.gate_up_proj.weight.double() @ row
            if expert.gate_up_proj.bias is not None:
                gate_up += expert.gate_up_proj.bias.double()
            activated = expert_activation(spec, gate_up)
            down = expert.down_proj.weight.double() @ quantized_activations(activated.float()[None])[0]
            if expert.down_proj.bias is not None:
                down += expert.down_proj.bias.double()
            out[token] += float(routing.weights[token, slot]) * down
    return out


# Block kinds of the experts' gate_up and down: GGUF's blocks of 32 (one kind for both), a Q4_K_M file's K-quants
# (gate/up Q4_K, down Q4_K or Q6_K), and kinds of both families in one expert.
EXPERT_BLOCKS = ["q4_0", "q4_1", "q8_0", "mxfp4", "q4_k/q4_k", "q4_k/q6_k", "q6_k/q4_k", "q4_0/q6_k", "q6_k/q8_0"]


@pytest.mark.parametrize("kind", [{}, GPT_OSS_EXPERTS], ids=["swiglu", "gpt_oss"])
@pytest.mark.parametrize("mode", EXPERT_BLOCKS)
def test_experts_kept_as_blocks_equal_the_float64_layer_over_int8_activations(kernels, mode, kind):
    """Experts kept as GGUF's blocks, one C call over the blocks as they are: the float64 layer over the blocks'
    values with x and the activations quantized per 32 columns as the block GEMV's. An activation whose float32 sums
    round it to the next int8 step moves a result by about 0.2% of the largest: the bound allows a few."""
    from infer.model.moe import ExpertGroups

    moe, reference = packed_moe(mode, **kind)
    moe.use_cpu_kernels(kernels, gemv_rows=8)
    assert moe.packed.blocks == tuple(mode.split("/") * (1 if "/" in mode else 2))
    assert all(p.blocks is not None and p.packed is None for e in moe.experts for p in (e.gate_up_proj, e.down_proj))
    hidden = moe.experts[0].gate_up_proj.in_features
    for routing in routings(moe.num_experts):
        x = torch.randn(routing.experts.shape[0], hidden)
        x[0, :32] = 0.0  # a block of zeros: scale 0
        groups = ExpertGroups.of(routing, moe.num_experts)
        got = torch.zeros(x.shape)
        kernels.moe_experts(x, moe.packed, *groups.pick(list(range(len(groups.active)))), got)
        want = block_expert_reference(reference, x, routing)
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-2 * float(want.abs().max()))
        # and most results to float32's rounding: only the few rounded to another step differ
        close = torch.isclose(got.double(), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
        assert float(close.double().mean()) > 0.9


@pytest.mark.parametrize("mode", ["q4_1", "mxfp4"])
def test_experts_kept_as_blocks_take_one_call_or_their_projections_past_a_gemv_pass(kernels, mode):
    """Experts of more tokens than one pass of the block GEMV (``block_pass_rows``) take the one C call too (its
    block GEMM), except where the block GEMM runs on AMX and reads the kind: there they go through their own
    projections. Either way, the layer those projections give alone."""
    moe, reference = packed_moe(mode, num_experts=4, top_k=2)
    moe.use_cpu_kernels(kernels, gemv_rows=8)
    counting = CountingKernels(kernels)
    rows = torch.randn(8, 64, generator=torch.Generator().manual_seed(5))
    chosen = [set(experts.tolist()) for experts in moe.route(rows).experts]
    first, second = next((a, b) for a in range(8) for b in range(8) if not chosen[a] & chosen[b])
    # one pass's tokens to two experts, a pass and three more to the other two
    few, many = kernels.block_pass_rows, kernels.block_pass_rows + 3
    x = torch.cat((rows[first].expand(few, 64), rows[second].expand(many, 64))).contiguous()
    sizes = torch.bincount(moe.route(x).experts.flatten(), minlength=4)
    assert sorted(sizes.tolist()) == [few, few, many, many]
    got = moe(x, kernel_step(counting))
    projections = kernels.block_gemm == "amx-bf16" and mode != "mxfp4"
    assert counting.call_tokens == [[few, few] if projections else [few, few, many, many]]
    alone = moe(x)  # no kernel step: every expert through its projections
    # int8 rows in the call, bf16 ones on the block GEMM (where it runs on AMX): about 1% of the largest result apart
    torch.testing.assert_close(got, alone, rtol=0, atol=3e-2 * float(alone.abs().max()))
    assert (got - reference(x)).abs().max() <= 0.05 * reference(x).abs().max()
