"""Request validation that answers before the prompt is tokenized: limits named in a 400 in OpenAI's error shape."""
import pytest

from fastdecode.engine.sampling import MAX_STOP_CHARS, MAX_STOP_STRINGS
from fastdecode.server.schemas import ChatCompletionRequest
from tests.server.stub import MODEL, UntokenizableLLM, stub_client

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def http():
    with stub_client() as client:
        yield client


def test_a_single_stop_string_longer_than_16_characters_is_accepted():
    body = ChatCompletionRequest.model_validate({"model": MODEL, "messages": MESSAGES, "stop": "x" * 40})
    assert body.stop == "x" * 40


@pytest.mark.parametrize("stop", ["x" * (MAX_STOP_CHARS + 1), ["ok", "x" * (MAX_STOP_CHARS + 1)],
                                  ["s"] * (MAX_STOP_STRINGS + 1)])
def test_stop_over_the_limits_is_a_400_naming_them(http, stop):
    response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "stop": stop})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "stop" and str(MAX_STOP_CHARS) in error["message"]


def post(http, **fields):
    return http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, **fields})


def tool(parameters):
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


def deep(depth: int):
    value = {}
    for _ in range(depth):
        value = {"items": value}
    return value


CASES = {  # name: (fields, the parameter the error names, a word the message holds)
    "a schema that is not an object": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": [1]}}}, "response_format.json_schema", "object"),
    "schema too deep": ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                     "schema": deep(40)}}},
                        "response_format.json_schema", "32"),
    "a grammar past the limit": ({"response_format": {"type": "grammar", "grammar": "x" * 100_001}},
                                 "response_format.grammar", "100000"),
    "two constraints in structured_outputs": ({"structured_outputs": {"regex": "a", "choice": ["b"]}},
                                              "structured_outputs", "exactly one"),
    "too many logit_bias entries": ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "1024"),
    "too many tools": ({"tools": [tool({})] * 129}, "tools", "128"),
}


@pytest.mark.parametrize("name", CASES)
def test_schema_and_bias_over_the_limits_or_malformed_are_a_400_naming_them(http, name):
    fields, param, word = CASES[name]
    response = post(http, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and word in error["message"], error


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab " * 100}]}),
    ("/v1/completions", {"prompt": "ab " * 100}),
    # short contents, but reasoning sent back that the template renders
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}, {
        "role": "assistant", "content": "ok", "reasoning_content": "ab " * 100}, {"role": "user", "content": "go"}]}),
])
def test_a_prompt_too_long_for_the_context_however_it_tokenizes_is_refused_before_tokenizing(path, body):
    # 300 characters, at most 4 a token: at least 75 tokens, over the context of 64
    with stub_client(UntokenizableLLM()) as client:
        response = client.post(path, json={"model": MODEL, "max_tokens": 1, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "context_length_exceeded"
