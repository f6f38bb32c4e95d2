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


class TestQwen3MoeOneExpertTakesEveryToken(MoeConformance):
    """Every token's first choice is expert ``FAVOURITE``: one expert gets the whole batch, the others a few tokens
    each."""

    impl_name = "qwen3_moe"
    hf_model_class = "Qwen3MoeForCausalLM"
    config_fields = {**QWEN3_MOE, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True}
    FAVOURITE = 3

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
    """The CPU kernels, counting the calls of ``moe_experts``."""

    def __init__(self, kernels):
        self.kernels, self.moe_calls = kernels, 0

    def __getattr__(self, name):
        return getattr(self.kernels, name)

    def moe_experts(self, *args):
        self.moe_calls += 1
        return self.kernels.moe_experts(*args)


# gpt-oss's experts: biases, the clamped SwiGLU (a limit the tests' activations pass), top-k then softmax
GPT_OSS_EXPERTS = {"router": "topk_softmax", "bias": True, "activation": "clamped_swiglu", "swiglu_limit": 1.0}


def packed_moe(mode: str, num_experts: int = 8, top_k: int = 2, hidden: int = 64, width: int = 32, **kind):
    """A random ``MoE`` packed as ``mode``, and a float32 one whose weights are the packed weights' values; ``kind``:
    ``ExpertsSpec`` fields beyond the shapes (``GPT_OSS_EXPERTS``)."""
    from types import SimpleNamespace

    from infer.model.moe import MoE
    from infer.model.quantization import quantize_linears
    from infer.model.spec import ExpertsSpec

    experts = ExpertsSpec(num_experts, top_k, width, frozenset({0}), True, **kind)
    spec = SimpleNamespace(hidden_size=hidden, experts=experts)
    torch.manual_seed(0)
    reference = MoE(spec, torch.float32)
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.normal_(0.0, 0.2)
    moe = MoE(spec, torch.float32)
    moe.load_state_dict(reference.state_dict())
    quantize_linears(moe, mode)
    with torch.no_grad():
        for ours, theirs in zip(moe.experts, reference.experts, strict=True):
            for name in ("gate_up_proj", "down_proj"):
                packed = getattr(ours, name)
                weight = (
                    packed.bf16_weight() if mode == "bf16" else torch.ops.quantized.linear_unpack_fp16(packed.packed)[0]
                )  # int8: its scaled weights, exactly
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
def test_the_experts_on_the_kernels_equal_float32_experts_with_the_same_weights(kernels, mode, kind):
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
def test_the_expert_kernel_on_each_simd_build_matches_this_cpus(kernels, build, tmp_path):
    """The kernel's AVX2 code and its portable C against the build this CPU runs (where it has the flags), every
    weight storage, experts taking 1 to 11 tokens (several GEMV passes)."""
    from infer.host import cpu_flags
    from infer.kernels import cpu as cpu_kernels
    from infer.model.moe import ExpertGroups, Routing

    if build == "avx2" and not {"avx2", "fma", "f16c"} <= cpu_flags():
        pytest.skip("this CPU lacks AVX2, FMA or F16C")
    flags = ["-mno-avx512f"] if build == "avx2" else ["-mno-avx"]
    if "amx_tile" in cpu_flags():
        flags.append("-mno-amx-tile")
    other = cpu_kernels.load_built(cpu_kernels.build(tmp_path, flags))
    x = torch.randn(12, 64, generator=torch.Generator().manual_seed(1))
    experts = torch.tensor([[0, 6]] * 11 + [[2, 6]])  # expert 0: 11 tokens, 2: one, 6: all twelve
    groups = ExpertGroups.of(Routing(experts, torch.rand(12, 2)), 8)
    for mode in ("fp16", "bf16", "int8"):
        moe, _ = packed_moe(mode)
        moe.use_cpu_kernels(kernels, gemv_rows=8)
        outs = [torch.zeros(12, 64), torch.zeros(12, 64)]
        for built, out in zip((kernels, other), outs, strict=True):
            built.moe_experts(x, moe.packed, *groups.pick([0, 1, 2]), out)
        torch.testing.assert_close(*outs, atol=2e-5, rtol=2e-5)
