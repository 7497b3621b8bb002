"""Each format's call grammar against its own parser: random replies the grammar allows (tokens drawn from its mask,
seeded) must parse, every one, into calls to offered tools whose arguments the tool's schema accepts; forced replies
into calls only, a reply without a call into its text. And what the models write on their own, the grammar allows."""
import functools
import json
import math
import re

import jsonschema
import numpy as np
import pytest

from fastdecode.engine.grammar import GrammarCompiler, lark_grammar
from fastdecode.loading import load_tokenizer
from fastdecode.loading.catalog import cached_path
from fastdecode.server.formats import (
    HarmonyParser,
    HermesParser,
    Llama3Parser,
    MistralParser,
    Qwen3CoderParser,
    ReasoningParser,
    tool_format,
)
from fastdecode.server.formats.lark import vocabulary_tokens
from fastdecode.server.formats.reasoning import CLOSE as THINK_CLOSE
from fastdecode.server.formats.reasoning import OPEN as THINK_OPEN
from tests.helpers.chat_models import TEMPLATES, chat_model
from tests.server.formats.replay import run_every_split
from tests.server.formats.sampling import Vocabulary, sample

REPLIES = 100
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 24},
    "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "units": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}
EVENT = {"type": "object", "properties": {  # nested objects and arrays, every type; strict below
    "title": {"type": "string", "pattern": "^[A-Z]"},
    "when": {"type": "object", "properties": {"date": {"type": "string"}, "hour": {"type": "integer", "minimum": 0,
             "maximum": 23}}, "required": ["date"], "additionalProperties": False},
    "attendees": {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string"},
                  "optional": {"type": "boolean"}}, "required": ["name"], "additionalProperties": False},
                  "maxItems": 3},
    "priority": {"type": "integer", "enum": [1, 2, 3]},
    "score": {"type": "number"},
    "all_day": {"type": "boolean"}}, "required": ["title", "when"], "additionalProperties": False}
TOOL_SETS = {
    "one": {"get_weather": WEATHER},
    "mixed": {"get_weather": WEATHER, "create_event": EVENT, "get_time": {"type": "object", "properties": {}},
              "ping": None},
}
STRICT = frozenset({"create_event"})
NUMBER = re.compile(r"-?\d+(\.\d+)?[eE][+-]?\d+")


def checked_schema(case: str, schema: dict | None) -> dict:
    """What a call's arguments are held to: the tool's schema, except that Qwen3-Coder's free-text parameters leave
    minLength and maxLength to the tool (qwen3_coder.value_rules says why)."""
    if not schema:
        return {"type": "object"}
    if case != "qwen3_coder":
        return schema
    unbounded = {name: {k: v for k, v in spec.items() if k not in ("minLength", "maxLength")}
                 if spec.get("type") == "string" else spec for name, spec in schema.get("properties", {}).items()}
    return {**schema, "properties": unbounded}


def overflows(text: str) -> bool:
    """Does `text` hold a number past a double's range? llguidance's JSON allows one (`1E400`), the parsers refuse
    it (base.json_problem: no client reads it alike), so a call that holds one is text: the one gap between the
    grammars and the parsers, counted apart."""
    return any(math.isinf(float(m.group())) for m in NUMBER.finditer(text))


@functools.cache
def vocabulary(name: str) -> Vocabulary:
    return Vocabulary(load_tokenizer(cached_path("smollm2-135m") if name == "smollm2" else chat_model(name)))


# name: (parser, vocabulary, chat template, reasoning, the text every call holds, hints for the sampler)
CASES = {
    "hermes": (HermesParser, "qwen3", TEMPLATES["qwen3"], "tags", "<tool_call>", ("<tool_call>", "</tool_call>")),
    "hermes-smollm2": (HermesParser, "smollm2", "", None, "<tool_call>", ("<tool_call>", "</tool_call>")),
    "qwen3_coder": (Qwen3CoderParser, "qwen3_coder", TEMPLATES["qwen3_coder"], None, "<tool_call>",
                    ("<tool_call>", "\n</parameter>")),
    "harmony": (HarmonyParser, "harmony", TEMPLATES["harmony"], None, "to=functions.", ()),
    "mistral": (MistralParser, "mistral", TEMPLATES["mistral"], "inside", "[TOOL_CALLS]", ("[TOOL_CALLS]",)),
    "mistral-list": (MistralParser, "mistral", "", None, "[TOOL_CALLS]", ("[TOOL_CALLS]",)),
    "llama3": (Llama3Parser, "smollm2", "", None, '{"name": ', ("{",)),
}
MODES = {"forced": (True, False), "forced-parallel": (True, True), "auto": (False, True), "auto-single": (False, False)}


def matcher(case: str, tools, forced: bool, parallel: bool):
    parser, vocab, template, reasoning, *_ = CASES[case]
    tokenizer = vocabulary(vocab).tokenizer
    grammar = parser.call_grammar(tools, forced=forced, parallel=parallel, reasoning=reasoning, strict=STRICT,
                                  template=template, added_tokens=vocabulary_tokens(tokenizer))
    return GrammarCompiler(tokenizer).matcher(lark_grammar(grammar))


def parse(case: str, tools, text: str, rng) -> list:
    """The events of `text` fed in random pieces."""
    cls, _, _, reasoning, *_ = CASES[case]
    parser = cls(tools) if reasoning is None else ReasoningParser(cls(tools), inside=reasoning == "inside")
    events, at = [], 0
    while at < len(text):
        step = int(rng.integers(1, 9))
        events += parser.feed(text[at:at + step])
        at += step
    return events + parser.finish()


def answer_of(text: str, reasoning: str | None) -> str:
    """The part of a reply after its reasoning."""
    if reasoning == "inside" or reasoning == "tags" and text.lstrip().startswith(THINK_OPEN):
        return text.partition(THINK_CLOSE)[2]
    return text


@pytest.mark.parametrize("tool_set", TOOL_SETS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES)
def test_every_reply_the_grammar_allows_parses_into_valid_calls(case, mode, tool_set):
    forced, parallel = MODES[mode]
    tools = TOOL_SETS[tool_set]
    _, vocab, _, reasoning, call_marker, hints = CASES[case]
    words = vocabulary(vocab)
    start = matcher(case, tools, forced, parallel)
    rng = np.random.default_rng(sorted(CASES).index(case) * 100 + sorted(MODES).index(mode) * 10 + len(tools))
    finished, with_calls, overflowed = 0, 0, 0
    for _ in range(REPLIES):
        ids, ended = sample(start.deep_copy(), words, rng, max_tokens=256, hints=hints)
        if not ended:
            continue  # cut by the length cap: counted, not parsed
        finished += 1
        text = words.decode(ids)
        events = parse(case, tools, text, rng)
        calls = [value["function"] for kind, value in events if kind == "tool_call"]
        content = "".join(value for kind, value in events if kind == "content")
        if overflows(text):
            assert not any(overflows(call["arguments"]) for call in calls)
            overflowed += 1
            continue
        for call in calls:
            assert call["name"] in tools, text
            jsonschema.validate(json.loads(call["arguments"]), checked_schema(case, tools[call["name"]]))
        assert bool(calls) == (call_marker in answer_of(text, reasoning)) and call_marker not in content, (text, events)
        if forced:
            assert calls and not content.strip(), (text, events)
        if not parallel:
            assert len(calls) <= 1, (text, events)
        if not calls and case != "harmony":
            assert content.strip() == answer_of(text, reasoning).strip(), (text, events)
        with_calls += bool(calls)
    assert finished >= REPLIES * 0.8, f"{REPLIES - finished} of {REPLIES} replies ran past the cap"
    assert overflowed <= REPLIES * 0.1
    if not forced:
        assert 0 < with_calls < finished, f"{with_calls} of {finished} replies call a tool"


WEATHER_CALL = {"city": "Paris", "days": 3}
# (case, forced, parallel, what the model writes, as its template renders it or as it says it)
NATURAL = [
    ("hermes", False, True, 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                            '"days": 3}}\n</tool_call>'),
    ("hermes", True, True, '<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
                           '"arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
                           '"arguments": {}}\n</tool_call>'),
    ("hermes", False, True, "<think>\nA greeting.\n</think>\n\nHello!"),
    ("hermes-smollm2", True, False, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                                    '</tool_call>'),
    ("hermes-smollm2", False, True, "The weather in Paris is sunny, 21 C."),
    ("qwen3_coder", False, True, "I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                                 "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"),
    ("qwen3_coder", True, True, "<tool_call>\n<function=create_event>\n<parameter=title>\nStand-up\n</parameter>\n"
                                '<parameter=when>\n{"date": "2025-05-01", "hour": 9}\n</parameter>\n'
                                "<parameter=all_day>\nFalse\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
                                "<function=ping>\n</function>\n</tool_call>"),
    ("harmony", True, True, '<|channel|>analysis<|message|>User wants weather.<|end|><|start|>assistant'
                            '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                            '{"city":"Paris","days":3}<|call|>'),
    ("harmony", False, True, "<|channel|>analysis<|message|>Simple.<|end|><|start|>assistant<|channel|>final"
                             "<|message|>It is **4**.\n<|return|>"),
    ("mistral", False, True, 'Sure.\n</think>\n\n[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}'
                             '[TOOL_CALLS]get_time[ARGS]{}'),
    ("mistral-list", True, True, '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}, {"name": "get_weather", '
                                 '"arguments": {"city": "X"}}]'),
    ("mistral-list", True, True, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Y"}}]'),
    ("llama3", True, False, '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'),
    ("llama3", False, True, "It is sunny in Paris."),
]


@pytest.mark.parametrize("case, forced, parallel, text", NATURAL)
def test_what_the_models_write_is_what_their_grammar_allows(case, forced, parallel, text):
    words = vocabulary(CASES[case][1])
    m = matcher(case, TOOL_SETS["mixed"], forced, parallel)
    *ids, last = words.tokenizer.encode(text, add_special_tokens=False)
    if not words.eos[last]:  # what ends the reply: harmony's stop token, or end-of-sequence
        ids.append(last)
        last = int(np.flatnonzero(words.eos)[0])
    allowed = m.validate_tokens(ids)
    assert allowed == len(ids), f"refused after {words.tokenizer.decode(ids[:allowed])!r}"
    assert m.consume_tokens(ids) and m.consume_token(last), f"the reply cannot end here: {m.get_error()}"


def test_llama3_templates_choose_their_json_format():
    llama31 = """{{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its
value}.' }}"""
    assert tool_format(llama31) is Llama3Parser
    assert tool_format(TEMPLATES["qwen3"]) is HermesParser


@pytest.mark.parametrize("text", [
    'Call it: <tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',  # city is required
    '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',  # not an offered tool
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',  # a bare call the parser would read
    "Text, then <function=get_weather>",  # the other opener Hermes reads
])
def test_auto_grammar_refuses_a_call_that_would_not_parse_or_validate(text):
    tokenizer = vocabulary("qwen3").tokenizer
    ids = tokenizer.encode(text, add_special_tokens=False)
    m = matcher("hermes", TOOL_SETS["mixed"], forced=False, parallel=True)
    assert m.validate_tokens(ids) < len(ids)


def test_a_hermes_call_whose_arguments_hold_its_closing_marker_is_one_call():
    """The grammar lets a JSON string hold `</tool_call>` (an agent writing code about tool calls): the call ends
    at the marker after its JSON, streamed or not."""
    call = '<tool_call>\n{"name": "write", "arguments": {"text": "a </tool_call> b"}}\n</tool_call>'
    events = run_every_split(lambda: HermesParser({"write": None}), f"Writing. {call}\n{call}")
    assert events == [("content", "Writing. ")] + [("tool_call", ("write", {"text": "a </tool_call> b"}))] * 2


def test_markers_the_vocabulary_lacks_are_text_and_its_tokens_are_tokens():
    grammar = HermesParser.call_grammar({"f": None}, forced=True, added_tokens={"<tool_call>": 7})
    assert '<[7]> body' in grammar and '"</tool_call>"' in grammar
    assert "[TOOL_CALLS]" not in MistralParser.call_grammar({"f": None}, forced=True,
                                                           added_tokens={"[TOOL_CALLS]": 3})


def test_a_call_grammar_needs_a_tool():
    for parser in (HermesParser, Qwen3CoderParser, HarmonyParser, MistralParser, Llama3Parser):
        with pytest.raises(ValueError):
            parser.call_grammar({}, forced=True)
