"""``infer simulate``: the real engine loop and plugins on a cost model, its cost models, its workloads, and its use in
``infer ablate``."""

from __future__ import annotations

import json
import math
import random
import statistics

import pytest
from click.testing import CliRunner

from infer.bench.runner import run_workload
from infer.bench.workloads import WorkloadError, build_workload
from infer.cli import main
from infer.config import load_config
from infer.scheduler import FEATURE_NAMES, StepShape
from infer.simulate.cost import (
    CostModelError,
    MeasuredCost,
    RooflineCost,
    fit_measured,
    load_accelerator,
    load_geometry,
)
from infer.simulate.engine import SimulatedEngine

# A cost model with round numbers: 10 ms a step, 1 ms a prefill token, 2 ms a decode token.
ROUND_COEFFICIENTS = {name: 0.0 for name in FEATURE_NAMES} | {
    "step": 0.01,
    "prefill_token": 0.001,
    "decode_token": 0.002,
}


def round_cost(kv_pool_slots=100_000) -> MeasuredCost:
    return MeasuredCost(dict(ROUND_COEFFICIENTS), kv_pool_slots, kv_bytes_per_token=1)


def simulated(*overrides: str, cost=None) -> SimulatedEngine:
    return SimulatedEngine(load_config("baseline", ["model.max_model_len=512", *overrides]), cost=cost or round_cost())


def test_steps_cost_what_the_cost_model_says_and_outputs_have_their_lengths():
    engine = simulated()
    workload = build_workload("chat", engine.tokenizer, num_requests=6, min_output_len=3, output_len=9)
    result = run_workload(engine, workload)
    assert sorted(len(o.token_ids) for o in result.outputs) == sorted(r.params.max_tokens for r in workload.requests)
    assert {o.finish_reason for o in result.outputs} == {"length"}  # the workloads ignore EOS
    # All at once, 6 prompts in one prefill step, then decode steps of 6, 5, ... sequences.
    prompt_tokens = sum(len(o.prompt_token_ids) for o in result.outputs)
    assert result.outputs[0].metrics.first_token_time == pytest.approx(0.01 + 0.001 * prompt_tokens)
    steps = engine.stats.num_steps
    decode_tokens = sum(len(o.token_ids) for o in result.outputs) - 6
    assert result.wall_time_s == pytest.approx(0.01 * steps + 0.001 * prompt_tokens + 0.002 * decode_tokens)


def test_a_request_that_does_not_ignore_eos_stops_on_the_eos_the_length_model_puts_last():
    engine = simulated()
    engine.add_request(list(range(10, 30)), load_params(max_tokens=5))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    (output,) = outputs
    assert output.finish_reason == "stop" and len(output.token_ids) == 5
    assert output.token_ids[-1] in engine.eos_token_ids


def load_params(**fields):
    from infer.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, **fields)


def test_draft_acceptance_follows_the_configured_rate():
    engine = simulated("drafter.name=ngram", "drafter.num_speculative_tokens=4", "simulate.acceptance_rate=0.5")
    workload = build_workload("chat", engine.tokenizer, num_requests=8, min_output_len=100, output_len=100)
    summary = run_workload(engine, workload).summary
    # Accepted per pass with k=4 and rate 0.5: 1 + 0.5 + 0.25 + 0.125 + 0.0625 = 1.94 (the bonus token included).
    assert summary["spec_accepted_per_pass"] == pytest.approx(1.94, abs=0.15)
    assert summary["output_tokens"] == 800


def test_refusals_and_limits_are_the_real_engines():
    engine = simulated()
    from infer.engine.engine import RequestError

    with pytest.raises(RequestError, match="max_model_len"):
        engine.add_request(list(range(1, 600)), load_params(max_tokens=4))
    with pytest.raises(RequestError) as error:
        engine.add_request([1, 2, 3], load_params(max_tokens=4, constraint={"regex": "a+"}))
    assert error.value.field == "constraint"


@pytest.mark.parametrize("scheduler, prefix_cache", [("fcfs", "hash"), ("lpm", "radix")])
def test_scheduling_decisions_equal_a_real_runs(scheduler, prefix_cache):
    """Requests all sent at once: the schedule does not depend on time, so the simulated run makes the real run's
    decisions: the same steps, prefix hits and preemptions (a pool small enough to preempt)."""
    from infer.engine.engine import Engine

    overrides = [
        "model.dtype=float32",
        f"scheduler.name={scheduler}",
        f"prefix_cache.name={prefix_cache}",
        "cache.num_blocks=24",
        "cache.block_size=8",
        "scheduler.max_num_seqs=6",
    ]
    config = load_config("baseline", ["model.max_model_len=160", *overrides])
    real = Engine(config)
    options = dict(groups=2, questions=4, system_len=48, question_len=12, output_len=40)
    real_summary = run_workload(real, build_workload("shared-prefix", real.tokenizer, **options)).summary
    sim = SimulatedEngine(config, cost=round_cost())
    sim_summary = run_workload(sim, build_workload("shared-prefix", sim.tokenizer, **options)).summary
    assert real_summary["preemptions"] > 0, "the pool should force preemptions"
    for key in (
        "preemptions",
        "prefix_hit_rate",
        "prefill_tokens_computed",
        "output_tokens",
        "peak_running",
        "peak_kv_blocks",
    ):
        assert sim_summary[key] == real_summary[key], key
    assert sim.stats.num_steps == real.stats.num_steps


def test_fit_recovers_a_linear_cost_exactly():
    rng = random.Random(0)
    truth = {name: rng.uniform(1e-6, 1e-3) for name in FEATURE_NAMES}
    steps = []
    for _ in range(200):
        shape = StepShape(
            num_seqs=rng.randint(1, 64),
            num_prefill_tokens=rng.choice([0, rng.randint(1, 2048)]),
            num_decode_tokens=rng.randint(0, 64),
            num_logit_rows=rng.randint(1, 64),
            decode_context_tokens=rng.randint(0, 50_000),
            prefill_attention_pairs=rng.randint(0, 10**6),
            decode_context_blocks=rng.randint(0, 3000),
        )
        steps.append((shape, sum(truth[name] * x for name, x in zip(FEATURE_NAMES, shape.features()))))
    cost = fit_measured(steps, kv_pool_slots=1000, kv_bytes_per_token=64, engine={})
    for name in FEATURE_NAMES:
        assert cost.coefficients[name] == pytest.approx(truth[name], rel=1e-3), name
    assert cost.quality["median_abs_relative_error"] < 1e-4


def test_measured_cost_round_trips_through_its_file(tmp_path):
    cost = round_cost()
    cost.save(tmp_path / "cost.json")
    loaded = MeasuredCost.load(tmp_path / "cost.json")
    assert loaded.coefficients == cost.coefficients and loaded.kv_pool_slots == cost.kv_pool_slots
    with pytest.raises(CostModelError, match="--fit"):
        MeasuredCost.load(tmp_path / "missing.json")


def test_roofline_decode_is_weight_bandwidth_bound_and_prefill_compute_bound():
    h100, geometry = load_accelerator("h100"), load_geometry("llama-3-8b", "unused")
    cost = RooflineCost(h100, geometry)
    assert geometry.num_params == pytest.approx(7.5e9, rel=0.02)
    decode = StepShape(num_seqs=1, num_decode_tokens=1, num_logit_rows=1, decode_context_tokens=100)
    weights_s = geometry.num_params * 2 / (h100.memory_bandwidth * h100.bandwidth_efficiency)
    assert cost.step_time(decode) == pytest.approx(weights_s + h100.step_overhead_s, rel=0.01)
    prefill = StepShape(num_seqs=1, num_prefill_tokens=4096, num_logit_rows=1, prefill_attention_pairs=4096 * 2048)
    flops_s = 2 * 4096 * geometry.num_layers * geometry.params_per_layer / (h100.peak_flops * h100.flops_efficiency)
    assert cost.step_time(prefill) > flops_s > weights_s
    # 8 ranks: an eighth of the time plus two ring all-reduces a layer.
    tp8 = RooflineCost(h100, geometry, tensor_parallel_size=8)
    allreduce = (
        2
        * geometry.num_layers
        * (2 * 7 / 8 * 4096 * geometry.hidden_size * 2 / h100.link_bandwidth + h100.allreduce_latency_s)
    )
    assert tp8.allreduce_time(4096) == pytest.approx(allreduce)
    assert tp8.step_time(prefill) < cost.step_time(prefill)


def test_roofline_pool_and_its_errors():
    h100 = load_accelerator("h100")
    seventy = load_geometry("llama-3-70b", "unused")
    with pytest.raises(CostModelError, match="tensor_parallel_size"):
        RooflineCost(h100, seventy).kv_pool_tokens(16)
    tokens = RooflineCost(h100, seventy, tensor_parallel_size=8).kv_pool_tokens(16)
    assert 1_000_000 < tokens < 1_500_000  # (640 GB x 0.85 - 141 GB) / 320 KiB per token
    with pytest.raises(CostModelError, match="shipped ones are"):
        load_accelerator("h900")
    with pytest.raises(CostModelError, match="llama-3-8b"):
        load_geometry("llama-9", "unused")


def test_cli_simulates_on_a_roofline_and_explains_a_missing_fit(tmp_path):
    runner = CliRunner()
    result = runner.invoke(
        main,
        [
            "simulate",
            "baseline",
            "simulate.cost=roofline",
            "simulate.geometry=llama-3-8b",
            "--workload",
            "synthetic",
            "--num-requests",
            "200",
            "--rate",
            "50",
            "--num-priorities",
            "2",
            "--ttft-slo-s",
            "0.2",
            "--no-progress",
            "--json",
            str(tmp_path / "sim.json"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "simulated time" in result.output and "TTFT SLO met" in result.output
    data = json.loads((tmp_path / "sim.json").read_text())
    assert data["simulated"]["requests"] == 200 and data["simulated"]["simulated_requests_per_wall_s"] > 0
    missing = runner.invoke(main, ["simulate", "baseline", f"simulate.cost_file={tmp_path / 'none.json'}"])
    assert missing.exit_code == 2 and "--fit" in missing.output


# slow: 33 s on a 2-core AVX2 EPYC: fits on real steps of the default model
# (the default suite ran 17 min in a clean-clone .ci/run there)
@pytest.mark.slow
def test_fit_on_real_steps_then_simulate_with_it(tmp_path):
    from infer.cli.simulate import fit_cost_model

    config = load_config("baseline", ["model.max_model_len=512", f"simulate.cost_file={tmp_path / 'fit.json'}"])
    cost = fit_cost_model(
        config,
        show_progress=False,
        workloads=[
            ("chat", {"num_requests": 6, "min_output_len": 4, "output_len": 12, "seed": 1}),
            ("prefill", {"num_requests": 2, "input_len": 100, "seed": 2}),
        ],
    )
    assert cost.coefficients["step"] > 0 and cost.quality["num_steps"] >= len(FEATURE_NAMES)
    engine = SimulatedEngine(config)  # reads the file just written
    summary = run_workload(engine, build_workload("chat", engine.tokenizer, num_requests=4)).summary
    assert summary["output_tok_per_s"] > 0


# -- workloads --------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    return simulated().tokenizer


def test_synthetic_lengths_arrivals_and_fields(tokenizer):
    workload = build_workload(
        "synthetic",
        tokenizer,
        num_requests=2000,
        input_len=100,
        output_len=50,
        rate=10.0,
        num_tenants=3,
        num_priorities=3,
        ttft_slo_s=0.5,
        seed=3,
    )
    requests = workload.requests
    assert statistics.mean(len(r.prompt) for r in requests) == pytest.approx(100, rel=0.1)
    assert statistics.mean(r.params.max_tokens for r in requests) == pytest.approx(50, rel=0.1)
    assert {r.params.tenant for r in requests} == {"tenant-0", "tenant-1", "tenant-2"}
    assert {r.params.priority for r in requests} == {0, 1, 2}
    assert all(r.params.ttft_slo_s == pytest.approx(0.5 * (r.params.priority + 1)) for r in requests)
    assert requests[-1].arrival_s == pytest.approx(200, rel=0.15)  # 2000 requests at 10/s
    again = build_workload(
        "synthetic",
        tokenizer,
        num_requests=2000,
        input_len=100,
        output_len=50,
        rate=10.0,
        num_tenants=3,
        num_priorities=3,
        ttft_slo_s=0.5,
        seed=3,
    )
    assert [r.prompt for r in again.requests] == [r.prompt for r in requests]


def test_burstiness_is_the_gamma_shape_of_the_gaps(tokenizer):
    def gap_cv(burstiness):
        requests = build_workload(
            "synthetic", tokenizer, num_requests=3000, input_len=4, output_len=4, rate=5.0, burstiness=burstiness
        ).requests
        gaps = [b.arrival_s - a.arrival_s for a, b in zip(requests, requests[1:])]
        return statistics.pstdev(gaps) / statistics.mean(gaps)

    assert gap_cv(1.0) == pytest.approx(1.0, abs=0.1)
    assert gap_cv(0.25) == pytest.approx(2.0, abs=0.3)  # CV = 1 / sqrt(shape)
    with pytest.raises(WorkloadError, match="burstiness"):
        build_workload("synthetic", tokenizer, num_requests=3, rate=1.0, burstiness=0)


def test_multi_turn_prompts_extend_the_last_turn(tokenizer):
    requests = build_workload("multi-turn", tokenizer, num_sessions=3, turns=3, think_time_s=1.0).requests
    assert len(requests) == 9
    by_start: dict[tuple, list] = {}
    for request in requests:
        by_start.setdefault(tuple(request.prompt[:200]), []).append(request)
    for turns in by_start.values():
        turns.sort(key=lambda request: request.arrival_s)
        for earlier, later in zip(turns, turns[1:]):
            assert later.prompt[: len(earlier.prompt)] == earlier.prompt
            assert later.arrival_s == pytest.approx(earlier.arrival_s + 1.0)


def test_trace_replay_and_its_errors(tokenizer, tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "\n".join(
            json.dumps(line)
            for line in [
                {"arrival_s": 2.0, "prompt_len": 30, "output_len": 5, "priority": 1, "tenant": "a"},
                {"arrival_s": 0.5, "prompt": "Hello there", "output_len": 3, "ttft_slo_s": 0.2},
                {"arrival_s": 1.0, "prompt_token_ids": [5, 6, 7], "output_len": 2},
            ]
        )
        + "\n"
    )
    requests = build_workload("trace", tokenizer, trace_file=str(trace), time_scale=0.5).requests
    assert [r.arrival_s for r in requests] == [0.25, 0.5, 1.0]
    assert requests[0].prompt == "Hello there" and requests[1].prompt == [5, 6, 7] and len(requests[2].prompt) == 30
    assert requests[2].params.priority == 1 and requests[2].params.tenant == "a"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival_s": 0, "output_len": 3, "prompt_len": 3}\n{"arrival_s": 1, "output_len": 3}\n')
    with pytest.raises(WorkloadError, match="bad.jsonl:2: .*exactly one of prompt"):
        build_workload("trace", tokenizer, trace_file=str(bad))


# -- scheduling on the simulator ---------------------------------------------------------------------------------------
def ttft_by_priority(scheduler: str) -> dict[str, float]:
    engine = simulated(f"scheduler.name={scheduler}", "scheduler.max_num_seqs=8", cost=round_cost())
    workload = build_workload(
        "synthetic",
        engine.tokenizer,
        num_requests=300,
        input_len=40,
        output_len=20,
        max_len=500,
        rate=40.0,
        num_priorities=2,
        seed=5,
    )
    summary = run_workload(engine, workload).summary
    return {group: values["p50_s"] for group, values in summary["ttft_by_priority"].items()}


def test_priority_scheduler_serves_priority_zero_sooner_under_overload():
    fcfs, priority = ttft_by_priority("fcfs"), ttft_by_priority("priority")
    assert priority["0"] < 0.5 * priority["1"]
    assert math.isclose(fcfs["0"], fcfs["1"], rel_tol=0.5)


def test_ablation_runs_simulated_in_parallel_processes(tmp_path):
    ablation = tmp_path / "sim.yaml"
    ablation.write_text(
        "mode: simulate\n"
        "base: {config: baseline, overrides: {simulate.cost: roofline, simulate.geometry: llama-3-8b}}\n"
        "workload: {name: synthetic, num_requests: 100, rate: 100, num_systems: 4, system_len: 256}\n"
        "grid:\n  prefix_cache.name: [none, radix]\n  scheduler.name: [fcfs, hrrn]\n"
    )
    result = CliRunner().invoke(
        main, ["ablate", str(ablation), "--jobs", "2", "--no-progress", "--out", str(tmp_path / "out")]
    )
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    rows = {tuple(c["settings"].values()): c for c in data["combinations"]}
    assert len(rows) == 4 and all(c["error"] is None for c in rows.values())
    assert rows[("radix", "fcfs")]["median"]["prefix_hit_rate"] > 0.3
    assert rows[("none", "fcfs")]["median"]["prefix_hit_rate"] == 0
    assert "Simulated" in (tmp_path / "out" / "results.md").read_text()
