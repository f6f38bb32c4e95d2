"""``infer serve CONFIG [OVERRIDES]... [--host H] [--port P] [--api-key KEY]``.

Loads the config and the engine, then runs uvicorn until SIGTERM or Ctrl-C. Shutdown is graceful: uvicorn stops
accepting connections and lets in-flight responses finish for three quarters of ``server.shutdown_timeout_s``; then
the engine aborts the rest, whose handlers still answer (``finish_reason: "abort"``; a stream's last chunk and
``[DONE]``), the engine thread stops, and the process exits with status 0 within the timeout.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

import click

CONFIG_HELP = (
    "CONFIG is a YAML file or a shipped config name (baseline); OVERRIDES are key=value, e.g. server.max_waiting=64."
)


@click.command("serve", epilog=CONFIG_HELP)
@click.argument("config")
@click.argument("overrides", nargs=-1)
@click.option("--host", help="Address to bind (default: server.host from the config).")
@click.option("--port", type=int, help="Port to bind (default: server.port from the config).")
@click.option(
    "--api-key",
    envvar="INFER_API_KEY",
    help="Require this bearer token on /v1 routes (default: $INFER_API_KEY, then server.api_key).",
)
@click.option(
    "--data-parallel-size",
    type=click.IntRange(min=1),
    help="Engine replicas behind a router on the address (default: parallel.data_parallel_size).",
)
def serve(
    config: str,
    overrides: tuple[str, ...],
    host: str | None,
    port: int | None,
    api_key: str | None,
    data_parallel_size: int | None,
) -> None:
    """Serve an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics)."""
    overrides = list(overrides)
    if data_parallel_size is not None:
        overrides.append(f"parallel.data_parallel_size={data_parallel_size}")
    serve_command(config, overrides, host, port, api_key)


@click.command("router", epilog=CONFIG_HELP)
@click.argument("overrides", nargs=-1)
@click.option(
    "--replica",
    "replicas",
    multiple=True,
    required=True,
    help="A replica's base URL, e.g. http://10.0.0.2:8000 (repeat for each).",
)
@click.option(
    "--config",
    "config",
    default="baseline",
    show_default=True,
    help="Config whose router and server sections apply (OVERRIDES change them: router.policy=...).",
)
@click.option("--host", help="Address to bind (default: server.host from the config).")
@click.option("--port", type=int, help="Port to bind (default: server.port from the config).")
@click.option(
    "--api-key",
    envvar="INFER_API_KEY",
    help="Require this bearer token on /metrics (the replicas check /v1 themselves; the router forwards the header).",
)
def router_command(
    overrides: tuple[str, ...],
    replicas: tuple[str, ...],
    config: str,
    host: str | None,
    port: int | None,
    api_key: str | None,
) -> None:
    """Route OpenAI API requests over running infer serve replicas (prefix_affinity or round_robin)."""
    from infer.config import load_config
    from infer.serve.replicas import run_router

    _log_to_stderr()
    run_router(list(replicas), load_config(config, list(overrides)), host, port, api_key)


def serve_command(
    config: str, overrides: list[str], host: str | None = None, port: int | None = None, api_key: str | None = None
) -> None:
    """Build the engine and serve until told to stop. Command-line values win over the config's ``server``."""
    import uvicorn

    from infer.config import load_config
    from infer.engine.engine import Engine
    from infer.serve.app import create_app
    from infer.serve.engine_loop import EngineLoop

    _log_to_stderr()
    resolved = load_config(config, overrides)
    if resolved.parallel.data_parallel_size > 1:
        from infer.serve.replicas import serve_data_parallel

        serve_data_parallel(config, overrides, host, port, api_key, resolved)
        return
    settings = resolved.server
    engine = Engine(resolved)
    bound = settings if host is None else settings.model_copy(update={"host": host})
    engine_loop = EngineLoop(engine, settings.max_waiting)
    app = create_app(engine_loop, api_key=api_key or settings.api_key, settings=bound)
    server = _graceful_server(
        uvicorn.Config(
            app,
            host=bound.host,
            port=settings.port if port is None else port,
            access_log=False,
            timeout_graceful_shutdown=settings.shutdown_timeout_s + _CANCEL_BACKSTOP_S,
            log_level="info",
        ),
        engine_loop,
        abort_after_s=settings.shutdown_timeout_s * _ABORT_AT,
    )
    # uvicorn re-raises the signal that stopped it once it has shut down; this handler turns that into exit 0.
    signal.signal(signal.SIGTERM, _exit_after_shutdown)
    try:
        server.run()
    finally:
        engine.close()  # the other tensor-parallel ranks (the lifespan has stopped the engine thread)
    if not server.started:
        sys.exit(1)  # e.g. the port was taken; uvicorn has logged why


# At shutdown, in-flight requests get this share of server.shutdown_timeout_s to finish; then the engine aborts them,
# and each handler still answers (finish_reason "abort": streams a last chunk and [DONE]).
_ABORT_AT = 0.75
# uvicorn's own deadline, after which it cancels handlers mid-response: a backstop the abort should never reach.
_CANCEL_BACKSTOP_S = 5.0


def _graceful_server(config, engine_loop, abort_after_s: float):
    """uvicorn's server, with in-flight requests aborted in the engine ``abort_after_s`` into its shutdown, before
    uvicorn's graceful-shutdown timeout would cancel their handlers (that cut streams off without [DONE] and answered
    the rest with a plain-text 500)."""
    import uvicorn

    class GracefulServer(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            abort = asyncio.get_running_loop().call_later(abort_after_s, engine_loop.abort_all)
            try:
                await super().shutdown(sockets)
            finally:
                abort.cancel()

    return GracefulServer(config)


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
