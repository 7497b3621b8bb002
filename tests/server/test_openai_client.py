"""The official `openai` client against a real server: chat and text completions, sync and async, streamed and
not, usage, log-probabilities, stop strings, JSON mode, tools, and our speed figures."""
import asyncio
import json

import pytest

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m"
HELLO = [{"role": "user", "content": "Write a haiku about the sea."}]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_chat_completion_has_text_usage_and_speed(client):
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, temperature=0)
    choice = r.choices[0]
    assert r.object == "chat.completion" and choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    figures = r.model_extra["fastdecode"]
    assert figures["ttft_s"] > 0 and figures["output_tok_s"] > 0 and "queue_s" in figures


def test_max_completion_tokens_caps_the_reply(client):
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_completion_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_stream_is_role_then_content_then_finish_then_usage(client):
    stream = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1 and finishes[0].choices[0].finish_reason in ("stop", "length")
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens > 0 and "fastdecode" in last.model_extra
    assert all(c.usage is None for c in chunks[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    plain = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=10, temperature=0)
    assert text == plain.choices[0].message.content


def test_stream_without_usage_puts_speed_on_the_finish_chunk(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, temperature=0,
                                                 stream=True))
    assert chunks[-1].choices[0].finish_reason and "fastdecode" in chunks[-1].model_extra


def test_async_client_streams_and_answers(async_client):
    async def main():
        r = await async_client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, temperature=0)
        stream = await async_client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6,
                                                            temperature=0, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        return r.choices[0].message.content, text
    whole, streamed = asyncio.run(main())
    assert whole == streamed and whole


def test_text_completion_streamed_and_not(client):
    r = client.completions.create(model=MODEL, prompt="def fib(n):", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.usage.completion_tokens == 8
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="def fib(n):", max_tokens=8, temperature=0, stream=True) if c.choices)
    assert text == r.choices[0].text


def test_text_completion_echo_and_token_prompt(client):
    r = client.completions.create(model=MODEL, prompt="def fib(n):", max_tokens=4, temperature=0, echo=True)
    assert r.choices[0].text.startswith("def fib(n):")
    ids = client.completions.create(model=MODEL, prompt=[563, 28657], max_tokens=4, temperature=0)
    assert ids.usage.prompt_tokens == 2


def test_stop_string_ends_the_reply_without_it(client):
    base = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0)
    assert " 6" in base.choices[0].text
    r = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[" 6"])
    assert r.choices[0].finish_reason == "stop" and " 6" not in r.choices[0].text
    assert base.choices[0].text.startswith(r.choices[0].text)


def test_seed_makes_sampling_repeatable(client):
    kw = dict(model=MODEL, messages=HELLO, max_tokens=12, temperature=1.0, top_p=0.9, seed=1234)
    a, b = (client.chat.completions.create(**kw).choices[0].message.content for _ in range(2))
    assert a == b


def test_penalties_are_accepted(client):
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, temperature=0,
                                       presence_penalty=1.5, frequency_penalty=1.0)
    assert r.usage.completion_tokens > 0


def test_chat_logprobs_one_entry_per_token(client):
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
    assert "".join(e.token for e in content) == r.choices[0].message.content  # greedy: top-1 is the token


def test_text_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="def fib(n):", max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 5
    assert all(len(t) == 2 for t in lp.top_logprobs) and "".join(lp.tokens) == r.choices[0].text


def test_json_object_mode_gives_parseable_json(client):
    r = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=120, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Describe a cat as a JSON object with name and age."}])
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_json_mode_when_streamed_is_the_same_json(client):
    kw = dict(model=MODEL, temperature=0, max_tokens=120, response_format={"type": "json_object"},
              messages=[{"role": "user", "content": "Give a JSON object with the keys fruit and color for an apple."}])
    whole = client.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
                       if c.choices)
    assert streamed == whole and isinstance(json.loads(whole), dict)


def test_forced_tool_call_is_parsed_into_tool_calls(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER_TOOL, TIME_TOOL],
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       temperature=0, max_tokens=80)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert isinstance(json.loads(call.function.arguments), dict)


def test_required_tool_call_streams_as_tool_call_deltas(client):
    kw = dict(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required",
              parallel_tool_calls=False, temperature=0, max_tokens=80)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].id.startswith("call_") and deltas[0].type == "function"
    assert {d.index for d in deltas} == {0}
    name = "".join(d.function.name or "" for d in deltas)
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert name == whole[0].function.name and json.loads(arguments) == json.loads(whole[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_round_trip_is_accepted(client):
    """An agent's second turn: the assistant's call and the tool's result go back into the conversation."""
    messages = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 21, "sky": "clear"}'}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL], max_tokens=16,
                                       temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > 60  # the tools, the call and its result are in the prompt


def test_tool_choice_none_leaves_tools_out(client):
    with_none = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER_TOOL],
                                               tool_choice="none", max_tokens=4, temperature=0)
    plain = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=4, temperature=0)
    assert with_none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert with_none.choices[0].message.tool_calls is None


def test_content_parts_and_developer_role(client):
    r = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=[
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}])
    assert r.usage.completion_tokens > 0


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=HELLO, max_tokens=2)
    assert e.value.body["code"] == "model_not_found"


def test_prompt_over_context_is_400_with_the_numbers(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5000)
    assert "maximum context length is 2048 tokens (--max-seq-len raises it, up to the model's 8,192)" in e.value.message
    assert e.value.body["code"] == "context_length_exceeded"


def test_wrong_api_key_is_401(server):
    bad = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
