"""Harmony (gpt-oss) end to end: the prompt a harmony template renders through the server equals openai-harmony's
rendering of the same conversation, and a tiny model whose scripted reply is harmony text is read back, through the
official SDKs, as reasoning_content and tool_calls, Anthropic thinking and tool_use blocks, and Responses items."""
import json
from datetime import datetime

import pytest

from fastdecode.server.prepare import ServedModel, chat_prompt
from fastdecode.server.schemas import ChatCompletionRequest
from tests.helpers.harmony import harmony_encoding
from tests.server.scripted import chat_reply, scripted_server

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "description": "The city"},
                                           "days": {"type": "integer"},
                                           "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}
TOOL = {"name": "get_weather", "description": "Gets the weather.", "parameters": SCHEMA}
ASK = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
PARIS = {"city": "Paris", "days": 3}
REASONED_CALL = ("<|channel|>analysis<|message|>User wants the weather.<|end|><|start|>assistant<|channel|>commentary "
                 'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 3}<|call|>')
REASONED_ANSWER = ("<|channel|>analysis<|message|>A greeting.<|end|><|start|>assistant<|channel|>final<|message|>"
                   "Hello!<|return|>")
MARKERS = ("<|", "analysis", "commentary")


@pytest.fixture(scope="module")
def harmony():
    with scripted_server("harmony") as (llm, base_url):
        llm.openai = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        llm.claude = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
        llm.model = llm.llm.name
        yield llm


def rendered(llm, **body) -> str:
    """The prompt the server renders for a Chat Completions body."""
    prompt = chat_prompt(ChatCompletionRequest(model=llm.model, **body), ServedModel(llm.llm))
    return llm.llm.tokenizer.decode(prompt.ids)


def reference(messages, effort: str) -> str:
    """openai-harmony's prompt for the same conversation: system, developer (instructions and tools), the turns."""
    from openai_harmony import (Author, Conversation, DeveloperContent, Message, ReasoningEffort, Role,
                                SystemContent, ToolDescription)
    system = SystemContent.new().with_reasoning_effort(ReasoningEffort(effort.capitalize())) \
        .with_conversation_start_date(datetime.now().strftime("%Y-%m-%d"))
    developer = DeveloperContent.new().with_instructions("Be brief.").with_function_tools(
        [ToolDescription.new(TOOL["name"], TOOL["description"], parameters=SCHEMA)])
    out = [Message.from_role_and_content(Role.SYSTEM, system), Message.from_role_and_content(Role.DEVELOPER, developer)]
    for role, *rest in messages:
        if role == "call":
            out.append(Message.from_role_and_content(Role.ASSISTANT, rest[0]).with_channel("commentary")
                       .with_recipient("functions.get_weather").with_content_type("<|constrain|>json"))
        elif role == "result":
            out.append(Message.from_author_and_content(Author.new(Role.TOOL, "functions.get_weather"), rest[0])
                       .with_channel("commentary").with_recipient("assistant"))
        elif role in ("analysis", "final"):
            out.append(Message.from_role_and_content(Role.ASSISTANT, rest[0]).with_channel(role))
        else:
            out.append(Message.from_role_and_content(Role.USER, rest[0]))
    enc = harmony_encoding()
    return enc.decode_utf8(enc.render_conversation_for_completion(Conversation.from_messages(out), Role.ASSISTANT))


CALL_TURN = [{"role": "system", "content": "Be brief."}, *ASK,
             {"role": "assistant", "content": None, "reasoning_content": "Need the weather tool.", "tool_calls": [
                 {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                   "arguments": json.dumps(PARIS)}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'}]
CALL_TURN_REFERENCE = [("user", ASK[0]["content"]), ("analysis", "Need the weather tool."),
                       ("call", json.dumps(PARIS)), ("result", '{"sky": "clear"}')]


@pytest.mark.parametrize("effort", ["low", "high"])
def test_a_call_and_its_result_render_as_openai_harmony_renders_them(harmony, effort):
    """Mid-call, the call's reasoning stays in the prompt (the model goes on from it)."""
    assert rendered(harmony, messages=CALL_TURN, tools=[{"type": "function", "function": TOOL}],
                    reasoning_effort=effort) == reference(CALL_TURN_REFERENCE, effort)


def test_a_finished_turn_renders_as_openai_harmony_renders_it(harmony):
    """Once an answer follows, the call's reasoning is left out of later prompts."""
    messages = CALL_TURN + [{"role": "assistant", "content": "Clear skies."}, {"role": "user", "content": "Thanks"}]
    expected = reference(CALL_TURN_REFERENCE[:1] + CALL_TURN_REFERENCE[2:] + [("final", "Clear skies."),
                                                                               ("user", "Thanks")], "medium")
    assert rendered(harmony, messages=messages, tools=[{"type": "function", "function": TOOL}]) == expected


def test_a_preamble_beside_reasoning_joins_it_as_the_template_demands(harmony):
    """gpt-oss's template refuses a call's message with both text and reasoning."""
    messages = [*CALL_TURN[:2], {**CALL_TURN[2], "content": "Let me check."}, CALL_TURN[3]]
    assert "<|channel|>analysis<|message|>Need the weather tool.\n\nLet me check.<|end|>" in rendered(
        harmony, messages=messages, tools=[{"type": "function", "function": TOOL}])


def chat(llm, script, stream=False, **kw):
    tools = [{"type": "function", "function": TOOL}]
    return chat_reply(llm, script, MARKERS, stream, **{"messages": ASK, "tools": tools, **kw})


@pytest.mark.parametrize("stream", [False, True])
def test_analysis_and_call_are_reasoning_content_and_tool_calls(harmony, stream):
    """The reply goes on past <|end|> (an end-of-turn token in the vocabulary) and stops at <|call|>."""
    assert chat(harmony, REASONED_CALL + "<|start|>assistant", stream) == (
        None, "User wants the weather.", [("get_weather", PARIS)], "tool_calls")


@pytest.mark.parametrize("stream", [False, True])
def test_analysis_and_final_are_reasoning_content_and_content(harmony, stream):
    assert chat(harmony, REASONED_ANSWER, stream, tools=None) == ("Hello!", "A greeting.", [], "stop")


def test_reply_is_an_anthropic_thinking_block_and_tool_use_block(harmony):
    harmony.script = REASONED_CALL
    kw = dict(model=harmony.model, max_tokens=400, messages=ASK,
              tools=[{"name": TOOL["name"], "description": TOOL["description"], "input_schema": SCHEMA}])
    plain = harmony.claude.messages.create(**kw)
    with harmony.claude.messages.stream(**kw) as s:
        streamed = s.get_final_message()
    for m in (plain, streamed):
        assert [b.type for b in m.content] == ["thinking", "tool_use"] and m.stop_reason == "tool_use"
        assert m.content[0].thinking == "User wants the weather." and m.content[1].input == PARIS


def test_reply_is_a_responses_reasoning_item_and_function_call(harmony):
    harmony.script = REASONED_CALL
    kw = dict(model=harmony.model, input="Weather in Paris for 3 days?",
              tools=[{"type": "function", **TOOL}])
    plain = harmony.openai.responses.create(**kw)
    with harmony.openai.responses.stream(**kw) as s:
        streamed = s.get_final_response()
    for r in (plain, streamed):
        assert [i.type for i in r.output] == ["reasoning", "function_call"]
        assert r.output[0].content[0].text == "User wants the weather." and json.loads(r.output[1].arguments) == PARIS


def test_reasoning_given_back_by_each_api_renders_before_its_call(harmony):
    """An agent's next request carries the reply's reasoning back; the template shows it before the call."""
    harmony.script = REASONED_CALL
    first = harmony.openai.responses.create(model=harmony.model, input=ASK, tools=[{"type": "function", **TOOL}])
    call = first.output[1]
    history = ASK + [item.model_dump(exclude_none=True) for item in first.output] + [
        {"type": "function_call_output", "call_id": call.call_id, "output": "clear"}]
    harmony.script = "<|channel|>final<|message|>Clear.<|return|>"
    second = harmony.openai.responses.create(model=harmony.model, input=history, tools=[{"type": "function", **TOOL}])
    assert second.output_text == "Clear."
    tokens = lambda **kw: harmony.openai.chat.completions.create(  # noqa: E731
        model=harmony.model, max_tokens=1, tools=[{"type": "function", "function": TOOL}], **kw).usage.prompt_tokens
    with_reasoning = [*ASK, {"role": "assistant", "content": None, "reasoning_content": "User wants the weather.",
                             "tool_calls": [{"id": call.call_id, "type": "function", "function": {
                                 "name": "get_weather", "arguments": call.arguments}}]},
                      {"role": "tool", "tool_call_id": call.call_id, "content": "clear"}]
    without = [with_reasoning[0], {**with_reasoning[1], "reasoning_content": None}, with_reasoning[2]]
    assert tokens(messages=with_reasoning) > tokens(messages=without)
    assert second.usage.input_tokens == tokens(messages=with_reasoning)


def test_reasoning_effort_reaches_the_template_from_each_api(harmony):
    """Chat's reasoning_effort, Responses' reasoning.effort, Anthropic's thinking (none: the lowest level)."""
    harmony.script = "<|channel|>final<|message|>Hi.<|return|>"
    def text(effort):
        return rendered(harmony, messages=ASK, **({"reasoning_effort": effort} if effort else {}))

    def tokens(effort):
        return len(harmony.llm.tokenizer.encode(text(effort), add_special_tokens=False))

    def counted(**kw):
        return harmony.claude.messages.count_tokens(model=harmony.model, messages=ASK, **kw).input_tokens

    assert "Reasoning: high" in text("high") and "Reasoning: medium" in text(None)
    assert "Reasoning: low" in text("minimal")  # gpt-oss cannot turn reasoning off
    assert counted() == tokens("low")
    assert counted(thinking={"type": "enabled", "budget_tokens": 2048}) == tokens("medium")
    assert harmony.openai.responses.create(model=harmony.model, input=ASK, max_output_tokens=1, reasoning={
        "effort": "high"}).usage.input_tokens == tokens("high")
