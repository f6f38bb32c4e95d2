"""The tool-parser contract: how a model writes a function call in its text, and how the server reads it back.

Chat requests with ``tools`` render them through the model's chat template; what the model writes is plain text, in
a format its template taught it (Hermes/Qwen's ``<tool_call>{json}</tool_call>``, Llama 3's bare JSON object...).
A ``ToolParser`` turns that text into the content and the calls of an OpenAI message (``parse``), tells a stream
how much of a growing text is surely content (``content_end``). The server picks one per model: ``server.tool_parser:
auto`` asks each registered parser whether a chat template uses its format (``detects``). With ``tool_choice``
``required`` or a named function no parser is involved: the guide constrains the output to one JSON object
``{"name": ..., "arguments": {...}}`` matching the tools' schemas, which the server reads as the call.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call: the function's name and its arguments as JSON text (OpenAI's ``function.arguments``)."""

    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ParsedMessage:
    """A model's text read as an assistant message: ``content`` (None when the text was calls only) and calls."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


def call_from_object(value: Any, arguments_key: str = "arguments") -> ToolCall | None:
    """A ``ToolCall`` from a decoded JSON object ``{"name": str, arguments_key: object}``; None for anything else."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, {})
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


class ToolParser(ABC):
    """Reads one tool-call format. Stateless: one instance serves every request."""

    # Higher is asked first by ``server.tool_parser: auto``; a parser that matches any template takes the lowest.
    auto_priority: ClassVar[int] = 0

    @classmethod
    @abstractmethod
    def detects(cls, chat_template: str) -> bool:
        """Whether ``chat_template`` (the Jinja source of the model's template) teaches this parser's format."""

    @abstractmethod
    def parse(self, text: str) -> ParsedMessage:
        """The whole output read as content and calls. Text that looks like a call but does not decode stays
        content: a malformed call is the model's answer, not an error."""

    @abstractmethod
    def content_end(self, text: str) -> int:
        """How many leading characters of a growing output are surely content (no call can start in them): a stream
        sends those at once and holds back the rest until more text, or the end, decides."""


def held_back(text: str, marker: str) -> int:
    """``len(text)`` less the longest tail of ``text`` that is a proper prefix of ``marker`` (it may grow into it)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return len(text) - length
    return len(text)
