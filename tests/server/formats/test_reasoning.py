"""Reasoning split from the answer: `<think>` opened by the reply or by the prompt, with and without tool calls,
whole or split anywhere."""
import pytest

from fastdecode.server.formats import HermesParser, Qwen3CoderParser, ReasoningParser
from tests.server.formats.replay import run_every_split

TOOLS = {"get_weather": {"type": "object", "properties": {"days": {"type": "integer"}}}}


def plain(inside=False):
    return lambda: ReasoningParser(None, inside)


def test_reasoning_then_answer():
    assert run_every_split(plain(), "<think>\nFirst, 2 < 3.\n</think>\n\nYes.") == [
        ("reasoning", "First, 2 < 3."), ("content", "Yes.")]


def test_reply_that_starts_inside_the_reasoning():
    assert run_every_split(plain(inside=True), "Hmm.\n\nOK.\n</think>\n\nDone.\n") == [
        ("reasoning", "Hmm.\n\nOK."), ("content", "Done.\n")]


def test_reasoning_then_a_hermes_call():
    text = '<think>\nUse the tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    assert run_every_split(lambda: ReasoningParser(HermesParser(TOOLS), False), text) == [
        ("reasoning", "Use the tool."), ("tool_call", ("get_weather", {}))]


def test_reasoning_then_an_xml_call():
    text = ("Use it.</think><tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n</function>\n"
            "</tool_call>")
    assert run_every_split(lambda: ReasoningParser(Qwen3CoderParser(TOOLS), True), text) == [
        ("reasoning", "Use it."), ("tool_call", ("get_weather", {"days": 3}))]


@pytest.mark.parametrize("text, inside, expected", [
    ("<think>\nStill going", False, [("reasoning", "Still going")]),  # cut by max_tokens while reasoning
    ("Just an answer.", False, [("content", "Just an answer.")]),
    ("<thin", False, [("content", "<thin")]),  # half a marker, then the end
    ("Text <think>x</think>", False, [("content", "Text <think>x</think>")]),  # not at the start: text
    ("<think></think>Answer", False, [("content", "Answer")]),  # empty reasoning
    ("", True, []),
])
def test_edges(text, inside, expected):
    assert run_every_split(plain(inside), text) == expected
