"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from infer.guide import Constraint, GuideError

# OpenAI's bound: higher temperatures flatten the distribution into noise; a request asking for one is refused.
MAX_TEMPERATURE = 2.0
# Temperatures below this sample greedily (vLLM's bound): dividing logits by a denormal one overflows them to inf,
# and the softmax of inf - inf is NaN.
GREEDY_TEMPERATURE = 1e-5


class SamplingParamsError(ValueError):
    """A sampling field has an invalid value; ``field`` names it."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request. ``temperature`` below ``GREEDY_TEMPERATURE`` (1e-5; 0 included) means greedy.

    ``max_tokens`` None means "until the context ends": the engine resolves it to ``max_model_len`` minus the prompt's
    length when the request arrives. A number that does not fit beside the prompt is refused, not silently cut
    (OpenAI's policy), as is a ``temperature`` above ``MAX_TEMPERATURE`` (2). ``max_tokens`` 0 computes the prompt and
    generates nothing (scoring a prompt with ``prompt_logprobs``).

    ``top_k`` 0 or -1 (vLLM's spelling) disables it. ``logit_bias`` maps token ids to a bias in [-100, 100] added to
    their logits before any filter or grammar mask, in every sampling path (greedy, sampled, draft verification):
    +100 all but forces a token, -100 bans it. Logprobs are always those of the model's own logits.

    ``prompt_logprobs``: the log-probability of every prompt token given the ones before it, with that many top
    alternatives (``RequestOutput.prompt_logprobs``; the first token has none). The engine computes the whole
    prompt for such a request (no prefix-cache hit skips positions it needs).

    Scheduling fields (read by schedulers that care; the others ignore them): ``priority`` (lower is served first,
    vLLM's convention; ``scheduler: priority``), ``tenant`` (who the request is for; ``scheduler: fair`` shares the
    engine between tenants) and ``ttft_slo_s`` (the time-to-first-token target in seconds after arrival; ``scheduler:
    deadline``; ``infer bench`` reports the share of requests that met theirs).

    ``seed`` makes sampling reproducible per request: the random draw for the token at absolute position ``p`` comes
    from a generator keyed by ``(seed, p)``, so a request gives the same text alone or in any batch.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None
    # Structured output: what the text must match (``infer.guide.Constraint``; a mapping is converted).
    constraint: Constraint | None = None
    # Scheduling (see above).
    priority: int = 0
    tenant: str | None = None
    ttft_slo_s: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        # JSON objects (a prompts file's line, an API body) key token ids by strings.
        self.logit_bias = {
            int(key) if isinstance(key, str) and key.isdecimal() else key: value
            for key, value in (self.logit_bias or {}).items()
        }
        if self.top_k == -1:
            self.top_k = 0
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            try:
                self.constraint = Constraint.from_dict(self.constraint)
            except (GuideError, TypeError) as error:
                raise SamplingParamsError("constraint", str(error)) from None
        self._validate()

    def _validate(self) -> None:
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 0
        ):
            raise SamplingParamsError(
                "max_tokens", f"must be an integer >= 0 or null (until the context ends), got {self.max_tokens!r}"
            )
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise SamplingParamsError("temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise SamplingParamsError("top_k", f"must be >= 0 (0 or -1 disables it), got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise SamplingParamsError(
                "min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}"
            )
        if self.n < 1:
            raise SamplingParamsError("n", f"must be >= 1, got {self.n!r}")
        if self.constraint is not None and self.min_tokens:
            raise SamplingParamsError(
                "min_tokens", "cannot be combined with a constraint: the grammar decides where the output may end"
            )
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise SamplingParamsError("priority", f"must be an integer (lower is served first), got {self.priority!r}")
        if self.ttft_slo_s is not None and not self.ttft_slo_s > 0:
            raise SamplingParamsError("ttft_slo_s", f"must be a positive number of seconds, got {self.ttft_slo_s!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 20:
                raise SamplingParamsError(name, f"must be in [0, 20], got {value!r}")
        for token_id, bias in self.logit_bias.items():
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise SamplingParamsError("logit_bias", f"keys are token ids (integers >= 0), got {token_id!r}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                raise SamplingParamsError(
                    "logit_bias", f"token {token_id}: the bias must be a number in [-100, 100], got {bias!r}"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @classmethod
    def from_dict(cls, data: dict) -> SamplingParams:
        """Build from a plain dict (a JSONL line, an API body); unknown keys are an error naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            import difflib

            hints = []
            for key in unknown:
                close = difflib.get_close_matches(key, sorted(known), n=1)
                hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise SamplingParamsError(unknown[0], "unknown sampling field(s): " + ", ".join(hints))
        return cls(**data)
