"""The guard in front of the routes (Host header, API key before the body) and what a failure mid-stream tells the
client and the log."""
import json
import logging

import pytest

from tests.server.stub import MODEL, SECRET, MidStreamFailureLLM, stub_client

KEY = "k3y"


@pytest.fixture(scope="module")
def keyed():
    with stub_client(api_key=KEY) as client:
        yield client


def test_invalid_json_without_a_key_is_401_not_400(keyed):
    response = keyed.post("/v1/chat/completions", content=b'{"model": ', headers={"Content-Type": "application/json"})
    assert response.status_code == 401 and response.json()["error"]["code"] == "missing_api_key"


def test_wrong_key_is_401_before_validation(keyed):
    response = keyed.post("/v1/completions", json={"bogus": 1}, headers={"Authorization": "Bearer nope"})
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


def test_openapi_schema_needs_the_key_and_health_does_not(keyed):
    assert keyed.get("/openapi.json").status_code == 401
    assert keyed.get("/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()["paths"]
    assert keyed.get("/health").status_code == 200


@pytest.fixture(scope="module")
def loopback():
    with stub_client() as client:  # 127.0.0.1 and no key: the default
        yield client


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example", ""])
def test_loopback_server_without_a_key_refuses_other_host_names(loopback, host):
    """DNS rebinding: a page on evil.example rebinds its name to 127.0.0.1; the browser still sends its Host."""
    response = loopback.get("/v1/models", headers={"Host": host})
    assert response.status_code == 403 and response.json()["error"]["code"] == "host_not_allowed"


@pytest.mark.parametrize("host", ["localhost:8000", "127.0.0.1:8000", "[::1]:8000", "LOCALHOST", "127.0.0.1"])
def test_loopback_server_answers_loopback_host_names(loopback, host):
    assert loopback.get("/v1/models", headers={"Host": host}).status_code == 200


@pytest.mark.parametrize("config", [{"api_key": KEY}, {"host": "192.0.2.10"}])  # a non-loopback address (RFC 5737), never bound
def test_host_is_not_checked_with_a_key_or_off_loopback(config):
    with stub_client(**config) as client:
        response = client.get("/v1/models", headers={"Host": "api.example.com", "Authorization": f"Bearer {KEY}"})
    assert response.status_code == 200


def test_a_mid_stream_failure_is_logged_with_an_id_and_sent_without_internals(caplog):
    with stub_client(MidStreamFailureLLM()) as client, caplog.at_level(logging.ERROR):
        response = client.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2], "max_tokens": 4,
                                                        "stream": True})
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    error = events[-1]["error"]
    request_id = events[0]["id"]
    assert error["type"] == "server_error" and request_id in error["message"] and SECRET not in response.text
    assert any(request_id in r.getMessage() and SECRET in str(r.exc_info[1]) for r in caplog.records)
