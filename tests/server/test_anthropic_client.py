"""The official `anthropic` SDK against a real server: messages streamed and not, the SDK's stream helper, stop
sequences, a tool-use round trip, count_tokens, Claude Code's extra fields, errors in Anthropic's shape, and a
client that leaves."""
import threading
import time

import httpx
import pytest

from tests.server.conftest import API_KEY

anthropic = pytest.importorskip("anthropic")

MODEL = "smollm2-135m"
HELLO = [{"role": "user", "content": "Write a haiku about the sea."}]
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris right now?"}]
FORCE_WEATHER = {"type": "tool", "name": "get_weather"}
GREEDY = {"extra_body": {"temperature": 0}}  # the SDK no longer offers temperature; the API still takes it


@pytest.fixture()
def claude(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_message_has_text_usage_and_stop_reason(claude):
    m = claude.messages.create(model=MODEL, max_tokens=12, **GREEDY, messages=HELLO,
                               system=[{"type": "text", "text": "Answer briefly."}])
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL and m.id.startswith("msg_")
    assert m.content[0].type == "text" and text_of(m)
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    # Anthropic's input_tokens leaves out what the prefix cache held (an earlier test may have sent this prefix).
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens > 0 and 0 < m.usage.output_tokens <= 12


def test_max_tokens_ends_with_max_tokens(claude):
    m = claude.messages.create(model=MODEL, max_tokens=3, **GREEDY, messages=HELLO)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


def test_stream_helper_gives_the_same_message_as_a_plain_request(claude):
    plain = claude.messages.create(model=MODEL, max_tokens=16, **GREEDY, messages=HELLO, system="Be poetic.")
    with claude.messages.stream(model=MODEL, max_tokens=16, **GREEDY, messages=HELLO,
                                system="Be poetic.") as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text_of(final) == text_of(plain)
    assert final.stop_reason == plain.stop_reason and final.usage.output_tokens == plain.usage.output_tokens
    assert final.usage.input_tokens == plain.usage.input_tokens


def test_raw_stream_is_anthropics_event_sequence(claude):
    events = [e.type for e in claude.messages.create(model=MODEL, max_tokens=6, **GREEDY, messages=HELLO,
                                                     stream=True)]
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    assert events[1] == "content_block_start" and events[-3] == "content_block_stop"
    assert set(events[2:-3]) == {"content_block_delta"}  # pings are dropped by the SDK


def test_stop_sequence_is_reported(claude):
    base = text_of(claude.messages.create(model=MODEL, max_tokens=16, **GREEDY, messages=HELLO))
    word = base.split()[2]
    m = claude.messages.create(model=MODEL, max_tokens=16, **GREEDY, messages=HELLO, stop_sequences=[word])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == word
    assert base.startswith(text_of(m)) and word not in text_of(m)


def test_forced_tool_use_round_trip(claude):
    """The tool is forced (the tiny model would rarely call one); its result goes back and the model answers."""
    first = claude.messages.create(model=MODEL, max_tokens=80, **GREEDY, messages=ASK_WEATHER,
                                   tools=[WEATHER, TIME], tool_choice=FORCE_WEATHER)
    assert first.stop_reason == "tool_use"
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_") and isinstance(call.input, dict)
    conversation = ASK_WEATHER + [
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": [{"type": "text", "text": "21 C, clear sky"}]}]}]
    second = claude.messages.create(model=MODEL, max_tokens=16, **GREEDY, messages=conversation,
                                    tools=[WEATHER, TIME])
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    prompt = lambda m: m.usage.input_tokens + m.usage.cache_read_input_tokens  # noqa: E731
    assert prompt(second) > prompt(first) and second.usage.cache_read_input_tokens > 0  # the first turn, cached


def test_streamed_tool_use_parses_with_the_stream_helper(claude):
    kw = dict(model=MODEL, max_tokens=80, **GREEDY, messages=ASK_WEATHER, tools=[WEATHER],
              tool_choice={"type": "any", "disable_parallel_tool_use": True})
    plain = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds and final.stop_reason == "tool_use"
    (a,), (b,) = ([x for x in m.content if x.type == "tool_use"] for m in (plain, final))
    assert a.name == b.name == "get_weather" and a.input == b.input


def test_tool_result_error_and_tool_choice_none(claude):
    conversation = ASK_WEATHER + [
        {"role": "assistant", "content": [{"type": "text", "text": "Let me check."}, {
            "type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                      "content": "service down"}, {"type": "text", "text": "Try again?"}]}]
    m = claude.messages.create(model=MODEL, max_tokens=8, **GREEDY, messages=conversation, tools=[WEATHER],
                               tool_choice={"type": "none"})
    assert m.stop_reason in ("end_turn", "max_tokens") and all(b.type == "text" for b in m.content)


def test_count_tokens_matches_the_prompt_of_a_request(claude):
    kw = dict(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], system="You are a weather bot.")
    counted = claude.messages.count_tokens(**kw)
    m = claude.messages.create(**kw, max_tokens=2, **GREEDY)
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens > 0


def test_claude_codes_extra_fields_headers_and_beta_path_are_accepted(claude):
    m = claude.beta.messages.create(  # POST /v1/messages?beta=true with an anthropic-beta header
        model=MODEL, max_tokens=4, messages=HELLO, metadata={"user_id": "u1"},
        betas=["interleaved-thinking-2025-05-14"],
        extra_body={"temperature": 0, "top_p": 0.9, "top_k": 40, "thinking": {"type": "enabled", "budget_tokens": 1024},
                    "context_management": {"edits": []}, "output_config": {"effort": "low"}})
    assert m.usage.output_tokens > 0


def assert_anthropic_error(response: httpx.Response, status: int, kind: str):
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"]


BAD = {  # name: (body fields, status, error type)
    "missing max_tokens": ({"max_tokens": None}, 400, "invalid_request_error"),
    "zero max_tokens": ({"max_tokens": 0}, 400, "invalid_request_error"),
    "no messages": ({"messages": []}, 400, "invalid_request_error"),
    "unknown block type": ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, 400,
                           "invalid_request_error"),
    "image block": ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
                    "invalid_request_error"),
    "tool_use from the user": ({"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "get_time", "input": {}}]}]}, 400, "invalid_request_error"),
    "tool_result for an unknown id": ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}]}, 400, "invalid_request_error"),
    "tool_choice names no tool": ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, 400,
                                  "invalid_request_error"),
    "tool without input_schema": ({"tools": [{"name": "web_search", "type": "web_search_20250305"}]}, 400,
                                  "invalid_request_error"),
    "temperature above one": ({"temperature": 1.5}, 400, "invalid_request_error"),
    "prompt over the context": ({"messages": [{"role": "user", "content": "word " * 3000}]}, 400,
                                "invalid_request_error"),
    "unknown model": ({"model": "claude-opus-9"}, 404, "not_found_error"),
}


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60,
                      headers={"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}) as client:
        yield client


@pytest.mark.parametrize("name", BAD)
def test_bad_request_is_a_4xx_anthropic_error(server, http, name):
    fields, status, kind = BAD[name]
    body = {k: v for k, v in {"model": MODEL, "max_tokens": 4, "messages": HELLO, **fields}.items() if v is not None}
    assert_anthropic_error(http.post("/v1/messages", json=body), status, kind)
    assert server.healthy()


def test_sdk_raises_its_own_errors(server, claude):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_x", "content": "x"}]}])
    assert e.value.body["error"]["type"] == "invalid_request_error" and "toolu_x" in e.value.message
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=HELLO)
    bearer = anthropic.Anthropic(base_url=server.base_url, auth_token=API_KEY, max_retries=0, timeout=60)
    assert bearer.messages.count_tokens(model=MODEL, messages=HELLO).input_tokens > 0  # ANTHROPIC_AUTH_TOKEN


def test_oversize_body_and_unknown_route_are_anthropic_errors(http):
    huge = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x" * (9 * 2**20)}]}
    assert_anthropic_error(http.post("/v1/messages", json=huge), 413, "request_too_large")
    assert_anthropic_error(http.post("/v1/messages/nothing", json={}), 404, "not_found_error")


def test_client_that_leaves_mid_stream_frees_the_engine(server, claude):
    with claude.messages.stream(model=MODEL, max_tokens=1500,
                                messages=[{"role": "user", "content": "Write a very long story."}],
                                extra_body={"temperature": 0, "ignore_eos": True}) as stream:
        for i, _ in enumerate(stream.text_stream):
            if i == 3:
                break  # leaving the block closes the connection with ~1500 tokens to come
    start = time.monotonic()
    assert claude.messages.create(model=MODEL, max_tokens=4, **GREEDY, messages=HELLO).usage.output_tokens
    assert time.monotonic() - start < 15, "the abandoned request kept the engine"


def test_max_tokens_beyond_the_context_is_a_ceiling(small_server):
    """Claude Code asks for 32k tokens whatever the context: the reply may use what the context has left."""
    tiny = anthropic.Anthropic(base_url=small_server.base_url, api_key="unused", max_retries=0, timeout=120)
    m = tiny.messages.create(model=MODEL, max_tokens=32000, **GREEDY, messages=HELLO)
    assert m.stop_reason in ("end_turn", "model_context_window_exceeded")
    assert m.usage.input_tokens + m.usage.output_tokens <= 96


def test_full_queue_is_a_429_anthropic_error_with_retry_after(small_server):
    tiny = anthropic.Anthropic(base_url=small_server.base_url, api_key="unused", max_retries=0, timeout=120)
    long = dict(model=MODEL, max_tokens=60, messages=[{"role": "user", "content": "Count."}],
                extra_body={"temperature": 0, "ignore_eos": True})
    with tiny.messages.stream(**long) as running:
        next(iter(running))  # the engine is on it
        waiter = threading.Thread(target=lambda: tiny.messages.create(model=MODEL, max_tokens=2, messages=HELLO))
        waiter.start()
        deadline = time.monotonic() + 30
        while httpx.get(f"{small_server.base_url}/health").json()["queue_depth"] < 1:
            assert time.monotonic() < deadline, "the second request never queued"
            time.sleep(0.02)
        refused = httpx.post(f"{small_server.base_url}/v1/messages", json={"model": MODEL, "max_tokens": 2,
                                                                           "messages": HELLO})
    waiter.join(60)
    assert_anthropic_error(refused, 429, "rate_limit_error")
    assert int(refused.headers["retry-after"]) >= 1 and small_server.healthy()


def test_stream_starts_and_pings_while_the_engine_is_busy(server, claude):
    """Claude Code drops a stream that stays silent for 5 minutes: headers, message_start and a ping go out before
    the first token, while the engine is busy with another request."""
    busy = threading.Thread(target=lambda: claude.messages.create(
        model=MODEL, max_tokens=600, messages=HELLO, extra_body={"temperature": 0, "ignore_eos": True}))
    busy.start()
    time.sleep(1)
    events, start = [], time.monotonic()
    with httpx.stream("POST", f"{server.base_url}/v1/messages", headers={"x-api-key": API_KEY}, timeout=120,
                      json={"model": MODEL, "max_tokens": 4, "stream": True, "messages": HELLO}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("event: "):
                events.append((line[len("event: "):], time.monotonic() - start, busy.is_alive()))
    busy.join(120)
    assert events[0][0] == "message_start" and events[0][1] < 5 and events[0][2], events[:3]
    first_block = next(i for i, e in enumerate(events) if e[0] == "content_block_start")
    # The first ping goes out at once; keep-alive pings follow only while the request waits for a place in a full
    # batch (the engine runs this one beside the busy one, so it need not wait here).
    assert [e[0] for e in events[1:first_block]].count("ping") >= 1, events[:first_block]
    assert events[-1][0] == "message_stop"
