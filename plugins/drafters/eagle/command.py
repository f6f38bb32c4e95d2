"""``infer train-eagle``'s command line (``infer.plugins.drafters.eagle.training`` does the work). Imports click
alone, so that registering the command costs nothing until it runs."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import click

from infer.plugins.drafters.eagle.options import TrainEagleOptions, options_from

# The defaults the flags' help shows (a slots dataclass's class attributes are its slot descriptors, not the values).
DEFAULTS = TrainEagleOptions()


@click.command("train-eagle")
@click.argument("config")
@click.argument("overrides", nargs=-1)
@click.option(
    "--out",
    "out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Folder for head.safetensors and its README card.",
)
@click.option(
    "--prompts",
    "prompts_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="JSONL prompt set (as for infer run); default: the built-in set.",
)
@click.option("--num-prompts", type=int, help=f"Prompts to answer (default {DEFAULTS.num_prompts}).")
@click.option(
    "--self-prompts",
    type=int,
    help="Requests the target writes itself and then answers, on top of "
    f"--num-prompts (default {DEFAULTS.self_prompts}).",
)
@click.option("--max-tokens", type=int, help=f"Answer length (default {DEFAULTS.max_tokens}).")
@click.option(
    "--generation-batch", type=int, help=f"Sequences generated at once (default {DEFAULTS.generation_batch})."
)
@click.option("--draft-vocab-size", type=int, help=f"Draft vocabulary (default {DEFAULTS.draft_vocab_size}).")
@click.option("--unroll-steps", type=int, help=f"Unrolled steps (default {DEFAULTS.unroll_steps}).")
@click.option("--epochs", type=int, help=f"Passes over the data (default {DEFAULTS.epochs}).")
@click.option("--max-minutes", type=float, help=f"Training time limit (default {DEFAULTS.max_minutes}).")
@click.option(
    "--patience",
    type=int,
    help=f"Stop after this many held-out evaluations without a gain (default {DEFAULTS.patience}).",
)
@click.option("--learning-rate", type=float, help=f"Peak learning rate (default {DEFAULTS.learning_rate}).")
@click.option("--seed", type=int, help="Seed for prompt order, split and training (default 0).")
@click.option(
    "--data",
    "data_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Generated answers and features: read from this file when it exists, else saved to it.",
)
def train_eagle_command(
    config: str, overrides: tuple[str, ...], out: Path, prompts_path: Path | None, data_path: Path | None, **values
) -> None:
    """Train an EAGLE draft head for CONFIG's model on its own answers, and write it to --out."""
    from infer.plugins.drafters.eagle.training import train_eagle

    options = options_from(values)
    report = train_eagle(config, list(overrides), out, prompts_path, options, data_path)
    click.echo(f"\nwrote {out / 'head.safetensors'}", err=True)
    click.echo(json.dumps(asdict(report), indent=2), err=True)
    sys.stdout.flush()
