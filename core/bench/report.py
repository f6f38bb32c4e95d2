"""Reports: the ``infer bench`` table and JSON, and an ablation's CSV, JSON, markdown table and PNG plots."""

from __future__ import annotations

import csv
import json
import math
import os
import platform
import statistics
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from infer.bench.ablate import Ablation, CombinationResult
from infer.engine.metrics import format_summary


@dataclass(frozen=True, slots=True)
class Metric:
    """A summary field worth a column and a plot: its key, a label, and how to print one value."""

    key: str
    label: str
    kind: str  # "rate", "ms", "count", "percent", "ratio"
    zero_means_unmeasured: bool = False  # e.g. acceptance length without speculative decoding

    def is_missing(self, value: float | None) -> bool:
        return value is None or math.isnan(value) or (self.zero_means_unmeasured and value == 0)

    def format(self, value: float | None) -> str:
        if self.is_missing(value):
            return "-"
        if self.kind == "ms":
            return f"{value * 1000:.1f}"
        if self.kind == "percent":
            return f"{value:.1%}"
        if self.kind == "count":
            return f"{value:.0f}" if float(value).is_integer() else f"{value:.1f}"
        return f"{value:.2f}"


KEY_METRICS = [
    Metric("output_tok_per_s", "output tok/s", "rate"),
    Metric("requests_per_s", "requests/s", "rate"),
    Metric("ttft_p50_s", "TTFT p50 (ms)", "ms"),
    Metric("ttft_p99_s", "TTFT p99 (ms)", "ms"),
    Metric("tpot_p50_s", "TPOT p50 (ms)", "ms"),
    Metric("tpot_p99_s", "TPOT p99 (ms)", "ms"),
    Metric("itl_p50_s", "ITL p50 (ms)", "ms"),
    Metric("itl_p99_s", "ITL p99 (ms)", "ms"),
    Metric("prefill_tokens_computed", "prefill tokens computed", "count"),
    Metric("prefix_hit_rate", "prefix hit rate", "percent"),
    Metric("kv_utilization", "KV utilization", "percent"),
    Metric("peak_kv_blocks", "peak KV blocks", "count"),
    Metric("peak_running", "peak running", "count"),
    Metric("mean_running", "mean running", "ratio"),
    Metric("preemptions", "preemptions", "count"),
    Metric("spec_accepted_per_pass", "spec tokens/pass", "ratio", zero_means_unmeasured=True),
    Metric("ttft_slo_attainment", "TTFT SLO met", "percent"),
]


def environment() -> dict[str, Any]:
    """Where and when numbers were measured (they mean little without it)."""
    import torch

    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


# -- infer bench -------------------------------------------------------------------------------------------------
def format_bench(
    workload_name: str, summary: dict, baseline: dict | None, vllm: dict | None = None, llamacpp: dict | None = None
) -> str:
    """The bench table: the engine's summary, then the HF baseline (``baseline``), vLLM's (``vllm``) and llama.cpp's
    server's (``llamacpp``) with the throughput ratios, when there are any."""
    batch = summary.get("batch_size")
    lines = [
        f"workload {workload_name}" + (f", at most {batch} in flight" if batch else ""),
        "",
        format_summary(summary),
    ]
    if baseline is not None:
        lines += [
            "",
            f"HF transformers generate (static batches of {baseline['batch_size']}, "
            f"{baseline.get('dtype', '?')}, greedy):",
            f"  output tok/s            {baseline['output_tok_per_s']:.1f}",
            f"  prompt tok/s            {baseline.get('prompt_tok_per_s', 0.0):.1f}",
            f"  requests/s              {baseline['requests_per_s']:.2f}",
            f"  wall time               {baseline['wall_time_s']:.2f} s",
            f"  tokens generated/output {baseline['generated_tokens']} / {baseline['output_tokens']}",
            f"infer / HF output tok/s   {throughput_ratio(summary, baseline):.2f}x",
        ]
    if vllm is not None:
        lines += [
            "",
            f"vLLM {vllm['version']} CPU backend (LLM.generate, {vllm['dtype']}, greedy):",
            f"  output tok/s            {vllm['output_tok_per_s']:.1f}",
            f"  prompt tok/s            {vllm['prompt_tok_per_s']:.1f}",
            f"  requests/s              {vllm['requests_per_s']:.2f}",
            f"  wall time               {vllm['wall_time_s']:.2f} s",
            f"  output tokens           {vllm['output_tokens']}",
            f"  same tokens as infer    {vllm['greedy_agreement']:.0%} of requests",
            f"infer / vLLM output tok/s {throughput_ratio(summary, vllm):.2f}x",
        ]
    if llamacpp is not None:
        lines += [
            "",
            f"llama.cpp llama-server {llamacpp['version']} ({llamacpp['slots']} slots, {llamacpp['threads']} threads, "
            "the same GGUF file, greedy):",
            f"  output tok/s            {llamacpp['output_tok_per_s']:.1f}",
            f"  prompt tok/s            {llamacpp['prompt_tok_per_s']:.1f}",
            f"  requests/s              {llamacpp['requests_per_s']:.2f}",
            f"  wall time               {llamacpp['wall_time_s']:.2f} s",
            f"  TTFT p50 / p99          {_ms(llamacpp['ttft_p50_s'])} / {_ms(llamacpp['ttft_p99_s'])}",
            f"  TPOT p50 / p99          {_ms(llamacpp['tpot_p50_s'])} / {_ms(llamacpp['tpot_p99_s'])}",
            f"  output tokens           {llamacpp['output_tokens']}",
            f"  same tokens as infer    {llamacpp['greedy_agreement']:.0%} of requests",
            f"infer / llama.cpp output tok/s {throughput_ratio(summary, llamacpp):.2f}x",
        ]
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"


def throughput_ratio(summary: dict, baseline: dict) -> float:
    """infer output tok/s divided by a baseline's."""
    hf = baseline["output_tok_per_s"]
    return summary["output_tok_per_s"] / hf if hf else math.inf


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


# -- infer ablate ------------------------------------------------------------------------------------------------
def write_ablation_report(
    ablation: Ablation, results: list[CombinationResult], out_dir: Path, command: str
) -> list[Path]:
    """``results.json``, ``results.csv``, ``results.md`` and one PNG per key metric under ``out_dir``; returns the
    paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    header = {"ablation": ablation.name, "command": command, **environment()}
    json_path = out_dir / "results.json"
    write_json(
        json_path,
        {
            **header,
            "base": {"config": ablation.base_config, "overrides": ablation.base_overrides},
            "workload": ablation.workload,
            "grid": ablation.grid,
            "repeats": ablation.repeats,
            "combinations": [result.to_dict() for result in results],
        },
    )
    csv_path = write_csv(out_dir / "results.csv", ablation, results)
    markdown_path = out_dir / "results.md"
    markdown_path.write_text(markdown_report(ablation, results, header) + "\n")
    return [json_path, csv_path, markdown_path, *write_plots(out_dir / "plots", results, list(ablation.grid))]


def write_csv(path: Path, ablation: Ablation, results: list[CombinationResult]) -> Path:
    """One row per combination: its settings, status, then every numeric metric's median, min and max."""
    metric_keys = _numeric_keys(results)
    columns = [
        *ablation.grid,
        "error",
        "repeats_ok",
        *[f"{key}{suffix}" for key in metric_keys for suffix in ("", "_min", "_max")],
    ]
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        for result in results:
            row: dict[str, Any] = {**result.settings, "error": result.error or "", "repeats_ok": len(result.runs)}
            for suffix, values in _aggregates(result).items():
                row.update({f"{key}{suffix}": values.get(key) for key in metric_keys})
            writer.writerow(row)
    return path


def _numeric_keys(results: list[CombinationResult]) -> list[str]:
    keys: dict[str, None] = {}
    for result in results:
        keys.update(dict.fromkeys(result.aggregate(statistics.median)))
    return list(keys)


def _aggregates(result: CombinationResult) -> dict[str, dict[str, float | None]]:
    return {"": result.aggregate(statistics.median), "_min": result.aggregate(min), "_max": result.aggregate(max)}


def markdown_report(ablation: Ablation, results: list[CombinationResult], header: dict[str, Any]) -> str:
    """A heading with the command, date and machine, then one table row per combination: the median, with the
    min-max spread in brackets when there were repeats; a failed combination shows its error."""
    machine = f"{header['cpu_count']} CPUs ({header['machine']}, {header['torch_threads']} torch threads)" + (
        f", {header['cuda']}" if header["cuda"] else ""
    )
    dtypes = sorted({run.get("dtype", "?") for result in results for run in result.runs})
    workload = ", ".join(f"{key}={value}" for key, value in ablation.workload.items())
    lines = [
        f"### Ablation `{ablation.name}`",
        "",
        f"`{header['command']}` on {header['date']}, {machine}, torch {header['torch']}, "
        f"dtype {'/'.join(dtypes) or '-'}; workload {workload}; median of {ablation.repeats} run(s)"
        + (" [min-max]" if ablation.repeats > 1 else "")
        + "."
        + (
            " Simulated (`infer simulate`): times are the cost model's, not this machine's."
            if ablation.mode == "simulate"
            else ""
        ),
        "",
    ]
    columns = [*ablation.grid, *[metric.label for metric in KEY_METRICS], "error"]
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_markdown_row(result)) + " |" for result in results]
    return "\n".join(lines)


def _markdown_row(result: CombinationResult) -> list[str]:
    medians, lows, highs = (result.aggregate(statistic) for statistic in (statistics.median, min, max))
    cells = [str(value) for value in result.settings.values()]
    for metric in KEY_METRICS:
        cell = metric.format(medians.get(metric.key))
        if len(result.runs) > 1 and not metric.is_missing(medians.get(metric.key)):
            cell += f" [{metric.format(lows[metric.key])}-{metric.format(highs[metric.key])}]"
        cells.append(cell)
    cells.append((result.error or "").replace("|", "\\|"))
    return cells


def write_plots(plot_dir: Path, results: list[CombinationResult], grid_keys: list[str]) -> list[Path]:
    """A bar chart per key metric (median, min-max error bars), skipping metrics no combination measured above 0."""
    plot_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for metric in KEY_METRICS:
        medians = [result.aggregate(statistics.median).get(metric.key) for result in results]
        if any(value for value in medians):
            paths.append(plot_metric(plot_dir / f"{metric.key}.png", metric, results, " / ".join(grid_keys)))
    return paths


def plot_metric(path: Path, metric: Metric, results: list[CombinationResult], x_label: str) -> Path:
    # A bare Figure renders with Agg and leaves pyplot's global backend alone.
    from matplotlib.figure import Figure

    scale = 1000 if metric.kind == "ms" else 100 if metric.kind == "percent" else 1
    medians, lows, highs = (
        [_scaled(result.aggregate(statistic).get(metric.key), scale) for result in results]
        for statistic in (statistics.median, min, max)
    )
    figure = Figure(figsize=(max(4.0, 0.6 * len(results) + 2), 3.6), layout="constrained")
    axes = figure.subplots()
    positions = range(len(results))
    heights = [value if value is not None else 0.0 for value in medians]
    repeated = any(len(result.runs) > 1 for result in results)
    axes.bar(positions, heights, yerr=_spread(heights, lows, highs) if repeated else None, capsize=3, color="tab:blue")
    for position, result in zip(positions, results):
        if result.error is not None:
            axes.text(position, 0, "failed", rotation=90, ha="center", va="bottom", color="tab:red")
    axes.set_xticks(
        list(positions),
        [result.label for result in results],
        rotation=45 if len(results) > 4 else 0,
        ha="right" if len(results) > 4 else "center",
    )
    axes.set_title(metric.label.replace("(ms)", "").strip())
    axes.set_xlabel(x_label)
    axes.set_ylabel({"ms": "ms", "percent": "%"}.get(metric.kind, metric.label))
    figure.savefig(path, dpi=110)
    return path


def _spread(heights: list[float], lows: list[float | None], highs: list[float | None]) -> list[list[float]]:
    """Error bars from each median down to the min and up to the max (none where a combination has no value)."""
    return [
        [height - (low if low is not None else height) for height, low in zip(heights, lows)],
        [(high if high is not None else height) - height for height, high in zip(heights, highs)],
    ]


def _scaled(value: float | None, scale: float) -> float | None:
    return None if value is None else value * scale
