"""How far int8 activations quantized per 32 columns (infer's block GEMVs) and per 256 (llama.cpp's Q8_K, which its
K-quant dot products take) put a projection's product from float64's.

The default model's real down-projection inputs (SiLU(gate) * up, 1536 wide: the only width of its projections that
256 divides) over one English prompt, every layer; exact weights, so the error is the activations' alone. Both
groupings cost the K-quant GEMV the same instructions (a vector of the 8 blocks' scales in place of one broadcast).

    python benchmarks/activation_groups.py
"""

from __future__ import annotations

import torch

from infer.model.loader import DEFAULT_MODEL, load_model

PROMPT = (
    "The history of the Roman Empire spans many centuries, from the founding of the city to the fall of "
    "Constantinople, and its roads, laws and languages shaped much of Europe long after."
)
GROUPS = (32, 256)


def quantized(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [rows, k] as int8 per ``group`` columns (scale amax / 127, rounded to nearest), dequantized in float64."""
    blocks = x.double().view(x.shape[0], -1, group)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return (torch.round(blocks / scale) * scale).view_as(x)


@torch.no_grad()
def main() -> None:
    loaded = load_model(DEFAULT_MODEL, torch.float32)
    model = loaded.model
    inputs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for layer in model.layers:
        down = layer.mlp.down_proj
        down.register_forward_pre_hook(lambda module, args: inputs.append((module.weight, args[0].flatten(0, -2))))
    ids = torch.tensor(loaded.tokenizer(PROMPT)["input_ids"])
    _forward(model, ids)
    errors = {group: [] for group in GROUPS}
    for weight, x in inputs:
        exact = x.double() @ weight.double().T
        for group in GROUPS:
            errors[group].append(float((quantized(x, group) @ weight.double().T - exact).norm() / exact.norm()))
    print(f"{len(ids)} tokens, {len(inputs)} layers: relative error of the down projection's product")
    for group, values in errors.items():
        print(f"per {group:3d} columns: mean {sum(values) / len(values):.2%}, worst layer {max(values):.2%}")


def _forward(model, ids: torch.Tensor) -> None:
    """One prefill of ``ids`` through a paged pool (the runner the model tests use)."""
    from infer.testing.model import PagedRunner

    PagedRunner(model).step({"prompt": ids.tolist()})


if __name__ == "__main__":
    main()
