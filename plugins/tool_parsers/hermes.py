"""Hermes' tool-call format, which Qwen 2.5 and Qwen 3 use: each call is a JSON object between ``<tool_call>`` and
``</tool_call>``; text outside the tags is the message's content."""

from __future__ import annotations

import json
import re

from infer.tool_parser import ParsedMessage, ToolParser, call_from_object, held_back

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


class HermesToolParser(ToolParser):
    auto_priority = 10

    @classmethod
    def detects(cls, chat_template: str) -> bool:
        return OPEN in chat_template

    def parse(self, text: str) -> ParsedMessage:
        calls, pieces, last = [], [], 0
        for match in CALL.finditer(text):
            try:
                call = call_from_object(json.loads(match.group(1)))
            except json.JSONDecodeError:
                call = None
            if call is None:
                continue
            calls.append(call)
            pieces.append(text[last : match.start()])
            last = match.end()
        if not calls:
            return ParsedMessage(text)
        content = ("".join(pieces) + text[last:]).strip()
        return ParsedMessage(content or None, calls)

    def content_end(self, text: str) -> int:
        start = text.find(OPEN)
        return start if start >= 0 else held_back(text, OPEN)
