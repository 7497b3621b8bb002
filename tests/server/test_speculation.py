"""Speculation stays on in the server and changes nothing: greedy replies from a server with a drafter equal those
from a server without one, for text, JSON mode and tool calls, streamed or not."""
import json

import pytest

from tests.server.conftest import API_KEY, started

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m"
CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"
REPEAT = [{"role": "user", "content": "Repeat this list exactly: apple, banana, cherry, apple, banana, cherry."}]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}}
CASES = {
    "chat": dict(messages=REPEAT, max_tokens=48),
    "json": dict(messages=[{"role": "user", "content": "A JSON object with the name and age of Ada Lovelace."}],
                 max_tokens=96, response_format={"type": "json_object"}),
    "tool call": dict(messages=[{"role": "user", "content": "Weather in Oslo?"}], max_tokens=64,
                      tools=[WEATHER_TOOL], tool_choice="required", parallel_tool_calls=False),
    "logprobs": dict(messages=REPEAT, max_tokens=24, logprobs=True, top_logprobs=2),
}


def openai_client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def reply(client, stream=False, **kw):
    kw = dict(model=MODEL, temperature=0, **kw)
    if not stream:
        message = client.chat.completions.create(**kw).choices[0].message
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
        return message.content, calls
    content, arguments, names = [], [], []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            for call in choice.delta.tool_calls or []:
                names.append(call.function.name or "")
                arguments.append(call.function.arguments or "")
    calls = [("".join(names), json.loads("".join(arguments)))] if names else []
    return "".join(content) or None, calls


@pytest.mark.parametrize("case", CASES)
def test_greedy_reply_with_speculation_equals_without(server, spec_server, case):
    plain, speculative = openai_client(server), openai_client(spec_server)
    expected = reply(plain, **CASES[case])
    assert reply(speculative, **CASES[case]) == expected
    assert reply(speculative, stream=True, **CASES[case]) == expected
    if case == "json":
        assert isinstance(json.loads(expected[0]), dict)
    if case == "tool call":
        assert expected[1] and expected[1][0][0] == "get_weather"


def test_text_completion_with_speculation_equals_without_and_reports_drafts(server, spec_server):
    kw = dict(model=MODEL, prompt=CODE, max_tokens=48, temperature=0)
    plain = openai_client(server).completions.create(**kw)
    speculative = openai_client(spec_server).completions.create(**kw)
    assert speculative.choices[0].text == plain.choices[0].text
    figures = speculative.model_extra["fastdecode"]
    # The adaptive policy may judge every draft not worth verifying (then it decodes plainly): stats are reported
    # either way, and agree with each other.
    assert figures["speculation"]["drafter"] == spec_server.speculate
    assert figures["speculation"]["steps"] > 0
    assert figures["accepted_tokens"] == figures["speculation"]["accepted"]


@pytest.fixture(scope="module")
def quiet_spec_server(smollm2_path, tmp_path_factory):
    """A drafter, and the server's default: no speculation figures in responses."""
    yield from started(smollm2_path, tmp_path_factory, "--speculate", "ngram", "--api-key", API_KEY)


def test_speculation_figures_are_reported_only_when_asked(quiet_spec_server):
    """How well a drafter guesses hints at what it has seen, so responses say nothing of it by default
    (`--expose-speculation-stats` turns it on, as the spec_server above does)."""
    reply = openai_client(quiet_spec_server).completions.create(model=MODEL, prompt=CODE, max_tokens=24,
                                                                temperature=0)
    figures = reply.model_extra["fastdecode"]
    assert figures["output_tokens"] == 24 and "speculation" not in figures and "accepted_tokens" not in figures
