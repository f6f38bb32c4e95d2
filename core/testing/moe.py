"""The model plugin suite for mixture-of-experts families: ``ModelConformance`` with the packed-weights check made
fair to a router. Rounding the weights to 16 bits moves router scores by a fraction of a percent, which swaps a
token's expert wherever two scores are that close (2 of 290 routings in the tiny Qwen3-MoE at bf16); a swapped
expert changes that token's output by the whole difference of two experts, not by rounding. So the packed model is
compared with HF under the float32 model's expert choices (replayed), and the share of choices that rounding
swapped on its own is bounded separately."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from infer.testing.model import ModelConformance


def record_routing(model) -> list[torch.Tensor]:
    """A list that collects the experts each mixture of ``model`` picks, ``[T, top_k]`` per call, in call order."""
    from infer.model.moe import MoE

    calls: list[torch.Tensor] = []
    for layer in model.layers:
        if isinstance(layer.mlp, MoE):
            layer.mlp.register_forward_pre_hook(lambda module, args: calls.append(module.route(args[0]).experts))
    return calls


def replay_routing(model, calls: list[torch.Tensor]) -> None:
    """Make ``model``'s mixtures pick the experts of ``calls`` (``record_routing``'s, from the same steps in the same
    order), weighting them by ``model``'s own router."""
    from infer.model.moe import MoE, Routing

    replayed = iter(calls)
    for layer in model.layers:
        if isinstance(layer.mlp, MoE):

            def route(x, moe=layer.mlp):
                experts = next(replayed)
                return Routing(experts, moe.weigh(moe.router(x), experts))

            layer.mlp.route = route


def swapped_share(calls: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """The share of tokens whose set of experts differs between two recordings of the same steps."""
    swapped = total = 0
    for ours, theirs in zip(calls, reference, strict=True):
        swapped += (ours.sort(dim=1).values != theirs.sort(dim=1).values).any(dim=1).sum().item()
        total += ours.shape[0]
    return swapped / max(total, 1)


class MoeConformance(ModelConformance):
    """``ModelConformance`` for a family with ``infer.model.moe.MoE`` layers. ``max_swapped_share``: the largest
    share of token routings that 16-bit weights may change."""

    max_swapped_share: ClassVar[float] = 0.05

    def test_packed_weights_on_the_kernels_stay_close_to_hf(self, model_dir, hf_model):
        """fp16 and bf16 weights through infer's CPU kernels: logits within the rounding of 16-bit weights under the
        float32 model's expert choices, and few choices changed by the rounding."""
        from infer.kernels import cpu as cpu_kernels
        from infer.model.quantization import quantize_model

        if cpu_kernels.load("auto") is None:
            pytest.skip("infer's CPU kernels do not build here")
        reference = self.load(model_dir)
        choices = record_routing(reference)
        self.logit_errors(reference, hf_model, "cpu", kernels=True)
        for mode in ("fp16", "bf16"):
            model = quantize_model(self.load(model_dir), mode)
            own_choices = record_routing(model)
            self.logit_errors(model, hf_model, "cpu", kernels=True)
            share = swapped_share(own_choices, choices)
            assert share <= self.max_swapped_share, f"{mode}: {share:.1%} of the routings changed"
            model = quantize_model(self.load(model_dir), mode)
            replay_routing(model, choices)
            error = self.logit_errors(model, hf_model, "cpu", kernels=True)
            assert error < self.packed_tolerance, f"{mode}: logits differ from HF by {error}"
