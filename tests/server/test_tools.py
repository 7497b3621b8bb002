"""Tool calls as text: parsed whole or split anywhere while streaming; the conversation a template sees."""
import json

import pytest

from fastdecode.server.tools import ToolCallParser, forced_call_grammar, template_messages

NAMES = ["get_weather", "get_time"]
HERMES = 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def parse(pieces, names=NAMES):
    """Events with adjacent content joined, so that the split points do not show."""
    parser, events = ToolCallParser(names), []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    out = []
    for kind, value in events:
        if out and kind == "content" and out[-1][0] == "content":
            out[-1] = ("content", out[-1][1] + value)
        else:
            out.append((kind, value))
    return out


def calls(events):
    return [(v["function"]["name"], json.loads(v["function"]["arguments"])) for k, v in events if k == "tool_call"]


def test_hermes_call_split_at_every_point_parses_the_same():
    for cut in range(1, len(HERMES)):
        events = parse([HERMES[:cut], HERMES[cut:]])
        assert events[0] == ("content", "Let me check. ") and calls(events) == [("get_weather", {"city": "Paris"})]


def test_character_by_character_stream_parses():
    assert calls(parse(list(HERMES))) == [("get_weather", {"city": "Paris"})]


def test_two_calls_get_distinct_ids():
    events = parse([HERMES + HERMES.replace("get_weather", "get_time")])
    ids = [v["id"] for k, v in events if k == "tool_call"]
    assert len(ids) == 2 and len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)


@pytest.mark.parametrize("text, expected", [
    ('{"name": "get_weather", "parameters": {"city": "Rome"}}', [("get_weather", {"city": "Rome"})]),  # Llama 3
    ('[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": "{\\"city\\": \\"X\\"}"}]',
     [("get_time", {}), ("get_weather", {"city": "X"})]),  # Mistral's list, arguments as a string
    ('<function=get_time>{"tz": "UTC"}</function>', [("get_time", {"tz": "UTC"})]),  # Llama 3.1 custom
    ('<tool_call>{"name": "get_time", "arguments": {}}', [("get_time", {})]),  # EOS before </tool_call>
])
def test_other_call_forms(text, expected):
    assert calls(parse([text])) == expected


@pytest.mark.parametrize("text", [
    '{"answer": 42}',  # JSON that is not a call stays content
    '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # not a tool we offered
    "<tool_call>not json</tool_call>",
    "a < b and <tool",  # looks like the start of a marker, never becomes one
])
def test_text_that_is_not_a_call_is_content_unchanged(text):
    assert parse([text]) == [("content", text)]


def test_template_without_tool_support_gets_hermes_text():
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "windy"}]
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    out = template_messages(messages, tools, knows_tools=False)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert "Be brief." in out[0]["content"] and "<tools>" in out[0]["content"] and "get_weather" in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert out[3]["content"].count("<tool_response>") == 2  # consecutive results merge into one turn


def test_template_with_tool_support_gets_the_conversation_with_parsed_arguments():
    messages = [{"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}, {"role": "tool", "content": "sunny"}]
    out = template_messages(messages, [{"type": "function", "function": {"name": "get_weather"}}], knows_tools=True)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"} and out[1]["role"] == "tool"


def test_forced_call_grammar_accepts_exactly_a_call_the_parser_reads():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    grammar = forced_call_grammar(tools)
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    state = grammar.start
    for ch in text:
        state = grammar.step(state, ch)
        assert state is not None
    assert grammar.done(state) and calls(parse([text])) == [("get_weather", {"city": "Oslo"})]


def test_consecutive_user_turns_merge_for_templates_that_need_alternation():
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                {"role": "assistant", "content": "c"}, {"role": "tool", "content": "r"}, {"role": "user", "content": "d"}]
    out = template_messages(messages, None, knows_tools=False)
    assert [(m["role"], m["content"]) for m in out] == [
        ("user", "a\nb"), ("assistant", "c"), ("user", "<tool_response>\nr\n</tool_response>\nd")]
