"""Each reply format end to end, through the official SDKs: a tiny model whose chat template teaches the format
says a scripted reply, and the server must hand it back as OpenAI tool_calls and reasoning_content, Anthropic
tool_use and thinking blocks, or Responses items, streamed and not, malformed calls as text and never a 500."""
import json

import pytest

from tests.server.scripted import chat_reply, scripted_server

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                  "required": ["city"]}
OPENAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "input_schema": WEATHER_SCHEMA}]
ASK = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
XML_CALL = ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
PARIS = {"city": "Paris", "days": 3}
MARKERS = ("<tool_call", "<function", "<parameter", "[TOOL_CALLS", "[ARGS", "<think", "</think")


def server(name):
    @pytest.fixture(scope="module")
    def running():
        with scripted_server(name) as (llm, base_url):
            llm.openai = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
            llm.claude = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
            llm.model = llm.llm.name
            yield llm
    return running


qwen3_coder, mistral, qwen3, deepseek_r1 = (server(n) for n in ("qwen3_coder", "mistral", "qwen3", "deepseek_r1"))


def chat(llm, script, stream=False, **kw):
    return chat_reply(llm, script, MARKERS, stream, **{"messages": ASK, "tools": OPENAI_TOOLS, **kw})


@pytest.mark.parametrize("stream", [False, True])
def test_qwen3_coder_xml_call_is_openai_tool_calls_typed_by_the_schema(qwen3_coder, stream):
    assert chat(qwen3_coder, XML_CALL, stream) == ("Checking.\n", None, [("get_weather", PARIS)], "tool_calls")


@pytest.mark.parametrize("stream", [False, True])
def test_qwen3_coder_call_is_an_anthropic_tool_use_block(qwen3_coder, stream):
    qwen3_coder.script = XML_CALL
    kw = dict(model=qwen3_coder.model, max_tokens=400, messages=ASK, tools=ANTHROPIC_TOOLS)
    if stream:
        with qwen3_coder.claude.messages.stream(**kw) as s:
            m = s.get_final_message()
    else:
        m = qwen3_coder.claude.messages.create(**kw)
    assert [b.type for b in m.content] == ["text", "tool_use"] and m.stop_reason == "tool_use"
    assert m.content[0].text == "Checking.\n" and m.content[1].name == "get_weather" and m.content[1].input == PARIS


def test_qwen3_coder_earlier_call_and_result_render_and_the_answer_is_text(qwen3_coder):
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                      "function": {"name": "get_weather", "arguments": json.dumps(PARIS)}}]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    assert chat(qwen3_coder, "Sunny, 21 C.", messages=history) == ("Sunny, 21 C.", None, [], "stop")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("script", [
    "<tool_call>\n<function=get_weather>\nno parameters here\n</function>\n</tool_call>",  # text outside a value
    "<tool_call>\n<function=get_forecast>\n</function>\n</tool_call>",  # not an offered tool
])
def test_qwen3_coder_malformed_call_is_text(qwen3_coder, script, stream):
    llm = qwen3_coder
    llm.script = script
    if stream:  # the leak check does not apply: the malformed call is the text
        chunks = list(llm.openai.chat.completions.create(model=llm.model, messages=ASK, tools=OPENAI_TOOLS,
                                                         stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == script and chunks[-1].choices[0].finish_reason == "stop"
    else:
        assert chat(llm, script) == (script, None, [], "stop")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("script", [
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}',
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
])
def test_mistral_calls_are_openai_tool_calls(mistral, script, stream):
    assert chat(mistral, script, stream) == (None, None, [("get_weather", PARIS)], "tool_calls")


def test_mistral_malformed_call_is_text_with_its_marker(mistral):
    script = '[TOOL_CALLS]get_weather[ARGS]{"city": '
    assert chat(mistral, script) == (script, None, [], "stop")


def test_mistral_round_trip_gives_its_template_the_ids_it_accepts(mistral):
    """The template refuses ids that are not 9 letters or digits; OpenAI's and Anthropic's ids are longer."""
    mistral.script = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
    first = mistral.claude.messages.create(model=mistral.model, max_tokens=200, messages=ASK, tools=ANTHROPIC_TOOLS)
    (call,) = [b for b in first.content if b.type == "tool_use"]
    mistral.script = "Sunny."
    history = ASK + [{"role": "assistant", "content": first.content}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}]}]
    second = mistral.claude.messages.create(model=mistral.model, max_tokens=200, tools=ANTHROPIC_TOOLS,
                                            messages=history)
    assert second.content[0].text == "Sunny." and second.stop_reason == "end_turn"
    # A forced call is written in the Hermes form, but the history still goes to Mistral's template
    assert mistral.claude.messages.count_tokens(model=mistral.model, tools=ANTHROPIC_TOOLS, messages=history,
                                                tool_choice={"type": "any"}).input_tokens > 0


REASONED_CALL = ('<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n'
                 '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>')


@pytest.mark.parametrize("stream", [False, True])
def test_qwen3_reasoning_is_reasoning_content_beside_tool_calls(qwen3, stream):
    assert chat(qwen3, REASONED_CALL, stream) == (None, "The user wants the weather.", [("get_weather", PARIS)],
                                                  "tool_calls")


@pytest.mark.parametrize("stream", [False, True])
def test_qwen3_reasoning_without_tools_is_reasoning_content_then_content(qwen3, stream):
    assert chat(qwen3, "<think>\nA greeting.\n</think>\n\nHello!", stream, tools=None) == (
        "Hello!", "A greeting.", [], "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_deepseek_r1_reply_starts_inside_the_reasoning(deepseek_r1, stream):
    assert chat(deepseek_r1, "Two and two.\n</think>\n\nFour.", stream, tools=None) == (
        "Four.", "Two and two.", [], "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_tokens_are_counted_in_usage(qwen3, stream):
    qwen3.script = "<think>\nThe user says hello, so a greeting back.\n</think>\n\nHello!"
    kw = dict(model=qwen3.model, messages=ASK)
    if stream:
        *_, last = qwen3.openai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
        used = last.usage
    else:
        used = qwen3.openai.chat.completions.create(**kw).usage
    reasoning = used.completion_tokens_details.reasoning_tokens
    assert 0 < reasoning < used.completion_tokens
    assert qwen3.openai.responses.create(model=qwen3.model, input="Hi").usage.output_tokens_details.reasoning_tokens \
        == reasoning
    qwen3.script = "Hello!"
    assert qwen3.openai.chat.completions.create(**kw).usage.completion_tokens_details.reasoning_tokens == 0


def test_qwen3_reasoning_is_an_anthropic_thinking_block_with_a_signature(qwen3):
    qwen3.script = REASONED_CALL
    kw = dict(model=qwen3.model, max_tokens=400, messages=ASK, tools=ANTHROPIC_TOOLS)
    plain = qwen3.claude.messages.create(**kw)
    assert [b.type for b in plain.content] == ["thinking", "tool_use"] and plain.stop_reason == "tool_use"
    assert plain.content[0].thinking == "The user wants the weather." and plain.content[0].signature
    assert plain.content[1].input == PARIS
    with qwen3.claude.messages.stream(**kw) as s:
        kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in s]
        final = s.get_final_message()
    assert ("content_block_delta", "thinking_delta") in kinds and ("content_block_delta", "signature_delta") in kinds
    assert [b.type for b in final.content] == ["thinking", "tool_use"] and final.stop_reason == "tool_use"
    assert final.content[0].thinking == plain.content[0].thinking and final.content[1].input == PARIS
    assert final.content[0].signature == plain.content[0].signature


def test_qwen3_reasoning_is_a_responses_reasoning_item(qwen3):
    qwen3.script = "<think>\nA greeting.\n</think>\n\nHello!"
    plain = qwen3.openai.responses.create(model=qwen3.model, input="Hi")
    assert [i.type for i in plain.output] == ["reasoning", "message"] and plain.output_text == "Hello!"
    assert plain.output[0].content[0].text == "A greeting."
    with qwen3.openai.responses.stream(model=qwen3.model, input="Hi") as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert "response.reasoning_text.delta" in kinds and final.output_text == "Hello!"
    assert [i.type for i in final.output] == ["reasoning", "message"]


def test_reasoning_turned_off_through_the_template_by_each_api(qwen3):
    """Qwen3's template renders an empty reasoning block when enable_thinking is false: reasoning_effort none or
    chat_template_kwargs on Chat Completions, no `thinking` (or a disabled one) on Messages, reasoning.effort on
    Responses; the reply then is content from its first token."""
    qwen3.script = "Hello!"
    tokens = lambda **kw: qwen3.openai.chat.completions.create(  # noqa: E731
        model=qwen3.model, messages=ASK, max_tokens=1, **kw).usage.prompt_tokens
    counted = lambda **kw: qwen3.claude.messages.count_tokens(  # noqa: E731
        model=qwen3.model, messages=ASK, **kw).input_tokens
    responses = lambda **kw: qwen3.openai.responses.create(  # noqa: E731
        model=qwen3.model, input=ASK, max_output_tokens=1, **kw).usage.input_tokens
    on = tokens()
    off = tokens(reasoning_effort="none")
    assert off > on
    assert tokens(reasoning_effort="minimal") == off and tokens(reasoning_effort="high") == on
    assert tokens(extra_body={"chat_template_kwargs": {"enable_thinking": False}}) == off
    assert counted() == off == counted(thinking={"type": "disabled"})
    assert counted(thinking={"type": "adaptive"}) == on == counted(thinking={"type": "enabled", "budget_tokens": 2048})
    assert responses(reasoning={"effort": "minimal"}) == off and responses(reasoning={"effort": "low"}) == on
    assert chat(qwen3, "Hello!", tools=None, reasoning_effort="none") == ("Hello!", None, [], "stop")
    with pytest.raises(openai.BadRequestError, match="may not set messages"):
        tokens(extra_body={"chat_template_kwargs": {"messages": []}})
