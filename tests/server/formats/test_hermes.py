"""Hermes/Qwen2.5 calls and the JSON forms read beside them, parsed whole or split anywhere while streaming."""
import pytest

from fastdecode.server.formats import HermesParser
from tests.server.formats.replay import run_every_split

TOOLS = {"get_weather": None, "get_time": None}
HERMES = 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def parser():
    return HermesParser(TOOLS)


def test_hermes_call_split_at_every_point_parses_the_same():
    assert run_every_split(parser, HERMES) == [("content", "Let me check. "),
                                               ("tool_call", ("get_weather", {"city": "Paris"}))]


def test_two_calls_get_distinct_ids_and_no_text_between_them():
    p = parser()
    events = p.feed(HERMES + "\n" + HERMES.replace("Let me check. ", "").replace("get_weather", "get_time") + "\n")
    events += p.finish()
    ids = [v["id"] for k, v in events if k == "tool_call"]
    assert len(ids) == 2 and len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)
    assert [k for k, _ in events] == ["content", "tool_call", "tool_call"]  # the newlines are not text


@pytest.mark.parametrize("text, expected", [
    ('{"name": "get_weather", "parameters": {"city": "Rome"}}', [("get_weather", {"city": "Rome"})]),  # Llama 3
    ('[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": "{\\"city\\": \\"X\\"}"}]',
     [("get_time", {}), ("get_weather", {"city": "X"})]),  # a list, arguments as a string
    ('<function=get_time>{"tz": "UTC"}</function>', [("get_time", {"tz": "UTC"})]),  # Llama 3.1 custom
    ('<tool_call>{"name": "get_time", "arguments": {}}', [("get_time", {})]),  # EOS before </tool_call>
])
def test_other_call_forms(text, expected):
    assert run_every_split(parser, text) == [("tool_call", call) for call in expected]


@pytest.mark.parametrize("text", [
    '{"answer": 42}',  # JSON that is not a call stays content
    '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # not a tool we offered
    "<tool_call>not json</tool_call>",
    "a < b and <tool",  # looks like the start of a marker, never becomes one
    "  \n",  # whitespace only
])
def test_text_that_is_not_a_call_is_content_unchanged(text):
    assert run_every_split(parser, text) == [("content", text)]


@pytest.mark.parametrize("text", ["<tool_call>" + "[" * 100_000 + "</tool_call>", "[" * 100_000])
def test_json_nested_past_the_stack_is_text_not_an_error(text):
    """A reply can nest brackets deeper than the JSON decoder's recursion (a request can force one with logit_bias):
    it is content, never a failed request."""
    p = parser()
    events = p.feed(text) + p.finish()
    assert [k for k, _ in events] == ["content"] * len(events) and "".join(v for _, v in events) == text
