"""Many concurrent streaming clients against one server: each gets exactly what the offline engine produces for the
same greedy request on the same config, and every KV block comes back afterwards."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from infer import LLM, SamplingParams
from infer.serve.process import ServerProcess

CLIENT_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from infer.testing.models import make_tiny_model_dir

    return str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny-model")))


def chats(count: int) -> list[list[dict]]:
    return [
        [{"role": "user", "content": f"Request {i}: what is {i} plus {3 * i + 1}? Show your work."}]
        for i in range(count)
    ]


async def stream_all(url: str, model: str, conversations: list[list[dict]], max_tokens: int) -> list[tuple[str, str]]:
    """Every conversation streamed at once; returns (text, finish_reason) per conversation."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S)

    async def one(messages) -> tuple[str, str]:
        text, finish_reason = "", None
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True
        )
        async for chunk in stream:
            text += chunk.choices[0].delta.content or ""
            finish_reason = chunk.choices[0].finish_reason or finish_reason
        return text, finish_reason

    try:
        return await asyncio.wait_for(asyncio.gather(*(one(m) for m in conversations)), CLIENT_TIMEOUT_S)
    finally:
        await client.close()


def offline(overrides: list[str], conversations: list[list[dict]], max_tokens: int) -> list[tuple[str, str]]:
    llm = LLM("baseline", dotlist=overrides)
    outputs = llm.generate(conversations, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return [(output.text, output.finish_reason) for output in outputs]


# The default model gets fewer clients: on two busy CPU cores, 16 of them take 10-50 s served and again offline.
@pytest.mark.parametrize("model, num_clients, max_tokens", [("tiny", 64, 32), ("smollm2-135m-instruct", 8, 8)])
def test_concurrent_streams_match_offline_and_free_every_block(
    tiny_model_dir, tmp_path, model, num_clients, max_tokens
):
    path = tiny_model_dir if model == "tiny" else model
    overrides = [
        f"model.path={path}",
        "model.dtype=float32",
        "model.max_model_len=256",
        "cache.num_blocks=640",
        f"scheduler.max_num_seqs={num_clients}",
        f"server.max_waiting={num_clients}",
    ]
    conversations = chats(num_clients)
    with ServerProcess("baseline", overrides, log_path=tmp_path / "server.log") as server:
        served = asyncio.run(stream_all(server.url, path, conversations, max_tokens))
        deadline = time.monotonic() + 10
        while (state := httpx.get(f"{server.url}/health").json())["requests_running"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert state["requests_running"] == state["requests_waiting"] == 0
        assert state["kv_blocks_used"] == state["kv_blocks_cached"] == 0
        assert server.stop() == 0
    expected = offline(overrides, conversations, max_tokens)
    mismatched = [i for i, (got, want) in enumerate(zip(served, expected)) if got != want]
    assert not mismatched, f"{len(mismatched)} differ, first: {served[mismatched[0]]!r} vs {expected[mismatched[0]]!r}"
    assert all(text for text, _ in served)
