"""Ablations: one base config, one workload, and a grid of settings; every combination runs in a fresh engine,
``repeats`` times, and reports the median and the spread (min to max) of each metric.

An ablation file (YAML)::

    base: baseline                        # a config path or shipped name, or {config: ..., overrides: {...}}
    workload: {name: shared-prefix, groups: 4, questions: 16}
    grid:
      prefix_cache.name: [none, hash, radix]
      scheduler.name: [fcfs, lpm]
      workload.batch_size: [1, 4]         # "workload." keys vary the workload instead of the config
    repeats: 1
    mode: real                            # or simulate: each combination runs in ``infer simulate``'s engine

A config path in ``base`` is looked up next to the ablation file first. ``mode: simulate`` (or ``infer ablate
--mode simulate``) runs the same grid on the cost model ``simulate.*`` of the config names; simulated combinations
may run in parallel processes (``--jobs``).
"""

from __future__ import annotations

import gc
import itertools
import statistics
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infer.llm import overrides_from_kwargs

WORKLOAD_PREFIX = "workload."
SHIPPED_ABLATIONS = "ablations"
MODES = ("real", "simulate")


class AblationError(ValueError):
    """The ablation file is malformed; the message names the file and the key."""


@dataclass(frozen=True, slots=True)
class Ablation:
    """A parsed ablation file (with any command-line overrides applied)."""

    name: str
    base_config: str
    base_overrides: list[str]
    workload: dict[str, Any]
    grid: dict[str, list[Any]]
    repeats: int = 1
    mode: str = "real"

    def combinations(self) -> list[dict[str, Any]]:
        """Every assignment of one value per grid key, in grid order (the last key varies fastest)."""
        keys = list(self.grid)
        return [dict(zip(keys, values)) for values in itertools.product(*self.grid.values())]

    def config_overrides(self, combination: dict[str, Any]) -> list[str]:
        settings = {key: value for key, value in combination.items() if not key.startswith(WORKLOAD_PREFIX)}
        return [*self.base_overrides, *overrides_from_kwargs(settings)]

    def workload_options(self, combination: dict[str, Any]) -> dict[str, Any]:
        varied = {
            key[len(WORKLOAD_PREFIX) :]: value for key, value in combination.items() if key.startswith(WORKLOAD_PREFIX)
        }
        return {**self.workload, **varied}


@dataclass(slots=True)
class CombinationResult:
    """One grid point: its settings, the summary of every successful repeat, and the error that stopped it."""

    settings: dict[str, Any]
    runs: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    traceback: str | None = None

    @property
    def label(self) -> str:
        return " / ".join(str(value) for value in self.settings.values())

    def aggregate(self, statistic: Callable[[list[float]], float]) -> dict[str, float | None]:
        """``statistic`` (median, min, max) of every numeric metric over the repeats; None where no run had it."""
        # A latency percentile is None in a run without data for it; it is still a metric.
        keys = dict.fromkeys(
            key for run in self.runs for key, value in run.items() if value is None or _is_number(value)
        )
        values = {key: [run[key] for run in self.runs if _is_number(run.get(key))] for key in keys}
        return {key: statistic(numbers) if numbers else None for key, numbers in values.items()}

    def to_dict(self) -> dict[str, Any]:
        return {
            "settings": self.settings,
            "label": self.label,
            "error": self.error,
            "traceback": self.traceback,
            "median": self.aggregate(statistics.median),
            "min": self.aggregate(min),
            "max": self.aggregate(max),
            "runs": self.runs,
        }


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def find_ablation_file(name: str) -> Path:
    """An existing path, else a shipped ablation (``memory`` or ``memory.yaml`` in ``infer.configs/ablations``)."""
    path = Path(name)
    if path.is_file():
        return path
    shipped = _shipped_folder() / f"{path.stem}.yaml"
    if shipped.is_file():
        return Path(str(shipped))
    raise AblationError(f"ablation file {name!r} not found (nor a shipped one: {', '.join(shipped_ablations())})")


def shipped_ablations() -> list[str]:
    """Names of the ablation files that ship with infer."""
    files = _shipped_folder().iterdir()
    return sorted(item.name.removesuffix(".yaml") for item in files if item.name.endswith(".yaml"))


def _shipped_folder():
    """The folder of shipped ablation files inside the installed package."""
    import importlib.resources

    return importlib.resources.files("infer.configs") / SHIPPED_ABLATIONS


def load_ablation(
    source: str, overrides: list[str] = (), repeats: int | None = None, mode: str | None = None
) -> Ablation:
    """Parse an ablation file; ``overrides`` (``key=value``) apply to the base config, or to the workload when the key
    starts with ``workload.``; ``repeats`` and ``mode`` replace the file's."""
    from omegaconf import OmegaConf

    path = find_ablation_file(source)
    data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if not isinstance(data, dict):
        raise AblationError(f"{path}: expected a mapping with base, workload and grid")
    unknown = sorted(set(data) - {"base", "workload", "grid", "repeats", "mode"})
    if unknown:
        raise AblationError(
            f"{path}: unknown key(s) {', '.join(unknown)}; expected base, workload, grid, repeats, mode"
        )
    mode = mode or data.get("mode", "real")
    if mode not in MODES:
        raise AblationError(f"{path}: mode must be one of {', '.join(MODES)}, got {mode!r}")
    base_config, base_overrides = _parse_base(path, data.get("base", "baseline"))
    workload = _parse_workload(path, data.get("workload"))
    config_overrides, workload_overrides = _split_overrides(overrides)
    return Ablation(
        name=path.stem,
        base_config=base_config,
        base_overrides=base_overrides + config_overrides,
        workload={**workload, **workload_overrides},
        grid=_parse_grid(path, data.get("grid")),
        repeats=repeats if repeats is not None else _parse_repeats(path, data.get("repeats", 1)),
        mode=mode,
    )


def _parse_base(path: Path, base: Any) -> tuple[str, list[str]]:
    if isinstance(base, str):
        return _resolve_config(path, base), []
    if not isinstance(base, dict) or "config" not in base or set(base) - {"config", "overrides"}:
        raise AblationError(f"{path}: base must be a config name/path, or {{config: ..., overrides: ...}}")
    overrides = base.get("overrides") or {}
    if isinstance(overrides, dict):
        overrides = overrides_from_kwargs(overrides)
    elif not isinstance(overrides, list):
        raise AblationError(f"{path}: base.overrides must be a mapping or a list of key=value strings")
    return _resolve_config(path, base["config"]), [str(item) for item in overrides]


def _resolve_config(path: Path, config: str) -> str:
    beside = path.parent / config
    return str(beside) if beside.is_file() else config


def _parse_workload(path: Path, workload: Any) -> dict[str, Any]:
    if not isinstance(workload, dict) or "name" not in workload:
        raise AblationError(f"{path}: workload must be a mapping with a name (and the workload's options)")
    return dict(workload)


def _parse_grid(path: Path, grid: Any) -> dict[str, list[Any]]:
    if not isinstance(grid, dict) or not grid:
        raise AblationError(f"{path}: grid must map config keys to lists of values")
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise AblationError(f"{path}: grid.{key} must be a non-empty list of values")
    return grid


def _parse_repeats(path: Path, repeats: Any) -> int:
    if not isinstance(repeats, int) or repeats < 1:
        raise AblationError(f"{path}: repeats must be a positive integer, got {repeats!r}")
    return repeats


def _split_overrides(overrides: list[str]) -> tuple[list[str], dict[str, Any]]:
    import yaml

    config_overrides, workload_overrides = [], {}
    for item in overrides:
        key, separator, value = item.partition("=")
        if not separator:
            raise AblationError(f"override {item!r} is not key=value")
        if key.startswith(WORKLOAD_PREFIX):
            workload_overrides[key[len(WORKLOAD_PREFIX) :]] = yaml.safe_load(value)
        else:
            config_overrides.append(item)
    return config_overrides, workload_overrides


def run_combination(ablation: Ablation, combination: dict[str, Any]) -> dict[str, Any]:
    """One fresh engine (simulated under ``mode: simulate``), one run of the workload; returns the run's summary
    (with device and dtype)."""
    from infer.bench.runner import run_workload
    from infer.bench.workloads import build_workload
    from infer.config import load_config

    options = ablation.workload_options(combination)
    config = load_config(ablation.base_config, ablation.config_overrides(combination))
    if ablation.mode == "simulate":
        from infer.bench.runner import simulate_workload
        from infer.simulate.engine import SimulatedEngine

        engine = SimulatedEngine(config)
        summary = simulate_workload(engine, build_workload(options.pop("name"), engine.tokenizer, **options))
        return {**summary, "device": "simulated", "dtype": config.model.dtype, "quantization": engine.quantization}
    from infer.engine.engine import Engine

    engine = Engine(config)
    workload = build_workload(options.pop("name"), engine.tokenizer, **options)
    summary = run_workload(engine, workload).summary
    return {
        **summary,
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "quantization": engine.quantization,
    }


def _release_memory() -> None:
    """Collect the finished engine (the drafter's back-reference makes a cycle) before the next one loads."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_ablation(ablation: Ablation, show_progress: bool = True, jobs: int = 1) -> list[CombinationResult]:
    """Every combination, each repeat in a fresh engine; a failing combination keeps its error and the rest run.
    ``jobs`` > 1 runs simulated combinations in that many processes (real ones always run one at a time: side by
    side they would time each other)."""
    from tqdm import tqdm

    combinations = ablation.combinations()
    results = [CombinationResult(settings) for settings in combinations]
    progress = tqdm(
        total=len(combinations) * ablation.repeats,
        desc=ablation.name,
        unit="run",
        disable=not show_progress,
        dynamic_ncols=True,
    )
    if jobs > 1 and ablation.mode == "simulate":
        with progress:
            _run_parallel(ablation, results, jobs, progress)
        return results
    # Repeat rounds go across the whole grid, so slow drift on a shared machine widens every combination's spread
    # instead of biasing whichever combination ran during it.
    with progress:
        for repeat, result in itertools.product(range(ablation.repeats), results):
            progress.set_postfix_str(f"{result.label} #{repeat + 1}")
            if result.error is None:
                _run_one(ablation, result)
            progress.update(1)
    return results


def _run_parallel(ablation: Ablation, results: list[CombinationResult], jobs: int, progress) -> None:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    # spawn: a forked child would inherit torch's thread pools mid-state.
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {
            pool.submit(_run_detached, ablation, result.settings): result
            for _, result in itertools.product(range(ablation.repeats), results)
        }
        for future in as_completed(futures):
            result = futures[future]
            run, error, trace = future.result()
            if run is not None:
                result.runs.append(run)
            elif result.error is None:
                result.error, result.traceback = error, trace
            progress.set_postfix_str(result.label)
            progress.update(1)


def _run_detached(ablation: Ablation, settings: dict[str, Any]) -> tuple[dict | None, str | None, str | None]:
    """``run_combination`` in a worker process: the summary, or the error and its traceback."""
    result = CombinationResult(settings)
    _run_one(ablation, result)
    return (result.runs[0] if result.runs else None), result.error, result.traceback


def _run_one(ablation: Ablation, result: CombinationResult) -> None:
    try:
        result.runs.append(run_combination(ablation, result.settings))
    except Exception as error:  # noqa: BLE001 - any failure is this combination's result, reported in the table
        result.error = f"{type(error).__name__}: {error}".splitlines()[0]
        result.traceback = traceback.format_exc()
    finally:
        _release_memory()
