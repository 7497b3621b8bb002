"""Qwen3-Coder's XML calls: parsed whole or split anywhere, values typed by the tool's schema, malformed calls
left as text."""
import pytest

from fastdecode.server.formats import Qwen3CoderParser
from fastdecode.server.formats.qwen3_coder import typed
from tests.server.formats.replay import run_every_split

WRITE = {"type": "object", "properties": {
    "path": {"type": "string"}, "content": {"type": "string"}, "mode": {"type": "integer"},
    "ratio": {"type": "number"}, "force": {"type": "boolean"}, "tags": {"type": "array"},
    "meta": {"type": "object"}, "limit": {"type": ["integer", "null"]}}}
TOOLS = {"write_file": WRITE, "get_time": {"type": "object", "properties": {}}}
CALL = """I'll write it.
<tool_call>
<function=write_file>
<parameter=path>
src/ü.py
</parameter>
<parameter=content>
def f(a, b):
    return a < b and "</x>"

</parameter>
<parameter=mode>
644
</parameter>
<parameter=force>
True
</parameter>
<parameter=tags>
["a", 1]
</parameter>
</function>
</tool_call>"""


def parser():
    return Qwen3CoderParser(TOOLS)


def test_call_split_at_every_point_parses_the_same_with_typed_values():
    assert run_every_split(parser, CALL) == [("content", "I'll write it.\n"), ("tool_call", ("write_file", {
        "path": "src/ü.py", "content": 'def f(a, b):\n    return a < b and "</x>"\n', "mode": 644, "force": True,
        "tags": ["a", 1]}))]


def test_two_calls_and_a_bare_function_block():
    text = ("<tool_call>\n<function=get_time>\n</function>\n</tool_call>\n"
            "<function=write_file>\n<parameter=path>\na\n</parameter>\n</function>\n")
    assert run_every_split(parser, text) == [("tool_call", ("get_time", {})),
                                             ("tool_call", ("write_file", {"path": "a"}))]


@pytest.mark.parametrize("end", ["", "\n"])  # cut inside the value, or after the newline that ends it
def test_call_cut_by_the_end_of_the_reply_still_counts(end):
    text = "<tool_call>\n<function=write_file>\n<parameter=path>\nb.txt" + end
    assert run_every_split(parser, text) == [("tool_call", ("write_file", {"path": "b.txt"}))]


@pytest.mark.parametrize("text", [
    "<tool_call>\n<function=rm_rf>\n</function>\n</tool_call>",  # not a tool we offered
    "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>",  # JSON is not this format
    "<tool_call>\n<function=get_time>\nstray text\n</function>\n</tool_call>",  # text outside a parameter
    "x <function is a tag",  # looks like a marker, never becomes one
])
def test_malformed_call_is_content_unchanged(text):
    assert run_every_split(parser, text) == [("content", text)]


@pytest.mark.parametrize("value, schema, expected", [
    ("12", {"type": "integer"}, 12),
    ("1.5", {"type": "number"}, 1.5),
    ("2", {"type": "number"}, 2),
    ("1e3", {"type": "number"}, 1000.0),
    ("false", {"type": "boolean"}, False),
    ('{"a": [1]}', {"type": "object"}, {"a": [1]}),
    ("{'a': 1}", {"type": "object"}, {"a": 1}),  # a Python literal, as models sometimes write
    ("null", {"type": ["integer", "null"]}, None),
    ("7", {"type": ["integer", "null"]}, 7),
    ("12", {"type": "string"}, "12"),  # a string stays as written
    ("12", None, "12"),  # a parameter the schema does not name: a string
    ("twelve", {"type": "integer"}, "twelve"),  # not a number: kept as written
    ("maybe", {"type": "boolean"}, "maybe"),
    ("nan", {"type": "number"}, "nan"),  # JSON has no NaN
    ("[1, 2", {"type": "array"}, "[1, 2"),
])
def test_values_take_the_schemas_type(value, schema, expected):
    got = typed(value, schema)
    assert got == expected and type(got) is type(expected)


def test_a_bounded_value_that_spells_a_closing_tag_leaves_the_lexer_within_its_budget(smollm2_path):
    """A maxLength value intersected with the tags' exclusion ran out of llguidance's per-token lexer fuel once the
    value read "</parameter" (the request failed); the bound is now left to the tool."""
    from fastdecode.engine.grammar import GrammarCompiler, lark_grammar
    from fastdecode.loading import load_tokenizer

    tokenizer = load_tokenizer(smollm2_path)
    tools = {"search": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 200}},
                        "required": ["query"]}}
    matcher = GrammarCompiler(tokenizer).matcher(lark_grammar(Qwen3CoderParser.call_grammar(tools, forced=True)))
    text = "<tool_call>\n<function=search>\n<parameter=query>\n</parameter"
    for token in tokenizer.backend.encode(text, add_special_tokens=False).ids:
        matcher.compute_bitmask()
        assert not matcher.is_error(), matcher.get_error()
        assert matcher.consume_token(token)
    matcher.compute_bitmask()
    assert not matcher.is_error(), matcher.get_error()
