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
    """A token's text and log-probability, with the ``top`` alternatives as (text, logprob) pairs; a prompt's first
    token has neither (None): nothing predicts it."""

    token: str
    logprob: float | None
    top: list[tuple[str, float]] | None


@dataclass(slots=True)
class SampleDelta:
    """New output of one of the request's ``n`` samples since the last update. A request that echoes its prompt
    (completions' ``echo``) gets the prompt's text, and its tokens' logprobs, in each sample's first delta."""

    index: int
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None
    echo_text: str = ""
    echo_logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(slots=True)
class RequestUpdate:
    """One step's news for one request. The last update carries ``usage`` and ``metrics`` (or ``error``): one
    ``RequestMetrics`` per engine request behind it (a batched completions prompt is several)."""

    samples: list[SampleDelta] = field(default_factory=list)
    usage: Usage | None = None
    metrics: list[RequestMetrics] = field(default_factory=list)
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
    echo_sent: bool = False


class RequestProgress:
    """Per-request bookkeeping in the engine thread; ``advance`` returns the news since the last call. ``echo``: each
    sample's first delta carries the prompt (a sample's first news comes once the prompt is computed, so its prompt
    logprobs are all there)."""

    def __init__(self, num_samples: int, token_text, echo: bool = False):
        self.samples = [SampleProgress() for _ in range(num_samples)]
        # token_text(token_id) -> str, memoized by the engine loop across requests.
        self.token_text = token_text
        self.echo = echo
        self._echo: tuple[str, list[TokenLogprob]] | None = None

    def advance(self, engine, request) -> RequestUpdate | None:
        """``request`` is the engine's ``Request``; returns None when nothing new is there to send."""
        deltas = [
            delta
            for seq, progress in zip(request.seqs, self.samples)
            if (delta := self._sample_delta(engine, seq, progress)) is not None
        ]
        if not request.finished:
            return RequestUpdate(deltas) if deltas else None
        return RequestUpdate(deltas, usage=self._usage(request), metrics=[request_metrics(request)])

    def _prompt_echo(self, engine, request) -> tuple[str, list[TokenLogprob]]:
        if self._echo is None:
            text = request.prompt if request.prompt is not None else engine.tokenizer.decode(request.prompt_token_ids)
            logprobs = []
            if request.params.prompt_logprobs is not None:
                first = request.prompt_token_ids[0]
                logprobs = [
                    TokenLogprob(self.token_text(first), None, None),
                    *(self._token_logprob(entry) for entry in request.seqs[0].prompt_logprobs),
                ]
            self._echo = (text, logprobs)
        return self._echo

    def _sample_delta(self, engine, seq, progress: SampleProgress) -> SampleDelta | None:
        if progress.finish_sent:
            return None
        if seq.is_finished:
            text = engine.output_text(seq)
            end = len(text)
        else:
            text = engine.sequence_text(seq)
            end = _stable_length(text, seq.params.stop)
        new_text = text[progress.num_chars_sent : end]
        new_logprobs = [self._token_logprob(entry) for entry in seq.logprobs[progress.num_logprobs_sent :]]
        finish_reason = seq.finish_reason if seq.is_finished else None
        if not new_text and not new_logprobs and finish_reason is None:
            return None
        progress.num_chars_sent = max(progress.num_chars_sent, end)
        progress.num_logprobs_sent = len(seq.logprobs)
        progress.finish_sent = finish_reason is not None
        delta = SampleDelta(seq.sample_index, new_text, new_logprobs, finish_reason)
        if self.echo and not progress.echo_sent:
            progress.echo_sent = True
            delta.echo_text, delta.echo_logprobs = self._prompt_echo(engine, engine.requests[seq.request_id])
        return delta

    def _token_logprob(self, entry: dict) -> TokenLogprob:
        top = [(self.token_text(token_id), logprob) for token_id, logprob in entry["top"]]
        return TokenLogprob(self.token_text(entry["token_id"]), entry["logprob"], top)

    @staticmethod
    def _usage(request) -> Usage:
        return Usage(
            prompt_tokens=len(request.prompt_token_ids),
            completion_tokens=sum(seq.num_output_tokens for seq in request.seqs),
            cached_tokens=request.seqs[0].num_cached_prompt_tokens,
        )


def _stable_length(text: str, stop_strings: list[str]) -> int:
    """Characters of a running sequence's text that no later token can cut (a stop string may begin in the rest)."""
    if not stop_strings:
        return len(text)
    return max(len(text) - (max(len(stop) for stop in stop_strings) - 1), 0)
