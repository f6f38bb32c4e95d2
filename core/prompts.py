"""Prompt sources for ``infer run`` (the built-in set and JSONL files), and ``ChatPrompt``: chat messages with the
tools a chat template renders for them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from infer.sampling_params import SamplingParams, SamplingParamsError

BUILTIN_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one paragraph.",
    "List three uses of Python.",
    "How do vaccines work?",
    "Give me a short recipe for pancakes.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
]


@dataclass(slots=True)
class PromptItem:
    prompt: object  # a string, token ids, or chat messages
    params: SamplingParams
    display: str
    id: object = None  # the line's own "id", echoed in the output line (None: numbered by position)


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """Chat messages (``{"role", "content"}``, an assistant's ``tool_calls``, ``tool`` results) and the tools the
    model may call, as OpenAI's ``tools`` entries; both go through the model's chat template (``tools=``)."""

    messages: list[dict]
    tools: list[dict] | None = None


class PromptFileError(ValueError):
    pass


def builtin_items(max_tokens: int = 64) -> list[PromptItem]:
    return [
        PromptItem([{"role": "user", "content": text}], SamplingParams(max_tokens=max_tokens, temperature=0.0), text)
        for text in BUILTIN_PROMPTS
    ]


def read_jsonl(path: str | Path) -> list[PromptItem]:
    """Lines are ``{"prompt": ...}`` or ``{"messages": [...]}`` plus an optional ``"id"`` (echoed in the output) and
    sampling fields; any other key is refused, naming the line and the closest field."""
    items = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            items.append(_parse_line(json.loads(line)))
        except (json.JSONDecodeError, SamplingParamsError, TypeError, ValueError) as error:
            raise PromptFileError(f"{path}:{number}: {error}") from error
    return items


def _parse_line(data: dict) -> PromptItem:
    if not isinstance(data, dict):
        raise ValueError("each line must be a JSON object")
    fields = dict(data)
    item_id = fields.pop("id", None)
    if "messages" in fields:
        prompt = fields.pop("messages")
        display = str(prompt[-1].get("content", "")) if prompt else ""
    elif "prompt" in fields:
        prompt = fields.pop("prompt")
        display = prompt if isinstance(prompt, str) else f"<{len(prompt)} token ids>"
    else:
        raise ValueError('a line needs "prompt" or "messages"')
    fields.setdefault("temperature", 0.0)
    return PromptItem(prompt, SamplingParams.from_dict(fields), display, item_id)
