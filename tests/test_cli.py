"""The ``infer`` command line, driven through click's CliRunner over a registry of stand-in plugins."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import types
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from omegaconf import OmegaConf

import infer.cli
import infer.config
from infer import hookimpl
from infer.allocator import Allocator
from infer.attention import AttentionBackend
from infer.cli import main
from infer.config import ConfigError
from infer.drafter import Drafter
from infer.guide import Guide
from infer.prefix_cache import PrefixCache
from infer.registry import Distribution, Registry
from infer.scheduler import BudgetedScheduler

FAKE = Distribution("infer-fake", "1.0")


class AllocatorStub(Allocator):
    pass


class PrefixCacheStub(PrefixCache):
    pass


class SchedulerStub(BudgetedScheduler):
    pass


class AttentionStub(AttentionBackend):
    pass


class DrafterStub(Drafter):
    pass


class GuideStub(Guide):
    pass


class BuiltinsStub:
    @hookimpl
    def register_allocators(self, register):
        register("paged", AllocatorStub, description="stand-in allocator")

    @hookimpl
    def register_prefix_caches(self, register):
        register("none", PrefixCacheStub)

    @hookimpl
    def register_schedulers(self, register):
        register("fcfs", SchedulerStub)

    @hookimpl
    def register_attention_backends(self, register):
        register("sdpa", AttentionStub)

    @hookimpl
    def register_drafters(self, register):
        register("none", DrafterStub)

    @hookimpl
    def register_guides(self, register):
        register("none", GuideStub)


class HelloCommand:
    @hookimpl
    def register_commands(self, cli):
        @cli.command()
        def hello():
            """Say hello from a plugin."""
            click.echo("hello from a plugin")


class ShadowingCommand:
    @hookimpl
    def register_commands(self, cli):
        cli.add_command(click.Command("run", callback=lambda: None))


def use_registry(monkeypatch, *plugins) -> Registry:
    registry = Registry.from_plugins([(BuiltinsStub(), FAKE), *plugins])
    monkeypatch.setattr(infer.cli, "get_registry", lambda load=None: registry)
    monkeypatch.setattr(infer.config, "get_registry", lambda load=None: registry)
    return registry


@pytest.fixture
def runner(monkeypatch):
    use_registry(monkeypatch)
    return CliRunner()


def test_config_print_shows_the_resolved_config_with_overrides(runner):
    result = runner.invoke(main, ["config", "baseline", "scheduler.max_num_seqs=8", "--print"])
    assert result.exit_code == 0, result.output
    printed = OmegaConf.to_container(OmegaConf.create(result.output))
    assert printed["scheduler"] == {
        "name": "fcfs",
        "max_num_seqs": 8,
        "max_num_batched_tokens": 2048,
        "preemption": "newest",
    }
    assert printed["model"]["path"] == "smollm2-135m-instruct"


def test_config_without_print_only_validates(runner):
    result = runner.invoke(main, ["config", "baseline"])
    assert (result.exit_code, result.output) == (0, "baseline: valid (--print shows it resolved)\n")


def test_config_errors_print_as_one_block_with_exit_code_2(runner):
    result = runner.invoke(main, ["config", "baseline", "scheduler.max_num_seq=8", "model.max_model_len=abc"])
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    assert result.output.startswith("Error: invalid config (2 problems):\n")
    assert '  scheduler.max_num_seq: unknown key; did you mean "max_num_seqs"?\n' in result.output
    assert "  model.max_model_len: Input should be a valid integer (got 'abc')\n" in result.output


def test_unknown_plugin_name_exits_with_code_2(runner):
    result = runner.invoke(main, ["config", "baseline", "scheduler.name=fcsf"])
    assert result.exit_code == 2
    assert 'unknown scheduler "fcsf"; did you mean "fcfs"? available: fcfs' in result.output


def test_verbose_lets_the_original_error_through(runner):
    result = runner.invoke(main, ["-v", "config", "baseline", "scheduler.max_num_seq=8"])
    assert isinstance(result.exception, ConfigError)


def test_config_needs_a_config_unless_printing_the_schema(runner):
    assert runner.invoke(main, ["config"]).exit_code == 2
    result = runner.invoke(main, ["config", "--schema"])
    assert result.exit_code == 0, result.output
    assert "scheduler" in json.loads(result.output)["properties"]


def test_plugins_lists_each_kind_with_provider_and_description(runner):
    result = runner.invoke(main, ["plugins"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == "allocator"
    assert lines[1] == "  paged  infer-fake 1.0  API 1  stand-in allocator"
    assert {"prefix_cache", "scheduler", "attention", "drafter", "guide"} <= set(lines)


def test_plugins_json_lists_every_registration(runner):
    result = runner.invoke(main, ["plugins", "--json"])
    listing = json.loads(result.output)
    assert {(p["kind"], p["name"]) for p in listing["plugins"]} == {
        ("allocator", "paged"),
        ("prefix_cache", "none"),
        ("scheduler", "fcfs"),
        ("attention", "sdpa"),
        ("drafter", "none"),
        ("guide", "none"),
    }
    assert listing["plugins"][0]["target"] == f"{__name__}:AllocatorStub"
    assert listing["plugins"][0]["plugin_api"] == 1
    assert listing["failed"] == []


def test_plugins_shows_modules_that_failed_to_load(monkeypatch):
    class Broken:
        @hookimpl
        def register_schedulers(self, register):
            raise ImportError("needs triton")

    with pytest.warns(UserWarning, match="needs triton"):
        use_registry(monkeypatch, Broken())
    output = CliRunner().invoke(main, ["plugins"]).output
    assert "not loaded (failed to import or register):\n  local:Broken (local 0): ImportError: needs triton" in output


def test_plugins_check_runs_the_conformance_sweep_with_extra_pytest_args(runner, monkeypatch):
    calls = []
    monkeypatch.setattr(pytest, "main", lambda args: calls.append(args) or 5)
    result = runner.invoke(main, ["plugins", "check", "-k", "allocator", "-x"])
    assert calls == [["--pyargs", "infer.testing.test_registered", "-k", "allocator", "-x"]]
    assert result.exit_code == 5


def test_run_routes_its_arguments_to_run_command(runner, monkeypatch, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    calls = []
    fake_run = types.SimpleNamespace(run_command=lambda *args: calls.append(args))
    monkeypatch.setitem(sys.modules, "infer.cli.run", fake_run)
    result = runner.invoke(
        main,
        [
            "run",
            "baseline",
            "model.seed=1",
            "--prompts",
            str(prompts),
            "--output",
            str(tmp_path / "out.jsonl"),
            "--explain",
        ],
    )
    assert result.exit_code == 0, result.output
    assert calls == [("baseline", ["model.seed=1"], prompts, tmp_path / "out.jsonl", True)]


def test_serve_routes_its_arguments_to_serve_command(runner, monkeypatch):
    calls = []
    monkeypatch.setattr("infer.serve.cli.serve_command", lambda *args: calls.append(args))
    result = runner.invoke(main, ["serve", "baseline", "--port", "9000", "--api-key", "secret"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(main, ["serve", "baseline", "model.seed=1", "--data-parallel-size", "2"])
    assert result.exit_code == 0, result.output
    assert calls == [
        ("baseline", [], None, 9000, "secret"),
        ("baseline", ["model.seed=1", "parallel.data_parallel_size=2"], None, None, None),
    ]


def test_config_error_raised_inside_a_command_exits_with_code_2(runner, monkeypatch):
    def failing_run_command(*args):
        raise ConfigError(["model.path: no such model (got 'x')"])

    monkeypatch.setitem(sys.modules, "infer.cli.run", types.SimpleNamespace(run_command=failing_run_command))
    result = runner.invoke(main, ["run", "baseline"])
    assert (result.exit_code, result.output) == (
        2,
        "Error: invalid config (1 problem):\n  model.path: no such model (got 'x')\n",
    )


def test_lazy_command_whose_module_is_missing_says_so(runner, monkeypatch):
    monkeypatch.setitem(infer.cli.LAZY_COMMANDS, "ghost", ("infer_no_such_module:ghost", "A missing command."))
    assert re.search(r"ghost +A missing command\.", runner.invoke(main, ["--help"]).output)
    result = runner.invoke(main, ["ghost"])
    assert result.exit_code == 1
    assert '"infer ghost" is not available in this installation' in result.output


def test_plugin_commands_appear_in_help_and_run(monkeypatch):
    use_registry(monkeypatch, HelloCommand())
    runner = CliRunner()
    assert "Say hello from a plugin." in runner.invoke(main, ["--help"]).output
    assert runner.invoke(main, ["hello"]).output == "hello from a plugin\n"


def test_plugin_command_may_not_shadow_a_core_command(monkeypatch):
    use_registry(monkeypatch, (ShadowingCommand(), Distribution("infer-shadow", "2.0")))
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 2
    assert 'plugin command "run" from infer-shadow 2.0 shadows the core command "infer run"' in result.output


def test_help_imports_neither_torch_nor_lazy_command_modules():
    # With the real registry: every built-in plugin registers without importing torch.
    script = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "import infer.cli\n"
        "result = CliRunner().invoke(infer.cli.main, ['--help'])\n"
        "assert result.exit_code == 0, result.output\n"
        "print(sorted(name for name in ('torch', 'infer.config', 'infer.cli.bench') if name in sys.modules))\n"
    )
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert completed.stdout == "[]\n"


def test_run_echoes_each_prompt_lines_id_and_refuses_unknown_keys(runner, tiny_model_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "q-7", "prompt": "hi", "max_tokens": 2}\n{"prompt": "there", "max_tokens": 2}\n')
    out = tmp_path / "out.jsonl"
    args = ["run", "baseline", f"model.path={tiny_model_dir}", "model.dtype=float32", "model.max_model_len=256"]
    result = runner.invoke(main, [*args, "--prompts", str(prompts), "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["q-7", 1]
    prompts.write_text('{"prompt": "hi", "max_token": 2}\n')
    result = runner.invoke(main, [*args, "--prompts", str(prompts)])
    message = result.output + str(result.exception)
    assert result.exit_code != 0 and "prompts.jsonl:1" in message and "did you mean 'max_tokens'" in message


def test_run_prompt_lines_carry_constraints(tiny_model_dir, tmp_path):
    """A random tiny model still answers within its line's constraint; a malformed constraint names the line. (The
    installed plugins, not the stand-ins: the guide must be real.)"""
    runner = CliRunner()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"prompt": "pick", "constraint": {"choice": ["red", "blue"]}, "max_tokens": 8}\n'
        '{"prompt": "digits", "constraint": {"regex": "[0-9]{4}"}, "max_tokens": 8}\n'
    )
    out = tmp_path / "out.jsonl"
    args = [
        "run",
        "baseline",
        f"model.path={tiny_model_dir}",
        "model.dtype=float32",
        "model.max_model_len=256",
        "guide.name=xgrammar",
    ]
    result = runner.invoke(main, [*args, "--prompts", str(prompts), "--output", str(out)])
    assert result.exit_code == 0, result.output
    texts = [json.loads(line)["text"] for line in out.read_text().splitlines()]
    assert texts[0] in {"red", "blue"} and len(texts[1]) == 4 and texts[1].isdigit(), texts
    prompts.write_text('{"prompt": "pick", "constraint": {"choices": ["red"]}}\n')
    result = runner.invoke(main, [*args, "--prompts", str(prompts)])
    message = result.output + str(result.exception)
    assert result.exit_code != 0 and "prompts.jsonl:1" in message and "choices" in message


def test_train_eagle_comes_from_the_eagle_plugin_through_register_commands():
    """EAGLE is one plugin package: its command is registered by its own hook, as a third-party plugin's would be,
    and core holds no EAGLE code or asset."""
    from pathlib import Path

    from infer.registry import get_registry

    assert "train-eagle" not in infer.cli.LAZY_COMMANDS
    command = get_registry().plugin_commands()["train-eagle"]
    assert command.distribution.name == "infer"
    assert command.command.callback.__module__ == "infer.plugins.drafters.eagle.command"
    assert "train-eagle" in CliRunner().invoke(main, ["--help"]).output  # the installed plugins' registry
    core = Path(infer.cli.__file__).parent
    assert not any("plugins.drafters.eagle" in path.read_text() for path in core.rglob("*.py"))
    assert not (core / "assets").exists()


def test_run_refuses_a_max_model_len_past_the_models_limit_in_one_line(runner, tiny_model_dir):
    limit = json.loads((Path(tiny_model_dir) / "config.json").read_text())["max_position_embeddings"]
    too_long = f"model.max_model_len={limit + 1}"
    result = runner.invoke(main, ["run", "baseline", f"model.path={tiny_model_dir}", "model.dtype=float32", too_long])
    assert result.exit_code != 0
    assert result.output.endswith(
        f"  model.max_model_len: {limit + 1} exceeds the model's limit (max_position_embeddings={limit}); "
        "lower model.max_model_len\n"
    )
