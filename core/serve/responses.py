"""Engine updates turned into OpenAI bodies: the whole response, or stream chunks, for completions and chat.

A format object lives for one request. Non-streamed responses are built from the same deltas as stream chunks
(merged per sample by ``Collector``), so the two paths cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    PromptTokensDetails,
    UsageInfo,
)
from infer.serve.updates import RequestUpdate, SampleDelta, TokenLogprob, Usage


@dataclass(frozen=True, slots=True)
class ResponseMeta:
    """What every body of one response repeats."""

    id: str
    created: int
    model: str
    num_samples: int
    logprobs: bool


def usage_info(usage: Usage) -> UsageInfo:
    return UsageInfo(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                     total_tokens=usage.prompt_tokens + usage.completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens))


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
            merged.finish_reason = delta.finish_reason or merged.finish_reason
        self.last = update


class CompletionFormat:
    """``/v1/completions``: choices carry ``text``; logprobs in the tokens / token_logprobs / top_logprobs shape."""

    def __init__(self, meta: ResponseMeta):
        self.meta = meta
        self._text_offsets = [0] * meta.num_samples

    def opening_chunks(self) -> list[BaseModel]:
        return []

    def chunk(self, deltas: list[SampleDelta]) -> BaseModel:
        return CompletionResponse(id=self.meta.id, created=self.meta.created, model=self.meta.model,
                                  choices=[self._choice(delta) for delta in deltas])

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return CompletionResponse(id=self.meta.id, created=self.meta.created, model=self.meta.model, choices=[],
                                  usage=usage_info(usage))

    def response(self, samples: list[SampleDelta], usage: Usage) -> BaseModel:
        return CompletionResponse(id=self.meta.id, created=self.meta.created, model=self.meta.model,
                                  choices=[self._choice(sample) for sample in samples], usage=usage_info(usage))

    def _choice(self, delta: SampleDelta) -> CompletionChoice:
        return CompletionChoice(index=delta.index, text=delta.text, logprobs=self._logprobs(delta),
                                finish_reason=delta.finish_reason)

    def _logprobs(self, delta: SampleDelta) -> CompletionLogprobs | None:
        if not self.meta.logprobs:
            return None
        logprobs = CompletionLogprobs()
        for entry in delta.logprobs:
            logprobs.tokens.append(entry.token)
            logprobs.token_logprobs.append(entry.logprob)
            logprobs.top_logprobs.append(dict(entry.top))
            logprobs.text_offset.append(self._text_offsets[delta.index])
            self._text_offsets[delta.index] += len(entry.token)
        return logprobs


class ChatFormat:
    """``/v1/chat/completions``: a message (or deltas after a first role-only chunk); logprobs as ``content``."""

    def __init__(self, meta: ResponseMeta):
        self.meta = meta

    def opening_chunks(self) -> list[BaseModel]:
        return [self._chunk([ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))])
                for index in range(self.meta.num_samples)]

    def chunk(self, deltas: list[SampleDelta]) -> BaseModel:
        return self._chunk([ChatChunkChoice(index=delta.index, delta=ChatDelta(content=delta.text or None),
                                            logprobs=self._logprobs(delta), finish_reason=delta.finish_reason)
                            for delta in deltas])

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return ChatCompletionChunk(id=self.meta.id, created=self.meta.created, model=self.meta.model, choices=[],
                                   usage=usage_info(usage))

    def response(self, samples: list[SampleDelta], usage: Usage) -> BaseModel:
        choices = [ChatChoice(index=sample.index, message=ChatResponseMessage(content=sample.text),
                              logprobs=self._logprobs(sample), finish_reason=sample.finish_reason)
                   for sample in samples]
        return ChatCompletionResponse(id=self.meta.id, created=self.meta.created, model=self.meta.model,
                                      choices=choices, usage=usage_info(usage))

    def _chunk(self, choices: list[ChatChunkChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.meta.id, created=self.meta.created, model=self.meta.model, choices=choices)

    def _logprobs(self, delta: SampleDelta) -> ChatLogprobs | None:
        if not self.meta.logprobs:
            return None
        return ChatLogprobs(content=[_chat_token_logprob(entry) for entry in delta.logprobs])


def _chat_token_logprob(entry: TokenLogprob) -> ChatTokenLogprob:
    top = [ChatTopLogprob(token=token, logprob=logprob, bytes=list(token.encode())) for token, logprob in entry.top]
    return ChatTokenLogprob(token=entry.token, logprob=entry.logprob, bytes=list(entry.token.encode()),
                            top_logprobs=top)
