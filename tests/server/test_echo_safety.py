"""What a response repeats of its request, and error messages that quote it, can always be sent: a field a response
echoes that holds NaN, 1e999, a lone surrogate (JSON's `\\ud800`) or deep nesting is a 400 in the API's own shape
before generation, where it was a 500, NaN inside SSE JSON or a stream cut short after it; an error message quoting a
lone surrogate (a model name, a call id) is sent with it escaped, where it failed to encode and became a 500.

Bodies are written by hand: json.dumps will not write NaN, and the SDKs will not send a lone surrogate."""
import pytest

from tests.server.canned import canned_client

DEEP = "[" * 200 + "]" * 200  # past the 64 levels an echoed value may nest, well within what the body parser takes
FUNCTION = '{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}'


@pytest.fixture(scope="module")
def served():
    with canned_client("qwen3") as (llm, client):
        llm.script = "Sunny."
        yield llm.llm.name, client


def post(client, path: str, body: str):
    return client.post(path, content=body.encode(), headers={"content-type": "application/json"})


def openai_error(response, status: int, param: str | None) -> str:
    """The error's message, once the response is OpenAI's error object with `status` naming `param`."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == ("invalid_request_error" if status == 400
                                                         else "not_found_error")
    return error["message"]


@pytest.mark.parametrize("stream", ["false", "true"])
@pytest.mark.parametrize("field, param", [
    ('"metadata": {"a": NaN}', "metadata"),
    ('"metadata": {"a": 1e999}', "metadata"),
    ('"metadata": {"a": -Infinity}', "metadata"),
    ('"metadata": {"a": "\\ud800"}', "metadata"),
    ('"metadata": {"\\udfff": "a key"}', "metadata"),
    (f'"metadata": {{"a": {DEEP}}}', "metadata"),
    ('"tools": [{"type": "function", "name": "f", "description": "\\ud800"}]', "tools"),
    ('"tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "x-limit": NaN}}]', "tools"),
    ('"tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "x-limit": 1e999}}]', "tools"),
    ('"tools": [{"type": "namespace", "name": "n\\ud800", "tools": [' + FUNCTION + ']}]', "tools"),
    ('"tools": [{"type": "web_search\\ud800"}]', "tools"),  # a tool left out of the prompt is still echoed
    ('"tools": [' + FUNCTION + '], "tool_choice": {"type": "function", "name": "\\ud800"}', "tool_choice"),
    ('"instructions": "Be brief.\\ud800"', "instructions"),
])
def test_responses_field_it_echoes_is_refused_unless_plain_json(served, field, param, stream):
    model, client = served
    response = post(client, "/v1/responses", f'{{"model": "{model}", "input": "Hi", "stream": {stream}, {field}}}')
    assert "Value cannot be repeated in the response" in openai_error(response, 400, param)


def test_responses_echo_of_plain_fields_is_unchanged(served):
    model, client = served
    metadata = {"user": "Zoë 🌍", "n": 1.5, "nested": [[{"a": None}]]}
    tool = {"type": "function", "name": "get_weather", "description": "Weather.", "parameters": {"type": "object"}}
    response = client.post("/v1/responses", json={"model": model, "input": "Hi", "metadata": metadata,
                                                  "tools": [tool]})
    assert response.status_code == 200, response.text
    assert response.json()["metadata"] == metadata and response.json()["tools"] == [tool]


@pytest.mark.parametrize("path, rest", [
    ("/v1/chat/completions", '"messages": [{"role": "user", "content": "Hi"}]'),
    ("/v1/completions", '"prompt": "Hi"'),
    ("/v1/responses", '"input": "Hi"'),
    ("/v1/messages", '"max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]'),
])
def test_unknown_model_with_a_lone_surrogate_is_a_404_that_quotes_it_escaped(served, path, rest):
    _, client = served
    response = post(client, path, f'{{"model": "gpt-\\ud800", {rest}}}')
    if path == "/v1/messages":
        assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"
        message = response.json()["error"]["message"]
    else:
        message = openai_error(response, 404, "model")
    assert "gpt-\\ud800" in message


def test_chat_tool_choice_naming_a_lone_surrogate_is_a_400(served):
    model, client = served
    response = post(client, "/v1/chat/completions", f'{{"model": "{model}", "messages": [{{"role": "user", '
                    '"content": "Hi"}], "tools": [{"type": "function", "function": {"name": "get_weather"}}], '
                    '"tool_choice": {"type": "function", "function": {"name": "\\ud800"}}}')
    assert "`\\ud800`" in openai_error(response, 400, "tool_choice")


def test_messages_tool_use_id_with_a_lone_surrogate_is_an_anthropic_400(served):
    model, client = served
    response = post(client, "/v1/messages", f'{{"model": "{model}", "max_tokens": 8, "messages": [{{"role": "user", '
                    '"content": [{"type": "tool_result", "tool_use_id": "toolu_\\ud800", "content": "sunny"}]}]}')
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "toolu_\\ud800" in body["error"]["message"]


def test_responses_call_id_with_a_lone_surrogate_is_a_400(served):
    model, client = served
    response = post(client, "/v1/responses", f'{{"model": "{model}", "input": [{{"type": "function_call_output", '
                    '"call_id": "call_\\ud800", "output": "sunny"}]}')
    assert "call_\\ud800" in openai_error(response, 400, "input.0.call_id")

