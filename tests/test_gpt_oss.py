"""gpt-oss through the mixture-of-experts model suite against HF transformers (8 experts top-2 and 16 experts top-4,
sliding and full layers alternating with a window of 8, attention sinks, YaRN, biases perturbed away from
transformers' zeros, a clamp limit the activations reach), planted bugs the suite must catch, and MXFP4 expert
weights dequantized as transformers does."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from infer.testing import MoeConformance
from infer.testing.model import save_tiny_model

GPT_OSS = {
    "num_hidden_layers": 4,
    "head_dim": 16,
    "intermediate_size": 32,
    "sliding_window": 8,
    # gpt-oss's YaRN settings over a short original context (the ramp not truncated)
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 150_000.0,
        "factor": 8.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 64,
    },
}


def save_gpt_oss(suite_class, destination: Path) -> Path:
    """The suite's tiny model with its biases drawn at random (transformers starts the experts' at zero, which would
    hide a bias in the wrong place) and sink logits large enough to take a visible share of each row."""
    from safetensors.torch import load_file, save_file

    model_dir = save_tiny_model(suite_class.hf_model_class, suite_class.tiny_config(), destination)
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    generator = torch.Generator().manual_seed(5)
    for name, tensor in tensors.items():
        if name.endswith("bias"):
            tensor.normal_(0.0, 0.5, generator=generator)
        elif name.endswith("sinks"):
            tensor.normal_(1.0, 1.0, generator=generator)
    save_file(tensors, path, metadata={"format": "pt"})
    return model_dir


class GptOssSuite(MoeConformance):
    impl_name = "gpt_oss"
    hf_model_class = "GptOssForCausalLM"
    # bf16's rounding through four layers with large biases and the clamps: 0.37 (torch's ops) to 0.54 (the kernels,
    # which also round large steps' activations to bf16) under the float32 model's expert choices; fp16's is 0.04
    packed_tolerance = 1.0

    @pytest.fixture(scope="class")
    @classmethod
    def model_dir(cls, tmp_path_factory):
        return save_gpt_oss(cls, tmp_path_factory.mktemp(cls.__name__))


class TestGptOss8Experts(GptOssSuite):
    # swiglu_limit 2: the clamps on gate and up change many activations of this tiny model
    config_fields = {**GPT_OSS, "num_local_experts": 8, "num_experts_per_tok": 2, "swiglu_limit": 2.0}


@pytest.mark.slow  # the router over more experts; the 8-expert model covers the rest in the default run
class TestGptOss16Experts(GptOssSuite):
    config_fields = {**GPT_OSS, "num_local_experts": 16, "num_experts_per_tok": 4}
    # bf16 weights swap 7.1% of this model's routings: with 4 of 16 chosen, the 4th and 5th scores are often closer
    # than bf16's rounding moves them
    max_swapped_share = 0.1


def test_the_tiny_model_reaches_the_clamps_and_the_sinks_take_a_share(tmp_path):
    """The suite's model exercises what gpt-oss adds: gate and up activations beyond the clamp limit, and sink logits
    far from zero."""
    import transformers

    model_dir = save_gpt_oss(TestGptOss8Experts, tmp_path)
    hf_model = transformers.GptOssForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gate_ups = []
    experts = hf_model.model.layers[0].mlp.experts
    hook = experts.register_forward_hook(lambda module, args, out: gate_ups.append(args[0]))
    with torch.no_grad():
        hf_model(torch.tensor([list(range(100, 140))]))
        gate_up = gate_ups[0] @ experts.gate_up_proj[0] + experts.gate_up_proj_bias[0]
    hook.remove()
    assert (gate_up.abs() > 2.0).float().mean() > 0.05
    assert hf_model.model.layers[0].self_attn.sinks.abs().max() > 1.0


# -- planted bugs: each must move the logits beyond the suite's tolerance ---------------------------------------------


def assert_planted_bug_fails(tmp_path, architecture, plant=None) -> None:
    """The suite's logit check passes the family as it is and fails ``architecture`` (after ``plant()``)."""
    import transformers

    model_dir = save_gpt_oss(TestGptOss8Experts, tmp_path)
    hf_model = transformers.GptOssForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    suite = TestGptOss8Experts()
    correct = suite.logit_errors(suite.load(model_dir), hf_model)
    if plant is not None:
        plant()
    planted = suite.logit_errors(suite.load(model_dir, architecture), hf_model)
    assert correct < suite.tolerance < planted, (correct, planted)


def test_gate_and_up_left_interleaved_fail_the_suite(tmp_path, monkeypatch):
    from infer.plugins.models import gpt_oss

    assert_planted_bug_fails(
        tmp_path, gpt_oss.GptOssArchitecture, plant=lambda: monkeypatch.setattr(gpt_oss, "gate_first", lambda t: t)
    )


def test_softmax_before_top_k_fails_the_suite(tmp_path):
    from infer.plugins.models.gpt_oss import GptOssArchitecture

    class SoftmaxFirst(GptOssArchitecture):
        @classmethod
        def decoder_spec(cls, hf_config, max_positions=None):
            spec = super().decoder_spec(hf_config, max_positions)
            return spec.replace(experts=dataclasses.replace(spec.experts, router="softmax_topk"))

    assert_planted_bug_fails(tmp_path, SoftmaxFirst)


def test_activations_without_the_clamps_fail_the_suite(tmp_path):
    from infer.plugins.models.gpt_oss import GptOssArchitecture

    class Unclamped(GptOssArchitecture):
        @classmethod
        def decoder_spec(cls, hf_config, max_positions=None):
            spec = super().decoder_spec(hf_config, max_positions)
            return spec.replace(experts=dataclasses.replace(spec.experts, swiglu_limit=math.inf))

    assert_planted_bug_fails(tmp_path, Unclamped)


def test_sinks_left_out_of_the_softmax_fail_the_suite(tmp_path):
    from infer.plugins.models.gpt_oss import GptOssArchitecture

    class NoSinks(GptOssArchitecture):
        @classmethod
        def convert_weight(cls, name, tensor):
            return torch.full_like(tensor, -1e30) if name.endswith("sinks") else tensor

    assert_planted_bug_fails(tmp_path, NoSinks)


def test_yarn_with_its_ramp_truncated_fails_the_suite(tmp_path):
    """gpt-oss's ``truncate: false``: rounding the ramp's ends to whole pairs (YaRN's default) moves the logits."""
    from infer.plugins.models.gpt_oss import GptOssArchitecture

    class Truncated(GptOssArchitecture):
        @classmethod
        def rotary_tables(cls, hf_config, head_dim, max_positions):
            config = copy.deepcopy(hf_config)
            config.rope_parameters["truncate"] = True
            return super().rotary_tables(config, head_dim, max_positions)

    assert_planted_bug_fails(tmp_path, Truncated)


# -- MXFP4 experts -----------------------------------------------------------------------------------------------------


def random_mxfp4(
    shape: tuple[int, ...], seed: int, exponents: tuple[int, int] = (-8, 2)
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 ``blocks`` ``[*shape[:-1], shape[-1] // 32, 16]`` and ``scales`` of random values (scales 2^-8..2^2, or
    the powers of two between ``exponents``)."""
    generator = torch.Generator().manual_seed(seed)
    groups = shape[-1] // 32
    blocks = torch.randint(0, 256, (*shape[:-1], groups, 16), generator=generator, dtype=torch.uint8)
    low, high = exponents
    scales = torch.randint(127 + low, 128 + high, (*shape[:-1], groups), generator=generator, dtype=torch.uint8)
    return blocks, scales


def test_mxfp4_dequantization_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from infer.plugins.models.gpt_oss import dequantize_mxfp4

    blocks, scales = random_mxfp4((4, 96, 64), seed=0)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [experts, in, out]
    ours = dequantize_mxfp4(blocks, scales, torch.float32)  # [experts, out, in]
    assert torch.equal(ours, theirs.transpose(1, 2))
    assert torch.equal(dequantize_mxfp4(blocks, scales).float(), ours)  # bfloat16 holds every MXFP4 value


def save_mxfp4_checkpoints(
    tmp_path: Path, exponents: tuple[int, int] = (-8, 2), suite_class: type | None = None
) -> tuple[Path, Path]:
    """The 8-expert suite's model (or ``suite_class``'s) with random MXFP4 experts in OpenAI's checkpoints' layout
    (``_blocks`` and ``_scales`` per projection, ``quantization_config`` mxfp4; scales between the powers of two
    ``exponents``), and the float checkpoint holding transformers' dequantization of those weights: their folders."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    suite_class = suite_class or TestGptOss8Experts
    float_dir = save_gpt_oss(suite_class, tmp_path / "float")
    mxfp4_dir = save_gpt_oss(suite_class, tmp_path / "mxfp4")
    config = suite_class.tiny_config()
    experts, hidden, width = config.num_local_experts, config.hidden_size, config.intermediate_size
    float_tensors = load_file(float_dir / "model.safetensors")
    mxfp4_tensors = load_file(mxfp4_dir / "model.safetensors")
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts."
        for seed, (projection, out_features, in_features) in enumerate(
            (("gate_up_proj", 2 * width, hidden), ("down_proj", hidden, width))
        ):
            blocks, scales = random_mxfp4((experts, out_features, in_features), 10 * layer + seed, exponents)
            float_tensors[prefix + projection] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            del mxfp4_tensors[prefix + projection]
            mxfp4_tensors[prefix + projection + "_blocks"] = blocks
            mxfp4_tensors[prefix + projection + "_scales"] = scales
    save_file(float_tensors, float_dir / "model.safetensors", metadata={"format": "pt"})
    save_file(mxfp4_tensors, mxfp4_dir / "model.safetensors", metadata={"format": "pt"})
    config_file = mxfp4_dir / "config.json"
    saved = json.loads(config_file.read_text())
    saved["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    config_file.write_text(json.dumps(saved))
    return float_dir, mxfp4_dir


def test_a_checkpoint_with_mxfp4_experts_loads_as_its_dequantized_weights(tmp_path):
    """An MXFP4 checkpoint read into a float model is the float checkpoint of transformers' dequantization."""
    from infer.model.loader import load_model

    float_dir, mxfp4_dir = save_mxfp4_checkpoints(tmp_path)
    dequantized = load_model(str(float_dir), torch.float32, architecture="gpt_oss").model.state_dict()
    loaded = load_model(str(mxfp4_dir), torch.float32, architecture="gpt_oss").model.state_dict()
    assert dequantized.keys() == loaded.keys()
    for name, tensor in dequantized.items():
        assert torch.equal(loaded[name], tensor), name


def test_mxfp4_experts_kept_as_blocks_are_the_checkpoints_and_stay_close_to_hf(tmp_path):
    """A load that keeps a checkpoint's blocks (the engine's under ``model.quantization: auto``) packs each MXFP4
    expert as the block kernels' ``mxfp4`` weight, never dequantized, whose values are transformers'; the experts run in
    the one C call, and the model's logits stay within the packed tolerance of HF's float model under the float32
    model's expert choices (int8 activations, as llama.cpp's MXFP4 dot products, and bf16 attention)."""
    import transformers

    from infer.kernels import cpu as cpu_kernels
    from infer.kernels.cpu.blocks import dequantize_blocks
    from infer.model.loader import load_model
    from infer.model.quantization import PackedLinear, quantize_model
    from infer.testing.moe import record_routing, replay_routing

    if cpu_kernels.load("auto") is None:
        pytest.skip("infer's CPU kernels do not build here")
    suite = TestGptOss8Experts()
    # weights of up to 6 / 8 (a trained model's are smaller still): larger ones make this tiny model's logits swing
    # by more than the tolerance under bf16 attention alone
    float_dir, mxfp4_dir = save_mxfp4_checkpoints(tmp_path, exponents=(-7, -3))
    reference = load_model(str(float_dir), torch.float32, max_positions=suite.max_model_len).model
    read = []
    model = load_model(
        str(mxfp4_dir),
        torch.float32,
        max_positions=suite.max_model_len,
        prepare_layer=read.append,
        keep_checkpoint_blocks=True,
    ).model
    assert len(read) == len(model.layers)
    for ours, theirs in zip(model.layers, reference.layers):
        for expert, float_expert in zip(ours.mlp.experts, theirs.mlp.experts):
            for name in ("gate_up_proj", "down_proj"):
                packed, linear = getattr(expert, name), getattr(float_expert, name)
                assert isinstance(packed, PackedLinear) and packed.blocks.kind == "mxfp4"
                assert torch.equal(dequantize_blocks(packed.blocks), linear.weight)
                assert torch.equal(packed.bias, linear.bias)
    model = quantize_model(model, "bf16")
    hf_model = transformers.GptOssForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()
    choices = record_routing(reference)
    suite.logit_errors(reference, hf_model, "cpu", kernels=True)
    replay_routing(model, choices)
    error = suite.logit_errors(model, hf_model, "cpu", kernels=True)
    assert error < suite.packed_tolerance, error
    assert all(layer.mlp.packed.blocks == ("mxfp4", "mxfp4") for layer in model.layers)


def test_the_engine_keeps_mxfp4_experts_under_auto_and_dequantizes_them_for_a_named_mode(tmp_path):
    from infer.model.quantization import PackedLinear

    _, mxfp4_dir = save_mxfp4_checkpoints(tmp_path, exponents=(-7, -3))
    suite = TestGptOss8Experts()
    prompts = [list(range(100, 120)), list(range(300, 305))]
    for quantization, kind in (("auto", "mxfp4"), ("fp16", None)):
        llm = suite.engine(
            mxfp4_dir, model__dtype="auto", model__quantization=quantization, execution__fused_max_tokens=8
        )
        experts = [
            projection
            for layer in llm.engine.model.layers
            for expert in layer.mlp.experts
            for projection in (expert.gate_up_proj, expert.down_proj)
        ]
        assert all(isinstance(projection, PackedLinear) for projection in experts)
        assert {getattr(projection.blocks, "kind", None) for projection in experts} == {kind}, quantization
        assert ("(MXFP4 experts)" in llm.engine.describe_execution()) == (kind == "mxfp4")
        tokens = suite.engine_greedy(llm, prompts)
        assert [len(output) for output in tokens] == [suite.max_tokens] * 2


def test_the_start_estimate_counts_mxfp4_experts_as_kept_or_dequantized(tmp_path, monkeypatch, caplog):
    """The headers' count of an MXFP4 checkpoint's expert weights (``checkpoint_matrices``) is the float checkpoint's
    stacked experts', and the start's estimate takes them at MXFP4's bytes where the load keeps them, else at the
    mode's: within the norms' and biases' share of what the loaded model holds."""
    from infer.execution import paths
    from infer.model.loader import checkpoint_matrices, load_model
    from infer.model.quantization import model_weight_bytes, quantize_model

    float_dir, mxfp4_dir = save_mxfp4_checkpoints(tmp_path)
    config = TestGptOss8Experts.tiny_config()
    experts = config.num_hidden_layers * config.num_local_experts * 3 * config.hidden_size * config.intermediate_size
    counts, float_counts = checkpoint_matrices(mxfp4_dir), checkpoint_matrices(float_dir)
    assert counts.mxfp4 == experts and float_counts.mxfp4 == 0
    assert float_counts.matrices == counts.matrices + experts
    estimates, held = {}, {}
    monkeypatch.setattr("infer.host.available_memory", lambda: 1)
    for keeps in (True, False):
        estimates[keeps] = paths.estimated_weight_bytes(counts, "bf16", torch.float32, keeps)
        model = load_model(
            str(mxfp4_dir), torch.float32, prepare_layer=lambda layer: None, keep_checkpoint_blocks=keeps
        )
        held[keeps] = model_weight_bytes(quantize_model(model.model, "bf16"))
        caplog.clear()
        with caplog.at_level("WARNING", logger="infer.execution"):
            paths.warn_if_memory_is_short(str(mxfp4_dir), "bf16", torch.float32, keeps)
        (record,) = caplog.records
        assert ("bf16 weights with MXFP4 experts" in record.message) == keeps
    # the experts' share: bf16's 2 bytes a weight against MXFP4's 17 per 32 (the tables' float32 copies, which this
    # tiny float32 checkpoint's estimate leaves out, are the same either way)
    saved = held[False] - held[True]
    assert saved == pytest.approx(experts * (2 - 17 / 32), rel=0.02)
    assert estimates[False] - estimates[True] == pytest.approx(saved, rel=0.02)


def test_mxfp4_blocks_without_their_scales_are_refused_naming_them(tmp_path):
    from safetensors.torch import load_file, save_file

    from infer.model.loader import load_model

    model_dir = save_gpt_oss(TestGptOss8Experts, tmp_path)
    tensors = load_file(model_dir / "model.safetensors")
    name = "model.layers.0.mlp.experts.down_proj"
    config = TestGptOss8Experts.tiny_config()
    tensors[name + "_blocks"] = random_mxfp4((8, config.hidden_size, config.intermediate_size), seed=0)[0]
    del tensors[name]
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing \['model.layers.0.mlp.experts.0.down_proj.weight'.*_blocks"):
        load_model(str(model_dir), torch.float32, architecture="gpt_oss")
