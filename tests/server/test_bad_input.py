"""Bad input gets a 4xx in OpenAI's error shape, and the server keeps answering /health after each."""
import json

import httpx
import pytest

from tests.server.conftest import API_KEY

MODEL = "smollm2-135m"
OK_MESSAGES = [{"role": "user", "content": "hi"}]
AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}


def body(**fields) -> bytes:
    return json.dumps({"model": MODEL, "messages": OK_MESSAGES, "max_tokens": 2, **fields}).encode()


CASES = {  # name: (path, raw body, expected status)
    "malformed json": ("/v1/chat/completions", b'{"model": "smollm2-135m", "messages": [', 400),
    "body is a list": ("/v1/chat/completions", b"[1, 2]", 400),
    "messages not a list": ("/v1/chat/completions", body(messages="hello"), 400),
    "max_tokens a string": ("/v1/chat/completions", body(max_tokens="ten"), 400),
    "temperature a string": ("/v1/chat/completions", body(temperature="hot"), 400),
    "negative max_tokens": ("/v1/chat/completions", body(max_tokens=-5), 400),
    "zero max_tokens": ("/v1/chat/completions", body(max_tokens=0), 400),
    "huge max_tokens": ("/v1/chat/completions", body(max_tokens=10**30), 400),
    "temperature too high": ("/v1/chat/completions", body(temperature=3.5), 400),
    "top_logprobs too many": ("/v1/chat/completions", body(logprobs=True, top_logprobs=50), 400),
    "n above one": ("/v1/chat/completions", body(n=2), 400),
    "unknown field": ("/v1/chat/completions", body(frobnicate=True), 400),
    "missing messages": ("/v1/chat/completions", json.dumps({"model": MODEL}).encode(), 400),
    "empty messages": ("/v1/chat/completions", body(messages=[]), 400),
    "unknown role": ("/v1/chat/completions", body(messages=[{"role": "wizard", "content": "x"}]), 400),
    "image content": ("/v1/chat/completions", body(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]), 400),
    "lone surrogate": ("/v1/chat/completions", b'{"model": "smollm2-135m", "max_tokens": 2, "messages": '
                                               b'[{"role": "user", "content": "a\\ud800b"}]}', 400),
    "invalid utf-8": ("/v1/chat/completions", b'{"model": "smollm2-135m", "messages": [{"role": "user", '
                                              b'"content": "\xff\xfe\xfd"}]}', 400),
    "null content": ("/v1/chat/completions", body(messages=[{"role": "user", "content": None}]), 400),
    "unknown model": ("/v1/chat/completions", body(model="gpt-9"), 404),
    "tool_choice names no tool": ("/v1/chat/completions", body(tool_choice={"type": "function", "function": {
        "name": "nope"}}), 400),
    "bad function name": ("/v1/chat/completions", body(tools=[{"type": "function", "function": {
        "name": "has space"}}]), 400),
    "logit_bias key not a token": ("/v1/chat/completions", body(logit_bias={"abc": 1}), 400),
    "too many stop strings": ("/v1/chat/completions", body(stop=[f"s{i}" for i in range(20)]), 400),
    "empty prompt": ("/v1/completions", json.dumps({"model": MODEL, "prompt": ""}).encode(), 400),
    "token id out of vocabulary": ("/v1/completions", json.dumps({"model": MODEL, "prompt": [10**9]}).encode(), 400),
    "two prompts": ("/v1/completions", json.dumps({"model": MODEL, "prompt": ["a", "b"]}).encode(), 400),
    "suffix": ("/v1/completions", json.dumps({"model": MODEL, "prompt": "a", "suffix": "b"}).encode(), 400),
}


def assert_openai_error(response: httpx.Response, status: int):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["type"]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


@pytest.mark.parametrize("name", CASES)
def test_bad_request_is_a_4xx_openai_error(server, http, name):
    path, raw, status = CASES[name]
    assert_openai_error(http.post(path, content=raw, headers=AUTH), status)
    assert server.healthy()


def test_body_over_the_limit_is_413(server, http):
    huge = body(messages=[{"role": "user", "content": "x" * (9 * 2**20)}])
    assert_openai_error(http.post("/v1/chat/completions", content=huge, headers=AUTH), 413)
    assert server.healthy()


def test_chunked_body_over_the_limit_is_413(server, http):
    """No Content-Length to trust: the limit counts the bytes as they arrive."""
    def pieces():
        yield b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"x" * 2**20
        yield b'"}]}'
    assert_openai_error(http.post("/v1/chat/completions", content=pieces(), headers=AUTH), 413)
    assert server.healthy()


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic dGVzdA=="},
                                     {"Authorization": f"Bearer {API_KEY}x"}])
def test_missing_or_wrong_api_key_is_401(server, http, headers):
    response = http.post("/v1/chat/completions", content=body(), headers={"Content-Type": "application/json",
                                                                          **headers})
    assert_openai_error(response, 401)
    assert_openai_error(http.get("/v1/models", headers=headers), 401)
    assert server.healthy()


def test_health_needs_no_key_and_the_schema_does(http):
    assert http.get("/health").status_code == 200 and http.get("/openapi.json", headers=AUTH).json()["paths"]
    assert_openai_error(http.get("/openapi.json"), 401)


def test_unknown_route_and_wrong_method_are_openai_errors(http):
    assert_openai_error(http.get("/v1/nothing", headers=AUTH), 404)
    assert_openai_error(http.get("/v1/chat/completions", headers=AUTH), 405)


def test_metrics_count_requests_and_errors(http):
    text = http.get("/metrics", headers=AUTH).text
    assert 'fastdecode_requests_total{route="/v1/chat/completions",status="400"}' in text
    assert "fastdecode_request_errors_total" in text and "fastdecode_queue_depth" in text
