"""Response shapes from engine chunks: the streamed chunks and the whole response agree, every token's
log-probability is sent exactly once, usage counts tokens."""
import json

from fastdecode.engine.timings import Timings
from fastdecode.engine.llm import Completion, StreamChunk
from fastdecode.server.formats import HermesParser, ReplyFormat
from fastdecode.server.protocol import DONE, ChatFormatter, TextFormatter, sse


class CharTokenizer:
    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]


def engine_chunks(text: str, logprobs=True):
    """One chunk per character (token id = code point), then the last chunk with the Completion."""
    ids = [ord(c) for c in text]
    entries = [{"token_id": i, "logprob": -0.5, "top": [(i, -0.5)]} for i in ids]
    chunks = [StreamChunk(c, [i], [e] if logprobs else None) for c, i, e in zip(text, ids, entries)]
    done = Completion(text, ids, [1, 2, 3], "stop", Timings(3, len(ids), 0.1, 0.1, 0.2), None, entries)
    return chunks + [StreamChunk("", [], None, done)]


def run(fmt, chunks):
    out = fmt.start()
    for chunk in chunks:
        out += fmt.add(chunk)
    return out + fmt.finish(chunks[-1].completion, "done", 0.0)


def test_chat_stream_has_role_content_tool_call_finish_and_usage():
    text = 'Hi <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    fmt = ChatFormatter("m", CharTokenizer(), 3, True, True, reply=ReplyFormat(HermesParser, {"f": None}))
    chunks = run(fmt, engine_chunks(text))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "", "refusal": None}
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == "Hi "
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert calls[0]["function"] == {"name": "f", "arguments": ""} and calls[0]["id"].startswith("call_")
    assert json.loads(calls[1]["function"]["arguments"]) == {"x": 1}
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(text)
    assert all(c["usage"] is None for c in chunks[:-1]) and "fastdecode" in chunks[-1]
    sent = sum(len(c["choices"][0]["logprobs"]["content"]) for c in chunks
               if c["choices"] and c["choices"][0]["logprobs"])
    assert sent == len(text)


def test_chat_response_matches_the_stream():
    pieces = engine_chunks("Hello there")
    streamed = run(ChatFormatter("m", CharTokenizer(), 3, False, False), pieces)
    whole = ChatFormatter("m", CharTokenizer(), 3, False, False)
    for chunk in pieces:
        whole.add(chunk)
    body = whole.response(pieces[-1].completion, "done", 0.0)
    assert body["choices"][0]["message"]["content"] == "".join(
        c["choices"][0]["delta"].get("content") or "" for c in streamed)
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 11, "total_tokens": 14,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert streamed[-1]["fastdecode"]["output_tokens"] == 11 and "usage" not in streamed[-1]


def test_reasoning_streams_as_reasoning_content_and_joins_in_the_message():
    pieces = engine_chunks("<think>\nA plan.\n</think>\n\nThe answer.", logprobs=False)
    reply = ReplyFormat(reasoning="tags")
    streamed = run(ChatFormatter("m", CharTokenizer(), 3, False, False, reply=reply), pieces)
    deltas = [c["choices"][0]["delta"] for c in streamed if c["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "A plan."
    assert "".join(d.get("content") or "" for d in deltas) == "The answer."
    whole = ChatFormatter("m", CharTokenizer(), 3, False, False, reply=reply)
    for chunk in pieces:
        whole.add(chunk)
    message = whole.response(pieces[-1].completion, "done", 0.0)["choices"][0]["message"]
    assert message["reasoning_content"] == "A plan." and message["content"] == "The answer."


def test_cut_short_reply_finishes_with_length_and_counts_streamed_tokens():
    pieces = engine_chunks("abc")[:2]  # two tokens, then the time limit: no Completion
    fmt = TextFormatter("m", CharTokenizer(), 3, True, True)
    out = fmt.start() + [c for p in pieces for c in fmt.add(p)] + fmt.finish(None, "timeout", 0.5)
    assert out[-2]["choices"][0]["finish_reason"] == "length"
    assert out[-1]["usage"]["completion_tokens"] == 2 and out[-1]["fastdecode"]["timed_out"]
    assert [c["choices"][0]["logprobs"]["text_offset"] for c in out[:2]] == [[0], [1]]


def test_sse_lines():
    assert sse({"a": "é"}) == 'data: {"a":"é"}\n\n' and DONE == "data: [DONE]\n\n"
