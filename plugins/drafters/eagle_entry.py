"""Registers drafter ``eagle`` (a one-layer head over the target's features; see ``eagle``). Imports nothing heavy:
the drafter module (torch) loads when a config selects it."""

from __future__ import annotations

from infer import hookimpl


@hookimpl
def register_drafters(register):
    register("eagle", "infer.plugins.drafters.eagle:EagleDrafter",
             description="EAGLE: a one-layer head drafting from the target's features")
