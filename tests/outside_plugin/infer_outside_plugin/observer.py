"""Observer hooks in plugin API 1's form (each takes ``engine``), and ``infer outside-hello``.

``SEEN`` counts what the hooks saw: engines started, steps finished, requests finished.
"""

from __future__ import annotations

from collections import Counter

from infer import hookimpl

SEEN: Counter[str] = Counter()


@hookimpl
def engine_started(engine):
    SEEN["engines"] += 1
    SEEN["max_model_len"] = engine.config.model.max_model_len


@hookimpl
def step_finished(engine, step_stats):
    SEEN["steps"] += 1
    SEEN["tokens"] += step_stats.num_batched_tokens


@hookimpl
def request_finished(engine, output):
    SEEN["requests"] += 1


@hookimpl
def register_commands(cli):
    import click

    @cli.command("outside-hello")
    def outside_hello():
        """Say hello from infer-outside-plugin."""
        click.echo("hello from infer-outside-plugin")
