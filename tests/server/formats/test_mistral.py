"""Mistral's [TOOL_CALLS] calls in both forms, parsed whole or split anywhere; malformed ones left as text."""
import pytest

from fastdecode.server.formats import MistralParser
from tests.server.formats.replay import run_every_split

TOOLS = {"get_weather": None, "get_time": None}


def parser():
    return MistralParser(TOOLS)


@pytest.mark.parametrize("text, calls", [
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', [("get_weather", {"city": "Paris"})]),  # Small 3.2
    ('[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}',
     [("get_weather", {"city": "Oslo"}), ("get_time", {})]),  # Magistral's ids, two calls
    ('[TOOL_CALLS] [{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "X"}}]',
     [("get_time", {}), ("get_weather", {"city": "X"})]),  # the older list
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Y"}, "id": "abcdefghi"}]',
     [("get_weather", {"city": "Y"})]),  # Nemo's list with ids
])
def test_calls_split_at_every_point_parse_the_same(text, calls):
    assert run_every_split(parser, text) == [("tool_call", c) for c in calls]


def test_text_before_the_calls_is_content():
    text = 'Checking.\n[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}\n'
    assert run_every_split(parser, text) == [("content", "Checking.\n"), ("tool_call", ("get_time", {"tz": "UTC"}))]


@pytest.mark.parametrize("text", [
    '[TOOL_CALLS]rm_rf[ARGS]{"path": "/"}',  # not a tool we offered
    '[TOOL_CALLS]get_weather[ARGS]{"city": ',  # cut by the end of the reply
    '[TOOL_CALLS]get_weather[ARGS]["Paris"]',  # arguments not an object
    "[TOOL_CALLS] is how I would call a tool",  # prose after the marker
    '[TOOL_CALLS] [{"name": "get_time"}, 3]',
    "[TOOL",  # half a marker at the end
])
def test_malformed_call_is_content_unchanged(text):
    assert run_every_split(parser, text) == [("content", text)]


def test_call_ids_become_what_mistral_templates_accept():
    assert MistralParser.template_call_id("call_0123456789abcdef") == "789abcdef"
    assert MistralParser.template_call_id("toolu_1-x") == "00toolu1x"  # short ids are padded
