"""Tensor parallelism (``infer.distributed``) on gloo over loopback: the shard plans, the step's wire format, greedy
float32 output equal to HF transformers with the model split over two ranks (chunked prefill, preemption, a
prefix-cache hit and ngram drafting in one run), a rank started as a separate command (a second "host"), and a rank
killed mid-run (a clear error, no hang, the other ranks gone); mixtures of experts (Qwen3-MoE with dense and sparse
layers, gpt-oss, a batch one expert takes whole) split by expert columns, their logits on two ranks equal to one
rank's and their greedy output equal to HF's."""

from __future__ import annotations

import copy
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
from test_gpt_oss import GPT_OSS as GPT_OSS_FIELDS
from test_gpt_oss import save_gpt_oss

from infer import LLM, SamplingParams
from infer.distributed import TensorParallelError, pack_step, plan_shards, unpack_step
from infer.host import free_port
from infer.sequence import Sequence
from infer.testing import MoeConformance
from infer.testing.model import random_prompt, save_tiny_model

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


def test_expert_columns_split_evenly_in_whole_blocks_of_the_packed_layouts():
    def split(width: int, world_size: int) -> list[range]:
        plans = plan_shards(num_heads=8, num_kv_heads=8, intermediate_size=64, vocab_size=64, world_size=world_size)
        return [plan.expert_columns(width) for plan in plans]

    assert split(768, 2) == [range(0, 384), range(384, 768)]  # qwen3-moe-3.3b's and Qwen3-30B-A3B's experts
    assert split(2880, 2) == [range(0, 1440), range(1440, 2880)]  # gpt-oss's: 45 blocks of 32 each
    assert split(2880, 4) == [range(0, 736), range(736, 1472), range(1472, 2176), range(2176, 2880)]  # 23, 23, 22, 22
    assert split(32, 2) == [range(0, 16), range(16, 32)]  # one block of 32 cannot be split: blocks of 16
    assert split(6, 4) == [range(0, 2), range(2, 4), range(4, 5), range(5, 6)]  # no block size fits: columns


def test_a_sharded_mixture_keeps_every_expert_and_the_whole_router_and_adds_the_down_bias_once():
    from infer.model.moe import MoE
    from infer.model.sharding import shard_model
    from infer.plugins.models.gpt_oss import GptOssArchitecture

    config = GptOssModel.tiny_config()
    torch.manual_seed(0)
    whole = GptOssArchitecture.build(config)
    for parameter in whole.parameters():
        torch.nn.init.normal_(parameter)
    for plan in plan_shards(4, 2, 128, config.vocab_size, 2):
        shard = copy.deepcopy(whole)
        shard_model(shard, plan, group=None)
        for ours, theirs in zip(shard.layers, whole.layers, strict=True):
            assert isinstance(ours.mlp, MoE)
            assert torch.equal(ours.mlp.router.weight, theirs.mlp.router.weight)
            columns = plan.expert_columns(64)
            for mine, full in zip(ours.mlp.experts, theirs.mlp.experts, strict=True):
                gate, up = mine.gate_up_proj.weight.chunk(2)
                assert torch.equal(gate, full.gate_up_proj.weight[columns.start : columns.stop])
                assert torch.equal(up, full.gate_up_proj.weight[64 + columns.start : 64 + columns.stop])
                assert torch.equal(mine.down_proj.weight, full.down_proj.weight[:, columns.start : columns.stop])
                bias = full.down_proj.bias if plan.rank == 0 else torch.zeros_like(full.down_proj.bias)
                assert torch.equal(mine.down_proj.bias, bias)


@pytest.mark.parametrize("mode", ["bf16", "none"])
def test_a_rank_shards_and_packs_each_layer_as_it_is_read_into_the_shard_of_the_whole_load(tiny_model_dir, mode):
    """A rank's load keeps its share of each layer and packs it as soon as the layer is read (``layer_preparer``):
    the model is the one sharding and packing the whole float model after the load gives, weight for weight, and
    ``shard_model`` then shards only the output head."""
    from infer.distributed import model_shard_plans
    from infer.execution.paths import layer_preparer
    from infer.model.loader import load_model
    from infer.model.quantization import PackedLinear, quantize_model
    from infer.model.sharding import shard_layer, shard_model

    whole = load_model(tiny_model_dir, torch.float32)
    for plan in model_shard_plans(whole.hf_config, 2):
        expected = quantize_model(shard_model(copy.deepcopy(whole.model), plan, None), mode)
        shards: list[int] = []

        def keep_share(layer, plan=plan, shards=shards):
            shard_layer(layer, plan, None)
            shards.append(layer.self_attn.o_proj.in_features)

        streamed = load_model(tiny_model_dir, torch.float32, prepare_layer=layer_preparer(mode, keep_share)).model
        assert all(isinstance(layer.mlp.down_proj, PackedLinear) == (mode != "none") for layer in streamed.layers)
        streamed = quantize_model(shard_model(streamed, plan, None), mode)
        assert shards == [len(plan.q_heads) * whole.model.head_dim] * whole.model.num_layers
        modules = dict(expected.named_modules())
        for name, module in streamed.named_modules():
            if isinstance(module, PackedLinear):
                assert torch.equal(module.bf16_weight(), modules[name].bf16_weight()), name
        expected_parameters = dict(expected.named_parameters())
        for name, parameter in streamed.named_parameters():
            assert torch.equal(parameter, expected_parameters[name]), name


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


# -- mixture of experts -------------------------------------------------------------------------------------------
# Qwen3-MoE with a dense layer between two sparse ones, and gpt-oss (biases on the experts and the router, sinks, a
# clamp the activations reach); expert widths of 64, so each rank's 32 columns keep the packed layouts' shapes.
QWEN3_MOE = {
    "head_dim": 16,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "mlp_only_layers": [1],
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
}
GPT_OSS = {
    **GPT_OSS_FIELDS,
    "intermediate_size": 64,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "swiglu_limit": 2.0,
}


class Qwen3MoeModel(MoeConformance):  # the suite's helpers over a tiny model; its checks run in tests/test_moe.py
    impl_name = "qwen3_moe"
    hf_model_class = "Qwen3MoeForCausalLM"
    config_fields = QWEN3_MOE


class GptOssModel(MoeConformance):
    impl_name = "gpt_oss"
    hf_model_class = "GptOssForCausalLM"
    config_fields = GPT_OSS
    packed_tolerance = 1.0  # tests/test_gpt_oss.py's: bf16 through large biases and the clamps (0.44 measured here)


FAVOURITE = 3


def plant_favourite(model_dir: Path) -> Path:
    """Make every token's first choice expert ``FAVOURITE`` in every sparse layer: a large first feature in every
    embedding, read only by that expert's router row."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    tensors["model.embed_tokens.weight"][:, 0] = 8.0
    for name, weight in tensors.items():
        if name.endswith("mlp.gate.weight"):
            weight[:, 0] = 0.0
            weight[FAVOURITE] = 0.0
            weight[FAVOURITE, 0] = 10.0
        if name.endswith("post_attention_layernorm.weight"):
            weight[0] = weight[0].abs()
    save_file(tensors, path, metadata={"format": "pt"})
    return model_dir


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, tuple[type, Path]]:
    """Each tiny mixture's suite and saved folder: Qwen3-MoE, gpt-oss, and Qwen3-MoE whose favourite expert takes
    every token."""
    return {
        "qwen3_moe": (
            Qwen3MoeModel,
            save_tiny_model(
                Qwen3MoeModel.hf_model_class, Qwen3MoeModel.tiny_config(), tmp_path_factory.mktemp("qwen3_moe")
            ),
        ),
        "gpt_oss": (GptOssModel, save_gpt_oss(GptOssModel, tmp_path_factory.mktemp("gpt_oss"))),
        "favourite": (
            Qwen3MoeModel,
            plant_favourite(
                save_tiny_model(
                    Qwen3MoeModel.hf_model_class, Qwen3MoeModel.tiny_config(), tmp_path_factory.mktemp("favourite")
                )
            ),
        ),
    }


# (attention backend, weight packing): float32 on torch's ops and on the cpu backend with the kernels, and fp16
# weights, whose experts of up to KERNEL_MAX_TOKENS tokens run in the one C call
MOE_CASES = [("sdpa", None), ("cpu", None), ("cpu", "fp16")]


def load_moe(model_dir: Path, architecture: str, mode: str | None, plan=None):
    """infer's float32 model of ``model_dir``, sharded as ``plan`` says (over the process group this process
    joined), then packed as ``mode``."""
    from infer.distributed import TensorParallelGroup
    from infer.model.loader import load_model
    from infer.model.quantization import quantize_model
    from infer.model.sharding import shard_model

    model = load_model(str(model_dir), torch.float32, max_positions=256, architecture=architecture).model
    if plan is not None:
        shard_model(model, plan, TensorParallelGroup(plan))
    return model if mode is None else quantize_model(model, mode)


def mixed_batch_logits(model, backend: str, kernels: bool) -> torch.Tensor:
    """Every logit of a prefill of 80, 7 and 3 prompt tokens in one step (90 tokens: a favourite expert takes more
    than the C call does), then 6 decode steps of the three; ``[96 + 18, vocab]`` (empty on ranks other than 0)."""
    from infer.testing.model import PagedRunner, random_prompt

    runner = PagedRunner(model, backend, kernels=kernels)
    prompts = {"a": random_prompt(80, seed=1), "b": random_prompt(7, seed=2), "c": random_prompt(3, seed=3)}
    steps = [prompts] + [
        {name: random_prompt(1, seed=10 * step + index) for index, name in enumerate(prompts)} for step in range(6)
    ]
    logits = []
    for tokens in steps:
        logits.extend(runner.step(tokens).values())
    return torch.cat(logits)


def placeholder_logits(gather):
    """``compute_logits`` of a rank other than 0, which gets None from the gather: an empty ``[N, 0]`` instead, for
    ``PagedRunner`` to split."""

    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        assert gather(hidden) is None
        return torch.empty(hidden.shape[0], 0)

    return compute_logits


def _moe_rank(rank: int, port: int, models: list[tuple[str, Path, str]], errors) -> None:
    """One of two ranks: ``mixed_batch_logits`` of its shard of each of ``models`` (name, folder, family) in every
    ``MOE_CASES`` case; rank 0 puts on ``errors`` each one's largest difference from the whole model's logits."""
    import datetime

    import torch.distributed as dist
    from transformers import AutoConfig

    from infer.distributed import model_shard_plans
    from infer.model.moe import MoE
    from infer.testing.moe import record_routing, replay_routing

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120)
    )
    found = {}
    try:
        for name, model_dir, architecture in models:
            plan = model_shard_plans(AutoConfig.from_pretrained(model_dir), 2)[rank]
            for backend, mode in MOE_CASES:
                model = load_moe(model_dir, architecture, mode, plan)
                if rank != 0:
                    model.compute_logits = placeholder_logits(model.compute_logits)
                routings = record_routing(model)
                got = mixed_batch_logits(model, backend, kernels=backend == "cpu")
                if name == "favourite":
                    assert all((experts == FAVOURITE).any(dim=1).all() for experts in routings)
                if mode is not None:  # the experts of few tokens ran in the C call, on this rank's packed columns
                    assert all(layer.mlp.packed is not None for layer in model.layers if isinstance(layer.mlp, MoE))
                if rank == 0:
                    want = mixed_batch_logits(load_moe(model_dir, architecture, mode), backend, backend == "cpu")
                    found[(name, backend, mode)] = (got - want).abs().max().item()
                if (backend, mode) == ("cpu", None):
                    float32_routings, float32_want = routings, want if rank == 0 else None
            # bf16 experts on the tiles: rounding to 16 bits swaps near-tied routings, so (as MoeConformance does
            # against HF) the float32 shard's expert choices are replayed, and the logits held to the suite's packed
            # tolerance of one float32 rank's
            model = load_moe(model_dir, architecture, "bf16", plan)
            if rank != 0:
                model.compute_logits = placeholder_logits(model.compute_logits)
            replay_routing(model, float32_routings)
            got = mixed_batch_logits(model, "cpu", kernels=True)
            assert all(layer.mlp.packed is not None for layer in model.layers if isinstance(layer.mlp, MoE))
            if rank == 0:
                found[(name, "cpu", "bf16")] = (got - float32_want).abs().max().item()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        errors.put(found)


@pytest.fixture(scope="module")
def two_rank_errors(moe_dirs) -> dict[tuple[str, str, str | None], float]:
    """Two spawned ranks' logits against the whole model's for every model of ``moe_dirs`` and every
    ``MOE_CASES`` case (one pair of processes for all: starting one costs more than the tiny models' steps)."""
    import torch.multiprocessing as mp

    from infer.host import free_port
    from infer.kernels import cpu as cpu_kernels

    if cpu_kernels.load("auto") is None:
        pytest.skip("infer's CPU kernels do not build here")
    models = [(name, model_dir, suite.impl_name) for name, (suite, model_dir) in moe_dirs.items()]
    context = mp.get_context("spawn")
    errors = context.Queue()
    port = free_port()
    ranks = [context.Process(target=_moe_rank, args=(rank, port, models, errors)) for rank in (0, 1)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=300)
    assert [process.exitcode for process in ranks] == [0, 0]
    return errors.get(timeout=10)


@pytest.mark.parametrize(("backend", "mode"), MOE_CASES, ids=["sdpa", "cpu", "cpu-fp16"])
@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss", "favourite"])
def test_two_ranks_of_a_mixture_of_experts_give_one_rank_logits(two_rank_errors, moe_dirs, name, backend, mode):
    """Each expert's columns split over two ranks (every rank routing every token): the logits of a mixed batch equal
    one rank's within the suite's float32 tolerance, on torch's ops, on the cpu backend with the kernels, and with
    fp16 experts in the kernels' one C call (with the same packing on one rank)."""
    error = two_rank_errors[(name, backend, mode)]
    assert error < moe_dirs[name][0].tolerance, f"logits differ from one rank's by {error}"


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss", "favourite"])
def test_two_ranks_of_bf16_experts_on_the_tiles_stay_near_one_float32_rank(two_rank_errors, moe_dirs, name):
    error = two_rank_errors[(name, "cpu", "bf16")]
    assert error < moe_dirs[name][0].packed_tolerance, f"logits differ from one float32 rank's by {error}"


# gpt-oss's two-rank engine in the slow run: its logits are held to one rank's above in the default one
@pytest.mark.parametrize("name", ["qwen3_moe", pytest.param("gpt_oss", marks=pytest.mark.slow)])
def test_two_ranks_of_a_mixture_of_experts_match_hf_greedy(moe_dirs, name):
    import transformers

    suite, model_dir = moe_dirs[name]
    model = suite()
    reference = getattr(transformers, suite.hf_model_class).from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [random_prompt(length, seed=length) for length in (5, 23, 40)]
    with model.engine(model_dir, parallel__tensor_parallel_size=2, parallel__threads_per_rank=1) as llm:
        assert llm.engine.ranks.sharded
        model.assert_greedy_matches(llm, reference, prompts)
