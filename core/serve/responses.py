"""Engine updates turned into OpenAI bodies: the whole response, or stream chunks, for completions and chat.

A format object lives for one request. Non-streamed responses are built from the same deltas as stream chunks
(merged per sample by ``Collector``), so the two paths cannot drift apart.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace

from pydantic import BaseModel

from infer.serve.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaToolCall,
    PromptTokensDetails,
    ResponseFunctionCall,
    ResponseToolCall,
    UsageInfo,
)
from infer.serve.tools import ToolReading
from infer.serve.updates import RequestUpdate, SampleDelta, TokenLogprob, Usage


@dataclass(frozen=True, slots=True)
class ResponseMeta:
    """What every body of one response repeats."""

    id: str
    created: int
    model: str
    num_samples: int
    logprobs: bool
    # completions' best_of: the engine drew ``samples_per_prompt`` samples of each prompt and the response keeps the
    # ``choices_per_prompt`` with the highest cumulative logprob (equal: every sample is a choice).
    samples_per_prompt: int = 1
    choices_per_prompt: int = 1


def usage_info(usage: Usage) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
    )


class Collector:
    """Merges a non-streamed request's updates into one delta per sample."""

    def __init__(self, num_samples: int):
        self.samples = [SampleDelta(index, "", []) for index in range(num_samples)]
        self.last: RequestUpdate | None = None

    def add(self, update: RequestUpdate) -> None:
        for delta in update.samples:
            merged = self.samples[delta.index]
            merged.text += delta.text
            merged.logprobs.extend(delta.logprobs)
            merged.echo_text += delta.echo_text
            merged.echo_logprobs.extend(delta.echo_logprobs)
            merged.finish_reason = delta.finish_reason or merged.finish_reason
        self.last = update


class CompletionFormat:
    """``/v1/completions``: choices carry ``text``; logprobs in the tokens / token_logprobs / top_logprobs shape."""

    def __init__(self, meta: ResponseMeta):
        self.meta = meta
        self._text_offsets = [0] * meta.num_samples

    def opening_chunks(self) -> list[BaseModel]:
        return []

    def chunks(self, deltas: list[SampleDelta]) -> list[BaseModel]:
        return [
            CompletionResponse(
                id=self.meta.id,
                created=self.meta.created,
                model=self.meta.model,
                choices=[self._choice(delta) for delta in deltas],
            )
        ]

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return CompletionResponse(
            id=self.meta.id, created=self.meta.created, model=self.meta.model, choices=[], usage=usage_info(usage)
        )

    def response(self, samples: list[SampleDelta], usage: Usage) -> BaseModel:
        return CompletionResponse(
            id=self.meta.id,
            created=self.meta.created,
            model=self.meta.model,
            choices=[self._choice(sample) for sample in self._best(samples)],
            usage=usage_info(usage),
        )

    def _best(self, samples: list[SampleDelta]) -> list[SampleDelta]:
        """best_of: each prompt's ``choices_per_prompt`` samples of highest cumulative logprob (of the generated
        tokens), best first, renumbered in OpenAI's prompt-major order."""
        drawn, kept = self.meta.samples_per_prompt, self.meta.choices_per_prompt
        if drawn == kept:
            return samples
        best = []
        for first in range(0, len(samples), drawn):
            group = sorted(samples[first : first + drawn], key=lambda s: -sum(entry.logprob for entry in s.logprobs))
            best.extend(replace(sample, index=len(best) + rank) for rank, sample in enumerate(group[:kept]))
        return best

    def _choice(self, delta: SampleDelta) -> CompletionChoice:
        return CompletionChoice(
            index=delta.index,
            text=delta.echo_text + delta.text,
            logprobs=self._logprobs(delta),
            finish_reason=delta.finish_reason,
        )

    def _logprobs(self, delta: SampleDelta) -> CompletionLogprobs | None:
        if not self.meta.logprobs:
            return None
        logprobs = CompletionLogprobs()
        for entry in [*delta.echo_logprobs, *delta.logprobs]:
            logprobs.tokens.append(entry.token)
            logprobs.token_logprobs.append(entry.logprob)
            logprobs.top_logprobs.append(None if entry.top is None else dict(entry.top))
            logprobs.text_offset.append(self._text_offsets[delta.index])
            self._text_offsets[delta.index] += len(entry.token)
        return logprobs


class ChatFormat:
    """``/v1/chat/completions``: a message (or deltas after a first role-only chunk); logprobs as ``content``.

    With tools (``tools``: how the request's output is read), a stream sends the text that is surely content as it
    comes, holds back what may be a call, and at the end sends the rest of the content, then each call: one delta
    with its id and name, then its arguments in pieces (OpenAI's chunk shape; clients concatenate them)."""

    def __init__(self, meta: ResponseMeta, tools: ToolReading | None = None):
        self.meta = meta
        self.tools = tools or ToolReading()
        # Per sample, streamed with tools: its text so far and how much of it went out as content.
        self._texts = [""] * meta.num_samples
        self._content_sent = [0] * meta.num_samples

    def opening_chunks(self) -> list[BaseModel]:
        return [
            self._chunk([ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))])
            for index in range(self.meta.num_samples)
        ]

    def chunks(self, deltas: list[SampleDelta]) -> list[BaseModel]:
        if not self.tools.active:
            return [
                self._chunk(
                    [
                        ChatChunkChoice(
                            index=delta.index,
                            delta=ChatDelta(content=delta.text or None),
                            logprobs=self._logprobs(delta),
                            finish_reason=delta.finish_reason,
                        )
                        for delta in deltas
                    ]
                )
            ]
        return [chunk for delta in deltas for chunk in self._tool_chunks(delta)]

    def _tool_chunks(self, delta: SampleDelta) -> list[BaseModel]:
        index = delta.index
        self._texts[index] += delta.text
        text, sent = self._texts[index], self._content_sent[index]
        if delta.finish_reason is None:
            end = max(sent, self.tools.content_end(text))
            self._content_sent[index] = end
            return [self._content_chunk(delta, text[sent:end])] if end > sent or delta.logprobs else []
        parsed = self.tools.parse(text)
        content = parsed.content or ""
        rest = content[sent:] if content.startswith(text[:sent]) else ""
        chunks = [self._content_chunk(delta, rest)] if rest or delta.logprobs else []
        for number, call in enumerate(parsed.tool_calls):
            opening = DeltaToolCall(
                index=number, id=_call_id(), type="function", function=DeltaFunctionCall(name=call.name, arguments="")
            )
            chunks.append(self._chunk([ChatChunkChoice(index=index, delta=ChatDelta(tool_calls=[opening]))]))
            for piece in _pieces(call.arguments):
                argument = DeltaToolCall(index=number, function=DeltaFunctionCall(arguments=piece))
                chunks.append(self._chunk([ChatChunkChoice(index=index, delta=ChatDelta(tool_calls=[argument]))]))
        reason = "tool_calls" if parsed.tool_calls else delta.finish_reason
        chunks.append(self._chunk([ChatChunkChoice(index=index, delta=ChatDelta(), finish_reason=reason)]))
        return chunks

    def _content_chunk(self, delta: SampleDelta, content: str) -> BaseModel:
        return self._chunk(
            [
                ChatChunkChoice(
                    index=delta.index, delta=ChatDelta(content=content or None), logprobs=self._logprobs(delta)
                )
            ]
        )

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return ChatCompletionChunk(
            id=self.meta.id, created=self.meta.created, model=self.meta.model, choices=[], usage=usage_info(usage)
        )

    def response(self, samples: list[SampleDelta], usage: Usage) -> BaseModel:
        choices = [self._choice(sample) for sample in samples]
        return ChatCompletionResponse(
            id=self.meta.id, created=self.meta.created, model=self.meta.model, choices=choices, usage=usage_info(usage)
        )

    def _choice(self, sample: SampleDelta) -> ChatChoice:
        if not self.tools.active:
            return ChatChoice(
                index=sample.index,
                message=ChatResponseMessage(content=sample.text),
                logprobs=self._logprobs(sample),
                finish_reason=sample.finish_reason,
            )
        parsed = self.tools.parse(sample.text)
        calls = [
            ResponseToolCall(id=_call_id(), function=ResponseFunctionCall(name=call.name, arguments=call.arguments))
            for call in parsed.tool_calls
        ]
        message = ChatResponseMessage(content=parsed.content, tool_calls=calls or None)
        return ChatChoice(
            index=sample.index,
            message=message,
            logprobs=self._logprobs(sample),
            finish_reason="tool_calls" if calls else sample.finish_reason,
        )

    def _chunk(self, choices: list[ChatChunkChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.meta.id, created=self.meta.created, model=self.meta.model, choices=choices)

    def _logprobs(self, delta: SampleDelta) -> ChatLogprobs | None:
        if not self.meta.logprobs:
            return None
        return ChatLogprobs(content=[_chat_token_logprob(entry) for entry in delta.logprobs])


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _pieces(text: str, size: int = 16) -> list[str]:
    return [text[start : start + size] for start in range(0, len(text), size)] or [""]


def _chat_token_logprob(entry: TokenLogprob) -> ChatTokenLogprob:
    top = [ChatTopLogprob(token=token, logprob=logprob, bytes=list(token.encode())) for token, logprob in entry.top]
    return ChatTokenLogprob(
        token=entry.token, logprob=entry.logprob, bytes=list(entry.token.encode()), top_logprobs=top
    )
