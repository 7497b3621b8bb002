"""Two engine replicas of SmolLM2-135M on a local Ray cluster (1 thread each) behind the server's app: outputs equal one
engine's, sessions and prefixes keep to their replica and hit its cache, grammars cross, /health and /metrics show
each replica, and a replica killed mid-run loses no request and hangs none."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time

import httpx
import pytest
from click.testing import CliRunner

from fastdecode.engine.llm import LLM
from fastdecode.engine.sampling import SamplingParams
from fastdecode.server.config import ServerConfig
from tests.server.conftest import app_server

ray = pytest.importorskip("ray", reason="the cluster extra: pip install 'fastdecode[cluster]'")
from fastdecode.cluster.remote import cluster_app  # noqa: E402 (it imports ray)

MODEL = "smollm2-135m"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three laws of thermodynamics are"]
REPLICA_BACK_S = 60  # Ray restarts a killed replica (the model loads in ~2 s; Ray's actor start dominates)


@pytest.fixture(scope="module")
def cluster(smollm2_path):
    from fastdecode.cluster.deployment import ClusterConfig
    from fastdecode.cluster.serve import LocalCluster

    model = dict(model=str(smollm2_path), dtype=None, quant=None, group_size=32, threads=1, max_seq_len=4096,
                 speculate="none")
    local = LocalCluster(ClusterConfig(model, replicas=2, max_batch=4))
    try:
        with app_server(cluster_app(local.llm, ServerConfig(served_model_name=MODEL)), "the cluster's server") as url:
            yield url, local.llm
    finally:
        local.stop()


@pytest.fixture(scope="module")
def one_engine(smollm2_path):
    llm = LLM(str(smollm2_path), max_seq_len=4096, threads=1)
    yield llm
    llm.close()


def completion(base_url: str, prompt, max_tokens=24, headers=None, **extra) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    r = httpx.post(f"{base_url}/v1/completions", json=body, headers=headers or {}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def health(base_url: str) -> dict:
    return httpx.get(f"{base_url}/health", timeout=10).json()


def test_greedy_outputs_equal_one_engines_side_by_side(cluster, one_engine):
    base_url, llm = cluster
    params = SamplingParams(max_tokens=24, temperature=0)
    expected = [one_engine.generate(llm.encode_prompt(p), params).text for p in PROMPTS]
    results = [None] * len(PROMPTS)
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, completion(base_url, PROMPTS[i])))
               for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [r["choices"][0]["text"] for r in results] == expected
    routed = health(base_url)["replicas"]
    assert len(routed) == 2 and all(r["routed"] > 0 for r in routed.values())  # the four were spread over both


def test_a_named_session_keeps_to_one_replica_and_hits_its_cache(cluster):
    base_url, llm = cluster
    before = {tag: r["routed"] for tag, r in health(base_url)["replicas"].items()}
    prompt, cached = "A session that the client names. " * 20, []
    for turn in range(3):
        reply = completion(base_url, prompt, 8, headers={"x-session-affinity": "session-42"})
        cached.append(reply["usage"]["prompt_tokens_details"]["cached_tokens"])
        prompt += reply["choices"][0]["text"] + f" Next turn {turn}. " * 5
    after = {tag: r["routed"] for tag, r in health(base_url)["replicas"].items()}
    assert sorted(after[tag] - before.get(tag, 0) for tag in after) == [0, 3]
    assert cached[0] == 0 and all(c >= 128 for c in cached[1:])  # each turn finds the one before in the cache
    assert health(base_url)["routing"]["decisions"]["session"] >= 2


def test_without_a_session_the_longest_cached_prefix_routes(cluster):
    base_url, llm = cluster
    conversations = [f"Conversation {k} is about {topic}. " * 30 for k, topic in enumerate(("ships", "bridges"))]
    firsts = [completion(base_url, c, 8) for c in conversations]
    seconds = [completion(base_url, c + f["choices"][0]["text"] + " And then?", 8)
               for c, f in zip(conversations, firsts)]
    for first, second in zip(firsts, seconds):
        hit = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert hit >= first["usage"]["prompt_tokens"] // 32 * 32 - 32  # all but the last block of the turn before


def test_a_grammar_is_compiled_again_on_the_replica(cluster):
    base_url, llm = cluster
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "A person as JSON."}], "max_tokens": 60,
            "temperature": 0, "response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "person", "schema": schema}}}
    r = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    person = json.loads(r.json()["choices"][0]["message"]["content"])
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)


def test_a_time_limit_ends_a_stream_as_on_one_engine(cluster):
    base_url, llm = cluster
    app = cluster_app(llm, ServerConfig(served_model_name=MODEL, request_timeout_s=1.0))
    with app_server(app, "the time-limited server") as short:
        body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 2000, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        events = []
        with httpx.stream("POST", f"{short}/v1/completions", json=body, timeout=60) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert not any("error" in e for e in events)
    finish = [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")]
    assert finish == ["length"] and 0 < events[-1]["usage"]["completion_tokens"] < 2000


def test_metrics_count_routing_and_each_replicas_cache(cluster):
    base_url, llm = cluster
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    assert 'fastdecode_routing_decisions_total{reason="session"}' in text
    assert text.count("fastdecode_replica_requests_total{replica=") == 2
    time.sleep(2.5)  # Ray polls the replicas' reports every 2 s
    replicas = health(base_url)["replicas"]
    assert sum(r.get("cached_tokens", 0) for r in replicas.values()) > 0
    assert all(r["pid"] > 0 for r in replicas.values())


async def stream(client: httpx.AsyncClient, base_url: str, prompt: str, max_tokens: int, session: str) -> dict:
    """A streamed completion -> its tokens and the error event that ended it, if one did."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    out = {"tokens": 0, "error": None, "status": None}
    async with client.stream("POST", f"{base_url}/v1/completions", json=body,
                             headers={"x-session-affinity": session}) as r:
        out["status"] = r.status_code
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    out["error"] = event["error"]
                elif event["choices"] and event["choices"][0]["text"]:
                    out["tokens"] += 1
    return out


def test_a_killed_replica_loses_no_request_and_comes_back(cluster):
    """Last in the module: it kills a replica. Its streams under way end with an error event; its requests with no
    token yet (long prompts still prefilling) are sent again to the other replica and finish; nothing hangs."""
    base_url, llm = cluster
    retried = llm.table.counts()["retried"]

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            streaming = [asyncio.ensure_future(stream(client, base_url, f"Story {k}: once", 150, "doomed"))
                         for k in range(2)]
            await asyncio.sleep(1.0)  # both under way
            prefilling = [asyncio.ensure_future(stream(client, base_url, f"Report {k}. " + "word " * 1500, 4, "doomed"))
                          for k in range(2)]
            await asyncio.sleep(0.3)
            victim = max(health(base_url)["replicas"].values(), key=lambda r: r["in_flight"])
            assert victim["in_flight"] == 4  # the session's four requests, on one replica
            os.kill(victim["pid"], signal.SIGKILL)  # (its pid is in its report, which Ray polls every 2 s)
            killed_at = time.monotonic()
            return await asyncio.wait_for(asyncio.gather(*streaming, *prefilling), 120), killed_at

    results, killed_at = asyncio.run(run())
    assert all(r["status"] == 200 for r in results)
    assert all(r["error"] is not None and "replica" in r["error"]["message"] and r["tokens"] > 0
               for r in results[:2]), results
    assert all(r["error"] is None and r["tokens"] == 4 for r in results[2:]), results
    assert llm.table.counts()["retried"] == retried + 2
    while len(health(base_url)["replicas"]) < 2:
        assert time.monotonic() - killed_at < REPLICA_BACK_S, "the killed replica did not come back"
        time.sleep(0.5)
    assert completion(base_url, "After the restart,", 4)["choices"][0]["text"]


def test_without_ray_one_line_says_how_to_install_it(monkeypatch):
    from fastdecode.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    result = CliRunner().invoke(main, ["serve", "--replicas", "2", "-m", MODEL])
    assert result.exit_code == 2
    assert "pip install 'fastdecode[cluster]'" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("args, says", [(["--min-replicas", "2"], "go together"),
                                        (["--min-replicas", "3", "--max-replicas", "2"], "no larger"),
                                        (["--replicas", "2", "--tp", "2"], "do not combine")])
def test_replica_options_that_cannot_work_get_one_line(args, says):
    from fastdecode.cli import main

    result = CliRunner().invoke(main, ["serve", "-m", MODEL, *args])
    assert result.exit_code == 2 and says in result.output and "Traceback" not in result.output
