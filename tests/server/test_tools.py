"""Tools in the prompt: the conversation a template sees (the grammars of calls: tests/server/formats/)."""
from fastdecode.server.formats import MistralParser
from fastdecode.server.tools import template_messages


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


def test_consecutive_user_turns_merge_for_templates_that_need_alternation():
    messages = [{"role": "developer", "content": "s"}, {"role": "system", "content": "t"},  # Codex: two developer
                {"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                {"role": "assistant", "content": "c"}, {"role": "tool", "content": "r"}, {"role": "user", "content": "d"}]
    out = template_messages(messages, None, knows_tools=False)
    assert [(m["role"], m["content"]) for m in out] == [
        ("system", "s\nt"), ("user", "a\nb"), ("assistant", "c"), ("user", "<tool_response>\nr\n</tool_response>\nd")]


def test_call_ids_are_rewritten_for_templates_that_need_their_own():
    messages = [{"role": "assistant", "content": None, "tool_calls": [{"id": "call_0123456789", "type": "function",
                                                                       "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_0123456789", "content": "ok"}]
    out = template_messages(messages, [{"type": "function", "function": {"name": "f"}}], knows_tools=True,
                            call_id=MistralParser.template_call_id)
    assert out[0]["tool_calls"][0]["id"] == out[1]["tool_call_id"] == "123456789"
