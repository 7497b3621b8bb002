"""Model output never crashes a response: whatever a model says, in whichever reply format (Hermes and reasoning
tags on Qwen3 and DeepSeek-R1's templates, Qwen3-Coder's XML, Mistral's, harmony), every API answers 200 with JSON
every client parses, streamed or not: no NaN, no lone surrogate, no error event, and every tool call's arguments a
JSON object. A call that cannot be written so stays text.

The findings first (each a 500, an error event or non-JSON arguments before), then a property-based fuzz of
arbitrary replies cut into arbitrary deltas. The reply is canned (tests/server/canned.py), so each request costs a
few milliseconds."""
from __future__ import annotations

import json
import math
from contextlib import ExitStack

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.canned import canned_client

FORMATS = ("qwen3", "deepseek_r1", "qwen3_coder", "mistral", "harmony")  # hermes + reasoning, ..., harmony
API_CALLS = ("chat", "responses", "messages")
PARAMETERS = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"}, "ok": {"type": "boolean"},
    "tags": {"type": "array"}, "opts": {"type": "object"}}}
WHAT = "Gets the weather."  # harmony's template renders every tool's description
ASK = [{"role": "user", "content": "Weather in Paris?"}]
DEEP = "[" * 960 + "]" * 960


@pytest.fixture(scope="module")
def servers():
    """format -> (llm, client), every format's app open for the module."""
    with ExitStack() as stack:
        yield {name: stack.enter_context(canned_client(name)) for name in FORMATS}


def request(api: str, model: str, stream: bool, tools: bool) -> tuple[str, dict]:
    body = {"model": model, "stream": stream}
    if api == "chat":
        return "/v1/chat/completions", {**body, "messages": ASK, **({"tools": [
            {"type": "function", "function": {"name": "get_weather", "description": WHAT, "parameters": PARAMETERS}}]} if tools else {})}
    if api == "responses":
        return "/v1/responses", {**body, "input": ASK, **({"tools": [
            {"type": "function", "name": "get_weather", "description": WHAT, "parameters": PARAMETERS}]} if tools else {})}
    return "/v1/messages", {**body, "max_tokens": 1000, "messages": ASK, **({"tools": [
        {"name": "get_weather", "description": WHAT, "input_schema": PARAMETERS}]} if tools else {})}


def plain(text: str):
    """`text` parsed as JSON that every client reads alike; fails the test on NaN, Infinity, a number past a
    double (1e999), a lone surrogate, or nesting past the stack."""
    def no_constant(name):
        raise AssertionError(f"{name} in the response's JSON: {text[:200]}")
    try:
        parsed = json.loads(text, parse_constant=no_constant)
    except RecursionError:
        raise AssertionError(f"JSON nested past the stack: {text[:200]}") from None
    stack = [parsed]
    while stack:
        value = stack.pop()
        if isinstance(value, float):
            assert math.isfinite(value), text[:200]
        elif isinstance(value, str):
            value.encode("utf-8")  # raises on a lone surrogate
        elif isinstance(value, dict):
            stack += [*value, *value.values()]
        elif isinstance(value, list):
            stack += value
    return parsed


def events(response) -> list[dict]:
    """The data of each Server-Sent Event, parsed (the [DONE] line left out)."""
    out = []
    for block in response.content.decode("utf-8").split("\n\n"):
        data = [line[len("data: "):] for line in block.split("\n") if line.startswith("data: ")]
        if data and data[0] != "[DONE]":
            out.append(plain(data[0]))
    return out


def arguments(text: str) -> dict:
    value = plain(text)
    assert isinstance(value, dict), text
    return value


def calls_in(api: str, stream: bool, response) -> list[tuple[str, dict]]:
    """The reply's tool calls as (name, arguments), once the response is well formed for its API."""
    assert response.status_code == 200, response.text[:500]
    if not stream:
        body = plain(response.content.decode("utf-8"))
        if api == "chat":
            message = body["choices"][0]["message"]
            return [(c["function"]["name"], arguments(c["function"]["arguments"])) for c in message.get("tool_calls")
                    or []]
        if api == "responses":
            assert body["status"] in ("completed", "incomplete")
            return [(i["name"], arguments(i["arguments"])) for i in body["output"] if i["type"] == "function_call"]
        assert body["stop_reason"] in ("end_turn", "tool_use", "max_tokens")
        return [(b["name"], b["input"]) for b in body["content"] if b["type"] == "tool_use"]
    stream_events = events(response)
    assert not any(e.get("type") == "error" or (api == "chat" and "error" in e) for e in stream_events), \
        stream_events[-1]
    if api == "chat":
        assert response.text.endswith("data: [DONE]\n\n")
        calls: dict[int, list[str]] = {}
        for e in stream_events:
            for delta in e["choices"][0]["delta"].get("tool_calls", []) if e["choices"] else []:
                name, args = calls.setdefault(delta["index"], ["", ""])
                calls[delta["index"]] = [name + (delta["function"].get("name") or ""),
                                         args + (delta["function"].get("arguments") or "")]
        return [(name, arguments(args)) for name, args in calls.values()]
    if api == "responses":
        assert stream_events[-1]["type"] in ("response.completed", "response.incomplete")
        return [(e["name"], arguments(e["arguments"])) for e in stream_events
                if e["type"] == "response.function_call_arguments.done"]
    assert stream_events[-1]["type"] == "message_stop"
    names = {e["index"]: e["content_block"]["name"] for e in stream_events
             if e["type"] == "content_block_start" and e["content_block"]["type"] == "tool_use"}
    partial = {i: "".join(e["delta"]["partial_json"] for e in stream_events if e["type"] == "content_block_delta"
                          and e["index"] == i and e["delta"]["type"] == "input_json_delta") for i in names}
    return [(names[i], arguments(partial[i])) for i in names]


def reply_in_every_api(served, script: str, cuts=(), tools: bool = True) -> dict:
    """(api, stream) -> the tool calls of `script`'s reply, once every API's response to it is well formed."""
    llm, client = served
    llm.script, llm.cuts = script, tuple(cuts)
    out = {}
    for api in API_CALLS:
        for stream in (False, True):
            path, body = request(api, llm.llm.name, stream, tools)
            calls = calls_in(api, stream, client.post(path, json=body))
            assert all(name == "get_weather" for name, _ in calls), calls
            out[api, stream] = calls
    return out


def hermes(value: str, name: str = '"get_weather"') -> str:
    return f'<tool_call>\n{{"name": {name}, "arguments": {{"opts": {value}}}}}\n</tool_call>'


def mistral(value: str) -> str:
    return f'[TOOL_CALLS]get_weather[ARGS]{{"opts": {value}}}'


def qwen3_coder(value: str, parameter: str = "opts") -> str:
    return (f"<tool_call>\n<function=get_weather>\n<parameter={parameter}>\n{value}\n</parameter>\n</function>\n"
            "</tool_call>")


def harmony(value: str) -> str:
    return ("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
            f'{{"opts": {value}}}<|call|>')


# Each kind of model output that crashed a response or gave non-JSON arguments: (format, reply), named.
FINDINGS = [pytest.param(name, script, id=label) for label, name, script in [
    ("hermes-name-list", "qwen3", hermes("{}", name='["get_weather"]')),  # `in names` raised TypeError
    ("hermes-name-object", "qwen3", hermes("{}", name='{"n": "get_weather"}')),
    ("mistral-name-list", "mistral", '[TOOL_CALLS][{"name": ["get_weather"], "arguments": {}}]'),
    ("mistral-name-object", "mistral", '[TOOL_CALLS][{"name": {"n": 1}, "arguments": {}}]'),
    ("qwen3_coder-tuple-key", "qwen3_coder", qwen3_coder("{(1, 2): 3}")),  # Python literals JSON cannot write
    ("qwen3_coder-bytes", "qwen3_coder", qwen3_coder("{'a': b'x'}")),
    ("qwen3_coder-complex", "qwen3_coder", qwen3_coder("{'a': 1j}")),
    ("qwen3_coder-set", "qwen3_coder", qwen3_coder("[{1, 2}]", "tags")),
    ("qwen3_coder-surrogate", "qwen3_coder", qwen3_coder('{"a": "\\ud800"}')),
    ("hermes-surrogate", "qwen3", hermes('"\\ud800"')),
    ("mistral-surrogate", "mistral", mistral('"\\udfff"')),
    ("harmony-surrogate", "harmony", harmony('"\\ud800"')),
    ("hermes-nan", "qwen3", hermes("NaN")),
    ("hermes-1e999", "qwen3", hermes("1e999")),
    ("hermes-minus-infinity", "qwen3", hermes("-Infinity")),
    ("mistral-nan", "mistral", mistral("NaN")),
    ("harmony-nan", "harmony", harmony("NaN")),
    ("harmony-1e999", "harmony", harmony("1e999")),
    ("reasoning-minus-infinity", "deepseek_r1", "Thinking.\n</think>\n\n" + hermes("-Infinity")),
    ("hermes-960-deep", "qwen3", hermes(DEEP)),
    ("mistral-960-deep", "mistral", mistral(DEEP)),
    ("harmony-960-deep", "harmony", harmony(DEEP)),
    ("qwen3_coder-960-deep", "qwen3_coder", qwen3_coder(DEEP, "tags")),
]]


@pytest.mark.parametrize("name, script", FINDINGS)
def test_hostile_call_gives_a_well_formed_response_in_every_api(servers, name, script):
    calls = reply_in_every_api(servers[name], script)
    assert len({json.dumps(c, sort_keys=True) for c in calls.values()}) == 1, calls  # the same reply everywhere


def test_plain_calls_still_come_back_as_calls(servers):
    """The checks leave good calls alone: one per format, its arguments typed as written."""
    paris = [("get_weather", {"opts": {"city": "Paris", "days": [3]}})]
    for name, script in [("qwen3", hermes('{"city": "Paris", "days": [3]}')),
                         ("mistral", mistral('{"city": "Paris", "days": [3]}')),
                         ("qwen3_coder", qwen3_coder('{"city": "Paris", "days": [3]}')),
                         ("qwen3_coder", qwen3_coder("{'city': 'Paris', 'days': [3]}")),
                         ("harmony", harmony('{"city": "Paris", "days": [3]}'))]:
        calls = reply_in_every_api(servers[name], script)
        assert all(c == paris for c in calls.values()), (name, script, calls)


# What a fuzzed reply is made of: calls in the format's own shells (and the others') around hostile values, every
# format's markup, JSON and Python fragments, and any text (lone surrogates aside: the detokenizer never yields them).
HOSTILE = ["NaN", "Infinity", "-Infinity", "1e999", "-1e400", "1" + "0" * 400, '"\\ud800"', '"\\udc00\\ud800"',
           DEEP, "{(1, 2): 3}", "b'x'", "1j", "{1, 2}", "[(1, 2)]", "{[1]: 2}", "{'a': None}", "...", "9" * 5000,
           '{"a": 1}', "[1, 2]", '"Paris"', "3", "true", "null", "{", "[", '"']
MARKUP = ["<tool_call>", "</tool_call>", "<function=get_weather>", "<function=nope>", "</function>", "<parameter=opts>",
          "<parameter=tags>", "<parameter=days>", "<parameter=temp>", "<parameter=ok>", "<parameter=city>",
          "</parameter>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "get_weather", "<|channel|>", "analysis", "final",
          "commentary", " to=functions.get_weather", " to=functions.nope", "<|constrain|>json", "<|message|>",
          "<|end|>", "<|start|>assistant", "<|call|>", "<|return|>", "<think>", "</think>", "\n", " ", "{", "}", "[",
          "]", '"', ":", ",", '{"name": "get_weather", "arguments": ', '{"name": ', '"arguments": ', '"parameters": ',
          '"opts": ', '["get_weather"]']
HERMES_SHELLS = [hermes, lambda v: hermes("{}", name=v), lambda v: f'<function=get_weather>{{"opts": {v}}}</function>',
                 lambda v: f'{{"name": "get_weather", "arguments": {{"opts": {v}}}}}']  # the last: a bare call
SHELLS = {"qwen3": HERMES_SHELLS, "deepseek_r1": HERMES_SHELLS,
          "qwen3_coder": [qwen3_coder, *(lambda v, p=p: qwen3_coder(v, p) for p in ("tags", "temp", "days", "ok"))],
          "mistral": [mistral, lambda v: f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {{"opts": {v}}}}}]',
                      lambda v: f'[TOOL_CALLS][{{"name": {v}, "arguments": {{}}}}]'],
          "harmony": [harmony, lambda v: f"<|channel|>analysis<|message|>{v}<|end|><|start|>assistant" + harmony(v)]}
EVERY_SHELL = [shell for shells in SHELLS.values() for shell in shells]
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
PIECES = st.one_of(st.sampled_from(MARKUP), st.sampled_from(HOSTILE), TEXT,
                   st.builds(lambda shell, v: shell(v), st.sampled_from(EVERY_SHELL), st.sampled_from(HOSTILE)))
REASONING = st.sampled_from(["", "<think>\nWhy.\n</think>\n\n", "Why.\n</think>\n\n"])  # so that a call follows


def scripts(name: str):
    """A reply: maybe reasoning, a few pieces, maybe a call in `name`'s own format, more pieces."""
    call = st.one_of(st.just(""), st.builds(lambda shell, v: shell(v), st.sampled_from(SHELLS[name]),
                                            st.sampled_from(HOSTILE)))
    return st.builds(lambda *parts: "".join(parts), REASONING, st.lists(PIECES, max_size=3).map("".join), call,
                     st.lists(PIECES, max_size=10).map("".join))


@pytest.mark.parametrize("name", FORMATS)
@settings(max_examples=100, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data(), cuts=st.lists(st.integers(0, 2000), max_size=10), tools=st.sampled_from([True, True, False]))
def test_any_reply_gives_a_well_formed_response_in_every_api(servers, name, data, cuts, tools):
    reply_in_every_api(servers[name], data.draw(scripts(name), label="script"), cuts, tools)
