"""What the engine thread tells the event loop about one request after each step, and how it works that out.

Text comes from the sequence's own detokenizer (``Engine.sequence_text``, ``infer.engine.detokenizer``), the one that
the engine's stop-string checks and its final text (``Engine.output_text``) read, so streamed text adds up to
exactly the text a non-streamed request returns. A delta only releases text that can no longer change: the
detokenizer holds back an incomplete UTF-8 character until its last byte comes, and the last
``len(longest stop string) - 1`` characters wait until no stop string can start there (the engine cuts a matched
stop string from the output). When the sequence finishes, the rest of its final text goes out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from infer.engine.engine import request_metrics
from infer.outputs import RequestMetrics


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's text and log-probability, with the ``top`` alternatives as (text, logprob) pairs."""

    token: str
    logprob: float
    top: list[tuple[str, float]]


@dataclass(slots=True)
class SampleDelta:
    """New output of one of the request's ``n`` samples since the last update."""

    index: int
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(slots=True)
class RequestUpdate:
    """One step's news for one request. The last update carries ``usage`` and ``metrics`` (or ``error``)."""

    samples: list[SampleDelta] = field(default_factory=list)
    usage: Usage | None = None
    metrics: RequestMetrics | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.usage is not None or self.error is not None


@dataclass(slots=True)
class SampleProgress:
    """How much of one sequence's text (and of its logprobs) has been sent."""

    num_chars_sent: int = 0
    num_logprobs_sent: int = 0
    finish_sent: bool = False


class RequestProgress:
    """Per-request bookkeeping in the engine thread; ``advance`` returns the news since the last call."""

    def __init__(self, num_samples: int, token_text):
        self.samples = [SampleProgress() for _ in range(num_samples)]
        # token_text(token_id) -> str, memoized by the engine loop across requests.
        self.token_text = token_text

    def advance(self, engine, request) -> RequestUpdate | None:
        """``request`` is the engine's ``Request``; returns None when nothing new is there to send."""
        deltas = [delta for seq, progress in zip(request.seqs, self.samples)
                  if (delta := self._sample_delta(engine, seq, progress)) is not None]
        if not request.finished:
            return RequestUpdate(deltas) if deltas else None
        return RequestUpdate(deltas, usage=self._usage(request), metrics=request_metrics(request))

    def _sample_delta(self, engine, seq, progress: SampleProgress) -> SampleDelta | None:
        if progress.finish_sent:
            return None
        if seq.is_finished:
            text = engine.output_text(seq)
            end = len(text)
        else:
            text = engine.sequence_text(seq)
            end = _stable_length(text, seq.params.stop)
        new_text = text[progress.num_chars_sent:end]
        new_logprobs = [self._token_logprob(entry) for entry in seq.logprobs[progress.num_logprobs_sent:]]
        finish_reason = seq.finish_reason if seq.is_finished else None
        if not new_text and not new_logprobs and finish_reason is None:
            return None
        progress.num_chars_sent = max(progress.num_chars_sent, end)
        progress.num_logprobs_sent = len(seq.logprobs)
        progress.finish_sent = finish_reason is not None
        return SampleDelta(seq.sample_index, new_text, new_logprobs, finish_reason)

    def _token_logprob(self, entry: dict) -> TokenLogprob:
        top = [(self.token_text(token_id), logprob) for token_id, logprob in entry["top"]]
        return TokenLogprob(self.token_text(entry["token_id"]), entry["logprob"], top)

    @staticmethod
    def _usage(request) -> Usage:
        return Usage(prompt_tokens=len(request.prompt_token_ids),
                     completion_tokens=sum(seq.num_output_tokens for seq in request.seqs),
                     cached_tokens=request.seqs[0].num_cached_prompt_tokens)


def _stable_length(text: str, stop_strings: list[str]) -> int:
    """Characters of a running sequence's text that no later token can cut (a stop string may begin in the rest)."""
    if not stop_strings:
        return len(text)
    return max(len(text) - (max(len(stop) for stop in stop_strings) - 1), 0)
