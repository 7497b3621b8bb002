"""Harmony replies (gpt-oss): analysis as reasoning, final and preambles as content, messages to functions.NAME as
calls, split anywhere; and what openai-harmony renders, read back as it parses it."""
import json

import pytest

from fastdecode.server.formats import HarmonyParser, tool_format
from tests.helpers.harmony import harmony_encoding
from tests.server.formats.replay import run_every_split

TOOLS = {"get_weather": None}
ANALYSIS = "<|channel|>analysis<|message|>User wants weather.<|end|>"


def parser():
    return HarmonyParser(TOOLS)


@pytest.mark.parametrize("text, events", [
    # analysis, then the answer (<|return|> is a stop token: the text ends before it)
    (ANALYSIS + "<|start|>assistant<|channel|>final<|message|>Sunny.",
     [("reasoning", "User wants weather."), ("content", "Sunny.")]),
    # analysis, then a call, as gpt-oss writes one (<|call|> stops it)
    (ANALYSIS + '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                '{"city": "Paris"}',
     [("reasoning", "User wants weather."), ("tool_call", ("get_weather", {"city": "Paris"}))]),
    # the recipient before the channel, as gpt-oss's template renders past calls
    ('<|channel|>analysis<|message|>a<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json'
     '<|message|>{"city": "Oslo"}', [("reasoning", "a"), ("tool_call", ("get_weather", {"city": "Oslo"}))]),
    # a preamble on commentary before the call is the answer's text
    ('<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary '
     'to=functions.get_weather <|constrain|>json<|message|>{}', [("content", "Checking."),
                                                                 ("tool_call", ("get_weather", {}))]),
    ("<|channel|>final<|message|>Hi <b>there</b>", [("content", "Hi <b>there</b>")]),  # markup-like text passes
    ("<|channel|>analysis<|message|>cut off while thinki", [("reasoning", "cut off while thinki")]),  # max_tokens
    ('{"answer": 42}', [("content", '{"answer": 42}')]),  # no header at all (a grammar spelled the reply)
])
def test_messages_split_at_every_point_parse_the_same(text, events):
    assert run_every_split(parser, text) == events


@pytest.mark.parametrize("text", [
    '<|channel|>commentary to=functions.rm_rf <|constrain|>json<|message|>{"path": "/"}',  # not an offered tool
    '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": ',  # cut by max_tokens
    '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>["Paris"]',  # not an object
])
def test_malformed_call_is_its_body_as_content(text):
    assert run_every_split(parser, text) == [("content", text.partition("<|message|>")[2])]


def test_a_header_cut_by_the_end_of_the_reply_says_nothing():
    assert run_every_split(parser, ANALYSIS + "<|start|>assistant<|channel|>fin") == [
        ("reasoning", "User wants weather.")]


def test_templates_that_render_channels_are_read_as_harmony():
    assert tool_format("{{ '<|start|>assistant<|channel|>final<|message|>' }}") is HarmonyParser


def reference_reply(messages):
    """The model's side of a conversation as openai-harmony renders it: the text after the prompt's
    `<|start|>assistant`, less the stop token that ends it, and the library's own parse of those tokens."""
    from openai_harmony import Conversation, RenderConversationConfig, Role
    enc = harmony_encoding()
    prompt = enc.render_conversation_for_completion(Conversation.from_messages(messages[:1]), Role.ASSISTANT)
    keep = RenderConversationConfig(auto_drop_analysis=False)  # the reply as said, before any later turn drops it
    whole = enc.render_conversation(Conversation.from_messages(messages), keep)
    assert whole[:len(prompt)] == prompt
    reply = whole[len(prompt):]
    if reply[-1] in enc.stop_tokens_for_assistant_actions():
        reply = reply[:-1]
    return enc.decode_utf8(reply), enc.parse_messages_from_completion_tokens(reply, Role.ASSISTANT)


def test_openai_harmony_reply_with_a_call_reads_back_as_its_messages():
    from openai_harmony import Message, Role
    arguments = '{"city":"Tokyo","days":3}'
    text, parsed = reference_reply([
        Message.from_role_and_content(Role.USER, "Weather in Tokyo for 3 days?"),
        Message.from_role_and_content(Role.ASSISTANT, "Need the weather tool.").with_channel("analysis"),
        Message.from_role_and_content(Role.ASSISTANT, arguments).with_channel("commentary")
        .with_recipient("functions.get_weather").with_content_type("<|constrain|>json")])
    events = run_every_split(parser, text)
    assert events == [("reasoning", "Need the weather tool."), ("tool_call", ("get_weather", json.loads(arguments)))]
    assert [(m.channel, m.recipient, m.content[0].text) for m in parsed] == [
        ("analysis", None, "Need the weather tool."), ("commentary", "functions.get_weather", arguments)]
    one = parser()
    calls = [value for kind, value in one.feed(text) + one.finish() if kind == "tool_call"]
    assert calls[0]["function"]["arguments"] == arguments  # as the model wrote them


def test_openai_harmony_reply_with_an_answer_reads_back_as_reasoning_and_content():
    from openai_harmony import Message, Role
    text, parsed = reference_reply([
        Message.from_role_and_content(Role.USER, "2+2?"),
        Message.from_role_and_content(Role.ASSISTANT, "Simple sum.").with_channel("analysis"),
        Message.from_role_and_content(Role.ASSISTANT, "It is **4**.\n").with_channel("final")])
    assert run_every_split(parser, text) == [("reasoning", parsed[0].content[0].text),
                                             ("content", parsed[1].content[0].text)]
