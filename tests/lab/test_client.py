"""The client against a scripted SSE server: known TTFT, ITL and output speed are recovered within 10%, and each
way an endpoint can fail is either one clear error (before a run) or a recorded one (during a run)."""
import asyncio

import httpx
import pytest

from fastdecode.lab.client import (AuthRefusedError, Endpoint, EndpointError, EndpointUnreachableError,
                                   NotStreamingError, SSEDecoder, check_endpoint, payload, stream_chat)
from fastdecode.lab.local_server import free_port
from fastdecode.lab.metrics import request_metrics
from fastdecode.lab.records import RequestRecord
from fastdecode.lab.tokens import TokenCounter, assign_tokens
from tests.lab.sse_server import Script, ScriptedServer

SCRIPTS = {
    "quick": Script(ttft_s=0.01, itl_s=0.001, tokens=3),
    "steady": Script(ttft_s=0.4, itl_s=0.04, tokens=40),
    "multi": Script(ttft_s=0.4, itl_s=0.04, tokens=40, per_chunk=3),  # 3 tokens per chunk, 0.12 s apart
    "reasoning": Script(ttft_s=0.4, itl_s=0.04, tokens=20, reasoning_tokens=10),
    "nousage": Script(ttft_s=0.4, itl_s=0.04, tokens=30, usage=False),
    "json": Script(mode="json"),
    "broken": Script(mode="http500"),
    "slow": Script(ttft_s=3.0),
}
WORDS = TokenCounter("tokenizer:words", lambda text: len(text.split()), lambda messages: 5)


@pytest.fixture(scope="module")
def server():
    with ScriptedServer(SCRIPTS) as s:
        yield s


def measure(server, model, timeout_s=10.0, counter=WORDS):
    async def go():
        endpoint = Endpoint.from_base(server.url, model)
        body = payload(endpoint, [{"role": "user", "content": "hi"}], 64, {"temperature": 0})
        async with httpx.AsyncClient() as client:
            quick = Endpoint.from_base(server.url, "quick")  # pays the client's first-use costs
            await stream_chat(client, quick, payload(quick, [], 4, {}), RequestRecord("warm", "w"), timeout_s)
            return await stream_chat(client, endpoint, body, RequestRecord("i", "c"), timeout_s)

    r = asyncio.run(go())
    if r.ok:
        assign_tokens(r, counter, [{"role": "user", "content": "hi"}])
    return r


def recovered(server, model, check, attempts=3):
    """The script must be recovered in one of three tries: on a shared 2-core machine a thread can wake a scheduler
    tick late, which is the machine's doing, not the lab's."""
    for attempt in range(attempts):
        r = measure(server, model)
        try:
            check(r, request_metrics(r))
            return
        except AssertionError:
            if attempt == attempts - 1:
                raise


def test_steady_stream_recovers_ttft_itl_and_speed(server):
    def check(r, m):
        assert r.token_source == "usage" and m.output_tokens == 40 and r.prompt_tokens == 17
        assert r.finish_reason == "length"
        assert m.ttft_s == pytest.approx(0.4, rel=0.1)
        assert sum(m.itl_s) / len(m.itl_s) == pytest.approx(0.04, rel=0.1)
        assert m.output_tok_s == pytest.approx(1 / 0.04, rel=0.1)
        assert m.tpot_s == pytest.approx(0.04, rel=0.1)
        assert m.window_floor_tok_s == pytest.approx(1 / 0.04, rel=0.1)

    recovered(server, "steady", check)


def test_multi_token_chunks_are_counted_as_tokens(server):
    def check(r, m):
        assert len(r.chunks) == 1 + 13 and m.output_tokens == 40 and len(m.itl_s) == 39
        assert m.output_tok_s == pytest.approx(1 / 0.04, rel=0.1)  # not 1 / 0.12, the chunk rate
        assert sum(m.itl_s) / len(m.itl_s) == pytest.approx(0.04, rel=0.1)

    recovered(server, "multi", check)


def test_reasoning_stream_separates_first_token_from_first_content(server):
    def check(r, m):
        assert len(r.reasoning.split()) == 10 and len(r.content.split()) == 20
        assert m.ttft_s == pytest.approx(0.4, rel=0.1)
        assert m.ttfc_s == pytest.approx(0.4 + 10 * 0.04, rel=0.1)
        assert m.output_tok_s == pytest.approx(1 / 0.04, rel=0.1)

    recovered(server, "reasoning", check)


def test_without_usage_tokens_come_from_the_tokenizer(server):
    def check(r, m):
        assert r.usage is None and r.token_source == "tokenizer:words" and m.output_tokens == 30
        assert r.prompt_tokens == 5
        assert m.output_tok_s == pytest.approx(1 / 0.04, rel=0.1)

    recovered(server, "nousage", check)


def test_failures_during_a_run_are_recorded(server):
    assert measure(server, "broken").error.startswith("http 500: scripted failure")
    assert measure(server, "json").error.startswith("not streaming")
    assert measure(server, "no-such-model").error.startswith("http 404")
    slow = measure(server, "slow", timeout_s=0.5)
    assert slow.error.startswith("timeout") and not slow.ok


def test_check_raises_one_clear_error_per_failure(server):
    with pytest.raises(EndpointUnreachableError, match="cannot reach"):
        asyncio.run(check_endpoint(Endpoint.from_base(f"http://127.0.0.1:{free_port()}", "steady")))
    with pytest.raises(NotStreamingError, match="does not stream"):
        asyncio.run(check_endpoint(Endpoint.from_base(server.url, "json")))
    with pytest.raises(EndpointError, match="http 500"):
        asyncio.run(check_endpoint(Endpoint.from_base(server.url, "broken")))
    assert asyncio.run(check_endpoint(Endpoint.from_base(server.url + "/v1", "quick"))).ok


def test_refused_key_is_an_auth_error():
    with ScriptedServer(SCRIPTS, api_key="sk-right") as s:
        with pytest.raises(AuthRefusedError, match="HTTP 401"):
            asyncio.run(check_endpoint(Endpoint.from_base(s.url, "quick", api_key="sk-wrong")))
        assert asyncio.run(check_endpoint(Endpoint.from_base(s.url, "quick", api_key="sk-right"))).ok


def test_endpoint_urls_normalise_to_chat_completions():
    assert Endpoint.from_base("http://h:1", "m").url == "http://h:1/v1/chat/completions"
    assert Endpoint.from_base("http://h:1/v1/", "m").url == "http://h:1/v1/chat/completions"
    assert Endpoint.from_base("https://h/v1/chat/completions", "m").url == "https://h/v1/chat/completions"
    with pytest.raises(EndpointError):
        Endpoint.from_base("h:1", "m")


def test_sse_decoder_joins_data_lines_and_skips_comments():
    d = SSEDecoder()
    assert [d.feed(x) for x in [": ping", "data: {\"a\":", "data: 1}", ""]] == [None, None, None, '{"a":\n1}']
    assert d.feed("") is None
