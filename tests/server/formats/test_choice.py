"""The format is chosen from what the chat template renders, and a parser per response comes from it."""
from fastdecode.server.formats import (
    HermesParser,
    MistralParser,
    Qwen3CoderParser,
    ReasoningParser,
    ReplyFormat,
    reasoning_in,
    tool_format,
)
from tests.helpers.chat_models import TEMPLATES


def test_tool_format_follows_the_templates_markers():
    assert tool_format(TEMPLATES["qwen3_coder"]) is Qwen3CoderParser
    assert tool_format(TEMPLATES["mistral"]) is MistralParser
    assert tool_format(TEMPLATES["qwen3"]) is HermesParser  # <tool_call> with JSON
    assert tool_format(None) is HermesParser  # no template: the tools-in-the-system-message prompt


def test_reasoning_follows_the_template_and_the_end_of_the_prompt():
    assert reasoning_in(TEMPLATES["qwen3"], "<|im_start|>assistant\n") == "tags"
    assert reasoning_in(TEMPLATES["deepseek_r1"], "<|Assistant|><think>\n") == "inside"
    assert reasoning_in(TEMPLATES["qwen3"], "<think>\n\n</think>\n\n") == "tags"  # thinking switched off
    assert reasoning_in(TEMPLATES["mistral"], "[/INST]") is None


def test_reply_format_builds_a_fresh_parser_chain():
    reply = ReplyFormat(MistralParser, {"f": None}, "tags")
    first, second = reply.parser(), reply.parser()
    assert isinstance(first, ReasoningParser) and isinstance(first.answer, MistralParser)
    assert first is not second and first.answer is not second.answer
    assert reply.special_markers == ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")
    assert isinstance(ReplyFormat(HermesParser, {"f": None}).parser(), HermesParser)
