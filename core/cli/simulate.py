"""``infer simulate`` (loaded lazily by ``infer.cli``)."""

from __future__ import annotations

from pathlib import Path

import click

from infer.cli import CONFIG_HELP
from infer.cli.bench import command_line, config_and_workload, workload_from_flags

# The real runs a measured cost model is fitted on: decode at many batch sizes, long prefills, chunked prefill beside
# decodes, prefix hits. Their seeds differ from the workloads' defaults, so a validation run is out of sample.
FIT_WORKLOADS: list[tuple[str, dict]] = [
    ("chat", {"num_requests": 32, "output_len": 96, "seed": 101}),
    ("chat", {"num_requests": 8, "min_output_len": 16, "output_len": 48, "batch_size": 2, "seed": 102}),
    ("prefill", {"num_requests": 6, "input_len": 768, "seed": 103}),
    ("prefill", {"num_requests": 24, "input_len": 96, "seed": 104}),
    ("long-prompt", {"output_len": 64, "long_len": 1024, "long_arrival_s": 0.5, "seed": 105}),
    ("shared-prefix", {"groups": 2, "questions": 24, "output_len": 32, "seed": 106}),
]
FIT_PREFIX_CACHES = ("none", "hash")
# Run first and thrown away: the first steps of a fresh engine pay one-time costs (allocations, lazy imports).
WARMUP_WORKLOAD = ("chat", {"num_requests": 4, "min_output_len": 8, "output_len": 8, "seed": 100})


@click.command("simulate", epilog=CONFIG_HELP)
@config_and_workload("simulate")
@click.option(
    "--fit",
    is_flag=True,
    help="Fit the measured cost model instead: run real steps of CONFIG on this "
    "machine and write simulate.cost_file (default: the cache dir).",
)
@click.option(
    "--real",
    is_flag=True,
    help="Also run the workload for real and print both, with simulated/real ratios (the simulator's validation).",
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write the results here.")
@click.option("--no-progress", is_flag=True, help="Hide the progress bar.")
def simulate(
    config: str,
    overrides: tuple[str, ...],
    workload_name: str,
    fit: bool,
    real: bool,
    json_path: Path | None,
    no_progress: bool,
    **flags,
) -> None:
    """Run CONFIG's scheduler, allocator and prefix cache over a workload with the model replaced by a cost model
    (simulate.cost: measured or roofline); print what infer bench prints, in simulated time."""
    from infer.bench.report import environment, write_json
    from infer.bench.runner import simulate_workload
    from infer.config import load_config
    from infer.engine.metrics import format_summary
    from infer.simulate.cost import CostModelError, build_cost_model
    from infer.simulate.engine import SimulatedEngine

    resolved = load_config(config, list(overrides))
    if fit:
        fit_cost_model(resolved, show_progress=not no_progress)
        return
    try:
        engine = SimulatedEngine(resolved, cost=build_cost_model(resolved))
    except CostModelError as error:
        raise click.UsageError(str(error)) from error
    click.echo(engine.describe_execution(), err=True)
    click.echo(engine.pool_plan.describe(), err=True)
    workload = workload_from_flags(workload_name, engine.tokenizer, flags)
    summary = simulate_workload(engine, workload, show_progress=not no_progress)
    click.echo(format_summary(summary).replace("wall time", "simulated time", 1))
    click.echo(
        f"simulator: {summary['simulator_wall_s']:.2f} s of wall time for {summary['requests']} requests "
        f"({summary['simulated_requests_per_wall_s']:.0f} requests/s, "
        f"{summary['simulated_steps_per_wall_s']:.0f} steps/s)"
    )
    result = {
        "command": command_line(),
        **environment(),
        "config": resolved.to_dict(),
        "cost_model": engine.describe_execution(),
        "workload": {"name": workload_name, "options": workload.options},
        "simulated": summary,
    }
    if real:
        from infer.bench.runner import run_workload
        from infer.engine.engine import Engine

        click.echo("running the same workload for real ...", err=True)
        measured = run_workload(Engine(resolved), workload, show_progress=not no_progress).summary
        click.echo(format_comparison(summary, measured))
        result["real"] = measured
    if json_path is not None:
        write_json(json_path, result)
        click.echo(f"wrote {json_path}", err=True)


COMPARED = [
    ("output tok/s", "output_tok_per_s"),
    ("TTFT p50 (s)", "ttft_p50_s"),
    ("TTFT p99 (s)", "ttft_p99_s"),
    ("ITL p50 (s)", "itl_p50_s"),
    ("prefix hit rate", "prefix_hit_rate"),
    ("preemptions", "preemptions"),
    ("peak running", "peak_running"),
]


def format_comparison(simulated: dict, real: dict) -> str:
    """Simulated beside real, with their ratio."""
    lines = [f"{'metric':<18}{'simulated':>14}{'real':>14}{'sim/real':>10}"]
    for label, key in COMPARED:
        sim_value, real_value = simulated.get(key), real.get(key)
        if sim_value is None or real_value is None:
            continue
        ratio = f"{sim_value / real_value:.3f}" if real_value else "-"
        lines.append(f"{label:<18}{sim_value:>14.4g}{real_value:>14.4g}{ratio:>10}")
    return "\n".join(lines)


def fit_cost_model(
    config, show_progress: bool = True, workloads: list[tuple[str, dict]] | None = None, output: Path | None = None
):
    """Run ``workloads`` (default ``FIT_WORKLOADS``) for real on ``config``, fit ``MeasuredCost`` to every step and
    write it to ``output`` (default: ``simulate.cost_file``, else the cache dir's file for this config)."""
    from infer.bench.runner import run_workload
    from infer.bench.workloads import build_workload
    from infer.config import InferConfig
    from infer.engine.engine import Engine
    from infer.simulate.cost import default_cost_file, fit_measured

    # A step's cost depends on its shape, not on the plugins: the workloads run without a prefix cache and again
    # with one (``hash``), so that the steps include prefill chunks over cached context and decodes over shared
    # blocks as well as fresh prompts, whatever CONFIG caches.
    steps = []
    for cache in FIT_PREFIX_CACHES:
        engine = Engine(InferConfig.from_dict({**config.to_dict(), "prefix_cache": {"name": cache}}))
        name, options = WARMUP_WORKLOAD
        run_workload(engine, build_workload(name, engine.tokenizer, **options))
        engine.step_log = []
        for name, options in workloads or FIT_WORKLOADS:
            click.echo(f"fit: running {name} {options} with prefix_cache {cache} for real ...", err=True)
            run_workload(engine, build_workload(name, engine.tokenizer, **options), show_progress=show_progress)
        steps.extend(engine.step_log)
    plan = engine.pool_plan
    described = {
        "model": config.model.path,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "quantization": engine.quantization,
        "execution": engine.describe_execution(),
        "block_size": plan.block_size,
        "num_blocks": plan.num_blocks,
    }
    cost = fit_measured(steps, plan.usable_tokens, plan.bytes_per_token, described)
    path = output or (Path(config.simulate.cost_file) if config.simulate.cost_file else default_cost_file(config))
    cost.save(path)
    quality = cost.quality
    click.echo(
        f"fit {quality['num_steps']:.0f} steps: median |error| {quality['median_abs_relative_error']:.1%}, "
        f"p90 {quality['p90_abs_relative_error']:.1%}, total time {quality['total_time_relative_error']:+.1%}",
        err=True,
    )
    click.echo(cost.describe())
    click.echo(f"wrote {path}")
    return cost
