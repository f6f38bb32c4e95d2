"""Tensor parallelism (``infer.distributed``) on gloo over loopback: the shard plans, the step's wire format, greedy
float32 output equal to HF transformers with the model split over two ranks (chunked prefill, preemption, a
prefix-cache hit and ngram drafting in one run), a rank started as a separate command (a second "host"), and a rank
killed mid-run (a clear error, no hang, the other ranks gone)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_engine_oracle import (
    CHATS,
    MAX_TOKENS,
    MODEL,
    SYSTEM,
    conversations,
    hf_greedy,
    hf_model,  # noqa: F401 (the module's fixture)
)

from infer import LLM, SamplingParams
from infer.distributed import TensorParallelError, pack_step, plan_shards, unpack_step
from infer.host import free_port
from infer.sequence import Sequence

BASE = {"model__path": MODEL, "model__dtype": "float32", "model__max_model_len": 512}


# -- shard plans --------------------------------------------------------------------------------------------------
def test_heads_split_by_kv_head_evenly_when_the_size_divides_them():
    plans = plan_shards(num_heads=32, num_kv_heads=8, intermediate_size=1000, vocab_size=101, world_size=4)
    assert [(p.q_heads, p.kv_heads) for p in plans] == [
        (range(8 * r, 8 * r + 8), range(2 * r, 2 * r + 2)) for r in range(4)
    ]
    assert [len(p.intermediate) for p in plans] == [250] * 4
    assert [p.vocab for p in plans] == [range(0, 26), range(26, 52), range(52, 78), range(78, 101)]
    assert {p.vocab_chunk for p in plans} == {26}


def test_an_uneven_split_keeps_gqa_groups_whole():
    # The default model: 9 query heads over 3 KV heads, on 2 ranks: 2 KV heads (6 query heads) and 1 (3).
    first, second = plan_shards(num_heads=9, num_kv_heads=3, intermediate_size=1536, vocab_size=49152, world_size=2)
    assert (first.q_heads, first.kv_heads) == (range(0, 6), range(0, 2))
    assert (second.q_heads, second.kv_heads) == (range(6, 9), range(2, 3))
    assert (first.intermediate, second.intermediate) == (range(0, 768), range(768, 1536))


def test_more_ranks_than_kv_heads_replicate_each_kv_head():
    plans = plan_shards(num_heads=8, num_kv_heads=2, intermediate_size=64, vocab_size=64, world_size=4)
    assert [p.kv_heads for p in plans] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert [p.q_heads for p in plans] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]


def test_a_split_that_cannot_keep_kv_heads_whole_is_refused_with_the_sizes_that_work():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 cannot split .* sizes that work: 1, 2, 3, 9"):
        plan_shards(num_heads=9, num_kv_heads=3, intermediate_size=64, vocab_size=64, world_size=4)


def test_a_step_plan_survives_the_wire():
    seqs = []
    for index, (computed, table) in enumerate([(0, [3, 4]), (17, [5, 6, 7]), (5, [])]):
        seq = Sequence(seq_id=f"s{index}", prompt_token_ids=list(range(40)), params=SamplingParams())
        seq.num_computed_tokens, seq.block_table = computed, table
        seqs.append(seq)
    scheduled = [(seqs[0], 20), (seqs[1], 1), (seqs[2], 0)]
    input_ids = torch.arange(100, 121)
    tables, computed, new, indices, tokens = unpack_step(pack_step(scheduled, input_ids, [19, 20]))
    assert tables == [[3, 4], [5, 6, 7], []] and computed == [0, 17, 5] and new == [20, 1, 0]
    assert indices == [19, 20] and tokens.tolist() == input_ids.tolist()


# -- real ranks ---------------------------------------------------------------------------------------------------
def test_a_drafter_that_runs_the_target_model_is_refused_before_any_rank_starts():
    with pytest.raises(ValueError, match="drafter 'eagle' cannot run with parallel.tensor_parallel_size=2"):
        LLM("baseline", drafter__name="eagle", parallel__tensor_parallel_size=2, **BASE)


def test_two_ranks_match_hf_greedy_with_chunked_prefill_preemption_prefix_hits_and_ngram(hf_model):  # noqa: F811
    chats = conversations(CHATS[:5], system=SYSTEM)
    references = hf_greedy(hf_model, chats)
    # 5 prompts of ~160 tokens, 9 blocks of 16 of them the shared system prompt (hash hits), in 16 blocks:
    # preemption; a budget of 96 tokens: prefill in chunks; ngram drafts: verification steps of several tokens.
    settings = {
        **BASE,
        "model__max_model_len": 256,
        "parallel__tensor_parallel_size": 2,
        "cache__num_blocks": 17,
        "prefix_cache__name": "hash",
        "scheduler__max_num_batched_tokens": 96,
        "drafter__name": "ngram",
        "drafter__num_speculative_tokens": 3,
    }
    with LLM("baseline", **settings) as llm:
        outputs = llm.generate(chats, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
        stats = llm.engine.stats
        assert [list(o.outputs[0].token_ids) for o in outputs] == references
        assert stats.num_preemptions > 0 and stats.num_cached_prompt_tokens > 0 and stats.num_draft_tokens > 0
        assert llm.engine.executor.counts["fused-stack"] == llm.engine.executor.counts["fused-layers"] == 0
        parallel = llm.engine.ranks
        assert parallel.group.num_all_reduces == 2 * llm.engine.model.num_layers * parallel_forwards(llm.engine)
        assert len(llm.engine.pool_plan.rank_bytes_per_token) == 2
        processes = list(parallel.processes.values())
    assert all(process.exitcode == 0 for process in processes)  # close() stopped rank 1 cleanly


def parallel_forwards(engine) -> int:
    return sum(engine.executor.counts.values())


# slow: 31 s on a 2-core AVX2 EPYC: a second process loads the model
# (the default suite ran 17 min in a clean-clone .ci/run there)
@pytest.mark.slow
def test_a_rank_started_as_its_own_command_joins_over_loopback(tmp_path, hf_model):  # noqa: F811
    """Two "hosts" on one machine: rank 0 starts no process (local_ranks 1) and rank 1 runs `infer tp-worker`; with
    the sdpa backend (each rank's backend sees its own heads), equal to HF."""
    port = free_port()
    overrides = [
        "model.dtype=float32",
        "model.max_model_len=512",
        "parallel.tensor_parallel_size=2",
        f"parallel.master_port={port}",
        "parallel.threads_per_rank=1",
        "attention.name=sdpa",
        "parallel.timeout_s=120",
    ]
    infer = Path(sys.executable).with_name("infer")  # the console script, installed beside this interpreter
    log = tmp_path / "rank1.log"
    with open(log, "wb") as output:
        worker = subprocess.Popen(
            [str(infer), "tp-worker", "baseline", *overrides, "--rank", "1"], stdout=output, stderr=subprocess.STDOUT
        )
    try:
        chats = conversations(CHATS[:2])
        with LLM("baseline", dotlist=[*overrides, "parallel.local_ranks=1"]) as llm:
            assert llm.engine.ranks.processes == {}
            outputs = llm.generate(chats, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
        assert worker.wait(timeout=60) == 0, log.read_text()[-2000:]
    finally:
        if worker.poll() is None:
            worker.kill()
    assert [list(o.outputs[0].token_ids) for o in outputs] == hf_greedy(hf_model, chats)


def test_a_rank_killed_mid_run_fails_the_engine_clearly_and_the_others_exit():
    llm = LLM("baseline", parallel__tensor_parallel_size=3, cache__num_blocks=64, **BASE)
    engine = llm.engine
    processes = engine.ranks.processes
    engine.add_request("Once upon a time", SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    for _ in range(5):
        engine.step()
    os.kill(processes[2].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rank 2 \(pid \d+\) was killed by signal 9 \(SIGKILL\)"):
        for _ in range(100):
            engine.step()
    assert time.monotonic() - start < 30
    assert all(process.exitcode is not None for process in processes.values())  # rank 1 is gone too
    with pytest.raises(TensorParallelError):  # and the engine refuses further steps
        engine.step()
    engine.close()
