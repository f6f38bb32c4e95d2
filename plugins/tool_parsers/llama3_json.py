"""Llama 3.1-3.3's JSON tool calls: the whole output is one call ``{"name": ..., "parameters": {...}}`` (or several
separated by ``;``), optionally after ``<|python_tag|>``; any other output is content."""

from __future__ import annotations

import json

from infer.tool_parser import ParsedMessage, ToolParser, call_from_object

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    # Llama 3's templates name no marker of their own: asked after the parsers that look for one.
    auto_priority = 0

    @classmethod
    def detects(cls, chat_template: str) -> bool:
        return "tools" in chat_template and '"parameters"' in chat_template

    def parse(self, text: str) -> ParsedMessage:
        body = text.strip().removeprefix(PYTHON_TAG).strip()
        calls = []
        decoder = json.JSONDecoder()
        position = 0
        while position < len(body):
            try:
                value, end = decoder.raw_decode(body, position)
            except json.JSONDecodeError:
                return ParsedMessage(text)
            call = (
                call_from_object(value, "parameters" if "parameters" in value else "arguments")
                if isinstance(value, dict)
                else None
            )
            if call is None:
                return ParsedMessage(text)
            calls.append(call)
            position = end
            while position < len(body) and body[position] in " \t\r\n;":
                position += 1
        return ParsedMessage(None, calls) if calls else ParsedMessage(text)

    def content_end(self, text: str) -> int:
        # A call is the whole output: text that begins (after blanks) with "{" or the python tag waits for the end.
        stripped = text.lstrip()
        if not stripped or stripped[0] == "{" or PYTHON_TAG.startswith(stripped[: len(PYTHON_TAG)]):
            return 0
        return len(text)
