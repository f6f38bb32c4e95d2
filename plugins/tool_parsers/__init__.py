"""infer's built-in tool-call parsers, registered as lazy ``"module:Class"`` targets: Hermes/Qwen's
``<tool_call>{json}</tool_call>`` and Llama 3's bare JSON object."""

from __future__ import annotations

from infer import hookimpl

INFER_PLUGIN_API = 2


@hookimpl
def register_tool_parsers(register):
    register(
        "hermes",
        "infer.plugins.tool_parsers.hermes:HermesToolParser",
        description='<tool_call>{"name": ..., "arguments": {...}}</tool_call> (Hermes, Qwen 2.5 and 3)',
    )
    register(
        "llama3_json",
        "infer.plugins.tool_parsers.llama3_json:Llama3JsonToolParser",
        description='a bare JSON object {"name": ..., "parameters": {...}} (Llama 3.1-3.3)',
    )
