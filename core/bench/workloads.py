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
import math
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


def chat(
    words: WordSource,
    rng: random.Random,
    num_requests: int = 64,
    input_len: int = 50,
    min_output_len: int = 16,
    output_len: int = 256,
    rate: float | None = None,
) -> list[BenchRequest]:
    """Mixed lengths: prompts of ``input_len`` +-20% random-word tokens, outputs uniform in
    [``min_output_len``, ``output_len``]."""
    if not 1 <= min_output_len <= output_len:
        raise WorkloadError(f"chat needs 1 <= min_output_len <= output_len, got {min_output_len} and {output_len}")
    spread = input_len // 5
    arrivals = arrival_offsets(num_requests, rate, rng)
    return [
        BenchRequest(
            words.token_ids(max(1, input_len + rng.randint(-spread, spread))),
            greedy(rng.randint(min_output_len, output_len)),
            arrival,
        )
        for arrival in arrivals
    ]


def shared_prefix(
    words: WordSource,
    rng: random.Random,
    groups: int = 4,
    questions: int = 16,
    system_len: int = 600,
    question_len: int = 30,
    output_len: int = 32,
    rate: float | None = None,
) -> list[BenchRequest]:
    """SGLang's generated-shared-prefix: ``groups`` system prompts of ``system_len`` tokens, each followed by
    ``questions`` different questions of ``question_len`` tokens. Submitted interleaved across groups (question 0 of
    every group, then question 1, ...), so arrival order alone does not keep a group together."""
    systems = [words.token_ids(system_len) for _ in range(groups)]
    prompts = [systems[group] + words.token_ids(question_len) for _ in range(questions) for group in range(groups)]
    arrivals = arrival_offsets(len(prompts), rate, rng)
    return [BenchRequest(prompt, greedy(output_len), arrival) for prompt, arrival in zip(prompts, arrivals)]


def long_prompt(
    words: WordSource,
    rng: random.Random,
    num_requests: int = 8,
    input_len: int = 32,
    output_len: int = 128,
    long_len: int = 1536,
    num_long: int = 1,
    long_arrival_s: float = 1.0,
    rate: float | None = None,
) -> list[BenchRequest]:
    """Chunked prefill's case: ``num_requests`` short requests decode ``output_len`` tokens while ``num_long``
    prompts of ``long_len`` tokens arrive, one every ``long_arrival_s`` seconds. Watch the ITL p99."""
    short = [
        BenchRequest(words.token_ids(input_len), greedy(output_len), arrival)
        for arrival in arrival_offsets(num_requests, rate, rng)
    ]
    long = [
        BenchRequest(words.token_ids(long_len), greedy(LONG_PROMPT_OUTPUT_LEN), long_arrival_s * (index + 1))
        for index in range(num_long)
    ]
    return sorted(short + long, key=lambda request: request.arrival_s)


def single_stream(
    words: WordSource,
    rng: random.Random,
    num_requests: int = 8,
    output_len: int = 128,
    passage_words: int = 120,
    prompt_kind: str = "mixed",
    rate: float | None = None,
) -> list[BenchRequest]:
    """Speculative decoding's case (run at batch size 1 by default): chat prompts that are ``copy`` (repeat or edit
    a passage of ``passage_words`` words: drafts from the prompt hit), ``open`` (free answers), or ``mixed``
    (alternating)."""
    kinds = {"copy": ["copy"], "open": ["open"], "mixed": ["copy", "open"]}
    if prompt_kind not in kinds:
        raise WorkloadError(f'single-stream prompt_kind must be one of {", ".join(kinds)}, got "{prompt_kind}"')
    cycle = kinds[prompt_kind]
    texts = [
        _copy_text(words, index, passage_words)
        if cycle[index % len(cycle)] == "copy"
        else BUILTIN_PROMPTS[index % len(BUILTIN_PROMPTS)]
        for index in range(num_requests)
    ]
    arrivals = arrival_offsets(num_requests, rate, rng)
    return [
        BenchRequest([{"role": "user", "content": text}], greedy(output_len), arrival)
        for text, arrival in zip(texts, arrivals)
    ]


def prefill(
    words: WordSource,
    rng: random.Random,
    num_requests: int = 16,
    input_len: int = 512,
    output_len: int = 1,
    rate: float | None = None,
) -> list[BenchRequest]:
    """Prompt processing: ``num_requests`` random-word prompts of exactly ``input_len`` tokens, ``output_len``
    tokens each (one: the run is all prefill); watch prompt tok/s."""
    arrivals = arrival_offsets(num_requests, rate, rng)
    return [BenchRequest(words.token_ids(input_len), greedy(output_len), arrival) for arrival in arrivals]


def _copy_text(words: WordSource, index: int, passage_words: int) -> str:
    template = COPY_TEMPLATES[(index // 2) % len(COPY_TEMPLATES)]
    return template.format(passage=words.passage(passage_words))


def jsonl(
    words: WordSource,
    rng: random.Random,
    prompts: str | None = None,
    num_requests: int | None = None,
    rate: float | None = None,
) -> list[BenchRequest]:
    """The user's own prompts: a JSONL file in ``infer run --prompts`` format (sampling fields per line; greedy
    unless a line says otherwise), optionally only the first ``num_requests``."""
    if prompts is None:
        raise WorkloadError("the jsonl workload needs a prompts file (--prompts FILE, or prompts: in the ablation)")
    items = read_jsonl(prompts)[:num_requests]
    arrivals = arrival_offsets(len(items), rate, rng)
    return [BenchRequest(item.prompt, item.params, arrival) for item, arrival in zip(items, arrivals)]


def lognormal_lengths(rng: random.Random, count: int, mean: float, sigma: float, maximum: int) -> list[int]:
    """``count`` lengths, lognormal with mean ``mean`` and log-space deviation ``sigma`` (0: all ``mean``), each in
    [1, ``maximum``]."""
    if mean < 1 or sigma < 0:
        raise WorkloadError(f"lengths need a mean >= 1 and length_sigma >= 0, got {mean} and {sigma}")
    mu = math.log(mean) - sigma * sigma / 2
    return [min(maximum, max(1, round(rng.lognormvariate(mu, sigma)))) for _ in range(count)]


def scheduling_params(
    rng: random.Random,
    output_len: int,
    num_tenants: int,
    tenant_skew: float,
    num_priorities: int,
    ttft_slo_s: float | None,
) -> SamplingParams:
    """A synthetic request's sampling and scheduling fields: a tenant drawn with Zipf weights ``1 / (k + 1) **
    tenant_skew`` (0: uniform), a priority uniform in [0, ``num_priorities``), and a TTFT target ``ttft_slo_s`` times
    (priority + 1) (favored requests want their first token sooner)."""
    tenant = None
    if num_tenants > 1:
        weights = [1.0 / (k + 1) ** tenant_skew for k in range(num_tenants)]
        tenant = f"tenant-{rng.choices(range(num_tenants), weights)[0]}"
    priority = rng.randrange(num_priorities) if num_priorities > 1 else 0
    slo = None if ttft_slo_s is None else ttft_slo_s * (priority + 1)
    return SamplingParams(
        max_tokens=output_len, temperature=0.0, ignore_eos=True, priority=priority, tenant=tenant, ttft_slo_s=slo
    )


def synthetic(
    words: WordSource,
    rng: random.Random,
    num_requests: int = 1000,
    input_len: int = 256,
    output_len: int = 128,
    length_sigma: float = 0.6,
    max_len: int = 2000,
    num_systems: int = 0,
    system_len: int = 512,
    num_tenants: int = 1,
    tenant_skew: float = 0.0,
    num_priorities: int = 1,
    ttft_slo_s: float | None = None,
    rate: float | None = None,
    burstiness: float = 1.0,
) -> list[BenchRequest]:
    """Traffic at scale: arrivals at ``rate`` requests/s (gamma gaps of shape ``burstiness``: 1 Poisson, lower
    burstier), lognormal prompt and output lengths with means ``input_len`` and ``output_len`` (prompt + output
    within ``max_len``); with ``num_systems`` > 0 each prompt starts with one of that many shared system prompts of
    ``system_len`` tokens; tenants, priorities and TTFT targets as ``scheduling_params`` draws them."""
    if num_tenants < 1 or num_priorities < 1:
        raise WorkloadError(
            f"synthetic needs num_tenants and num_priorities >= 1, got {num_tenants} and {num_priorities}"
        )
    systems = [words.token_ids(system_len) for _ in range(num_systems)]
    inputs = lognormal_lengths(rng, num_requests, input_len, length_sigma, max_len - 1)
    outputs = lognormal_lengths(rng, num_requests, output_len, length_sigma, max_len - 1)
    arrivals = arrival_offsets(num_requests, rate, rng, burstiness)
    requests = []
    for prompt_len, out_len, arrival in zip(inputs, outputs, arrivals):
        prefix = rng.choice(systems) if systems else []
        prompt = prefix + words.bulk_token_ids(max(1, prompt_len))
        prompt = prompt[: max_len - 2]
        out_len = max(1, min(out_len, max_len - len(prompt)))
        params = scheduling_params(rng, out_len, num_tenants, tenant_skew, num_priorities, ttft_slo_s)
        requests.append(BenchRequest(prompt, params, arrival))
    return requests


def multi_turn(
    words: WordSource,
    rng: random.Random,
    num_sessions: int = 16,
    turns: int = 4,
    system_len: int = 200,
    user_len: int = 40,
    output_len: int = 64,
    think_time_s: float = 2.0,
    num_tenants: int = 1,
    rate: float | None = None,
) -> list[BenchRequest]:
    """Chat sessions: each turn's prompt is the previous turn's prompt, an answer of ``output_len`` tokens and a new
    user message of ``user_len`` (prefix reuse grows turn by turn); sessions start at ``rate`` per second, turn t
    arrives ``t * think_time_s`` after its session's first. The answers in later prompts are stand-ins, not what the
    engine generated (an open loop), so what a later turn finds cached is the earlier turns' prompts."""
    if turns < 1:
        raise WorkloadError(f"multi-turn needs turns >= 1, got {turns}")
    starts = arrival_offsets(num_sessions, rate, rng)
    requests = []
    for session, start in enumerate(starts):
        tenant = f"tenant-{session % num_tenants}" if num_tenants > 1 else None
        prompt = words.token_ids(system_len)
        for turn in range(turns):
            if turn:
                prompt = prompt + words.token_ids(output_len)
            prompt = prompt + words.token_ids(user_len)
            params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True, tenant=tenant)
            requests.append(BenchRequest(list(prompt), params, start + turn * think_time_s))
    return sorted(requests, key=lambda request: request.arrival_s)


TRACE_FIELDS = (
    "arrival_s",
    "prompt",
    "prompt_token_ids",
    "prompt_len",
    "output_len",
    "priority",
    "tenant",
    "ttft_slo_s",
)


def trace(
    words: WordSource,
    rng: random.Random,
    trace_file: str | None = None,
    num_requests: int | None = None,
    time_scale: float = 1.0,
) -> list[BenchRequest]:
    """Replay a JSONL trace, one request per line: ``arrival_s`` (seconds from the start), the prompt as ``prompt``
    (text), ``prompt_token_ids`` or ``prompt_len`` (that many random-word tokens), ``output_len``, and optionally
    ``priority``, ``tenant``, ``ttft_slo_s``. Arrival times are multiplied by ``time_scale`` (0.5: twice as fast)."""
    import json

    if trace_file is None:
        raise WorkloadError("the trace workload needs a JSONL file (--trace-file FILE, or trace_file: in the ablation)")
    requests = []
    with open(trace_file) as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            if num_requests is not None and len(requests) >= num_requests:
                break
            try:
                item = json.loads(line)
                requests.append(_trace_request(words, item, time_scale))
            except (ValueError, KeyError, TypeError) as error:
                raise WorkloadError(
                    f"{trace_file}:{number}: {error}; a line needs arrival_s, one of prompt, "
                    f"prompt_token_ids, prompt_len, and output_len"
                ) from None
    return sorted(requests, key=lambda request: request.arrival_s)


def _trace_request(words: WordSource, item: dict, time_scale: float) -> BenchRequest:
    unknown = sorted(set(item) - set(TRACE_FIELDS))
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(unknown)} (known: {', '.join(TRACE_FIELDS)})")
    given = [key for key in ("prompt", "prompt_token_ids", "prompt_len") if key in item]
    if len(given) != 1:
        raise ValueError(f"give exactly one of prompt, prompt_token_ids, prompt_len (got {given or 'none'})")
    prompt = item[given[0]]
    if given[0] == "prompt_len":
        prompt = words.token_ids(int(prompt))
    params = SamplingParams(
        max_tokens=int(item["output_len"]),
        temperature=0.0,
        ignore_eos=True,
        priority=int(item.get("priority", 0)),
        tenant=item.get("tenant"),
        ttft_slo_s=item.get("ttft_slo_s"),
    )
    return BenchRequest(prompt, params, float(item["arrival_s"]) * time_scale)


WORKLOADS: dict[str, Callable[..., list[BenchRequest]]] = {
    "chat": chat,
    "shared-prefix": shared_prefix,
    "long-prompt": long_prompt,
    "single-stream": single_stream,
    "prefill": prefill,
    "jsonl": jsonl,
    "synthetic": synthetic,
    "multi-turn": multi_turn,
    "trace": trace,
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
    try:
        return Workload(name, resolved, _generator(name)(WordSource(tokenizer, rng), rng, **own))
    except WorkloadError:
        raise
    except (ValueError, OSError) as error:
        raise WorkloadError(f'workload "{name}": {error}') from None


def _generator(name: str) -> Callable[..., list[BenchRequest]]:
    if name not in WORKLOADS:
        raise WorkloadError(
            f'unknown workload "{name}"{_did_you_mean(name, WORKLOADS)}; available: {", ".join(WORKLOADS)}'
        )
    return WORKLOADS[name]


def _check_option_names(name: str, options: dict[str, Any], known: dict[str, Any]) -> None:
    unknown = [key for key in options if key not in known]
    if unknown:
        problems = "; ".join(f'"{key}"{_did_you_mean(key, known)}' for key in unknown)
        raise WorkloadError(f'workload "{name}" has no option {problems}; its options: {", ".join(known)}')


def _did_you_mean(name: str, choices) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f' (did you mean "{close[0]}"?)' if close else ""
