"""Tool calling in ``/v1/chat/completions``: which parser reads a model's calls, the constraint that forces a call,
and how one request's output is read.

``tool_choice`` ``auto`` (the default with tools) lets the model write what it likes and the server's parser
(``server.tool_parser``) finds the calls in it. ``required`` and a named function constrain the output through the
guide to one JSON object ``{"name": ..., "arguments": {...}}`` whose name is a tool's (the named one) and whose
arguments match that tool's ``parameters`` schema: the model's own call format (``<tool_call>`` tags...) is not
part of the grammar, so the same constraint serves every model and the server reads the object as the call.
``none`` renders the tools but reads no calls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from infer.guide import Constraint
from infer.tool_parser import ParsedMessage, ToolParser, call_from_object


def select_tool_parser(registry, name: str, chat_template: str | None) -> ToolParser | None:
    """The parser ``server.tool_parser`` names; with ``auto``, the first registered parser (highest
    ``auto_priority``) whose ``detects`` accepts the chat template; with ``none``, or no match, no parser (``auto``
    tool choices then return plain content)."""
    if name == "none":
        return None
    if name != "auto":
        return registry.load("tool_parser", name)()
    if not chat_template:
        return None
    parsers = sorted(
        (registry.load("tool_parser", parser_name) for parser_name in registry.names("tool_parser")),
        key=lambda parser: -parser.auto_priority,
    )
    return next((parser() for parser in parsers if parser.detects(chat_template)), None)


def forced_call_schema(tools: list[dict], name: str | None) -> dict:
    """The JSON schema of one call of ``name`` (None: of any of ``tools``), arguments per the tool's parameters."""

    def call_of(function: dict) -> dict:
        return {
            "type": "object",
            "properties": {
                "name": {"const": function["name"]},
                "arguments": function.get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }

    calls = [call_of(tool["function"]) for tool in tools if name is None or tool["function"]["name"] == name]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def forced_call_constraint(tools: list[dict], name: str | None) -> Constraint:
    return Constraint(json_schema=forced_call_schema(tools, name))


@dataclass(frozen=True, slots=True)
class ToolReading:
    """How one chat request's output is read: by ``parser`` (tool_choice auto), as one forced JSON call
    (``forced``), or as content only (neither). ``parallel``: more than one call may be returned."""

    parser: ToolParser | None = None
    forced: bool = False
    parallel: bool = True

    @property
    def active(self) -> bool:
        return self.forced or self.parser is not None

    def parse(self, text: str) -> ParsedMessage:
        if self.forced:
            try:
                call = call_from_object(json.loads(text))
            except json.JSONDecodeError:  # cut off by max_tokens: the grammar never finished the object
                call = None
            return ParsedMessage(None, [call]) if call is not None else ParsedMessage(text)
        if self.parser is None:
            return ParsedMessage(text)
        parsed = self.parser.parse(text)
        if not self.parallel and len(parsed.tool_calls) > 1:
            return ParsedMessage(parsed.content, parsed.tool_calls[:1])
        return parsed

    def content_end(self, text: str) -> int:
        """Characters of a growing output that are surely content (a stream sends them at once)."""
        if self.forced:
            return 0
        return len(text) if self.parser is None else self.parser.content_end(text)
