"""Messages API requests -> the Chat Completions request that means the same (no model needed)."""
import pytest

from fastdecode.server.anthropic.convert import chat_body
from fastdecode.server.anthropic.schemas import MessagesInput, MessagesRequest
from fastdecode.server.errors import ApiError

TOOL = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def convert(**fields):
    return chat_body(MessagesRequest.model_validate({"model": "m", "max_tokens": 8, **fields}))


def test_system_blocks_become_one_system_message():
    body = convert(system=[{"type": "text", "text": "a"}, {"type": "text", "text": "b", "cache_control": {}}],
                   messages=[{"role": "user", "content": "hi"}])
    assert [(m.role, m.content) for m in body.messages] == [("system", "a\nb"), ("user", "hi")]


def test_tool_use_and_results_become_tool_calls_and_tool_messages():
    body = convert(tools=[TOOL], messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                     {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                      "content": [{"type": "text", "text": "timeout"}]},
                                     {"type": "text", "text": "and tomorrow?"}]}])
    roles = [m.role for m in body.messages]
    assert roles == ["user", "assistant", "tool", "tool", "user"]
    call = body.messages[1].tool_calls[0]
    assert body.messages[1].content is None and body.messages[1].reasoning_content == "hmm"  # thinking: reasoning
    assert (call.id, call.function.name, call.function.arguments) == ("toolu_1", "get_weather", '{"city": "Oslo"}')
    assert [m.content for m in body.messages[2:]] == ["sunny", "Error: timeout", "and tomorrow?"]
    assert body.tools[0].function.parameters == TOOL["input_schema"]


@pytest.mark.parametrize("choice, expected", [({"type": "auto"}, "auto"), ({"type": "any"}, "required"),
                                              ({"type": "none"}, "none")])
def test_tool_choice_maps_to_openais(choice, expected):
    assert convert(tools=[TOOL], tool_choice=choice, messages=[{"role": "user", "content": "x"}]).tool_choice == \
        expected


def test_named_tool_choice_and_sampling_fields():
    body = convert(tools=[TOOL], tool_choice={"type": "tool", "name": "get_weather"}, stop_sequences=["END"],
                   temperature=0.5, top_k=5, messages=[{"role": "user", "content": "x"}])
    assert body.tool_choice.function.name == "get_weather"
    assert (body.stop, body.temperature, body.top_k, body.max_tokens) == (["END"], 0.5, 5, 8)


def test_count_tokens_body_needs_no_max_tokens():
    body = chat_body(MessagesInput.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}]}))
    assert body.max_tokens is None


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": []}],  # empty turn
    [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope", "content": "x"}]}],  # unknown id
    [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x"}]}],  # result from the assistant
    [{"role": "user", "content": [{"type": "image", "source": {}}]}],  # images are not read
])
def test_bad_conversations_are_400(messages):
    with pytest.raises(ApiError) as e:
        convert(messages=messages)
    assert e.value.status == 400


def test_mid_conversation_system_message_stays_in_place_as_user_text():
    """Claude Code's `mid-conversation-system` beta puts a system message after the first user turn."""
    body = convert(system="top", messages=[{"role": "user", "content": "task"},
                                           {"role": "system", "content": [{"type": "text", "text": "agents: ..."}]}])
    assert [(m.role, m.content) for m in body.messages] == [("system", "top"), ("user", "task"),
                                                          ("user", "agents: ...")]


BILLING = "x-anthropic-billing-header: cc_version=2.1.197.8f6; cc_entrypoint=sdk-cli;"


@pytest.mark.parametrize("system, expected", [
    ([{"type": "text", "text": BILLING}, {"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
     [("system", "a\nb")]),  # Claude Code's first system block
    (BILLING + "\nBe brief.", [("system", "Be brief.")]),  # a string that starts with the header: its other lines stay
    ([{"type": "text", "text": f"{BILLING}\na"}, {"type": "text", "text": "b"}], [("system", "a\nb")]),  # one block
    ([{"type": "text", "text": BILLING}], []),  # the header alone: no system message at all
    ([{"type": "text", "text": f"a\n{BILLING}"}], [("system", f"a\n{BILLING}")]),  # not first: the model's to read
], ids=["first block", "string", "first line of a block", "header alone", "not first"])
def test_billing_header_is_left_out_of_the_system_message(system, expected):
    body = convert(system=system, messages=[{"role": "user", "content": "hi"}])
    assert [(m.role, m.content) for m in body.messages] == expected + [("user", "hi")]


def test_requests_differing_only_in_the_billing_header_convert_alike():
    """Its version suffix is a digest of the first user message: a new session's header differs from the last's."""
    def session(suffix):
        return convert(system=[{"type": "text", "text": BILLING.replace("8f6", suffix)},
                               {"type": "text", "text": "You are a coding agent."}],
                       tools=[TOOL], messages=[{"role": "user", "content": "x"}]).model_dump()
    assert session("8f6") == session("82c")
