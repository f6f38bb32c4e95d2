"""Data parallelism: the router's choices (prefix affinity with load balancing, round robin, health), its metrics
aggregation, and real replicas on loopback: ``infer serve --data-parallel-size 2`` answers every request as one
replica does, keeps a shared-prefix workload's cache hit rate near one engine's with ``prefix_affinity`` (and clearly
above ``round_robin``'s), and fails over when a replica is killed."""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from infer.config import RouterConfig
from infer.serve.process import RouterProcess, ServerProcess
from infer.serve.router import ReplicaSet, aggregate_metrics, block_hashes, routing_text

BASE = ["model.dtype=float32", "model.max_model_len=512", "cache.num_blocks=128", "prefix_cache.name=radix"]


def replica_set(policy="prefix_affinity", size=2, **settings) -> ReplicaSet:
    replicas = ReplicaSet([f"http://replica-{i}" for i in range(size)], RouterConfig(policy=policy, **settings))
    for replica in replicas.replicas:
        replicas.mark(replica, healthy=True)
    return replicas


def routed(replicas: ReplicaSet, text: str) -> int:
    replica, _ = replicas.choose(text)
    replicas.remember(replica, text)
    return replica.index


# -- routing ------------------------------------------------------------------------------------------------------
def test_routing_text_reads_completions_and_chats():
    assert routing_text({"prompt": "abc"}) == "abc"
    assert routing_text({"prompt": ["first", "second"]}) == "first"
    assert routing_text({"prompt": [1, 2, 3]}) == "1 2 3"
    chat = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ]
    }
    assert routing_text(chat) == "system\nbe brief\nuser\nhi\n"
    assert routing_text("not a dict") == routing_text({"model": "x"}) == ""


def test_block_hashes_chain_so_a_block_matches_only_after_the_same_blocks():
    a, b = block_hashes("x" * 64 + "y" * 64, 64), block_hashes("z" * 64 + "y" * 64, 64)
    assert len(a) == 2 and a[1] != b[1]
    assert block_hashes("short", 64) == []


def test_prefix_affinity_keeps_a_shared_prefix_on_one_replica_and_spreads_new_ones():
    replicas = replica_set()
    systems = ["".join(random.Random(seed).choices("abcdefgh ", k=600)) for seed in range(4)]
    first = [routed(replicas, system + " question 0") for system in systems]
    assert sorted(first) == [0, 0, 1, 1]  # nothing matched: the idlest, in turn
    for question in range(1, 5):
        assert [routed(replicas, system + f" question {question}") for system in systems] == first


def test_prefix_affinity_passes_over_a_much_busier_replica():
    replicas = replica_set(balance_abs_threshold=2, balance_rel_threshold=1.5)
    system = "s" * 640
    assert routed(replicas, system + "a") == 0
    replicas.replicas[0].in_flight = 3  # 3 > 0 + 2 and 3 > 0 * 1.5
    assert routed(replicas, system + "b") == 1
    replicas.replicas[0].in_flight = 2  # within the absolute threshold: the cache wins
    assert routed(replicas, system + "c") in (0, 1) and replicas.choose(system + "d")[1] == 10


def test_round_robin_alternates_and_both_skip_unhealthy_replicas():
    replicas = replica_set("round_robin", size=3)
    assert [routed(replicas, "same text") for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    replicas.mark(replicas.replicas[1], healthy=False, at_once=True)
    assert {routed(replicas, "same text") for _ in range(4)} == {0, 2}
    affinity = replica_set(failure_threshold=2)
    affinity.mark(affinity.replicas[0], healthy=False)
    assert affinity.replicas[0].healthy  # one failed check is not enough
    affinity.mark(affinity.replicas[0], healthy=False)
    assert not affinity.replicas[0].healthy and routed(affinity, "x" * 200) == 1
    affinity.mark(affinity.replicas[1], healthy=False, at_once=True)
    assert affinity.choose("x" * 200) == (None, 0)


def test_metrics_of_replicas_add_up_and_ratios_are_recomputed():
    def replica(prompt, cached, finished):
        return (
            f"# TYPE infer_prompt_tokens_total counter\ninfer_prompt_tokens_total {prompt}\n"
            f"# TYPE infer_prompt_tokens_cached_total counter\ninfer_prompt_tokens_cached_total {cached}\n"
            f"# TYPE infer_prefix_cache_hit_rate gauge\ninfer_prefix_cache_hit_rate {cached / prompt}\n"
            f"# TYPE infer_sequences_finished_total counter\n"
            f'infer_sequences_finished_total{{finish_reason="stop"}} {finished}\n'
            f"# TYPE infer_ttft_seconds histogram\n"
            f'infer_ttft_seconds_bucket{{le="1.0"}} {finished}\ninfer_ttft_seconds_bucket{{le="+Inf"}} {finished}\n'
            f"infer_ttft_seconds_sum 0.5\ninfer_ttft_seconds_count {finished}\n"
        )

    merged = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(aggregate_metrics([replica(100, 50, 3), replica(300, 0, 1)]))
        for sample in family.samples
    }
    assert merged[("infer_prompt_tokens_total", ())] == 400
    assert merged[("infer_prefix_cache_hit_rate", ())] == pytest.approx(50 / 400)  # not 0.5 + 0
    assert merged[("infer_sequences_finished_total", (("finish_reason", "stop"),))] == 4
    assert merged[("infer_ttft_seconds_bucket", (("le", "+Inf"),))] == 4 and merged[("infer_ttft_seconds_sum", ())] == 1


# -- real replicas ------------------------------------------------------------------------------------------------
WORDS = (
    "library museum river garden window pencil orange mountain silver engine teacher market morning winter "
    "bridge candle forest island letter music ocean planet rocket summer"
).split()


def shared_prefix_prompts(seed: int, groups: int = 3, questions: int = 4) -> list[str]:
    """Interleaved like the shared-prefix workload: question q of every group, then q + 1, ... (an odd number of
    groups, so that round robin over 2 replicas does not keep each group on one by accident)."""
    rng = random.Random(seed)
    systems = [" ".join(rng.choices(WORDS, k=220)) for _ in range(groups)]
    return [
        f"{systems[group]}\nQuestion {question}: {' '.join(rng.choices(WORDS, k=8))}?"
        for question in range(questions)
        for group in range(groups)
    ]


def complete(url: str, prompt: str) -> dict:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def hit_rate(results: list[dict]) -> float:
    cached = sum(result["usage"]["prompt_tokens_details"]["cached_tokens"] for result in results)
    return cached / sum(result["usage"]["prompt_tokens"] for result in results)


@pytest.fixture(scope="module")
def data_parallel(tmp_path_factory):
    log = tmp_path_factory.mktemp("dp") / "serve.log"
    with ServerProcess("baseline", [*BASE, "parallel.data_parallel_size=2"], log_path=log) as server:
        server.replicas = [replica["url"] for replica in httpx.get(f"{server.url}/health").json()["replicas"]]
        yield server


def test_two_replicas_answer_as_one_and_prefix_affinity_keeps_the_hit_rate(data_parallel):
    # One engine alone (replica 0, straight), the router's prefix_affinity, and round_robin over the same two
    # replicas (a second router): each on its own prompts, so every run starts from caches that hold none of them.
    single = [complete(data_parallel.replicas[0], prompt) for prompt in shared_prefix_prompts(seed=1)]
    affinity = [complete(data_parallel.url, prompt) for prompt in shared_prefix_prompts(seed=2)]
    with RouterProcess(data_parallel.replicas, ["router.policy=round_robin"]) as router:
        round_robin = [complete(router.url, prompt) for prompt in shared_prefix_prompts(seed=3)]
        # The same prompts through either router: the same text as one replica gives (greedy, float32).
        repeated = [complete(router.url, prompt) for prompt in shared_prefix_prompts(seed=1)[:3]]
    assert [r["choices"][0]["text"] for r in repeated] == [r["choices"][0]["text"] for r in single[:3]]
    # 3 groups of 4: one engine misses each group's system prompt once; so does prefix_affinity (each group stays
    # on one replica); round_robin misses it once on each replica.
    assert hit_rate(affinity) >= hit_rate(single) - 0.05
    assert hit_rate(affinity) > hit_rate(round_robin) + 0.1
    routed_counts = [replica["routed"] for replica in httpx.get(f"{data_parallel.url}/health").json()["replicas"]]
    assert min(routed_counts) >= 3  # both replicas served


def test_aggregated_metrics_parse_and_add_up(data_parallel):
    complete(data_parallel.url, "A small test of the metrics.")
    merged = {
        sample.name: sample.value
        for family in text_string_to_metric_families(httpx.get(f"{data_parallel.url}/metrics").text)
        for sample in family.samples
        if not sample.labels
    }
    per_replica = [
        {
            sample.name: sample.value
            for family in text_string_to_metric_families(
                httpx.get(f"{data_parallel.url}/replicas/{index}/metrics").text
            )
            for sample in family.samples
            if not sample.labels
        }
        for index in range(2)
    ]
    for name in ("infer_prompt_tokens_total", "infer_generation_tokens_total", "infer_kv_blocks_total"):
        assert merged[name] == sum(replica[name] for replica in per_replica)


def test_a_killed_replica_is_taken_out_and_its_requests_fail_over(data_parallel):
    """Last in this module: it kills replica 0."""
    os.kill(process_serving(data_parallel.replicas[0]), signal.SIGKILL)
    results = [complete(data_parallel.url, prompt) for prompt in shared_prefix_prompts(seed=4, groups=2, questions=2)]
    assert len(results) == 4
    replicas = httpx.get(f"{data_parallel.url}/health").json()["replicas"]
    assert [replica["healthy"] for replica in replicas] == [False, True]
    up = {
        sample.labels["replica"]: sample.value
        for family in text_string_to_metric_families(httpx.get(f"{data_parallel.url}/metrics").text)
        for sample in family.samples
        if sample.name == "infer_router_replica_up"
    }
    assert up == {"0": 0.0, "1": 1.0}


def process_serving(url: str) -> int:
    """The pid of the replica started with ``--port`` of ``url`` (from /proc: Linux)."""
    port = url.rsplit(":", 1)[1]
    for entry in Path("/proc").iterdir():
        try:
            arguments = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"serve" in arguments and b"--port" in arguments and port.encode() in arguments:
            return int(entry.name)
    raise LookupError(f"no process serves {url}")
