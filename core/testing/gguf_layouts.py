"""How llama.cpp's converter writes the tensors of an architecture where it lays them out otherwise than the HF
checkpoint: for the GGUF files that tests and benchmarks write from HF folders. Needs no pytest."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch


def gpt_oss_tensors(name: str, read: Callable[[str], torch.Tensor]) -> list[tuple[str, np.ndarray, str]] | None:
    """The tensors llama.cpp's ``GptOssModel`` writes for OpenAI's gpt-oss tensor ``name`` (``read`` gives a tensor of
    the checkpoint by name), each as (an HF-style name the gguf package's tensor map takes, values, GGUF type): an
    expert projection's MXFP4 blocks repacked into GGUF's (``MXFP4``: ``[experts, rows, bytes]``), gate's rows and
    up's split out of their interleaving into two tensors, their biases likewise (``F32``), the sinks named as a
    weight. ``[]`` for a scales tensor (written with its blocks); None for a tensor written as any architecture's."""
    from infer.kernels.cpu.blocks import mxfp4_gguf_blocks

    prefix, _, kind = name.rpartition("mlp.experts.")
    if kind.endswith("_scales"):
        return []
    if kind.endswith("_blocks"):
        blocks, scales = read(name), read(name.removesuffix("_blocks") + "_scales")
        parts = {"down_proj": (blocks, scales)}
        if kind.startswith("gate_up_proj"):  # gate's rows interleaved with up's
            parts = {"gate_proj": (blocks[:, 0::2], scales[:, 0::2]), "up_proj": (blocks[:, 1::2], scales[:, 1::2])}
        written = []
        for projection, (part, part_scales) in parts.items():
            raw = mxfp4_gguf_blocks(part, part_scales)  # [experts, rows, groups, 17]
            written.append(
                (f"{prefix}mlp.experts.{projection}.weight", raw.reshape(*raw.shape[:2], -1).numpy(), "MXFP4")
            )
        return written
    if kind in ("gate_up_proj_bias", "down_proj_bias"):
        values = read(name).float().numpy()
        parts = {"down_proj": values}
        if kind == "gate_up_proj_bias":
            parts = {"gate_proj": values[:, 0::2], "up_proj": values[:, 1::2]}
        return [
            (f"{prefix}mlp.experts.{projection}.bias", np.ascontiguousarray(part), "F32")
            for projection, part in parts.items()
        ]
    if name.endswith("sinks"):
        return [(f"{name}.weight", np.ascontiguousarray(read(name).float().numpy()), "F32")]
    return None
