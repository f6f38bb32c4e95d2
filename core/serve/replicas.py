"""``infer serve CONFIG --data-parallel-size N`` and ``infer router``: N engine replicas behind the router.

Each replica is ``python -m infer serve CONFIG OVERRIDES`` on a free loopback port, with this host's cores split
evenly among the replicas (``OMP_NUM_THREADS``; on CUDA each gets its own devices, ``CUDA_VISIBLE_DEVICES``), told
to stop when this process dies (Linux's parent-death signal). The router (``infer.serve.router``) starts once every
replica answers ``/health``; it then keeps checking them. At shutdown the replicas get SIGTERM (their own graceful
shutdown) and are killed if they outlast ``server.shutdown_timeout_s``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time

import httpx

logger = logging.getLogger("infer.router")


def replica_command(config: str, overrides: list[str], port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "infer",
        "serve",
        config,
        *overrides,
        "parallel.data_parallel_size=1",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Replicas:
    """The replica processes of one ``infer serve --data-parallel-size N``."""

    def __init__(self, config: str, overrides: list[str], resolved, api_key: str | None):
        from infer.host import cores_per_process, free_port

        self.size = resolved.parallel.data_parallel_size
        self.resolved = resolved
        self.ports = [free_port() for _ in range(self.size)]
        self.urls = [f"http://127.0.0.1:{port}" for port in self.ports]
        self.processes: list[subprocess.Popen] = []
        for index, port in enumerate(self.ports):
            env = dict(os.environ)
            env.setdefault("OMP_NUM_THREADS", str(cores_per_process(self.size)))
            if api_key:
                env["INFER_API_KEY"] = api_key
            gpus = resolved.parallel.tensor_parallel_size
            if resolved.model.resolved_device().startswith("cuda"):
                env["CUDA_VISIBLE_DEVICES"] = ",".join(str(index * gpus + g) for g in range(gpus))
            self.processes.append(
                subprocess.Popen(
                    replica_command(config, overrides, port),
                    env=env,
                    preexec_fn=_die_with_parent if sys.platform == "linux" else None,
                )
            )
        logger.info(
            "started %d replicas on %s (%s threads each)", self.size, ", ".join(self.urls), env["OMP_NUM_THREADS"]
        )

    def wait_healthy(self, timeout_s: float) -> None:
        """Block until every replica answers ``/health`` with 200; raise ``RuntimeError`` naming a replica that
        exited or did not come up in time."""
        deadline = time.monotonic() + timeout_s
        pending = set(range(self.size))
        while pending:
            for index in sorted(pending):
                code = self.processes[index].poll()
                if code is not None:
                    raise RuntimeError(f"replica {index} exited with status {code} while loading; see its output above")
                try:
                    if httpx.get(f"{self.urls[index]}/health", timeout=2.0).status_code == 200:
                        pending.discard(index)
                except httpx.HTTPError:
                    pass
            if pending and time.monotonic() > deadline:
                raise RuntimeError(
                    f"replicas {sorted(pending)} did not answer /health within router.startup_timeout_s={timeout_s:g} s"
                )
            if pending:
                time.sleep(0.25)

    def stop(self) -> None:
        """SIGTERM every replica, then kill those still running after the server's shutdown timeout."""
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.resolved.server.shutdown_timeout_s + 5
        for process in self.processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def serve_data_parallel(
    config: str, overrides: list[str], host: str | None, port: int | None, api_key: str | None, resolved
) -> None:
    """Start the replicas, then the router on ``host:port`` (the config's ``server`` address by default) until
    SIGTERM or Ctrl-C; then stop the replicas."""
    replicas = Replicas(config, overrides, resolved, api_key)
    try:
        replicas.wait_healthy(resolved.router.startup_timeout_s)
        run_router(replicas.urls, resolved, host, port, api_key)
    finally:
        replicas.stop()


def run_router(urls: list[str], resolved, host: str | None, port: int | None, api_key: str | None) -> None:
    """Serve the router over ``urls`` with uvicorn until SIGTERM or Ctrl-C."""
    import uvicorn
    from starlette.middleware.trustedhost import TrustedHostMiddleware

    from infer.serve.app import allowed_hosts
    from infer.serve.router import create_router_app

    settings = resolved.server if host is None else resolved.server.model_copy(update={"host": host})
    app = create_router_app(urls, resolved.router, api_key or settings.api_key, settings.metrics_public)
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts(settings))
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port if port is None else port,
            access_log=False,
            log_level="info",
            timeout_graceful_shutdown=settings.shutdown_timeout_s,
        )
    )
    # uvicorn re-raises the signal that stopped it once it has shut down; this handler turns that into exit 0.
    signal.signal(signal.SIGTERM, _exit_zero)
    server.run()
    if not server.started:
        raise SystemExit(1)


def _exit_zero(signum, frame) -> None:
    raise SystemExit(0)
