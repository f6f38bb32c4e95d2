"""The ``infer`` command line.

Commands import their heavy modules (torch, the engine, the server) only when they run, so ``infer --help`` and
``infer plugins`` stay fast. Config and plugin errors print as one block without a traceback and exit with code 2;
``-v`` shows the traceback instead. Plugins add commands through the ``register_commands(cli)`` hook.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from infer import __version__
from infer.registry import KINDS, PluginError, PluginSpec, Registry, get_registry, import_object

# Commands whose modules other parts of infer provide, imported on use: name -> ("module:command", short help).
LAZY_COMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("infer.cli.bench:bench", "Measure throughput and latency of a config on a workload, beside HF or vLLM."),
    "ablate": ("infer.cli.bench:ablate", "Run a grid of configs (an ablation file) and compare them."),
    "simulate": (
        "infer.cli.simulate:simulate",
        "Run a config's scheduling and caching over a workload on a cost model (no model forward).",
    ),
    "serve": (
        "infer.serve.cli:serve",
        "Serve an OpenAI-compatible HTTP API (--data-parallel-size N: N replicas behind a router).",
    ),
    "router": ("infer.serve.cli:router_command", "Route OpenAI API requests over running infer serve replicas."),
    "tp-worker": ("infer.cli.tp_worker:tp_worker_command", "Run a tensor-parallel rank for an engine on another host."),
}
CONFIG_HELP = "CONFIG is a YAML file or a shipped config name (baseline); OVERRIDES are key=value (scheduler.name=lpm)."


class CliError(click.ClickException):
    """A usage or config problem: printed without a traceback, exit code 2."""

    exit_code = 2


class InferGroup(click.Group):
    """The top-level group: core commands, lazily imported commands, and commands added by plugins."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *LAZY_COMMANDS, *self._plugin_commands()})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.commands:
            return self.commands[name]
        if name in LAZY_COMMANDS:
            return _import_command(name, LAZY_COMMANDS[name][0])
        return self._plugin_commands().get(name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Lazy commands show their help from LAZY_COMMANDS, so --help imports none of them.
        names = [name for name in self.list_commands(ctx) if not self._is_hidden(ctx, name)]
        if not names:
            return
        limit = formatter.width - 6 - max(len(name) for name in names)
        with formatter.section("Commands"):
            formatter.write_dl([(name, self._short_help(ctx, name, limit)) for name in names])

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except Exception as error:
            if ctx.params.get("verbose") or not _is_user_error(error):
                raise
            raise CliError(_describe(error)) from error

    def _plugin_commands(self) -> dict[str, click.Command]:
        try:
            commands = get_registry().plugin_commands()
        except PluginError as error:
            raise CliError(str(error)) from error
        core = {*self.commands, *LAZY_COMMANDS}
        for name, plugin_command in commands.items():
            if name in core:
                raise CliError(
                    f'plugin command "{name}" from {plugin_command.distribution} shadows the core command '
                    f'"infer {name}"; the plugin must rename it'
                )
        return {name: plugin_command.command for name, plugin_command in commands.items()}

    def _is_hidden(self, ctx: click.Context, name: str) -> bool:
        return name not in LAZY_COMMANDS and getattr(self.get_command(ctx, name), "hidden", False)

    def _short_help(self, ctx: click.Context, name: str, limit: int) -> str:
        if name in LAZY_COMMANDS:
            return LAZY_COMMANDS[name][1]
        command = self.get_command(ctx, name)
        return command.get_short_help_str(limit) if command else ""


def _import_command(name: str, path: str) -> click.Command:
    try:
        return import_object(path)
    except ImportError as error:
        raise click.ClickException(f'"infer {name}" is not available in this installation: {error}') from error


# Errors that say what the user asked for cannot run, by module: a config problem, a model no installed family
# serves (or uses what its family lacks), an attention backend that cannot run the model here, a pool too small.
USER_ERRORS = {
    "infer.config": "ConfigError",
    "infer.model.architecture": "UnsupportedModelError",
    "infer.attention": "BackendUnavailableError",
    "infer.execution.kv_pool": "KVPoolTooSmallError",
}


def _is_user_error(error: Exception) -> bool:
    # Each class can only exist once its module is imported; importing them here would import torch.
    for module_name, class_name in USER_ERRORS.items():
        module = sys.modules.get(module_name)
        if module is not None and isinstance(error, getattr(module, class_name)):
            return True
    return isinstance(error, PluginError)


def _describe(error: Exception) -> str:
    lines = getattr(error, "errors", None)
    if not isinstance(lines, list) or not lines:
        return str(error)
    plural = "s" if len(lines) > 1 else ""
    return f"invalid config ({len(lines)} problem{plural}):\n" + "\n".join(f"  {line}" for line in lines)


@click.group(cls=InferGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Show full tracebacks for errors.")
@click.version_option(__version__, prog_name="infer")
def main(verbose: bool) -> None:
    """infer: an LLM inference engine, a small core with swappable plugins (allocators, prefix caches, schedulers,
    attention backends, drafters, guides) chosen by name in a YAML config."""


@main.command("run", epilog=CONFIG_HELP)
@click.argument("config")
@click.argument("overrides", nargs=-1)
@click.option(
    "--prompts", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="JSONL file, one request per line."
)
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path), help="Write results as JSONL here.")
@click.option(
    "--explain",
    is_flag=True,
    help="Log on stderr which execution path each forward pass took and why, and count them at the end.",
)
def run_cli(config: str, overrides: tuple[str, ...], prompts: Path | None, output: Path | None, explain: bool) -> None:
    """Generate completions offline for a batch of prompts."""
    from infer.cli.run import run_command

    run_command(config, list(overrides), prompts, output, explain)


@main.command("config", epilog=CONFIG_HELP)
@click.argument("config", required=False)
@click.argument("overrides", nargs=-1)
@click.option("--print", "print_config", is_flag=True, help="Print the resolved config with every default.")
@click.option("--schema", is_flag=True, help="Print the JSON Schema of configs, with every installed plugin's section.")
def config_cli(config: str | None, overrides: tuple[str, ...], print_config: bool, schema: bool) -> None:
    """Validate a config (every problem at once), print it resolved, or print its schema."""
    from infer.config import config_json_schema, load_config

    if schema:
        click.echo(json.dumps(config_json_schema(), indent=2))
        return
    if config is None:
        raise click.UsageError("missing CONFIG: a YAML file or a shipped config name such as baseline")
    resolved = load_config(config, overrides)
    if print_config:
        click.echo(resolved.to_yaml(), nl=False)
    else:
        click.echo(f"{config}: valid (--print shows it resolved)")


@main.group("plugins", invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.pass_context
def plugins_cli(ctx: click.Context, as_json: bool) -> None:
    """List the implementations of each plugin kind, the distribution that provides each and the plugin API version
    it is written to."""
    if ctx.invoked_subcommand is not None:
        return
    registry = get_registry()
    click.echo(json.dumps(plugins_listing(registry), indent=2) if as_json else format_plugins(registry))


@plugins_cli.command("check", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.argument("pytest_args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def check_cli(ctx: click.Context, pytest_args: tuple[str, ...]) -> None:
    """Run the conformance suites over every registered plugin (extra arguments go to pytest, e.g. -k allocator)."""
    try:
        import pytest
    except ImportError as error:
        raise click.ClickException(
            f"plugins check needs the testing extra (pip install 'infer[testing]'): {error}"
        ) from error
    ctx.exit(int(pytest.main(["--pyargs", "infer.testing.test_registered", *pytest_args])))


def plugins_listing(registry: Registry) -> dict[str, Any]:
    """Every registration and every plugin module that failed to load, as JSON-compatible data."""
    plugins = [
        {
            "kind": spec.kind,
            "name": spec.name,
            "distribution": spec.distribution,
            "version": spec.version,
            "plugin_api": spec.plugin_api,
            "description": spec.description,
            "target": _path_of(spec.target),
        }
        for kind in KINDS
        for spec in registry.specs(kind)
    ]
    failed = [
        {"plugin": b.plugin, "distribution": b.distribution, "version": b.version, "error": b.error}
        for b in registry.broken
    ]
    return {"plugins": plugins, "failed": failed}


def format_plugins(registry: Registry) -> str:
    """The ``infer plugins`` table: each kind, then one aligned row per implementation (its name, its distribution,
    the plugin API version it declares, its description)."""
    specs = [spec for kind in KINDS for spec in registry.specs(kind)]
    name_width = max((len(spec.name) for spec in specs), default=0)
    provider_width = max((len(_provider(spec)) for spec in specs), default=0)
    lines = []
    for kind in KINDS:
        lines.append(kind)
        lines.extend(
            f"  {spec.name:<{name_width}}  {_provider(spec):<{provider_width}}  API {spec.plugin_api}  "
            f"{spec.description}".rstrip()
            for spec in registry.specs(kind)
        )
        if not registry.names(kind):
            lines.append("  (none)")
    if registry.broken:
        lines.append("not loaded (failed to import or register):")
        lines.extend(f"  {b.plugin} ({b.distribution} {b.version}): {b.error}" for b in registry.broken)
    return "\n".join(lines)


def _provider(spec: PluginSpec) -> str:
    return f"{spec.distribution} {spec.version}"


def _path_of(target: type | str) -> str:
    return target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"
