"""infer's built-in drafters: registered here, each as a lazy ``"module:Class"`` target, so that listing them
(``infer plugins``, ``infer --help``) imports none of their modules; a module loads when a config selects it. EAGLE
is its own package (``eagle``), with its own hooks."""

from __future__ import annotations

from infer import hookimpl

INFER_PLUGIN_API = 2


@hookimpl
def register_drafters(register):
    register("none", "infer.plugins.drafters.none:NoDrafter", description="No speculative decoding")
    register(
        "ngram",
        "infer.plugins.drafters.ngram:NgramDrafter",
        description="Prompt lookup: propose what followed the last n-gram earlier on",
    )
    register(
        "model",
        "infer.plugins.drafters.model:ModelDrafter",
        description="A small draft model with its own paged KV, or the target's first layers (self-speculative)",
    )
