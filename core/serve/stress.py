"""A bounded stress run of a live ``infer serve`` on loopback: what a hostile or careless client population does.

In one run, against one server: ``concurrency`` greedy completions at once, each compared with the same request
made alone beforehand (the reference); streams the client drops mid-way; a fuzz of malformed requests (every field
with wrong types and extreme values, invalid JSON, a huge body, unknown fields, wrong keys); and a burst past
``server.max_waiting`` (429s). Afterwards the server must be alive with every KV block free. ``run`` returns the
figures; ``tests/test_serve_stress.py`` runs it small, ``python -m infer.serve.stress`` at full size:

    python -m infer.serve.stress --url http://127.0.0.1:8000 --api-key KEY
    python -m infer.serve.stress --launch baseline model.dtype=float32    # starts its own server, then SIGTERMs it

Every loop is bounded in count and time; only loopback addresses are used.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import time
from dataclasses import asdict, dataclass, field

import httpx

MALFORMED_VALUES = [
    None,
    "",
    "x" * 5000,
    -1,
    0,
    2**63,
    -(2**63),
    1e308,
    -1e308,
    0.5,
    True,
    [],
    {},
    [1, "a"],
    {"a": 1},
    "NaN",
]
FIELDS = [
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "stop",
    "seed",
    "stream",
    "logprobs",
    "min_tokens",
    "ignore_eos",
    "stream_options",
    "model",
    "user",
    "presence_penalty",
    "echo",
    "best_of",
    "logit_bias",
    "suffix",
]
# Chat bodies' tool fields, each with values of the wrong shape, a schema the guide cannot compile, or names that
# do not match.
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
MALFORMED_TOOL_FIELDS = {
    "tools": [
        [{"type": "function"}],
        [{"type": "function", "function": {"name": ""}}],
        [TOOL, TOOL],
        [1],
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
        "f",
    ],
    "tool_choice": ["always", {"type": "function"}, {"type": "function", "function": {"name": "g"}}, 1],
    "logit_bias": [{"x": 1}, {"1": 1000}, {"-5": 1}, {"99999999999999999999": 1}, {"1": "a"}, [1]],
    "messages": [
        [{"role": "tool", "content": "r"}],
        [{"role": "assistant", "tool_calls": [{"id": "1"}]}],
        [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{"}}],
            }
        ],
    ],
}


@dataclass
class StressReport:
    requests: int = 0
    status_counts: dict[int, int] = field(default_factory=dict)
    mismatches: int = 0
    disconnects: int = 0
    server_errors: int = 0  # 5xx and transport errors on requests the server should have answered
    kv_blocks_used_after: int = -1
    alive_after: bool = False

    def count(self, status: int) -> None:
        self.requests += 1
        self.status_counts[status] = self.status_counts.get(status, 0) + 1
        if status >= 500:
            self.server_errors += 1


def run(
    url: str,
    api_key: str | None = None,
    concurrency: int = 64,
    disconnects: int = 16,
    fuzz: int = 200,
    burst: int = 0,
    max_tokens: int = 16,
    seed: int = 0,
    time_limit_s: float = 600.0,
) -> StressReport:
    """The whole run against the server at ``url``; ``burst`` > 0 sends that many at once to provoke 429s (set it
    above the server's ``max_waiting``)."""
    rng = random.Random(seed)
    report = StressReport()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + time_limit_s
    with httpx.Client(base_url=url, headers=headers, timeout=120) as client:
        prompts = [f"Request {i}: tell me about the number {rng.randint(0, 10**6)}." for i in range(concurrency)]
        references = [_complete(client, report, prompt, max_tokens) for prompt in prompts]
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            together = list(pool.map(lambda prompt: _complete(client, report, prompt, max_tokens), prompts))
            report.mismatches = sum(a != b for a, b in zip(together, references))
            list(pool.map(lambda i: _disconnect(url, headers, report, i), range(disconnects)))
            list(pool.map(lambda i: _malformed(client, report, random.Random(seed * 1000 + i)), range(fuzz)))
            if burst:
                list(
                    pool.map(
                        lambda prompt: _complete(client, report, prompt, 64, expect_busy=True),
                        [f"burst {i}" for i in range(burst)],
                    )
                )
        _wrong_keys(url, report)
        report.kv_blocks_used_after = _settled_blocks(client, deadline)
        report.alive_after = client.get("/health").status_code == 200
    return report


def _complete(
    client: httpx.Client, report: StressReport, prompt: str, max_tokens: int, expect_busy: bool = False
) -> str | None:
    """One greedy completion; a well-behaved client retries a 429 after its Retry-After (a burst does not)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    for _ in range(50):
        try:
            response = client.post("/v1/completions", json=body)
        except httpx.TransportError:
            report.count(599)
            return None
        report.count(response.status_code)
        if response.status_code != 429 or expect_busy:
            break
        time.sleep(min(float(response.headers.get("Retry-After", 1)), 1.0) * random.random())
    return response.json()["choices"][0]["text"] if response.status_code == 200 else None


def _disconnect(url: str, headers: dict, report: StressReport, index: int) -> None:
    """A stream the client abandons after a few chunks (the server must abort it and free its blocks)."""
    body = {"prompt": f"disconnect {index}", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=60) as response:
        report.count(response.status_code)
        for number, _ in enumerate(response.iter_lines()):
            if number >= 2 + index % 5:
                break
    report.disconnects += 1


def _malformed(client: httpx.Client, report: StressReport, rng: random.Random) -> None:
    """One hostile body: a field with a wrong type or an extreme value, invalid JSON, a huge or unknown field, a
    malformed tool, tool choice, logit bias or tool turn in a chat."""
    kind = rng.randrange(6)
    path = "/v1/completions"
    if kind == 5:
        path = "/v1/chat/completions"
        name = rng.choice(sorted(MALFORMED_TOOL_FIELDS))
        body = {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "tools": [TOOL],
            "tool_choice": "required",
            name: rng.choice(MALFORMED_TOOL_FIELDS[name]),
        }
        content = json.dumps(body).encode()
    elif kind == 0:
        content = b'{"prompt": "hi", "max_tokens": ' + bytes(rng.choice([b"", b"}", b"[", b"1e999"]))
    elif kind == 1:
        content = json.dumps({"prompt": "hi", rng.choice(["echo", "best_of", "maxtokens", "tools"]): 1}).encode()
    elif kind == 2:
        # Past the context, past any tokenization's reach, or past server.max_body_bytes (4 MiB by default).
        words = rng.choice([rng.randint(3000, 40000), 900_000])
        content = json.dumps({"prompt": "word " * words, "max_tokens": 2}).encode()
    else:
        body = {"prompt": "hi", "max_tokens": 4, rng.choice(FIELDS): rng.choice(MALFORMED_VALUES)}
        content = json.dumps(body).encode()
    try:
        response = client.post(path, content=content, headers={"Content-Type": "application/json"})
    except httpx.TransportError:
        report.count(599)
        return
    report.count(response.status_code)


def _wrong_keys(url: str, report: StressReport) -> None:
    for authorization in ("Bearer wrong", "Basic c3RyZXNz", "Bearer"):
        response = httpx.get(f"{url}/v1/models", headers={"Authorization": authorization}, timeout=10)
        report.count(response.status_code)


def _settled_blocks(client: httpx.Client, deadline: float) -> int:
    """KV blocks in use once the aborted streams have drained (the server frees them within a few steps)."""
    while True:
        used = client.get("/health").json()["kv_blocks_used"]
        if used == 0 or time.monotonic() > deadline:
            return used
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url")
    parser.add_argument("--api-key")
    parser.add_argument(
        "--launch",
        nargs="+",
        metavar="CONFIG_AND_OVERRIDES",
        help="start a server (config, then overrides), stress it, then SIGTERM it",
    )
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--fuzz", type=int, default=400)
    args = parser.parse_args()
    if args.launch:
        from infer.serve.process import ServerProcess

        config, *overrides = args.launch
        with ServerProcess(config, [*overrides, "server.max_waiting=16"], api_key="stress-key") as server:
            report = run(server.url, "stress-key", args.concurrency, fuzz=args.fuzz, burst=48)
            exit_code = server.stop()
        print(json.dumps({**asdict(report), "sigterm_exit_code": exit_code}, indent=2))
        return
    print(json.dumps(asdict(run(args.url, args.api_key, args.concurrency, fuzz=args.fuzz)), indent=2))


if __name__ == "__main__":
    main()
