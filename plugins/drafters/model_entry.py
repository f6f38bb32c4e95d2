"""Registers drafter ``model`` (a draft model or the target's first layers; see ``model``). Imports nothing heavy:
the drafter module (torch) loads when a config selects it."""

from __future__ import annotations

from infer import hookimpl


@hookimpl
def register_drafters(register):
    register("model", "infer.plugins.drafters.model:ModelDrafter",
             description="A small draft model with its own paged KV, or the target's first layers (self-speculative)")
