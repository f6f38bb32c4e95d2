"""``infer serve`` under a bounded hostile load on loopback (``infer.serve.stress``): concurrent requests equal to
one-at-a-time references, abandoned streams, malformed bodies, a burst past the queue limit and wrong keys; then
every block is free and the server alive, and SIGTERM under load exits 0."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx

from infer.serve.process import ServerProcess
from infer.serve.stress import run

API_KEY = "stress-key"


def test_hostile_load_gets_no_5xx_leaks_no_block_and_sigterm_under_load_exits_zero(tiny_model_dir, tmp_path):
    overrides = [
        f"model.path={tiny_model_dir}",
        "model.dtype=float32",
        "model.max_model_len=256",
        "cache.num_blocks=128",
        "server.max_waiting=4",
        "server.shutdown_timeout_s=4",
    ]
    with ServerProcess("baseline", overrides, api_key=API_KEY, log_path=tmp_path / "server.log") as server:
        report = run(
            server.url, API_KEY, concurrency=16, disconnects=6, fuzz=80, burst=24, max_tokens=8, time_limit_s=240
        )
        print(json.dumps(report.status_counts))
        assert report.server_errors == 0, report
        assert report.mismatches == 0 and report.disconnects == 6
        assert report.kv_blocks_used_after == 0 and report.alive_after
        assert report.status_counts.get(401) == 3 and report.status_counts.get(429, 0) > 0
        assert report.status_counts.get(400, 0) > 40 and report.status_counts.get(413, 0) > 0
        # SIGTERM with streams in flight: each ends with a finish reason and [DONE], and the process exits 0.
        body = {"prompt": "Hi", "max_tokens": 200, "ignore_eos": True, "stream": True}
        headers = {"Authorization": f"Bearer {API_KEY}"}

        def stream() -> list[str]:
            with httpx.stream(
                "POST", f"{server.url}/v1/completions", json=body, headers=headers, timeout=60
            ) as response:
                return [line for line in response.iter_lines() if line.startswith("data:")]

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            streams = [pool.submit(stream) for _ in range(4)]
            while httpx.get(f"{server.url}/health", timeout=5).json()["requests_running"] < 4:
                time.sleep(0.05)
            server.process.terminate()
            endings = [future.result(timeout=60)[-2:] for future in streams]
        assert server.process.wait(30) == 0
        for before_done, done in endings:
            assert done == "data: [DONE]"
            assert json.loads(before_done.removeprefix("data: "))["choices"][0]["finish_reason"] in ("abort", "length")
