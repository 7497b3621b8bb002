"""The official `openai` client's Responses API against a real server: text streamed and not, the SDK's stream
helper, instructions, a function-call round trip through input items, usage, and errors."""
import json

import httpx
import pytest

from tests.server.conftest import API_KEY

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m"
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ASK_WEATHER = "What is the weather in Paris right now?"


def test_text_response_has_output_text_and_usage(client):
    r = client.responses.create(model=MODEL, input="Write a haiku about the sea.", max_output_tokens=12,
                                temperature=0, instructions="Answer briefly.")
    assert r.object == "response" and r.id.startswith("resp_") and r.output_text
    assert r.status in ("completed", "incomplete") and r.output[0].type == "message"
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 12
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens == 0


def test_max_output_tokens_makes_the_response_incomplete(client):
    r = client.responses.create(model=MODEL, input="Write a long story.", max_output_tokens=3, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


def test_stream_events_and_text_match_the_plain_response(client):
    kw = dict(model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": "Say hello."}]}],
              max_output_tokens=10, temperature=0)
    plain = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == f"response.{plain.status}" and "response.output_text.delta" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == plain.output_text == events[-1].response.output_text


def test_stream_helper_gives_the_final_response_of_a_function_call(client):
    kw = dict(model=MODEL, input=ASK_WEATHER, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
              temperature=0, max_output_tokens=80)
    plain = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    (a,), (b,) = ([o for o in r.output if o.type == "function_call"] for r in (plain, final))
    assert a.name == b.name == "get_weather" and json.loads(a.arguments) == json.loads(b.arguments)
    assert b.call_id.startswith("call_") and b.status == "completed"


def test_function_call_round_trip_through_input_items(client):
    first = client.responses.create(model=MODEL, input=ASK_WEATHER, tools=[WEATHER], temperature=0,
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=80)
    (call,) = [o for o in first.output if o.type == "function_call"]
    items = [{"role": "user", "content": ASK_WEATHER},
             {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature_c": 21}'}]
    second = client.responses.create(model=MODEL, input=items, tools=[WEATHER], temperature=0, max_output_tokens=12)
    assert second.usage.input_tokens > first.usage.input_tokens and second.output


def test_codex_style_request_is_accepted(client):
    """Fields a stateless server ignores, developer messages, and a reasoning item from an earlier turn."""
    r = client.responses.create(
        model=MODEL, instructions="You are a coding agent.", store=False, parallel_tool_calls=False,
        include=["reasoning.encrypted_content"], reasoning={"effort": "low"}, prompt_cache_key="k", tools=[WEATHER],
        input=[{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
               {"type": "reasoning", "id": "rs_1", "summary": []},
               {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
        max_output_tokens=4, temperature=0)
    assert r.usage.output_tokens > 0


def test_codex_tools_a_namespace_is_offered_and_hosted_tools_are_left_out(client):
    """Codex CLI 0.171 groups its sub-agent tools in a namespace and adds web_search, which OpenAI's servers run: the
    namespace's functions are offered (a call names its namespace), the hosted tool is left out, not refused."""
    subagents = {"type": "namespace", "name": "multi_agent_v1", "description": "Tools for sub-agents.",
                 "tools": [{"type": "function", "name": "spawn_agent", "description": "Start a sub-agent on a task",
                            "parameters": {"type": "object", "properties": {"task": {"type": "string"}},
                                           "required": ["task"]}}]}
    r = client.responses.create(model=MODEL, input="Start a sub-agent that lists the files.", temperature=0,
                                tools=[WEATHER, subagents, {"type": "web_search", "external_web_access": False}],
                                tool_choice={"type": "function", "name": "spawn_agent"}, max_output_tokens=80)
    (call,) = [o.to_dict() for o in r.output if o.type == "function_call"]
    assert call["name"] == "spawn_agent" and call["namespace"] == "multi_agent_v1" and "task" in json.loads(
        call["arguments"])
    plain = client.responses.create(model=MODEL, input=ASK_WEATHER, tools=[WEATHER], tool_choice="required",
                                    temperature=0, max_output_tokens=80)
    assert all("namespace" not in o.to_dict() for o in plain.output)


@pytest.mark.parametrize("fields, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),  # stateless
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, "input.0.call_id"),
    ({"input": [{"type": "input_image", "image_url": "data:,"}]}, None),
    ({"tools": [WEATHER, {"type": "namespace", "name": "more", "tools": [WEATHER]}]}, "tools"),  # one name twice
    ({"tools": [{"type": "web_search"}] * 129}, None),  # over OpenAI's 128, left out or not
    ({"tools": [{"type": "namespace", "name": "many", "tools": [{"type": "function", "name": f"f{i}"}
                                                              for i in range(129)]}]}, None),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"model": "gpt-9"}, "model"),
])
def test_bad_request_is_a_4xx_openai_error(server, fields, param):
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 4, **fields}
    r = httpx.post(f"{server.base_url}/v1/responses", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == (404 if "model" in fields else 400), r.text
    error = r.json()["error"]
    assert error["message"] and (param is None or error["param"] == param)
    assert server.healthy()
