"""infer's built-in structured-output guides: registered here, each as a lazy ``"module:Class"`` target, so that
listing them (``infer plugins``, ``infer --help``) imports none of their modules; a module loads when a config
selects it."""

from __future__ import annotations

from infer import hookimpl

INFER_PLUGIN_API = 2


@hookimpl
def register_guides(register):
    register(
        "none",
        "infer.plugins.guides.none:NoGuide",
        description="No constrained decoding (requests with a constraint are refused)",
    )
    register(
        "xgrammar",
        "infer.plugins.guides.xgrammar_guide:XGrammarGuide",
        description="Constrained decoding with xgrammar (EBNF grammars)",
    )
    register(
        "llguidance",
        "infer.plugins.guides.llguidance_guide:LLGuidanceGuide",
        description="Constrained decoding with llguidance (Lark grammars)",
    )
