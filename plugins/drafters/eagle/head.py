"""The EAGLE draft head: one decoder layer that predicts the target's next final hidden state.

At position t it reads the pair (target feature f_t, token x_{t+1}), where f_t is the target's final hidden state
(after its last norm) at t, the one whose logits chose x_{t+1}:

    g_{t+1} = norm(layer(fc(concat(norm_e(embed(x_{t+1})), norm_f(f_t)))))  ~  f_{t+1}

so the target's head applied to g_{t+1} guesses x_{t+2}. The two inputs are RMS-normalized first (as in EAGLE-3):
SmolLM2's token embeddings are about 16 times smaller than its final features, and without the norms the token,
the most telling input, would start out drowned. The embedding and the head are the target's (no copies);
the head may be cut to a draft vocabulary (the most frequent tokens, ``vocab_ids``), because on a CPU the full
49k-row head dominates a draft step. The layer has the target's layer shapes and runs through the same attention
backend, over its own one-layer KV pool.

File format (safetensors): ``embed_norm.weight``, ``feature_norm.weight``, ``fc.*``, ``layer.*`` (the fused layout of
``infer.model.DecoderLayer``), ``norm.weight`` and ``vocab_ids`` (int64 target ids of the draft vocabulary), with
metadata ``format``, ``target`` (the model it was trained for) and ``hidden_size``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from infer.attention import FULL_ATTENTION
from infer.model import DecoderLayer, ModelArchitecture, RMSNorm

FORMAT = "infer-eagle-head-2"


class EagleHead(nn.Module):
    """``fc`` over the normalized ``[embed(x_{t+1}), f_t]``, one decoder layer, a final norm; outputs the predicted
    feature."""

    def __init__(
        self, config, vocab_ids: torch.Tensor, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ):
        super().__init__()
        hidden = config.hidden_size
        with torch.device(device):
            self.embed_norm = RMSNorm(hidden, config.rms_norm_eps, dtype)
            self.feature_norm = RMSNorm(hidden, config.rms_norm_eps, dtype)
            self.fc = nn.Linear(2 * hidden, hidden, bias=True, dtype=dtype)
            self.layer = DecoderLayer(head_layer_spec(config), 0, dtype)
            self.norm = RMSNorm(hidden, config.rms_norm_eps, dtype)
        self.register_buffer("vocab_ids", vocab_ids.to(device=device, dtype=torch.int64))

    def combine(self, embeds: torch.Tensor, features: torch.Tensor, ops=None) -> torch.Tensor:
        """The layer's input ``[T, hidden]`` from token embeddings and the features they follow; the norms on
        ``ops`` (a step's ``StepOps``: the CPU kernels' where it has them) or in torch (training)."""
        features = features.to(embeds.dtype)
        if ops is None:
            normed = (self.embed_norm(embeds), self.feature_norm(features))
        else:
            normed = (ops.norm(self.embed_norm, embeds)[0], ops.norm(self.feature_norm, features)[0])
        return self.fc(torch.cat(normed, dim=-1))

    def forward(self, embeds, features, step) -> torch.Tensor:
        """Paged inference: predicted features ``[T, hidden]``, writing the layer's K/V into ``step.kv_cache`` (the
        head's own one-layer pool); ``step`` from the target's executor (``infer.execution.paths.ForwardStep``)."""
        hidden, residual = step.run_layers([self.layer], self.combine(embeds, features, step.ops))
        return step.ops.norm(self.norm, hidden, residual)[0]


def head_layer_spec(config):
    """The head's decoder layer for a target of HF config ``config``: a Llama layer of the target's shapes (full
    attention, SwiGLU, the target's first RoPE table, which the head's steps rotate by)."""
    spec = ModelArchitecture.decoder_spec(config)
    return spec.replace(
        num_layers=1,
        layer_attention=(FULL_ATTENTION,),
        layer_rotary=(0,),
        rotary=spec.rotary[:1],
        activation="silu",
        head_norms=False,
        output_norms=False,
    )


def draft_head_weight(target, vocab_ids: torch.Tensor) -> torch.Tensor:
    """Rows of the target's output head for the draft vocabulary, ``[len(vocab_ids), hidden]``, in the target's
    ``activation_dtype``."""
    weight = target.head_weight().detach()
    return weight.index_select(0, vocab_ids.to(weight.device)).to(target.activation_dtype)


def save_head(head: EagleHead, path: str | Path, target_name: str, summary: dict | None = None) -> None:
    """Write the head as safetensors in bfloat16 (ids as int64), with what it was trained for in the metadata."""
    from safetensors.torch import save_file

    tensors = {
        name: tensor.detach().to("cpu", torch.bfloat16).contiguous()
        for name, tensor in head.state_dict().items()
        if name != "vocab_ids"
    }
    tensors["vocab_ids"] = head.vocab_ids.detach().cpu().contiguous()
    metadata = {
        "format": FORMAT,
        "target": target_name,
        "hidden_size": str(head.fc.out_features),
        "summary": json.dumps(summary or {}),
    }
    save_file(tensors, str(path), metadata=metadata)


def load_head(path: str | Path, config, dtype: torch.dtype, device: torch.device) -> EagleHead:
    """Read a head written by ``save_head`` for a target with HF config ``config``."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    if metadata.get("format") != FORMAT:
        raise ValueError(f"{path} is not an infer EAGLE head (format {metadata.get('format')!r}, expected {FORMAT})")
    if int(metadata.get("hidden_size", -1)) != config.hidden_size:
        raise ValueError(
            f"{path} was trained for hidden size {metadata.get('hidden_size')} (target "
            f"{metadata.get('target')!r}), but this target's is {config.hidden_size}"
        )
    tensors = load_file(str(path))
    head = EagleHead(config, tensors["vocab_ids"], dtype, device)
    head.load_state_dict(tensors)
    return head.eval()


def random_head(config, target, dtype: torch.dtype, device: torch.device, seed: int = 0) -> EagleHead:
    """An untrained head over the full vocabulary (tests: output must not depend on the drafter's quality)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = EagleHead(config, torch.arange(target.vocab_size), torch.float32, "cpu")
        initialize(head, target)
    return head.to(device=device, dtype=dtype).eval()


@torch.no_grad()
def initialize(head: EagleHead, target) -> None:
    """Starting weights for training: ``fc`` passes the normalized feature through and adds the normalized token
    embedding through a random projection of the same scale; the layer starts as the identity (its output
    projections are zero, so each branch adds nothing until trained); the final norm copies the target's."""
    hidden = head.fc.out_features
    for norm in (head.embed_norm, head.feature_norm, head.layer.input_layernorm, head.layer.post_attention_layernorm):
        norm.weight.fill_(1.0)
    head.fc.weight[:, :hidden].normal_(0.0, hidden**-0.5)
    head.fc.weight[:, hidden:].copy_(torch.eye(hidden))
    head.fc.bias.zero_()
    attention, mlp = head.layer.self_attn, head.layer.mlp
    for projection in (attention.qkv_proj, mlp.gate_up_proj):
        projection.weight.normal_(0.0, hidden**-0.5)
    for projection in (attention.o_proj, mlp.down_proj):
        projection.weight.zero_()
    for module in (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj):
        if module.bias is not None:
            module.bias.zero_()
    head.norm.weight.copy_(target.norm.weight)
