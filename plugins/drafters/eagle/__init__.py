"""The ``eagle`` drafter plugin: the drafter (``drafter``), its head (``head``), the trained heads it ships
(``heads/``, package data) and ``infer train-eagle`` (``command``, ``training``), registered here as any third-party
plugin registers its own. Imports nothing heavy: each module loads when a config selects the drafter or the command
runs."""

from __future__ import annotations

from infer import hookimpl


@hookimpl
def register_drafters(register):
    register(
        "eagle",
        "infer.plugins.drafters.eagle.drafter:EagleDrafter",
        description="EAGLE: a one-layer head drafting from the target's features",
    )


@hookimpl
def register_commands(cli):
    from infer.plugins.drafters.eagle.command import train_eagle_command

    cli.add_command(train_eagle_command)
