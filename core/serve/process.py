"""``infer serve`` as a child process on a free loopback port, for tests and benchmarks.

``with ServerProcess("baseline", ["model.dtype=float32"]) as server:`` starts it, waits until ``/health`` answers,
and on exit sends SIGTERM (a graceful shutdown) and waits for the exit status.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from infer.host import free_port

LOOPBACK = "127.0.0.1"
# Runs the click command directly, so a server starts whether or not the ``infer`` script is on PATH.
LAUNCHER = "from infer.serve.cli import serve; serve()"


class ServerProcess:
    """A running server: ``url`` (``http://127.0.0.1:PORT``), ``process``, and its combined output in ``log_path``."""

    def __init__(
        self,
        config: str,
        overrides: list[str] = (),
        api_key: str | None = None,
        startup_timeout_s: float = 300.0,
        log_path: str | os.PathLike | None = None,
    ):
        self.port = free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        self.command = [
            sys.executable,
            "-c",
            LAUNCHER,
            config,
            *overrides,
            "--host",
            LOOPBACK,
            "--port",
            str(self.port),
            *(["--api-key", api_key] if api_key else []),
        ]
        self.startup_timeout_s = startup_timeout_s
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="infer-serve-", suffix=".log")[1])
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self) -> None:
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        try:
            self._wait_until_healthy()
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, then wait; a server that does not exit in ``timeout_s`` is killed. Returns the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def _wait_until_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"the server did not become healthy in {self.startup_timeout_s} s:\n{self.log_tail()}")


class RouterProcess(ServerProcess):
    """``infer router`` over running replicas at ``urls`` as a child process (``overrides``: ``router.policy=...``)."""

    def __init__(
        self,
        urls: list[str],
        overrides: list[str] = (),
        startup_timeout_s: float = 60.0,
        log_path: str | os.PathLike | None = None,
    ):
        super().__init__("baseline", overrides, startup_timeout_s=startup_timeout_s, log_path=log_path)
        self.command = [
            sys.executable,
            "-m",
            "infer",
            "router",
            *overrides,
            *[f"--replica={url}" for url in urls],
            "--host",
            LOOPBACK,
            "--port",
            str(self.port),
        ]
