"""Concurrency: many streaming clients are all served, in full, each with the reply its request gets alone; a
client that leaves frees the engine; a full queue answers 429 with Retry-After. Bounded in time: short replies and a
wall-clock limit on each scenario."""
import asyncio
import json
import threading
import time

import httpx
import pytest

from tests.server.conftest import API_KEY

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m"
CLIENTS, REQUESTS_EACH, MAX_TOKENS = 16, 4, 12
LOAD_LIMIT_S = 400  # 64 short requests, one at a time on 2 cores


async def stream_once(client, i: int, j: int) -> dict:
    """One streamed chat request read as raw SSE lines: tokens counted from per-token logprobs, not chunks."""
    messages = [{"role": "user", "content": f"Client {i}, request {j}: name a prime number above {10 * i + j}."}]
    tokens, usage, done, text = 0, None, False, []
    async with client.chat.completions.with_streaming_response.create(
            model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True, logprobs=True,
            stream_options={"include_usage": True}) as response:
        async for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                continue
            event = json.loads(data)
            assert "error" not in event, event
            for choice in event["choices"]:
                tokens += len((choice.get("logprobs") or {}).get("content") or [])
                text.append(choice["delta"].get("content") or "")
            usage = event.get("usage") or usage
    return {"tokens": tokens, "usage": usage, "done": done, "text": "".join(text)}


def test_sixteen_streaming_clients_four_requests_each_all_complete(server):
    async def client_loop(i: int):
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0,
                                    timeout=LOAD_LIMIT_S)
        try:
            return [await stream_once(client, i, j) for j in range(REQUESTS_EACH)]
        finally:
            await client.close()

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(client_loop(i) for i in range(CLIENTS))), LOAD_LIMIT_S)

    by_client = asyncio.run(main())
    results = [r for per_client in by_client for r in per_client]
    assert len(results) == CLIENTS * REQUESTS_EACH
    for r in results:
        assert r["done"], r
        assert r["usage"]["completion_tokens"] == r["tokens"] and 0 < r["tokens"] <= MAX_TOKENS, r
    assert server.healthy()

    # Each reply is the one its request gets alone (greedy; batching and prefix hits change nothing): one request
    # of every client, each position j covered, run again one at a time.
    async def alone():
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0,
                                    timeout=LOAD_LIMIT_S)
        try:
            return [await stream_once(client, i, i % REQUESTS_EACH) for i in range(CLIENTS)]
        finally:
            await client.close()

    for i, solo in enumerate(asyncio.run(alone())):
        assert by_client[i][i % REQUESTS_EACH]["text"] == solo["text"], (i, solo)


def test_client_that_leaves_mid_stream_stalls_nobody(server, client):
    long = dict(model=MODEL, messages=[{"role": "user", "content": "Write a very long story."}], max_tokens=1500,
                temperature=0, extra_body={"ignore_eos": True})
    stream = client.chat.completions.create(**long, stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()  # the client goes away with about 1500 tokens still to come
    start = time.monotonic()
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       temperature=0)
    assert r.usage.completion_tokens > 0
    assert time.monotonic() - start < 15, "the abandoned request kept the engine"
    metrics = httpx.get(f"{server.base_url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    assert 'fastdecode_requests_cancelled_total{reason="client"}' in metrics


def test_client_that_times_out_on_a_plain_request_frees_the_engine(server):
    impatient = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=1.5)
    with pytest.raises(openai.APITimeoutError):
        impatient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A long story."}],
                                          max_tokens=1500, temperature=0, extra_body={"ignore_eos": True})
    patient = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    start = time.monotonic()
    patient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert time.monotonic() - start < 15


def test_full_queue_answers_429_with_retry_after(small_server):
    """Queue of one: one request generating, one waiting, the third is refused; the waiting one is still served."""
    client = openai.OpenAI(base_url=f"{small_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    long = dict(model=MODEL, prompt="1, 2, 3,", max_tokens=80, temperature=0, extra_body={"ignore_eos": True})
    running = client.completions.create(**long, stream=True)
    next(iter(running))  # the engine is on it
    waiting_result = {}
    waiter = threading.Thread(target=lambda: waiting_result.update(
        r=client.completions.create(model=MODEL, prompt="a", max_tokens=2)))
    waiter.start()
    deadline = time.monotonic() + 30
    while httpx.get(f"{small_server.base_url}/health").json()["queue_depth"] < 1:
        assert time.monotonic() < deadline, "the second request never queued"
        time.sleep(0.02)
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model=MODEL, prompt="b", max_tokens=2)
    assert int(e.value.response.headers["Retry-After"]) >= 1 and e.value.body["code"] == "queue_full"
    running.close()
    waiter.join(60)
    assert waiting_result["r"].usage.completion_tokens > 0
    assert small_server.healthy()
