"""``infer serve CONFIG [OVERRIDES]... [--host H] [--port P] [--api-key KEY]``.

Loads the config and the engine, then runs uvicorn until SIGTERM or Ctrl-C. Shutdown is graceful: uvicorn stops
accepting connections and lets in-flight responses finish for up to ``server.shutdown_timeout_s``, cancels the rest
(their requests are aborted), then the engine thread stops, and the process exits with status 0.
"""

from __future__ import annotations

import logging
import signal
import sys

import click

CONFIG_HELP = ("CONFIG is a YAML file or a shipped config name (baseline); OVERRIDES are key=value, "
               "e.g. server.max_waiting=64.")


@click.command("serve", epilog=CONFIG_HELP)
@click.argument("config")
@click.argument("overrides", nargs=-1)
@click.option("--host", help="Address to bind (default: server.host from the config).")
@click.option("--port", type=int, help="Port to bind (default: server.port from the config).")
@click.option("--api-key", envvar="INFER_API_KEY",
              help="Require this bearer token on /v1 routes (default: $INFER_API_KEY, then server.api_key).")
def serve(config: str, overrides: tuple[str, ...], host: str | None, port: int | None, api_key: str | None) -> None:
    """Serve an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics)."""
    serve_command(config, list(overrides), host, port, api_key)


def serve_command(config: str, overrides: list[str], host: str | None = None, port: int | None = None,
                  api_key: str | None = None) -> None:
    """Build the engine and serve until told to stop. Command-line values win over the config's ``server``."""
    import uvicorn

    from infer.config import load_config
    from infer.engine import Engine
    from infer.serve.app import create_app
    from infer.serve.engine_loop import EngineLoop

    _log_to_stderr()
    resolved = load_config(config, overrides)
    settings = resolved.server
    engine = Engine(resolved)
    bound = settings if host is None else settings.model_copy(update={"host": host})
    app = create_app(EngineLoop(engine, settings.max_waiting), api_key=api_key or settings.api_key, settings=bound)
    server = uvicorn.Server(uvicorn.Config(
        app, host=host or settings.host, port=settings.port if port is None else port, access_log=False,
        timeout_graceful_shutdown=settings.shutdown_timeout_s, log_level="info"))
    # uvicorn re-raises the signal that stopped it once it has shut down; this handler turns that into exit 0.
    signal.signal(signal.SIGTERM, _exit_after_shutdown)
    server.run()
    if not server.started:
        sys.exit(1)  # e.g. the port was taken; uvicorn has logged why


def _exit_after_shutdown(signum, frame) -> None:
    raise SystemExit(0)


def _log_to_stderr() -> None:
    """The engine logs its KV pool plan on the ``infer`` logger; show it beside uvicorn's lines."""
    logger = logging.getLogger("infer")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
