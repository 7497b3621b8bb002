"""Request validation that answers before the prompt is tokenized: limits named in a 400 in OpenAI's error shape."""
import pytest

from fastdecode.engine.sampling import MAX_STOP_CHARS, MAX_STOP_STRINGS
from fastdecode.server.schemas import ChatCompletionRequest
from tests.server.stub import MODEL, stub_client

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
