"""The options of an EAGLE head's training run (``infer train-eagle``'s flags; the head's card records them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TrainEagleOptions:
    """Everything that shapes a training run (the card records it)."""

    num_prompts: int = 960
    self_prompts: int = 2000
    max_tokens: int = 192
    generation_batch: int = 128
    draft_vocab_size: int = 8192
    unroll_steps: int = 3
    eval_drafts: int = 4
    epochs: int = 3
    max_minutes: float = 12.0
    tokens_per_batch: int = 1024
    learning_rate: float = 1e-3
    feature_noise: float = 0.05
    ce_weight: float = 1.0
    held_out_fraction: float = 0.05
    eval_every: int = 25
    patience: int = 4
    seed: int = 0


def options_from(values: dict) -> TrainEagleOptions:
    return TrainEagleOptions(**{name: value for name, value in values.items() if value is not None})
