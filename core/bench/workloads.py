"""Seeded, deterministic workloads: each is a list of requests (prompt, sampling params, arrival offset).

A workload is a generator function registered in ``WORKLOADS``; its keyword parameters are the workload's options
and their defaults (``infer bench --workload NAME --OPTION VALUE``, or ``workload:`` in an ablation file). Every
workload also takes ``seed`` (all randomness comes from it) and ``batch_size`` (how many requests may be in flight at
once; None: no cap). Synthetic prompts are random real words (``infer.bench.words``); synthetic requests are greedy
with ``ignore_eos``, so every output has exactly its requested length and configs compare on equal work.
"""

from __future__ import annotations

import difflib
import inspect
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from infer.bench.arrivals import arrival_offsets
from infer.bench.words import WordSource
from infer.prompts import BUILTIN_PROMPTS, read_jsonl
from infer.sampling_params import SamplingParams

# The long-prompt workload measures the decodes around a long prefill; the long requests' own outputs stay short.
LONG_PROMPT_OUTPUT_LEN = 16
COPY_TEMPLATES = (
    "Repeat the following passage exactly, word for word.\n\n{passage}",
    "Copy the following passage, replacing every period with an exclamation mark.\n\n{passage}",
)


class WorkloadError(ValueError):
    """A workload name or option is wrong; the message says which and what is accepted."""


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request: a prompt (text, token ids or chat messages), how to sample it, and when to send it (seconds
    after the run starts)."""

    prompt: Any
    params: SamplingParams
    arrival_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Workload:
    """A named, generated workload with the options it was built from (defaults filled in)."""

    name: str
    options: dict[str, Any]
    requests: list[BenchRequest] = field(repr=False)

    @property
    def batch_size(self) -> int | None:
        """The most requests in flight at once (None: no cap)."""
        return self.options["batch_size"]


def greedy(max_tokens: int) -> SamplingParams:
    """Exactly ``max_tokens`` greedy tokens, whatever the model would say about stopping."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def chat(words: WordSource, rng: random.Random, num_requests: int = 64, input_len: int = 50,
         min_output_len: int = 16, output_len: int = 256, rate: float | None = None) -> list[BenchRequest]:
    """Mixed lengths: prompts of ``input_len`` +-20% random-word tokens, outputs uniform in
    [``min_output_len``, ``output_len``]."""
    if not 1 <= min_output_len <= output_len:
        raise WorkloadError(f"chat needs 1 <= min_output_len <= output_len, got {min_output_len} and {output_len}")
    spread = input_len // 5
    arrivals = arrival_offsets(num_requests, rate, rng)
    return [BenchRequest(words.token_ids(max(1, input_len + rng.randint(-spread, spread))),
                         greedy(rng.randint(min_output_len, output_len)), arrival) for arrival in arrivals]


def shared_prefix(words: WordSource, rng: random.Random, groups: int = 4, questions: int = 16,
                  system_len: int = 600, question_len: int = 30, output_len: int = 32,
                  rate: float | None = None) -> list[BenchRequest]:
    """SGLang's generated-shared-prefix: ``groups`` system prompts of ``system_len`` tokens, each followed by
    ``questions`` different questions of ``question_len`` tokens. Submitted interleaved across groups (question 0 of
    every group, then question 1, ...), so arrival order alone does not keep a group together."""
    systems = [words.token_ids(system_len) for _ in range(groups)]
    prompts = [systems[group] + words.token_ids(question_len) for _ in range(questions) for group in range(groups)]
    arrivals = arrival_offsets(len(prompts), rate, rng)
    return [BenchRequest(prompt, greedy(output_len), arrival) for prompt, arrival in zip(prompts, arrivals)]


def long_prompt(words: WordSource, rng: random.Random, num_requests: int = 8, input_len: int = 32,
                output_len: int = 128, long_len: int = 1536, num_long: int = 1, long_arrival_s: float = 1.0,
                rate: float | None = None) -> list[BenchRequest]:
    """Chunked prefill's case: ``num_requests`` short requests decode ``output_len`` tokens while ``num_long``
    prompts of ``long_len`` tokens arrive, one every ``long_arrival_s`` seconds. Watch the ITL p99."""
    short = [BenchRequest(words.token_ids(input_len), greedy(output_len), arrival)
             for arrival in arrival_offsets(num_requests, rate, rng)]
    long = [BenchRequest(words.token_ids(long_len), greedy(LONG_PROMPT_OUTPUT_LEN), long_arrival_s * (index + 1))
            for index in range(num_long)]
    return sorted(short + long, key=lambda request: request.arrival_s)


def single_stream(words: WordSource, rng: random.Random, num_requests: int = 8, output_len: int = 128,
                  passage_words: int = 120, prompt_kind: str = "mixed",
                  rate: float | None = None) -> list[BenchRequest]:
    """Speculative decoding's case (run at batch size 1 by default): chat prompts that are ``copy`` (repeat or edit
    a passage of ``passage_words`` words: drafts from the prompt hit), ``open`` (free answers), or ``mixed``
    (alternating)."""
    kinds = {"copy": ["copy"], "open": ["open"], "mixed": ["copy", "open"]}
    if prompt_kind not in kinds:
        raise WorkloadError(f'single-stream prompt_kind must be one of {", ".join(kinds)}, got "{prompt_kind}"')
    cycle = kinds[prompt_kind]
    texts = [_copy_text(words, index, passage_words) if cycle[index % len(cycle)] == "copy"
             else BUILTIN_PROMPTS[index % len(BUILTIN_PROMPTS)] for index in range(num_requests)]
    arrivals = arrival_offsets(num_requests, rate, rng)
    return [BenchRequest([{"role": "user", "content": text}], greedy(output_len), arrival)
            for text, arrival in zip(texts, arrivals)]


def prefill(words: WordSource, rng: random.Random, num_requests: int = 16, input_len: int = 512,
            output_len: int = 1, rate: float | None = None) -> list[BenchRequest]:
    """Prompt processing: ``num_requests`` random-word prompts of exactly ``input_len`` tokens, ``output_len``
    tokens each (one: the run is all prefill); watch prompt tok/s."""
    arrivals = arrival_offsets(num_requests, rate, rng)
    return [BenchRequest(words.token_ids(input_len), greedy(output_len), arrival) for arrival in arrivals]


def _copy_text(words: WordSource, index: int, passage_words: int) -> str:
    template = COPY_TEMPLATES[(index // 2) % len(COPY_TEMPLATES)]
    return template.format(passage=words.passage(passage_words))


def jsonl(words: WordSource, rng: random.Random, prompts: str | None = None, num_requests: int | None = None,
          rate: float | None = None) -> list[BenchRequest]:
    """The user's own prompts: a JSONL file in ``infer run --prompts`` format (sampling fields per line; greedy
    unless a line says otherwise), optionally only the first ``num_requests``."""
    if prompts is None:
        raise WorkloadError("the jsonl workload needs a prompts file (--prompts FILE, or prompts: in the ablation)")
    items = read_jsonl(prompts)[:num_requests]
    arrivals = arrival_offsets(len(items), rate, rng)
    return [BenchRequest(item.prompt, item.params, arrival) for item, arrival in zip(items, arrivals)]


WORKLOADS: dict[str, Callable[..., list[BenchRequest]]] = {
    "chat": chat,
    "shared-prefix": shared_prefix,
    "long-prompt": long_prompt,
    "single-stream": single_stream,
    "prefill": prefill,
    "jsonl": jsonl,
}
DEFAULT_BATCH_SIZE = {"single-stream": 1}


def workload_options(name: str) -> dict[str, Any]:
    """A workload's options and their defaults, ``seed`` and ``batch_size`` included."""
    generator = _generator(name)
    parameters = list(inspect.signature(generator).parameters.values())[2:]
    options = {parameter.name: parameter.default for parameter in parameters}
    return {**options, "seed": 0, "batch_size": DEFAULT_BATCH_SIZE.get(name)}


def build_workload(name: str, tokenizer, **options: Any) -> Workload:
    """Generate workload ``name`` with ``options`` over ``tokenizer``'s vocabulary; the same options give the same
    requests."""
    resolved = workload_options(name)
    _check_option_names(name, options, resolved)
    resolved.update(options)
    if resolved["batch_size"] is not None and resolved["batch_size"] < 1:
        raise WorkloadError(f"batch_size must be at least 1 (or omitted for no cap), got {resolved['batch_size']}")
    rng = random.Random(resolved["seed"])
    own = {key: value for key, value in resolved.items() if key not in ("seed", "batch_size")}
    return Workload(name, resolved, _generator(name)(WordSource(tokenizer, rng), rng, **own))


def _generator(name: str) -> Callable[..., list[BenchRequest]]:
    if name not in WORKLOADS:
        raise WorkloadError(f'unknown workload "{name}"{_did_you_mean(name, WORKLOADS)}; '
                            f"available: {', '.join(WORKLOADS)}")
    return WORKLOADS[name]


def _check_option_names(name: str, options: dict[str, Any], known: dict[str, Any]) -> None:
    unknown = [key for key in options if key not in known]
    if unknown:
        problems = "; ".join(f'"{key}"{_did_you_mean(key, known)}' for key in unknown)
        raise WorkloadError(f'workload "{name}" has no option {problems}; its options: {", ".join(known)}')


def _did_you_mean(name: str, choices) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f' (did you mean "{close[0]}"?)' if close else ""
